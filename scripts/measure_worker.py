"""Per-token cost of running the models in the supervised model process (app.engine.worker).

Loads the same models twice, in this process (`Engine`) and in a model process (`WorkerEngine`), and runs
the same prompts and seeds through both, interleaved (A B, then B A, ...), consuming the stream as a client
does. Speed is what the client sees: new tokens / wall time from the call to the last event. The answers
must match token for token (the script fails otherwise). Prints a table and writes JSON.

    flock /tmp/cpu.lock python scripts/measure_worker.py [--preset tiny] [--repeats 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from app.config import DecodeParams  # noqa: E402
from backends.registry import ModelSpec  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.engine.worker import WorkerEngine  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash map is in two sentences.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Give three tips for a good night's sleep."]
MODES = {"greedy": dict(mode="greedy"), "sample": dict(mode="sample", temperature=0.8),
         "beam-sample": dict(mode="beam-sample", beams=2), "dsbd": dict(mode="dsbd", beams=2)}


def run(engine, prompt: str, params: DecodeParams) -> dict:
    t0 = time.perf_counter()
    events = 0
    last = None
    for last in engine.chat([{"role": "user", "content": prompt}], params):
        events += 1
    wall = time.perf_counter() - t0
    return {"tokens": last.tokens, "wall_s": wall, "events": events, "text": last.text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=str(ROOT_DIR / "docs" / "measurements" / "worker-overhead.json"))
    a = ap.parse_args()
    spec = ModelSpec(source=a.preset, n_ctx=a.ctx)
    inproc = Engine.load(spec, spec)
    worker = WorkerEngine.load(spec, spec)
    modes = [m for m in a.modes.split(",") if m]
    runs = []
    try:
        for params in (DecodeParams(max_new_tokens=4, **MODES[m]) for m in modes):  # warm both up
            run(inproc, PROMPTS[0], params), run(worker, PROMPTS[0], params)
        for r in range(a.repeats):
            for mode in modes:
                for i, prompt in enumerate(PROMPTS):
                    params = DecodeParams(max_new_tokens=a.max_tokens, seed=100 * r + i, **MODES[mode])
                    order = [("in_process", inproc), ("worker", worker)]
                    if (r + i) % 2:
                        order.reverse()
                    got = {name: run(eng, prompt, params) for name, eng in order}
                    if got["worker"]["text"] != got["in_process"]["text"]:
                        raise SystemExit(f"answers differ for {mode} / prompt {i} / seed {params.seed}")
                    runs.append({"mode": mode, "prompt": i, "seed": params.seed, "first": order[0][0]} |
                                {f"{k}_{f}": v[f] for k, v in got.items() for f in ("tokens", "wall_s", "events")})
    finally:
        worker.close()
        inproc.close()
    summary = {}
    for mode in modes + ["all"]:
        rs = [x for x in runs if mode in ("all", x["mode"])]
        tps = {k: sum(x[f"{k}_tokens"] for x in rs) / sum(x[f"{k}_wall_s"] for x in rs) for k in ("in_process", "worker")}
        paired = [(x["worker_tokens"] / x["worker_wall_s"]) / (x["in_process_tokens"] / x["in_process_wall_s"]) for x in rs]
        ms = {k: 1000 * sum(x[f"{k}_wall_s"] for x in rs) / sum(x[f"{k}_tokens"] for x in rs) for k in tps}
        summary[mode] = {"runs": len(rs), "in_process_tok_s": round(tps["in_process"], 2),
                         "worker_tok_s": round(tps["worker"], 2), "ratio": round(tps["worker"] / tps["in_process"], 4),
                         "median_paired_ratio": round(statistics.median(paired), 4),
                         "overhead_ms_per_token": round(ms["worker"] - ms["in_process"], 3),
                         "overhead_pct": round(100 * (1 - tps["worker"] / tps["in_process"]), 2)}
    print(f"{'mode':<12} {'in-process tok/s':>17} {'worker tok/s':>13} {'ratio':>7} {'paired':>7} {'ms/token':>9}")
    for mode, s in summary.items():
        print(f"{mode:<12} {s['in_process_tok_s']:>17.2f} {s['worker_tok_s']:>13.2f} {s['ratio']:>7.3f} "
              f"{s['median_paired_ratio']:>7.3f} {s['overhead_ms_per_token']:>+9.3f}")
    out = {"what": "client-side tok/s (new tokens / wall time from the call to the last event), same prompts and "
                   "seeds in-process and through the model process, interleaved; answers identical",
           "command": "flock /tmp/cpu.lock python scripts/measure_worker.py " + " ".join(sys.argv[1:]),
           "preset": a.preset, "max_new_tokens": a.max_tokens, "repeats": a.repeats, "machine": platform.machine(),
           "python": platform.python_version(), "summary": summary, "runs": runs}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
