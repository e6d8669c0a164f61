"""Pass costs learnt from answers: how well the warm-up's timed curve, and the curve corrected by the answers
before, predict each answer's passes. The engine loads a target, times its passes (or reads the timing cache),
then answers the code suite with one mode; before every answer both curves price that answer's passes, and the
answer's own timed passes say who was closer.

    python scripts/measure_learnt_costs.py [--target qwen-coder] [--mode preset:Balanced] [--prompts 6]
                                           [--max-tokens 64] [--threads 2] [--json F]

Error: per answer, the pass-weighted mean of |predicted - measured| / measured over the token counts its passes
scored (each count's median pass). The cache folder is a fresh temporary one unless $DSBD_CHAT_CACHE is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from _common import emit, machine


def error(curve, passes: dict, seconds: dict) -> float:
    total = sum(passes[n] for n in seconds)
    return sum(passes[n] * abs(curve(n) - s) / s for n, s in seconds.items()) / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen-coder")
    ap.add_argument("--mode", default="preset:Balanced")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("DSBD_CHAT_CACHE", tempfile.mkdtemp(prefix="dsbd-costs-"))
    from app.compare.bench import load_suite, parse_mode, prompt_text
    from app.config import DecodeParams
    from app.engine.engine import Engine
    from backends.registry import ModelSpec

    engine = Engine.load(ModelSpec(source=a.target, n_threads=a.threads))
    try:
        timed, _ = engine.costs()
        learner = engine.policy.passes[0]
        base = DecodeParams(max_new_tokens=a.max_tokens, seed=1, temperature=1.0)
        _, params = parse_mode(a.mode, base, engine.machine_class())
        rows = []
        for i, item in enumerate(load_suite("code")[: a.prompts]):
            before = engine.policy.target_cost
            ids = engine.encode([{"role": "user", "content": prompt_text(item)}])
            *_, last = engine.generate(ids, params)
            s = last.stats
            seconds = {int(n): v for n, v in s["pass_s_by_tokens"].items()}
            passes = {int(n): c for n, c in s["passes_by_tokens"].items()}
            rows.append({"answer": i, "tokens": s["new_tokens"], "passes_by_tokens": passes,
                         "median_pass_s": seconds, "error_timed": error(timed, passes, seconds),
                         "error_learnt": error(before, passes, seconds)})
            print(json.dumps(rows[-1]), flush=True)
        out = {"machine": machine(), "target": a.target, "mode": a.mode, "threads": a.threads,
               "timed": dict(timed.points), "learnt": dict(engine.policy.target_cost.points),
               "factors": {n: learner.factor(n) for n in learner.timed}, "answers": rows,
               "mean_error_timed": sum(r["error_timed"] for r in rows[1:]) / max(1, len(rows) - 1),
               "mean_error_learnt": sum(r["error_learnt"] for r in rows[1:]) / max(1, len(rows) - 1)}
    finally:
        engine.close()
    emit(out, a.json)


if __name__ == "__main__":
    main()
