"""Pure sampling math for DSBD and the baselines (spec §2.1, §5): warp, residual chain, layer verification.

Letters follow the paper: p = target, q = draft. Every distribution of a layer lives in the flat key space
`key = parent * V + token` and is stored sparse as a `Joint` (sorted keys, positive float64 probs).
Everything here is numpy float64 and deterministic: identical inputs give bit-identical outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

# Below this residual mass the chance of ever needing r_j is negligible; fall back to p (spec §5 step 3).
RESIDUAL_EPS = 1e-12
# top_p sorts only the head of the value order: this many entries first, 8x more while the mass is short.
TOP_P_HEAD = 1024
# Joint.lookup scatters into a dense table instead of binary search when the key range is at most this many
# times the number of keys involved: O(range) beats O(n log n) for dense joints (4 x 152k: ~10x faster).
DENSE_LOOKUP_RATIO = 4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise stable log-softmax in float64 for [V] or [n, V]; an all -inf row stays all -inf."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)  # [..., 1]
    m = np.where(np.isfinite(m), m, 0.0)  # an all -inf row must not turn into nan via -inf - -inf
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))  # [..., 1]
    lse = np.where(np.isfinite(lse), lse, 0.0)
    return x - m - lse


@dataclass(frozen=True)
class Warp:
    """Temperature / top-k / top-p applied to the joint (beam, token) distribution (spec §2.1)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off; counts (parent, token) pairs, not tokens per beam
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def truncating(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def positions(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in `sorted_keys`, -1 where absent (searchsorted)."""
    keys = np.asarray(keys, dtype=np.int64)
    if sorted_keys.size == 0:
        return np.full(keys.shape, -1, dtype=np.int64)
    idx = np.minimum(sorted_keys.searchsorted(keys), sorted_keys.size - 1)
    return np.where(sorted_keys[idx] == keys, idx, -1)


@dataclass(frozen=True, eq=False)
class Joint:
    """A sparse distribution over flat keys `parent * vocab + token`: keys sorted ascending, probs > 0."""

    keys: np.ndarray  # [n] int64, strictly increasing
    probs: np.ndarray  # [n] float64, > 0, sums to 1
    vocab: int

    def __post_init__(self) -> None:
        if self.keys.ndim != 1 or self.keys.shape != self.probs.shape:
            raise ValueError(f"keys {self.keys.shape} and probs {self.probs.shape} must be equal 1-D shapes")
        if self.keys.dtype != np.int64 or self.probs.dtype != np.float64:
            raise ValueError("Joint needs int64 keys and float64 probs")

    @classmethod
    def from_dense(cls, table: np.ndarray) -> "Joint":
        """Build from a dense [n_parents, V] probability table (zeros are dropped, no renormalisation)."""
        table = np.asarray(table, dtype=np.float64)
        flat = table.reshape(-1)  # [n V]
        keys = np.flatnonzero(flat > 0)
        return cls(keys.astype(np.int64), flat[keys].copy(), int(table.shape[-1]))

    def __len__(self) -> int:
        return int(self.keys.size)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Probability of each key, 0 where absent."""
        keys = np.asarray(keys, dtype=np.int64)
        if self.keys.size == 0:
            return np.zeros(keys.shape)
        n = self.keys.size + keys.size
        if n > 4096 and keys.size and keys.min() >= 0:
            hi = int(max(self.keys[-1], keys.max())) + 1
            if hi <= DENSE_LOOKUP_RATIO * n:
                table = np.zeros(hi)  # [range]
                table[self.keys] = self.probs
                return table[keys]
        pos = positions(self.keys, keys)
        return np.where(pos >= 0, self.probs[np.maximum(pos, 0)], 0.0)

    def parent(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(keys, dtype=np.int64) // self.vocab

    def token(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(keys, dtype=np.int64) % self.vocab


def _top_indices(v: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the k largest entries of v; among ties at the cut, the lowest indices win."""
    if k >= v.size:
        return np.arange(v.size)
    thr = np.partition(v, v.size - k)[v.size - k]  # k-th largest, O(m)
    sel = v > thr  # [m]
    ties = np.flatnonzero(v == thr)[: k - int(np.count_nonzero(sel))]
    sel[ties] = True
    return np.flatnonzero(sel)


def warp_joint(z: np.ndarray, warp: Warp) -> Joint:
    """Warp joint log-scores z [n_parents, V] (parent score + log p(token | parent)) into a `Joint` (spec §2.1).

    -inf entries (invalid parent rows, masked ids) are excluded before top_k. Order of operations: z / T,
    top_k over all flattened pairs, top_p on the softmax of the kept entries (shortest prefix in descending
    order whose mass reaches top_p, crossing entry kept), softmax over the survivors. Ties go to the lower key.
    """
    z = np.asarray(z, dtype=np.float64)
    if z.ndim == 1:
        z = z[None, :]
    if z.ndim != 2:
        raise ValueError(f"z must be [n_parents, V], got shape {z.shape}")
    V = int(z.shape[1])
    flat = z.reshape(-1)  # [n V]
    if not np.all(flat < np.inf):
        raise ValueError("z contains nan or +inf")
    keys = np.flatnonzero(flat > -np.inf)  # [m] ascending: no sort needed when nothing truncates
    if keys.size == 0:
        raise ValueError("no valid (parent, token) pair: every entry of z is -inf")
    v = flat[keys]  # [m]
    # 1. temperature (after dropping -inf, so invalid parents and masked ids never enter top_k)
    if warp.temperature != 1.0:
        v = v / warp.temperature

    # 2. top_k over pairs: O(m) selection, no full sort.
    if 0 < warp.top_k < v.size:
        sel = _top_indices(v, warp.top_k)  # [k] ascending
        keys, v = keys[sel], v[sel]

    # 3. top_p over the order (-value, key). Only a head of that order is sorted: grow it until its mass
    # reaches top_p. cumsum is sequential, so the head's prefix sums equal a full sort's bit for bit.
    if warp.top_p < 1.0 and v.size > 1:
        e = np.exp(v - v.max())  # [k]
        total = e.sum()
        M = min(v.size, TOP_P_HEAD)
        while True:
            head = _top_indices(v, M)  # [M] the first M of the order, ascending by key
            order = head[np.argsort(-v[head], kind="stable")]  # [M] stable: ties by lower key
            cum = np.cumsum(e[order] / total)  # [M] descending mass
            i = int(np.searchsorted(cum, warp.top_p, side="left"))  # crossing entry
            if i < M or M == v.size:
                break
            M = min(v.size, 8 * M)
        kept = np.sort(order[: min(i + 1, M)])  # back to key order
        keys, v = keys[kept], v[kept]

    # 4. softmax over the survivors, in key order so the summation order is fixed.
    e = np.exp(v - v.max())
    probs = e / e.sum()
    if not np.all(probs > 0):
        # exp underflow (a pair > 745 nats below the best): drop it, Joint promises probs > 0.
        nz = probs > 0
        keys, probs = keys[nz], probs[nz]
    return Joint(keys.astype(np.int64, copy=False), probs, V)


def _inverse_cdf(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    # First index i with u < cdf[i] (u scaled by the total, so rounding in cdf cannot bias the last cell);
    # zero-probability cells are never chosen.
    return np.minimum(cdf.searchsorted(u * cdf[-1], side="right"), cdf.size - 1)


def sample_iid(p: Joint, n: int, rng: np.random.Generator) -> np.ndarray:
    """n i.i.d. keys from p by inverse CDF over p.keys (key order): key i is drawn iff cdf[i-1] <= u < cdf[i].

    Uses exactly n `rng.random()` uniforms, so it matches n successive `SeededRand.categorical` calls.
    """
    cdf = np.cumsum(p.probs)  # [|p|]
    return p.keys[_inverse_cdf(cdf, rng.random(n))]  # [n]


def residual_chain(p: Joint, q: Joint, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Residual chain on S = supp(p) (spec §5 step 3): returns (S, R [n+1, |S|], alpha [n]).

    q is looked up at S and NOT renormalised (mass on invalid parents or outside S still counts as draws).
    r_0 = p; alpha_j = sum(min(r_{j-1}, q_S)); r_j = norm(max(r_{j-1} - q_S, 0)), or p if that mass < 1e-12.
    R[c] is the verifier's p' after c rejections in a row.
    """
    S = p.keys  # [|S|]
    # Shortcut for the common dense case: identical key sets need no search.
    q_S = q.probs if np.array_equal(q.keys, S) else q.lookup(S)  # [|S|]
    R = np.empty((n + 1, S.size))  # [n+1, |S|]
    alpha = np.empty(n)  # [n]
    R[0] = p.probs
    buf = np.empty(S.size)  # [|S|]
    for j in range(1, n + 1):
        np.minimum(R[j - 1], q_S, out=buf)
        alpha[j - 1] = buf.sum()
        np.subtract(R[j - 1], q_S, out=buf)
        np.maximum(buf, 0.0, out=buf)
        mass = buf.sum()
        if mass < RESIDUAL_EPS:
            R[j] = p.probs
        else:
            np.divide(buf, mass, out=R[j])
    return S, R, alpha


class Rand(Protocol):
    """Randomness used by `verify_layer`: seeded in production, an enumerator in tests (spec §13)."""

    def bernoulli(self, prob: float) -> bool: ...

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int: ...


@dataclass(frozen=True, eq=False)
class SeededRand:
    """`Rand` on a numpy Generator: one uniform per call; bernoulli is `u < prob`, categorical inverse CDF."""

    rng: np.random.Generator

    def bernoulli(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int:
        cdf = np.cumsum(probs)  # [n]
        i = int(cdf.searchsorted(self.rng.random() * cdf[-1], side="right"))  # same rule as _inverse_cdf
        return int(keys[min(i, cdf.size - 1)])


@dataclass(frozen=True)
class Draft:
    """One drafted pair: flat key, its q_beam probability, and whether its parent is a valid parent."""

    key: int
    qval: float
    valid: bool


def make_drafts(keys: np.ndarray, q: Joint, valid_parent: np.ndarray) -> list[Draft]:
    """Drafts (in draw order) for keys drawn from q; valid_parent [n_parents] bool marks the valid parents."""
    keys = np.asarray(keys, dtype=np.int64)  # [W_S]
    qval = q.lookup(keys)  # [W_S]
    valid = np.asarray(valid_parent, dtype=bool)[q.parent(keys)]  # [W_S]
    return [Draft(int(k), float(v), bool(ok)) for k, v, ok in zip(keys, qval, valid)]


def verify_layer(
    drafts: Sequence[Draft], S: np.ndarray, R: np.ndarray, width: int, rand: Rand
) -> tuple[bool, list[tuple[int, int | None]]]:
    """Sequential MSS test with reset over one layer's drafts (spec §5 step 4).

    Returns (passed, out): out lists (key, draft index) for accepted drafts and (key, None) for the correction
    and fill draws, in slot order. passed iff `width` drafts were accepted (out is then exactly those);
    otherwise out holds exactly `width` entries: the accepted drafts, one draw from the current residual,
    then fresh draws from p = R[0]. Drafts past the width-th acceptance stay untested.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if R.shape[0] < len(drafts) + 1:
        raise ValueError(f"R has {R.shape[0]} rows; {len(drafts)} drafts need {len(drafts) + 1}")
    pos = positions(S, np.array([d.key for d in drafts], dtype=np.int64))  # [W_S], -1 outside S
    acc: list[tuple[int, int | None]] = []
    c = 0  # rejections since the last acceptance: p' = R[c]
    for i, d in enumerate(drafts):
        if len(acc) == width:
            break  # layer full: the rest stay untested
        if not d.valid:
            c += 1  # p'(d) = 0: certain rejection that still advances the residual
            continue
        if not d.qval > 0:
            raise ValueError(f"draft {i} has qval {d.qval}; a drawn pair must have q > 0")
        r = float(R[c, pos[i]]) if pos[i] >= 0 else 0.0
        if rand.bernoulli(min(1.0, r / d.qval)):
            acc.append((d.key, i))
            c = 0  # accept: p' resets to p_beam
        else:
            c += 1  # reject: p' <- norm(max(p' - q, 0))
    if len(acc) == width:
        return True, acc
    out = acc + [(rand.categorical(S, R[c]), None)]  # correction: one draw from the current p'
    while len(out) < width:
        out.append((rand.categorical(S, R[0]), None))  # fill: fresh p_beam draws
    return False, out
