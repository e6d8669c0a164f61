"""A model load and the first answer after it, each run in a fresh process (the imports and the first context
count, as for a user who starts the app): the seconds `Engine.load` takes for a preset's pair, and the seconds of
a short `sample` answer after it, given at once or after a pause (a user typing the first message); with
--prepare, the contexts are made in the background after the load, as the chat app does.

    python scripts/measure_first_answer.py [--preset qwen-coder] [--runs 5] [--pause 0 3] [--prepare] [--json F]

Run it in two checkouts to compare them: each run is one process, the runs of every pause interleaved.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from _common import ROOT_DIR, emit, machine

ONE_RUN = """
import json, sys, time
from app.config import DecodeParams
from app.engine.engine import Engine, final_event
from backends.registry import ModelSpec
preset, pause, prepare = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
t0 = time.perf_counter()
engine = Engine.load(ModelSpec(source=preset).validated(), ModelSpec(source=preset).validated())
t1 = time.perf_counter()
if prepare:  # as the chat app does after a load
    import threading
    threading.Thread(target=engine.prepare, daemon=True).start()
time.sleep(pause)
t2 = time.perf_counter()
params = DecodeParams(mode="sample", max_new_tokens=4, seed=1)
final_event(engine.chat([{"role": "user", "content": "Say hi."}], params))
t3 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_answer_s": t3 - t2}))
engine.close()
"""


def one(preset: str, pause: float, prepare: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_RUN, preset, str(pause), "1" if prepare else "0"], cwd=ROOT_DIR,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen-coder")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pause", type=float, nargs="+", default=[0.0, 3.0])
    ap.add_argument("--prepare", action="store_true",
                    help="make the contexts in the background after the load (Engine.prepare), as the chat app does")
    ap.add_argument("--json")
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {str(p): [] for p in a.pause}
    for _ in range(a.runs):
        for p in a.pause:
            runs[str(p)].append(one(a.preset, p, a.prepare))
            print(json.dumps({"pause_s": p, **runs[str(p)][-1]}), file=sys.stderr)
    summary = {p: {k: round(statistics.median(r[k] for r in rs), 2) for k in ("load_s", "first_answer_s")}
               for p, rs in runs.items()}
    emit({"preset": a.preset, "prepare": a.prepare, "runs": runs, "median": summary, "machine": machine()}, a.json)


if __name__ == "__main__":
    main()
