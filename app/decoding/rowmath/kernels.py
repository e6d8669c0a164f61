"""Compiled CPU row kernels: the host row math's passes over float32 logits, each in one compiled call on every core.

    m = norms(x, e, eb)                     # e = exp(x - m), eb its block sums: lse = m + log(eb.sum(1))
    exp_blocks(x, shift, inv_t, e, eb)      # e = exp((x - shift) / T) and its block sums
    block_sums(flat, out)                   # float64 sums of a flat float32 array's blocks
    scaled(e, scale, out)                   # out = e * scale_row, flat: a law's normalised cells
    total = residual_blocks(p, q, s, out)   # the block sums and total of u = max(p - s q, 0), u not stored
    residual_cells(p, q, s, lo, hi)         # u's cells lo..hi, bit for bit those residual_blocks summed
    total = pair_blocks(ep, ap, eq, qptr, qidx, qc, s, out)   # the same from the stored rows, u not formed:
    pair_cells(ep, ap, eq, qptr, qidx, qc, s, r, lo, hi)      #   p = e_p * a_r, q = sum of e_q[j] * c_j over row r's
                                                              #   parents j; its cells lo..hi of row r
    RowStep(V), RowsStep(n, V)              # the plain modes' step: normalisers, then draws, bit for bit the above

Layout: cells are float32; sums are float64, over consecutive CDF_BLOCK-cell blocks of each row (a row's last
block short), the blocks the inverse-CDF draws read. Inputs are C-contiguous arrays (converted if not); outputs are
arrays the caller owns and reuses, checked, never reallocated.

Exactness: exp is a float32 polynomial within ~1 ulp (relative error < 1e-7) of the float64 exp of the same float32
argument; -inf gives 0, and so do arguments below ln(2^-126) (results under float32's smallest normal number).
Logits must be finite or -inf; nothing then yields NaN. Sums are float64 in any order of addition, so a row's
log-sum-exp is within ~1e-7 of the float64 one. No `fastmath=True`: it lets LLVM assume there are no infinities.

Threads: each call splits its rows, or their blocks, over numba's threads, so one row uses every core, with one
thread fewer for each core other programs keep busy (`_turn`); `RowStep` runs on the calling thread and wakes none.
Calls from several Python threads take turns on one lock. `warm()` compiles or loads every kernel from numba's
cache; call it off the answer's path. Without numba this module raises
ImportError on import; `available()` says whether the kernels compiled and passed a check.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np

from app.decoding.sampling import CDF_BLOCK
from backends.base import ThreadGovernor

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic
except ImportError as e:  # the one place a missing numba shows: callers fall back to the reference
    raise ImportError(f"the compiled row kernels need numba: {e}") from e


def _layer() -> str:
    """OpenMP where numba's OpenMP pool loads, else workqueue (always present). On a 2-vCPU VM a norms call on
    4,096 cells took 10 us under OpenMP and 330 us under workqueue (190 us under OpenMP told to wait passively):
    waking a sleeping thread costs that much there, and OpenMP's workers spin a moment between calls instead."""
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return "workqueue"
    return "omp"


def _choose_layer() -> None:
    """Set numba's threading layer unless the environment (NUMBA_THREADING_LAYER) or an earlier parallel call did."""
    try:
        numba.threading_layer()  # raises until a first parallel call has started a layer
    except ValueError:
        if numba.config.THREADING_LAYER == "default":
            numba.config.THREADING_LAYER = _layer()


_choose_layer()

# One parallel call at a time: two would oversubscribe the cores, and workqueue aborts the process on them.
_LOCK = threading.Lock()
_GOVERNOR: list = []  # the ThreadGovernor, made at the first call
_SET = threading.local()  # the thread count _turn last gave numba on this thread (numba keeps one per thread)


@contextmanager
def _turn():
    """This call's turn on the cores, with one thread fewer for each core other programs keep busy: a parallel
    call's threads wait for each other at its end, and a thread that shares its core with a busy program waits
    for its time slice there (a 4-row normaliser beside one busy process on 2 cores: 99th percentile 13 ms with
    2 threads always, 0.54 ms governed; docs/measurements/rowmath.md)."""
    with _LOCK:
        if not _GOVERNOR:
            try:
                _GOVERNOR.append(ThreadGovernor(numba.config.NUMBA_NUM_THREADS))
            except ImportError:  # no psutil: every thread, always
                _GOVERNOR.append(None)
        if _GOVERNOR[0] is not None:
            n = _GOVERNOR[0].threads()
            if getattr(_SET, "n", None) != n:  # numba's setter costs about 15 us a call inside an answer
                numba.set_num_threads(n)
                _SET.n = n
        yield

# Sums may be reordered (vectorised); cells never see these flags (see _exp, _residual).
_SUMS = {"reassoc", "contract", "nsz", "arcp"}

# ----------------------------------------------------------------------------------------- float32 bit tricks

_I32 = ir.IntType(32)


def _flip(builder, bits):
    """Sign-magnitude to two's complement order: flip the magnitude bits of negatives (an involution)."""
    mask = builder.and_(builder.ashr(bits, ir.Constant(_I32, 31)), ir.Constant(_I32, 0x7FFFFFFF))
    return builder.xor(bits, mask)


@intrinsic
def _order_key(typingctx, x):
    """A float32 as an int32 whose signed order is the floats' order: an integer max vectorises, a float max
    does not in numba (NaN rules)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _flip(builder, builder.bitcast(args[0], _I32))

    return types.int32(types.float32), codegen


@intrinsic
def _key_value(typingctx, k):
    """The float32 whose `_order_key` is k."""
    if k != types.int32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_flip(builder, args[0]), ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _pow2(typingctx, t):
    """2^n for t = n + 1.5 * 2^23, n an integer in [-126, 127]: n sits in t's low mantissa bits, so
    (bits(t) - bits(1.5 * 2^23) + 127) << 23 is 2^n's exponent field."""
    if t != types.float32:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.add(builder.bitcast(args[0], _I32), ir.Constant(_I32, 127 - 0x4B400000))
        return builder.bitcast(builder.shl(bits, ir.Constant(_I32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


# ------------------------------------------------------------------------------------------------ float32 exp

_F = np.float32
_ZERO, _ONE = _F(0.0), _F(1.0)
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)  # ln 2 in 9 bits: n * _LN2_HI is exact for |n| < 2^15
_LN2_LO = _F(-2.12194440e-4)  # ln 2 - _LN2_HI
_ROUND = _F(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 below 2^22 to an integer
_FLOOR = _F(-87.33654)  # ln(2^-126): below it the result is no normal float32
# e^r = 1 + r + r^2 q(r) on |r| <= ln(2) / 2, q a degree-4 minimax fit in relative error (3.9e-9)
_Q0, _Q1, _Q2, _Q3, _Q4 = _F(4.9999988e-01), _F(1.6666518e-01), _F(4.1669488e-02), _F(8.36891e-03), _F(1.3753952e-03)


@njit(fastmath={"contract"}, cache=True)
def _exp(d):
    """exp(d) in float32, within ~1 ulp: d = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), a degree-6 polynomial for
    e^r, 2^n from the bits. -inf and d < ln(2^-126) give 0; d <= 88 is exact, larger d overflows to inf.
    Contraction (FMA) only: reassociation would add 1 + r before the small terms and lose bits."""
    c = max(d, _FLOOR)
    t = c * _LOG2E + _ROUND
    n = t - _ROUND
    r = (c - n * _LN2_HI) - n * _LN2_LO
    q = (((_Q4 * r + _Q3) * r + _Q2) * r + _Q1) * r + _Q0
    y = (q * (r * r) + r) + _ONE
    return y * _pow2(t) if d >= _FLOOR else _ZERO


@njit(fastmath={"contract"}, cache=True)
def _exp_at(x, shift, inv_t):
    """exp((x - shift) * inv_t), the argument rounded as float32 arithmetic does (no FMA can form: sub, then mul)."""
    return _exp((x - shift) * inv_t)


@njit(fastmath={"contract"}, cache=True)
def _exp_less(x, shift):
    """exp(x - shift)."""
    return _exp(x - shift)


@njit(fastmath=False, cache=True)
def _residual(p, q, s):
    """max(p - s q, 0) in float32: a product then a difference, each rounded, as numpy computes it. fastmath=False
    explicitly: a helper left unset inherits its first caller's flags, and contraction would fuse an FMA."""
    return max(p - s * q, _ZERO)


# ------------------------------------------------------------------------------------------------ block passes

@njit(cache=True)
def _span(k, nb, size):
    """Task k's (row, first cell, end) in rows of nb blocks: the parallel index may be unsigned, and numba types
    unsigned with signed arithmetic as float."""
    k = np.int64(k)
    r, j = k // nb, k % nb
    return r, j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)


# Each loop below runs over whole arrays (slices) from index 0: with a range(lo, hi) LLVM cannot rule out
# negative indices, numba's wraparound makes the addresses non-affine, and the loop turns into gathers and scatters.

@njit(fastmath=_SUMS, cache=True)
def _max_key(x):
    k = np.int32(-2147483648)
    for i in range(x.size):
        k = max(k, _order_key(x[i]))
    return k


@njit(cache=True)
def _max_of(key):
    """A row max from its order key: 0 where no cell is finite (an all -inf row)."""
    top = _key_value(key)
    return top if np.isfinite(top) else _ZERO


@njit(fastmath=_SUMS, cache=True)
def _sum(x):
    s = 0.0
    for i in range(x.size):
        s += x[i]
    return s


@njit(fastmath={"contract"}, cache=True)
def _exp_into(x, shift, inv_t, e):
    """e = exp((x - shift) * inv_t) (at inv_t = 1 no product: exactly exp(x - shift)). A loop of float32 only, so
    that it runs 8 lanes wide on AVX2: with a float64 sum in the same loop LLVM picks 4."""
    if inv_t == _ONE:
        for i in range(x.size):
            e[i] = _exp_less(x[i], shift)
    else:
        for i in range(x.size):
            e[i] = _exp_at(x[i], shift, inv_t)


@njit(fastmath=_SUMS, cache=True)
def _exp_sum(x, shift, inv_t, e):
    """e = exp((x - shift) * inv_t) and its float64 sum: the cells first, then their sum while they are in L1 (a
    block of CDF_BLOCK cells is 16 KB)."""
    _exp_into(x, shift, inv_t, e)
    return _sum(e[:x.size])


@njit(fastmath=_SUMS, cache=True)
def _row_norm(x, e, eb):
    """One row on one thread: its max, then exp and block sums with the row still in this core's cache."""
    m = _max_of(_max_key(x))
    for j in range(eb.size):
        lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, x.size)
        eb[j] = _exp_sum(x[lo:hi], m, _ONE, e[lo:hi])
    return m


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _norms(x, rows, e, eb, threads):
    """Output row r reads x[rows[r]]. Whole rows per thread while every thread has one; the rows left over (fewer
    than the threads) split by blocks in two parallel passes, block maxima then exp, so that one row still uses
    every core. (The caller passes the thread count: a kernel that asks numba for it cannot be cached.)"""
    n, size = e.shape
    nb = eb.shape[1]
    m = np.zeros(n)
    whole = n - n % threads
    if whole:
        for r in prange(whole):
            m[r] = _row_norm(x[rows[r]], e[r], eb[r])
    left = n - whole
    if left:
        keys = np.empty((left, nb), np.int32)
        for k in prange(left * nb):
            r, lo, hi = _span(k, nb, size)
            keys[r, k % nb] = _max_key(x[rows[whole + r], lo:hi])
        for r in range(left):
            m[whole + r] = _max_of(keys[r].max())
        for k in prange(left * nb):
            r, lo, hi = _span(k, nb, size)
            row = whole + r
            eb[row, k % nb] = _exp_sum(x[rows[row], lo:hi], _F(m[row]), _ONE, e[row, lo:hi])
    return m


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _exp_blocks(x, shift, inv_t, e, eb):
    n, size = x.shape
    nb = eb.shape[1]
    for k in prange(n * nb):
        r, lo, hi = _span(k, nb, size)
        eb[r, k % nb] = _exp_sum(x[r, lo:hi], _F(shift[r]), inv_t, e[r, lo:hi])


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _block_sums(flat, out):
    for j in prange(out.size):
        out[j] = _sum(flat[j * CDF_BLOCK:(j + 1) * CDF_BLOCK])


@njit(fastmath=_SUMS, cache=True)
def _scale(e, c, out):
    for i in range(e.size):
        out[i] = e[i] * c


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _scaled(e, scale, out):
    n, size = e.shape
    nb = (size + CDF_BLOCK - 1) // CDF_BLOCK
    for k in prange(n * nb):
        r, lo, hi = _span(k, nb, size)
        _scale(e[r, lo:hi], _F(scale[r]), out[r, lo:hi])


@njit(fastmath=_SUMS, cache=True)
def _residual_sum(p, q, s):
    acc = 0.0
    for i in range(p.size):
        acc += _residual(p[i], q[i], s)
    return acc


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _residual_blocks(p, q, s, out):
    for j in prange(out.size):
        lo, hi = j * CDF_BLOCK, (j + 1) * CDF_BLOCK
        out[j] = _residual_sum(p[lo:hi], q[lo:hi], s)
    return out.sum()


@njit(cache=True)
def _residual_cells(p, q, s):
    out = np.empty(p.size)
    for i in range(p.size):
        out[i] = _residual(p[i], q[i], s)
    return out


@njit(fastmath=False, cache=True)
def _pair_cell(e, a, qv, s):
    """max(e a - s q, 0) in float32, each product and the difference rounded (no FMA: fastmath=False)."""
    return max(e * a - s * qv, _ZERO)


@njit(fastmath=False, cache=True)
def _q_more(acc, e, c):
    """acc + e c in float32, the product rounded before the sum."""
    return acc + e * c


@njit(fastmath=False, cache=True)
def _q_cells(eq, idx, coef, lo, hi, out):
    """q's cells lo..hi of one row: e_q[idx[0]] c[0] + e_q[idx[1]] c[1] + ..., in that order (0 with no parent)."""
    if idx.size == 0:
        for i in range(hi - lo):
            out[i] = _ZERO
        return
    row, c = eq[idx[0]], _F(coef[0])
    for i in range(hi - lo):
        out[i] = row[lo + i] * c
    for k in range(1, idx.size):
        row, c = eq[idx[k]], _F(coef[k])
        for i in range(hi - lo):
            out[i] = _q_more(out[i], row[lo + i], c)


@njit(fastmath=_SUMS, cache=True)
def _pair_sum(ep, a, q, s):
    acc = 0.0
    for i in range(ep.size):
        acc += _pair_cell(ep[i], a, q[i], s)
    return acc


@njit(fastmath=_SUMS, cache=True)
def _pair_sum1(ep, a, eq, c, s):
    """One parent: q's cell e_q c formed in the sum (as _q_cells forms it)."""
    acc = 0.0
    for i in range(ep.size):
        acc += _pair_cell(ep[i], a, eq[i] * c, s)
    return acc


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _pair_blocks(ep, ap, eq, qptr, qidx, qc, s, out):
    n, size = ep.shape
    nb = out.shape[1]
    for k in prange(n * nb):
        r, lo, hi = _span(k, nb, size)
        a, first, last = _F(ap[r]), qptr[r], qptr[r + 1]
        if last - first == 1:
            out[r, k % nb] = _pair_sum1(ep[r, lo:hi], a, eq[qidx[first], lo:hi], _F(qc[first]), s)
        else:
            q = np.empty(hi - lo, np.float32)
            _q_cells(eq, qidx[first:last], qc[first:last], lo, hi, q)
            out[r, k % nb] = _pair_sum(ep[r, lo:hi], a, q, s)
    return out.sum()


@njit(cache=True)
def _pair_cells(ep, ap, eq, qptr, qidx, qc, s, r, lo, hi):
    q = np.empty(hi - lo, np.float32)
    _q_cells(eq, qidx[qptr[r]:qptr[r + 1]], qc[qptr[r]:qptr[r + 1]], lo, hi, q)
    a = _F(ap[r])
    out = np.empty(hi - lo)
    for i in range(hi - lo):
        out[i] = _pair_cell(ep[r, lo + i], a, q[i], s)
    return out


@njit(cache=True)
def _pair_pq(ep, ap, eq, qptr, qidx, qc, r, t):
    q = np.empty(1, np.float32)
    _q_cells(eq, qidx[qptr[r]:qptr[r + 1]], qc[qptr[r]:qptr[r + 1]], t, t + 1, q)
    return ep[r, t] * _F(ap[r]), q[0]


# ------------------------------------------------------------------------------------------ the plain step
# A plain step (one row, a dense warp) in two serial calls that compute what the general path computes, in its order:
# the block sums as `_norms` and `_exp_blocks` form them (the same `_exp_sum` on the same blocks), every float64 total
# in numpy's pairwise order, every running sum (np.cumsum) left to right. So the key drawn and the log-prob are the
# general path's to the bit. The cells are not kept: each block's go through one block of scratch (in L1), and the
# draw forms its block's cells again.

PAIRWISE_MAX = 128  # numpy's pairwise block: up to this many values it sums without splitting


@njit(fastmath=False, cache=True)
def _pairwise_at(a, lo, n):
    """a[lo:lo + n].sum() as numpy forms it for n <= PAIRWISE_MAX (eight accumulators from eight values, then the
    rest in order), bit for bit. No fastmath: reassociation would change the order."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i, whole = 8, n - n % 8
    while i < whole:
        k = lo + i
        r0, r1, r2, r3 = r0 + a[k], r1 + a[k + 1], r2 + a[k + 2], r3 + a[k + 3]
        r4, r5, r6, r7 = r4 + a[k + 4], r5 + a[k + 5], r6 + a[k + 6], r7 + a[k + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(fastmath=False, cache=True)
def _pairwise(a, n):
    """a[:n].sum() as numpy forms it, any n: above PAIRWISE_MAX numpy halves the range (the first half a multiple of
    8) and adds the halves' sums; that recursion runs here on an explicit stack (numba's cache cannot hold a
    recursive kernel)."""
    if n <= PAIRWISE_MAX:
        return _pairwise_at(a, 0, n)
    los, ns, lefts = np.empty(64, np.int64), np.empty(64, np.int64), np.empty(64)
    phase = np.zeros(64, np.int64)  # 0: not split yet, 1: its left half being summed, 2: its right half
    d, los[0], ns[0] = 0, 0, n
    while True:
        if ns[d] > PAIRWISE_MAX:  # split: the left half first
            half = ns[d] // 2
            half -= half % 8
            phase[d] = 1
            los[d + 1], ns[d + 1], phase[d + 1] = los[d], half, 0
            d += 1
            continue
        value = _pairwise_at(a, los[d], ns[d])
        d -= 1
        while d >= 0 and phase[d] == 2:  # a right half done: its range's sum goes up
            value = lefts[d] + value
            d -= 1
        if d < 0:
            return value
        lefts[d], phase[d] = value, 2  # a left half done: the right half next
        half = ns[d] // 2
        half -= half % 8
        los[d + 1], ns[d + 1], phase[d + 1] = los[d] + half, ns[d] - half, 0
        d += 1


@njit(fastmath=_SUMS, cache=True)
def _row_law(x, inv_t, seg, eb1, eb, want_argmax):
    """One row on this thread: its max m, the block sums eb1 of exp(x - m) (the normaliser's), and at inv_t != 1
    the block sums eb of exp((x - m) * inv_t) (the law's; else eb = eb1); the first index of the max when asked
    (else -1). inv_t is rounded to float32 here, as `exp_blocks` rounds it."""
    size, nb = x.size, eb.size
    t = np.float32(inv_t)
    key = _max_key(x)
    m = _max_of(key)
    for j in range(nb):
        lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)
        eb1[j] = _exp_sum(x[lo:hi], m, _ONE, seg[:hi - lo])
    if t != _ONE:
        for j in range(nb):
            lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)
            eb[j] = _exp_sum(x[lo:hi], m, t, seg[:hi - lo])
    else:
        eb[:] = eb1
    first = -1
    if want_argmax:
        top = _key_value(key)
        for i in range(size):
            if x[i] == top:
                first = i
                break
    return np.float64(m), _pairwise(eb1, nb), _pairwise(eb, nb), first


@njit(fastmath=False, cache=True)
def _scan(cells, n, rest, last):
    """The first of a block's n cells whose running sum (left to right, float64) passes `rest`; `last` (its last
    cell with mass) where rounding leaves none that does."""
    acc, i = 0.0, 0
    while i < n:
        acc += cells[i]
        if acc > rest:
            return i
        i += 1
    return last


@njit(fastmath=False, cache=True)
def _draw_row(x, m, inv_t, seg, eb, scale, u):
    """The key `tensors._icdf` draws with the uniform u from the law e * scale, e = exp((x - m) * inv_t) with block
    sums eb: t = u * the blocks' total, the block where their running sum passes t, then the cell where the block's
    running sum passes what is left of t (a block whose cells are all 0 is dropped and t capped, as there)."""
    size, nb = x.size, eb.size
    m32, t32 = np.float32(m), np.float32(inv_t)
    blocks = eb * scale
    t = u * _pairwise(blocks, nb)
    cb = np.empty(nb)
    cells = np.empty(CDF_BLOCK)
    while True:
        acc = 0.0
        for j in range(nb):
            acc += blocks[j]
            cb[j] = acc
        b = 0
        while b < nb and cb[b] <= t:
            b += 1
        b = min(b, nb - 1)
        while b > 0 and blocks[b] <= 0:
            b -= 1
        lo, hi = b * CDF_BLOCK, min((b + 1) * CDF_BLOCK, size)
        _exp_into(x[lo:hi], m32, t32, seg[:hi - lo])  # the block's cells, as the law's pass formed them
        last = -1
        for i in range(hi - lo):
            cells[i] = np.float64(seg[i]) * scale
            if cells[i] > 0:
                last = i
        if last >= 0:
            break
        blocks[b] = 0.0
        t = min(t, _pairwise(blocks, nb) * (1 - 1e-16))
    return lo + _scan(cells, hi - lo, t - (cb[b - 1] if b else 0.0), last)


@njit(parallel=True, fastmath=_SUMS, cache=True)
def _rows_law(x, rows, inv_t, seg, eb1, eb, m, s1, s_t):
    """`_row_law` for each row x[rows[r]] (a thread per row): m, eb1, eb and their totals s1, s_t per row."""
    n, size = rows.size, x.shape[1]
    nb = eb.shape[1]
    t = np.float32(inv_t)
    for r in prange(n):
        top = _max_of(_max_key(x[rows[r]]))
        m[r] = top
        for j in range(nb):
            lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)
            eb1[r, j] = _exp_sum(x[rows[r], lo:hi], top, _ONE, seg[r, :hi - lo])
        if t != _ONE:
            for j in range(nb):
                lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)
                eb[r, j] = _exp_sum(x[rows[r], lo:hi], top, t, seg[r, :hi - lo])
        else:
            for j in range(nb):
                eb[r, j] = eb1[r, j]
        s1[r] = _pairwise(eb1[r], nb)
        s_t[r] = _pairwise(eb[r], nb)


@njit(fastmath=False, cache=True)
def _icdf_rows(x, rows, m, t32, stored, seg, scale, blocks, t, drawn, n_drawn):
    """`tensors._icdf` on the law e * scale_row over the rows x[rows[r]] (e = exp((x - m_row) * t32), or x itself
    where `stored`; block sums `blocks`, flat), the cells of the keys drawn[:n_drawn] set to 0 (keys r * V + t):
    the key, and seg holding its block's e."""
    n, size = rows.size, x.shape[1]
    nb = blocks.size // n
    bl = blocks.copy()
    cb = np.empty(bl.size)
    cells = np.empty(CDF_BLOCK)
    while True:
        acc = 0.0
        for j in range(bl.size):
            acc += bl[j]
            cb[j] = acc
        b = 0
        while b < bl.size and cb[b] <= t:
            b += 1
        b = min(b, bl.size - 1)
        while b > 0 and bl[b] <= 0:
            b -= 1
        r, j = b // nb, b % nb
        lo, hi = j * CDF_BLOCK, min((j + 1) * CDF_BLOCK, size)
        first = r * size + lo
        if stored:
            seg[:hi - lo] = x[rows[r], lo:hi]
        else:
            _exp_into(x[rows[r], lo:hi], np.float32(m[r]), t32, seg[:hi - lo])
        for i in range(hi - lo):
            cells[i] = np.float64(seg[i]) * scale[r]
        for d in range(n_drawn):
            if first <= drawn[d] < first + hi - lo:
                cells[drawn[d] - first] = 0.0
        last = -1
        for i in range(hi - lo):
            if cells[i] > 0:
                last = i
        if last >= 0:
            break
        bl[b] = 0.0
        t = min(t, _pairwise(bl, bl.size) * (1 - 1e-16))
    return first + _scan(cells, hi - lo, t - (cb[b - 1] if b else 0.0), last)


@njit(fastmath=False, cache=True)
def _draw_rows(x, rows, m, inv_t, stored, seg, eb, scale, u, replace, out, vals):
    """`TorchLaw.sample` (replace) or `TorchLaw.distinct`'s keys, one uniform of u each, into out, and each drawn
    cell's value into vals: blocks eb * scale_row; with replacement every draw from the whole law, without each
    from what the earlier ones left (their cells 0, their masses out of their blocks). The cells are
    exp((x - m_row) * inv_t) * scale_row, or x * scale_row where `stored` (x holds the law's e), row r being
    x[rows[r]]."""
    n, size = rows.size, x.shape[1]
    nb = eb.shape[1]
    t32 = np.float32(inv_t)
    blocks = np.empty(n * nb)
    for r in range(n):
        for j in range(nb):
            blocks[r * nb + j] = eb[r, j] * scale[r]
    total = _pairwise(blocks, blocks.size)
    for d in range(u.size):
        if replace:
            k = _icdf_rows(x, rows, m, t32, stored, seg, scale, blocks, u[d] * total, out, 0)
        else:
            k = _icdf_rows(x, rows, m, t32, stored, seg, scale, blocks, u[d] * _pairwise(blocks, blocks.size), out,
                           d)
        r, tok = k // size, k % size
        vals[d] = np.float64(seg[tok % CDF_BLOCK]) * scale[r]
        if not replace:
            blocks[r * nb + tok // CDF_BLOCK] -= vals[d]
        out[d] = k


_TOP_CHUNK = 512  # cells a chunk: the unit `_row_top` skips after one integer max


@njit(cache=True)
def _least(w, idx, k):
    """The position of the last-ranked of k kept cells: the least worth, of those the highest index."""
    j = 0
    for i in range(1, k):
        if w[i] < w[j] or (w[i] == w[j] and idx[i] > idx[j]):
            j = i
    return j


@njit(cache=True)
def _row_top(e, s32, k, w, idx):
    """The k cells of one row with the largest worth e * s32 (float32 products), ties to the lower index, into w
    and idx (unordered): the row's first k cells, then each later cell worth more than the last-ranked kept one
    (cells come in index order, so an equal worth never displaces a lower index). A chunk whose largest cell is
    worth no more than the last-ranked is skipped after one integer max (the worth is monotone in the cell).
    Returns the count kept (k, or the row's size if smaller)."""
    size = e.size
    n, last = 0, 0
    for lo in range(0, size, _TOP_CHUNK):
        hi = min(lo + _TOP_CHUNK, size)
        if n == k and not _key_value(_max_key(e[lo:hi])) * s32 > w[last]:
            continue
        for i in range(lo, hi):
            v = e[i] * s32
            if n < k:
                w[n], idx[n] = v, i
                n += 1
                if n == k:
                    last = _least(w, idx, k)
            elif v > w[last]:
                w[last], idx[last] = v, i
                last = _least(w, idx, k)
    return n


@njit(parallel=True, cache=True)
def _rows_top(e, rows, s32, k, w, idx, counts):
    for j in prange(rows.size):
        counts[j] = _row_top(e[rows[j]], s32[j], k, w[j], idx[j])


# ----------------------------------------------------------------------------------------------------- the API

def blocks(size: int) -> int:
    """Blocks of CDF_BLOCK cells in `size` cells (the last one short)."""
    return -(-size // CDF_BLOCK)


def _input(a, ndim: int) -> np.ndarray:
    """a as a C-contiguous float32 array, read-only (one compiled variant per kernel, whatever the caller's flags)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != ndim:
        raise ValueError(f"expected a {ndim}-d array, got shape {a.shape}")
    a = a.view()
    a.flags.writeable = False
    return a


def _output(a: np.ndarray, dtype, shape: tuple[int, ...], name: str) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape and a.flags.c_contiguous
            and a.flags.writeable):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a writable C-contiguous {np.dtype(dtype)} array of shape {shape}, got {got}")


def _row_scalars(a, n: int) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
    if a.size != n:
        raise ValueError(f"expected {n} per-row values, got {a.size}")
    a = a.view()
    a.flags.writeable = False
    return a


def norms(x, e_out: np.ndarray, eb_out: np.ndarray, rows=None) -> np.ndarray:
    """Each row's max m (float64 [n]; 0 for a row with no finite cell), e = exp(x - float32(m)) into e_out
    (float32 [n, V]) and e's float64 block sums into eb_out ([n, blocks(V)]): lse = m + log(eb_out.sum(1)).
    With `rows`, row r is x[rows[r]] (rows gathered where they lie, with no copy); else x's rows in order.

    Two passes over a row, the second from cache: its max (an integer max of order keys), then exp and the sums.
    The max must come first: e is exp(x - m) as float32 computes it, not a running sum rescaled. Each thread takes
    whole rows while there are rows for all; the rest are split by blocks, so one row still uses every core."""
    x = _input(x, 2)
    rows = np.arange(x.shape[0]) if rows is None else np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and not 0 <= rows.min() <= rows.max() < x.shape[0]:
        raise ValueError(f"rows must index x's {x.shape[0]} rows, got {rows.min()}..{rows.max()}")
    n, size = rows.size, x.shape[1]
    _output(e_out, np.float32, (n, size), "e_out")
    _output(eb_out, np.float64, (n, blocks(size)), "eb_out")
    with _turn():
        return _norms(x, rows, e_out, eb_out, numba.get_num_threads())


def exp_blocks(x, shift, inv_t: float, e_out: np.ndarray, eb_out: np.ndarray) -> None:
    """e = exp((x - float32(shift_r)) * float32(inv_t)) into e_out (float32 [n, V]) and its float64 block sums into
    eb_out ([n, blocks(V)]); a temperature law passes shift = the row max and inv_t = 1 / T."""
    x = _input(x, 2)
    n, size = x.shape
    _output(e_out, np.float32, (n, size), "e_out")
    _output(eb_out, np.float64, (n, blocks(size)), "eb_out")
    with _turn():
        _exp_blocks(x, _row_scalars(shift, n), _F(inv_t), e_out, eb_out)


def block_sums(flat, out: np.ndarray) -> np.ndarray:
    """Float64 sums of a flat float32 array's consecutive CDF_BLOCK-cell blocks (the last short) into out."""
    flat = _input(flat, 1)
    _output(out, np.float64, (blocks(flat.size),), "out")
    with _turn():
        _block_sums(flat, out)
    return out


def scaled(e, scale, out: np.ndarray) -> np.ndarray:
    """out[r * V + t] = e[r, t] * float32(scale[r]), float32, flat [n * V]: a law's cells from e and each row's
    float64 scale, rounded once as the product of two float32 numbers."""
    e = _input(e, 2)
    n, size = e.shape
    _output(out, np.float32, (n * size,), "out")
    with _turn():
        _scaled(e, _row_scalars(scale, n), out.reshape(n, size))
    return out


def residual_blocks(p, q, s: float, out: np.ndarray) -> float:
    """The float64 block sums (into out, [blocks(N)]) and total of u = max(p - float32(s) * q, 0) over flat float32
    p and q [N], in one pass that stores no cell: the residual chain's mass M(s) and the blocks a draw from u
    reads. Cells are computed as `residual_cells` computes them."""
    p, q = _input(p, 1), _input(q, 1)
    if p.size != q.size:
        raise ValueError(f"p and q differ in size: {p.size} and {q.size}")
    _output(out, np.float64, (blocks(p.size),), "out")
    with _turn():
        return float(_residual_blocks(p, q, _F(s), out))


def residual_cells(p, q, s: float, lo: int, hi: int) -> np.ndarray:
    """u = max(p - float32(s) * q, 0) on cells lo..hi, float32 arithmetic (a product, then a difference, each
    rounded: numpy's float32 result bit for bit), as float64: one block for an inverse-CDF scan."""
    p, q = _input(p, 1), _input(q, 1)
    if not 0 <= lo <= hi <= min(p.size, q.size):
        raise ValueError(f"cells {lo}..{hi} outside 0..{min(p.size, q.size)}")
    return _residual_cells(p[lo:hi], q[lo:hi], _F(s))


class Pair:
    """A law p and a draft law q mapped onto its rows, read from the stored rows: p = e_p[r] * float32(a_r) (a law's
    normalised cells, as `scaled` forms them) and q[r] = sum over row r's parents j of e_q[j] * float32(c_j)
    (CSR: the parents of row r are qidx[qptr[r]:qptr[r + 1]], rows of e_q). Neither [n, V] table is ever written:
    the residual u = max(p - float32(s) * q, 0) is summed by blocks of each row in one pass (`blocks`), a block's
    cells come from the same arithmetic (`cells`), bit for bit."""

    def __init__(self, ep, ap, eq, qptr, qidx, qc) -> None:
        self.ep, self.eq = _input(ep, 2), _input(eq, 2)
        n, size = self.ep.shape
        if self.eq.shape[1] != size:
            raise ValueError(f"p's rows have {size} cells, q's {self.eq.shape[1]}")
        self.ap = _row_scalars(ap, n)
        self.qptr = np.ascontiguousarray(qptr, dtype=np.int64)
        self.qidx = np.ascontiguousarray(qidx, dtype=np.int64)
        self.qc = np.ascontiguousarray(qc, dtype=np.float64)
        if self.qptr.shape != (n + 1,) or self.qptr[0] != 0 or self.qptr[-1] != self.qidx.size \
                or self.qidx.size != self.qc.size or (np.diff(self.qptr) < 0).any() \
                or (self.qidx.size and not 0 <= self.qidx.min() <= self.qidx.max() < self.eq.shape[0]):
            raise ValueError("q's parents must be CSR: qptr [n + 1] from 0 to len(qidx) == len(qc), "
                             "qidx rows of eq")
        self.n, self.size, self.per_row = n, size, blocks(size)

    def blocks(self, s: float, out: np.ndarray) -> float:
        """u's float64 block sums, row by row ([n * blocks(V)] flat), and their total."""
        _output(out, np.float64, (self.n * self.per_row,), "out")
        with _turn():
            return float(_pair_blocks(self.ep, self.ap, self.eq, self.qptr, self.qidx, self.qc, _F(s),
                                      out.reshape(self.n, self.per_row)))

    def cells(self, s: float, r: int, lo: int, hi: int) -> np.ndarray:
        """u's cells lo..hi of row r, float64."""
        if not (0 <= r < self.n and 0 <= lo <= hi <= self.size):
            raise ValueError(f"row {r}, cells {lo}..{hi} outside {self.n} x {self.size}")
        return _pair_cells(self.ep, self.ap, self.eq, self.qptr, self.qidx, self.qc, _F(s), r, lo, hi)

    def pq(self, r: int, t: int) -> tuple[float, float]:
        """(p, q) of one cell, float32 values as the kernels form them."""
        p, q = _pair_pq(self.ep, self.ap, self.eq, self.qptr, self.qidx, self.qc, r, t)
        return float(p), float(q)


class RowStep:
    """One row's plain step on rows of `size` cells, serially on the calling thread: a call wakes no thread, and its
    scratch (one block of cells, two rows of block sums) is checked once, here.

        m, s1, s, first = step.law(x, inv_t, argmax)   # x: float32 [size]; numpy's sums of eb1 and eb
        key = step.draw(x, m, inv_t, scale, u)         # after law, with its eb

    law: the row's max m (float64; 0 for a row with no finite cell), the block sums eb1 of exp(x - float32(m))
    (`norms`'s) and eb of exp((x - m) * float32(inv_t)) (`exp_blocks`'s; eb1's at inv_t = 1), their totals as numpy
    sums them, and the first index of the max if `argmax` (else -1). draw: the key the law e * scale gives the uniform
    u by the inverse CDF over the blocks then one block's cells (`tensors._icdf`'s key, bit for bit). One instance
    per thread."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a row needs cells, got {size}")
        self.size = size
        self.seg = np.empty(CDF_BLOCK, np.float32)
        self.eb1, self.eb = np.empty(blocks(size)), np.empty(blocks(size))

    def law(self, x: np.ndarray, inv_t: float, argmax: bool = False) -> tuple[float, float, float, int]:
        self._check(x)
        return _row_law(x, float(inv_t), self.seg, self.eb1, self.eb, bool(argmax))

    def draw(self, x: np.ndarray, m: float, inv_t: float, scale: float, u: float) -> int:
        self._check(x)
        return _draw_row(x, float(m), float(inv_t), self.seg, self.eb, float(scale), float(u))

    def _check(self, x) -> None:
        if not (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 1 and x.size == self.size):
            raise ValueError(f"expected a float32 row of {self.size} cells")


class RowsStep:
    """`RowStep` for n rows at once, a thread per row for the normalisers (for the beam modes' plain step).

        m, s1, s = step.law(x, inv_t, rows=None)       # x: float32 [n, size] (or rows of it); float64 [n] each
        keys = step.draw(x, m, inv_t, scale, u, replace, rows=None)   # flat keys (r * size + token), a uniform each

    draw: `TorchLaw.sample` (replace) or `TorchLaw.distinct`'s keys for the law e * scale_row (scale: float64 [n]),
    bit for bit. One instance per thread; `draw` after `law`, with its block sums."""

    def __init__(self, rows: int, size: int) -> None:
        if rows < 1 or size < 1:
            raise ValueError(f"rows need cells, got {rows} x {size}")
        self.shape = (rows, size)
        self.seg = np.empty((rows, CDF_BLOCK), np.float32)
        self.eb1, self.eb = np.empty((rows, blocks(size))), np.empty((rows, blocks(size)))
        self.m, self.s1, self.s = np.empty(rows), np.empty(rows), np.empty(rows)

    def law(self, x: np.ndarray, inv_t: float, rows=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = self._check(x, rows)
        with _turn():
            _rows_law(x, rows, float(inv_t), self.seg, self.eb1, self.eb, self.m, self.s1, self.s)
        return self.m, self.s1, self.s

    def draw(self, x: np.ndarray, m, inv_t: float, scale, u, replace: bool, rows=None) -> np.ndarray:
        rows = self._check(x, rows)
        out = np.empty(len(u), np.int64)
        _draw_rows(x, rows, _row_scalars(m, self.shape[0]), float(inv_t), False, self.seg[0], self.eb,
                   _row_scalars(scale, self.shape[0]), np.asarray(u, dtype=np.float64), bool(replace), out,
                   np.empty(len(u)))
        return out

    def _check(self, x, rows) -> np.ndarray:
        """The row index: x's rows in order, or `rows` of x (rows gathered where they lie, with no copy)."""
        n, size = self.shape
        if not (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2 and x.shape[1] == size
                and x.flags.c_contiguous):
            raise ValueError(f"expected C-contiguous float32 rows of {size} cells")
        rows = np.arange(n) if rows is None else np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        if rows.size != n or (rows.size and not 0 <= rows.min() <= rows.max() < x.shape[0]):
            raise ValueError(f"expected {n} rows of x's {x.shape[0]}")
        return rows


def draws(e, eb: np.ndarray, scale, u, replace: bool) -> tuple[np.ndarray, np.ndarray]:
    """The keys `TorchLaw.sample` (replace) or `TorchLaw.distinct` draws with the uniforms u from the stored law
    e * scale_row (e: float32 [n, V], eb: its float64 block sums [n, blocks(V)], scale: float64 [n]), bit for bit,
    and each drawn cell's float64 value; serially, on the calling thread."""
    e = _input(e, 2)
    n, size = e.shape
    eb = np.ascontiguousarray(eb, dtype=np.float64)
    if eb.shape != (n, blocks(size)):
        raise ValueError(f"eb must be [{n}, {blocks(size)}], got {eb.shape}")
    u = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
    out, vals = np.empty(u.size, np.int64), np.empty(u.size)
    _draw_rows(e, np.arange(n), np.zeros(n), 1.0, True, np.empty(CDF_BLOCK, np.float32), eb, _row_scalars(scale, n),
               u, bool(replace), out, vals)
    return out, vals


def top_cells(e, rows, s32, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of each listed row of e (float32 [n, V], cells >= 0) the k cells with the largest worth e * s32[j]
    (float32 products), ties to the lower index: (row positions in `rows`, token ids, worths as float64), every
    row's kept cells, unordered; the k best overall are among them."""
    e = _input(e, 2)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    s32 = np.ascontiguousarray(s32, dtype=np.float32)
    if s32.shape != rows.shape or k < 1:
        raise ValueError(f"need one scale a row and k >= 1, got {s32.shape} for {rows.shape}, k {k}")
    w, idx, counts = np.empty((rows.size, k), np.float32), np.empty((rows.size, k), np.int64), np.empty(rows.size,
                                                                                                        np.int64)
    with _turn():
        _rows_top(e, rows, s32, int(k), w, idx, counts)
    keep = np.arange(k)[None, :] < counts[:, None]
    return np.nonzero(keep)[0], idx[keep], w[keep].astype(np.float64)


def numpy_sum(a) -> float:
    """A float64 array's sum in numpy's order (pairwise; what `RowStep` and `RowsStep` total with), bit for bit."""
    a = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
    return float(_pairwise(a, a.size))


# ----------------------------------------------------------------------------------------- warm-up and status

_STATUS: list = []  # [(ok, reason, seconds)] once warm() has run
_WARMING = threading.Lock()


def warm() -> tuple[bool, str, float]:
    """Compile (or load from numba's cache) every kernel on small arrays and check them against numpy:
    (ok, reason if not, seconds). Runs once; later calls return the first result."""
    with _WARMING:
        if not _STATUS:
            t0 = time.perf_counter()
            try:
                _check()
                _STATUS.append((True, "", time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - any compile or check failure means "use the reference"
                _STATUS.append((False, f"{type(e).__name__}: {e}", time.perf_counter() - t0))
        return _STATUS[0]


def available() -> tuple[bool, str]:
    """(whether the kernels compiled and passed their check, why not): warms them first if no one has."""
    ok, reason, _ = warm()
    return ok, reason


def _check() -> None:
    """Every kernel once, with the types the callers pass, against numpy at float32 tolerance."""
    x = np.linspace(-30.0, 5.0, 2 * (CDF_BLOCK + 5), dtype=np.float32).reshape(2, -1)
    x[1, 7] = -np.inf
    x64 = x.astype(np.float64)
    n, size = x.shape
    e, eb = np.empty_like(x), np.empty((n, blocks(size)))
    m = norms(x, e, eb)
    _close(m, x.max(1))
    _close(e, np.exp(x64 - m[:, None]))
    _close(eb.sum(1), np.exp(x64 - m[:, None]).sum(1))
    exp_blocks(x, m, 1.25, e, eb)
    _close(e, np.exp((x64 - m[:, None]) * 1.25))
    flat = scaled(e, np.array([0.5, 2.0]), np.empty(n * size, np.float32))
    _close(flat, (e * np.array([[0.5], [2.0]])).ravel())
    _close(block_sums(flat, np.empty(blocks(flat.size))).sum(), flat.sum(dtype=np.float64))
    p, q = flat / flat.sum(), flat[::-1] / flat.sum()
    _close(residual_blocks(p, q, 0.5, np.empty(blocks(p.size))), residual_cells(p, q, 0.5, 0, p.size).sum())
    for qptr in ([0, 1, 3], [0, 0, 1]):  # one parent, two; none
        qidx, qc = [1, 0, 1][:qptr[-1]], [0.5, 0.25, 1.0][:qptr[-1]]
        pair = Pair(e, [0.25, 0.5], e[::-1], qptr, qidx, qc)
        total = pair.blocks(0.5, np.empty(n * blocks(size)))
        _close(total, sum(pair.cells(0.5, r, 0, size).sum() for r in range(n)))
        parents = range(qptr[1], qptr[2])  # row 1's
        _close(pair.pq(1, 3), [e[1, 3] * 0.5, sum(e[::-1][qidx[j], 3] * qc[j] for j in parents)])
    _close(numpy_sum(eb), eb.sum())
    step = RowStep(size)
    for r, inv_t in ((0, 1.0), (1, 1.25)):  # the plain step at T = 1 and T = 0.8, on a row with a -inf cell
        m1, s1, s_t, first = step.law(x[r], inv_t, argmax=True)
        _close([m1, s1, s_t, first], [x64[r].max(), np.exp(x64[r] - m[r]).sum(),
                                      np.exp((x64[r] - m[r]) * inv_t).sum(), np.argmax(x[r])])
        key = step.draw(x[r], m1, inv_t, 1.0 / s_t, 0.5)
        cdf = np.cumsum(np.exp((x64[r] - m[r]) * inv_t)) / s_t
        _close(key, np.searchsorted(cdf, 0.5, side="right"))
    rows = RowsStep(n, size)  # the same over both rows, drawn with and without replacement
    for inv_t in (1.0, 1.25):
        m2, s1, s_t = rows.law(x, inv_t)
        _close(m2, m)
        _close(s1, np.exp(x64 - m[:, None]).sum(1))
        _close(s_t, np.exp((x64 - m[:, None]) * inv_t).sum(1))
        scale = np.array([0.5, 0.5]) / s_t
        cdf = np.cumsum((np.exp((x64 - m[:, None]) * inv_t) * scale[:, None]).ravel())
        for replace in (True, False):
            _close(rows.draw(x, m2, inv_t, scale, [0.25], replace), np.searchsorted(cdf, 0.25, side="right"))
    exp_blocks(x, m, 1.25, e, eb)  # the same draws from the stored cells (the last law, T = 0.8)
    for replace in (True, False):
        keys, vals = draws(e, eb, scale, [0.25, 0.75], replace)
        _close(keys[0], np.searchsorted(cdf, 0.25, side="right"))
        _close(vals, [e.ravel()[k] * scale[k // size] for k in keys])
    r, tok, worth = top_cells(e, np.array([1, 0]), np.array([2.0, 0.5], np.float32), 3)
    got = sorted(zip((-worth).tolist(), (np.array([1, 0])[r] * size + tok).tolist()))[:3]
    flat = (e * np.array([[0.5], [2.0]], np.float32)).astype(np.float64).ravel()
    _close([k for _, k in got], np.lexsort((np.arange(flat.size), -flat))[:3])


def _close(got, want) -> None:
    if not np.allclose(got, want, rtol=1e-5, atol=1e-30):
        raise ArithmeticError(f"a compiled row kernel disagrees with numpy: {got} against {want}")
