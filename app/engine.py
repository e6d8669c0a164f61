"""The engine: owns the loaded models and their KV contexts, runs one generation at a time, streams events.

Decoders yield token-level `Step`s; the engine turns them into text events, enforces the context
limit (never truncating silently), and honours a per-request cancel event.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from backends.base import BackendError, ContextFull

from .chat import encode_chat
from .config import ConfigError, DecodeParams, ModelSpec
from .decoding import decoder, derive_seed
from .decoding.beams import Stopper
from .decoding.metrics import Metrics


class PromptTooLong(ConfigError):
    """The prompt plus the answer budget exceed the context window."""

    def __init__(self, *, prompt: int, max_new: int, tree: int, n_ctx: int) -> None:
        room = n_ctx - prompt - tree
        hint = (f"lower max tokens to {room} or less, or " if room > 0 else "") + \
            "shorten the conversation (drop the oldest turns) or load the models with a larger context"
        super().__init__(f"prompt is {prompt} tokens; with max_new_tokens={max_new} and the draft tree "
                         f"({tree}) it needs {prompt + max_new + tree} of the {n_ctx}-token context: {hint}")
        self.prompt, self.max_new, self.n_ctx, self.room = prompt, max_new, n_ctx, room


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


class Engine:
    """Loaded target (+ draft) and their contexts; thread-safe with one generation at a time."""

    specs: tuple[ModelSpec | None, ModelSpec | None] = (None, None)  # (target, draft) as loaded; for the UI

    def __init__(self, target, draft=None, *, n_ctx: int = 4096) -> None:
        self.target, self.draft = target, draft
        self.n_ctx = min(n_ctx, target.info.n_ctx_train or n_ctx)
        self.tokenizer = target.tokenizer
        self._ctx: dict[str, tuple[int, object, int]] = {}  # role -> (rows, context, KV cells)
        self.lock = threading.Lock()
        if draft is not None:
            from backends.tokenizer import check_compatible

            check_compatible(draft.tokenizer, target.tokenizer)

    @classmethod
    def load(cls, target: ModelSpec, draft: ModelSpec | None = None) -> "Engine":
        from backends.registry import load_model

        t = load_model(target.validated(), role="target")
        d = None
        try:
            d = load_model(draft.validated(), role="draft") if draft is not None else None
            engine = cls(t, d, n_ctx=target.n_ctx)
        except BaseException:
            for m in (d, t):
                if m is not None:
                    m.close()
            raise
        engine.specs = (target, draft)
        return engine

    def swap(self, target: ModelSpec, draft: ModelSpec | None = None, *, progress=None) -> dict:
        """Replace the models; returns describe(). On any failure the old models stay loaded and serving.

        New models load beside the old ones, outside the lock, so answers keep streaming meanwhile; a spec
        equal to the one already serving that role is kept, not reloaded. Only the switch itself waits
        for the running generation. `progress(fraction, desc=...)` (a gr.Progress fits) hears each step.
        """
        from backends.registry import load_model

        note = progress or (lambda *a, **k: None)
        target = target.validated()
        draft = draft.validated() if draft is not None else None
        fresh = []  # loaded by this call: closed again if anything fails
        try:
            models = []
            for i, (role, spec) in enumerate((("target", target), ("draft", draft))):
                m = self._serving(role, spec)
                if m is None and spec is not None:
                    note(i / 2, desc=f"loading {role} {spec.source} ({spec.backend})")
                    m = load_model(spec, role=role)
                    fresh.append(m)
                models.append(m)
            note(0.95, desc="checking vocabularies")
            staged = type(self)(*models, n_ctx=target.n_ctx)  # the same checks and n_ctx as at startup
            note(0.97, desc="switching (waits for the running answer)")
        except BaseException:
            for m in fresh:
                m.close()
            raise
        keep = {id(m) for m in models}
        with self.lock:
            stale = [ctx for _, ctx, _ in self._ctx.values()]
            old = {id(m): m for m in (self.target, self.draft) if m is not None and id(m) not in keep}
            # The new state first, so a failing close below cannot leave the engine half switched.
            self._ctx.clear()
            self.target, self.draft = staged.target, staged.draft
            self.n_ctx, self.tokenizer, self.specs = staged.n_ctx, staged.tokenizer, (target, draft)
            for ctx in stale:
                ctx.close()
            for m in old.values():
                m.close()
        return self.describe()

    def _serving(self, role: str, spec: ModelSpec | None):
        """The model now serving `role` if it was loaded from `spec` (None: load it, or no such role)."""
        i = 0 if role == "target" else 1
        return (self.target, self.draft)[i] if spec is not None and self.specs[i] == spec else None

    def close(self) -> None:
        for _, ctx, _ in self._ctx.values():
            ctx.close()
        self._ctx.clear()
        for m in {id(self.target): self.target, id(self.draft): self.draft}.values():
            if m is not None:
                m.close()

    def describe(self) -> dict:
        d = {"target": self.target.info.name, "target_backend": self.target.info.backend, "n_ctx": self.n_ctx}
        if self.draft is not None:
            d |= {"draft": self.draft.info.name, "draft_backend": self.draft.info.backend}
        return d

    # -- contexts ------------------------------------------------------------------------------
    def _context(self, role: str, rows: int, cells: int):
        """A context with >= rows rows; llama.cpp's unified cache also needs >= cells KV cells in all."""
        model = self.target if role == "target" else self.draft
        unified = model.info.backend == "llamacpp"
        size = max(self.n_ctx, -(-cells // 512) * 512) if unified else self.n_ctx
        have = self._ctx.get(role)
        if have is not None and have[0] >= rows and have[2] >= size:
            return have[1]
        if have is not None:
            have[1].close()
        ctx = model.context(rows=rows, max_tokens=size)
        self._ctx[role] = (rows, ctx, size)
        return ctx

    # -- generation ----------------------------------------------------------------------------
    def check_params(self, params: DecodeParams) -> DecodeParams:
        params = params.validated()
        if params.needs_draft and self.draft is None:
            raise ConfigError(f"mode {params.mode!r} needs a draft model: load one (--draft) or pick "
                              "greedy / sample / beam / beam-sample / beam-sample-repl")
        return params

    def encode(self, messages: list[dict]) -> list[int]:
        return encode_chat(messages, self.tokenizer)

    def generate(self, prompt: Sequence[int], params: DecodeParams, *,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream one completion of `prompt` (token ids). Raises ConfigError before any work."""
        params = self.check_params(params)
        prompt = list(prompt)
        if not prompt:
            raise ConfigError("the prompt is empty")
        tree = params.draft_beams * params.gamma + 1 if params.needs_draft else 1
        if len(prompt) + params.max_new_tokens + tree > self.n_ctx:
            raise PromptTooLong(prompt=len(prompt), max_new=params.max_new_tokens, tree=tree, n_ctx=self.n_ctx)
        return self._run(prompt, params, cancel, self.target)

    def _run(self, prompt, params, cancel, encoded_for) -> Iterator[Event]:
        memory = params.mode in ("dsbd-mem", "greedy", "sample", "sps")
        rows = 1 if memory else params.beams
        # Rows of a unified cache share the prompt but each holds its own answer (worst case).
        tree = params.draft_beams * params.gamma + 1 if params.needs_draft else 1
        cells = len(prompt) + rows * params.max_new_tokens + tree
        with self.lock:
            if cancel is not None and cancel.is_set():  # cancelled while waiting for the lock
                yield Event(text="", tokens=0, live_beams=0, done=True,
                            stats={"mode": params.mode, "finish_reason": "cancelled", "new_tokens": 0})
                return
            if self.target is not encoded_for:  # a model swap went through while this request waited
                raise BackendError("the models changed while this request waited; send it again")
            target = self._context("target", rows, cells)
            draft = self._context("draft", rows, cells) if params.needs_draft else None
            tok = self.tokenizer
            stopper = Stopper(eos_ids=tok.eos_ids, stop=params.stop, decode=tok.decode)
            metrics = Metrics(mode=params.mode, prompt_tokens=len(prompt))
            steps = decoder(params.mode)(target=target, draft=draft, prompt=prompt, params=params,
                                         stopper=stopper, metrics=metrics, vocab=self.target.info.vocab_size)
            try:
                for step in steps:
                    if cancel is not None and cancel.is_set() and not step.done:
                        metrics.finish_reason = "cancelled"
                        text = stopper.visible_text(step.final, final=True)
                        yield Event(text=text, tokens=len(step.final), live_beams=0, done=True,
                                    stats=self._stats(metrics, step.final, None))
                        return
                    text = stopper.visible_text(step.final, final=step.done)
                    if step.done:
                        yield Event(text=text, tokens=len(step.output.tokens), live_beams=0, done=True,
                                    stats=self._stats(metrics, step.output.tokens, step.output.score),
                                    forest=step.forest)
                        return
                    yield Event(text=text, tokens=len(step.final), live_beams=step.live, forest=step.forest)
            except ContextFull as e:
                raise BackendError(f"the context filled up during generation: {e}") from e
            finally:
                steps.close()  # the decoder's own cleanup; the next prefill drops any pending forest

    @staticmethod
    def _stats(metrics: Metrics, tokens, score) -> dict:
        metrics.t_end = time.perf_counter()
        metrics.new_tokens = len(tokens)
        if score is not None:
            metrics.score = score
        return metrics.as_dict()

    def chat(self, messages: list[dict], params: DecodeParams, *,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        return self.generate(self.encode(messages), params, cancel=cancel)

    def complete(self, prompt: Sequence[int], params: DecodeParams, *, n: int = 1) -> list[dict]:
        """N independent completions (derived seeds), each {text, tokens, stats}."""
        out = []
        for i in range(n):
            p = replace(params, seed=derive_seed(params.seed, i)) if n > 1 else params
            last = None
            for last in self.generate(prompt, p):
                pass
            out.append({"text": last.text, "tokens": last.tokens, "stats": last.stats})
        return out
