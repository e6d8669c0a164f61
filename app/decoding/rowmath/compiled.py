"""The CPU default: `tensors.TorchRows`'s algorithms with every pass over whole rows in a compiled kernel.

The torch backend spends its time on the number of passes (max, softmax, a block-sum pass, a second max, float64
widening) and on per-op dispatch, not on arithmetic. Here each of those is one kernel of `kernels.py` over the
rows where they lie (a torch CPU tensor and its numpy view share memory): a row's maximum, then one fused pass
that writes e = exp(x - max) and sums it in float64 blocks of CDF_BLOCK cells. A verified layer forms neither
p's normalised table nor q's on its rows: q on the rows stays a list of (draft row, coefficient) per row
(`_MappedQ`; draft rows read from the same cells merge into one), and the residual max(p - s q, 0) is summed
block by block from the stored e rows (`kernels.Pair`); a draw reads only the block its uniform falls in.
Everything else (laws, chains, draws, without replacement) is the torch backend's code, so the two differ only in
float32 rounding (spec §16.10), and the tests hold both to the reference.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Sequence

import numpy as np

from ..sampling import CDF_BLOCK, Rand, SeededRand, Warp
from . import kernels
from .reference import LogProbRow
from .tensors import TORCH_CELL_SECONDS, TorchLaw, TorchLogProbs, TorchRows, _InPlace, _one_result, _Pair, _QRows

log = logging.getLogger(__name__)

# The forest policy's prices (warp and draws, one chain step, per cell): torch's, divided by what
# scripts/measure_rowmath.py timed for compiled against torch on 4 Qwen-sized rows in one run on a 2-core EPYC
# (1.57x and 1.75x). They are above what the row math alone now costs (about 1.1e-9 and 1.2e-10 s a cell in the
# engine), and that is on purpose: a drafted layer also costs what the prices leave out (the node bookkeeping, the
# unique-path plan, the cache copies), and the engine's row-math prices let the policy build forests that did not
# pay (docs/measurements/rowmath.md, "The policy's prices").
COMPILED_CELL_SECONDS = (TORCH_CELL_SECONDS[0] / 1.57, TORCH_CELL_SECONDS[1] / 1.75)


class CompiledRows(TorchRows):
    """Row math on CPU tensors with `kernels.py`'s fused passes (module docstring)."""

    def __init__(self) -> None:
        ok, why, _ = kernels.warm()  # compiled, or loaded from numba's cache, before any answer is timed
        if not ok:
            raise RuntimeError(why)
        super().__init__("cpu")
        self.name = "compiled"
        self._cell_seconds = COMPILED_CELL_SECONDS
        self._scratch = threading.local()  # the plain steps' kernels.RowStep and RowsStep, per thread

    def plain_step(self, logits, score: float, warp: Warp | None, rand: Rand | None) -> tuple[int, float] | None:
        """One row's plain step in two compiled calls: the token `law(rows(logits), [score], warp).sample(1, rand)`
        draws (rand None: `argmax(0)`, greedy's pick) and its raw log-prob `at(0, token)`, bit for bit, with no
        tensor, law or numpy pass (a decoder's per-token cost on a small model). logits: one row, [1, V], as a pass
        returns it. None where the general path must run: a truncated warp, a rand other than the seeded stream
        (the enumerating tests'), a row with no finite mass."""
        if rand is not None and (type(rand) is not SeededRand or warp.top_p < 1.0):
            return None
        row = getattr(logits, "row", None)  # rows read in place (backends.unique.Rows); arrays and tensors have none
        src = row(0) if row is not None else logits[0]
        x = np.asarray(src, dtype=np.float32)
        vocab = x.size
        if rand is not None and 0 < warp.top_k < vocab:
            return None
        step = getattr(self._scratch, "step", None)
        if step is None or step.size != vocab:
            step = self._scratch.step = kernels.RowStep(vocab)
        inv_t = 1.0 if rand is None else 1.0 / warp.temperature
        m, s1, s_t, first = step.law(x, inv_t, rand is None)
        if not (0.0 < s1 < math.inf and 0.0 < s_t < math.inf):
            return None
        lse = m + float(np.log(s1))  # numpy's log, as the general path's (its SIMD exp and log are not libm's)
        if rand is None:
            key = first
        else:
            base = m if inv_t == 1.0 else m * inv_t
            row_lse = base + float(np.log(s_t))
            d = (score - lse) * inv_t
            w = d + row_lse  # the row's log mass: the only row's, so log_z = w + log(exp(0))
            if not math.isfinite(w):
                return None
            scale = float(np.exp(d - (w + 0.0) + base))
            if not 0.0 < scale < math.inf:
                return None
            key = step.draw(x, m, inv_t, scale, rand.rng.random())
        return key, float((src if row is not None else x)[key]) - lse

    def beam_step(self, logits, scores, warp: Warp, rand: Rand, n: int,
                  replace: bool) -> list[tuple[int, int, float]] | None:
        """The beam modes' step on the rows of one pass, fused: the n keys `law(rows(logits), scores, warp)` gives
        `sample(n, rand)` (replace) or `distinct_keys(law, n, rand)`, as (row, token, raw log-prob `at(row, token)`),
        bit for bit, in two compiled calls and the law's few numpy steps on one value a row. logits: a pass's rows,
        or a list of rows of `rows(...)` results (DSBD's beams, LogProbRow; read where they lie when one array holds
        them all; their normalisers are kept, as `stack` keeps them). None where the general
        path must run: a truncated warp, a rand other than the seeded stream, a row set with no valid parent or a
        row without finite mass, fewer blocks holding mass than distinct draws."""
        if type(rand) is not SeededRand or warp.top_p < 1.0:
            return None
        refs = logits if isinstance(logits, (list, tuple)) else None  # rows of `rows(...)` results (LogProbRow)
        lie = self._where_they_lie(refs) if refs is not None else None
        at = None  # x's row of each of the step's rows, where they are gathered in place
        if lie is not None:  # one array holds them all: read there, not copied
            logits, at = lie[0], np.asarray(lie[1], dtype=np.int64)
        elif refs is not None:
            logits = self._raw(refs)
        row = getattr(logits, "row", None)  # rows read in place (backends.unique.Rows)
        whole = logits if row is None else (logits.block() if hasattr(logits, "block") else None)
        if whole is None:
            whole = logits.take(range(len(logits)))
        x = np.ascontiguousarray(whole, dtype=np.float32)
        s = np.asarray(scores, dtype=np.float64)
        valid = np.isfinite(s)
        n_rows = x.shape[0] if at is None else at.size
        if x.ndim != 2 or not valid.any() or 0 < warp.top_k < x.shape[1] * np.count_nonzero(valid):
            return None
        step = getattr(self._scratch, "rows", None)
        if step is None or step.shape != (n_rows, x.shape[1]):
            step = self._scratch.rows = kernels.RowsStep(n_rows, x.shape[1])
        inv_t = 1.0 / warp.temperature
        m, s1, s_t = step.law(x, inv_t, at)
        # The law's arithmetic as `TorchRows.law` forms it (numpy's exp and log, numpy's sums), one value a row.
        with np.errstate(divide="ignore", invalid="ignore"):
            lse_rows = m + np.log(s1)
            lse = np.where(valid, lse_rows, 0.0)
            base = m if inv_t == 1.0 else m * inv_t
            row_lse = base + np.log(s_t)
            w = np.where(valid, (s - lse) * inv_t + row_lse, -np.inf)
            if not np.isfinite(w[valid]).all():
                return None
            w_max = w[valid].max()
            log_z = w_max + math.log(float(np.exp(w[valid] - w_max).sum()))
            c = (s - lse) * inv_t - log_z
            scale = np.where(valid, np.exp(np.where(valid, c + base, 0.0)), 0.0)
        if not replace and int(np.count_nonzero((step.eb * scale[:, None]).reshape(-1) > 0)) < n:
            return None
        keys = step.draw(x, m, inv_t, scale, rand.rng.random(n), replace, at)
        for r, ref in enumerate(refs or ()):  # their normalisers, as `stack` leaves them: a later read costs nothing
            if np.isfinite(lse_rows[r]):
                ref.src._norm.setdefault(ref.i, (float(m[r]), float(lse_rows[r])))
        vocab, out = x.shape[1], []
        for k in keys.tolist():
            r, t = divmod(k, vocab)
            cells = x[r if at is None else at[r]] if row is None else row(r)
            out.append((r, t, float(cells[t]) - float(lse_rows[r])))
        return out

    def stack(self, refs: Sequence[LogProbRow]) -> TorchLogProbs:
        """`TorchRows.stack` with no copy where the rows, none normalised yet, lie in one array: the normaliser
        reads them there (`kernels.norms` with a row index) and writes e, so the law needs no other pass; their
        raw cells are copied only if a truncated warp or a temperature reads them."""
        whole = _one_result(refs)
        lie = None if whole is not None or any(r.i in r.src._norm for r in refs) else self._where_they_lie(refs)
        if lie is None:
            return super().stack(refs)
        m, lse, e, eb, shift = self._norms(*lie)
        out = TorchLogProbs(self, _InPlace(self, _RefRows(refs)), dict(enumerate(zip(m.tolist(), lse.tolist()))))
        out.e, out.eb, out.shift = e, eb, shift
        for j, r in enumerate(refs):
            r.src._norm.setdefault(r.i, out._norm[j])
        return out

    @staticmethod
    def _where_they_lie(refs):
        """(a float32 numpy array, the rows' indices in it) where every row of refs lies in one array on the host;
        else None."""
        src = refs[0].src if refs else None
        if src is None or any(r.src is not src for r in refs):
            return None
        idx = [r.i for r in refs]
        x = src.x
        if isinstance(x, _InPlace):
            lie = getattr(x.rows, "lie", None)
            got = lie(idx) if lie is not None else None
            if got is None:
                return None
            block, idx = got
        else:
            block = x.numpy() if getattr(x, "device", None) is not None and x.device.type == "cpu" else None
        ok = isinstance(block, np.ndarray) and block.dtype == np.float32 and block.ndim == 2 \
            and block.shape[1] == src.vocab
        return (block, idx) if ok else None

    def _raw(self, refs):
        """The raw logits of rows of `rows(...)` results as one [n, V] block, with no normaliser: a result's own
        rows in order where they are all of one, else a stack of them (as `stack` forms it)."""
        whole = _one_result(refs)
        if whole is not None:
            return whole.whole()
        return self._stack([r.src.x[r.i] for r in refs])

    @staticmethod
    def _np(x) -> np.ndarray:
        """A CPU tensor's numpy view (shared memory; the kernels make any other layout C-contiguous float32)."""
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)

    def _norms(self, x, rows=None):
        """(row maxima (0 for a row with no finite cell), normalisers, e = exp(x - max), e's block sums, the
        shift (the maxima)): one read for the maxima, one fused exp-and-block-sum pass. With `rows`, of the rows
        x[rows] read where they lie."""
        xn = self._np(x)
        n = xn.shape[0] if rows is None else len(rows)
        e = self.torch.empty((n, xn.shape[1]), dtype=self.dtype)
        eb = np.empty((n, kernels.blocks(xn.shape[1])))
        m = kernels.norms(xn, e.numpy(), eb, rows=rows)
        with np.errstate(divide="ignore"):
            return m, m + np.log(eb.sum(axis=1)), e, eb, m

    def _exp_blocks(self, x, m: np.ndarray, inv_t: float):
        xn = self._np(x)
        e = self.torch.empty(xn.shape, dtype=self.dtype)
        eb = np.empty((xn.shape[0], kernels.blocks(xn.shape[1])))
        kernels.exp_blocks(xn, np.asarray(m, dtype=np.float64), float(inv_t), e.numpy(), eb)
        return e, eb

    def _block_sums(self, x) -> np.ndarray:
        xn = self._np(x)
        if xn.ndim == 1:
            out = np.empty(kernels.blocks(xn.size))
            kernels.block_sums(xn, out)
            return out
        out = np.empty((xn.shape[0], kernels.blocks(xn.shape[1])))
        for r in range(xn.shape[0]):  # a row's blocks start at its first cell
            kernels.block_sums(xn[r], out[r])
        return out

    def _cells_at(self, flat, idx: np.ndarray) -> np.ndarray:
        return self._np(flat)[idx].astype(np.float64)

    def _draws(self, law: TorchLaw, u: np.ndarray, replace: bool) -> tuple[np.ndarray, np.ndarray]:
        return kernels.draws(self._np(law._e), law._eb, law._scale, u, replace)

    def _top_cells(self, e, rows: np.ndarray, s: np.ndarray, k: int):
        return kernels.top_cells(self._np(e), rows, s, k)  # each row's k best, in one pass that skips chunks

    def _scaled(self, e, scale: np.ndarray):
        out = self.torch.empty(int(e.shape[0]) * int(e.shape[1]), dtype=self.dtype)
        kernels.scaled(self._np(e), np.asarray(scale, dtype=np.float64), out.numpy())
        return out

    def on_rows(self, q, parents: Sequence[Sequence[int]], counts: Sequence[int]):
        """q_rows(i, t) = (sum of q(j, t) over row i's parents j) / counts_i (spec §16.2), kept as each row's
        parents and coefficients: formed cell by cell where it is read."""
        if not isinstance(q, TorchLaw):
            return super().on_rows(q, parents, counts)
        return _MappedQ(self, q, parents, counts)

    def _pair(self, p, q) -> _Pair:
        if not (isinstance(q, _MappedQ) and isinstance(p, TorchLaw) and p.total() > 0):
            return super()._pair(p, q.formed() if isinstance(q, _MappedQ) else q)
        return _FusedPair(self._np(p._e), p._scale / p.total(), q)

    # torch's own thread pool would split these copies and scans, and its threads wait for each other as the
    # kernels' do (`kernels._turn`): on the host numpy does them on this thread.
    def _stack(self, rows):
        out = self.torch.empty((len(rows), int(rows[0].shape[0])), dtype=self.dtype)
        np.stack([self._np(r) for r in rows], out=out.numpy())
        return out

    def _argmax(self, row) -> int:
        return int(np.argmax(self._np(row)))

    def _residual_mass(self, p, q, s: float) -> float:
        pn, qn = self._np(p), self._np(q)
        return float(kernels.residual_blocks(pn, qn, float(s), np.empty(kernels.blocks(pn.size))))

    def _residual_blocks(self, p, q, s: float):
        pn, qn = self._np(p), self._np(q)
        blocks = np.empty(kernels.blocks(pn.size))
        kernels.residual_blocks(pn, qn, float(s), blocks)
        return blocks, _ResidualCells(pn, qn, float(s))


class _RefRows:
    """Rows of `rows(...)` results (LogProbRow) as `_InPlace` reads a runtime's rows: a row is a view where it lies,
    several rows a copy."""

    def __init__(self, refs: Sequence[LogProbRow]) -> None:
        self.refs = list(refs)
        self.shape = (len(self.refs), refs[0].src.vocab)

    def row(self, i: int) -> np.ndarray:
        r = self.refs[i]
        return CompiledRows._np(r.src.x[r.i])

    def take(self, idx) -> np.ndarray:
        return np.stack([self.row(int(i)) for i in idx])

    def block(self) -> None:
        return None


class _ResidualCells:
    """The cells max(p - s q, 0) of flat rows, computed one block at a time by the same kernel arithmetic as
    their block sums (so a draw's block and its cells agree to the bit)."""

    def __init__(self, p: np.ndarray, q: np.ndarray, s: float) -> None:
        self.p, self.q, self.s = p, q, s

    def block_of(self, k: int) -> int:
        return k // CDF_BLOCK

    def segment(self, b: int) -> tuple[int, np.ndarray]:
        lo = b * CDF_BLOCK
        return lo, kernels.residual_cells(self.p, self.q, self.s, lo, min(lo + CDF_BLOCK, self.p.size))

    def value(self, k: int) -> float:
        return float(kernels.residual_cells(self.p, self.q, self.s, k, k + 1)[0])

    def dense(self) -> np.ndarray:
        return kernels.residual_cells(self.p, self.q, self.s, 0, self.p.size)


class _MappedQ:
    """A draft law q on the target's rows: row i's cells are sum_j e_q[j] * c_ij over its parents j (float32, in
    parent order), c_ij = scale_j / (counts_i * total). Parents whose rows lie in the same cells (q's rows read in
    place, `TorchLogProbs.origin`) have the same e row: their coefficients add up on one of them."""

    def __init__(self, tm: TorchRows, q: TorchLaw, parents: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        self.tm, total = tm, q.total()
        self.vocab, self.n = q.vocab, len(parents)
        self.eq = q._e.numpy()
        ptr, idx, coef = [0], [], []
        for js, m in zip(parents, counts):
            row: dict = {}  # where a parent's cells lie -> its position in idx
            for j in js:
                if q._scale[j] > 0:
                    a = float(q._scale[j]) / (m * total)
                    key = q.origin[j] if q.origin is not None else j
                    if key in row:
                        coef[row[key]] += a
                    else:
                        row[key] = len(idx)
                        idx.append(j)
                        coef.append(a)
            ptr.append(len(idx))
        self.ptr, self.idx, self.coef = np.array(ptr), np.array(idx, dtype=np.int64), np.array(coef)
        self._formed: _QRows | None = None

    def cell(self, r: int, t: int) -> float:
        """q's cell (r, t), float32 as the kernels form it (each product rounded, then each sum)."""
        f32 = np.float32
        lo, hi = self.ptr[r], self.ptr[r + 1]
        if lo == hi:
            return 0.0
        acc = self.eq[self.idx[lo], t] * f32(self.coef[lo])
        for k in range(lo + 1, hi):
            acc = acc + self.eq[self.idx[k], t] * f32(self.coef[k])
        return float(acc)

    def lookup(self, keys) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        return np.array([self.cell(*divmod(int(k), self.vocab)) if 0 <= k < self.n * self.vocab else 0.0
                         for k in keys])

    def formed(self) -> _QRows:
        """The [n, V] table, as the torch backend holds it, formed once (for a p that is not a dense law)."""
        if self._formed is None:
            out = np.zeros((self.n, self.vocab), np.float32)
            for r in range(self.n):
                for k in range(self.ptr[r], self.ptr[r + 1]):
                    part = self.eq[self.idx[k]] * np.float32(self.coef[k])
                    out[r] = part if k == self.ptr[r] else out[r] + part
            self._formed = _QRows(self.tm, self.tm.torch.from_numpy(out))
        return self._formed

    @property
    def flat(self):
        return self.formed().flat


class _FusedPair(_Pair):
    """`_Pair` from the stored rows (`kernels.Pair`): p = e_p * (scale / total) per row, q as `_MappedQ` keeps it,
    the residual's blocks row by row."""

    def __init__(self, ep: np.ndarray, ap: np.ndarray, q: _MappedQ) -> None:
        self.k = kernels.Pair(ep, ap, q.eq, q.ptr, q.idx, q.coef)
        self.vocab = self.k.size
        self.n_cells = self.k.n * self.k.size

    def pq(self, k: int) -> tuple[float, float]:
        return self.k.pq(*divmod(k, self.vocab))

    def mass(self, s: float) -> float:
        return self.k.blocks(s, np.empty(self.k.n * self.k.per_row))

    def blocks(self, s: float):
        out = np.empty(self.k.n * self.k.per_row)
        self.k.blocks(s, out)
        return out, _PairCells(self.k, s)

    def p_dense(self) -> np.ndarray:
        return _PairCells(self.k, 0.0).dense()  # the residual at s = 0 is p


class _PairCells:
    """The residual's cells of a `kernels.Pair` at threshold s, in blocks of each row (`_icdf`'s cells)."""

    def __init__(self, k: "kernels.Pair", s: float) -> None:
        self.k, self.s = k, s

    def block_of(self, key: int) -> int:
        r, t = divmod(key, self.k.size)
        return r * self.k.per_row + t // CDF_BLOCK

    def segment(self, b: int) -> tuple[int, np.ndarray]:
        r, j = divmod(b, self.k.per_row)
        lo = j * CDF_BLOCK
        return r * self.k.size + lo, self.k.cells(self.s, r, lo, min(lo + CDF_BLOCK, self.k.size))

    def value(self, key: int) -> float:
        r, t = divmod(key, self.k.size)
        return float(self.k.cells(self.s, r, t, t + 1)[0])

    def dense(self) -> np.ndarray:
        return np.concatenate([self.k.cells(self.s, r, 0, self.k.size) for r in range(self.k.n)])
