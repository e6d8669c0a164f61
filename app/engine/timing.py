"""Pass costs: the seconds of one forward pass scoring n tokens, timed once per model file, runtime build, CPU
and thread count, and cached on disk so a load or a `generate` call does not time them again.

    CostCurve        piecewise linear through the measured points (auto mode and the forest policy read it)
    measure_costs    time a flat n-node forest after a fixed context, through the backend protocol
    cached_costs     measure_costs behind the cache: $DSBD_CHAT_CACHE (else ~/.cache/dsbd-chat)/pass-costs.json

The cache key is backends.registry.timing_identity(model) (file path, size and mtime; llama-cpp-python version
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
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from app.storage import atomic_write

log = logging.getLogger(__name__)

CAL_POINTS = (1, 2, 4, 8, 16, 32, 64)
CACHE_NAME = "pass-costs.json"
METHOD = 1  # bump when measure_costs changes what it times: old entries then miss
RETIME = "DSBD_CHAT_RETIME"


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one pass scoring n tokens: piecewise linear through measured points, linear beyond."""

    points: tuple[tuple[int, float], ...]  # (n, seconds), n ascending

    @classmethod
    def of(cls, costs: Mapping[int, float]) -> "CostCurve":
        if not costs:
            raise ValueError("a cost curve needs at least one measured point")
        pts, best = [], float("inf")
        # A pass scoring more tokens never costs less, and other processes only ever add time: clip each
        # point to the cheapest one at or above its n, so one disturbed measurement cannot lift the curve.
        for n, s in sorted(((int(n), float(s)) for n, s in costs.items()), reverse=True):
            best = min(best, s)
            pts.append((n, best))
        return cls(tuple(reversed(pts)))

    def __call__(self, n: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * n / pts[0][0]  # one point: assume proportional
        if n <= pts[0][0]:
            return pts[0][1]
        # Beyond the last point: extend the last segment's slope (compute-bound growth).
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1 or (n1, s1) == pts[-1]:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        raise AssertionError("unreachable")


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
    from backends.registry import timing_identity

    ident = timing_identity(model)
    if ident is None:
        return None
    ident |= {"ns": [int(n) for n in ns], "context": context, "repeats": repeats, "method": METHOD}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_costs(model, ns: Sequence[int] = CAL_POINTS, *, context: int = 128, repeats: int = 2,
                 path: Path | None = None) -> dict[int, float]:
    """measure_costs(model, ns, ...) from the cache when this model, build, CPU and thread count were timed
    before; else timed now and stored."""
    key = cost_key(model, ns, context, repeats)
    if key is None:
        return measure_costs(model, ns, context=context, repeats=repeats)
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
    costs = measure_costs(model, ns, context=context, repeats=repeats)
    costs = {n: min(s, old.get(n, s)) for n, s in costs.items()}
    store = read_store(path, "pass-cost cache", quiet=True)  # re-read: another process may have written meanwhile
    store[key] = {"model": model.info.name, "file": model.info.extra.get("path"), "when": int(time.time()),
                  "seconds": {str(n): s for n, s in costs.items()}}
    write_store(path, store, "pass-cost cache")
    return costs


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


# ---------------------------------------------------------------------------------------------- cost profiles

PROFILES = Path(__file__).resolve().parents[2] / "assets" / "cost_profiles"
TIMED = "timed"


@dataclass(frozen=True)
class CostProfile:
    """The pass costs forests are priced with: this machine's, timed (`timed`), or a named curve for another
    machine (assets/cost_profiles/NAME.json: seconds per pass by tokens scored, for a target and a draft)."""

    name: str
    machine: str  # the machine class the curves describe: "cpu" or "gpu" (the presets' caps follow it)
    target: CostCurve | None = None  # None: timed on this machine
    draft: CostCurve | None = None
    source: str = "timed on this machine"
    description: str = ""


def profile_names() -> list[str]:
    return [TIMED] + sorted(p.stem for p in PROFILES.glob("*.json"))


def cost_profile(name: str = TIMED) -> CostProfile:
    """A named cost profile, or one from a .json file (scripts/gpu_profile.py writes them); ValueError naming
    the known ones for any other name, or saying what is wrong with the file."""
    if name == TIMED:
        return CostProfile(TIMED, machine="")
    path = Path(name) if name.endswith(".json") else PROFILES / f"{name}.json"
    if not name.endswith(".json") and name not in profile_names():
        raise ValueError(f"unknown cost profile {name!r}; choose one of: {', '.join(profile_names())}, or a "
                         "profile .json file")
    try:
        data = json.loads(path.read_text())
        if data["machine"] not in ("cpu", "gpu") or not data["target"] or not data["draft"]:
            raise ValueError("machine must be cpu or gpu, target and draft seconds by tokens")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the cost profile {path}: {e}") from e
    curve = lambda d: CostCurve.of({int(n): float(s) for n, s in d.items()})
    label = (data.get("name") or path.stem) if name.endswith(".json") else name
    return CostProfile(label, machine=data["machine"], target=curve(data["target"]), draft=curve(data["draft"]),
                       source=data.get("source", ""), description=data.get("description", ""))
