"""Frozen configuration objects, validated once at the edge with messages a user can act on."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

MODES = ("greedy", "sample", "beam", "beam-sample", "beam-sample-repl", "sps", "dsbd", "dsbd-mem", "auto")
# auto's quality levels (app/engine/auto.py): fast = sample | sps, beam = beam-sample | dsbd with W_min >= 2,
# dynamic = dsbd with W_min = W (beam sampling's law), gamma 0..6 sized to the measured pass costs.
QUALITY_LEVELS = ("fast", "beam", "dynamic")
DRAFT_MODES = ("sps", "dsbd", "dsbd-mem")
# DSBD forest sizes: fixed = the user's gamma and W_S every iteration; adaptive = per iteration, gamma in
# 0..gamma and W_S in W..draft_beams with the most expected beam steps per second (app/decoding/forest_policy.py)
FOREST_POLICIES = ("fixed", "adaptive")
BEAM_MODES = ("beam", "beam-sample", "beam-sample-repl", "dsbd", "dsbd-mem")
BACKENDS = ("llamacpp", "pytorch")
DTYPES = ("float32", "bfloat16", "float16")
MAX_BEAMS = 16
MAX_GAMMA = 16
MIN_TEMPERATURE = 1e-6  # below this sampling is argmax anyway


class ConfigError(ValueError):
    """A parameter is out of range; the message says which and what is allowed."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _int(name: str, value: int, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {value}")
    return value


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

    def validated(self) -> "DecodeParams":
        """Check every field; return a copy with defaults resolved. Raises ConfigError."""
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        _int("max_new_tokens", self.max_new_tokens, 1, 1_000_000)
        t = _finite("temperature", self.temperature)
        if t < MIN_TEMPERATURE:  # logits / T must stay finite: a subnormal T turns the warp into NaN
            raise ConfigError(f"temperature must be >= {MIN_TEMPERATURE:g} (use mode 'greedy' for argmax), got {t}")
        _int("top_k", self.top_k, 0, 1_000_000)
        p = _finite("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {p}")
        w = _int("beams", self.beams, 1, MAX_BEAMS)
        _int("gamma", self.gamma, 0, MAX_GAMMA)
        th = _finite("threshold", self.threshold)
        if not 0 <= th <= 1:
            raise ConfigError(f"threshold must be in [0, 1], got {th}")
        ws = self.draft_beams
        if ws is None:
            ws = 1 if self.mode == "sps" else w + 1 if self.mode in ("dsbd", "dsbd-mem") else w
        _int("draft_beams", ws, 1, 4 * MAX_BEAMS)
        if self.mode in ("dsbd", "dsbd-mem") and ws < w:
            raise ConfigError(f"draft_beams (W_S={ws}) must be >= beams (W={w})")
        _int("min_beams", self.min_beams, 1, w)
        if self.quality not in QUALITY_LEVELS:
            raise ConfigError(f"unknown quality level {self.quality!r} for auto; choose one of: "
                              f"{', '.join(QUALITY_LEVELS)}")
        if self.forest not in FOREST_POLICIES:
            raise ConfigError(f"forest must be one of: {', '.join(FOREST_POLICIES)} (adaptive: per iteration "
                              f"gamma <= {self.gamma} and W <= W_S <= draft_beams, sized to the timed pass costs), "
                              f"got {self.forest!r}")
        if not isinstance(self.unique_paths, bool):
            raise ConfigError(f"unique_paths must be true or false, got {self.unique_paths!r}")
        if self.select not in ("best", "sample"):
            raise ConfigError(f"select must be 'best' or 'sample', got {self.select!r}")
        lp = _finite("length_penalty", self.length_penalty)
        if not -10 <= lp <= 10:  # S(y) = s(y) / n^lambda: beyond this n^lambda overflows a float
            raise ConfigError(f"length_penalty must be between -10 and 10, got {lp}")
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1)
        # A bare string would iterate as characters, and None or a number would not iterate at all.
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r:.80}")
        return replace(self, draft_beams=ws, temperature=t, top_p=p, threshold=th, stop=tuple(self.stop))

    @property
    def needs_draft(self) -> bool:
        return self.mode in DRAFT_MODES

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to run it."""

    source: str  # preset role ("tiny"), local .gguf, safetensors folder, or "org/name[:file.gguf]"
    backend: str = "llamacpp"
    dtype: str = "float32"  # pytorch only
    device: str = "cpu"  # pytorch only: cpu | cuda | cuda:N
    n_threads: int | None = None  # llama.cpp; None = physical cores
    n_gpu_layers: int | None = None  # llama.cpp; None = from the memory plan (0 without a GPU)
    n_ctx: int = 4096
    llama_extra_bufts: str = "auto"  # llama.cpp weight repack: on | off | auto ($DSBD_CHAT_LLAMA_EXTRA_BUFTS, probe)

    def validated(self) -> "ModelSpec":
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        _int("n_ctx", self.n_ctx, 16, 1 << 20)
        if self.n_gpu_layers is not None:
            _int("n_gpu_layers", self.n_gpu_layers, -1, 100_000)
        if self.n_threads is not None:
            _int("n_threads", self.n_threads, 1, 1024)
        if self.llama_extra_bufts not in ("auto", "on", "off"):
            raise ConfigError(f"llama_extra_bufts must be auto, on or off, got {self.llama_extra_bufts!r}")
        return self
