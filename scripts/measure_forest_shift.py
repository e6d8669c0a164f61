"""How far llama.cpp's forest pass moves the target's distribution.

Runs DSBD on a preset pair with the target wrapped in a recorder, then scores every query the forest pass
answered (root suffixes and draft nodes) again from scratch, one sequence per pass, and compares the two
next-token distributions: KL(sequential || forest), total variation, max |logit difference|, top-1 agreement.

    python scripts/measure_forest_shift.py --preset qwen-coder --runs 20 --json docs/measurements/qwen-forest-shift.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from _common import load_pair, machine, pair_arguments

from app.config import DecodeParams  # noqa: E402
from app.decoding import decoder  # noqa: E402
from app.decoding.beams import Stopper  # noqa: E402
from app.decoding.metrics import Metrics  # noqa: E402
from app.decoding.sampling import log_softmax  # noqa: E402
from real_pair import Recorder, SequentialModel  # noqa: E402

PROMPTS = ["My favourite animal is the", "def fibonacci(n):\n    ", "The capital of France is"]


def main() -> None:
    ap = pair_arguments(runs=12, max_tokens=8)
    a = ap.parse_args()
    target, draft = load_pair(a.preset, a.threads)
    vocab = target.info.vocab_size
    settings = {"narrow (W 2, W_S 3, gamma 3, W_min 2, t 0)": dict(beams=2, draft_beams=3, min_beams=2, threshold=0.0),
                "defaults (W 4, W_S 5, gamma 3)": dict(beams=4, draft_beams=5)}
    seen = {}
    for name, kw in settings.items():
        rec = Recorder(target.context(rows=kw["beams"], max_tokens=1024), vocab)
        d = draft.context(rows=kw["beams"], max_tokens=1024)
        for i in range(a.runs):
            params = DecodeParams(mode="dsbd", seed=i, max_new_tokens=a.max_tokens, gamma=3, **kw).validated()
            prompt = target.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
            for _ in decoder("dsbd")(target=rec, draft=d, prompt=prompt, params=params,
                                     stopper=Stopper(eos_ids=target.tokenizer.eos_ids), metrics=Metrics(mode="dsbd"),
                                     vocab=vocab):
                pass
        seen[name] = rec.seen
    seq = SequentialModel(target, n_ctx=1024)
    report = {}
    for name, pairs in seen.items():
        kl, tv, dl, top1 = [], [], [], []
        for s, forest_logits in pairs:
            ref = seq.score(s)
            lp, lq = log_softmax(ref), log_softmax(forest_logits)
            p, q = np.exp(lp), np.exp(lq)
            kl.append(float(np.sum(p * (lp - lq))))
            tv.append(0.5 * float(np.abs(p - q).sum()))
            dl.append(float(np.max(np.abs(ref - forest_logits))))
            top1.append(int(np.argmax(ref) == np.argmax(forest_logits)))
        q = lambda x: {"mean": float(np.mean(x)), "p50": float(np.median(x)),  # noqa: E731
                       "p95": float(np.quantile(x, 0.95)), "max": float(np.max(x))}
        report[name] = {"queries": len(pairs), "kl": q(kl), "tv": q(tv), "max_abs_logit": q(dl),
                        "top1_agree": float(np.mean(top1))}
        r = report[name]
        print(f"{name}: {r['queries']} queries; KL mean {r['kl']['mean']:.2e} p95 {r['kl']['p95']:.2e} "
              f"max {r['kl']['max']:.2e}; TV mean {r['tv']['mean']:.3f} p95 {r['tv']['p95']:.3f} "
              f"max {r['tv']['max']:.3f}; max |dlogit| {r['max_abs_logit']['max']:.2f}; "
              f"top-1 agree {r['top1_agree']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "preset": a.preset, "runs": a.runs, "max_tokens": a.max_tokens,
                                            "report": report}, indent=1))


if __name__ == "__main__":
    main()
