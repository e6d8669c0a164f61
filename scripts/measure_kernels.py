"""The compiled row kernels (app/decoding/rowmath/kernels.py) against the torch backend's passes on this CPU:
ms per call on cold Qwen-sized rows (151,936), numba at 1 and 2 threads, torch at 1 and 2 threads; beside them the
norms design not taken (every row split by blocks), the cost of one call under each numba threading layer, and the
kernels' compile and cache-load times. No model needed; a few minutes on 2 cores.

    python scripts/measure_kernels.py [--rows 1 4 16 24 64] [--calls 60] [--pool-gb 1.1] [--json F]

"Cold": each call takes the next rows of a pool larger than any cache (rows a GPU copy has just written behave
so). Methods take turns in short bursts, so load from other processes falls on all of them alike; figures are
medians, with the 10th percentile beside them. The machine's load average is recorded before and after, and each
row count first waits (up to --quiet-s seconds) for the CPUs to be idle: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import _common  # noqa: F401  (the repository on sys.path)

V = 151_936
CDF_BLOCK_CELLS = 4096
KERNELS = "app.decoding.rowmath.kernels"


def load_kernels():
    """The kernels module, by its path where the package app.decoding.rowmath is not there yet (numba's cache
    records the module's name, so it is loaded under the package's name)."""
    try:
        return importlib.import_module(KERNELS)
    except ImportError:
        path = _common.ROOT_DIR / "app" / "decoding" / "rowmath" / "kernels.py"
        spec = importlib.util.spec_from_file_location(KERNELS, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[KERNELS] = mod
        spec.loader.exec_module(mod)
        return mod


def warm_times() -> dict:
    """This process: seconds to import the kernels and to warm them (compile, or load from numba's cache)."""
    t0 = time.perf_counter()
    k = load_kernels()
    t1 = time.perf_counter()
    ok, reason, _ = k.warm()
    return {"import_s": round(t1 - t0, 3), "warm_s": round(time.perf_counter() - t1, 3), "ok": ok, "reason": reason}


def compile_times() -> dict:
    """First compile and cached load, each in a fresh process, with a cache folder of their own."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("first_compile", "cached_load"):
            run = subprocess.run([sys.executable, __file__, "--warm-only"], env=env, capture_output=True, text=True,
                                 check=True)
            out[label] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def call_costs() -> dict:
    """This process, its threading layer: median us of norms on one row in cache, of 4,096 cells and of 151,936."""
    import numba

    k = load_kernels()
    k.warm()
    out = {"layer": numba.threading_layer()}
    for size in (CDF_BLOCK_CELLS, V):
        x = np.random.default_rng(0).normal(0, 2, (1, size)).astype(np.float32)
        e, eb = np.empty_like(x), np.empty((1, k.blocks(size)))
        times = []
        for _ in range(3000):
            t0 = time.perf_counter()
            k.norms(x, e, eb)
            times.append(time.perf_counter() - t0)
        out[f"norms 1 x {size} us"] = round(float(np.median(times)) * 1e6, 2)
    return out


def layers() -> list[dict]:
    """`call_costs` under each threading layer (OpenMP also with passive waiting), each in a fresh process."""
    out = []
    for env in ({"NUMBA_THREADING_LAYER": "omp"}, {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "passive"},
                {"NUMBA_THREADING_LAYER": "workqueue"}):
        run = subprocess.run([sys.executable, __file__, "--call-costs"], env=dict(os.environ, **env),
                             capture_output=True, text=True, check=True)
        out.append(env | json.loads(run.stdout.strip().splitlines()[-1]))
    return out


def idle_share(seconds: float) -> float:
    """The CPUs' idle share over `seconds` (/proc/stat; 1.0 where it cannot be read)."""
    def sample():
        try:
            f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return None
        return f[3] + f[4], sum(f)

    a = sample()
    time.sleep(seconds)
    b = sample()
    return 1.0 if a is None or b is None or b[1] == a[1] else (b[0] - a[0]) / (b[1] - a[1])


def wait_quiet(limit_s: float) -> float:
    """Wait until the CPUs are at least 90% idle over half a second, at most limit_s; the idle share found."""
    end = time.monotonic() + limit_s
    share = idle_share(0.5)
    while share < 0.9 and time.monotonic() < end:
        share = idle_share(0.5)
    return round(share, 3)


class Pool:
    """Rows taken in turn from a pool bigger than the caches."""

    def __init__(self, gb: float, seed: int = 0) -> None:
        n = max(64, int(gb * 1e9 / (4 * V)))
        rng = np.random.default_rng(seed)
        self.x = np.empty((n, V), np.float32)
        for i in range(0, n, 64):  # LLM-like rows: normal(0, 2) plus a few peaked ids
            self.x[i:i + 64] = rng.normal(0, 2, (min(64, n - i), V))
        self.x[np.arange(n), rng.integers(0, V, n)] += 14
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.x):
            self.at = 0
        self.at += n
        return self.x[self.at - n:self.at]


def timed(methods: dict, pool: Pool, n: int, calls: int, burst: int = 5) -> dict:
    """{name: (median ms, 10th percentile ms)} over `calls` calls each; methods take turns `burst` calls at a time.
    A method is (setup, fn): setup() sets its threads, fn(x) runs on fresh cold rows x."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for setup, fn in methods.values():  # first calls: buffers, dispatch
        setup()
        fn(pool.take(n))
    for _ in range(-(-calls // burst)):
        for name, (setup, fn) in methods.items():
            setup()
            for _ in range(burst):
                x = pool.take(n)
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
    return {name: (round(float(np.median(t)) * 1e3, 4), round(float(np.percentile(t, 10)) * 1e3, 4))
            for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 24, 64])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--pool-gb", type=float, default=1.1)
    ap.add_argument("--quiet-s", type=float, default=30.0)
    ap.add_argument("--json")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--call-costs", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.warm_only or a.call_costs:
        print(json.dumps(warm_times() if a.warm_only else call_costs()))
        return

    import numba
    import torch

    from app.decoding import rowmath

    out: dict = {"machine": _common.machine(), "load_before": os.getloadavg(), "compile": compile_times(),
                 "layers": layers()}
    k = load_kernels()
    k.warm()
    tr = rowmath.TorchRows("cpu")
    out |= {"numba": numba.__version__, "layer": numba.threading_layer(), "torch": torch.__version__,
            "numpy": np.__version__, "threads_max": numba.config.NUMBA_NUM_THREADS, "calls": a.calls}
    pool = Pool(a.pool_gb)
    out["pool_rows"] = len(pool.x)

    def numba_threads(t):
        return lambda: numba.set_num_threads(t)

    def torch_threads(t):
        return lambda: torch.set_num_threads(t)

    out["norms"], out["other"] = [], []
    for n in a.rows:
        idle = wait_quiet(a.quiet_s)
        e, eb = np.empty((n, V), np.float32), np.empty((n, k.blocks(V)))
        res = timed({"kernel_1t": (numba_threads(1), lambda x: k.norms(x, e, eb)),
                     "kernel_2t": (numba_threads(2), lambda x: k.norms(x, e, eb)),
                     # the design not taken: every row split by blocks, two parallel passes over all rows
                     "blocks_only_2t": (numba_threads(2), lambda x: k._norms(k._input(x, 2), e, eb, len(x) + 1)),
                     "torch_1t": (torch_threads(1), lambda x: tr._norms(torch.from_numpy(x))),
                     "torch_2t": (torch_threads(2), lambda x: tr._norms(torch.from_numpy(x)))}, pool, n, a.calls)
        row = {"rows": n, "idle_before": idle} | {f"{m}_ms": v[0] for m, v in res.items()} | {
            f"{m}_p10_ms": v[1] for m, v in res.items()}
        row["torch_2t_over_kernel_2t"] = round(row["torch_2t_ms"] / row["kernel_2t_ms"], 2)
        out["norms"].append(row)
        print(json.dumps(row), flush=True)
        if n in (1, 4, 24):
            out["other"].append(other_kernels(k, tr, pool, n, a.calls) | {"rows": n})
            print(json.dumps(out["other"][-1]), flush=True)
    out["load_after"] = os.getloadavg()
    _common.emit(out, a.json)


def other_kernels(k, tr, pool: Pool, n: int, calls: int) -> dict:
    """The other kernels against the torch operations they replace, 2 threads each, cold rows."""
    import numba
    import torch

    from app.decoding import rowmath

    numba.set_num_threads(2)
    torch.set_num_threads(2)
    e, eb = np.empty((n, V), np.float32), np.empty((n, k.blocks(V)))
    flat, fb = np.empty(n * V, np.float32), np.empty(k.blocks(n * V))
    shift, scale = np.full(n, 8.0), np.full(n, 1e-3)

    def pq(x):  # two flat laws over the same cells (cold rows, as read from memory)
        return x.reshape(-1), pool.take(n).reshape(-1)

    nothing = (lambda: None)
    res = timed({
        "exp_blocks T=0.7": (nothing, lambda x: k.exp_blocks(x, shift, 1 / 0.7, e, eb)),
        "torch _exp_blocks T=0.7": (nothing, lambda x: tr._exp_blocks(torch.from_numpy(x), shift, 1 / 0.7)),
        "scaled": (nothing, lambda x: k.scaled(x, scale, flat)),
        "torch e * scale": (nothing, lambda x: torch.from_numpy(x) * torch.from_numpy(scale.astype(np.float32))[:, None]),
        "block_sums": (nothing, lambda x: k.block_sums(x.reshape(-1), fb)),
        "torch _block_sums": (nothing, lambda x: tr._block_sums(torch.from_numpy(x.reshape(-1)))),
        "residual_blocks (M and block sums)": (nothing, lambda x: k.residual_blocks(*pq(x), 0.5, fb)),
        "torch _mass (M only)": (nothing, lambda x: rowmath._mass(tr, *map(torch.from_numpy, pq(x)), 0.5)),
    }, pool, n, calls)
    return {f"{m} ms": v[0] for m, v in res.items()}


if __name__ == "__main__":
    main()
