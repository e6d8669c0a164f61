"""What the supervisor (app.engine.worker.WorkerEngine) and its model process say over the pipe: one frozen
dataclass per message, matched by type. `rid` ties a reply to its request (0: the process itself). Exceptions
cross the pipe packed (`pack_exc`) and are rebuilt with their type on the other side (`unpack_exc`)."""

from __future__ import annotations

import importlib
import pickle
import traceback
from dataclasses import dataclass, field

from backends.base import BackendError


@dataclass(frozen=True)
class PipeMessage:
    rid: int


# -- supervisor -> model process ------------------------------------------------------------------------
@dataclass(frozen=True)
class Call(PipeMessage):
    """Run `Engine.<name>(*args, **kwargs)`; answered by Result or Failed (and LoadProgress for a swap)."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Open(PipeMessage):
    """Open a stream (`generate` / `chat`): validated at once (Opened or Failed), run after Go."""

    name: str
    args: tuple = ()


@dataclass(frozen=True)
class Go(PipeMessage):
    """Start (or continue) the opened stream."""


@dataclass(frozen=True)
class Cancel(PipeMessage):
    """The user stopped the answer: finish it as cancelled."""


@dataclass(frozen=True)
class Drop(PipeMessage):
    """The supervisor closed the stream: stop at the next step, or never start."""


@dataclass(frozen=True)
class Close(PipeMessage):
    """Exit the model process."""


# -- model process -> supervisor ------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready(PipeMessage):
    """The models are loaded; `state` describes them (specs, n_ctx, tokenizer attributes, ...)."""

    state: dict


@dataclass(frozen=True)
class LoadFailed(PipeMessage):
    """Loading the models failed; `error` is a packed exception (pack_exc)."""

    error: tuple


@dataclass(frozen=True)
class LoadProgress(PipeMessage):
    """A swap's progress callback, forwarded."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Result(PipeMessage):
    value: object = None


@dataclass(frozen=True)
class Failed(PipeMessage):
    """The call or stream raised; `error` is a packed exception, rebuilt with its type in the supervisor."""

    error: tuple


@dataclass(frozen=True)
class Opened(PipeMessage):
    pass


@dataclass(frozen=True)
class Streamed(PipeMessage):
    """One engine Event of an open stream."""

    event: object


@dataclass(frozen=True)
class End(PipeMessage):
    """The stream finished."""


# -- the supervisor's own, never sent: the process died or hung --------------------------------------------
@dataclass(frozen=True)
class Lost(PipeMessage):
    why: str


# -- exceptions across the pipe -----------------------------------------------------------------------------
def pack_exc(e: BaseException) -> tuple:
    """(module, qualname, args, attributes, traceback text): rebuilt in the parent without calling __init__
    (PromptTooLong's takes keyword-only numbers, so plain unpickling would fail)."""
    def ok(v) -> bool:
        try:
            pickle.dumps(v)
            return True
        except Exception:
            return False

    args = tuple(a if ok(a) else repr(a) for a in e.args)
    attrs = {k: v for k, v in vars(e).items() if ok(v)} if hasattr(e, "__dict__") else {}
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return type(e).__module__, type(e).__qualname__, args, attrs, tb


def unpack_exc(packed: tuple) -> BaseException:
    module, qualname, args, attrs, tb = packed
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise TypeError(qualname)
        e = cls.__new__(cls)
        Exception.__init__(e, *args)
        e.__dict__.update(attrs)
    except Exception:  # a type the parent cannot import: keep its name in the message
        e = BackendError(f"{qualname}: {args[0] if args else ''}")
    e.add_note(f"raised in the model process:\n{tb}")
    return e

