"""Pass costs: the seconds of one forward pass scoring n tokens, timed once per model file, runtime build, CPU
and thread count, and cached on disk so a load or a `generate` call does not time them again.

    CostCurve        piecewise linear through the measured points (offload.cost: the one speed model)
    measure_costs    time a flat n-node forest after a fixed context, through the backend protocol
    cached_costs     measure_costs behind the cache: $DSBD_CHAT_CACHE (else ~/.cache/dsbd-chat)/pass-costs.json
    PassCosts        the timed points corrected by the passes answers ran (learnt in the background, kept by
                     app.engine.learned): the curve forests and auto mode price with

The cache key is backends.host.timing_identity(model) (file path, size and mtime; llama-cpp-python version
and library files or the torch version; CPU model and flags; threads; weight placement) plus the timing method
(the token counts, context and repeats). A model without a file is timed every time. An unreadable or corrupt
cache file is ignored (and logged), then replaced by the next write. Timings taken while other processes ran
are too high and would stay: $DSBD_CHAT_RETIME=1 times again and keeps, per point, the lower of the old and
the new figure (other processes only ever add time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from app.storage import atomic_write
from offload.cost import CURVE_POINTS, DATASHEETS, CostCurve, CostProfile  # noqa: F401  (CostCurve: re-exported)

log = logging.getLogger(__name__)

CAL_POINTS = CURVE_POINTS
CACHE_NAME = "pass-costs.json"
METHOD = 1  # bump when measure_costs changes what it times: old entries then miss
RETIME = "DSBD_CHAT_RETIME"


def measure_costs(model, ns: Sequence[int] = CAL_POINTS, *, context: int = 128, repeats: int = 2,
                  shape: str = "flat", stat: Callable[[list[float]], float] = min, **context_kw) -> dict[int, float]:
    """Seconds of one evaluate() scoring n new tokens after `context` cached tokens, `stat` of `repeats` runs
    (min by default: other processes on a shared machine only ever add time). shape "flat": n siblings under
    the row (a wide forest layer); "chain": one path of n nodes. context_kw go to model.context."""
    from backends.base import ROOT, Forest

    vocab = model.info.vocab_size
    ids = [(i * 7919) % (vocab - 200) + 100 for i in range(context)] if vocab > 300 else \
        [i % vocab for i in range(context)]  # arbitrary but fixed tokens
    out = {}
    ctx = model.context(rows=1, max_tokens=context + max(ns) + 8, **context_kw)
    try:
        ctx.prefill(ids)
        for n in ns:
            parents = (ROOT,) * n if shape == "flat" else (ROOT,) + tuple(range(n - 1))
            forest = Forest(tokens=tuple(ids[(i * 13) % context] for i in range(n)), parents=parents, rows=(0,) * n)
            times = []
            for _ in range(repeats + 1):  # the first run warms caches and is dropped
                t = time.perf_counter()
                ctx.evaluate(forest)
                times.append(time.perf_counter() - t)
                ctx.truncate(context)  # drop the pending nodes, keep the prompt
            out[n] = stat(times[1:])
    finally:
        ctx.close()
    return out


def cache_file(name: str = CACHE_NAME) -> Path:
    """A file in the app's cache folder (the one the llama.cpp probe keeps its verdicts in)."""
    root = os.environ.get("DSBD_CHAT_CACHE") or Path.home() / ".cache" / "dsbd-chat"
    return Path(root) / name


def retiming() -> bool:
    """$DSBD_CHAT_RETIME=1: time the passes again and start what adaptive forests learnt afresh."""
    return os.environ.get(RETIME, "") in ("1", "yes", "true")


def cost_key(model, ns: Sequence[int], context: int, repeats: int) -> str | None:
    """The cache key of these timings of this model, None when the model cannot be identified."""
    from backends.host import timing_identity

    ident = timing_identity(model)
    if ident is None:
        return None
    ident |= {"ns": [int(n) for n in ns], "context": context, "repeats": repeats, "method": METHOD}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_costs(model, ns: Sequence[int] = CAL_POINTS, *, context: int = 128, repeats: int = 2,
                 path: Path | None = None, hold: Callable | None = None) -> dict[int, float]:
    """measure_costs(model, ns, ...) from the cache when this model, build, CPU and thread count were timed
    before; else timed now and stored. `hold()`: a context manager each point is timed inside (the engine's
    lock, so answers run between the points and never beside one)."""
    key = cost_key(model, ns, context, repeats)
    if key is None:
        return _measured(model, ns, context, repeats, hold)
    path = path or cache_file()
    store = read_store(path, "pass-cost cache")
    hit, old = store.get(key), {}
    if isinstance(hit, dict) and isinstance(hit.get("seconds"), dict):
        try:
            old = {int(n): float(s) for n, s in hit["seconds"].items()}
        except (TypeError, ValueError):
            old = {}
        if not (old and set(old) == {int(n) for n in ns} and all(s > 0 for s in old.values())):
            log.warning("ignoring a malformed pass-cost entry in %s: timing the passes again", path)
            old = {}
        elif not retiming():
            return old
    costs = _measured(model, ns, context, repeats, hold)
    costs = {n: min(s, old.get(n, s)) for n, s in costs.items()}
    store = read_store(path, "pass-cost cache", quiet=True)  # re-read: another process may have written meanwhile
    store[key] = {"model": model.info.name, "file": model.info.extra.get("path"), "when": int(time.time()),
                  "seconds": {str(n): s for n, s in costs.items()}}
    write_store(path, store, "pass-cost cache")
    return costs


def _measured(model, ns, context: int, repeats: int, hold) -> dict[int, float]:
    if hold is None:
        return measure_costs(model, ns, context=context, repeats=repeats)
    out = {}
    for n in ns:
        with hold():
            out |= measure_costs(model, [n], context=context, repeats=repeats)
    return out


def read_store(path: Path, what: str, *, quiet: bool = False) -> dict:
    """A JSON object cache file; {} (logged) when it is missing, unreadable or corrupt: it is rewritten."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        if not quiet:
            log.warning("cannot read the %s %s (%s): starting afresh", what, path, e)
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        if not quiet:
            log.warning("ignoring the corrupt %s %s: starting afresh (it will be rewritten)", what, path)
        return {}
    return data


def write_store(path: Path, data: dict, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(data, indent=1))
    except OSError as e:  # a read-only cache only costs what it would have saved
        log.warning("cannot write the %s %s (%s)", what, path, e)


# ------------------------------------------------------------------------------------ learnt from answers

LEARN_STRENGTH = 4.0  # pseudo-passes behind a point's correction: a handful of passes outweigh the timing
LEARN_CAP = 64.0  # most passes a point's correction keeps: the latest answers outweigh a long session


@dataclass
class PassCosts:
    """A model's timed pass costs, corrected by the passes its answers ran.

    The warm-up times each curve point once, after a short fixed context; answers run at their own context
    lengths, on a machine that may be busier or quieter than it was then. Every answer's passes (the median
    seconds of its passes that scored n tokens) give ratios to the timed curve at n, counted at the curve point
    nearest n (log scale). The curve is each point's timed seconds times its mean ratio, shrunk toward the mean
    ratio of every point (itself shrunk toward 1): a point no answer reached moves with the level answers saw,
    keeping the shape the warm-up timed. Counts are capped (LEARN_CAP), so the curve follows the machine as it
    changes. What is learnt only sizes forests and picks auto's setting; it never moves an output law."""

    timed: Mapping[int, float]
    ratios: dict[int, list[float]] = field(default_factory=dict)  # point -> [sum of ratios, passes]
    setting: str | None = None  # the engine's key for what this learns (app.engine.learned)

    def __post_init__(self) -> None:
        self.timed = {int(n): float(s) for n, s in self.timed.items()}
        self._base = CostCurve.of(self.timed)

    def observe(self, passes: Mapping | None, seconds: Mapping | None) -> bool:
        """One answer's `passes_by_tokens` (n -> passes) and `pass_s_by_tokens` (n -> median seconds), as the
        engine's stats carry them (keys may be strings, from JSON); True when the curve moved."""
        moved = False
        for n, s in (seconds or {}).items():
            count = (passes or {}).get(n, 0)
            n, s = int(n), float(s)
            if n < 1 or not s > 0 or not count:
                continue
            row = self.ratios.setdefault(self._point(n), [0.0, 0.0])
            row[0] += count * s / self._base(n)
            row[1] += count
            if row[1] > LEARN_CAP:
                row[0], row[1] = row[0] * LEARN_CAP / row[1], LEARN_CAP
            moved = True
        return moved

    def factor(self, point: int) -> float:
        """The correction of one curve point (1 with nothing learnt)."""
        total = sum(r[0] for r in self.ratios.values()), sum(r[1] for r in self.ratios.values())
        level = (total[0] + LEARN_STRENGTH) / (total[1] + LEARN_STRENGTH)
        own = self.ratios.get(point, (0.0, 0.0))
        return (own[0] + LEARN_STRENGTH * level) / (own[1] + LEARN_STRENGTH)

    def curve(self) -> CostCurve:
        return CostCurve.of({n: s * self.factor(n) for n, s in self.timed.items()})

    def _point(self, n: int) -> int:
        return min(self.timed, key=lambda p: (abs(math.log2(n) - math.log2(p)), p))


# ---------------------------------------------------------------------------------------------- cost profiles

PROFILES = Path(__file__).resolve().parents[2] / "assets" / "cost_profiles"
TIMED = "timed"


def profile_names() -> list[str]:
    """Every cost profile by name: this machine's timed passes, the curves files, the datasheets."""
    return [TIMED] + sorted(p.stem for p in PROFILES.glob("*.json")) + list(DATASHEETS)


def cost_profile(name: str = TIMED) -> CostProfile:
    """A cost profile (offload.cost.CostProfile) by name or .json file (scripts/gpu_profile.py writes them);
    ValueError naming the known ones for any other name, or saying what is wrong with the file."""
    if name == TIMED:
        return CostProfile(TIMED, machine="")
    if name in DATASHEETS:
        hw = DATASHEETS[name]
        return CostProfile(name, machine="gpu" if hw.has_gpu else "cpu", datasheet=hw,
                           vram_gb=hw.vram_gb, source="datasheet (nominal numbers, roofline)")
    path = Path(name) if name.endswith(".json") else PROFILES / f"{name}.json"
    if not name.endswith(".json") and name not in profile_names():
        raise ValueError(f"unknown cost profile {name!r}; choose one of: {', '.join(profile_names())}, or a "
                         "profile .json file")
    try:
        data = json.loads(path.read_text())
        if data["machine"] not in ("cpu", "gpu") or not data["target"] or not data["draft"]:
            raise ValueError("machine must be cpu or gpu, target and draft seconds by tokens")
        vram = float(data["vram_gb"]) if data.get("vram_gb") is not None else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the cost profile {path}: {e}") from e
    curve = lambda d: CostCurve.of({int(n): float(s) for n, s in d.items()})
    label = (data.get("name") or path.stem) if name.endswith(".json") else name
    return CostProfile(label, machine=data["machine"], target=curve(data["target"]), draft=curve(data["draft"]),
                       vram_gb=vram, source=data.get("source", ""), description=data.get("description", ""))
