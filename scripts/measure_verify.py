"""Where a DSBD iteration's time goes: target pass, draft passes, and the decoder's own CPU work.

Wraps the target and draft contexts with wall-clock timers and runs DSBD on a preset pair. Everything that is
not a model pass (log-softmax, warp, residual chain, width DP, verification, bookkeeping: numpy over
W x |V|) is "decoder". Prints per iteration and per verified layer, as shares of the iteration.

    python scripts/measure_verify.py --preset qwen-coder --runs 3 --max-tokens 32 [--top-k 20]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _common import load_pair, machine, pair_arguments

from app.config import DecodeParams  # noqa: E402
from app.decoding import start  # noqa: E402
from app.decoding.beams import Stopper  # noqa: E402
from app.decoding.metrics import Metrics  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash map is in two sentences.", "def quicksort(xs):\n    "]


class Timed:
    """Forwards to a context and adds the wall time of every evaluate / commit / prefill to `spent`."""

    def __init__(self, ctx) -> None:
        self.ctx, self.spent = ctx, 0.0

    def __getattr__(self, name):
        return getattr(self.ctx, name)

    def _t(self, f, *a):
        t0 = time.perf_counter()
        try:
            return f(*a)
        finally:
            self.spent += time.perf_counter() - t0

    def evaluate(self, forest):
        return self._t(self.ctx.evaluate, forest)

    def commit(self, paths):
        return self._t(self.ctx.commit, paths)

    def prefill(self, ids):
        return self._t(self.ctx.prefill, ids)


def main() -> None:
    ap = pair_arguments(runs=3, max_tokens=32)
    ap.add_argument("--modes", default="dsbd,dsbd-mem")
    ap.add_argument("--top-k", default="0,20")
    a = ap.parse_args()
    target, draft = load_pair(a.preset, a.threads)
    out = []
    for top_k in [int(k) for k in a.top_k.split(",")]:
        for mode in a.modes.split(","):
            t = Timed(target.context(rows=4, max_tokens=2048))
            d = Timed(draft.context(rows=4, max_tokens=2048))
            total = iters = layers = t_sum = d_sum = 0.0
            for i in range(a.runs):
                params = DecodeParams(mode=mode, beams=4, draft_beams=5, gamma=3, top_k=top_k, seed=i,
                                      max_new_tokens=a.max_tokens).validated()
                prompt = target.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
                m = Metrics(mode=mode)
                t.prefill(prompt[:-1])  # warm the caches: the decoder's own prefill then reuses them
                d.prefill(prompt[:-1])
                t0, ts, ds = time.perf_counter(), t.spent, d.spent
                for _ in start(params, target=t, draft=d, prompt=prompt, vocab=target.info.vocab_size,
                               stopper=Stopper(eos_ids=target.tokenizer.eos_ids), metrics=m):
                    pass
                total += time.perf_counter() - t0
                t_sum, d_sum = t_sum + t.spent - ts, d_sum + d.spent - ds
                iters += m.iterations
                layers += len(m.widths)
            t.spent, d.spent = t_sum, d_sum
            other = total - t.spent - d.spent
            row = {"mode": mode, "top_k": top_k, "iterations": iters, "layers": layers,
                   "iteration_ms": 1e3 * total / iters, "target_ms": 1e3 * t.spent / iters,
                   "draft_ms": 1e3 * d.spent / iters, "decoder_ms": 1e3 * other / iters,
                   "decoder_share": other / total, "decoder_ms_per_layer": 1e3 * other / max(layers, 1)}
            out.append(row)
            print(f"{mode:8s} top_k={top_k:<3d} iteration {row['iteration_ms']:.0f} ms: target {row['target_ms']:.0f}, "
                  f"draft {row['draft_ms']:.0f}, decoder {row['decoder_ms']:.0f} ms "
                  f"({100 * row['decoder_share']:.1f}%; {row['decoder_ms_per_layer']:.1f} ms per verified layer)",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "preset": a.preset, "runs": a.runs, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
