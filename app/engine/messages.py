"""What the supervisor (app.engine.worker.WorkerEngine) and its model process say over the pipe: one frozen
dataclass per message, matched by type. `rid` ties a reply to its request (0: the process itself)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Message:
    rid: int


# -- supervisor -> model process ------------------------------------------------------------------------
@dataclass(frozen=True)
class Call(Message):
    """Run `Engine.<name>(*args, **kwargs)`; answered by Result or Failed (and Progress for a swap)."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Open(Message):
    """Open a stream (`generate` / `chat`): validated at once (Opened or Failed), run after Go."""

    name: str
    args: tuple = ()


@dataclass(frozen=True)
class Go(Message):
    """Start (or continue) the opened stream."""


@dataclass(frozen=True)
class Cancel(Message):
    """The user stopped the answer: finish it as cancelled."""


@dataclass(frozen=True)
class Drop(Message):
    """The supervisor closed the stream: stop at the next step, or never start."""


@dataclass(frozen=True)
class Close(Message):
    """Exit the model process."""


# -- model process -> supervisor ------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Message):
    """The models are loaded; `state` describes them (specs, n_ctx, tokenizer attributes, ...)."""

    state: dict


@dataclass(frozen=True)
class LoadFailed(Message):
    """Loading the models failed; `error` is a packed exception (worker._pack_exc)."""

    error: tuple


@dataclass(frozen=True)
class Progress(Message):
    """A swap's progress callback, forwarded."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Result(Message):
    value: object = None


@dataclass(frozen=True)
class Failed(Message):
    """The call or stream raised; `error` is a packed exception, rebuilt with its type in the supervisor."""

    error: tuple


@dataclass(frozen=True)
class Opened(Message):
    pass


@dataclass(frozen=True)
class Streamed(Message):
    """One engine Event of an open stream."""

    event: object


@dataclass(frozen=True)
class End(Message):
    """The stream finished."""


# -- the supervisor's own, never sent: the process died or hung --------------------------------------------
@dataclass(frozen=True)
class Lost(Message):
    why: str
