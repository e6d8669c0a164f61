"""The decoder's row math on synthetic rows at Qwen's vocabulary (151,936): ms per operation and per iteration,
the numpy reference and the torch backend side by side in one run, and each as a share of the rtx4090-7b and
rtx4090-1.5b target passes at that many tokens. No model needed; a minute or two on 2 cores.

    python scripts/measure_rowmath.py [--rows 4 16 64 260] [--repeats 5] [--backends numpy torch] [--json F]

Rows are peaked like an LLM's (normal(0, 2) plus 14 on 8 ids per row); the draft's rows are the target's plus
normal(0, 1) noise, so a chain of n drafts meets real rejections. "iteration" rows are what a decoder does per
iteration outside the passes: the plain steps of sample (1 row), beam-sample-repl and beam-sample (W rows), by the
general path and as the engine takes them (a backend's fused step where it has one), and a verified layer at
n = 8 and n = 32 drafts (warp p, map q onto the rows, chain, width, tests, draws).
A backend on a device (torch-cuda) reads rows already there, as it reads a PyTorch model's rows on the GPU; for it
the run also times the rows' copy to the host, pageable and pinned: what a host decoder pays for them. The JSON is
written after each row count, so a run stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import _common  # noqa: F401  (the repository on sys.path)
from app.decoding import rowmath
from app.decoding.sampling import Draft, DraftWOR, SeededRand, Warp
from app.decoding.width import layer_width
from app.engine.timing import cost_profile
from backends.cpu import cpu_id
from backends.host import keep_freed_rows

V = 151_936


def rows(rng, n: int) -> np.ndarray:
    x = rng.normal(0, 2, (n, V)).astype(np.float32)
    for r in range(n):
        x[r, rng.integers(0, V, 8)] += 14
    return x


def placed(rm, x: np.ndarray):
    """The rows where backend rm computes: on its device for a GPU backend (as a model there leaves them), else
    the host array itself."""
    if not getattr(rm, "off_host", False):
        return x
    out = rm.torch.from_numpy(x).to(rm.device)
    rm.torch.cuda.synchronize()
    return out


def to_host_ms(rm, xd, repeats: int) -> dict:
    """ms to copy device rows xd to the host: into new pageable memory (what `.cpu()` does) and into a pinned
    buffer reused (the fastest a host decoder can have them)."""
    t = rm.torch
    pinned = t.empty(xd.shape, dtype=xd.dtype, pin_memory=True)

    def pageable():
        xd.cpu()

    def into_pinned():
        pinned.copy_(xd, non_blocking=True)
        t.cuda.synchronize()

    return {"rows to the host, pageable": timed(pageable, repeats),
            "rows to the host, pinned": timed(into_pinned, repeats)}


def timed(fn, repeats: int) -> float:
    fn()  # warm: buffers, first-call dispatch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def normalisers(rows):
    """Every row's normaliser: the reference computes whole log-prob rows, the torch backend one scalar each."""
    return rows.lse_all() if hasattr(rows, "lse_all") else rows.lp


def operations(rm, x, y, scores, n_drafts: int):
    """name -> a callable doing that part of an iteration once on backend rm."""
    n = x.shape[0]
    seeded = lambda s=0: SeededRand(np.random.default_rng(s))
    warp, hot = Warp(), Warp(0.7)
    one = [[i] for i in range(n)]

    def law(w=warp):
        return rm.law(rm.rows(x), scores, w)

    def verified(without: bool, k: int):
        def run():
            p = law()
            q = rm.law(rm.rows(y), scores, warp)
            q_on = rm.on_rows(q, one, [1] * n)
            if without:
                keys, rest = q.distinct(k, seeded(1))
                drafts = [DraftWOR(int(a), float(b), float(r), True)
                          for a, b, r in zip(keys, q_on.lookup(keys), rest)]
            else:
                keys = q.sample(k, seeded(1))
                drafts = [Draft(int(a), float(b), True) for a, b in zip(keys, q_on.lookup(keys))]
            chain = rm.chain(p, q_on, k)
            width = layer_width(chain.alphas, k, 0.9, min(4, n), min(4, n))  # as DSBD reads it
            if without:
                rm.verify_without(p, q_on, drafts, min(width, len(p)), seeded(2))
            else:
                rm.verify(chain, drafts, width, seeded(2))
        return run

    def engine_step(replace: bool):
        """The decoders' plain step: the backend's fused step where it has one (`plain_step` for one row,
        `beam_step` for several), else the general path above."""
        got = None
        if n == 1 and hasattr(rm, "plain_step"):
            got = rm.plain_step(x[:1], float(scores[0]), warp, seeded())
        elif n > 1 and hasattr(rm, "beam_step"):
            got = rm.beam_step(x, scores, warp, seeded(), min(4, n), replace)
        if got is not None:
            return got
        return law().sample(min(4, n), seeded()) if replace else rm.distinct_keys(law(), min(4, n), seeded())

    def draft_layer():
        """A draft layer as DSBD's drafting takes it over these rows: the law, W_S = rows distinct draws with their
        q, and the likeliest pairs for 2 lookup nodes."""
        q = law()
        keys, _ = q.distinct(n, seeded(1)) if len(q) >= n else (q.sample(n, seeded(1)), None)
        q.lookup(keys)
        return q.top(n + 2)

    ops = {
        "normaliser (rows)": lambda: normalisers(rm.rows(x)),
        "draft layer (law, W_S distinct draws, q, likeliest pairs)": draft_layer,
        "warp T=1": lambda: law().lookup([0]),
        "warp T=0.7": lambda: law(hot).lookup([0]),
        "warp top-k 20": lambda: law(Warp(1.0, top_k=20)).lookup([0]),
        "warp top-p 0.95": lambda: law(Warp(1.0, top_p=0.95)).lookup([0]),
        "plain step, with replacement (W draws)": lambda: law().sample(min(4, n), seeded()),
        "plain step, without replacement (W draws)": lambda: rm.distinct_keys(law(), min(4, n), seeded()),
        "plain step as the engine takes it, with": lambda: engine_step(True),
        "plain step as the engine takes it, without": lambda: engine_step(False),
        f"verified layer, with, n={n_drafts}": verified(False, n_drafts),
        f"verified layer, without, n={n_drafts}": verified(True, n_drafts),
    }
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 260])
    ap.add_argument("--drafts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["numpy", "torch"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--check", action="store_true",
                    help="also check every backend against the numpy reference (p, alpha, seeded keys)")
    ap.add_argument("--json")
    a = ap.parse_args()
    keep_freed_rows()  # as the app's commands set the heap: freed rows stay for the next call
    rng = np.random.default_rng(0)
    backends = {name: rowmath.make(name) for name in a.backends}
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    profiles = {name: cost_profile(name) for name in ("rtx4090-7b", "rtx4090-1.5b")}
    out = {"cpu": _cpu(), "vocab": V, "repeats": a.repeats, "results": []}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out | {"machine": _common.machine()}, f, indent=1)

    for n in a.rows:
        x = rows(rng, n)
        y = x + rng.normal(0, 1, x.shape).astype(np.float32)
        scores = -np.sort(rng.random(n) * 3)
        for k in a.drafts:
            ms, moved = {}, {}
            for name, rm in backends.items():
                xd, yd = placed(rm, x), placed(rm, y)
                ms[name] = {op: timed(fn, a.repeats) for op, fn in operations(rm, xd, yd, scores, k).items()}
                if xd is not x and k == a.drafts[0]:
                    moved[name] = to_host_ms(rm, xd, a.repeats)
                del xd, yd
            ops = [op for op in next(iter(ms.values())) if k == a.drafts[0] or "verified" in op]
            lines = [(op, {b: ms[b][op] for b in ms}) for op in ops]
            lines += [(op, {b: moved[b][op]}) for b in moved for op in moved[b]]
            for op, by in lines:
                row = {"rows": n, "op": op, **{f"{b}_ms": round(v, 3) for b, v in by.items()}}
                if "numpy" in by and len(by) > 1:
                    for b in by:
                        if b != "numpy":
                            row[f"numpy/{b}"] = round(by["numpy"] / max(by[b], 1e-9), 1)
                for pname, prof in profiles.items():
                    pass_ms = prof.target(n) * 1e3
                    for b, v in by.items():
                        row[f"{b}/{pname} pass"] = round(v / pass_ms, 3)
                out["results"].append(row)
                print(json.dumps(row))
        save()
    # the forest policy's per-cell prices of each backend, and the same figures timed here warm (a GPU backend's
    # prices are its own timing: TorchRows.cell_seconds)
    out["cell_seconds"] = {name: {"prices": list(rm.cell_seconds),
                                  **({"timed_warm": list(rm.time_cells())} if hasattr(rm, "time_cells") else {})}
                           for name, rm in backends.items()}
    print(json.dumps(out["cell_seconds"]))
    if a.check:
        out["check"] = check(backends, rng)
        print(json.dumps(out["check"]))
    save()


def check(backends: dict, rng, trials: int = 20) -> dict:
    """Each backend against the numpy reference on 4 Qwen-sized rows: max |p - p_ref| per warp, max |alpha -
    alpha_ref| at n = 8 and 32, and how many seeded draws / verified layers gave the same keys."""
    ref = rowmath.NumpyRows()
    x = rows(rng, 4)
    y = x + rng.normal(0, 1, x.shape).astype(np.float32)
    scores = np.array([-1.0, -1.5, -3.0, -2.2])
    one = [[0], [1], [2], [3]]
    out = {}
    for name, rm in backends.items():
        if name == "numpy":
            continue
        res: dict = {"p_max_abs_diff": {}, "alpha_max_abs_diff": {}, "same_keys": {}}
        for warp in (Warp(), Warp(0.7), Warp(1.0, top_k=20), Warp(1.0, top_p=0.95)):
            pr, pt = ref.law(ref.rows(x), scores, warp), rm.law(rm.rows(x), scores, warp)
            res["p_max_abs_diff"][str(warp)] = float(np.abs(pr.lookup(pr.keys) - pt.lookup(pr.keys)).max())
            same = sum((pr.sample(4, SeededRand(np.random.default_rng(s)))
                        == pt.sample(4, SeededRand(np.random.default_rng(s)))).all()
                       and ref.distinct_keys(pr, 4, SeededRand(np.random.default_rng(s)))
                       == rm.distinct_keys(pt, 4, SeededRand(np.random.default_rng(s))) for s in range(trials))
            res["same_keys"][f"draws {warp}"] = f"{same}/{trials}"
        pr, pt = ref.law(ref.rows(x), scores, Warp()), rm.law(rm.rows(x), scores, Warp())
        qr, qt = ref.law(ref.rows(y), scores, Warp()), rm.law(rm.rows(y), scores, Warp())
        qor, qot = ref.on_rows(qr, one, [1] * 4), rm.on_rows(qt, one, [1] * 4)
        for k in (8, 32):
            cr, ct = ref.chain(pr, qor, k), rm.chain(pt, qot, k)
            res["alpha_max_abs_diff"][k] = float(np.abs(cr.alpha - ct.alpha).max())
            keys, rest = qr.distinct(k, SeededRand(np.random.default_rng(k)))
            dw = [DraftWOR(int(a), float(b), float(r), True) for a, b, r in zip(keys, qor.lookup(keys), rest)]
            dr = [Draft(int(a), float(b), True) for a, b in zip(keys, qor.lookup(keys))]
            same_w = sum(ref.verify(cr, dr, 4, SeededRand(np.random.default_rng(s)))
                         == rm.verify(ct, dr, 4, SeededRand(np.random.default_rng(s))) for s in range(trials))
            same_wo = sum(ref.verify_without(pr, qor, dw, 4, SeededRand(np.random.default_rng(s)))
                          == rm.verify_without(pt, qot, dw, 4, SeededRand(np.random.default_rng(s)))
                          for s in range(trials))
            res["same_keys"][f"verify with n={k}"] = f"{same_w}/{trials}"
            res["same_keys"][f"verify without n={k}"] = f"{same_wo}/{trials}"
        out[name] = res
    return out


def _cpu() -> dict:
    import os

    import torch

    model, _, flags = cpu_id().partition("|")
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags.split()]
    return {"model": model, "simd": simd, "cores": os.cpu_count(), "numpy": np.__version__,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
