"""Model-free lookup nodes without replacement keep beam sampling's law on a real model and vocabulary.

DSBD without a draft model, W = W_min = 2, without replacement, a fixed forest of up to 8 lookup nodes from the `match` and
`recycled` sources, against `beam-sample` W 2, on a prompt that repeats itself so match nodes are built and hit:
raw `colors = [...]\\nsizes = [...]\\ncolors = ['red',`, 3 new tokens, T 1, top-k / top-p off. Both decoders read
logits through `SequentialModel` (one score per token sequence, whatever forest it is in), so a gap in the answer
distributions would be the algorithm's, not the forest pass's rounding. Chi-square homogeneity of the answers.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from app.config import DecodeParams
from app.decoding import start
from app.decoding.beams import Stopper
from app.decoding.metrics import Metrics
from real_pair import SequentialModel

PROMPT = "colors = ['red', 'green', 'blue']\nsizes = [1, 2, 3]\ncolors = ['red',"
BASE = dict(beams=2, max_new_tokens=3, temperature=1.0, top_k=0, top_p=1.0, replacement="without")
LOOKUP = dict(mode="dsbd", forest="fixed", min_beams=2, lookup_nodes=8, lookup_sources=("match", "recycled"))
ALPHA = 1e-4


def answer(target, prompt, mode: str, seed: int, **kw) -> tuple[tuple[int, ...], int, int]:
    """(answer tokens, lookup nodes built, lookup nodes an output landed on) of one seeded answer."""
    params = DecodeParams(mode=mode, seed=seed, **BASE, **kw).validated()
    ctx = target.context(rows=params.beams, max_tokens=512)
    metrics = Metrics(mode=mode)
    steps = start(params, target=ctx, draft=None, prompt=list(prompt), metrics=metrics, vocab=target.vocab,
                  stopper=Stopper(eos_ids=target.tokenizer.eos_ids))
    *_, last = steps
    model_free = [row for source, row in metrics.sources.items() if source != "draft"]
    return last.output.tokens, sum(r[0] for r in model_free), sum(r[1] for r in model_free)


@pytest.mark.slow
def test_lookup_only_layers_without_replacement_keep_beam_samplings_law(tiny_gguf_path):
    from dsbd_helpers import homogeneous

    llamacpp = pytest.importorskip("backends.llamacpp")
    from backends.registry import ModelSpec

    real = llamacpp.load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), n_threads=2))
    target = SequentialModel(real)
    try:
        prompt = target.tokenizer.encode(PROMPT)
        n = int(os.environ.get("DSBD_LOOKUP_N", "3000"))
        ref = Counter(answer(target, prompt, "beam-sample", 10_000_000 + i)[0] for i in range(n))
        got, built, hits = Counter(), 0, 0
        for i in range(n):
            tokens, nodes, hit = answer(target, prompt, LOOKUP["mode"], 70_000_000 + i,
                                        **{k: v for k, v in LOOKUP.items() if k != "mode"})
            got[tokens] += 1
            built, hits = built + nodes, hits + hit
        p = homogeneous(ref, got)
        print(f"lookup-only without replacement: n={n} per arm, p={p:.4g}, cells {len(ref)} / {len(got)}, "
              f"lookup nodes built {built}, hit {hits}")
        assert len(ref) > 3 and hits > n  # a spread of answers, and the match nodes really are built and hit
        assert p > ALPHA, (p, ref.most_common(5), got.most_common(5))
    finally:
        target.close()
        real.close()
