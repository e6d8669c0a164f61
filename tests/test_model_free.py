"""Model-free lookup nodes (spec §16.7, app/decoding/lookups.py): the sources, the builder's choices, and
exactness.

Exact tests enumerate every outcome of every random choice through one scripted `Rand` (as in
tests/test_forest_cache.py) and compare the law of the returned sequence with the baseline's within 1e-12,
with nodes from the n-gram matches and the recycled predictions, with and without a draft model. The
negative control gives a source the layer's own draws: it keeps the forest's shape and pass chance and only
adds the dependence, and the law moves.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pytest

from app.config import ConfigError, DecodeParams
from app.decoding import dsbd as D
from app.decoding.beams import Stopper
from app.decoding.lookups import Builder, Calibration, LookupBudget, MatchIndex, Recycler
from app.decoding.metrics import Metrics
from app.engine.timing import CostCurve
from dsbd_helpers import ALPHA_TEST, LookupOnly, chisquare_pvalue, enumerate_paths
from law_helpers import BASELINE, DRAFT, EXACT, PROMPT, TARGET, V, generate, law_of, max_gap, params


# ------------------------------------------------------------------------------------------------- sources

def test_match_index_continues_the_longest_suffix_with_counts():
    idx = MatchIndex(max_n=4)
    idx.add([5, 6, 7, 5, 6, 8, 5, 6, 7])
    # "5 6" is followed by 7 twice and 8 once; the longest match wins over shorter ones
    assert idx.propose([1, 5, 6]) == [(7, 2, pytest.approx(2 / 3)), (8, 2, pytest.approx(1 / 3))]
    assert idx.propose([7, 5, 6]) == [(8, 3, 1.0)]
    assert idx.propose([9, 9]) == []
    idx.add([1, 2, 3], start=2)  # only the continuation at position 2 ("1 2" -> 3) is new
    assert idx.propose([1, 2]) == [(3, 2, 1.0)]
    assert idx.propose([1]) == []  # position 1 ("1" -> 2) was before `start`


def test_recycler_keeps_the_targets_top_successors_by_two_then_one_token():
    r = Recycler(k=2)
    lp = np.log(np.array([0.1, 0.6, 0.05, 0.25]))
    r.harvest([3, 2], lp)
    assert r.propose([0, 3, 2]) == [(1, 2, 1.0), (3, 2, 0.5)]  # the bigram key first
    assert r.propose([9, 2]) == [(1, 1, 1.0), (3, 1, 0.5)]  # then the last token alone
    assert r.propose([7]) == []


def test_calibration_moves_from_the_prior_to_what_it_saw_and_caps_its_counts():
    c = Calibration()
    prior = c.estimate("match", 4, 0, 1.0)
    assert prior == pytest.approx(Calibration.prior("match", 4, 1.0))
    for _ in range(200):
        c.observe("match:4:0", 0.9)
    assert c.estimate("match", 4, 0, 1.0) > 0.85
    capped = c.carried(cap=10)
    assert capped.table["match:4:0"] == pytest.approx([9.0, 10.0])


# ------------------------------------------------------------------------------------------------- builder

def _builder(prompt, **kw) -> Builder:
    return Builder(prompt, sources=("match",), **kw)


def test_builder_without_costs_takes_the_likeliest_chain_up_to_the_caps():
    b = _builder([5, 6, 7, 8, 9, 5, 6])  # "5 6" continues with 7 8 9 5 6 ...
    shape = LookupBudget(max_depth=4, width=1, replacement=True, per_layer=[1, 1, 1, 1])
    picks = b.build([(0, (), 1.0)], shape, lambda parent, tok: False)
    assert [c.token for c in picks] == [7, 8, 9, 5]  # one chain, extended while the match continues
    assert [c.depth for c in picks] == [1, 2, 3, 4]
    assert picks[1].parent is picks[0] and picks[0].parent == 0
    none = _builder([1, 2, 3]).build([(0, (4,), 1.0)], shape, lambda p, t: False)
    assert none == []  # nothing matches: no node


def test_builder_with_costs_adds_nodes_only_where_they_pay():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    shape = lambda: LookupBudget(max_depth=6, width=1, replacement=True, per_layer=[2] * 6, base_tokens=1.0,
                          base_seconds=0.076)
    flat = CostCurve.of({1: 0.076, 64: 0.078})  # a GPU: a longer pass costs about the same
    steep = CostCurve.of({1: 0.076, 2: 0.2, 64: 5.0})  # every token costs more than a plain step
    gpu = _builder(prompt, target_cost=flat).build([(0, (), 1.0)], shape(), lambda p, t: False)
    assert len(gpu) == 6  # the whole likely chain
    cpu = _builder(prompt, target_cost=steep).build([(0, (), 1.0)], shape(), lambda p, t: False)
    assert cpu == []  # no node can pay: never slower than the plain step
    # a calibration that learnt the matches always continue makes the chain pay on a moderate curve
    mid = CostCurve.of({1: 0.076, 2: 0.09, 4: 0.12, 8: 0.17})
    sure = Calibration({f"match:{n}:0": [1000.0, 1000.0] for n in range(1, 9)})
    doubtful = Calibration({f"match:{n}:0": [10.0, 1000.0] for n in range(1, 9)})
    assert len(_builder(prompt, target_cost=mid, calibration=sure).build([(0, (), 1.0)], shape(),
                                                                       lambda p, t: False)) >= 4
    assert _builder(prompt, target_cost=mid, calibration=doubtful).build([(0, (), 1.0)], shape(),
                                                                         lambda p, t: False) == []


def test_a_build_skipped_by_its_bound_is_the_build_it_skips(monkeypatch):
    """Where the depth-1 candidates alone show that no node can pay, the builder returns at once: the same nodes
    (none), the same depth-1 proposals and predictions as the full search, over widths, laws, caps, curves and
    calibrations; the bound fires in some cases and the search still builds in others."""
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 11, 12, 5, 6, 7, 8, 13, 5, 6]
    curves = [CostCurve.of({1: 0.006, 8: 0.0062, 64: 0.0075}), CostCurve.of({1: 0.076, 2: 0.09, 8: 0.17}),
              CostCurve.of({1: 0.076, 2: 0.2, 64: 5.0})]
    sure = Calibration({f"match:{n}:{r}": [900.0, 1000.0] for n in range(1, 9) for r in range(3)})
    roots = [[(0, (), 1.0)], [(0, (), 0.6), (1, (7,), 0.3), (2, (9,), 0.1)], [(0, (8,), 0.5), (1, (8, 13), 0.5)]]
    cases = [(w, repl, cap, curve, cal, r) for w in (1, 2, 4) for repl in (True, False) for cap in (1, 4)
             for curve in curves for cal in (None, sure) for r in roots]

    def run():
        out = []
        for w, repl, cap, curve, cal, r in cases:
            b = _builder(prompt, target_cost=curve, calibration=cal, verify_cost=2e-4)
            shape = LookupBudget(max_depth=6, width=w, replacement=repl, per_layer=[cap] * 6, base_tokens=3.0,
                                 base_seconds=curve(3.0), base_pass=[0.3, 0.1])
            picks = b.build(r, shape, lambda p, t: False)
            out.append(([(c.depth, c.text) for c in picks], [(c.text, c.mass) for c in b.proposed], b.predicted))
        return out

    def loose(b, shape, masses, factor, base, rate):  # the cap's coverage at one token's cost: one bound for all n
        top = sorted(masses, reverse=True)[:shape.per_layer[0]]
        return b._bound(shape, base)(Builder._coverage(shape, top, factor) if top else 0.0, 1) <= rate

    fired, loosely = [], []
    original = Builder._cannot_pay
    monkeypatch.setattr(Builder, "_cannot_pay",
                        lambda *a: loosely.append(loose(*a)) or fired.append(original(*a)) or fired[-1])
    bounded = run()
    monkeypatch.setattr(Builder, "_cannot_pay", lambda *a: False)
    assert bounded == run()
    assert 0 < sum(fired) < len(fired) and any(picks for picks, _, _ in bounded)
    assert all(f or not lo for f, lo in zip(fired, loosely)) and sum(fired) > sum(loosely)  # n by n prunes more


def test_priced_chains_grow_while_they_pass_whole_and_start_over_after_a_failure():
    """A priced builder's model-free depth starts at CHAIN_START, doubles after a chain that passed at that
    depth (never past gamma) and goes back after one that failed; an unpriced (fixed) forest uses gamma."""
    from app.decoding.lookups import CHAIN_START
    prompt = list(range(5, 45)) + [5, 6]
    flat = CostCurve.of({1: 0.076, 64: 0.078})
    b = _builder(prompt, target_cost=flat)
    assert b.depth(16) == CHAIN_START == 8 and b.depth(3) == 3
    b.settle_chain(built=8, passed=8)
    assert b.depth(16) == 16 and b.depth(32) == 16
    b.settle_chain(built=16, passed=16)
    assert b.depth(16) == 16 and b.depth(64) == 32
    b.settle_chain(built=5, passed=5)  # a chain shorter than the reach (its match ended) passed: no change
    assert b.depth(64) == 32
    b.settle_chain(built=32, passed=11)  # the answer left the copied text
    assert b.depth(64) == CHAIN_START
    b.settle_chain(built=0, passed=0)  # no model-free nodes: nothing learnt
    assert b.depth(64) == CHAIN_START
    fixed = _builder(prompt)
    fixed.settle_chain(built=8, passed=2)
    assert fixed.depth(16) == 16  # the fixed forest's shape is the user's
    shape = LookupBudget(max_depth=b.depth(16), width=1, replacement=True, per_layer=[1] * 8, base_tokens=1.0,
                         base_seconds=0.076)
    assert len(b.build([(0, (), 1.0)], shape, lambda p, t: False)) == 8  # the builder fills the depth it is given


def test_an_answer_that_copies_its_prompt_gets_longer_chains_as_they_pass():
    """The decoder end to end (no draft model): a target that continues a cycle its prompt holds; the first
    priced chains are at most CHAIN_START deep, later ones reach gamma, and the answer is the copy."""
    from app.decoding.lookups import CHAIN_START
    from refmodel import TableModel

    sv = 12
    model = TableModel(lambda seq: np.where(np.arange(sv) == (seq[-1] % (sv - 1)) + 1, 40.0, 0.0), sv)
    prompt = [1 + i % (sv - 1) for i in range(66)]  # 1 2 ... 11 1 2 ...
    p = DecodeParams(mode="dsbd-mem", beams=4, min_beams=1, gamma=16, lookup_nodes=2, lookup_sources=("match",),
                     forest="adaptive", max_new_tokens=60, seed=3).validated()
    flat = CostCurve.of({1: 0.02, 64: 0.021})
    metrics = Metrics(mode=p.mode)
    stopper = Stopper(eos_ids=frozenset({0}))
    builder = D.model_free_builder(p, prompt, stopper, sv, target_cost=flat)
    steps = list(D.dsbd(target=model.context(rows=4, max_tokens=256), draft=None, prompt=prompt, params=p,
                        stopper=stopper, metrics=metrics, vocab=sv, nodes=builder))
    assert list(steps[-1].output.tokens) == [1 + (prompt[-1] + i) % (sv - 1) for i in range(60)]
    depths = [g for g, _ in metrics.forests if g]
    assert depths[0] <= CHAIN_START and max(depths) == 16
    assert metrics.target_passes < 60 / 8  # more than 8 steps a pass on average


def test_lookup_only_layers_that_keep_failing_stop_being_built():
    """Per-token chances can be right while a layer of W outputs still rarely passes (they must all hit at once):
    the builder weighs its layer predictions by what lookup-only layers did, and stops where they do not pay."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    mid = CostCurve.of({1: 0.076, 2: 0.09, 4: 0.12, 8: 0.17})
    sure = Calibration({f"match:{n}:0": [1000.0, 1000.0] for n in range(1, 9)})
    b = _builder(prompt, target_cost=mid, calibration=sure)
    shape = lambda: LookupBudget(max_depth=4, width=4, replacement=True, per_layer=[2] * 4, base_tokens=1.0,
                          base_seconds=0.076)
    first = b.build([(0, (), 1.0)], shape(), lambda p, t: False)
    assert first and b.predicted[0] > 0.9
    for _ in range(20):  # every lookup-only layer failed
        b.build([(0, (), 1.0)], shape(), lambda p, t: False)
        b.settle_layer(1, passed=False)
    assert b.calibration.layer_factor(4, True) < 0.3  # it stopped building them on its own
    assert b.build([(0, (), 1.0)], shape(), lambda p, t: False) == []  # no longer worth a node
    assert b.calibration.layer_factor(4, False) == 1.0  # another law's layers are their own
    assert b.calibration.carried().layer_factor(4, True) == pytest.approx(b.calibration.layer_factor(4, True))


def test_priced_searches_that_keep_choosing_nothing_rest_the_builder_in_proportion_to_the_pass():
    """A search costs the host about SEARCH_SECONDS a root: after the k-th priced search in a row that chose no
    node, the builder rests (no search, no proposals) 2^(k-1) - 1 iterations, at most as many as keep its
    searches under IDLE_SHARE of the iterations' expected seconds. A pass of CPU speed never rests it; a search
    that chose nodes starts the count again."""
    from app.decoding.lookups import IDLE_SHARE, SEARCH_SECONDS
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    roots = [(0, (), 0.5), (1, (7,), 0.5)]
    steep = CostCurve.of({1: 0.002, 2: 0.05, 64: 5.0})  # every further token costs more than it could save
    flat = CostCurve.of({1: 0.002, 64: 0.0021})  # a chain costs about nothing more: the search chooses nodes
    shape = lambda seconds: LookupBudget(max_depth=4, width=1, replacement=True, per_layer=[2] * 4,
                                         base_tokens=2.0, base_seconds=seconds)
    assert math.ceil(2 * SEARCH_SECONDS / (IDLE_SHARE * 0.002)) - 1 == 4  # the most a 2 ms pass rests

    def searched(b, curves, seconds=0.002):
        out = []
        for i, curve in enumerate(curves):
            if b.rests():
                assert b.proposed == [] and b.predicted == []  # a rested iteration calibrates nothing
                continue
            b.target_cost = curve
            picks = b.build(roots, shape(seconds), lambda p, t: False)
            assert bool(picks) == (curve is flat) and b.proposed
            out.append(i)
        return out

    b = _builder(prompt)
    assert searched(b, [steep] * 20) == [0, 1, 3, 7, 12, 17]  # rests 0, 1, 3, then 4 (the cap)
    again = _builder(prompt)
    assert searched(again, [steep, flat] + [steep] * 6) == [0, 1, 2, 3, 5]  # after a chosen node: 0, 1, 3 again
    cpu = _builder(prompt)
    assert searched(cpu, [steep] * 12, seconds=0.1) == list(range(12))  # a CPU pass: a search every iteration


def test_an_answer_whose_nodes_never_pay_searches_for_them_in_few_iterations():
    """The decoder end to end: on a fast pass where no node pays, the builder searches in about one iteration of
    each rest and the answer is the one every iteration's search gives."""
    from refmodel import TableModel

    sv = 12
    model = TableModel(lambda seq: np.where(np.arange(sv) == (seq[-1] % (sv - 1)) + 1, 3.0, 0.0), sv)
    prompt = [1 + i % (sv - 1) for i in range(30)]
    p = DecodeParams(mode="dsbd-mem", beams=4, min_beams=1, gamma=4, lookup_nodes=2, lookup_sources=("match",),
                     forest="adaptive", max_new_tokens=40, seed=3).validated()
    steep = CostCurve.of({1: 0.002, 2: 0.05, 64: 5.0})
    stopper = Stopper(eos_ids=frozenset({0}))

    def run(rest: bool):
        searches = []
        builder = D.model_free_builder(p, prompt, stopper, sv, target_cost=steep)
        build = builder.build
        builder.build = lambda *a: searches.append(1) or build(*a)
        if not rest:
            builder.rests = lambda: False
        metrics = Metrics(mode=p.mode)
        steps = list(D.dsbd(target=model.context(rows=4, max_tokens=256), draft=None, prompt=prompt, params=p,
                            stopper=stopper, metrics=metrics, vocab=sv, nodes=builder))
        assert not metrics.sources  # no search chose a node
        return steps[-1].output.tokens, len(searches), metrics.iterations

    tokens, searched, iterations = run(rest=True)
    every_tokens, every_searched, every_iterations = run(rest=False)
    assert (tokens, iterations) == (every_tokens, every_iterations) and iterations == 40
    # one root a search (dsbd-mem carries one beam) on a pass of about 2 ms: rests of 0, 1, then 2 (the cap)
    assert every_searched == iterations - 1 and searched == 2 + len(range(3, iterations - 1, 3))


def test_builder_learns_from_verified_rows_including_nodes_it_did_not_add():
    b = Builder([5, 6, 7, 5, 6], sources=("match", "recycled"))
    shape = LookupBudget(max_depth=1, width=1, replacement=True, per_layer=[0])  # no room: nothing added
    assert b.build([(0, (), 1.0)], shape, lambda p, t: False) == []
    assert b.proposed == []  # no slot at depth 1: nothing proposed either
    shape = LookupBudget(max_depth=1, width=1, replacement=True, per_layer=[1])
    b.build([(0, (), 1.0)], shape, lambda p, t: False)
    assert [c.token for c in b.proposed] == [7]
    lp = np.log(np.full(10, 0.02))
    lp[7] = np.log(0.82)
    b.learn({(): lp}, [])
    assert b.calibration.table[b.proposed[0].bucket] == pytest.approx([0.82, 1.0])
    assert b.recycler.propose([5, 6])[0][0] == 7  # harvested: the target's top successor of "... 5 6"


def test_decode_params_take_lookup_sources():
    p = DecodeParams(mode="dsbd", lookup_nodes=2, lookup_sources=("recycled", "match")).validated()
    assert p.lookup_sources == ("match", "recycled")  # the canonical order
    with pytest.raises(ConfigError, match="lookup_sources"):
        DecodeParams(mode="dsbd", lookup_sources=("psychic",)).validated()


# ------------------------------------------------------------------------------------ process level, exact

def sources(*names):
    """A fresh builder per run (it learns as the answer goes): fixed forests take the likeliest nodes."""
    return lambda p: Builder(PROMPT, sources=names, finished=Stopper(eos_ids=frozenset({0})).finished)


@pytest.mark.parametrize("replacement,draft,names", [
    # drafts and model-free nodes together: 11 minutes on 2 cores with replacement (heavy), 2 without (slow); the
    # default holds each kind's law on its own (tests/test_forest_cache.py's drafted forests with the cache rule,
    # the draft-free shapes below)
    pytest.param("with", True, ("match",), marks=[pytest.mark.slow, pytest.mark.heavy]),
    pytest.param("without", True, ("match",), marks=pytest.mark.slow),
    ("with", False, ("match", "recycled")), ("without", False, ("match", "recycled")),
])
def test_model_free_nodes_keep_the_baseline_law_exact(replacement, draft, names):
    """W = W_min = 2: DSBD with n-gram and recycled nodes, with a draft model or none, has the baseline's law
    (A with, B without replacement), and the model-free nodes really are hit."""
    want, _ = law_of(params(BASELINE[replacement]))
    got, seen = law_of(params("dsbd", replacement=replacement, lookup_nodes=2, gamma=2,
                              lookup_sources=names), draft=draft, builder=sources(*names))
    assert abs(sum(got.values()) - 1) < EXACT
    assert max_gap(got, want) < EXACT
    assert seen["match"] > 1e-3
    if "recycled" in names:
        assert seen["recycled"] > 1e-3


class Peeking(D._Run):
    """Negative control: a lookup-only layer whose nodes depend on the layer's own draws. The outputs are
    drawn first; the every-token nodes stay only when the first output is token 1, so the layer passes exactly
    then. `Honest` keeps them with an independent coin of the same chance instead."""

    peek = True

    def verify_layer(self, layer, rows):
        outputs, drafts, by_drafts, width = super().verify_layer(layer, rows)
        if not layer.drafts and layer.lookups:
            p = self._p_beam(rows)
            chance = float(p.probs[p.keys % self.vocab == 1].sum())
            keep = (outputs[0][0] % self.vocab == 1) if self.peek else self.draft_rand.bernoulli(chance)
            if not keep:
                layer.lookups.clear()
        return outputs, drafts, by_drafts, width


class Honest(Peeking):
    peek = False


def every_token(l, parent_content, prev, q, drafts):
    return [(par, t) for par in range(len(parent_content)) for t in range(V)
            if prev is None or not prev[par].ended]


def test_negative_control_a_source_that_sees_the_layers_draws_moves_the_law(monkeypatch):
    """dsbd-mem (the set collapses to one beam at each iteration's end, so where iterations end matters):
    the same forest and pass chance, chosen with or without sight of the draws, give different laws."""
    def law(run_cls):
        monkeypatch.setattr(D, "_Run", run_cls)
        out: dict = defaultdict(float)
        p = params("dsbd-mem", max_new_tokens=3, gamma=1)

        def one(rand):
            t = TARGET.context(rows=2, max_tokens=64)
            gen = D.dsbd(target=t, draft=DRAFT.context(rows=2, max_tokens=64), prompt=PROMPT, params=p,
                         stopper=Stopper(eos_ids=frozenset({0})), metrics=Metrics(mode=p.mode), vocab=V,
                         policy=LookupOnly(1), lookups=every_token, rands=(rand, rand))
            return list(gen)[-1].output.tokens

        for tokens, pr in enumerate_paths(one):
            out[tokens] += pr
        return out

    honest, peeking = law(Honest), law(Peeking)
    assert abs(sum(honest.values()) - 1) < EXACT and abs(sum(peeking.values()) - 1) < EXACT
    assert max_gap(honest, peeking) > 1e-3


# ------------------------------------------------------------------------------------ statistics (slow: 2e5)

@pytest.mark.slow
def test_production_path_without_replacement_with_model_free_nodes_chi_square():
    """Seeded production path, no draft model, n-gram and recycled nodes, W = W_min = 2: answers against
    beam-sample's exact law (enumerated), chi-square at N = 2*10^5."""
    want, _ = law_of(params("beam-sample"))
    p = params("dsbd", replacement="without", lookup_nodes=2, lookup_sources=("match", "recycled"))
    counts: Counter = Counter()
    make = sources("match", "recycled")
    for s in range(200_000):
        counts[generate(replace(p, seed=s), None, draft=False, builder=make)] += 1
    cells = sorted(want)
    assert sum(counts[c] for c in cells) == 200_000
    assert chisquare_pvalue(np.array([counts[c] for c in cells]), np.array([want[c] for c in cells])) > ALPHA_TEST


# ------------------------------------------------------------------------------------- the view and stats

def test_forest_view_and_stats_name_each_lookup_nodes_source():
    from app.serve.ui.forest import forest_svg
    from app.serve.ui.stats import stats_markdown

    shown, metrics = [], Metrics(mode="dsbd")
    for seed in range(10):  # some answers end at once (EOS)
        p = params("dsbd", replacement="with", lookup_nodes=2, gamma=2, max_new_tokens=12, seed=seed,
                   lookup_sources=("match",))
        steps = list(D.dsbd(target=TARGET.context(rows=2, max_tokens=64), draft=None, prompt=PROMPT, params=p,
                            stopper=Stopper(eos_ids=frozenset({0})), metrics=metrics, vocab=V,
                            nodes=sources("match")(p)))
        shown += [s.forest for s in steps if s.forest and any(L["lookups"] for L in s.forest["layers"])]
    assert shown and all(n["source"] == "match" for f in shown for L in f["layers"] for n in L["lookups"])
    svg = forest_svg(shown[0])
    assert "lookup node from a match in the text" in svg and "from a match in the text (" in svg
    stats = metrics.as_dict()
    nodes, hits = stats["lookup_sources"]["match"]["nodes"], stats["lookup_sources"]["match"]["hits"]
    assert nodes > 0 and f"matches in the text {nodes} ({hits} hit)" in stats_markdown(stats, memory=False)
