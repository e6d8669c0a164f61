"""Dynamic width (spec §6, §13 items 3-4): the acceptance-count DP and the threshold rule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.decoding.sampling import Draft, Joint, SeededRand, residual_chain, sample_iid, verify_layer
from app.decoding.width import (acceptance_count_law, acceptance_count_table, choose_width, layer_width,
                                tail_probabilities)
from dsbd_helpers import (ALPHA_TEST, NEG_CONTROL_P, chisquare_pvalue, enumerate_paths, layer_cases, make_drafts,
                          rngs)

CASES = layer_cases()
N_MC = 200_000

GOLDEN_ALPHA = (0.35, 0.30385, 0.15, 0.15)  # spec §6, 5 digits
GOLDEN_LAW = (0.32693, 0.32580, 0.23181, 0.10045, 0.01501)


def enumerated_count_law(p: Joint, q: Joint, valid: np.ndarray, W_S: int) -> np.ndarray:
    """Exact law of #accepted among W_S i.i.d. drafts, every draft tested (width = W_S never stops early)."""
    S, R, _ = residual_chain(p, q, W_S)
    law = np.zeros(W_S + 1)
    for idx in itertools.product(range(len(q)), repeat=W_S):
        w = float(np.prod(q.probs[list(idx)]))
        drafts = make_drafts(q.keys[list(idx)], q, valid)
        run = lambda rand: verify_layer(drafts, S, R, W_S, rand)  # noqa: E731
        for (_, out), pr in enumerate_paths(run, branch_categorical=False):
            law[sum(i is not None for _, i in out)] += w * pr
    return law


def double_step_alpha(p: Joint, q: Joint, W_S: int) -> np.ndarray:
    """WRONG on purpose (reference code, §6): the residual step applied twice per j."""
    q_S = q.lookup(p.keys)
    r, alpha = p.probs.copy(), []

    def step(r: np.ndarray) -> np.ndarray:
        d = np.maximum(r - q_S, 0.0)
        return d / d.sum() if d.sum() >= 1e-12 else p.probs

    for j in range(W_S):
        alpha.append(np.minimum(r, q_S).sum())
        r = step(step(r))
    return np.array(alpha)


class _AcceptOnlyRand(SeededRand):
    """Production acceptance tests; correction and fill draws (irrelevant to the count) skipped for speed."""

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int:
        return int(keys[0])


# ---------------------------------------------------------------------------------------- hand and golden


def test_hand_case() -> None:
    np.testing.assert_allclose(acceptance_count_law([0.5, 0.5]), [0.25, 0.5, 0.25], atol=1e-15)
    assert choose_width([0.5, 0.5], 0.7, 0, 2) == 1
    assert choose_width([0.5, 0.5], 0.9, 0, 2) == 0


def test_golden_case_from_p_and_q() -> None:
    p, q, _ = CASES["golden"]
    _, _, alpha = residual_chain(p, q, 4)
    # exact: alpha_2 = min(.4/.65, .1) + min(.1/.65, .2) + min(.15/.65, .05)
    np.testing.assert_allclose(alpha, [0.35, 0.15 + 0.1 / 0.65, 0.15, 0.15], rtol=0, atol=1e-12)
    np.testing.assert_allclose(alpha, GOLDEN_ALPHA, rtol=0, atol=5e-6)
    np.testing.assert_allclose(acceptance_count_law(alpha), GOLDEN_LAW, rtol=0, atol=5e-6)


def test_rows_sum_to_one() -> None:
    rng = rngs("width_rows")[0]
    for m in range(0, 9):
        for alpha in (rng.random(m), np.zeros(m), np.ones(m), rng.choice([0.0, 1.0, 0.3], m)):
            P = acceptance_count_table(alpha)
            assert P.shape == (m + 1, m + 1)
            np.testing.assert_allclose(P.sum(axis=1), 1.0, atol=1e-12)
            assert np.all(P >= 0) and np.all(np.triu(P, 1) == 0)  # k <= n


def test_tail_and_degenerate_alphas() -> None:
    np.testing.assert_allclose(acceptance_count_law([1.0, 1.0, 1.0]), [0, 0, 0, 1])
    np.testing.assert_allclose(acceptance_count_law([0.0, 0.0]), [1, 0, 0])
    np.testing.assert_allclose(acceptance_count_law([]), [1.0])
    tail = tail_probabilities([0.5, 0.5])
    np.testing.assert_allclose(tail, [1.0, 0.75, 0.25], atol=1e-15)


# ------------------------------------------------------------------------------ DP vs enumeration / MC


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("W_S", [1, 2, 3])
def test_dp_matches_enumerated_count_law(case: str, W_S: int) -> None:
    p, q, valid = CASES[case]
    _, _, alpha = residual_chain(p, q, W_S)
    exact = enumerated_count_law(p, q, valid, W_S)
    np.testing.assert_allclose(acceptance_count_law(alpha), exact, rtol=0, atol=1e-12)


def test_dp_matches_enumerated_golden_w4() -> None:
    p, q, valid = CASES["golden"]
    _, _, alpha = residual_chain(p, q, 4)
    exact = enumerated_count_law(p, q, valid, 4)
    np.testing.assert_allclose(acceptance_count_law(alpha), exact, rtol=0, atol=1e-12)
    # negative control: the double residual step predicts a different law
    assert np.abs(acceptance_count_law(double_step_alpha(p, q, 4)) - exact).max() > 0.05


@pytest.mark.slow  # the same counts enumerated exactly: test_dp_matches_enumerated_golden_w4
def test_dp_matches_monte_carlo_golden() -> None:
    """Production path, no stopping (width = W_S = 4); the double-step DP must fail on the same counts."""
    p, q, valid = CASES["golden"]
    W_S = 4
    S, R, alpha = residual_chain(p, q, W_S)
    rng_draft, rng_verify = rngs("width_mc_golden")
    keys = sample_iid(q, N_MC * W_S, rng_draft).reshape(N_MC, W_S)  # [N, W_S]
    qval, ok = q.lookup(keys), valid[q.parent(keys)]  # [N, W_S]
    rand = _AcceptOnlyRand(rng_verify)
    counts = np.zeros(W_S + 1, dtype=np.int64)
    for ks, vs, bs in zip(keys.tolist(), qval.tolist(), ok.tolist()):
        _, out = verify_layer([Draft(k, v, b) for k, v, b in zip(ks, vs, bs)], S, R, W_S, rand)
        counts[sum(i is not None for _, i in out)] += 1
    assert chisquare_pvalue(counts, acceptance_count_law(alpha)) > ALPHA_TEST
    assert chisquare_pvalue(counts, acceptance_count_law(double_step_alpha(p, q, W_S))) < NEG_CONTROL_P


# ------------------------------------------------------------------------------------------ the rule


def test_width_non_increasing_in_t() -> None:
    rng = rngs("width_monotone")[0]
    ts = np.linspace(0.0, 1.0, 101)
    for _ in range(50):
        alpha = rng.random(rng.integers(1, 7))
        widths = [choose_width(alpha, t, 1, len(alpha)) for t in ts]
        assert all(a >= b for a, b in zip(widths, widths[1:]))
        raw = [choose_width(alpha, t, 0, len(alpha)) for t in ts]
        assert raw[0] == len(alpha)  # t = 0: every K qualifies


def test_clamps() -> None:
    alpha = [0.9, 0.9, 0.9, 0.9, 0.9]
    tail = tail_probabilities(alpha)
    K = max(k for k in range(6) if tail[k] >= 0.5)
    assert choose_width(alpha, 0.5, 1, 5) == K
    assert choose_width(alpha, 0.5, 1, 2) == 2  # w_max caps
    assert choose_width([0.1, 0.1], 0.9, 2, 4) == 2  # w_min forces above K = 0
    assert choose_width([0.1, 0.1], 0.9, 1, 4) == 1
    assert choose_width([1.0, 1.0, 1.0], 1.0, 1, 4) == 3  # tolerance: tail[3] = 1 >= t
    for t in np.linspace(0, 1, 11):
        for w_min in range(1, 4):
            for w_max in range(w_min, 5):
                assert w_min <= choose_width(alpha, t, w_min, w_max) <= w_max
    with pytest.raises(ValueError):
        choose_width(alpha, 0.5, 3, 2)


def test_threshold_tolerance() -> None:
    # tail[1] = 0.75 exactly; t a hair above it (within 1e-12) still admits K = 1
    assert choose_width([0.5, 0.5], 0.75 + 5e-13, 0, 2) == 1
    assert choose_width([0.5, 0.5], 0.75 + 1e-9, 0, 2) == 0


def test_pass_probability_at_least_t() -> None:
    """§6: P(layer passes) = tail[W_L] >= t unless W_min forced the width above K."""
    rng = rngs("width_pass_prob")[0]
    for _ in range(200):
        alpha = rng.random(rng.integers(1, 7))
        t = rng.random()
        w = choose_width(alpha, t, 1, len(alpha))
        tail = tail_probabilities(alpha)
        assert tail[w] >= t - 1e-12 or w == 1


def test_the_lazy_width_is_the_rule_and_reads_only_what_decides_it() -> None:
    """`layer_width` returns `choose_width` on all m alphas for every threshold and clamp, reading a prefix only:
    none at a fixed width, W_max of them when those already pass the threshold."""
    rng = rngs("lazy_width")[0]
    for _ in range(3000):
        m = int(rng.integers(0, 12))
        alpha = rng.random(m) ** float(rng.choice([0.2, 1.0, 3.0]))
        t = float(rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()]))
        w_min = int(rng.integers(0, 5))
        w_max = int(rng.integers(w_min, 6))
        read: list[int] = []
        lazy = layer_width(lambda j: read.append(j) or alpha[:j], m, t, w_min, w_max)
        assert lazy == choose_width(alpha, t, w_min, w_max), (alpha, t, w_min, w_max)
        assert all(j <= m for j in read)
        if w_min == w_max:
            assert read == []
    assert layer_width(lambda j: np.ones(j), 32, 0.9, 1, 4) == 4
    read = []
    layer_width(lambda j: read.append(j) or np.ones(j), 32, 0.9, 1, 4)
    assert read == [4]
    with pytest.raises(ValueError):
        layer_width(np.zeros, 3, 0.5, 3, 2)
