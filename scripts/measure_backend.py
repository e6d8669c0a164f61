"""Backend cost of one forward pass: single-token decode time and the cost of scoring N tokens at once.

Backend-agnostic: `scoring_cost` only uses the protocol (context / prefill / evaluate / truncate), so the
same numbers can be taken for any runtime. Run:

    python scripts/measure_backend.py --threads 2            # the embedded tiny GGUF through llama.cpp
    python scripts/measure_backend.py --backend pytorch      # the same file, dequantised, in PyTorch
    python scripts/measure_backend.py --model qwen-coder --shape chain   # a preset's target
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

from backends.base import ROOT, Forest


def scoring_cost(model, ns: Sequence[int] = (1, 8, 32, 64), *, context: int = 200, repeats: int = 7,
                 shape: str = "flat", stat: Callable[[list[float]], float] = statistics.median,
                 **context_kw) -> dict[int, float]:
    """Seconds of one evaluate() scoring n new tokens after `context` cached tokens (`stat` of the runs).

    shape "flat": n siblings under the row (a wide forest layer); "chain": one path of n nodes. Use
    stat=min on a shared machine: other processes only ever add time.
    """
    vocab = model.info.vocab_size
    ids = [(i * 7919) % (vocab - 200) + 100 for i in range(context)]  # arbitrary but fixed tokens
    out = {}
    with model.context(rows=1, max_tokens=context + max(ns) + 8, **context_kw) as ctx:
        ctx.prefill(ids)
        for n in ns:
            toks = tuple(ids[(i * 13) % context] for i in range(n))
            parents = (ROOT,) * n if shape == "flat" else (ROOT,) + tuple(range(n - 1))
            forest = Forest(tokens=toks, parents=parents, rows=(0,) * n)
            times = []
            for _ in range(repeats + 1):  # the first run warms caches and is dropped
                t = time.perf_counter()
                ctx.evaluate(forest)
                times.append(time.perf_counter() - t)
                ctx.truncate(context)  # drop the pending nodes, keep the prompt
            out[n] = stat(times[1:])
    return out


def report(costs: dict[int, float]) -> str:
    one = costs[min(costs)]
    return "\n".join(f"  n={n:3d}: {t * 1e3:8.2f} ms  ({t / one:5.2f}x one token)" for n, t in costs.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset or GGUF file (default: the embedded tiny SmolLM2-135M)")
    ap.add_argument("--backend", choices=("llamacpp", "pytorch"), default="llamacpp")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=("flat", "chain"), default="flat")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kv-type", choices=("f32", "f16"), default=None)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--ns", default="1,8,32,64", help="tokens per pass to time, comma-separated")
    ap.add_argument("--batch", type=int, default=None, help="llama.cpp n_batch = n_ubatch of the context")
    ap.add_argument("--json", help="also write {n: seconds} and the settings here")
    args = ap.parse_args()
    ns = tuple(int(n) for n in args.ns.split(","))

    from app.config import ModelSpec
    from backends.registry import load_model

    if args.backend == "pytorch":
        import torch

        torch.set_num_threads(args.threads)
    spec = ModelSpec(source=args.model, backend=args.backend, dtype=args.dtype, n_threads=args.threads)
    model = load_model(spec)
    kw = {}
    if args.backend == "llamacpp":
        kw = {"flash_attn": args.flash_attn, **({"kv_type": args.kv_type} if args.kv_type else {}),
              **({"n_batch": args.batch} if args.batch else {})}
    try:
        costs = scoring_cost(model, ns, context=args.context, repeats=args.repeats, shape=args.shape,
                             stat=statistics.median if args.stat == "median" else min, **kw)
    finally:
        model.close()
    print(f"{model.info.name} ({args.backend}, {args.dtype if args.backend == 'pytorch' else 'gguf'}): {args.threads} threads, {args.shape} forest after {args.context} tokens, "
          f"{args.stat} of {args.repeats}, {kw}")
    print(report(costs))
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps({"model": model.info.name, "settings": vars(args), "context_kw": kw,
                                               "seconds": costs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
