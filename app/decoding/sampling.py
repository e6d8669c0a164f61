"""Pure sampling math for DSBD and the baselines (spec §2, §5): warp, residual chain, layer verification.

Letters follow the paper: p = target, q = draft. Every distribution of a layer lives in the flat key space
`key = parent * V + token` and is stored sparse as a `Joint` (sorted keys, positive float64 probs).
Everything here is numpy float64 and deterministic: identical inputs give bit-identical outputs.
"""

from __future__ import annotations

import threading
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


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread float64 work buffer of `shape`, reused between calls (never returned to a caller)."""
    n = int(np.prod(shape))
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        buf = _SCRATCH.buf = np.empty(max(n, 1))
    return buf[:n].reshape(shape)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise stable log-softmax in float64 for [V] or [n, V]; an all -inf row stays all -inf.

    Computed as (x - m) - lse with two [.., V] float64 buffers (float32 input is widened elementwise by the
    subtraction, no separate copy): the same operations in the same order as the textbook form, so the result is
    bit for bit that of `x = float64(logits); x - m - log(sum(exp(x - m)))` (tests/test_sampling.py checks it).
    """
    x = np.asarray(logits)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True).astype(np.float64)  # [..., 1]; the max of float32 values is exact
    m = np.where(np.isfinite(m), m, 0.0)  # an all -inf row must not turn into nan via -inf - -inf
    y = np.subtract(x, m, dtype=np.float64)  # [..., V] x - m
    e = np.exp(y, out=_scratch(y.shape))  # [..., V]
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(e, axis=-1, keepdims=True))  # [..., 1]
    lse = np.where(np.isfinite(lse), lse, 0.0)
    y -= lse
    return y


@dataclass(frozen=True)
class Warp:
    """Temperature / top-k / top-p applied to the joint (beam, token) distribution (spec §2)."""

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

    def __len__(self) -> int:
        return int(self.keys.size)

    @property
    def dense(self) -> bool:
        """keys == arange(len): strictly increasing int64 keys from 0 to len - 1 (an O(1) test)."""
        n = self.keys.size
        return n > 0 and self.keys[0] == 0 and self.keys[-1] == n - 1

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Probability of each key, 0 where absent."""
        keys = np.asarray(keys, dtype=np.int64)
        if self.keys.size == 0:
            return np.zeros(keys.shape)
        if self.dense:  # the key is the index
            ok = (keys >= 0) & (keys < self.keys.size)
            return np.where(ok, self.probs[np.where(ok, keys, 0)], 0.0)
        n = self.keys.size + keys.size
        if keys.size > 1024 and keys.min() >= 0:  # few keys: binary search beats building a table
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


_ARANGES: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """A shared read-only arange(n) int64 (the keys of a dense joint; a few sizes recur: rows x V)."""
    a = _ARANGES.get(n)
    if a is None:
        if len(_ARANGES) >= 16:
            _ARANGES.clear()
        a = np.arange(n, dtype=np.int64)
        a.flags.writeable = False
        _ARANGES[n] = a
    return a


def _finite_entries(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of the entries of z [n, V] above -inf, keys ascending; raises on nan / +inf / none.

    Fast path without a full-size mask or flatnonzero: when every row is either all finite or all -inf (the
    usual case: invalid parents, ended drafts), the keys are whole rows of consecutive ids and the values a row
    copy (or z itself). Mixed rows (masked ids) take the general path. Both give the same keys and values.
    """
    n, V = z.shape
    rmax = z.max(axis=1)  # [n]; nan propagates
    if not np.all(rmax < np.inf):
        raise ValueError("z contains nan or +inf")
    rmin = z.min(axis=1)  # [n]
    full, empty = rmin > -np.inf, rmax == -np.inf  # [n]
    if np.all(empty):
        raise ValueError("no valid (parent, token) pair: every entry of z is -inf")
    flat = z.reshape(-1)  # [n V]
    if np.all(full | empty):
        if np.all(full):
            return _arange(n * V), flat
        rows = np.flatnonzero(full)  # [r]
        keys = (rows[:, None] * V + np.arange(V, dtype=np.int64)).reshape(-1)  # [r V]
        return keys, z[rows].reshape(-1)
    keys = np.flatnonzero(flat > -np.inf)  # [m] ascending
    return keys, flat[keys]


def warp_joint(z: np.ndarray, warp: Warp) -> Joint:
    """Warp joint log-scores z [n_parents, V] (parent score + log p(token | parent)) into a `Joint` (spec §2).

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
    keys, v = _finite_entries(z)  # [m] ascending keys of the finite entries, their values
    return warp_entries(keys, v, V, warp)


def warp_entries(keys: np.ndarray, v: np.ndarray, V: int, warp: Warp, *, head_total: float | None = None) -> Joint:
    """`warp_joint` on the finite entries (keys ascending, values z): temperature, top_k, top_p, softmax.
    head_total: the entries are only the head of a larger support (top_p without top_k): sum of
    exp(z / T - max) over the whole support, so top_p's cut is the whole support's."""
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
        total = e.sum() if head_total is None else head_total
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

    # 4. softmax over the survivors, in key order so the summation order is fixed (in place: one buffer).
    probs = np.subtract(v, v.max())  # [m]
    np.exp(probs, out=probs)
    np.divide(probs, probs.sum(), out=probs)
    if not probs.min() > 0:
        # exp underflow (a pair > 745 nats below the best): drop it, Joint promises probs > 0.
        nz = probs > 0
        keys, probs = keys[nz], probs[nz]
    return Joint(keys.astype(np.int64, copy=False), probs, V)


def _inverse_cdf(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    # First index i with u < cdf[i] (u scaled by the total, so rounding in cdf cannot bias the last cell);
    # zero-probability cells are never chosen.
    return np.minimum(cdf.searchsorted(u * cdf[-1], side="right"), cdf.size - 1)


# Inverse CDF in two levels above this many cells: block sums, then a cumsum inside the chosen block only
# (a full cumsum over W x |V| = 0.6-0.8 M cells costs ~2 ms; the block sums a fifth of it).
CDF_BLOCK = 4096


def _draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Indices drawn by inverse CDF for uniforms u [k] (probs >= 0, sum > 0); zero cells are never chosen.

    Index i is drawn iff F(i-1) <= u * total < F(i), F the running sum of probs. For more than 4 blocks and few
    draws, F is the block-prefix sum plus the running sum inside the block: the same rule up to float rounding
    of the sums (~1e-16), not bit for bit the full cumsum's.
    """
    m = probs.size
    if m <= 4 * CDF_BLOCK or u.size > 64:
        return _inverse_cdf(np.cumsum(probs), u)
    starts = np.arange(0, m, CDF_BLOCK)  # [nb]
    cb = np.cumsum(np.add.reduceat(probs, starts))  # [nb] block-prefix sums
    out = np.empty(u.size, dtype=np.int64)
    for k, t in enumerate(u * cb[-1]):
        b = min(int(cb.searchsorted(t, side="right")), starts.size - 1)  # first block with cb > t: its sum > 0
        seg = probs[starts[b]: starts[b] + CDF_BLOCK]
        x = t - cb[b - 1] if b else t  # >= 0: t >= cb[b - 1]
        i = int(np.cumsum(seg).searchsorted(x, side="right"))
        if i >= seg.size:  # x past the block's running sum by rounding: its last positive cell
            i = int(np.flatnonzero(seg)[-1])
        out[k] = starts[b] + i
    return out


def sample_iid(p: Joint, n: int, rng: np.random.Generator) -> np.ndarray:
    """n i.i.d. keys from p by inverse CDF over p.keys (key order): key i is drawn iff cdf[i-1] <= u < cdf[i].

    Uses exactly n `rng.random()` uniforms, so it matches n successive `SeededRand.categorical` calls.
    """
    return p.keys[_draw(p.probs, rng.random(n))]  # [n]


class Residuals:
    """The verifier's residuals R[c] on S (c = 0..n rejections in a row), kept unnormalised.

    R[c] = u_c / Z_c with u_0 = p, Z_0 = 1 and u_j = max(u_{j-1} - Z_{j-1} q_S, 0), Z_j = sum(u_j): the
    textbook chain r_j = norm(max(r_{j-1} - q_S, 0)) scaled by Z_j, so a step costs no normalisation pass and the
    [n+1, |S|] table is never written. A row is divided out only when asked for (the correction draw); an entry
    costs O(1) (a draft's test). The fallback (mass < 1e-12) stores u_j = p, Z_j = 1.

    Supports what the verifier and the tests use: `shape`, `len`, `R[c]` (a read-only row), `R[c, i]` (equal to
    `R[c][i]` bit for bit), `R[a:b]` (sub-chain) and `np.asarray(R)` (the dense table).
    """

    def __init__(self, u: list[np.ndarray], Z: list[float]) -> None:
        self.u, self.Z = u, Z  # n+1 arrays [|S|] (u[0] = p) and their masses
        self._rows: dict[int, np.ndarray] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.u), int(self.u[0].size) if self.u else 0)

    def __len__(self) -> int:
        return len(self.u)

    def row(self, c: int) -> np.ndarray:
        c = range(len(self.u))[c]  # negative indices, IndexError out of range
        if self.Z[c] == 1.0:
            return self.u[c]  # p itself (r_0, a fallback) or a residual of mass exactly 1
        r = self._rows.get(c)
        if r is None:
            r = np.divide(self.u[c], self.Z[c])  # [|S|]
            r.flags.writeable = False
            self._rows[c] = r
        return r

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.row(int(idx))
        if isinstance(idx, slice):
            return Residuals(self.u[idx], self.Z[idx])
        if isinstance(idx, tuple) and len(idx) == 2 and isinstance(idx[0], (int, np.integer)):
            c = range(len(self.u))[int(idx[0])]
            return self.u[c][idx[1]] / self.Z[c] if self.Z[c] != 1.0 else self.u[c][idx[1]]
        return np.asarray(self)[idx]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.stack([self.row(c) for c in range(len(self))]) if len(self) else np.empty((0, 0))
        return out if dtype is None else out.astype(dtype)


def residual_chain(p: Joint, q: Joint, n: int) -> tuple[np.ndarray, Residuals, np.ndarray]:
    """Residual chain on S = supp(p) (spec §5 step 3): returns (S, R [n+1, |S|], alpha [n]).

    q is looked up at S and NOT renormalised (mass on invalid parents or outside S still counts as draws).
    r_0 = p; alpha_j = sum(min(r_{j-1}, q_S)); r_j = norm(max(r_{j-1} - q_S, 0)), or p if that mass < 1e-12.
    R[c] is the verifier's p' after c rejections in a row, a lazy `Residuals` (unnormalised, see there).

    Three passes over S per step (multiply, subtract, max) and a sum. alpha_j is computed as 1 - mass_j
    (min(r, q) = r - max(r - q, 0) and sum(r) = 1). Against the textbook chain (kept in tests/test_sampling.py)
    this agrees up to float rounding: r_1 bit for bit, alpha within 1e-13 absolute, later residual entries
    within 1e-13 of the row's scale (each step rounds like the textbook step: the subtraction near the cut is
    exact, the scaling by Z_{j-1} replaces the textbook's division by the mass).
    """
    S = p.keys  # [|S|]
    if np.array_equal(q.keys, S):  # the common dense case: identical key sets need no search
        q_S = q.probs
    elif q.dense and S.size and S[-1] < q.keys.size:
        q_S = q.probs[S]  # [|S|] key = index
    else:
        q_S = q.lookup(S)  # [|S|]
    u, Z = [p.probs], [1.0]  # u_j = Z_j r_j
    alpha = np.empty(n)  # [n]
    block = np.empty((n, S.size))  # [n, |S|] u_1..u_n, one allocation (cheaper than n)
    for j in range(1, n + 1):
        d = block[j - 1]  # [|S|]
        if Z[-1] == 1.0:
            np.subtract(u[-1], q_S, out=d)
        else:
            np.multiply(q_S, Z[-1], out=d)  # Z_{j-1} q
            np.subtract(u[-1], d, out=d)
        np.maximum(d, 0.0, out=d)  # Z_{j-1} max(r_{j-1} - q, 0)
        mass_u = float(d.sum())
        mass = mass_u / Z[-1]  # mass of max(r_{j-1} - q, 0)
        alpha[j - 1] = min(1.0, max(0.0, 1.0 - mass))
        if mass < RESIDUAL_EPS:
            u.append(p.probs)  # fallback r_j = p; the chain restarts from p
            Z.append(1.0)
        else:
            u.append(d)
            Z.append(mass_u)
    return S, Residuals(u, Z), alpha


class Rand(Protocol):
    """Randomness of the decoders: seeded in production, an enumerator in tests (spec §13)."""

    def bernoulli(self, prob: float) -> bool: ...

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int: ...

    def draws(self, p: "Joint", n: int) -> np.ndarray: ...

    def integer(self, n: int) -> int: ...


@dataclass(frozen=True, eq=False)
class SeededRand:
    """`Rand` on a numpy Generator: one uniform per call; bernoulli is `u < prob`, categorical inverse CDF."""

    rng: np.random.Generator

    def bernoulli(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def categorical(self, keys: np.ndarray, probs: np.ndarray) -> int:
        return int(keys[_draw(np.asarray(probs), np.array([self.rng.random()]))[0]])  # same rule as sample_iid

    def draws(self, p: "Joint", n: int) -> np.ndarray:
        """n i.i.d. keys from p: n `categorical` calls in one pass (`sample_iid`)."""
        return sample_iid(p, n, self.rng)

    def integer(self, n: int) -> int:
        """Uniform over 0..n-1."""
        return int(self.rng.integers(n))


@dataclass(frozen=True)
class Draft:
    """One drafted pair: flat key, its q_beam probability, and whether its parent is a valid parent."""

    key: int
    qval: float
    valid: bool


class Chain(Protocol):
    """A layer's residual chain as the verifier reads it: R[c] is p' after c rejections in a row (R[0] = p)."""

    def value(self, c: int, key: int) -> float: ...  # R[c](key); 0 outside the support

    def draw(self, c: int, rand: Rand) -> int: ...  # one key from R[c] (one uniform when seeded)


def mss(chain: Chain, drafts: Sequence[Draft], width: int, rand: Rand) -> tuple[bool, list[tuple[int, int | None]]]:
    """Sequential MSS test with reset over one layer's drafts (spec §5 step 4), on any backend's chain.

    Returns (passed, out): out lists (key, draft index) for accepted drafts and (key, None) for the correction
    and fill draws, in slot order. passed iff `width` drafts were accepted (out is then exactly those);
    otherwise out holds exactly `width` entries: the accepted drafts, one draw from the current residual,
    then fresh draws from p = R[0]. Drafts past the width-th acceptance stay untested. Speculative sampling's
    chain is this loop with one draft a position and width 1.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
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
        if rand.bernoulli(min(1.0, chain.value(c, d.key) / d.qval)):
            acc.append((d.key, i))
            c = 0  # accept: p' resets to p_beam
        else:
            c += 1  # reject: p' <- norm(max(p' - q, 0))
    if len(acc) == width:
        return True, acc
    out = acc + [(chain.draw(c, rand), None)]  # correction: one draw from the current p'
    while len(out) < width:
        out.append((chain.draw(0, rand), None))  # fill: fresh p_beam draws
    return False, out


@dataclass(frozen=True)
class ArrayChain:
    """`Chain` on the reference's arrays: S = supp(p) (sorted keys) and R [n+1, |S|] (`residual_chain`)."""

    S: np.ndarray
    R: "Residuals | np.ndarray"

    def value(self, c: int, key: int) -> float:
        i = int(positions(self.S, np.array([key]))[0])
        return float(self.R[c, i]) if i >= 0 else 0.0

    def draw(self, c: int, rand: Rand) -> int:
        return int(rand.categorical(self.S, self.R[c]))


def verify_layer(
    drafts: Sequence[Draft], S: np.ndarray, R: "Residuals | np.ndarray", width: int, rand: Rand
) -> tuple[bool, list[tuple[int, int | None]]]:
    """`mss` on the reference's chain arrays (S, R [n+1, |S|])."""
    if R.shape[0] < len(drafts) + 1:
        raise ValueError(f"R has {R.shape[0]} rows; {len(drafts)} drafts need {len(drafts) + 1}")
    return mss(ArrayChain(S, R), drafts, width, rand)


# ------------------------------------------------------------------------ without replacement (spec §16.5)


def sample_without_replacement(p: Joint, n: int, rand: "Rand") -> tuple[np.ndarray, np.ndarray]:
    """Up to n distinct keys drawn sequentially without replacement from p, and for each the mass of p not yet
    drawn before it (key j's conditional law is p over the undrawn keys divided by that mass).

    Draw j is `rand.categorical` over p with the earlier keys' cells zeroed (one uniform each when seeded).
    """
    n = min(n, len(p))
    probs = p.probs.copy()  # [|p|] drawn cells zeroed as we go
    keys = np.empty(n, dtype=np.int64)
    rest = np.empty(n)
    for j in range(n):
        rest[j] = float(probs.sum())  # summed afresh: no cancellation when the first keys hold most mass
        keys[j] = rand.categorical(p.keys, probs / rest[j])
        probs[positions(p.keys, keys[j:j + 1])[0]] = 0.0
    return keys, rest


@dataclass(frozen=True)
class DraftWOR:
    """One draft of a layer drawn without replacement: flat key, its unconditional q, the q mass not yet drawn
    before it (its conditional law is q / rest on the undrawn pairs), and whether its parent is valid."""

    key: int
    qval: float
    rest: float
    valid: bool


def verify_layer_without_replacement(
    drafts: Sequence[DraftWOR], p: Joint, q_S: np.ndarray, width: int, rand: Rand
) -> tuple[bool, list[tuple[int, int | None]]]:
    """Recursive rejection over drafts drawn without replacement, verifying baseline B's layer (spec §16.5).

    Output slot k is a draw from p_k = p renormalised over the pairs not yet output. The current target r starts
    at p_1; draft j (conditional law q_j = q / rest_j on the pairs not drawn before it) is accepted with
    probability min(1, r(x_j) / q_j(x_j)); acceptance fills the next slot and resets r to p_(k+1); rejection sets
    r <- norm(max(r - q_j, 0)). When the drafts run out: one correction draw from r, then sequential fills from
    p_(k+1), p_(k+2), ... q_S [|S|] is q looked up at S = p.keys (unconditional, not renormalised).

    Returns (passed, out) like `verify_layer`: passed iff `width` drafts were accepted; otherwise exactly
    `width` slots (accepted drafts, the correction, the fills). width must not exceed len(p).
    """
    S = p.keys
    if not 1 <= width <= len(S):
        raise ValueError(f"width must be in 1..{len(S)} (pairs in supp(p)), got {width}")
    pos = positions(S, np.array([d.key for d in drafts], dtype=np.int64))  # [n], -1 outside S
    p_left = p.probs.copy()  # [|S|] p with the output pairs zeroed: p_k = p_left / sum(p_left)
    q_left = np.asarray(q_S, dtype=np.float64).copy()  # [|S|] q with the drawn pairs zeroed
    r = p_left / p_left.sum()  # [|S|] current target
    out: list[tuple[int, int | None]] = []

    def output(key_pos: int, draft: int | None) -> None:
        out.append((int(S[key_pos]), draft))
        p_left[key_pos] = 0.0

    for j, d in enumerate(drafts):
        if len(out) == width:
            break  # layer full: the rest stay untested
        if not d.qval > 0 or not d.rest > 0:
            raise ValueError(f"draft {j} has q {d.qval} and undrawn mass {d.rest}; a drawn pair needs both > 0")
        i = int(pos[j])
        ok = d.valid and i >= 0 and r[i] > 0
        if ok and rand.bernoulli(min(1.0, float(r[i]) * d.rest / d.qval)):
            output(i, j)
            if len(out) < width:
                r = p_left / p_left.sum()  # reset to p_(k+1)
        else:
            res = np.maximum(r - q_left / d.rest, 0.0)  # [|S|] max(r - q_j, 0) on S
            mass = float(res.sum())
            r = res / mass if mass >= RESIDUAL_EPS else p_left / p_left.sum()
        if i >= 0:
            q_left[i] = 0.0  # later drafts exclude this pair
    if len(out) == width:
        return True, out
    output(int(positions(S, np.array([rand.categorical(S, r)]))[0]), None)  # correction: one draw from r
    while len(out) < width:
        output(int(positions(S, np.array([rand.categorical(S, p_left / p_left.sum())]))[0]), None)  # fills
    return False, out


def draw_without_replacement(p: Joint, n: int, rand: Rand) -> list[int]:
    """n sequential draws without replacement from p through `rand` (baseline B's step; n <= len(p))."""
    left = p.probs.copy()
    keys: list[int] = []
    for _ in range(min(n, len(p))):
        k = rand.categorical(p.keys, left / left.sum())
        keys.append(int(k))
        left[positions(p.keys, np.array([k]))[0]] = 0.0
    return keys
