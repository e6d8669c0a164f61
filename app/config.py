"""Frozen configuration objects, validated once at the edge with messages a user can act on."""

from __future__ import annotations

import json
import math
import re
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
SELECTS = ("best", "sample")  # dsbd-mem: which output beam to carry between iterations
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
    """One generation's decoding settings; what each one means: KNOBS."""

    mode: str = "greedy"
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    beams: int = 4
    draft_beams: int | None = None  # None: the mode's default (Mode.default_draft_beams)
    gamma: int = 3
    threshold: float = 0.9
    min_beams: int = 1
    select: str = "best"
    length_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    quality: str = "fast"
    forest: str = "fixed"
    unique_paths: bool = True  # spec §16.1
    replacement: str = "with"
    lookup_nodes: int = 0
    lookup_sources: tuple[str, ...] = ("draft",)

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
        if self.select not in SELECTS:
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


@dataclass(frozen=True)
class Knob:
    """One setting as every edge describes it: the CLI's flag and help, the settings panel's label and info, the
    API's field description, the README's glossary row (generated by scripts/figures.py)."""

    name: str  # the glossary's, with its symbol
    flag: str  # the CLI's
    meaning: str  # Markdown; `plain` for the CLI, the panel and the API
    label: str | None = None  # the settings panel's (None: not in the panel)
    more: str = ""  # what only the README adds to the meaning
    choices: tuple[str, ...] | None = None  # the CLI's choices, shown in the glossary's flag column
    arg: str = ""  # the glossary's flag column: the value after the flag (when not the choices)
    note: str = ""  # the glossary's flag column: a note after the flag and its value
    default: str | None = None  # the glossary's default (None: the DecodeParams default)

    @property
    def plain(self) -> str:
        """The meaning without Markdown: the panel's info, the API's description."""
        return plain(self.meaning)

    @property
    def help(self) -> str:
        """The meaning and the note without Markdown: the CLI's help."""
        return plain(f"{self.meaning} {self.note}" if self.note else self.meaning)


def plain(markdown: str) -> str:
    """Text without its Markdown: code marks, emphasis, links (their text stays)."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "").replace("**", "")


# Every DecodeParams field but the mode (the README's modes table says what each does), and the cost profile (a
# model setting: the CLI's, beside the models), in the glossary's order.
KNOBS: dict[str, Knob] = {
    "beams": Knob("W, beams", "--beams", "the most beams carried between steps; in DSBD the widest a forest layer may "
                  "get", label="Beams W"),
    "draft_beams": Knob("W_S, draft beams", "--draft-beams", "drafts per forest layer (>= W); with an adaptive forest, "
                        "the most", label="Draft beams W_S (0 = W+1)", default="W + 1"),
    "gamma": Knob("gamma", "--gamma", "draft depth: forest layers per iteration; with an adaptive forest, the most "
                  "(0 = no draft)", label="Draft length γ",
                  more="An adaptive forest's model-free lookup chains start at most 8 layers deep, double after a "
                       "chain that passed whole and go back to 8 after one that failed, never past gamma: copying "
                       "stretches get long chains, other text short ones"),
    "threshold": Knob("t, threshold", "--threshold", "width threshold in [0, 1]: each layer takes the largest width K "
                      "such that at least K of its drafts are accepted with probability >= t. Higher t: narrower "
                      "layers that pass more often (more tokens per pass, closer to sampling)",
                      label="Width threshold t"),
    "min_beams": Knob("W_min, min beams", "--min-beams", "the narrowest a layer may get; W_min = W keeps every layer "
                      "at W beams (beam sampling's law)", label="Min beams W_min"),
    "select": Knob("select", "--select", "dsbd-mem: which output beam to carry; `best` the highest score (the paper's "
                   "rule), `sample` an exact draw", label="Carry between iterations", choices=SELECTS),
    "forest": Knob("forest", "--forest", "fixed: gamma and W_S every iteration; adaptive: per iteration gamma in "
                   "0..gamma and W_S in W..W_S with the most expected beam steps per second, from pass costs timed "
                   "once per model file and machine", label="Forest size", choices=FOREST_POLICIES,
                   default="fixed (CLI), adaptive (presets)"),
    "replacement": Knob("replacement", "--replacement", "dsbd / dsbd-mem: `with` reproduces beam sampling with "
                        "replacement (`beam-sample-repl`); `without` drafts without replacement and reproduces "
                        "conventional beam sampling (`beam-sample`); no repeated beam or draft", label="Drafts drawn",
                        choices=REPLACEMENTS),
    "lookup_nodes": Knob("lookup nodes", "--lookup-nodes", "dsbd / dsbd-mem: extra forest nodes per layer, chosen "
                         "before the pass; never proposals, only chances for a layer to pass when every output is "
                         "already a forest node; with an adaptive forest, the most (a best-first builder adds them "
                         "while its estimate says they pay; after searches that keep finding none worth adding it "
                         "waits 1, 3, 7, ... iterations, at most as many as keep its own searching under 2% of the "
                         "time on a fast GPU pass; on a CPU it searches every iteration)",
                         label="Lookup nodes per layer", arg="N"),
    "lookup_sources": Knob("lookup sources", "--lookup-sources", "where lookup nodes come from: `draft`, the draft "
                           "model's likeliest pairs no draft drew; `match`, what followed the longest match (at least "
                           "4 tokens) of a beam's text in the prompt, the conversation (attached files included), "
                           "another beam or an earlier chat, extended while the match continues (pays where the "
                           "answer copies its context: edits, refactors); `recycled`, the target's own likeliest "
                           "successors of a token, kept from every pass. `match` and `recycled` cost no draft pass, "
                           "so DSBD runs without a draft model on them", label="Lookup nodes from",
                           arg=",".join(LOOKUP_SOURCES), note="(in `bench --modes`: `lookup_sources=draft+match`)",
                           more="Earlier chats: the saved chats, newest first, read at the first answer after a "
                                "start, then every chat answered; the newest version of each chat, at most 200,000 "
                                "tokens in memory, read again when the target changes"),
    "cost_profile": Knob("cost profile", "--cost-profile", "the machine passes are priced for (adaptive forests, auto "
                         "mode, `plan` and `bench` projections): `timed`, this machine's passes (timed once, cached); "
                         "another machine's curves or datasheet to shape forests for it (the bench then also reports "
                         "the projected time there)", more="[Memory planning](#memory-planning-and-offloading) lists "
                         "them", arg="timed|rtx4090-1.5b|rtx4090-7b|rtx4090-24gb|...|FILE.json", default="timed"),
    "unique_paths": Knob("unique paths", "--no-unique-paths", "identical sequences in a forest pass (repeated beams, "
                         "repeated drafts) are computed once; no effect on answers, only on work",
                         note="(this flag turns it off)", default="on"),
    "temperature": Knob("temperature T", "--temperature", "divides the logits; > 0 (use `greedy` for argmax)",
                        label="Temperature T"),
    "top_k": Knob("top-k", "--top-k", "keep the k most likely (beam, token) **pairs** in total, not per beam; 0 = off",
                  label="Top-k (0 = off)"),
    "top_p": Knob("top-p", "--top-p", "keep the smallest set of pairs whose mass reaches p; 1 = off",
                  label="Top-p (1 = off)"),
    "length_penalty": Knob("length penalty lambda", "--length-penalty", "the final choice ranks beams by "
                           "log-likelihood / length^lambda", label="Length penalty λ"),
    "max_new_tokens": Knob("max tokens", "--max-tokens", "the answer's token budget", label="Max new tokens"),
    "stop": Knob("stop", "--stop", "stop strings; the answer is cut before them", note="(repeatable)", default="none"),
    "seed": Knob("seed", "--seed", "the same seed and settings give the same answer", label="Seed (-1 = random)",
                 default="random"),
    "quality": Knob("quality", "--quality", "auto only: which modes it may pick: fast = sample or sps, beam = "
                    "beam-sample or dsbd with W_min >= 2, dynamic = dsbd with W_min = W (beam sampling's law)",
                    label="Auto: quality level", choices=QUALITY_LEVELS),
}
