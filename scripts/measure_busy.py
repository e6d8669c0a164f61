"""A busy machine: llama.cpp pass times idle and beside a bounded busy loop on one core, threads pinned to the
physical cores vs auto (the runtime's governor, backends/llamacpp/_native.py ThreadGovernor).

    python scripts/measure_busy.py [--preset qwen-coder] [--passes 20] [--rows 1] [--json F]

The busy loop is a child process spinning for at most --busy-s seconds (it stops by itself); each arm scores
--passes one-token passes per row on a context of --rows rows and reports the median ms and tokens/s.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import _common  # noqa: F401

from backends import llamacpp
from backends.base import AcceptedPath, Forest
from backends.modelfiles.resolution import resolve
from backends.registry import ModelSpec

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def passes(model, rows: int, n: int) -> list[float]:
    ctx = model.context(rows=rows, max_tokens=512)
    ctx.prefill(list(range(100, 164)))
    if rows > 1:
        ctx.commit([AcceptedPath(0)] * rows)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        ctx.evaluate(Forest(suffix=tuple((200 + i,) for _ in range(rows))))
        out.append(time.perf_counter() - t0)
        ctx.commit([AcceptedPath(r) for r in range(rows)])
    ctx.close()
    return out


def main() -> None:
    ap = _common.pair_arguments(runs=1, max_tokens=0)
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--busy-s", type=float, default=120.0)
    a = ap.parse_args()
    path = resolve(a.preset, role="target").path
    results = []
    for label, threads in (("pinned", a.threads), ("auto", None)):
        model = llamacpp.load(path, ModelSpec(source=a.preset, n_threads=threads))
        passes(model, a.rows, 3)  # warm
        idle = statistics.median(passes(model, a.rows, a.passes))
        busy_proc = subprocess.Popen([sys.executable, "-c", SPIN.format(s=a.busy_s)])
        try:
            time.sleep(1.0)  # the governor reads the load over its interval
            busy = statistics.median(passes(model, a.rows, a.passes))
        finally:
            busy_proc.kill()
            busy_proc.wait()
        threads_now = model.governor.current if model.governor is not None else threads
        row = {"threads": label if threads is None else threads, "threads_beside_busy": threads_now,
               "idle_ms": round(idle * 1e3, 1), "busy_ms": round(busy * 1e3, 1),
               "busy_speed_vs_idle": round(idle / busy, 3)}
        print(json.dumps(row))
        results.append(row)
        model.close()
        time.sleep(1.0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": _common.machine(), "preset": a.preset, "rows": a.rows, "passes": a.passes, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
