"""Exact laws of a whole decode on a tiny bigram pair (tests/test_model_free.py, tests/test_cross_chat.py,
tests/test_decoding.py): every outcome of every random choice enumerated through one scripted `Rand`, so two modes'
laws compare within EXACT."""

from __future__ import annotations

from collections import defaultdict

from app.config import DecodeParams
from app.decoding import baselines, dsbd as D
from app.decoding.beams import Stopper
from app.decoding.metrics import Metrics
from dsbd_helpers import enumerate_paths
from refmodel import bigram


EXACT = 1e-12
V = 3  # token 0 is EOS
TARGET = bigram(V, 21, sharp=2.0)
DRAFT = bigram(V, 22, sharp=1.5)
PROMPT = [1, 2, 1, 2, 1]  # repeats: the match source has something to continue
BASELINE = {"with": "beam-sample-repl", "without": "beam-sample"}


def params(mode: str, **kw) -> DecodeParams:
    base = dict(beams=2, min_beams=2, draft_beams=2, gamma=2, max_new_tokens=3, seed=0)
    return DecodeParams(mode=mode, **{**base, **kw}).validated()


def generate(p: DecodeParams, rand, *, draft=True, metrics=None, builder=None, run_cls=None, costs=None):
    stopper = Stopper(eos_ids=frozenset({0}))
    metrics = metrics if metrics is not None else Metrics(mode=p.mode)
    t = TARGET.context(rows=p.beams, max_tokens=64)
    if p.mode in ("dsbd", "dsbd-mem"):
        d = DRAFT.context(rows=p.beams, max_tokens=64) if draft else None
        nodes = builder(p) if builder is not None else None
        gen = D.dsbd(target=t, draft=d, prompt=PROMPT, params=p, stopper=stopper, metrics=metrics, vocab=V,
                     nodes=nodes, costs=costs, rands=None if rand is None else (rand, rand))
    elif p.mode == "sps":
        gen = baselines.speculative_sampling(target=t, draft=DRAFT.context(rows=1, max_tokens=64), prompt=PROMPT,
                                             params=p, stopper=stopper, metrics=metrics, vocab=V,
                                             rands=None if rand is None else (rand, rand))
    else:
        gen = baselines.beam_sampling(target=t, prompt=PROMPT, params=p, stopper=stopper, metrics=metrics,
                                      rand=rand)
    return list(gen)[-1].output.tokens


def law_of(p: DecodeParams, **kw) -> tuple[dict, dict]:
    """Exact law of the returned sequence, and P(a model-free node was hit)."""
    law: dict = defaultdict(float)
    seen: dict = defaultdict(float)

    def one(rand):
        m = Metrics(mode=p.mode)
        return generate(p, rand, metrics=m, **kw), m

    for (tokens, m), pr in enumerate_paths(one):
        law[tokens] += pr
        for source in ("match", "recycled"):
            seen[source] += pr * bool(m.sources.get(source, [0, 0])[1])
    return law, seen


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
