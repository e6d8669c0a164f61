"""Per-generation metrics (spec §12): passes, acceptance per depth, widths, speed, memory, quality."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class LayerStats:
    attempted: int = 0
    passed: int = 0
    tested: int = 0
    accepted: int = 0
    auto_rejected: int = 0  # drafts whose parent was rejected or finished
    untested: int = 0
    passed_by_cache: int = 0  # passed although the drafts alone did not fill it: every output was a node (§16.2)
    cache_hits: int = 0  # correction / fill outputs that landed on a forest node
    lookup_nodes: int = 0
    lookup_hits: int = 0


@dataclass
class Metrics:
    mode: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    iterations: int = 0
    steps: list[int] = field(default_factory=list)  # beam steps advanced per target pass
    widths: list[int] = field(default_factory=list)  # W_L chosen per verified layer
    carried: list[int] = field(default_factory=list)  # live beams at each iteration boundary
    forests: list[tuple[int, int]] = field(default_factory=list)  # DSBD: (gamma, W_S) run per iteration
    forest_policy: str | None = None  # DSBD: "fixed" or "adaptive" (cost-aware gamma / W_S per iteration)
    layers: dict[int, LayerStats] = field(default_factory=dict)
    peak_kv_target: int = 0
    peak_kv_draft: int = 0
    score: float | None = None  # s(returned) under the raw target
    finish_reason: str = ""
    t_start: float = field(default_factory=time.perf_counter)
    t_prefill: float | None = None
    t_first: float | None = None
    t_end: float | None = None

    phase_s: dict[str, float] = field(default_factory=dict)  # DSBD: seconds per phase of the iteration
    # DSBD: lookup nodes per source (draft, match, recycled) -> [nodes, nodes an output landed on]
    sources: dict[str, list[int]] = field(default_factory=dict)

    def lookup_source(self, source: str, *, hit: bool) -> None:
        row = self.sources.setdefault(source, [0, 0])
        row[0] += 1
        row[1] += int(hit)

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t0

    def layer(self, depth: int) -> LayerStats:
        return self.layers.setdefault(depth, LayerStats())

    def mark_prefilled(self) -> None:
        self.t_prefill = time.perf_counter()

    def mark_first_token(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def track_kv(self, target, draft=None) -> None:
        self.peak_kv_target = max(self.peak_kv_target, target.kv_bytes())
        if draft is not None:
            self.peak_kv_draft = max(self.peak_kv_draft, draft.kv_bytes())

    def as_dict(self) -> dict:
        end = self.t_end or time.perf_counter()
        t0 = self.t_prefill or self.t_start
        decode_s = max(end - t0, 1e-9)
        steps = self.steps or [0]
        hist = Counter(self.widths)
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "iterations": self.iterations,
            "steps_per_target_pass": sum(steps) / max(1, len(self.steps)),
            "steps_histogram": dict(sorted(Counter(self.steps).items())),
            "target_passes_per_token": self.target_passes / max(1, self.new_tokens),
            "acceptance_by_depth": {
                d: {**vars(s), "rate": s.accepted / s.tested if s.tested else None}
                for d, s in sorted(self.layers.items())
            },
            "widths": list(self.widths),
            "widths_histogram": dict(sorted(hist.items())),
            "mean_width": sum(self.widths) / len(self.widths) if self.widths else None,
            "beams_carried": list(self.carried),
            **({"forest_policy": self.forest_policy, "forest_sizes": forest_sizes(self.forests)}
               if self.forest_policy else {}),
            **({"phase_s": dict(self.phase_s)} if self.phase_s else {}),
            **({"lookup_sources": {k: {"nodes": n, "hits": h} for k, (n, h) in sorted(self.sources.items())}}
               if self.sources else {}),
            "peak_kv_bytes_target": self.peak_kv_target,
            "peak_kv_bytes_draft": self.peak_kv_draft,
            "mean_target_logprob": self.score / self.new_tokens if self.new_tokens and self.score is not None else None,
            "prefill_s": (self.t_prefill - self.t_start) if self.t_prefill else None,
            "time_to_first_token_s": (self.t_first - self.t_start) if self.t_first else None,
            "decode_s": decode_s,
            "tokens_per_s": self.new_tokens / decode_s,
        }


def forest_sizes(forests) -> dict[str, int]:
    """Histogram of the (layers, W_S) run per iteration: {"g3/ws5": n, "g2/ws0": n (lookup nodes only),
    "g0": n (a plain step)}, most used first."""
    hist = Counter(f"g{g}/ws{ws}" if g else "g0" for g, ws in forests)
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))
