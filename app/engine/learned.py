"""What adaptive forests learnt, kept across processes beside the pass-cost cache (spec §16.8).

    $DSBD_CHAT_CACHE (else ~/.cache/dsbd-chat)/forest-knowledge.json

Two kinds of entries, each under a hashed key:
    acceptance   the forest policy's counts (app.decoding.forest_policy.Acceptance) per model pair, runtime,
                 machine, cost profile and decoding setting: acceptance per depth, which forests passed, and
                 the exploration budget's ledger, so a new process neither explores again nor pays twice
    calibration  the model-free node builder's calibration (app.decoding.lookups.Calibration) per target
                 model: how often each source's proposals are the target's next token
    passes       per model: how its answers' passes compared with its timed pass costs (the corrections of
                 app.engine.timing.PassCosts)

Model identities come from backends.host.timing_identity (file path, size and mtime; runtime build; CPU;
threads; placement): another file, build or machine starts afresh. Counts are capped when stored (recent
answers outweigh old ones) and the file keeps at most MAX_ENTRIES entries, the least recently used dropped.
Writes are atomic. $DSBD_CHAT_RETIME=1 (the pass costs' switch) ignores what was stored and starts afresh.
What is stored only sizes forests: it changes speed, never the output law.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from app.decoding.forest_policy import CARRY, Acceptance
from app.decoding.lookups import Calibration
from app.engine.timing import cache_file, read_store, retiming, write_store

FILE = "forest-knowledge.json"
MAX_ENTRIES = 64
WHAT = "forest knowledge cache"


def model_key(model) -> str | None:
    """A model's identity for what is learnt about it (None: it cannot be identified, nothing persists)."""
    from backends.host import timing_identity

    if model is None:
        return "none"
    ident = timing_identity(model)
    if ident is None:
        return None
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


def entry_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


class Learned:
    """The store: read once per key, written after every answer that taught something."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_file(FILE)
        self.fresh = retiming()

    def acceptance(self, key: str | None) -> Acceptance | None:
        data = self._get(key, "acceptance")
        if data is None:
            return None
        try:
            return acceptance_from_json(data)
        except (TypeError, ValueError, KeyError):
            return None

    def calibration(self, key: str | None) -> Calibration | None:
        data = self._get(key, "calibration")
        if not isinstance(data, dict):
            return None
        try:
            return Calibration({str(k): [float(v[0]), float(v[1])] for k, v in data.items()})
        except (TypeError, ValueError, IndexError):
            return None

    def passes(self, key: str | None) -> dict[int, list[float]]:
        """A PassCosts' ratios ({} when none were stored or the entry is malformed)."""
        data = self._get(key, "passes")
        try:
            return {int(k): [float(v[0]), float(v[1])] for k, v in data.items()} if isinstance(data, dict) else {}
        except (TypeError, ValueError, IndexError):
            return {}

    def store(self, key: str | None, *, acceptance: Acceptance | None = None,
              calibration: Calibration | None = None, passes: dict | None = None) -> None:
        if key is None:
            return
        entry: dict = {"when": time.time()}
        if acceptance is not None:
            entry["acceptance"] = acceptance_to_json(acceptance.carried(CARRY))
        if calibration is not None:
            entry["calibration"] = calibration.carried().table
        if passes is not None:
            entry["passes"] = {str(k): list(v) for k, v in passes.items()}
        data = read_store(self.path, WHAT, quiet=True)
        data[key] = entry
        if len(data) > MAX_ENTRIES:
            for old in sorted(data, key=lambda k: _when(data[k]))[: len(data) - MAX_ENTRIES]:
                del data[old]
        write_store(self.path, data, WHAT)

    def _get(self, key: str | None, kind: str):
        if key is None or self.fresh:
            return None
        entry = read_store(self.path, WHAT).get(key)
        return entry.get(kind) if isinstance(entry, dict) else None


def _when(entry) -> float:
    try:
        return float(entry.get("when", 0.0))
    except (AttributeError, TypeError, ValueError):
        return 0.0


# An older version also stored "verify" (seconds per verified layer); reading ignores tables not named here.
_TABLES = ("depth_draws", "layer_runs", "cache_runs", "distinct")


def acceptance_to_json(a: Acceptance) -> dict:
    out: dict = {name: {",".join(map(str, k if isinstance(k, tuple) else (k,))): list(v)
                        for k, v in getattr(a, name).items()} for name in _TABLES}
    out |= {"layers": a.layers, "plain_s": a.plain_s, "explore_s": a.explore_s}
    return out


def acceptance_from_json(data: dict) -> Acceptance:
    a = Acceptance(layers=int(data["layers"]), plain_s=float(data.get("plain_s", 0.0)),
                   explore_s=float(data.get("explore_s", 0.0)))
    for name in _TABLES:
        table = getattr(a, name)
        for k, v in (data.get(name) or {}).items():
            parts = tuple(int(x) for x in k.split(","))
            table[parts if len(parts) > 1 else parts[0]] = [float(x) for x in v]
    return a
