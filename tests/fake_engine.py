"""A fake engine with the real Engine's interface, for UI tests: no model, deterministic, fast.

It streams the answer word by word: first with live_beams = W while the beams "disagree", then a
done event whose stats come from the real Metrics class (same keys as the engine's). DSBD modes carry
a small forest. A prompt longer than n_ctx words raises the real PromptTooLong.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

from app.engine.auto import AutoPolicy, describe
from app.config import BEAM_MODES, ConfigError, DecodeParams
from app.decoding.metrics import LayerStats, Metrics
from app.engine.engine import Event, PromptTooLong


class FakeTokenizer:
    """Token id i <-> the i-th word of a tiny vocabulary."""

    words = ["The", " beam", " forest", " says", " hello", " world", ".", " and", " then", "\n"]

    def decode(self, ids) -> bytes:
        return "".join(self.words[i % len(self.words)] for i in ids).encode()

    def encode(self, text: str, **_) -> list[int]:
        """One token per word (what the fake engine's context counts)."""
        return [0] * len(text.split())


class FakeEngine:
    """Engine stand-in: `chat(messages, params, cancel=)` -> Iterator[Event]; `swap(target, draft)`."""

    def __init__(self, *, n_ctx: int = 200, delay: float = 0.0, answer_words: int = 12, draft: bool = True) -> None:
        self.n_ctx, self.delay, self.answer_words, self.has_draft = n_ctx, delay, answer_words, draft
        self.tokenizer = FakeTokenizer()
        self.lock = threading.Lock()
        self.calls: list[tuple[list[dict], DecodeParams]] = []
        self.fail_with: Exception | None = None  # raise this from the next chat() call
        self.swap_fails_with: Exception | None = None  # raise this from the next swap() call
        self.specs = (None, None)  # (target, draft) ModelSpecs, set by swap()
        self.names = ("fake-target", "fake-draft")
        self.backends = ("fake", "fake")
        # auto mode: fixed pass costs instead of timing (the README's qwen-coder ones on a 2-core CPU)
        self.policy = AutoPolicy.from_costs({1: 0.080, 8: 0.25, 64: 1.0}, {1: 0.045, 8: 0.11, 64: 0.76})
        self.observed: list[tuple[DecodeParams, dict]] = []
        self.loaded = True  # False after unload(): requests raise NoModelLoaded
        self.load_steps, self.step_s = 1, 0.0  # swap(): progress reports per model and the pause between them

    def describe(self) -> dict:
        self._require()
        d = {"target": self.names[0], "target_backend": self.backends[0], "n_ctx": self.n_ctx}
        return d | ({"draft": self.names[1], "draft_backend": self.backends[1]} if self.has_draft else {})

    def swap(self, target, draft=None, *, progress=None, cancel=None) -> dict:
        """Pretend to load: the names become the specs' sources; `swap_fails_with` fails it, keeping the old.
        `load_steps` seconds per stage (cancellable between them, as the real engine's reports are)."""
        from backends.load_progress import LoadCancelled, LoadStep

        target, draft = target.validated(), draft.validated() if draft is not None else None
        for role, spec in (("target", target), ("draft", draft)):
            if spec is None:
                continue
            for i in range(self.load_steps + 1):
                if progress is not None:
                    progress(LoadStep("load", role, i / max(self.load_steps, 1), spec.source))
                if cancel is not None and cancel.is_set():
                    raise LoadCancelled(f"cancelled while {role}: loading the weights; the models that were "
                                        "serving still serve")
                if i < self.load_steps:
                    time.sleep(self.step_s)
        if progress is not None:
            progress(LoadStep("check", None, 0.0))
        if self.swap_fails_with is not None:  # as a vocabulary check would fail, after both loaded
            err, self.swap_fails_with = self.swap_fails_with, None
            raise err
        with self.lock:
            self.specs, self.has_draft = (target, draft), draft is not None
            self.names = (target.source, draft.source if draft else None)
            self.backends = (target.backend, draft.backend if draft else None)
            self.loaded = True
        if progress is not None:
            progress(LoadStep("switch", None, 1.0))
        return self.describe()

    def unload(self, role: str = "all") -> dict | None:
        self._require()
        with self.lock:
            if role == "draft":
                self.has_draft, self.specs = False, (self.specs[0], None)
            else:
                self.loaded, self.specs, self.has_draft = False, (None, None), False
        return self.describe() if role == "draft" else None

    def _require(self) -> None:
        if not self.loaded:
            from app.engine.interface import NoModelLoaded

            raise NoModelLoaded()

    def encode(self, messages: list[dict]) -> list[int]:
        """The prompt as chat() counts it: a token per word plus two per message."""
        return [0] * sum(len(m["content"].split()) + 2 for m in messages)

    def check_params(self, params: DecodeParams) -> DecodeParams:
        self._require()
        params = params.validated()
        if params.needs_draft and not self.has_draft:
            raise ConfigError(f"mode {params.mode!r} needs a draft model")
        return params

    def chat(self, messages: list[dict], params: DecodeParams, *,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        params = self.check_params(params)  # NoModelLoaded once unloaded
        if self.fail_with is not None:
            err, self.fail_with = self.fail_with, None
            raise err
        prompt = sum(len(m["content"].split()) + 2 for m in messages)
        if prompt + params.max_new_tokens > self.n_ctx:
            raise PromptTooLong(prompt=prompt, max_new=params.max_new_tokens, tree=0, n_ctx=self.n_ctx)
        self.calls.append((messages, params))
        auto = None
        if params.mode == "auto":
            chosen = self.policy.choose(params, params.quality)
            auto = {"quality": params.quality, "setting": describe(chosen),
                    "projected_tokens_per_s": self.policy.projected_tps(chosen)}
            params = chosen
        return self._run(messages, params, cancel, len(self.calls), auto)

    def observe(self, params: DecodeParams, stats: dict) -> None:
        self.observed.append((params, stats))
        self.policy.observe(params, stats)

    def _run(self, messages, params, cancel, call_no, auto=None) -> Iterator[Event]:
        with self.lock:
            last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            words = [f"Answer {call_no} to {last_user.split()[0]}:"] + \
                [f"w{i}" for i in range(min(self.answer_words, params.max_new_tokens) - 1)]
            m = Metrics(mode=params.mode, prompt_tokens=len(messages))
            m.mark_prefilled()
            w = params.beams if params.mode in BEAM_MODES else 1
            dsbd = params.mode in ("dsbd", "dsbd-mem")
            for i in range(1, len(words) + 1):
                if cancel is not None and cancel.is_set():
                    m.finish_reason = "cancelled"
                    yield self._done(m, words[:i - 1])
                    return
                m.mark_first_token()
                m.target_passes += 1
                m.steps.append(1 + (i % 2 if dsbd else 0))
                if dsbd:
                    m.widths.append(1 + i % w)
                    for d in (1, 2):
                        st = m.layers.setdefault(d, LayerStats())
                        st.tested += 2
                        st.accepted += 2 if d == 1 else i % 2
                m.track_kv(_KV(1000 * i * w), _KV(300 * i) if params.needs_draft else None)
                final = words[:max(0, i - 2)] if w > 1 else words[:i]  # beams disagree on the newest words
                live = w if w > 1 and i < len(words) else 1
                yield Event(text=" ".join(final), tokens=len(final), live_beams=live,
                            forest=_forest(i, w) if dsbd else None)
                if self.delay:
                    time.sleep(self.delay)
            m.finish_reason = "stop"
            m.score = -0.5 * len(words)
            done = self._done(m, words)
            self.observe(params, done.stats)
            if auto:
                done.stats["auto"] = auto
            yield done

    @staticmethod
    def _done(m: Metrics, words: list[str]) -> Event:
        m.t_end = time.perf_counter()
        m.new_tokens = len(words)
        text, segments, stats = " ".join(words), None, m.as_dict()
        if m.mode in ("sps", "dsbd", "dsbd-mem") and words:  # every other word "from the draft"
            segments = [(w if i == 0 else " " + w, i % 2 == 0) for i, w in enumerate(words)]
            stats["draft_tokens"] = (len(words) + 1) // 2
        return Event(text=text, tokens=len(words), live_beams=0, done=True, stats=stats, segments=segments)


class _KV:
    def __init__(self, n: int) -> None:
        self.n = n

    def kv_bytes(self) -> int:
        return self.n


def _forest(i: int, w: int) -> dict:
    ws = w + 1
    layer1 = [{"parent": j % w, "token": (i + j) % 10, "status": "accepted" if j < w else "rejected"}
              for j in range(ws)]
    layer2 = [{"parent": j % w, "token": (i + 2 * j) % 10, "status": "accepted" if j == 0 else "auto-rejected"}
              for j in range(ws)]
    return {"gamma": 2, "layers": [{"width": w, "passed": True, "nodes": layer1, "corrections": []},
                                   {"width": 1, "passed": False, "nodes": layer2, "corrections": [7]}]}


__all__ = ["FakeEngine", "FakeTokenizer"]
