"""The forest as a cache (spec §16.2-16.6): the cache rule, lookup nodes and DSBD without replacement.

Exact tests enumerate every outcome of every random choice (draft draws, row assignment, the verifier's coins
and draws) through one scripted `Rand` and compare the law of the returned sequence with the baseline's law,
enumerated the same way, within 1e-12. Negative controls (wrong variants written here only) must fail them.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from collections import Counter, defaultdict

import numpy as np
import pytest

from app.config import DecodeParams
from app.decoding import baselines, dsbd as D
from app.decoding.beams import Stopper
from app.decoding.metrics import Metrics
from app.decoding.sampling import DraftWOR, SeededRand, sample_without_replacement, verify_layer_without_replacement
from dsbd_helpers import ALPHA_TEST, LookupOnly, chisquare_pvalue, enumerate_paths, joint, layer_cases, rngs
from refmodel import bigram

EXACT = 1e-12
V = 3  # token 0 is EOS


# ------------------------------------------------------------------------------ layer level, without replacement

def sequential_law(p, W: int) -> dict[tuple[int, ...], float]:
    """Slot k ~ p renormalised over the pairs not yet output (baseline B's layer)."""
    law = {}
    for idx in itertools.permutations(range(len(p)), W):
        w, left = 1.0, 1.0
        for i in idx:
            w *= p.probs[i] / left
            left -= p.probs[i]
        law[tuple(int(p.keys[i]) for i in idx)] = w
    return law


def drafts_without_replacement(q, W_S: int):
    """Every ordered W_S-tuple of distinct q keys with its probability and each draft's undrawn mass."""
    for idx in itertools.permutations(range(len(q)), min(W_S, len(q))):
        w, left, rests = 1.0, 1.0, []
        for i in idx:
            rests.append(left)
            w *= q.probs[i] / left
            left -= q.probs[i]
        yield [int(q.keys[i]) for i in idx], rests, w


def layer_law(p, q, valid, W_S: int, W_L: int, *, conditional: bool = True):
    q_S = q.lookup(p.keys)
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for keys, rests, w in drafts_without_replacement(q, W_S):
        drafts = [DraftWOR(k, float(q.lookup(np.array([k]))[0]), r if conditional else 1.0,
                           bool(valid[k // q.vocab])) for k, r in zip(keys, rests)]
        for (_, out), pr in enumerate_paths(lambda rand: verify_layer_without_replacement(drafts, p, q_S, W_L, rand)):
            law[tuple(k for k, _ in out)] += w * pr
    return law


CASES = layer_cases()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("W_S", [1, 2, 3, 4])
def test_without_replacement_layer_is_sequential_p_exact(case, W_S):
    p, q, valid = CASES[case]
    for W_L in range(1, min(W_S, len(p)) + 1):
        got, want = layer_law(p, q, valid, W_S, W_L), sequential_law(p, W_L)
        for k in set(got) | set(want):
            assert abs(got.get(k, 0.0) - want.get(k, 0.0)) < EXACT, (case, W_S, W_L, k)


def test_negative_unconditional_q_in_the_ratio_is_biased():
    """The reference code's mistake: drafts without replacement, ratio against the unconditional q."""
    worst = 0.0
    for case in ("golden", "three_parents", "random"):
        p, q, valid = CASES[case]
        got, want = layer_law(p, q, valid, 3, 2, conditional=False), sequential_law(p, 2)
        worst = max(worst, max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want)))
    assert worst > 1e-3


def test_sample_without_replacement_law_and_masses():
    p = joint([[0.5, 0.3, 0.2], [0.0, 0.0, 0.0]])
    counts = Counter()
    rng = rngs("wor")[0]
    for _ in range(20_000):
        keys, rest = sample_without_replacement(p, 2, SeededRand(rng))
        assert len(set(keys.tolist())) == 2 and rest[0] == pytest.approx(1.0)
        assert rest[1] == pytest.approx(1.0 - p.lookup(keys[:1])[0])
        counts[tuple(keys.tolist())] += 1
    law = sequential_law(p, 2)
    cells = sorted(law)
    assert chisquare_pvalue(np.array([counts[c] for c in cells]), np.array([law[c] for c in cells])) > ALPHA_TEST


# --------------------------------------------------------------------------------- process level, enumerated

TARGET = bigram(V, 21, sharp=2.0)  # peaked: identical beams and drafts are common
DRAFT = bigram(V, 22, sharp=1.5)


def params(mode: str, **kw) -> DecodeParams:
    base = dict(beams=2, min_beams=2, draft_beams=2, gamma=2, max_new_tokens=3)
    return DecodeParams(mode=mode, seed=0, **{**base, **kw}).validated()


def generate(p: DecodeParams, rand, *, metrics=None, **kw) -> tuple[int, ...]:
    stopper = Stopper(eos_ids=frozenset({0}))
    metrics = metrics if metrics is not None else Metrics(mode=p.mode)
    t = TARGET.context(rows=p.beams, max_tokens=64)
    if p.mode in ("dsbd", "dsbd-mem"):
        d = DRAFT.context(rows=p.beams, max_tokens=64)
        gen = D.dsbd(target=t, draft=d, prompt=[1, 2], params=p, stopper=stopper, metrics=metrics, vocab=V,
                     rands=None if rand is None else (rand, rand), **kw)
    else:
        gen = baselines.beam_sampling(target=t, prompt=[1, 2], params=p, stopper=stopper, metrics=metrics,
                                      rand=rand)
    return list(gen)[-1].output.tokens


def law_of(p: DecodeParams, **kw) -> tuple[dict, dict]:
    """Exact law of the returned sequence, and P(some layer passed by the cache rule / a lookup node hit)."""
    law: dict = defaultdict(float)
    seen = defaultdict(float)
    for (tokens, m), pr in enumerate_paths(lambda rand: _one(p, rand, **kw)):
        law[tokens] += pr
        stats = m.layers.values()
        seen["cache"] += pr * any(s.passed_by_cache for s in stats)
        seen["lookup"] += pr * any(s.lookup_hits for s in stats)
    return law, seen


def _one(p, rand, **kw):
    m = Metrics(mode=p.mode)
    return generate(p, rand, metrics=m, **kw), m


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


BASELINE = {"with": "beam-sample-repl", "without": "beam-sample"}


# (replacement, lookup nodes, gamma, answer tokens): gamma 2 with three answer tokens puts two layers in the first
# iteration. Without lookup nodes more layers fail and every failed layer's draws branch over all pairs: those
# enumerations (and drafts with replacement over two layers or two iterations) take from seconds to minutes and
# run in the slow suite; the default keeps one shape of two drafted layers (without replacement) and, with
# replacement, the one-layer shape of the same lookups and cache rule.
SLOW = pytest.mark.slow
SHAPES = [("with", 2, 1, 2), ("without", 2, 2, 3), ("with", 0, 2, 2), ("without", 0, 2, 2),
          pytest.param("with", 2, 1, 3, marks=SLOW), pytest.param("with", 2, 2, 3, marks=SLOW),
          pytest.param("with", 0, 1, 3, marks=SLOW), pytest.param("without", 0, 2, 3, marks=SLOW)]


@pytest.mark.parametrize("replacement,lookups,gamma,tokens", SHAPES)
def test_cache_rule_and_lookups_keep_the_baseline_law_exact(replacement, lookups, gamma, tokens):
    """W = W_min = 2, W_S = 2: DSBD's returned-sequence law is the baseline's (A with, B without replacement),
    with the cache rule on and lookup nodes present or absent; the cache rule and the lookups really fire."""
    want, _ = law_of(params(BASELINE[replacement], max_new_tokens=tokens))
    got, seen = law_of(params("dsbd", replacement=replacement, lookup_nodes=lookups, gamma=gamma,
                              max_new_tokens=tokens))
    assert abs(sum(got.values()) - 1) < EXACT
    assert max_gap(got, want) < EXACT
    assert seen["cache"] > 0.01
    if lookups:
        assert seen["lookup"] > 0.01


class RedrawUntilHit(D._Run):
    """Negative control: a correction or fill that misses the forest is drawn again (up to 3 times)."""

    def verify_layer(self, layer, rows):
        outputs, drafts, by_drafts, width = super().verify_layer(layer, rows)
        hits = {n.content for n in layer.nodes}
        p = self._p_beam(rows)
        fixed = []
        for k, i in outputs:
            tries = 0
            while i is None and tries < 3 and not self._hit(rows, hits, k):
                k, tries = int(self.rand.categorical(p.keys, p.probs)), tries + 1
            fixed.append((k, i))
        return fixed, drafts, by_drafts, width

    def _hit(self, rows, hits, k):
        c = self._contents.find(rows[k // self.vocab].content, k % self.vocab)
        return c in hits


class PickTheHit(RedrawUntilHit):
    """Negative control: a fill is chosen between two candidate draws by whether it hits."""

    def verify_layer(self, layer, rows):
        outputs, drafts, by_drafts, width = super(RedrawUntilHit, self).verify_layer(layer, rows)
        hits = {n.content for n in layer.nodes}
        p = self._p_beam(rows)
        out = []
        for k, i in outputs:
            if i is None and not self._hit(rows, hits, k):
                other = int(self.rand.categorical(p.keys, p.probs))
                k = other if self._hit(rows, hits, other) else k
            out.append((k, i))
        return out, drafts, by_drafts, width


@pytest.mark.parametrize("wrong", [RedrawUntilHit, PickTheHit])
def test_negative_controls_choosing_outputs_by_hits_are_biased(monkeypatch, wrong):
    real_verify = D._Run.verify

    def verify(self, it, rows, node_lp):
        self._contents = it.contents
        return real_verify(self, it, rows, node_lp)

    monkeypatch.setattr(wrong, "verify", verify)
    monkeypatch.setattr(D, "_Run", wrong)
    got, _ = law_of(params("dsbd", max_new_tokens=2, lookup_nodes=1))
    want, _ = law_of(params("beam-sample-repl", max_new_tokens=2))
    assert max_gap(got, want) > 1e-4


# -------------------------------------------------------------------------- lookup-only layers = baseline A


def every_token(l, parent_content, prev, q, drafts):
    """Lookup nodes: every token under every node of the previous layer (the root rows at depth 1)."""
    return [(par, t) for par in range(len(parent_content)) for t in range(V4)
            if prev is None or not prev[par].ended]


V4 = 4


def test_lookup_only_layers_are_beam_sample_repl_token_for_token():
    target, draft = bigram(V4, 31, sharp=1.5), bigram(V4, 32)
    most_steps = 0
    for seed in range(20):
        outs = []
        for mode in ("beam-sample-repl", "dsbd"):
            p = DecodeParams(mode=mode, seed=seed, beams=2, min_beams=2, gamma=3, max_new_tokens=9,
                             forest="adaptive").validated()
            m = Metrics(mode=mode)
            t, d = target.context(rows=2, max_tokens=128), draft.context(rows=2, max_tokens=128)
            stopper = Stopper(eos_ids=frozenset({0}))
            if mode == "dsbd":
                steps = list(D.dsbd(target=t, draft=d, prompt=[1, 2], params=p, stopper=stopper, metrics=m,
                                    vocab=V4, policy=LookupOnly(3), lookups=every_token))
                assert m.draft_passes == 0
                most_steps = max(most_steps, max(m.steps))
            else:
                steps = list(baselines.beam_sampling(target=t, prompt=[1, 2], params=p, stopper=stopper,
                                                     metrics=m))
            outs.append((steps[-1].output.tokens, steps[-1].output.score))
        assert outs[0][0] == outs[1][0], seed
        assert outs[0][1] == pytest.approx(outs[1][1], abs=1e-9)
    assert most_steps == 4  # three lookup layers and the extra layer in one target pass


# ------------------------------------------------------------------------------------ statistics (slow: 2e5)

N_STAT = 200_000


@pytest.mark.slow
@pytest.mark.heavy  # 8 minutes each on 2 cores; the exact enumerations above hold the law, test_model_free's
# chi-square the seeded production path with lookup nodes
@pytest.mark.parametrize("replacement", ["with", "without"])
def test_production_path_matches_the_baseline_chi_square(replacement):
    """Seeded production path, cache rule and lookups on, W = W_min = 2, W_S = 3: answers vs the baseline's
    exact law (enumerated), chi-square at N = 2*10^5."""
    want, _ = law_of(params(BASELINE[replacement]))
    counts = Counter()
    p = params("dsbd", replacement=replacement, lookup_nodes=1, draft_beams=3)
    for s in range(N_STAT):
        counts[generate(replace(p, seed=s), None)] += 1
    cells = sorted(want)
    assert sum(counts[c] for c in cells) == N_STAT
    assert chisquare_pvalue(np.array([counts[c] for c in cells]), np.array([want[c] for c in cells])) > ALPHA_TEST
