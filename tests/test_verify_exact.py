"""Layer exactness of verify_layer (spec §5, §11 Theorem 1, §13 items 1-3).

Exact: enumerate every draft tuple (i.i.d. from q, weighted by q) and every outcome of the verifier's
randomness; the output slots must be i.i.d. p within 1e-12, pass and fail combined.
Statistical: the production path (sample_iid drafts, SeededRand verifier) against p and p x p.
Negative controls (wrong variants written here only) must fail the same tests.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Sequence

import numpy as np
import pytest

from app.decoding.sampling import (
    Draft,
    Joint,
    Rand,
    SeededRand,
    Warp,
    positions,
    residual_chain,
    sample_iid,
    verify_layer,
)
from app.decoding.width import tail_probabilities
from dsbd_helpers import (
    ALPHA_TEST,
    NEG_CONTROL_P,
    chisquare_pvalue,
    enumerate_paths,
    joint,
    layer_cases,
    make_drafts,
    rngs,
)

CASES = layer_cases()
SHAPES = [(ws, wl) for ws in (1, 2, 3) for wl in range(1, ws + 1)]  # (W_S, W_L)
N_STAT = 200_000  # spec §13: detects TV 0.01 over <= 16 cells with power > 0.999

Verifier = Callable[..., tuple[bool, list[tuple[int, int | None]]]]
DraftLaw = Iterator[tuple[tuple[int, ...], float]]


def iid_drafts(q: Joint, W_S: int) -> DraftLaw:
    """Every W_S-tuple of q's keys with its i.i.d. probability (the production draft law, §4)."""
    for idx in itertools.product(range(len(q)), repeat=W_S):
        yield tuple(int(q.keys[i]) for i in idx), float(np.prod(q.probs[list(idx)]))


def without_replacement_drafts(q: Joint, W_S: int) -> DraftLaw:
    """Negative control (§4): sequential sampling without replacement, verified against unconditional q."""
    for idx in itertools.permutations(range(len(q)), W_S):
        w, left = 1.0, 1.0
        for i in idx:
            w *= q.probs[i] / left
            left -= q.probs[i]
        yield tuple(int(q.keys[i]) for i in idx), w


def exact_layer_law(
    p: Joint, q: Joint, valid: np.ndarray, W_S: int, W_L: int,
    verify: Verifier = verify_layer, drafts_law: Callable[[Joint, int], DraftLaw] = iid_drafts,
) -> tuple[dict[tuple[int, ...], float], float]:
    """Exact law of the output slot keys, and P(pass), by full enumeration."""
    S, R, _ = residual_chain(p, q, W_S)
    law: dict[tuple[int, ...], float] = {}
    p_pass = 0.0
    for keys, w in drafts_law(q, W_S):
        drafts = make_drafts(np.array(keys), q, valid)
        for (passed, out), pr in enumerate_paths(lambda rand: verify(drafts, S, R, W_L, rand)):
            k = tuple(key for key, _ in out)
            law[k] = law.get(k, 0.0) + w * pr
            p_pass += w * pr * passed
    return law, p_pass


def product_law(p: Joint, W_L: int) -> dict[tuple[int, ...], float]:
    return {
        tuple(int(p.keys[i]) for i in idx): float(np.prod(p.probs[list(idx)]))
        for idx in itertools.product(range(len(p)), repeat=W_L)
    }


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# -------------------------------------------------------------------------------------------- 1. exact


@pytest.mark.parametrize("W_S,W_L", SHAPES)
@pytest.mark.parametrize("case", list(CASES))
def test_layer_law_is_iid_p_exact(case: str, W_S: int, W_L: int) -> None:
    p, q, valid = CASES[case]
    law, p_pass = exact_layer_law(p, q, valid, W_S, W_L)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert max_gap(law, product_law(p, W_L)) <= 1e-12
    # The verifier passes exactly as often as the width DP predicts (§6: P(pass) = tail[W_L]).
    _, _, alpha = residual_chain(p, q, W_S)
    assert p_pass == pytest.approx(tail_probabilities(alpha)[W_L], abs=1e-12)


def test_invalid_parent_example_exact() -> None:
    """§5 example: p' = (a, c) halves, q = (a, b) halves with b's parent invalid: P(a) = 1/2."""
    p, q, valid = _invalid_example()
    law, _ = exact_layer_law(p, q, valid, 1, 1)
    assert law[(0,)] == pytest.approx(0.5, abs=1e-15)


def test_failed_layer_outputs_exactly_width() -> None:
    """§5: a point-mass draft on a passes exactly when it yields a; fail emits W_L beams, never more."""
    p, q = joint([[0.5, 0.5]]), joint([[1.0, 0.0]])
    law, p_pass = exact_layer_law(p, q, np.array([True]), 1, 1)
    assert p_pass == pytest.approx(0.5) and law == pytest.approx({(0,): 0.5, (1,): 0.5})


# ------------------------------------------------------------------------------- 3. negative controls, exact


def _invalid_example() -> tuple[Joint, Joint, np.ndarray]:
    # keys: a = (parent 0, token 0) = 0, c = (0, 1) = 1, b = (parent 1, token 0) = 2; parent 1 invalid
    return joint([[0.5, 0.5], [0, 0]]), joint([[0.5, 0], [0.5, 0]]), np.array([True, False])


def verify_skipping_invalid(drafts: Sequence[Draft], S: np.ndarray, R: np.ndarray, width: int, rand: Rand):
    """WRONG on purpose (§5): skips invalid-parent drafts without advancing the residual."""
    pos = positions(S, np.array([d.key for d in drafts], dtype=np.int64))
    acc, c = [], 0
    for i, d in enumerate(drafts):
        if len(acc) == width:
            break
        if not d.valid:
            continue  # the bug: c is not advanced
        r = float(R[c, pos[i]]) if pos[i] >= 0 else 0.0
        if rand.bernoulli(min(1.0, r / d.qval)):
            acc.append((d.key, i))
            c = 0
        else:
            c += 1
    if len(acc) == width:
        return True, acc
    out = acc + [(rand.categorical(S, R[c]), None)]
    while len(out) < width:
        out.append((rand.categorical(S, R[0]), None))
    return False, out


def test_negative_without_replacement_exact() -> None:
    """§4 example: (a,b) 1/2, (b,a) 23/90 = 0.256, (b,b) 22/90 = 0.244, never (a,a): not p x p."""
    p, q = joint([[0.5, 0.5]]), joint([[0.9, 0.1]])
    law, _ = exact_layer_law(p, q, np.array([True]), 2, 2, drafts_law=without_replacement_drafts)
    assert law.get((0, 1), 0) == pytest.approx(0.5, abs=1e-12)
    assert law.get((1, 0), 0) == pytest.approx(23 / 90, abs=1e-12)
    assert law.get((1, 1), 0) == pytest.approx(22 / 90, abs=1e-12)
    assert law.get((0, 0), 0.0) == pytest.approx(0.0, abs=1e-12)
    assert max_gap(law, product_law(p, 2)) > 0.2
    # the same verifier with i.i.d. drafts is exact
    law_iid, _ = exact_layer_law(p, q, np.array([True]), 2, 2)
    assert max_gap(law_iid, product_law(p, 2)) <= 1e-12


def test_negative_skip_invalid_exact() -> None:
    """§5 example: skipping b without the residual update gives P(a) = 3/4 instead of 1/2."""
    p, q, valid = _invalid_example()
    law, _ = exact_layer_law(p, q, valid, 1, 1, verify=verify_skipping_invalid)
    assert law[(0,)] == pytest.approx(0.75, abs=1e-12)
    assert max_gap(law, product_law(p, 1)) > 0.2


@pytest.mark.parametrize("case", ["golden", "three_parents"])
def test_negative_skip_invalid_fails_general(case: str) -> None:
    p, q, valid = CASES[case]
    law, _ = exact_layer_law(p, q, valid, 2, 2, verify=verify_skipping_invalid)
    assert max_gap(law, product_law(p, 2)) > 1e-3


# ------------------------------------------------------------------------------------- 2. statistical


def run_layers(
    p: Joint, q: Joint, valid: np.ndarray, W_S: int, W_L: int, n: int, test_id: str,
    verify: Verifier = verify_layer, draft_keys: np.ndarray | None = None,
) -> np.ndarray:
    """n seeded layers on the production path; returns output slots as indices into S, [n, W_L]."""
    rng_draft, rng_verify = rngs(test_id)
    S, R, _ = residual_chain(p, q, W_S)
    if draft_keys is None:
        draft_keys = sample_iid(q, n * W_S, rng_draft).reshape(n, W_S)  # [n, W_S] i.i.d. from q
    qval = q.lookup(draft_keys)  # [n, W_S]
    ok = valid[q.parent(draft_keys)]  # [n, W_S]
    rand = SeededRand(rng_verify)
    out = np.empty((n, W_L), dtype=np.int64)  # [n, W_L] keys
    for t, (ks, vs, bs) in enumerate(zip(draft_keys.tolist(), qval.tolist(), ok.tolist())):
        _, slots = verify([Draft(k, v, b) for k, v, b in zip(ks, vs, bs)], S, R, W_L, rand)
        out[t] = [key for key, _ in slots]
    idx = positions(S, out)
    assert np.all(idx >= 0), "an output key lies outside supp(p)"
    return idx


def slot_pvalues(idx: np.ndarray, p: Joint) -> tuple[list[float], list[float]]:
    """p-values of each slot vs p and of each slot pair vs p x p."""
    m = len(p)
    single = [chisquare_pvalue(np.bincount(idx[:, s], minlength=m), p.probs) for s in range(idx.shape[1])]
    pairs = [
        chisquare_pvalue(np.bincount(idx[:, a] * m + idx[:, b], minlength=m * m), np.outer(p.probs, p.probs))
        for a, b in itertools.combinations(range(idx.shape[1]), 2)
    ]
    return single, pairs


def _stat_case() -> tuple[Joint, Joint, np.ndarray]:
    # |S| = 4 (16 pair cells); q misses key 1, puts mass on key 2 (valid parent, outside S after top_k)
    # and on the invalid parent 1.
    p = joint([[0.3, 0.2, 0.01], [0, 0, 0], [0.35, 0.15, 0.01]], Warp(top_k=4))
    q = joint([[0.2, 0, 0.1], [0.15, 0.05, 0], [0.05, 0.3, 0.15]])
    return p, q, np.array([True, False, True])


@pytest.mark.slow
def test_layer_statistical_production_path() -> None:
    p, q, valid = _stat_case()
    assert len(p) == 4
    idx = run_layers(p, q, valid, W_S=3, W_L=2, n=N_STAT, test_id="verify_stat_3_2")
    single, pairs = slot_pvalues(idx, p)
    assert min(single) > ALPHA_TEST, single
    assert min(pairs) > ALPHA_TEST, pairs


@pytest.mark.slow
@pytest.mark.parametrize("W_S,W_L", [(3, 3), (4, 2), (2, 1)])
def test_layer_statistical_more_shapes(W_S: int, W_L: int) -> None:
    p, q, valid = _stat_case()
    idx = run_layers(p, q, valid, W_S=W_S, W_L=W_L, n=N_STAT, test_id=f"verify_stat_{W_S}_{W_L}")
    single, pairs = slot_pvalues(idx, p)
    assert min(single + pairs) > ALPHA_TEST, (single, pairs)


# ------------------------------------------------------------------------- 3. negative controls, statistical


@pytest.mark.slow
def test_negative_without_replacement_statistical() -> None:
    p, q = joint([[0.5, 0.5]]), joint([[0.9, 0.1]])
    rng_draft, _ = rngs("neg_without_replacement_draws")
    # Gumbel top-k = sequential sampling without replacement, in draw order.
    g = np.log(q.probs) + rng_draft.gumbel(size=(N_STAT, len(q)))  # [N, |q|]
    keys = q.keys[np.argsort(-g, axis=1)[:, :2]]  # [N, 2]
    idx = run_layers(p, q, np.array([True]), 2, 2, N_STAT, "neg_without_replacement", draft_keys=keys)
    single, pairs = slot_pvalues(idx, p)
    assert single[1] < NEG_CONTROL_P and pairs[0] < NEG_CONTROL_P


@pytest.mark.slow
def test_negative_skip_invalid_statistical() -> None:
    p, q, valid = _invalid_example()
    idx = run_layers(p, q, valid, 1, 1, N_STAT, "neg_skip_invalid", verify=verify_skipping_invalid)
    single, _ = slot_pvalues(idx, p)
    assert single[0] < NEG_CONTROL_P
    # the production verifier on the same case passes
    idx = run_layers(p, q, valid, 1, 1, N_STAT, "skip_invalid_positive")
    assert slot_pvalues(idx, p)[0][0] > ALPHA_TEST
