"""A model load's stages and how fast Cancel stops it, through the supervised model process (the chat server's
default engine), as the Models tab sees them.

1. From an empty model cache, load the `qwen-coder` preset (target and draft) in place of `tiny`: the stages
   reported (assembling each file from its packages, loading each file's weights, checking, switching), each
   with when it first and last reported and how many reports the page got.
2. Cancel latency: the seconds from setting the cancel Event to LoadCancelled in the caller, while assembling
   the target (at 30 %), inside llama.cpp's load of the target (its progress callback, past 60 %), between the
   PyTorch loader's tensors (past 15 %) and while the switch waits for a running answer.

    python scripts/measure_load.py --json docs/measurements/load-progress.json
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

from _common import ROOT_DIR, machine  # noqa: F401  (ROOT_DIR: the repository on sys.path)


def _timeline(engine, target, draft):
    from backends.load_progress import STAGES

    t0 = time.perf_counter()
    seen: dict = {}

    def hear(step):
        now = round(time.perf_counter() - t0, 3)
        key = f"{step.role + ': ' if step.role else ''}{STAGES[step.stage]}"
        first, _, n = seen.get(key, (now, now, 0))
        seen[key] = (first, now, n + 1)
    engine.swap(target, draft, progress=hear)
    return {"seconds": round(time.perf_counter() - t0, 2),
            "stages": [{"stage": k, "first_s": a, "last_s": b, "reports": n} for k, (a, b, n) in seen.items()]}


def _cancel(engine, target, draft, when, *, during=None) -> dict:
    """Start a swap; set cancel once `when(step)`; seconds from then to the LoadCancelled."""
    from backends.load_progress import LoadCancelled

    cancel, at, last = threading.Event(), [], []

    def hear(step):
        last[:] = [step]
        if not cancel.is_set() and when(step):
            at.append(time.perf_counter())
            cancel.set()
    try:
        engine.swap(target, draft, progress=hear, cancel=cancel)
    except LoadCancelled as e:
        return {"latency_s": round(time.perf_counter() - at[0], 3), "said": str(e),
                "last_report": str(last[0]) if last else None}
    return {"latency_s": None, "said": "the load finished before the cancel took effect"}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="dsbd-load-")
    os.environ["DSBD_CHAT_CACHE"] = cache  # the model process inherits it: an empty cache, presets assembled anew
    from app.config import DecodeParams
    from app.engine.worker import WorkerEngine
    from backends.registry import ModelSpec

    tiny = ModelSpec("tiny", n_ctx=1024)
    qt, qd = ModelSpec("qwen-coder", n_ctx=1024), ModelSpec("qwen-coder", n_ctx=1024)
    out = {"engine": "WorkerEngine (supervised model process)", "cpu_cores": os.cpu_count()}
    with WorkerEngine.load(tiny, tiny) as w:
        out["cancel"] = {"assembling the target (30 %)": _cancel(
            w, qt, qd, lambda s: s.stage == "assemble" and s.fraction >= 0.3)}
        out["qwen-coder from an empty cache"] = _timeline(w, qt, qd)
        w.swap(tiny, tiny)
        out["qwen-coder again (assembled, hashed)"] = _timeline(w, qt, qd)
        w.swap(tiny, tiny)
        out["cancel"]["llama.cpp loading the target (60 %)"] = _cancel(
            w, qt, qd, lambda s: s.stage == "load" and s.role == "target" and s.fraction >= 0.6)
        out["cancel"]["PyTorch loader (past 15 % of the tensors)"] = _cancel(
            w, ModelSpec("tiny", backend="pytorch", n_ctx=1024), tiny,
            lambda s: s.stage == "load" and s.detail.startswith("tensor ") and s.fraction >= 0.15)
        stream = w.chat([{"role": "user", "content": "Write a long story."}],
                        DecodeParams(mode="greedy", max_new_tokens=200))
        next(stream)  # an answer holds the engine
        out["cancel"]["switch waiting for a running answer"] = _cancel(
            w, ModelSpec("tiny", n_ctx=2048), tiny, lambda s: s.stage == "switch")
        stream.close()
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out | {"machine": machine()}, f, indent=2)


if __name__ == "__main__":
    main()
