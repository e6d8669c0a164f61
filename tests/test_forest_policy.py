"""Cost-aware DSBD forests: app/decoding/forest_policy.py and its use in the decoder and the engine.

Reductions (policy off == the fixed-forest decoder, token for token; a one-candidate policy == fixed;
a gamma-0-only policy == beam sampling), the policy's choices on hand-made costs, the draft cache staying
right when gamma = 0 iterations sit between drafted ones, the pricing of distinct tokens, verifier time and
lookup nodes (spec §16.4), exploration, counts carried across answers, and the engine path on the real tiny
model.
Exactness with the policy on: tests/test_decoding.py enumerates the exact laws of fixed-width DSBD and of the R1
reduction with forest="adaptive" under cost curves that make the policy's choices vary with the past (asserted
there); its slow chi-square tests run larger forests (W_min = W, t = 0, R1) the same way.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from app.engine.auto import PRIOR_ACCEPTANCE
from app.engine.timing import CostCurve
from app.config import ConfigError, DecodeParams
from backends.registry import ModelSpec
from app.decoding import start
from app.decoding.beams import Stopper
from app.decoding.forest_policy import (PRIOR, ForestPolicy, count_law, expected_distinct,
                                        layer_pass)
from app.decoding.metrics import Metrics
from app.decoding.sampling import log_softmax
from toy_models import DRAFT, SEQ_DRAFT, SEQ_TARGET, SV, TARGET, VARYING, hashed

CPU = (CostCurve.of({1: 0.080, 8: 0.25, 64: 1.0}), CostCurve.of({1: 0.045, 8: 0.11, 64: 0.76}))  # qwen, 2 cores
GPU = (CostCurve.of({1: 0.020, 64: 0.022}), CostCurve.of({1: 0.004, 64: 0.0045}))  # a pass costs ~ its launch


def decode(mode, target, draft, *, seed, prompt=(1, 2, 3), vocab=None, costs=None, policy=None, **kw):
    """(tokens, metrics, steps) of one generation, with an optional injected forest policy."""
    params = DecodeParams(mode=mode, seed=seed, **kw).validated()
    t = target.context(rows=params.beams, max_tokens=512)
    d = draft.context(rows=params.beams, max_tokens=512) if draft is not None else None
    metrics = Metrics(mode=mode)
    steps = list(start(params, target=t, draft=d, prompt=list(prompt),
                       stopper=Stopper(eos_ids=target.tokenizer.eos_ids), metrics=metrics,
                       vocab=vocab or target.vocab, costs=costs, policy=policy))
    return steps[-1].output.tokens, metrics, steps


class Scripted(ForestPolicy):
    """Plays (gamma, W_S) from a script, round and round (gamma capped by the budget): any past-free schedule."""

    def __init__(self, script, params):
        super().__init__(*GPU, gammas=(0,), widths=(params.beams,), threshold=params.threshold,
                         min_beams=params.min_beams, beams=params.beams)
        self.script = script

    def choose(self, *, max_gamma, roots, draft_roots, **_):
        g, ws = self.script[len(self.chosen) % len(self.script)]
        self.chosen.append((min(g, max_gamma), ws))
        return self.chosen[-1]


# --- (a) reductions --------------------------------------------------------------------------------------

# Answers of the fixed-forest decoder (cache rule on, no lookup nodes), seeds 0..5, on the sequence-hash models:
# with the policy off, the decoder must give them token for token.
BEFORE = {
    ("dsbd", (("beams", 3), ("draft_beams", 4), ("gamma", 3), ("max_new_tokens", 12))): [
        "9,11,1,2,4,8,0,3,11,5,10,0", "4,6,6,9,5,5,10,6,0,6,0,8", "10,3,1,7,4,11,4,10,5,5,7,4",
        "7,5,4,10,10,0,4,10,10,1,4,10", "6,8,8,9,11,4,6,5,5,10,4,4", "3,4,1,4,0,0,2,10,8,9,0,4"],
    ("dsbd", (("beams", 2), ("draft_beams", 3), ("gamma", 2), ("max_new_tokens", 10), ("min_beams", 2))): [
        "3,4,11,6,2,7,9,5,8,7", "3,4,2,4,1,3,9,8,11,9", "9,9,2,4,11,2,8,7,5,7", "7,5,2,0,11,3,0,2,3,7",
        "4,6,11,1,8,11,7,10,3,5", "3,1,1,10,5,4,4,4,0,3"],
    ("dsbd-mem", (("beams", 2), ("draft_beams", 3), ("gamma", 3), ("max_new_tokens", 12))): [
        "3,4,2,5,3,2,5,2,10,11,10,3", "3,4,6,5,6,3,0,1,3,7,3,8", "9,1,2,4,8,5,11,11,8,0,2,0",
        "7,9,3,3,11,6,10,3,0,9,0,4", "4,5,4,1,9,9,7,0,5,4,8,1", "4,5,0,11,2,5,2,6,5,3,1,0"],
    ("dsbd-mem", (("beams", 3), ("draft_beams", 5), ("gamma", 4), ("max_new_tokens", 12), ("select", "sample"),
                  ("threshold", 0.5))): [
        "8,9,8,7,5,1,7,10,4,9,11,2", "3,1,3,2,8,1,1,10,2,6,3,9", "4,5,1,7,3,1,5,7,1,4,7,1",
        "7,1,1,9,10,10,1,9,2,4,3,2", "1,3,3,4,3,11,11,9,2,9,11,6", "3,4,6,9,0,6,6,8,6,11,1,9"],
}
CASES = [(mode, dict(kw)) for mode, kw in BEFORE]


@pytest.mark.parametrize("mode,kw", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_policy_off_gives_the_fixed_forest_answers(mode, kw):
    want = BEFORE[(mode, tuple(sorted(kw.items())))]
    for seed in range(6):
        tokens, m, _ = decode(mode, SEQ_TARGET, SEQ_DRAFT, seed=seed, vocab=SV, **kw)
        assert ",".join(map(str, tokens)) == want[seed], seed
        assert m.as_dict()["forest_policy"] == "fixed"
        assert {ws for _, ws in m.forests} == {kw["draft_beams"]}


@pytest.mark.parametrize("mode,kw", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_adaptive_with_one_candidate_equals_fixed(mode, kw):
    params = DecodeParams(mode=mode, **kw).validated()
    for seed in range(6):
        fixed, mf, _ = decode(mode, SEQ_TARGET, SEQ_DRAFT, seed=seed, vocab=SV, **kw)
        one = ForestPolicy(*CPU, gammas=(params.gamma,), widths=(params.draft_beams,), threshold=params.threshold,
                           min_beams=params.min_beams, beams=params.beams)
        got, ma, _ = decode(mode, SEQ_TARGET, SEQ_DRAFT, seed=seed, vocab=SV, forest="adaptive", policy=one, **kw)
        assert got == fixed and ma.forests == mf.forests and ma.target_passes == mf.target_passes
        assert ma.as_dict()["forest_policy"] == "adaptive"


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_gamma_zero_only_is_beam_sampling_token_for_token(seed):
    """gamma = 0 through the policy (spec §11, reductions): never drafting is baseline A, the draft cache
    commits notwithstanding."""
    kw = dict(beams=3, max_new_tokens=8, temperature=1.0)
    only0 = ForestPolicy(*GPU, gammas=(0,), widths=(3,), threshold=0.9, min_beams=1, beams=3)
    got, m, _ = decode("dsbd", SEQ_TARGET, SEQ_DRAFT, seed=seed, vocab=SV, forest="adaptive", policy=only0,
                       draft_beams=4, **kw)
    ref, _, _ = decode("beam-sample-repl", SEQ_TARGET, None, seed=seed, vocab=SV, **kw)
    assert got == ref and m.draft_passes == 0 and set(m.forests) == {(0, 3)}


# --- gamma = 0 iterations between drafted ones keep the draft cache right ---------------------------------

@pytest.mark.parametrize("mode", ["dsbd", "dsbd-mem"])
def test_self_draft_accepts_everything_across_undrafted_iterations(mode):
    """Draft = target on a whole-sequence model: at depth 1 (parents = the live rows, so q = p_beam exactly)
    every valid draft is accepted iff the draft saw exactly the target's context. A gamma-0 iteration that left
    the draft's rows behind (rows not following their roots, tokens not fed later) would make q differ from p
    and reject drafts. (Deeper, equal drafts merged by content can make q exceed p: rejections are legitimate.)"""
    for seed in range(8):
        params = DecodeParams(mode=mode, beams=3, draft_beams=4, gamma=3, max_new_tokens=16, seed=seed).validated()
        script = Scripted([(0, 3), (2, 4), (0, 3), (0, 3), (3, 3), (1, 4)], params)
        _, m, _ = decode(mode, SEQ_TARGET, SEQ_TARGET, seed=seed, vocab=SV, forest="adaptive", policy=script,
                         beams=3, draft_beams=4, gamma=3, max_new_tokens=16)
        first = m.layers[1]
        assert first.tested > 0 and m.draft_passes > 0
        assert first.accepted == first.tested, (seed, m.as_dict()["acceptance_by_depth"])
        assert any(g == 0 for g, _ in m.forests[:-1]) and any(g > 0 for g, _ in m.forests[1:])


@pytest.mark.parametrize("mode", ["dsbd", "dsbd-mem"])
def test_changing_sizes_keep_every_score_exact(mode):
    """Per-iteration gamma / W_S reach every index: a node looked up with another iteration's W_S would hand a
    beam another node's target log-probs, and the returned score would no longer be the sequence's."""
    tempered = hashed(0, 0.8)  # the target's logits, flattened: deep layers pass often
    deep = 0
    for seed in range(12):
        params = DecodeParams(mode=mode, beams=3, draft_beams=5, gamma=4, max_new_tokens=14, seed=seed).validated()
        script = Scripted([(3, 3), (4, 5), (2, 4), (0, 3), (4, 3), (3, 5)], params)
        tokens, m, steps = decode(mode, SEQ_TARGET, tempered, seed=seed, vocab=SV, forest="adaptive", policy=script,
                                  beams=3, draft_beams=5, gamma=4, max_new_tokens=14)
        want = sum(log_softmax(SEQ_TARGET.fn([1, 2, 3] + list(tokens[:i])))[tokens[i]] for i in range(len(tokens)))
        assert abs(steps[-1].output.score - want) < 1e-5, (seed, tokens)
        deep += sum(s.passed for d, s in m.layers.items() if d >= 2)
    assert deep > 20  # deeper layers passed (their nodes' log-probs were used) many times


def test_adaptive_needs_costs_and_forest_is_validated():
    with pytest.raises(ConfigError, match="forest must be one of: fixed, adaptive"):
        DecodeParams(mode="dsbd", forest="wide").validated()
    with pytest.raises(ConfigError, match="needs the timed pass costs"):
        decode("dsbd", TARGET, DRAFT, seed=0, forest="adaptive")
    tokens, m, _ = decode("dsbd", TARGET, DRAFT, seed=0, forest="adaptive", costs=VARYING)  # costs: it runs
    assert tokens and m.as_dict()["forest_sizes"]


# --- (c) the choice on hand-made costs -------------------------------------------------------------------

def policy(costs, *, draft_beams=8, **kw) -> ForestPolicy:
    params = DecodeParams(mode="dsbd", beams=4, draft_beams=draft_beams, gamma=6).validated()
    kw.setdefault("cache_rule", False)  # acceptance alone: the cache prior has tests of its own
    return ForestPolicy.for_params(params, *costs, **kw)


def test_prior_is_autos():
    assert PRIOR == PRIOR_ACCEPTANCE


def test_flat_gpu_like_costs_pick_a_deep_wide_forest():
    assert policy(GPU).choose(max_gamma=6, roots=4, draft_roots=4) == (6, 8)


def test_a_bound_on_drafts_keeps_every_choice_within_it():
    """The runtime's sequence ids (the engine's max_drafts): on flat costs the deep wide forest does not fit, so
    the best forest within gamma x W_S <= 20 is chosen, exploring too."""
    capped = policy(GPU, max_drafts=20)
    g, ws = capped.choose(max_gamma=6, roots=4, draft_roots=4)
    assert 0 < g * ws <= 20
    assert all(f[0] * f[1] <= 20 for f, _, _ in capped._grid(6, 4))
    explorer = policy(CPU, max_drafts=4, explore=100)
    assert all(g * ws <= 4 for g, ws in [explorer.choose(max_gamma=6, roots=4, draft_roots=4) for _ in range(3)])


def test_the_grid_holds_the_scalar_methods_values_bit_for_bit():
    """Each candidate's (expected steps, seconds less the catch-up pass) in the grid is what expected_steps and
    seconds give, after observations at several depths, widths and lookup counts."""
    params = DecodeParams(mode="dsbd", beams=4, draft_beams=16, gamma=5, lookup_nodes=4).validated()
    p = ForestPolicy.for_params(params, *CPU, verify_cost=lambda ws: 1e-4 * ws, step_cost=2e-4)
    for depth, ws, ok, n in ((1, 4, 3, 0), (2, 8, 5, 2), (3, 16, 9, 4), (1, 5, 1, 1)):
        p.observe(depth, ws, outcomes=[True] * ok + [False] * (ws - ok), passed=ok >= 4, by_cache=ok < 4,
                  distinct=ws - 1, lookups=n)
    for roots in (1, 4):
        for (g, ws, n), steps, seconds in p._grid(5, roots):
            assert steps == p.expected_steps(g, ws, n)
            want = p.seconds(g, ws, roots=roots, draft_roots=0, lookups=n)
            assert seconds == (want - p.draft_cost(0) if g else want)


def _scanned(p, max_gamma, roots, catch_up):
    """The choice as a scan over the grid: the first candidate that no later one beats by a relative 1e-12."""
    best, best_rate = None, -1.0
    for forest, steps, seconds in p._grid(max_gamma, roots):
        r = steps / (seconds + (catch_up if forest[0] else 0.0))
        if r > best_rate * (1 + 1e-12):
            best, best_rate = forest, r
    return best


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_array_choice_is_the_scan(costs):
    """The grid's rates in one array operation pick what the candidate-by-candidate scan picks, on learnt
    counts, for cheap and dear catch-up passes; and where rates near the best lie within the scan's tolerance
    (here made so), the scan decides."""
    p = policy(costs, draft_beams=16, lookups=(0, 1, 2, 4))
    for i in range(12):
        p.observe(1 + i % 3, 4 + i % 5, outcomes=[i % 2 == 0, True], passed=i % 3 != 1, by_cache=i % 4 == 0,
                  distinct=3, lookups=i % 3)
    for catch_up in (0.0, 1e-4, 0.01, 0.3):
        assert p._best(6, 4, catch_up) == _scanned(p, 6, 4, catch_up)
    key = p._key(6, 4)
    grid, (_, _, drafted), _ = p._choice[key]
    assert len(grid) > 10 and drafted.sum() == len(grid) - 1
    # rates 1, 1 + 2e-12, 1 + 2.5e-12 on three candidates: the scan keeps the second, the plain argmax the third
    near = {3: 1.0, 4: 1 + 2e-12, 5: 1 + 2.5e-12}
    made = [(f, near.get(i, 0.5), 1.0) for i, (f, _, _) in enumerate(grid)]
    p._choice[key] = (made, (np.array([s for _, s, _ in made]), np.ones(len(made)), drafted), {})
    assert p._best(6, 4, 0.0) == _scanned(p, 6, 4, 0.0) == grid[4][0] != grid[5][0]


def test_a_plain_choice_holds_for_dearer_catch_ups_and_only_for_them():
    """Once the plain step wins on a grid it is returned without the rates for any dearer catch-up pass; a
    cheaper one, and a grid whose counts changed, are priced again: the scan's choice at every catch-up."""
    p = policy(GPU, draft_beams=16)
    sweep = [0.0, 1e-3, 0.02, 0.05, 0.3, 1.0, 0.05, 0.02, 1e-3, 0.0, 2.0]
    got = [p._best(6, 4, c) for c in sweep]
    assert got == [_scanned(p, 6, 4, c) for c in sweep]
    assert got[0][0] > 0 and got[5][0] == 0  # the sweep crosses from a drafted forest to the plain step
    assert p._choice[p._key(6, 4)][2]["plain_from"] <= 0.3
    p.observe(1, 4, outcomes=[True] * 3, passed=True)  # new counts: a new grid, nothing carried over
    assert "plain_from" not in p._choice.get(p._key(6, 4), ({}, (), {}))[2]
    assert [p._best(6, 4, c) for c in sweep] == [_scanned(p, 6, 4, c) for c in sweep]


def test_a_capped_budget_reads_the_full_grid():
    """Near an answer's end the budget caps gamma: the candidates taken from the full grid equal those of a
    policy whose deepest forest is that cap, value for value, and so does the choice."""
    def made(gamma):
        params = DecodeParams(mode="dsbd", beams=4, draft_beams=16, gamma=gamma).validated()
        p = ForestPolicy.for_params(params, *GPU, lookups=(0, 1, 2), cache_rule=True, verify_cost=2e-3)
        for i in range(6):
            p.observe(1 + i % 2, 4 + i % 3, outcomes=[i % 2 == 0], passed=i % 3 != 1, by_cache=True, lookups=i % 2)
        return p

    full = made(6)
    full.choose(max_gamma=6, roots=4, draft_roots=4)
    for cap in range(6):
        capped = made(cap)
        assert full._grid(cap, 4) == capped._grid(cap, 4)
        assert full.choose(max_gamma=cap, roots=4, draft_roots=9) == capped.choose(max_gamma=cap, roots=4, draft_roots=9)


def test_a_new_policy_takes_the_grids_of_the_same_inputs_and_only_those():
    """Each answer makes a new policy. One with the costs, counts and profile of an earlier one takes that one's
    grids instead of pricing them again and chooses what a policy that prices them chooses; other counts,
    another profile or other costs price their own; the module keeps at most GRIDS_KEPT grids."""
    from app.decoding import forest_policy as fp

    def made(costs=GPU, observed=4):
        p = policy(costs, draft_beams=16, lookups=(0, 1, 2), verify_cost=2e-3)
        for i in range(observed):
            p.observe(1 + i % 2, 4 + i % 3, outcomes=[i % 2 == 0], passed=i % 3 != 1, by_cache=True, lookups=i % 2)
        return p

    calls = [(6, 1, 1), (6, 4, 4), (6, 4, 30), (3, 4, 9), (6, 3, 3), (0, 4, 4), (6, 4, 4)]

    def choices(p):
        return [p.choose(max_gamma=g, roots=r, draft_roots=d, with_lookups=True) for g, r, d in calls]

    fp._SHARED.clear()
    first = made()
    want = choices(first)
    assert len({c[0] > 0 for c in want}) == 2  # drafted and plain choices both
    second = made()
    assert choices(second) == want
    for _, roots, _ in calls:
        assert second._choice[second._key(6, roots)] is first._choice[first._key(6, roots)]  # taken, not priced
    fp._SHARED.clear()
    assert choices(made()) == want  # priced again: the same choices
    profiled = made()
    profiled.set_profile(np.array([0.7, 0.2, 0.1]))
    for other in (made(observed=5), made(costs=CPU), profiled):
        other.choose(max_gamma=6, roots=4, draft_roots=4)
        assert other._choice[other._key(6, 4)] is not first._choice[first._key(6, 4)]
    for roots in range(1, fp.GRIDS_KEPT + 10):
        first.choose(max_gamma=6, roots=roots, draft_roots=4)
    assert len(fp._SHARED) == fp.GRIDS_KEPT


def test_steep_cpu_like_costs_pick_a_small_forest_or_none():
    g, ws = policy(CPU).choose(max_gamma=6, roots=4, draft_roots=4)
    assert g <= 1 and (g == 0 or ws == 4)
    assert policy(CPU).choose(max_gamma=6, roots=4, draft_roots=4) == (0, 4)  # at the prior: do not draft


def test_more_acceptance_drafts_deeper():
    costs = (CostCurve.of({1: 1.0, 8: 1.4, 64: 6.0}), CostCurve.of({1: 0.1, 64: 0.2}))
    low, high = policy(costs, draft_beams=4), policy(costs, draft_beams=4)
    for _ in range(20):
        low.observe(1, 4, outcomes=[False, False, True], passed=True)
        low.observe(2, 4, outcomes=[False] * 4, passed=False)
        for d in (1, 2, 3):
            high.observe(d, 4, outcomes=[True], passed=True)
    g_low, _ = low.choose(max_gamma=6, roots=4, draft_roots=4)
    g_high, _ = high.choose(max_gamma=6, roots=4, draft_roots=4)
    assert g_low < g_high
    assert high.expected_steps(3, 4) > 3.5 and low.expected_steps(3, 4) < 2


def test_gamma_is_capped_by_the_budget_and_the_choice_is_deterministic():
    a, b = policy(GPU), policy(GPU)
    assert a.choose(max_gamma=2, roots=4, draft_roots=4)[0] <= 2
    for p in (a, b):
        p.observe(1, 5, outcomes=[True, False, False, True], passed=True)
    assert a.choose(max_gamma=6, roots=4, draft_roots=9) == b.choose(max_gamma=6, roots=4, draft_roots=9)


def test_count_law_is_the_law_of_every_acceptance_sequence():
    """P(k of ws accepted) summed over all 2^ws sequences, each draft accepted w.p. beta1 first and after an
    acceptance, beta_retry after a rejection."""
    import itertools

    for beta1, retry, ws in ((0.7, 0.2, 1), (0.55, 0.35, 6), (0.9, 0.05, 9), (1.0, 0.0, 4), (0.0, 1.0, 5)):
        law = [0.0] * (ws + 1)
        for seq in itertools.product((True, False), repeat=ws):
            pr, first = 1.0, True
            for ok in seq:
                a = beta1 if first else retry
                pr *= a if ok else 1 - a
                first = ok
            law[sum(seq)] += pr
        assert count_law(beta1, retry, ws) == pytest.approx(law, abs=1e-14)


def test_layer_model_follows_the_width_rule():
    # equal rates: the binomial law
    assert count_law(0.5, 0.5, 2) == pytest.approx([0.25, 0.5, 0.25])
    # t = 0: the widest width W (capped by W_S) must be filled: P(Bin(3, .5) >= 2) = 1/2
    assert layer_pass(0.5, 0.5, 3, 0.0, 1, 2) == pytest.approx(0.5)
    # W_min = W = 2 with W_S = 2: both accepted, 1/4; with W_S = 4: 11/16
    assert layer_pass(0.5, 0.5, 2, 0.9, 2, 2) == pytest.approx(0.25)
    assert layer_pass(0.5, 0.5, 4, 0.9, 2, 2) == pytest.approx(11 / 16)
    # t = 0.7, rates .5, W_S = 2: P(>=1) = .75 >= t, P(>=2) = .25: width 1, pass .75 (spec §6 hand case)
    assert layer_pass(0.5, 0.5, 2, 0.7, 1, 4) == pytest.approx(0.75)
    # retries rarely accepted: first .8, then .1: P(0 of 2) = .2 * .9, P(2 of 2) = .8 * .8
    assert count_law(0.8, 0.1, 2) == pytest.approx([0.18, 1 - 0.18 - 0.64, 0.64])
    # more drafts never lower P(>= 1): the W_min = 1 pass rate grows with W_S
    rates = [layer_pass(0.6, 0.15, ws, 1.0, 1, 4) for ws in range(1, 8)]
    assert rates == sorted(rates)


def test_observed_pass_rates_pull_the_model():
    p = policy(GPU, draft_beams=5)
    before = p.pass_rate(1, 5)
    for _ in range(30):
        p.observe(1, 5, outcomes=[False] * 5, passed=False)
    assert p.pass_rate(1, 5) < 0.1 < before
    assert p.pass_rate(2, 5) < 0.3  # an unseen depth starts from the one above it
    g, _ = p.choose(max_gamma=6, roots=4, draft_roots=4)
    assert g <= 1


# --- distinct tokens, verifier time and lookup nodes (spec §16.4) ------------------------------------------

STEEP = (CostCurve.of({1: 0.05, 2: 0.06, 4: 0.1, 8: 0.2, 32: 0.8}), CostCurve.of({1: 0.005, 64: 0.01}))


def small(costs=STEEP, *, replacement="with") -> ForestPolicy:
    params = DecodeParams(mode="dsbd", beams=2, draft_beams=6, gamma=4).validated()
    return ForestPolicy.for_params(params, *costs, replacement=replacement == "with", cache_rule=False)


def test_expected_distinct_is_the_occupancy_law():
    # E[distinct] = sum_x 1 - (1 - q_x)^n: uniform over 4 with 2 draws -> 4 (1 - 9/16) = 1.75
    assert expected_distinct([0.25] * 4, 2) == pytest.approx(1.75)
    assert expected_distinct([1.0], 5) == pytest.approx(1.0)
    assert expected_distinct([0.5, 0.5, 0, 0], 3) == pytest.approx(2 * (1 - 0.5 ** 3))
    # unnormalised rows are normalised; many tiny entries count ws * q each
    assert expected_distinct([[2.0, 2.0]], 2) == pytest.approx(1.5)
    tiny = [1e-6] * 1_000_000  # 1 - (1 - q)^4 = 4q - 6q^2 + ...: 4 within 1e-5
    assert expected_distinct(tiny, 4) == pytest.approx(1e6 * (1 - (1 - 1e-6) ** 4), rel=1e-5)
    # without replacement every draft is distinct, up to the support
    assert expected_distinct([0.9, 0.05, 0.05], 2, replacement=False) == 2
    assert expected_distinct([0.9, 0.1], 6, replacement=False) == 2


def test_pricing_distinct_tokens_picks_a_wider_forest():
    """A peaked q makes W_S drafts with replacement few distinct tokens: wide layers get cheap on steep costs."""
    blind, priced = small(), small()
    assert blind.choose(max_gamma=4, roots=1, draft_roots=1) == (1, 2)
    assert priced.choose(max_gamma=4, roots=1, draft_roots=1, q_rows=[0.95, 0.05]) == (1, 6)
    assert priced.seconds(1, 6, roots=1, draft_roots=1) < blind.seconds(1, 6, roots=1, draft_roots=1)
    # without replacement all W_S drafts are distinct: a broad q changes nothing against the blind price
    broad = [1 / 50] * 50
    wo = small(replacement="without")
    assert not wo.replacement
    assert wo.choose(max_gamma=4, roots=1, draft_roots=1, q_rows=broad) == (1, 2)
    assert wo.seconds(2, 6, roots=1, draft_roots=1) == pytest.approx(blind.seconds(2, 6, roots=1, draft_roots=1))


def test_observed_distinct_counts_pull_the_estimate():
    p = small()
    assert p.distinct_drafts(1, 6) == 6  # no q, nothing seen: every draft priced
    for _ in range(40):
        p.observe(1, 6, outcomes=[True, True], passed=True, distinct=2)
    assert p.distinct_drafts(1, 6) == pytest.approx((40 * 2 + 4 * 6) / 44)
    assert p.distinct_drafts(2, 6) == p.distinct_drafts(1, 6)  # a deeper layer starts from depth 1's


def test_verifier_time_favours_shallower_forests():
    cheap, slow = small(GPU), small(GPU)
    slow.verify_cost = 1.0  # seconds per verified layer: dwarfs the passes
    g_cheap, _ = cheap.choose(max_gamma=4, roots=2, draft_roots=2)
    g_slow, _ = slow.choose(max_gamma=4, roots=2, draft_roots=2)
    assert g_slow < g_cheap == 4
    # the verifier is priced, never timed: observed layers leave its cost alone (a seed reproduces the choice)
    p = small(GPU)
    p.observe(1, 3, outcomes=[True], passed=True)
    assert p.verify_seconds(3) == p.verify_seconds(4) == 0.0
    slow.observe(1, 3, outcomes=[True], passed=True)
    assert slow.verify_seconds(3) == 1.0


def test_decoder_cost_priors_follow_the_backend_and_the_forest_shape():
    """On the numpy reference's cell costs (the measured qwen-coder decoder): a verified layer of W_S = 5 drafts
    over 4 x 152k cells costs 14 ms of warp + 12 ms of chain (none with top-k), plus the draft side's warp over
    W_S rows; the chain grows with W_S; a faster backend's prices are lower by its cell costs."""
    from app.decoding import rowmath
    from app.decoding.forest_policy import decoder_costs

    ref = rowmath.NumpyRows()
    dense = decoder_costs(DecodeParams(mode="dsbd", beams=4).validated(), 151_936, ref)
    topk = decoder_costs(DecodeParams(mode="dsbd", beams=4, top_k=20).validated(), 151_936, ref)
    draft_side = 5 / 4 * 0.014
    assert dense["verify_cost"](5) == pytest.approx(0.026 + draft_side) and dense["step_cost"] == pytest.approx(0.014)
    assert topk["verify_cost"](5) == pytest.approx(0.014 + draft_side)
    assert dense["verify_cost"](10) - dense["verify_cost"](5) == pytest.approx(0.012 + draft_side)
    half = decoder_costs(DecodeParams(mode="dsbd", beams=2, top_k=20).validated(), 151_936, ref)
    assert half["verify_cost"](4) == pytest.approx(0.007 + 0.014)  # per (beam, token) cell
    fast = decoder_costs(DecodeParams(mode="dsbd", beams=4).validated(), 151_936, rowmath.make("torch"))
    assert fast["verify_cost"](5) < dense["verify_cost"](5) and fast["step_cost"] < dense["step_cost"]
    p = ForestPolicy.for_params(DecodeParams(mode="dsbd", beams=4, gamma=2).validated(), *CPU, **dense)
    bare = ForestPolicy.for_params(DecodeParams(mode="dsbd", beams=4, gamma=2).validated(), *CPU)
    assert p.seconds(0, 4, roots=4, draft_roots=4) == pytest.approx(bare.seconds(0, 4, roots=4, draft_roots=4) + 0.014)
    extra = p.seconds(2, 5, roots=4, draft_roots=4) - bare.seconds(2, 5, roots=4, draft_roots=4)
    # layer 2 is verified if layer 1 passed
    assert extra == pytest.approx(0.014 + (0.026 + draft_side) * (1 + p.pass_rate(1, 5)))


def test_lookup_nodes_only_raise_the_pass_rate_and_are_priced():
    p = ForestPolicy(*STEEP, gammas=(0, 1, 2), widths=(2,), threshold=0.9, min_beams=2, beams=2,
                     lookups=(0, 2, 4), cache_rule=True)
    rates = [p.pass_rate(1, 2, n) for n in (0, 2, 4)]
    assert rates == sorted(rates) and rates[0] > p.acceptance_pass(1, 2)
    # a lookup count seen to fail never prices below fewer lookups
    for _ in range(50):
        p.observe(1, 2, outcomes=[False], passed=False, by_cache=False, lookups=4)
        p.observe(1, 2, outcomes=[False], passed=True, by_cache=True, lookups=2)
    assert p.cache_pass(1, 2, 4) >= p.cache_pass(1, 2, 2) > 0.8
    assert p.seconds(1, 2, roots=1, draft_roots=1, lookups=4) > p.seconds(1, 2, roots=1, draft_roots=1, lookups=0)
    p.target_cost, p.draft_cost = GPU  # tokens nearly free: the cache rule's passes decide
    g, ws, n = p.choose(max_gamma=2, roots=1, draft_roots=1, with_lookups=True)
    assert (g, n) == (2, 2) and p.lookups_chosen == [2]  # 4 lookups pass no more often and cost more
    # cache passes do not count as acceptance passes
    assert p.acceptance_pass(1, 2) < 0.2
    # without the cache rule and no observations lookups buy nothing: never chosen
    plain = ForestPolicy(*STEEP, gammas=(0, 1, 2), widths=(2,), threshold=0.9, min_beams=2, beams=2,
                         lookups=(0, 2, 4))
    assert plain.pass_rate(1, 2, 4) == plain.pass_rate(1, 2, 0)
    assert plain.choose(max_gamma=2, roots=1, draft_roots=1, with_lookups=True)[2] == 0


def test_for_params_reads_the_settings():
    p = ForestPolicy.for_params(DecodeParams(mode="dsbd", beams=2, draft_beams=4, gamma=3, min_beams=2,
                                             replacement="without", lookup_nodes=2).validated(), *STEEP)
    assert (p.replacement, tuple(p.lookups), p.cache_rule, tuple(p.widths)) == (False, (0, 1, 2), True, (2, 3, 4))
    q = ForestPolicy.for_params(DecodeParams(mode="dsbd").validated(), *STEEP)
    assert (q.replacement, tuple(q.lookups), q.cache_rule) == (True, (0,), True)  # the decoder applies it always
    # model-free sources only: the draft model's lookup nodes are no candidates
    r = ForestPolicy.for_params(DecodeParams(mode="dsbd", lookup_nodes=4, lookup_sources=("match",)).validated(),
                                *STEEP)
    assert tuple(r.lookups) == (0,)
    # a GPU-sized range stays a short grid of candidates
    wide = ForestPolicy.for_params(DecodeParams(mode="dsbd", beams=4, draft_beams=32, gamma=8,
                                                lookup_nodes=16).validated(), *GPU)
    assert tuple(wide.widths) == (4, 5, 6, 8, 16, 32) and tuple(wide.lookups) == (0, 1, 2, 4, 8, 16)
    assert wide.choose(max_gamma=8, roots=4, draft_roots=4)[0] == 8  # flat costs: the deepest forest


# --- exploration and learning across answers --------------------------------------------------------------

def test_exploration_stays_within_its_budget_and_tries_only_forests_that_could_pay():
    from app.decoding.forest_policy import ANSWER_SHARE, EXPLORE_SHARE

    p = policy(CPU, explore=3)
    assert p.choose(max_gamma=6, roots=4, draft_roots=4) == (0, 4)  # nothing advanced yet: no budget
    plain = p._plain_step
    p.settle(1)
    picks = []
    for _ in range(600):
        g, ws = p.choose(max_gamma=6, roots=4, draft_roots=4)
        picks.append((g, ws))
        if g:
            # a forest that could not pay even if every layer passed is never tried
            assert (g + 1) / p.seconds(g, ws, roots=4, draft_roots=4) > 1 / plain
            p.observe(1, ws, outcomes=[False] * ws, passed=False)
        p.settle(1)
        assert p.known.explore_s <= EXPLORE_SHARE * p.known.plain_s + 1e-12  # never over budget
        assert p._answer[1] <= ANSWER_SHARE * p._answer[0] + 1e-12  # nor over this answer's share
    tried = [c for c in picks if c[0]]
    assert len(tried) == 3 and len(set(tried)) == 1  # the cheapest such forest, until 3 layers were seen
    assert picks.index(tried[0]) > 50  # the budget is earned by plain steps first
    # the prior alone never drafts on these costs, and a budget of no gamma is respected
    assert policy(CPU).choose(max_gamma=6, roots=4, draft_roots=4) == (0, 4)
    assert policy(CPU, explore=3).choose(max_gamma=0, roots=4, draft_roots=4) == (0, 4)
    # where even the deepest forest cannot pay when every layer passes, nothing is ever tried
    hopeless = policy((CostCurve.of({1: 0.08, 64: 5.0}), CostCurve.of({1: 0.5})), explore=3)
    for _ in range(300):
        assert hopeless.choose(max_gamma=6, roots=4, draft_roots=4)[0] == 0
        hopeless.settle(1)


def test_the_forest_to_explore_is_the_first_cheapest_of_the_grid_that_could_pay():
    """The exploration's pick, read from the grid's arrays, is the scan's: among the drafted candidates with the
    fewest lookups whose rate would beat the plain step if every layer passed, the cheapest, the first of equals."""
    rng = np.random.default_rng(7)
    for costs in (CPU, GPU, (CostCurve.of({1: 0.02, 8: 0.03, 64: 0.2}), CostCurve.of({1: 0.004, 64: 0.005}))):
        p = policy(costs, explore=1000, draft_beams=16, lookups=(2, 4, 8))
        p._answer, p.known.plain_s = [1e9, 0.0], 1e9  # a budget that never binds: the pick alone is tested
        for roots, max_gamma in ((1, 6), (4, 6), (4, 3)):
            grid = p._grid(max_gamma, roots)
            fewest = min(f[2] for f, _, _ in grid)
            for plain in rng.uniform(0.01, 0.5, 20):
                catch_up = float(rng.uniform(0.0, 0.05))
                scan = None
                for (g, ws, n), _, seconds in grid:
                    s = seconds + catch_up
                    if g > 0 and n == fewest and (g + 1) / s > 1.0 / plain * (1 + 1e-9) and (scan is None or s < scan[1]):
                        scan = ((g, ws, n), s)
                got = p._trial(max_gamma, roots, catch_up, float(plain))
                assert (got and (got[0], got[1][0])) == (scan and scan), (costs, roots, plain)


def test_carried_counts_start_the_next_policy_and_are_capped():
    first = policy(CPU)
    for _ in range(100):
        first.observe(1, 4, outcomes=[True, True, True, True], passed=True)
    carried = first.known.carried(cap=20)
    assert carried.layer_runs[(1, 4)] == pytest.approx([20, 20])
    assert carried.depth_draws[1] == pytest.approx([20, 20, 0, 0])
    assert first.known.layer_runs[(1, 4)] == [100, 100]  # the original is untouched
    second = policy(CPU, known=carried)
    assert second.pass_rate(1, 4) > 0.9 and second.observed == 100  # what the pair saw counts as seen
    assert second.expected_steps(3, 4) > 3.5 > policy(CPU).expected_steps(3, 4)
    mid = (CostCurve.of({1: 0.08, 8: 0.18, 64: 1.0}), CostCurve.of({1: 0.01, 8: 0.015}))
    second.target_cost, second.draft_cost = mid
    # what the first answer saw makes deeper forests pay than the prior would draft
    assert policy(mid).choose(max_gamma=6, roots=4, draft_roots=4) == (1, 4)
    assert second.choose(max_gamma=6, roots=4, draft_roots=4) == (3, 4)
    second.observe(1, 4, outcomes=[True], passed=True)
    assert second.known.layers == 101 and second.observed == 101


def test_engine_carries_counts_across_answers_and_explores_within_budget(monkeypatch):
    """Adaptive answers on bigram-table models: each starts from the counts the earlier ones left (the plain
    steps' time and the explorations' cost included); exploration waits for its budget, which plain steps earn
    across answers and within each one, and never exceeds either."""
    import backends.tokenizer
    from app.decoding.forest_policy import ANSWER_SHARE, EXPLORE_SHARE
    from app.engine.auto import AutoPolicy
    from app.engine.engine import Engine, final_event

    monkeypatch.setattr(backends.tokenizer, "check_compatible", lambda draft, target: None)  # table tokenizers
    e = Engine(TARGET, DRAFT, n_ctx=256)
    # as if timed: the prior says drafting does not pay, though it could if every layer passed (a cheap draft,
    # whose catch-up over the tokens it did not see stays cheap: exploration waits for this answer's budget)
    e.policy = AutoPolicy(CostCurve.of({1: 0.08, 4: 0.13, 8: 0.16, 64: 1.0}), CostCurve.of({1: 0.04, 128: 0.045}))
    made = []
    build = e._forest_policy
    monkeypatch.setattr(e, "_forest_policy", lambda *a: made.append(build(*a)) or made[-1])
    params = DecodeParams(mode="dsbd", beams=2, draft_beams=3, gamma=3, max_new_tokens=30, min_beams=2, seed=1,
                          forest="adaptive")
    assert made == [] and build(params.validated(), e.costs()).choose(max_gamma=3, roots=2, draft_roots=2)[0] == 0
    first = final_event(e.generate([1, 2], params)).stats
    (key,) = e._acceptance
    assert e._acceptance[key].plain_s > 0 and first["forest_sizes"] == {"g0": first["iterations"]}  # no budget yet
    explored = 0
    for seed in range(2, 10):
        plain_before = e._acceptance[key].plain_s
        stats = final_event(e.generate([1, 2], replace(params, seed=seed))).stats
        assert made[-1].known.plain_s >= plain_before  # started from the earlier answers' counts
        explored += sum(n for k, n in stats["forest_sizes"].items() if k != "g0")
        k, (plain_s, explore_s) = e._acceptance[key], made[-1]._answer
        assert k.explore_s <= EXPLORE_SHARE * k.plain_s + 1e-12
        assert explore_s <= ANSWER_SHARE * plain_s + 1e-12  # and within this answer's own share
    assert explored > 0 and e._acceptance[key].layers > 0
    # a fixed forest neither reads nor writes the counts
    before = e._acceptance[key].layers
    final_event(e.generate([1, 2], replace(params, forest="fixed")))
    assert made[-1] is None and e._acceptance[key].layers == before


# --- (d) stats, UI and the engine on the real tiny model ------------------------------------------------------

def test_stats_line_and_forest_caption_show_the_sizes():
    from app.serve.ui.forest import forest_svg
    from app.serve.ui.stats import stats_markdown

    _, m, steps = decode("dsbd", TARGET, DRAFT, seed=1, forest="adaptive", costs=VARYING, beams=2, draft_beams=3,
                         gamma=2, max_new_tokens=12)
    stats = m.as_dict()
    assert sum(stats["forest_sizes"].values()) == m.iterations
    md = stats_markdown(stats, memory=False)
    assert "**Forest sizes chosen (adaptive):**" in md
    forests = [s.forest for s in steps if s.forest]
    assert all(f["adaptive"] for f in forests)
    drafted = next(f for f in forests if f["layers"])
    assert f"γ={drafted['gamma']}, W_S={drafted['draft_beams']} (chosen adaptively)" in forest_svg(drafted)
    assert "no draft" in forest_svg({"layers": [], "gamma": 0, "draft_beams": 2, "adaptive": True})
    fixed = dict(stats, forest_policy="fixed")
    assert "Forest sizes" not in stats_markdown(fixed, memory=False)


def test_cli_settings_and_api_carry_the_forest_option():
    from app.serve.api import ChatRequest, decode_params
    from app.cli import build_parser
    from app.serve.ui.settings import params_from, relevant

    a = build_parser().parse_args(["generate", "--mode", "dsbd", "--forest", "adaptive", "--prompt", "hi"])
    assert a.forest == "adaptive"
    assert "forest" in relevant("dsbd") and "forest" in relevant("dsbd-mem") and "forest" not in relevant("sps")
    assert params_from({"mode": "dsbd", "forest": "adaptive"}).forest == "adaptive"
    assert params_from({"mode": "sample", "forest": "adaptive"}).forest == "fixed"  # hidden: the default
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], dsbd={"mode": "dsbd", "forest": "adaptive"})
    assert decode_params(req).forest == "adaptive"


def test_engine_adaptive_forest_on_tiny(tiny_gguf_path):
    from app.engine.engine import Engine

    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        msgs = [{"role": "user", "content": "List three colours."}]
        params = DecodeParams(mode="dsbd", beams=2, draft_beams=4, gamma=4, max_new_tokens=24, seed=7,
                              forest="adaptive")
        events = list(e.chat(msgs, params))  # first use: times the passes (Engine.costs)
        assert e.policy is not None
        stats = events[-1].stats
        assert stats["forest_policy"] == "adaptive" and stats["new_tokens"] > 0
        assert sum(stats["forest_sizes"].values()) == stats["iterations"]
        assert all(ev.forest["adaptive"] for ev in events[:-1] if ev.forest)
        # The counts the answer left (the plain steps' time: the exploration budget) are the engine's now and
        # in the cache folder, for the next process.
        (key,) = e._acceptance
        learnt = e._acceptance.pop(key)
        assert learnt.plain_s > 0 and e.learned.acceptance(key).plain_s == pytest.approx(learnt.plain_s)
        # Same seed, same calibration, same counts (none): the same answer (the choice is deterministic given
        # the past).
        e.learned.path.unlink()
        assert list(e.chat(msgs, params))[-1].text == events[-1].text
        # GPU-like costs: it drafts, and deep (the tiny preset drafts for itself, so nearly every layer passes).
        e.policy.target_cost, e.policy.draft_cost = GPU
        flat = list(e.chat(msgs, params))[-1].stats
        assert any(k != "g0" for k in flat["forest_sizes"]) and flat["steps_per_target_pass"] > 2
        # A forest that may need more sequence ids than llama.cpp holds: fixed, a clear error before it runs;
        # adaptive, the forests it may choose are bounded (4 rows + 16 x 8 lookup nodes leave 124 drafts).
        big = DecodeParams(mode="dsbd", beams=4, draft_beams=32, gamma=8, lookup_nodes=16, max_new_tokens=8,
                           forest="fixed")
        with pytest.raises(ConfigError, match="may need 388 sequence ids in one pass; llama.cpp holds 256: lower "
                                              "draft_beams, gamma or lookup_nodes, or use the adaptive forest"):
            e.check_params(big)
        with pytest.raises(ConfigError, match="sequence ids"):
            list(e.chat(msgs, big))
        adaptive = replace(big, forest="adaptive")
        assert e.check_params(adaptive).forest == "adaptive" and e._forest_budget(adaptive.validated()) == 124
        e.policy.target_cost, e.policy.draft_cost = GPU
        stats = list(e.chat(msgs, adaptive))[-1].stats
        assert stats["new_tokens"] > 0
        shapes = [k[1:].split("/ws") for k in stats["forest_sizes"] if k != "g0"]  # "g3/ws8" -> gamma, W_S
        assert all(int(g) * int(ws) <= 124 for g, ws in shapes)
        with pytest.raises(ConfigError, match="lookup_nodes"):  # lookup nodes alone overflow: adaptive too
            e.check_params(replace(adaptive, lookup_nodes=32))
    finally:
        e.close()


def test_a_deep_forest_with_many_lookup_nodes_is_priced_in_bounded_work(monkeypatch):
    """c_l(L) shrinks toward depth l - 1 for every lookup count up to L: computed once per (depth, W_S, L), not
    once per path through the depths (which grew as (lookup counts)^depth: seconds per choice at gamma 16)."""
    import app.decoding.forest_policy as fp

    calls = [0]
    mean = fp._mean

    def counted(*a):
        calls[0] += 1
        return mean(*a)

    monkeypatch.setattr(fp, "_mean", counted)
    params = DecodeParams(mode="dsbd-mem", beams=4, draft_beams=16, gamma=16, lookup_nodes=16,
                          lookup_sources=("draft", "match"), forest="adaptive").validated()
    p = ForestPolicy.for_params(params, *GPU)
    assert p.lookups == (0, 1, 2, 4, 8, 16) and max(p.gammas) == 16
    p.choose(max_gamma=16, roots=1, draft_roots=1, q_rows=None, with_lookups=True)
    assert calls[0] < 20_000
    fresh = ForestPolicy.for_params(params, *GPU)  # the memo gives the recursion's value
    assert p.cache_pass(16, 16, 16) == pytest.approx(fresh.cache_pass(16, 16, 16))
    assert p.cache_pass(3, 5, 4) >= p.cache_pass(3, 5, 2) >= p.cache_pass(3, 5, 0)
