"""`sample` against llama.cpp's own generation loop: the same model file, threads and token count, one process,
the loops interleaved run by run.

    python scripts/measure_plain.py [--preset qwen-coder] [--max-tokens 128] [--runs 5] [--threads 2] [--supervised]
                                    [--json F]

llama.cpp's loop is what a llama.cpp user gets and nothing more: a context with llama.cpp's default settings,
one `llama_decode` of one token per step and llama.cpp's own sampler chain (a draw from the softmax at T 1).
The same loop runs a second time on the context the engine makes, so the report separates what that context
costs (its exact numerics) from what the decoder costs. dsbd-chat's is the engine's `sample` mode end to end
(the decoder, the stop checks, detokenising, the events), its decode time as the bench counts it (after the
prefill, to the last token). All prefill the prompt but its last token, then score one token per generated
token, so they do the same passes; their tokens differ (two samplers, two streams), which moves a pass's time
only through the KV length, the same for all.
"""

from __future__ import annotations

import json
import statistics
import time

import _common  # noqa: F401

import llama_cpp.llama_cpp as ll

from app.config import DecodeParams
from app.engine.engine import final_event

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def llama_loop(model, prompt: list[int], n: int, threads: int, seed: int, *, ours_ctx: bool = False) -> float:
    """Seconds for n generated tokens with llama.cpp's own loop after prefilling prompt[:-1], on a context with
    llama.cpp's defaults, or (ours_ctx) on the context the engine makes (f32 cache, plain attention, one unified
    cell pool, 256 sequence ids: what exact forests need)."""
    own = model.context(rows=1, max_tokens=len(prompt) + n + 8) if ours_ctx else None
    if own is not None:
        ctx = own._ctx
    else:
        p = ll.llama_context_default_params()
        p.n_ctx = len(prompt) + n + 8
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        ctx = ll.llama_init_from_model(model._h.ptr, p)
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
    try:
        head = (ll.llama_token * (len(prompt) - 1))(*prompt[:-1])
        if ll.llama_decode(ctx, ll.llama_batch_get_one(head, len(prompt) - 1)) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        one = (ll.llama_token * 1)(prompt[-1])
        t0 = time.perf_counter()
        for _ in range(n):
            if ll.llama_decode(ctx, ll.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
            one[0] = ll.llama_sampler_sample(chain, ctx, -1)
        return time.perf_counter() - t0
    finally:
        ll.llama_sampler_free(chain)
        if own is not None:
            own.close()
        else:
            ll.llama_free(ctx)


def ours(engine, n: int, seed: int) -> tuple[float, int]:
    """(decode seconds, tokens) of the engine's sample mode on the chat prompt."""
    params = DecodeParams(mode="sample", max_new_tokens=n, temperature=1.0, seed=seed)
    last = final_event(engine.chat([{"role": "user", "content": PROMPT}], params))
    return last.stats["decode_s"], last.stats["new_tokens"]


def main() -> None:
    ap = _common.pair_arguments(runs=5, max_tokens=128)
    ap.add_argument("--supervised", action="store_true", help="the engine in a model process, as the chat runs it")
    a = ap.parse_args()
    from backends import llamacpp
    from backends.modelfiles.resolution import resolve
    from backends.registry import ModelSpec
    from app.cli import open_engine

    spec = ModelSpec(source=a.preset, n_threads=a.threads).validated()  # the preset's target, no draft
    engine = open_engine(spec, None, supervised=a.supervised)
    model = llamacpp.load(resolve(a.preset, role="target").path, spec)
    prompt = engine.encode([{"role": "user", "content": PROMPT}])  # the chat's prompt, as `ours` sends it
    rows = []
    try:
        ours(engine, 8, 0)  # warm all three: first-use allocations stay out of the figures
        llama_loop(model, prompt, 8, a.threads, 0)
        llama_loop(model, prompt, 8, a.threads, 0, ours_ctx=True)
        for r in range(a.runs):
            s_ours, n = ours(engine, a.max_tokens, r)
            s_llama = llama_loop(model, prompt, max(n, 1), a.threads, r)
            s_same = llama_loop(model, prompt, max(n, 1), a.threads, r, ours_ctx=True)
            row = {"run": r, "tokens": n, "ours_tok_s": n / s_ours, "llama_tok_s": n / s_llama,
                   "llama_on_our_context_tok_s": n / s_same, "ours_vs_llama": s_llama / s_ours,
                   "ours_vs_llama_on_our_context": s_same / s_ours}
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
            rows.append(row)
    finally:
        engine.close()
        model.close()
    def overall(key: str) -> float:  # the baseline's seconds over ours, over all tokens of all runs
        return sum(r["tokens"] / r[key] for r in rows) / sum(r["tokens"] / r["ours_tok_s"] for r in rows)

    ratios = [r["ours_vs_llama"] for r in rows]
    same = [r["ours_vs_llama_on_our_context"] for r in rows]
    summary = {"ours_vs_llama_median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
               "overall": overall("llama_tok_s"),
               "ours_vs_llama_on_our_context_median": statistics.median(same),
               "on_our_context_overall": overall("llama_on_our_context_tok_s"),
               "context_cost": overall("llama_tok_s") / overall("llama_on_our_context_tok_s")}
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": _common.machine(), "preset": a.preset, "threads": a.threads,
                       "max_tokens": a.max_tokens, "supervised": a.supervised, "prompt": PROMPT, "runs": rows,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
