"""Frozen configuration objects, validated once at the edge with messages a user can act on."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path



@dataclass(frozen=True)
class Mode:
    """What one decoding mode is, as every layer needs to know it (read from MODE_FACTS, never restated)."""

    name: str
    needs_draft: bool  # cannot run without a draft model (sps)
    beams: bool  # uses W (beams) and the length penalty
    keeps_rows: bool  # keeps W target KV rows between steps (full mode); False: one row
    samples: bool  # draws from the warped distribution (T, top-k, top-p matter)
    verifier: str  # "none" | "sps" (one chain) | "dsbd" (forest, layer by layer)
    draft_width: str  # W_S when unset: "1" (one chain), "W+1" (DSBD's default), "W" (no draft)
    uses_draft: bool = False  # drafts with the small model when one is loaded (sps, dsbd, dsbd-mem)
    concrete: bool = True  # False for auto, which picks a concrete mode per request
    memory_twin: str | None = None  # the same decoder carrying one row: what to run when W rows do not fit

    @property
    def forest(self) -> bool:
        """DSBD's forest knobs apply (W_S, t, W_min, the forest policy)."""
        return self.verifier == "dsbd"

    def default_draft_beams(self, w: int) -> int:
        return {"1": 1, "W+1": w + 1, "W": w}[self.draft_width]

    def rows(self, w: int) -> int:
        """Target KV rows for W beams."""
        return w if self.keeps_rows else 1

    def tree_tokens(self, draft_beams: int, gamma: int, lookup_nodes: int = 0) -> int:
        """Context cells one iteration's forest needs beyond the committed tokens (1: the next token): W_S drafts
        and the lookup nodes of each of gamma layers."""
        return (draft_beams + (lookup_nodes if self.forest else 0)) * gamma + 1 if self.uses_draft else 1

    def target_tokens(self, w: int, draft_beams: int, gamma: int) -> tuple[int, list[int]]:
        """(tokens one target pass scores, tokens scored by each draft pass) for one iteration."""
        roots = w if self.keeps_rows or (self.beams and not self.uses_draft) else 1
        if not self.uses_draft:
            return roots, []
        ws = 1 if self.verifier == "sps" else draft_beams
        return roots + ws * gamma, ([roots] + [ws] * (gamma - 1)) if gamma else []


MODE_FACTS: dict[str, Mode] = {m.name: m for m in (
    Mode("greedy", needs_draft=False, beams=False, keeps_rows=False, samples=False, verifier="none", draft_width="W"),
    Mode("sample", needs_draft=False, beams=False, keeps_rows=False, samples=True, verifier="none", draft_width="W"),
    Mode("beam", needs_draft=False, beams=True, keeps_rows=True, samples=False, verifier="none", draft_width="W"),
    Mode("beam-sample", needs_draft=False, beams=True, keeps_rows=True, samples=True, verifier="none",
         draft_width="W"),
    Mode("beam-sample-repl", needs_draft=False, beams=True, keeps_rows=True, samples=True, verifier="none",
         draft_width="W"),
    Mode("sps", needs_draft=True, beams=False, keeps_rows=False, samples=True, verifier="sps", draft_width="1",
         uses_draft=True),
    # DSBD runs without a draft model too: its forest then holds model-free lookup nodes only
    Mode("dsbd", needs_draft=False, beams=True, keeps_rows=True, samples=True, verifier="dsbd", draft_width="W+1",
         uses_draft=True, memory_twin="dsbd-mem"),
    Mode("dsbd-mem", needs_draft=False, beams=True, keeps_rows=False, samples=True, verifier="dsbd",
         draft_width="W+1", uses_draft=True),
    # auto picks one of the above per request; its own facts only steer the settings panel
    Mode("auto", needs_draft=False, beams=True, keeps_rows=False, samples=True, verifier="none", draft_width="W",
         concrete=False),
)}
MODES = tuple(MODE_FACTS)


def without_draft() -> str:
    """What the app does with a target and no draft model, read from MODE_FACTS (the draft picker's fallback)."""
    concrete = [(m, f) for m, f in MODE_FACTS.items() if f.concrete]
    alone = ", ".join(m for m, f in concrete if not f.uses_draft)
    free = " and ".join(m for m, f in concrete if f.uses_draft and not f.needs_draft)
    need = ", ".join(m for m, f in concrete if f.needs_draft)
    return (f"without a compatible draft the target runs alone: {alone} need no draft model; {free} draft from "
            f"n-gram matches of the prompt and the answer and from the target's own successors instead "
            f"(lookup sources match and recycled); {need} needs one")
BEAM_MODES = tuple(m for m, f in MODE_FACTS.items() if f.beams and f.concrete)
# auto's quality levels (app/engine/auto.py): fast = sample | sps, beam = beam-sample | dsbd with W_min >= 2,
# dynamic = dsbd with W_min = W (beam sampling's law), gamma 0..6 sized to the measured pass costs.
QUALITY_LEVELS = ("fast", "beam", "dynamic")
# DSBD forest sizes: fixed = the user's gamma and W_S every iteration; adaptive = per iteration, gamma in
# 0..gamma and W_S in W..draft_beams with the most expected beam steps per second (app/decoding/forest_policy.py)
FOREST_POLICIES = ("fixed", "adaptive")
REPLACEMENTS = ("with", "without")
# Where DSBD's lookup nodes (spec §16.3) come from: the draft model's likeliest pairs no draft drew; matches of the
# text in the prompt and the beams; the target's own successors recycled from earlier passes (spec §16.7)
LOOKUP_SOURCES = ("draft", "match", "recycled")
# Per-token acceptance sum(min(p, q)) assumed before any answer is measured: the qwen-coder pair on mixed
# prose and code (llama.cpp, CPU). Auto mode, adaptive forests and `dsbd-chat plan` start from it.
ACCEPTANCE_PRIOR = 0.66
# The edges' defaults. The CLI's `generate` is greedy (DecodeParams' own default: reproducible output without
# a seed, and it runs on a target alone); the API follows OpenAI's meaning (temperature 0 = greedy, else
# sampling at T = 1 by default); the chat UI opens on its Balanced preset (dsbd-mem: with a draft when one is
# loaded, on model-free lookup nodes alone without one; README: Presets).
API_MODES = {"argmax": "greedy", "sampling": "sample"}
UI_PRESET = "Balanced"
MAX_BEAMS = 16
MAX_GAMMA = 16
MIN_TEMPERATURE = 1e-6  # below this sampling is argmax anyway


class ConfigError(ValueError):
    """A parameter is out of range; the message says which and what is allowed, `field` names it (a DecodeParams
    field; None when the error is about no one field)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


PRESETS_FILE = Path(__file__).resolve().parents[1] / "assets" / "presets.json"
MACHINES = ("cpu", "gpu")  # machine classes: the presets' forest caps differ (a GPU pass costs about the same
#                            for 1 and 64 tokens, so its forests may be much larger)


def load_presets(machine: str = "cpu", path: Path | None = None) -> dict[str, dict]:
    """{name: {description, settings}} from assets/presets.json, each preset's settings with the forest caps of
    that machine class (its "caps" entry for the class, if any); {} if the file is missing."""
    try:
        data = json.loads((path or PRESETS_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {name: {"description": p.get("description", ""),
                   "settings": p["settings"] | p.get("caps", {}).get(machine, {})} for name, p in data.items()}


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)


def _int(name: str, value: int, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}", field=name)
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {value}", field=name)
    return value


# The sampling warp of the law (DecodeParams' fields). Given on the command line it is every compared mode's law,
# presets included.
WARP = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class DecodeParams:
    """One generation's decoding settings (spec §1 names in comments)."""

    mode: str = "greedy"
    max_new_tokens: int = 256
    temperature: float = 1.0  # T
    top_k: int = 0  # 0 = off; counts (beam, token) pairs
    top_p: float = 1.0  # 1 = off
    beams: int = 4  # W
    draft_beams: int | None = None  # W_S; None -> W + 1 (dsbd) or 1 (sps)
    gamma: int = 3
    threshold: float = 0.9  # t
    min_beams: int = 1  # W_min
    select: str = "best"  # memory mode: best | sample
    length_penalty: float = 1.0  # lambda
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    quality: str = "fast"  # auto mode only: which modes it may pick (QUALITY_LEVELS)
    forest: str = "fixed"  # dsbd / dsbd-mem: "fixed" gamma and W_S, or "adaptive" (FOREST_POLICIES)
    unique_paths: bool = True  # score each distinct sequence of a forest pass once (spec §16.1; same output)
    # dsbd / dsbd-mem: "with" reproduces beam sampling with replacement (beam-sample-repl), "without" conventional
    # beam sampling (beam-sample): drafts drawn without replacement, verified by recursive rejection
    replacement: str = "with"
    lookup_nodes: int = 0  # dsbd / dsbd-mem: the most lookup nodes per layer, from lookup_sources
    lookup_sources: tuple[str, ...] = ("draft",)  # dsbd / dsbd-mem: LOOKUP_SOURCES to take them from

    def validated(self) -> "DecodeParams":
        """Check every field; return a copy with defaults resolved. Raises ConfigError."""
        if not isinstance(self.mode, str) or self.mode not in MODE_FACTS:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODE_FACTS)}", field="mode")
        _int("max_new_tokens", self.max_new_tokens, 1, 1_000_000)
        t = _finite("temperature", self.temperature)
        if t < MIN_TEMPERATURE:  # logits / T must stay finite: a subnormal T turns the warp into NaN
            raise ConfigError(f"temperature must be >= {MIN_TEMPERATURE:g} (use mode 'greedy' for argmax), got {t}",
                              field="temperature")
        _int("top_k", self.top_k, 0, 1_000_000)
        p = _finite("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {p}", field="top_p")
        w = _int("beams", self.beams, 1, MAX_BEAMS)
        _int("gamma", self.gamma, 0, MAX_GAMMA)
        th = _finite("threshold", self.threshold)
        if not 0 <= th <= 1:
            raise ConfigError(f"threshold must be in [0, 1], got {th}", field="threshold")
        facts = MODE_FACTS[self.mode]
        ws = facts.default_draft_beams(w) if self.draft_beams is None else self.draft_beams
        _int("draft_beams", ws, 1, 4 * MAX_BEAMS)
        if facts.forest and ws < w:
            raise ConfigError(f"draft_beams (W_S={ws}) must be >= beams (W={w})", field="draft_beams")
        _int("min_beams", self.min_beams, 1, w)
        if self.quality not in QUALITY_LEVELS:
            raise ConfigError(f"unknown quality level {self.quality!r} for auto; choose one of: "
                              f"{', '.join(QUALITY_LEVELS)}", field="quality")
        if self.replacement not in REPLACEMENTS:
            raise ConfigError(f"replacement must be 'with' or 'without' (without: DSBD reproduces beam-sample, "
                              f"conventional beam sampling), got {self.replacement!r}", field="replacement")
        _int("lookup_nodes", self.lookup_nodes, 0, 4 * MAX_BEAMS)
        sources = (self.lookup_sources,) if isinstance(self.lookup_sources, str) else self.lookup_sources
        if not isinstance(sources, (list, tuple)) or any(s not in LOOKUP_SOURCES for s in sources):
            raise ConfigError(f"lookup_sources must name some of: {', '.join(LOOKUP_SOURCES)}, got "
                              f"{self.lookup_sources!r:.80}", field="lookup_sources")
        if self.forest not in FOREST_POLICIES:
            raise ConfigError(f"forest must be one of: {', '.join(FOREST_POLICIES)} (adaptive: per iteration "
                              f"gamma <= {self.gamma} and W <= W_S <= draft_beams, sized to the timed pass costs), "
                              f"got {self.forest!r}", field="forest")
        if not isinstance(self.unique_paths, bool):
            raise ConfigError(f"unique_paths must be true or false, got {self.unique_paths!r}", field="unique_paths")
        if self.select not in ("best", "sample"):
            raise ConfigError(f"select must be 'best' or 'sample', got {self.select!r}", field="select")
        lp = _finite("length_penalty", self.length_penalty)
        if not -10 <= lp <= 10:  # S(y) = s(y) / n^lambda: beyond this n^lambda overflows a float
            raise ConfigError(f"length_penalty must be between -10 and 10, got {lp}", field="length_penalty")
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1)
        # A bare string would iterate as characters, and None or a number would not iterate at all.
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r:.80}", field="stop")
        return replace(self, draft_beams=ws, temperature=t, top_p=p, threshold=th, stop=tuple(self.stop),
                       lookup_sources=tuple(s for s in LOOKUP_SOURCES if s in sources))

    @property
    def needs_draft(self) -> bool:
        facts = MODE_FACTS.get(self.mode)  # unvalidated params may name no mode
        return facts is not None and facts.needs_draft

    @property
    def uses_draft(self) -> bool:
        """Drafts with the draft model when one is loaded."""
        facts = MODE_FACTS.get(self.mode)
        return facts is not None and facts.uses_draft

    @property
    def adaptive(self) -> bool:
        """A forest sized per iteration from pass costs (DSBD with forest='adaptive')."""
        facts = MODE_FACTS.get(self.mode)
        return facts is not None and facts.forest and self.forest == "adaptive"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["lookup_sources"] = list(self.lookup_sources)
        return d
