"""The one engine interface the edges (CLI, API, UI, compare) program against, its events and typed errors.

`Engine` runs the models in this process; `WorkerEngine` runs an `Engine` in a supervised child and forwards
the same calls. Both subclass `ModelEngine`, so an edge never knows which one it holds.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from app.config import ConfigError, DecodeParams
from backends.base import BackendError

if TYPE_CHECKING:
    from backends.registry import ModelSpec


@dataclass(frozen=True)
class Event:
    """What a client sees: the stable text so far, then the final text and stats."""

    text: str
    tokens: int  # tokens final so far
    live_beams: int  # > 1: "deciding between N beams"
    done: bool = False
    stats: dict | None = None
    forest: dict | None = None
    error: str | None = None
    notice: str | None = None  # the engine changed the request to fit memory (first and last event)
    segments: list | None = None  # last event of a drafted mode: [(text, from the draft?)] covering `text`


class PromptTooLong(ConfigError):
    """The prompt plus the answer budget exceed the context window."""

    def __init__(self, *, prompt: int, max_new: int, tree: int, n_ctx: int) -> None:
        room = n_ctx - prompt - tree
        hint = (f"lower max tokens to {room} or less, or " if room > 0 else "") + \
            "shorten the conversation (drop the oldest turns) or load the models with a larger context"
        super().__init__(f"prompt is {prompt} tokens; with max_new_tokens={max_new} and the draft tree "
                         f"({tree}) it needs {prompt + max_new + tree} of the {n_ctx}-token context: {hint}")
        self.prompt, self.max_new, self.n_ctx, self.room = prompt, max_new, n_ctx, room


class ModelProcessLost(BackendError):
    """The supervised model process died or hung during the request; it restarts with the same models."""


class NoModelLoaded(BackendError):
    """The models were unloaded (Models tab): nothing answers until models are loaded again."""

    def __init__(self, message: str | None = None) -> None:
        from app.config import MODE_FACTS

        drafted = ", ".join(m for m, f in MODE_FACTS.items() if f.concrete and f.needs_draft)
        super().__init__(message or f"no model is loaded: load a target (and a draft for {drafted}) in the Models "
                                    "tab, or start dsbd-chat with --preset / --target")


class ModelEngine(ABC):
    """Loaded target (+ draft): one generation at a time, streamed as `Event`s."""

    specs: tuple[ModelSpec | None, ModelSpec | None]  # (target, draft) as loaded
    plan: object  # offload.plan.Plan the models were loaded with (None: not planned)
    n_ctx: int
    tokenizer: object  # backends.base.Tokenizer (or the worker's stand-in)

    @classmethod
    @abstractmethod
    def load(cls, target: ModelSpec, draft: ModelSpec | None = None, *, budget=None,
             profile: str = "timed") -> "ModelEngine":
        """Plan memory, then load both models as planned (PlanError before any weights are read); price adaptive
        forests with cost profile `profile`."""

    @abstractmethod
    def swap(self, target: ModelSpec, draft: ModelSpec | None = None, *, progress=None,
             cancel: threading.Event | None = None) -> dict:
        """Replace the models; returns describe(). On failure (LoadCancelled when `cancel` was set) the old
        models keep serving. `progress(backends.load_progress.LoadStep)` hears each stage of the load."""

    def unload(self, role: str = "all") -> dict | None:
        """Free the draft ("draft": the target keeps serving; returns describe()) or both models ("all": every
        request then raises NoModelLoaded until a swap loads models again; returns None). Waits for a running
        answer."""
        if role == "draft":
            target, _ = self.specs
            if target is None:
                raise NoModelLoaded()
            return self.swap(target, None)
        if role != "all":
            raise ConfigError(f"unload takes 'draft' or 'all', got {role!r}")
        self._unload_all()
        return None

    @abstractmethod
    def _unload_all(self) -> None:
        """Free both models."""

    @abstractmethod
    def describe(self) -> dict:
        """Names, runtimes and context of the loaded models."""

    @abstractmethod
    def check_params(self, params: DecodeParams) -> DecodeParams:
        """Validated params as they would run (ConfigError says why not)."""

    @abstractmethod
    def resolve(self, params: DecodeParams) -> tuple[DecodeParams, str | None]:
        """Validated concrete params, switched to fit the memory plan, and a notice when switched."""

    @abstractmethod
    def pick(self, params: DecodeParams) -> tuple[DecodeParams, dict]:
        """Auto mode's choice for params.quality, and what it was based on."""

    @abstractmethod
    def costs(self) -> tuple:
        """(target, draft) pass-cost curves, timed on first use (or the cost profile's)."""

    def prepare(self) -> None:
        """Make what the next answers reuse (the runtime's contexts) now, so the first answer after a load does
        not wait for it; waits for a running answer. Engines with nothing to prepare do nothing."""

    @abstractmethod
    def use_cost_profile(self, name: str) -> dict:
        """Price adaptive forests and auto with a named cost profile ("timed": this machine's); returns
        describe()."""

    @abstractmethod
    def observe(self, params: DecodeParams, stats: dict) -> None:
        """Learn from a finished answer (auto's estimates)."""

    @abstractmethod
    def encode(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt token ids (the model's template)."""

    def remember_chats(self, chats: Sequence[list[dict]]) -> None:
        """Saved chats (each its messages, newest chat first) whose text the `match` source may continue in
        later answers (the cross-chat index); an engine without that index ignores them."""

    @abstractmethod
    def generate(self, prompt: Sequence[int], params: DecodeParams, *,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream one completion of `prompt`; raises ConfigError / PromptTooLong before any work."""

    def chat(self, messages: list[dict], params: DecodeParams, *,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        return self.generate(self.encode(messages), params, cancel=cancel)

    @abstractmethod
    def complete(self, prompt: Sequence[int], params: DecodeParams, *, n: int = 1) -> list[dict]:
        """N independent completions (derived seeds), each {text, tokens, stats}."""

    @abstractmethod
    def close(self) -> None:
        """Free the models (and the model process)."""
