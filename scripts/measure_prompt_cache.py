"""Whether a seeded answer depends on what the engine answered before, and what a prompt keeps of the cache.

For each mode: the second code prompt answered in a fresh engine, and again in an engine that answered the
first one before it (same seed); then a three-turn chat in one engine, with the prompt tokens each turn's
prefill wrote (the target's context) and the answers' texts.

    python scripts/measure_prompt_cache.py --preset qwen-coder --modes "beam-sample,sample" --max-tokens 48 \
        --json docs/measurements/prompt-cache-qwen.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from _common import ROOT_DIR, emit, machine

FOLLOW_UPS = ["Now make it shorter.", "Add a docstring."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen-coder")
    ap.add_argument("--modes", default="beam-sample,sample")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()

    import backends.llamacpp.runtime as runtime
    from app.cli import open_engine
    from app.compare.bench import parse_mode
    from app.config import DecodeParams
    from app.engine.engine import final_event
    from backends.registry import ModelSpec

    written: list[int] = []  # prompt tokens each target prefill wrote
    prefill, decode = runtime.LlamaContext.prefill, runtime.LlamaContext._decode
    state = {"in": None}

    def counted_prefill(self, ids):
        state["in"] = self if self._model is engine_target[0] else None
        try:
            return prefill(self, ids)
        finally:
            state["in"] = None

    def counted_decode(self, tokens, *rest):
        if state["in"] is self:
            written[-1] += len(tokens)
        return decode(self, tokens, *rest)

    runtime.LlamaContext.prefill, runtime.LlamaContext._decode = counted_prefill, counted_decode
    engine_target = [None]
    spec = ModelSpec(source=a.preset).validated()
    tasks = json.loads((ROOT_DIR / "assets/bench/code.json").read_text())["tasks"]
    first, second = ([{"role": "user", "content": tasks[i]["prompt"]}] for i in (0, 1))

    def engine():
        eng = open_engine(spec, spec if a.preset != "tiny" else None)
        engine_target[0] = eng.target
        return eng

    def answer(eng, msgs, params):
        written.append(0)
        t = time.perf_counter()
        ev = final_event(eng.chat(msgs, params))
        return {"text_sha1": hashlib.sha1(ev.text.encode()).hexdigest()[:12], "prompt_tokens_written": written[-1],
                "seconds": round(time.perf_counter() - t, 2)}, ev.text

    out = {"machine": machine(), "preset": a.preset, "max_tokens": a.max_tokens, "seed": a.seed, "modes": {}}
    for mode in a.modes.split(","):
        _, params = parse_mode(mode, DecodeParams(temperature=1.0, beams=4, max_new_tokens=a.max_tokens,
                                                  seed=a.seed), machine="cpu")
        eng = engine()
        fresh, _ = answer(eng, second, params)
        eng.close()
        eng = engine()
        before, _ = answer(eng, first, params)
        after, text = answer(eng, second, params)
        msgs, turns = second, []
        for follow in FOLLOW_UPS:  # the chat of the second prompt goes on: each turn keeps the conversation
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": follow}]
            turn, text = answer(eng, msgs, params)
            turns.append(turn)
        eng.close()
        out["modes"][mode] = {"fresh": fresh, "after_another_chat": after, "other_chat": before,
                              "same_answer": fresh["text_sha1"] == after["text_sha1"], "next_turns": turns}
        emit(out, a.json, show=False)
    emit(out, a.json)


if __name__ == "__main__":
    main()
