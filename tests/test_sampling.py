"""Sampling math (spec §2, §5, §13 item 8): log_softmax, warp, Joint, sample_iid, residual chain, Rand."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax as scipy_log_softmax

from app.decoding.sampling import (
    Draft,
    Joint,
    SeededRand,
    Warp,
    log_softmax,
    positions,
    residual_chain,
    sample_iid,
    verify_layer,
    warp_joint,
)
from dsbd_helpers import ALPHA_TEST, chisquare_pvalue, joint, joint_from_dense, make_drafts, rngs

NEG = -np.inf


def as_dict(p: Joint) -> dict[int, float]:
    return {int(k): float(v) for k, v in zip(p.keys, p.probs)}


# -------------------------------------------------------------------------------------------- log_softmax


def test_log_softmax_matches_scipy_and_is_stable() -> None:
    rng = rngs("log_softmax")[0]
    x = rng.normal(size=(4, 50)) * 10 + 1e4  # large offset: naive exp would overflow
    np.testing.assert_allclose(log_softmax(x), scipy_log_softmax(x, axis=-1), atol=1e-9)
    np.testing.assert_allclose(log_softmax(x[0]), scipy_log_softmax(x[0]), atol=1e-9)
    assert log_softmax(x.astype(np.float32)).dtype == np.float64


def test_log_softmax_masked_entries_and_rows() -> None:
    x = np.array([[0.0, NEG, np.log(3.0)], [NEG, NEG, NEG]])
    out = log_softmax(x)
    np.testing.assert_allclose(np.exp(out[0]), [0.25, 0.0, 0.75], atol=1e-15)
    assert np.all(out[1] == NEG)  # an all -inf row stays -inf, no nan


# ------------------------------------------------------------------------------------------------- Warp


def test_warp_validation_and_truncating() -> None:
    assert not Warp().truncating
    assert Warp(top_k=5).truncating and Warp(top_p=0.9).truncating and not Warp(temperature=0.5).truncating
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Warp(**bad)


# ------------------------------------------------------------------------------------------- warp_joint


def test_untruncated_is_joint_softmax_over_finite_entries() -> None:
    rng = rngs("warp_dense")[0]
    z = rng.normal(size=(3, 7))
    z[1] = NEG  # invalid parent
    z[0, 2] = NEG  # masked id
    p = warp_joint(z, Warp())
    np.testing.assert_array_equal(p.keys, np.flatnonzero(np.isfinite(z)))
    ls = log_softmax(z.reshape(-1))
    np.testing.assert_allclose(p.probs, np.exp(ls[p.keys]), rtol=1e-13)
    assert p.vocab == 7 and p.keys.dtype == np.int64 and p.probs.dtype == np.float64
    assert p.probs.sum() == pytest.approx(1.0, abs=1e-14)


def test_top_k_counts_pairs_not_per_beam() -> None:
    z = np.array([[5.0, 4.0, 3.0], [1.0, 0.0, -1.0]])
    p = warp_joint(z, Warp(top_k=2))
    assert list(p.keys) == [0, 1]  # both from parent 0; per-beam top_k would keep 4 pairs
    np.testing.assert_allclose(p.probs, np.exp([5, 4]) / np.exp([5, 4]).sum())
    assert list(warp_joint(z, Warp(top_k=4)).keys) == [0, 1, 2, 3]


def test_top_k_ties_break_by_lower_key() -> None:
    assert list(warp_joint(np.zeros((2, 3)), Warp(top_k=2)).keys) == [0, 1]
    z = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # two 1s (keys 0, 4), then ties of 0 at 1, 2, 3, 5
    assert list(warp_joint(z, Warp(top_k=3)).keys) == [0, 1, 4]
    assert list(warp_joint(z, Warp(top_k=5)).keys) == [0, 1, 2, 3, 4]


def test_invalid_parents_go_before_top_k() -> None:
    z = np.array([[0.0, -1.0, -2.0], [NEG, NEG, NEG], [-3.0, NEG, -4.0]])
    p = warp_joint(z, Warp(top_k=4))
    assert list(p.keys) == [0, 1, 2, 6]  # 4 valid pairs, none from the invalid row or the masked id
    assert np.all(p.parent(p.keys) != 1)
    # top_k above the number of valid pairs keeps them all, bit-identical to no truncation
    a, b = warp_joint(z, Warp(top_k=100)), warp_joint(z, Warp())
    assert a.keys.tobytes() == b.keys.tobytes() and a.probs.tobytes() == b.probs.tobytes()


def test_top_p_keeps_the_crossing_entry() -> None:
    z = np.log([[0.5, 0.3, 0.2]])
    assert as_dict(warp_joint(z, Warp(top_p=0.6))) == pytest.approx({0: 0.625, 1: 0.375})
    assert list(warp_joint(z, Warp(top_p=0.4)).keys) == [0]  # at least the first entry
    assert list(warp_joint(z, Warp(top_p=0.51)).keys) == [0, 1]
    assert list(warp_joint(z, Warp(top_p=0.81)).keys) == [0, 1, 2]
    # across parents: mass ordered over pairs
    z2 = np.log([[0.1, 0.35], [0.4, 0.15]])
    assert list(warp_joint(z2, Warp(top_p=0.7)).keys) == [1, 2]
    assert list(warp_joint(z2, Warp(top_p=0.76)).keys) == [1, 2, 3]


def test_top_p_ties_break_by_lower_key() -> None:
    z = np.zeros((2, 2))  # four pairs of 0.25
    assert list(warp_joint(z, Warp(top_p=0.5)).keys) == [0, 1]
    z = np.array([[0.0, 1.0], [1.0, 0.0]])  # equal leaders at keys 1 and 2
    assert list(warp_joint(z, Warp(top_p=0.1)).keys) == [1]


def test_top_p_applies_to_the_top_k_renormalised_mass() -> None:
    z = np.log([[0.4, 0.3, 0.2, 0.1]])
    assert list(warp_joint(z, Warp(top_p=0.5)).keys) == [0, 1]  # 0.4 < 0.5
    p = warp_joint(z, Warp(top_k=2, top_p=0.5))  # 4/7 >= 0.5 after top_k
    assert list(p.keys) == [0] and p.probs[0] == 1.0


def test_temperature() -> None:
    rng = rngs("warp_temperature")[0]
    z = rng.normal(size=(2, 5))
    for T in (0.5, 2.0):
        p = warp_joint(z, Warp(temperature=T))
        np.testing.assert_allclose(p.probs, np.exp(log_softmax((z / T).reshape(-1))), rtol=1e-13)
    # T sharpens or flattens before top_p: T -> small keeps only the argmax pair
    assert list(warp_joint(z, Warp(temperature=1e-3, top_p=0.9)).keys) == [int(np.argmax(z))]


@pytest.mark.parametrize(
    "warp", [Warp(), Warp(top_k=20), Warp(top_p=0.9), Warp(temperature=0.7, top_k=50, top_p=0.8)]
)
def test_bit_identical_on_identical_inputs(warp: Warp) -> None:
    rng = rngs("warp_bits")[0]
    z = np.round(rng.normal(size=(4, 1000)), 1)  # rounding makes many ties
    z[2] = NEG
    a = warp_joint(z, warp)
    for other in (z.copy(), np.asfortranarray(z), z.astype(np.float64).copy(order="C")):
        b = warp_joint(other, warp)
        assert a.keys.tobytes() == b.keys.tobytes() and a.probs.tobytes() == b.probs.tobytes()
    assert np.all(np.diff(a.keys) > 0) and np.all(a.probs > 0)
    if warp.top_k and warp.top_p == 1.0:
        assert len(a) == warp.top_k


def reference_warp(z: np.ndarray, warp: Warp) -> tuple[np.ndarray, np.ndarray]:
    """§2 the obvious way: one full sort by (-value, key)."""
    flat = z.reshape(-1) / warp.temperature
    keys = np.flatnonzero(np.isfinite(flat))
    order = keys[np.lexsort((keys, -flat[keys]))]  # descending value, ties by lower key
    if warp.top_k:
        order = order[: warp.top_k]
    if warp.top_p < 1:
        e = np.exp(flat[order] - flat[order[0]])
        cum = np.cumsum(e / e.sum())
        order = order[: int(np.argmax(cum >= warp.top_p)) + 1 if cum[-1] >= warp.top_p else order.size]
    kept = np.sort(order)
    e = np.exp(flat[kept] - flat[kept].max())
    return kept, e / e.sum()


@pytest.mark.parametrize(
    "warp", [Warp(top_p=0.5), Warp(top_p=0.99), Warp(top_k=3000, top_p=0.95), Warp(temperature=3.0, top_p=0.999)]
)
def test_fast_paths_match_full_sort_reference(warp: Warp) -> None:
    """Partial selection (top_k) and the growing sorted head (top_p) equal a full sort, ties included."""
    rng = rngs("warp_reference")[0]
    z = np.round(rng.normal(size=(4, 6000)) * 0.5, 2)  # flat-ish with many ties: the head must grow
    z[1, :] = NEG
    z[0, ::7] = NEG
    keys, probs = reference_warp(z, warp)
    p = warp_joint(z, warp)
    np.testing.assert_array_equal(p.keys, keys)
    np.testing.assert_allclose(p.probs, probs, rtol=1e-12)
    assert len(p) > 1024 or warp.top_p == 0.5  # the larger cases really exercise head growth


def test_warp_errors_and_underflow() -> None:
    with pytest.raises(ValueError):
        warp_joint(np.full((2, 3), NEG), Warp())
    with pytest.raises(ValueError):
        warp_joint(np.array([[0.0, np.nan]]), Warp())
    with pytest.raises(ValueError):
        warp_joint(np.array([[0.0, np.inf]]), Warp())
    p = warp_joint(np.array([[0.0, -1000.0, -1.0]]), Warp())  # exp(-1000) underflows: dropped, probs > 0
    assert list(p.keys) == [0, 2] and np.all(p.probs > 0)
    assert list(warp_joint(np.array([0.0, 1.0]), Warp()).keys) == [0, 1]  # [V] = one parent


# ---------------------------------------------------------------------------------------- Joint, lookup


def test_joint_helpers() -> None:
    p = joint_from_dense([[0.5, 0.0, 0.2], [0.0, 0.3, 0.0]])
    assert list(p.keys) == [0, 2, 4] and len(p) == 3
    np.testing.assert_array_equal(p.lookup(np.array([4, 1, 0, 99, -1])), [0.3, 0.0, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(p.parent(p.keys), [0, 0, 1])
    np.testing.assert_array_equal(p.token(p.keys), [0, 2, 1])
    np.testing.assert_array_equal(positions(p.keys, np.array([2, 3, 4])), [1, -1, 2])
    big = joint_from_dense(np.random.default_rng(0).random((3, 5000)) * (np.arange(15000) % 3 > 0).reshape(3, -1))
    probe = np.arange(-5, 15010, 2)  # > 4096 keys: the dense-scatter path, including keys out of range
    expect = np.where(positions(big.keys, probe) >= 0, big.probs[np.maximum(positions(big.keys, probe), 0)], 0.0)
    np.testing.assert_array_equal(big.lookup(probe), expect)
    np.testing.assert_array_equal(big.lookup(probe[probe >= 0]), expect[probe >= 0])
    empty = Joint(np.zeros(0, np.int64), np.zeros(0), 3)
    assert empty.lookup(np.array([1, 2])).tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------------------------- draws


def test_sample_iid_law() -> None:
    p = joint([[0.5, 0.0, 0.2], [0.001, 0.299, 0.0]])
    keys = sample_iid(p, 200_000, rngs("sample_iid")[0])
    counts = np.bincount(positions(p.keys, keys), minlength=len(p))
    assert counts.sum() == 200_000 and chisquare_pvalue(counts, p.probs) > ALPHA_TEST


def test_sample_iid_matches_seeded_categorical_stream() -> None:
    """The RNG protocol: n i.i.d. draws = n successive SeededRand.categorical calls on the same seed."""
    p = joint([[0.1, 0.2, 0.3], [0.25, 0.0, 0.15]])
    a = sample_iid(p, 500, np.random.default_rng(5))
    rand = SeededRand(np.random.default_rng(5))
    b = [rand.categorical(p.keys, p.probs) for _ in range(500)]
    assert a.tolist() == b


def test_seeded_rand_conventions() -> None:
    rand = SeededRand(rngs("seeded_rand")[0])
    assert all(rand.bernoulli(1.0) for _ in range(1000)) and not any(rand.bernoulli(0.0) for _ in range(1000))
    hits = sum(rand.bernoulli(0.3) for _ in range(20_000))
    assert chisquare_pvalue(np.array([hits, 20_000 - hits]), np.array([0.3, 0.7])) > ALPHA_TEST
    keys, probs = np.array([3, 5, 9]), np.array([0.0, 1.0, 0.0])
    assert {rand.categorical(keys, probs) for _ in range(100)} == {5}  # zero cells are never drawn


# --------------------------------------------------------------------------------------- residual chain


def test_residual_chain_golden_rows() -> None:
    p = joint_from_dense([[0.5, 0.3, 0.2], [0, 0, 0]])
    q = joint_from_dense([[0.1, 0.2, 0.05], [0.3, 0.25, 0.1]])
    S, R, alpha = residual_chain(p, q, 3)
    assert S is p.keys and R.shape == (4, 3) and alpha.shape == (3,)
    np.testing.assert_array_equal(R[0], p.probs)
    np.testing.assert_allclose(R[1], np.array([0.4, 0.1, 0.15]) / 0.65, atol=1e-15)
    np.testing.assert_allclose(alpha[0], 0.35, atol=1e-15)  # q on the invalid parent is not renormalised away


def test_residual_chain_properties() -> None:
    rng = rngs("residual_props")[0]
    for _ in range(20):
        sparse = lambda: rng.dirichlet(np.ones(12)).reshape(3, 4) * (rng.random((3, 4)) < 0.7)  # noqa: E731
        p = joint(sparse() + np.eye(3, 4) * 1e-3)
        q = joint(sparse() + np.eye(3, 4)[::-1] * 1e-3)
        S, R, alpha = residual_chain(p, q, 5)
        R = np.asarray(R)  # [6, |S|] the dense table
        np.testing.assert_allclose(R.sum(axis=1), 1.0, atol=1e-12)
        assert np.all(R >= 0) and np.all((alpha >= 0) & (alpha <= 1 + 1e-12))
        q_S = q.lookup(S)
        for j in range(1, 6):  # alpha_j = 1 - mass of max(r_{j-1} - q_S, 0)
            assert alpha[j - 1] == pytest.approx(1 - np.maximum(R[j - 1] - q_S, 0).sum(), abs=1e-12)


def test_residual_fallbacks() -> None:
    p = joint([[0.5, 0.3, 0.2]])
    S, R, alpha = residual_chain(p, p, 3)  # perfect draft: residual mass 0 -> r_j = p
    np.testing.assert_allclose(alpha, 1.0, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(R[1:]), np.tile(p.probs, (3, 1)))
    q = joint([[0, 0, 0], [0.4, 0.6, 0]])  # disjoint q: nothing is ever accepted
    _, R, alpha = residual_chain(p, q, 2)
    np.testing.assert_array_equal(alpha, 0.0)
    np.testing.assert_allclose(np.asarray(R), np.tile(p.probs, (3, 1)), atol=1e-15)


# ------------------------------------------------------------------------------------- verify_layer unit


class CountingRand:
    """Always accepts / picks the first key, and counts calls."""

    def __init__(self, accept: bool = True):
        self.accept, self.calls = accept, []

    def bernoulli(self, prob: float) -> bool:
        self.calls.append(("b", prob))
        return self.accept and prob > 0

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int:
        self.calls.append(("c", tuple(np.round(probs, 12))))
        return int(keys[np.flatnonzero(probs > 0)[0]])


def test_verify_layer_mechanics() -> None:
    p = joint_from_dense([[0.5, 0.3, 0.2], [0, 0, 0]])
    q = joint_from_dense([[0.1, 0.2, 0.05], [0.3, 0.25, 0.1]])
    S, R, _ = residual_chain(p, q, 4)
    drafts = make_drafts(np.array([3, 1, 0, 2]), q, np.array([True, False]))
    assert [d.valid for d in drafts] == [False, True, True, True]
    assert drafts[0] == Draft(3, 0.3, False)

    rand = CountingRand()
    passed, out = verify_layer(drafts, S, R, 2, rand)
    # invalid draft: no randomness used; draft 1 tested against R[1] (one rejection in a row)
    assert passed and out == [(1, 1), (0, 2)]
    assert rand.calls[0] == ("b", min(1.0, R[1, 1] / 0.2)) and len(rand.calls) == 2  # draft 3 untested

    rand = CountingRand(accept=False)
    passed, out = verify_layer(drafts, S, R, 3, rand)
    # all rejected: correction from R[4], then fills from R[0] = p
    assert not passed and [i for _, i in out] == [None, None, None]
    assert [c[0] for c in rand.calls] == ["b", "b", "b", "c", "c", "c"]
    assert rand.calls[3][1] == tuple(np.round(R[4], 12)) and rand.calls[4][1] == tuple(np.round(R[0], 12))

    passed, out = verify_layer(drafts[:1], S, R, 2, CountingRand())  # width > drafts: fail, exactly width
    assert not passed and len(out) == 2
    with pytest.raises(ValueError):
        verify_layer(drafts, S, R, 0, CountingRand())
    with pytest.raises(ValueError):
        verify_layer(drafts, S, R[:3], 2, CountingRand())
    with pytest.raises(ValueError):
        verify_layer([Draft(0, 0.0, True)], S, R, 1, CountingRand())


# ------------------------------------------------- the fast paths vs the textbook forms
# Straightforward implementations as they stood before the decoder's CPU time was cut. The production code must
# give the same values: bit for bit for log_softmax, warp_joint and lookup; up to float rounding (documented
# tolerance) for the residual chain, whose threshold form sums in a different order.


def ref_log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
    lse = np.where(np.isfinite(lse), lse, 0.0)
    return x - m - lse


def ref_warp_joint(z, warp: Warp) -> Joint:
    """warp_joint with a full-size mask and flatnonzero, and the softmax with temporaries (top_p shared)."""
    z = np.atleast_2d(np.asarray(z, dtype=np.float64))
    flat = z.reshape(-1)
    assert np.all(flat < np.inf)
    keys = np.flatnonzero(flat > -np.inf)
    v = flat[keys]
    if warp.temperature != 1.0:
        v = v / warp.temperature
    if warp.truncating:  # truncation itself is unchanged: reuse it on the finite (scaled) entries
        q = warp_joint(v[None, :], Warp(top_k=warp.top_k, top_p=warp.top_p))
        keys, v = keys[q.keys], v[q.keys]
    e = np.exp(v - v.max())
    probs = e / e.sum()
    return Joint(keys[probs > 0].astype(np.int64), probs[probs > 0], int(z.shape[1]))


def ref_residual_chain(p: Joint, q: Joint, n: int):
    """The textbook chain (spec §5 step 3): a dense [n+1, |S|] table, renormalised every step."""
    q_S = np.array([dict(zip(q.keys.tolist(), q.probs.tolist())).get(k, 0.0) for k in p.keys.tolist()])
    R = np.empty((n + 1, p.keys.size))
    alpha = np.empty(n)
    R[0] = p.probs
    for j in range(1, n + 1):
        alpha[j - 1] = np.minimum(R[j - 1], q_S).sum()
        buf = np.maximum(R[j - 1] - q_S, 0.0)
        mass = buf.sum()
        R[j] = p.probs if mass < 1e-12 else buf / mass
    return R, alpha


def _logit_rows(rng, n: int, V: int, spread: float = 2.5) -> np.ndarray:
    x = rng.standard_normal((n, V)) * spread
    x[:, : max(1, V // 50)] += 8  # a peaked head, a long tail: roughly an LLM's next-token shape
    return x


def test_log_softmax_is_bit_identical_to_the_textbook_form() -> None:
    rng = rngs("ls_bits")[0]
    for dt in (np.float32, np.float64):
        x = _logit_rows(rng, 5, 3001).astype(dt)
        x[2] = NEG
        x[3, ::7] = NEG
        for arg in (x, x[0], x[2]):
            assert log_softmax(arg).tobytes() == ref_log_softmax(arg).tobytes()
    ints = [[1, 2, 3], [0, 0, 5]]
    assert log_softmax(ints).tobytes() == ref_log_softmax(ints).tobytes()


@pytest.mark.parametrize("rows", ["dense", "invalid rows", "mixed rows", "one row"])
@pytest.mark.parametrize("warp", [Warp(), Warp(temperature=0.7), Warp(top_k=40), Warp(top_p=0.9),
                                  Warp(temperature=1.3, top_k=100, top_p=0.8)], ids=str)
def test_warp_joint_fast_paths_are_bit_identical(rows: str, warp: Warp) -> None:
    rng = rngs(f"warp_bits_{rows}_{warp}")[0]
    z = _logit_rows(rng, 5, 2003) - rng.random((5, 1)) * 3  # parent scores
    if rows == "invalid rows":
        z[[1, 4]] = NEG
    elif rows == "mixed rows":
        z[1] = NEG
        z[3, rng.random(2003) < 0.1] = NEG  # masked ids: the general path
    elif rows == "one row":
        z = z[2]
    got, ref = warp_joint(z, warp), ref_warp_joint(z, warp)
    assert got.keys.tobytes() == ref.keys.tobytes() and got.probs.tobytes() == ref.probs.tobytes()
    assert got.keys.dtype == np.int64 and got.vocab == ref.vocab


def test_warp_joint_rejects_bad_input_on_every_path() -> None:
    for bad in (np.nan, np.inf):
        for row in (0, 1):
            z = np.zeros((2, 4))
            z[1] = NEG
            z[row, 2] = bad
            with pytest.raises(ValueError):
                warp_joint(z, Warp())
    with pytest.raises(ValueError):
        warp_joint(np.full((3, 4), NEG), Warp())
    z = np.full((2, 3), NEG)
    z[1, 1] = 0.0  # one finite entry in a mixed row
    p = warp_joint(z, Warp())
    assert list(p.keys) == [4] and list(p.probs) == [1.0]


def test_joint_lookup_fast_paths_agree_with_binary_search() -> None:
    rng = rngs("lookup_paths")[0]
    dense = Joint(np.arange(3000, dtype=np.int64), rng.dirichlet(np.ones(3000)), 1000)
    sparse = Joint(np.sort(rng.choice(9000, 2500, replace=False)).astype(np.int64), rng.dirichlet(np.ones(2500)), 3000)
    assert dense.dense and not sparse.dense and not Joint(np.zeros(0, np.int64), np.zeros(0), 3).dense
    for j in (dense, sparse):
        for keys in (np.array([-5, 0, 2999, 3000, 8999, 9000, 12]), rng.integers(-10, 9100, 5000)):
            pos = positions(j.keys, keys)
            ref = np.where(pos >= 0, j.probs[np.maximum(pos, 0)], 0.0)
            assert j.lookup(keys).tobytes() == ref.tobytes()


def _chain_cases():
    rng = rngs("chain_vs_ref")[0]
    V = 1500
    lp = _logit_rows(rng, 4, V)
    J = lambda z, w=Warp(): warp_joint(z, w)  # noqa: E731
    noise = lambda s: lp + rng.standard_normal(lp.shape) * s  # noqa: E731
    row = np.arange(4)[:, None]
    cases = {
        "dense, same keys": (J(lp), J(noise(1.5))),
        "p on valid rows, q on all": (J(np.where(row != 2, lp, NEG)), J(noise(1.0))),
        "q misses part of p": (J(lp), J(np.where(rng.random(lp.shape) < 0.3, NEG, lp))),
        "near-perfect draft": (J(lp), J(noise(1e-4))),  # tiny residual masses: rounding amplified
        "perfect draft (fallbacks)": (J(lp), J(lp)),
        "disjoint": (J(np.where(row < 2, lp, NEG)), J(np.where(row >= 2, lp, NEG))),
        "truncated": (J(lp, Warp(top_k=30)), J(noise(1.0), Warp(top_k=30))),
    }
    for i in range(6):  # small random tables with sparse supports
        t = lambda: rng.dirichlet(np.ones(12)).reshape(3, 4) * (rng.random((3, 4)) < 0.6)  # noqa: E731
        cases[f"random {i}"] = (joint(t() + np.eye(3, 4) * 1e-3), joint(t() + np.eye(3, 4)[::-1] * 1e-3))
    return cases


@pytest.mark.parametrize("name", list(_chain_cases()))
def test_residual_chain_matches_the_textbook_chain(name: str) -> None:
    p, q = _chain_cases()[name]
    for n in (1, 3, 6):
        S, R, alpha = residual_chain(p, q, n)
        R_ref, alpha_ref = ref_residual_chain(p, q, n)
        assert S is p.keys and R.shape == R_ref.shape == (n + 1, S.size) and len(R) == n + 1
        np.testing.assert_allclose(alpha, alpha_ref, rtol=0, atol=1e-13)
        dense = np.asarray(R)
        for c in range(n + 1):
            # rounding of p and q entries (~1e-16 each) is amplified by 1 / mass of the residuals on the way
            scale = max(1.0, float(R_ref[c].max()))
            np.testing.assert_allclose(dense[c], R_ref[c], rtol=0, atol=1e-13 * scale)
            assert dense[c].sum() == pytest.approx(1.0, abs=1e-12) and np.all(dense[c] >= 0)
            assert R[c] is dense[c] or R[c].tobytes() == dense[c].tobytes()
            idx = np.arange(S.size)
            assert R[c, idx].tobytes() == R[c].tobytes()  # an entry equals its row's, bit for bit
            assert all(float(R[c, int(i)]) == R[c][i] for i in idx[:: max(1, S.size // 50)])
        assert R[0] is p.probs  # r_0 = p exactly
        if n >= 1:  # the first step is the textbook one, bit for bit
            assert np.asarray(R[1]).tobytes() == R_ref[1].tobytes()
        sub = R[: n]
        assert sub.shape == (n, S.size) and np.asarray(sub).tobytes() == dense[:n].tobytes()
        with pytest.raises(IndexError):
            R[n + 1]


def test_two_level_inverse_cdf_matches_the_full_cumsum() -> None:
    from app.decoding.sampling import CDF_BLOCK, _draw, _inverse_cdf

    rng = rngs("two_level_cdf")[0]
    m = 13 * CDF_BLOCK + 123  # more than 4 blocks, a short last block
    probs = rng.dirichlet(np.full(m, 0.3))
    probs[rng.random(m) < 0.4] = 0.0  # residual-like rows have many zero cells
    probs[: 2 * CDF_BLOCK] = 0.0  # whole zero blocks
    probs[-5:] = 0.0  # trailing zeros: u near 1 must not land there
    u = np.concatenate([rng.random(4000), [0.0, 1 - 2.0**-53, 0.5]])
    got = np.concatenate([_draw(probs, u[i: i + 7]) for i in range(0, u.size, 7)])  # few draws: two levels
    ref = _inverse_cdf(np.cumsum(probs), u)
    assert np.mean(got == ref) == 1.0
    assert np.all(probs[got] > 0)
    # a block whose running sum falls short of t by rounding: the clamp picks its last positive cell
    p2 = np.zeros(5 * CDF_BLOCK)
    p2[CDF_BLOCK + 7], p2[CDF_BLOCK + 9] = 0.5, 0.5
    assert set(_draw(p2, np.array([0.0, 0.49, 0.5, 0.999999, 1 - 2.0**-53])).tolist()) <= {CDF_BLOCK + 7, CDF_BLOCK + 9}
    # SeededRand.categorical and sample_iid share the rule on a large support
    big = warp_joint(rng.standard_normal((4, 6 * CDF_BLOCK)), Warp())
    a = sample_iid(big, 5, np.random.default_rng(11))
    r = SeededRand(np.random.default_rng(11))
    assert [r.categorical(big.keys, big.probs) for _ in range(5)] == a.tolist()
