"""Test helpers for the decoding math: fixed seeds, merged-cell chi-square, test distributions and drafts, an
enumerating `Rand`, and a forest policy whose every node is a lookup node.

Statistical design (spec §13): chi-square with cells of expected count < 5 merged, significance 1e-4 per
assertion, seeds fixed from `numpy.random.SeedSequence(test_id)`. Set DSBD_FRESH_SEEDS=1 (nightly) to draw fresh
entropy instead; the entropy is printed so a failure can be replayed.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Any, Callable, Iterator

import numpy as np
from scipy import stats
from scipy.stats import chi2_contingency

from app.decoding.sampling import Draft, Joint, Warp, warp_joint

ALPHA_TEST = 1e-4  # significance per assertion
NEG_CONTROL_P = 1e-10  # a negative control must reach this at the same N


def seed_sequence(test_id: str) -> np.random.SeedSequence:
    """SeedSequence(test_id) with the name hashed to an int; fresh entropy when DSBD_FRESH_SEEDS is set."""
    if os.environ.get("DSBD_FRESH_SEEDS"):
        ss = np.random.SeedSequence()
        print(f"{test_id}: fresh entropy {ss.entropy}")
        return ss
    return np.random.SeedSequence(int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:8], "little"))


def rngs(test_id: str, n: int = 2) -> list[np.random.Generator]:
    """n independent generators for one test (e.g. rng_draft, rng_verify, as the RNG protocol of §11)."""
    return [np.random.default_rng(s) for s in seed_sequence(test_id).spawn(n)]


def chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value of counts against probs; cells with expected count < 5 are merged.

    A count in a cell of probability 0 is an impossible event: p-value 0.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    expected = n * probs / probs.sum()
    if np.any(counts[expected == 0] > 0):
        return 0.0
    # Ascending expected: small cells pool together (and with the next cell) until the pool reaches 5.
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for i in np.argsort(expected, kind="stable"):
        if expected[i] == 0:
            continue
        pool_o += counts[i]
        pool_e += expected[i]
        if pool_e >= 5:
            obs.append(pool_o)
            exp.append(pool_e)
            pool_o = pool_e = 0.0
    if pool_e > 0 and exp:  # leftover pool below 5: fold it into the largest cell
        obs[-1] += pool_o
        exp[-1] += pool_e
    if len(exp) < 2:
        return 1.0
    return float(stats.chisquare(np.array(obs), np.array(exp)).pvalue)


class ScriptedRand:
    """A `Rand` that replays option indices from `script`, then takes option 0, recording the path.

    Every call branches over its positive-probability outcomes; `prob` is the path probability.
    With branch_categorical=False, categorical returns its first positive key with probability 1
    (for tests that only look at acceptances).
    """

    def __init__(self, script: list[int], branch_categorical: bool = True):
        self.script = script
        self.branch_categorical = branch_categorical
        self.taken: list[int] = []
        self.sizes: list[int] = []
        self.prob = 1.0

    def _choose(self, values: list[Any], weights: list[float]) -> Any:
        i = len(self.taken)
        j = self.script[i] if i < len(self.script) else 0
        self.taken.append(j)
        self.sizes.append(len(values))
        self.prob *= weights[j]
        return values[j]

    def bernoulli(self, prob: float) -> bool:
        opts = [(v, w) for v, w in ((True, float(prob)), (False, 1.0 - float(prob))) if w > 0]
        return self._choose([v for v, _ in opts], [w for _, w in opts])

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int:
        nz = np.flatnonzero(np.asarray(probs) > 0)
        if not self.branch_categorical:
            return self._choose([int(keys[nz[0]])], [1.0])
        return self._choose([int(k) for k in keys[nz]], [float(w) for w in np.asarray(probs)[nz]])


    def draws(self, p, n: int) -> np.ndarray:
        return np.array([self.categorical(p.keys, p.probs) for _ in range(n)], dtype=np.int64)

    def integer(self, n: int) -> int:
        return self._choose(list(range(n)), [1.0 / n] * n)


def enumerate_paths(
    run: Callable[[ScriptedRand], Any], branch_categorical: bool = True
) -> Iterator[tuple[Any, float]]:
    """Yield (run(rand), path probability) for every outcome path, depth-first (odometer over choices)."""
    script: list[int] = []
    while True:
        rand = ScriptedRand(script, branch_categorical)
        result = run(rand)
        yield result, rand.prob
        taken, sizes = rand.taken, rand.sizes
        while taken and taken[-1] + 1 >= sizes[len(taken) - 1]:
            taken.pop()
        if not taken:
            return
        taken[-1] += 1
        script = taken


# ---------------------------------------------------------------------------------------------------------
# Layer cases: (p, q, valid_parent) in one key space, each with exactly one invalid parent row (spec §13.1).


def joint_from_dense(table: Any) -> Joint:
    """A Joint from a dense [n_parents, V] probability table (zeros are dropped, no renormalisation)."""
    table = np.asarray(table, dtype=np.float64)
    flat = table.reshape(-1)  # [n V]
    keys = np.flatnonzero(flat > 0)
    return Joint(keys.astype(np.int64), flat[keys].copy(), int(table.shape[-1]))


def make_drafts(keys: np.ndarray, q: Joint, valid_parent: np.ndarray) -> list[Draft]:
    """Drafts (in draw order) for keys drawn from q; valid_parent [n_parents] bool marks the valid parents."""
    keys = np.asarray(keys, dtype=np.int64)  # [W_S]
    qval = q.lookup(keys)  # [W_S]
    valid = np.asarray(valid_parent, dtype=bool)[q.parent(keys)]  # [W_S]
    return [Draft(int(k), float(v), bool(ok)) for k, v, ok in zip(keys, qval, valid)]


def joint(table: Any, warp: Warp = Warp()) -> Joint:
    """warp_joint of log(table): zeros become -inf, so the production path builds every test distribution."""
    with np.errstate(divide="ignore"):
        return warp_joint(np.log(np.asarray(table, dtype=np.float64)), warp)


def _random_case(seed: int) -> tuple[Joint, Joint, np.ndarray]:
    rng = np.random.default_rng(seed)
    pt = rng.dirichlet(np.ones(6)).reshape(3, 2) * (rng.random((3, 2)) < 0.8)
    pt[1] = 0.0  # parent 1 invalid
    pt[0, 0] = max(pt[0, 0], 0.05)
    qt = rng.dirichlet(np.ones(6)).reshape(3, 2) * (rng.random((3, 2)) < 0.7)
    qt[1, 0] = max(qt[1, 0], 0.1)  # some mass on the invalid parent
    return joint(pt), joint(qt), np.array([True, False, True])


def layer_cases() -> dict[str, tuple[Joint, Joint, np.ndarray]]:
    """Named (p, q, valid_parent) cases; keys are parent * V + token."""
    two = np.array([True, False])
    return {
        # §6 golden case: second parent invalid, q has mass there
        "golden": (joint([[0.5, 0.3, 0.2], [0, 0, 0]]), joint([[0.1, 0.2, 0.05], [0.3, 0.25, 0.1]]), two),
        # q misses part of supp(p): keys 1 and 2 are only ever produced by residual draws
        "q_missing": (joint([[0.5, 0.3, 0.2], [0, 0, 0]]), joint([[0.6, 0, 0], [0.4, 0, 0]]), two),
        # q wider than p: p is top_k-truncated, q puts mass on a valid parent's pair outside S
        "q_wider": (
            joint([[0.5, 0.3, 0.2], [0, 0, 0]], Warp(top_k=2)),
            joint([[0.2, 0.2, 0.2], [0.2, 0.1, 0.1]]),
            two,
        ),
        # perfect draft on the valid row plus nothing else: every valid draft is accepted
        "q_equals_p": (joint([[0.5, 0.3, 0.2], [0, 0, 0]]), joint([[0.5, 0.3, 0.2], [0, 0, 0]]), two),
        # three parents, the middle one invalid
        "three_parents": (
            joint([[0.3, 0.2], [0, 0], [0.35, 0.15]]),
            joint([[0.25, 0], [0.2, 0.1], [0.05, 0.4]]),
            np.array([True, False, True]),
        ),
        "random": _random_case(7),
    }


class LookupOnly:
    """A forest policy stub: gamma layers, no drafts (W_S = 0): every node is a lookup node."""

    def __init__(self, g: int) -> None:
        self.g = g

    def choose(self, *, max_gamma, roots, draft_roots, **_):
        return min(self.g, max_gamma), 0

    def observe(self, *a, **kw):
        pass

    def settle(self, steps):
        pass


def homogeneous(a: Counter, b: Counter) -> float:
    """p-value of the chi-square homogeneity test, merging rare cells (expected < 5)."""
    cells = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    table = np.array([[a[c] for c in cells], [b[c] for c in cells]], dtype=float)
    expected_min = table.sum(0) * min(na, nb) / (na + nb)
    rare = expected_min < 5
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table)[1])
