"""Backend cost of one forward pass: single-token decode time and the cost of scoring N tokens at once.

Backend-agnostic: `scoring_cost` only uses the protocol (context / prefill / evaluate / truncate), so the
same numbers can be taken for any runtime. Run:

    python scripts/measure_backend.py --threads 2            # the embedded tiny GGUF through llama.cpp
    python scripts/measure_backend.py --backend pytorch      # the same file, dequantised, in PyTorch
    python scripts/measure_backend.py --model qwen-coder --shape chain   # a preset's target
    python scripts/measure_backend.py --model qwen-coder --role draft --quant q4_0 --stat min --ns 1,4,8
    python scripts/measure_backend.py --model qwen-coder --role draft --head-share     # the vocabulary head's cost
    python scripts/measure_backend.py --model qwen-coder --role draft --quant q4_0 --overlap-with qwen-coder
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence


def scoring_cost(model, ns: Sequence[int] = (1, 8, 32, 64), *, context: int = 200, repeats: int = 7,
                 shape: str = "flat", stat: Callable[[list[float]], float] = statistics.median,
                 **context_kw) -> dict[int, float]:
    """Seconds of one evaluate() scoring n new tokens after `context` cached tokens (`stat` of the runs):
    app.engine.timing.measure_costs, the loop auto mode and the forest policy are timed with.

    shape "flat": n siblings under the row (a wide forest layer); "chain": one path of n nodes. Use
    stat=min on a shared machine: other processes only ever add time.
    """
    from app.engine.timing import measure_costs

    return measure_costs(model, ns, context=context, repeats=repeats, shape=shape, stat=stat, **context_kw)


def interleaved_costs(models: dict, ns: Sequence[int], *, context: int = 200, repeats: int = 7,
                      stat=min, clock=time.perf_counter) -> dict[str, dict[int, float]]:
    """scoring_cost for several models at once, round-robin pass by pass, so a busy machine slows them alike
    (clock=time.process_time with one thread: CPU seconds, which other processes barely change)."""
    from backends.base import ROOT, Forest

    ctxs, ids = {}, {}
    for label, model in models.items():
        vocab = model.info.vocab_size
        ids[label] = [(i * 7919) % (vocab - 200) + 100 for i in range(context)]
        ctxs[label] = model.context(rows=1, max_tokens=context + max(ns) + 8)
        ctxs[label].prefill(ids[label])
    times: dict = {label: {n: [] for n in ns} for label in models}
    try:
        for r in range(repeats + 1):
            for n in ns:
                for label, ctx in ctxs.items():
                    forest = Forest(tokens=tuple(ids[label][(i * 13) % context] for i in range(n)),
                                    parents=(ROOT,) * n, rows=(0,) * n)
                    t = clock()
                    ctx.evaluate(forest)
                    if r:  # the first round warms caches and is dropped
                        times[label][n].append(clock() - t)
                    ctx.truncate(context)
    finally:
        for ctx in ctxs.values():
            ctx.close()
    return {label: {n: stat(ts) for n, ts in by_n.items()} for label, by_n in times.items()}


def head_share(path, *, threads: int, context: int = 200, repeats: int = 7, stat=min,
               clock=time.perf_counter) -> dict[str, float]:
    """One-token decode seconds with the output head (logits requested) and without (no output row: llama.cpp
    then skips the vocabulary matmul), on the raw llama.cpp API; the difference is the head's cost."""
    import llama_cpp.llama_cpp as ll

    import backends.llamacpp._native  # noqa: F401  quiet logging and backend init
    from backends.llamacpp import probe

    mp = ll.llama_model_default_params()
    mp.use_extra_bufts = probe.decide(Path(path)).extra_bufts
    model = ll.llama_model_load_from_file(str(path).encode(), mp)
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = context + 16, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, cp)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    mem = ll.llama_get_memory(ctx)

    def decode(start: int, n: int, logits_last: bool) -> None:
        batch = ll.llama_batch_init(n, 0, 1)
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = (start + i) * 7919 % (n_vocab - 200) + 100, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = logits_last and i == n - 1
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        ll.llama_batch_free(batch)

    decode(0, context, True)
    times: dict = {"with_head": [], "without_head": []}
    for r in range(repeats + 1):  # alternating, so a busy machine slows both alike
        for label, with_head in (("with_head", True), ("without_head", False)):
            t = clock()
            decode(context, 1, with_head)
            if r:
                times[label].append(clock() - t)
            ll.llama_memory_seq_rm(mem, 0, context, -1)
    out = {label: stat(ts) for label, ts in times.items()}
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return out


def head_rows_loadable(path, rows: int, folder: Path) -> str:
    """Copy the GGUF with its output matrix (the vocabulary head) cut to its first `rows` rows, everything else
    unchanged, and try to load it: whether llama.cpp can run a head over a subset of ids (FR-Spec style)."""
    import gguf
    import llama_cpp.llama_cpp as ll

    from backends.llamacpp._native import take_errors

    reader = gguf.GGUFReader(str(path), "r")
    dest = folder / f"{Path(path).stem}.head{rows}.gguf"
    writer = gguf.GGUFWriter(str(dest), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    data = {t.name: (t.data[:rows] if t.name == "output.weight" else t.data) for t in reader.tensors}
    for t in reader.tensors:
        writer.add_tensor_info(t.name, data[t.name].shape, data[t.name].dtype, data[t.name].nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(data[t.name], tensor_endianess=reader.endianess)
    writer.close()
    try:
        mp = ll.llama_model_default_params()
        mp.use_extra_bufts = False
        take_errors()
        model = ll.llama_model_load_from_file(str(dest).encode(), mp)
        if not model:
            return f"rejected: {take_errors() or 'no log'}"
        ll.llama_model_free(model)
        return "loaded"
    finally:
        dest.unlink(missing_ok=True)


def overlap(target, draft, text: str, *, positions: int = 256) -> float:
    """Mean over the positions of `text` of sum_x min(p(x), q(x)) at temperature 1: the chance that a single
    draft token is accepted (spec §5), comparable between drafts of one target."""
    import numpy as np

    from backends.base import ROOT, Forest

    ids = target.tokenizer.encode(text)[: positions + 1]
    rows = []
    for model in (target, draft):
        with model.context(rows=1, max_tokens=len(ids) + 8) as ctx:
            ctx.prefill(ids[:1])
            n = len(ids) - 1
            lg = ctx.evaluate(Forest(tokens=tuple(ids[1:]), parents=(ROOT,) + tuple(range(n - 1)), rows=(0,) * n))
            z = np.concatenate([lg.roots[:1], lg.nodes[:-1]]).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        rows.append(p / p.sum(axis=1, keepdims=True))
    v = min(rows[0].shape[1], rows[1].shape[1])
    return float(np.minimum(rows[0][:, :v], rows[1][:, :v]).sum(axis=1).mean())


def report(costs: dict[int, float]) -> str:
    one = costs[min(costs)]
    return "\n".join(f"  n={n:3d}: {t * 1e3:8.2f} ms  ({t / one:5.2f}x one token)" for n, t in costs.items())


# Mixed prose and code for --overlap-with (the chat and code suites' kind of text).
SAMPLE = """Beam search keeps the most likely partial answers at every step. Here is a small Python function
that returns the k largest numbers of a list, with a test:

def top_k(values: list[float], k: int) -> list[float]:
    \"\"\"The k largest values, largest first.\"\"\"
    if k <= 0:
        return []
    return sorted(values, reverse=True)[:k]


def test_top_k():
    assert top_k([3, 1, 4, 1, 5, 9, 2, 6], 3) == [9, 6, 5]
    assert top_k([], 2) == []

The function sorts the whole list, which costs O(n log n); for a small k a heap is faster, since heapq.nlargest
keeps only k items while it walks the list once. Both return the same values in the same order."""


def compare_quants(args, source: str, ns: Sequence[int], stat) -> None:
    """--quant a,b,c: each copy's pass costs (interleaved), head share and overlap with --overlap-with."""
    import json

    from backends.llamacpp.quantize import requantized
    from backends.modelfiles.presets import cache_dir
    from backends.registry import ModelSpec, load_model

    files = {q: source if q == "none" else str(requantized(Path(source), q, folder=cache_dir()))
             for q in args.quant.split(",")}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    result: dict = {"settings": vars(args), "files": files}
    if args.head_share:
        result["head_share"] = {q: head_share(f, threads=args.threads, context=args.context, repeats=args.repeats,
                                              stat=stat, clock=clock) for q, f in files.items()}
    models = {q: load_model(ModelSpec(source=f, n_threads=args.threads), role=args.role) for q, f in files.items()}
    try:
        result["seconds"] = interleaved_costs(models, ns, context=args.context, repeats=args.repeats, stat=stat,
                                              clock=clock)
        if args.overlap_with:
            target = load_model(ModelSpec(source=args.overlap_with, n_threads=args.threads))
            try:
                result["overlap"] = {q: overlap(target, m, SAMPLE) for q, m in models.items()}
            finally:
                target.close()
    finally:
        for m in models.values():
            m.close()
    base = next(iter(files))
    print(f"{args.threads} threads, flat forest after {args.context} tokens, {args.stat} of {args.repeats} "
          f"(interleaved, {args.clock} seconds); relative to {base}")
    for q in files:
        costs = result["seconds"][q]
        row = "  ".join(f"n={n}: {s * 1e3:7.2f} ms ({s / result['seconds'][base][n]:4.2f}x)" for n, s in costs.items())
        print(f"  {q:10s} {row}")
        if args.head_share:
            h = result["head_share"][q]
            head = h["with_head"] - h["without_head"]
            print(f"  {'':10s} one-token pass {h['with_head'] * 1e3:.2f} ms, without the head {h['without_head'] * 1e3:.2f} "
                  f"ms: head {head / h['with_head']:.0%}")
        if args.overlap_with:
            print(f"  {'':10s} mean sum(min(p, q)) against {args.overlap_with}: {result['overlap'][q]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="preset or GGUF file (default: the embedded tiny SmolLM2-135M)")
    ap.add_argument("--role", choices=("target", "draft"), default="target", help="which file of a preset")
    ap.add_argument("--quant", default=None,
                    help="time a requantized copy of the file (llama.cpp quantize API, cached beside the original): "
                         "q4_0, q4_0-head (the vocabulary head too), q8_0, q4_k_m; a comma list (\"none\" = the file "
                         "itself) times them interleaved, pass by pass")
    ap.add_argument("--head-share", action="store_true",
                    help="time one-token passes with and without the vocabulary head (llama.cpp only)")
    ap.add_argument("--head-rows", type=int, default=None, metavar="K",
                    help="only check whether llama.cpp loads a copy whose vocabulary head keeps its first K rows")
    ap.add_argument("--overlap-with", default=None, metavar="TARGET",
                    help="also report the mean sum(min(p, q)) against this target (preset or GGUF) on a sample text")
    ap.add_argument("--backend", choices=("llamacpp", "pytorch"), default="llamacpp")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=("flat", "chain"), default="flat")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kv-type", choices=("f32", "f16"), default=None)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="with --quant a,b: cpu = process CPU seconds (use --threads 1: robust on a busy machine)")
    ap.add_argument("--ns", default="1,8,32,64", help="tokens per pass to time, comma-separated")
    ap.add_argument("--batch", type=int, default=None, help="llama.cpp n_batch = n_ubatch of the context")
    ap.add_argument("--json", help="also write {n: seconds} and the settings here")
    args = ap.parse_args()
    ns = tuple(int(n) for n in args.ns.split(","))
    stat = statistics.median if args.stat == "median" else min

    from backends.modelfiles.resolution import resolve
    from backends.registry import ModelSpec, load_model

    source = args.model
    if args.quant or args.head_share or args.role == "draft":
        source = str(resolve(args.model, role=args.role).path)
    if args.head_rows:
        import tempfile

        import backends.llamacpp._native  # noqa: F401  log routing (the loader's message is the answer)

        with tempfile.TemporaryDirectory() as tmp:
            print(f"{source} with a {args.head_rows}-row head: {head_rows_loadable(source, args.head_rows, Path(tmp))}")
        return
    if args.quant and "," in args.quant:
        compare_quants(args, source, ns, stat)
        return
    if args.quant:
        from backends.llamacpp.quantize import requantized
        from backends.modelfiles.presets import cache_dir

        source = str(requantized(Path(source), args.quant, folder=cache_dir()))
        print(f"requantized copy: {source}")
    if args.backend == "pytorch":
        import torch

        torch.set_num_threads(args.threads)
    result: dict = {"file": source, "settings": vars(args)}
    if args.head_share:
        share = head_share(source, threads=args.threads, context=args.context, repeats=args.repeats, stat=stat)
        head = share["with_head"] - share["without_head"]
        print(f"one-token pass: {share['with_head'] * 1e3:.2f} ms with the head, {share['without_head'] * 1e3:.2f} ms "
              f"without: the head is {head * 1e3:.2f} ms, {head / share['with_head']:.0%} of the pass ({args.stat} of "
              f"{args.repeats}, {args.threads} threads)")
        result["head_share"] = share
    spec = ModelSpec(source=source, backend=args.backend, dtype=args.dtype, n_threads=args.threads)
    model = load_model(spec, role=args.role)
    kw = {}
    if args.backend == "llamacpp":
        kw = {"flash_attn": args.flash_attn, **({"kv_type": args.kv_type} if args.kv_type else {}),
              **({"n_batch": args.batch} if args.batch else {})}
    try:
        costs = scoring_cost(model, ns, context=args.context, repeats=args.repeats, shape=args.shape, stat=stat, **kw)
        if args.overlap_with:
            target = load_model(ModelSpec(source=args.overlap_with, n_threads=args.threads))
            try:
                result["overlap"] = overlap(target, model, SAMPLE)
            finally:
                target.close()
    finally:
        model.close()
    kind = args.dtype if args.backend == "pytorch" else "gguf"
    print(f"{model.info.name} ({args.backend}, {kind}): {args.threads} threads, {args.shape} forest after "
          f"{args.context} tokens, {args.stat} of {args.repeats}, {kw}")
    print(report(costs))
    if "overlap" in result:
        print(f"mean sum(min(p, q)) against {args.overlap_with} on the sample text: {result['overlap']:.4f}")
    if args.json:
        import json

        result |= {"model": model.info.name, "context_kw": kw, "seconds": costs}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
