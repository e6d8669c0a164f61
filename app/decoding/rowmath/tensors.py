"""The row math on torch tensors where the logits are: CPU threads, or a CUDA device (spec §16.10).

- one normaliser per row (max, the rows' softmax in one fused kernel, the sums of each row's 4,096-cell blocks),
  a row's log-probs only where a beam reads them;
- a dense law is `exp(x / T - base_row) * scale_row`: the normaliser's softmax (at T = 1) or one exp pass,
  float32 cells; its block sums are the rows' block sums times the row's float64 scale, with no pass over the
  cells, and the [rows, V] product is formed only where a verifier reads cells as a tensor;
- draws read the block sums and one block per uniform; draws without replacement are the same
  sequential rule with the drawn cells' masses taken out of their blocks (one uniform per draw, as `Rand` has);
- the residual chain in closed form: after rejections r = max(p - s q, 0) / M(s) with a scalar s (all drafts of a
  layer share q), each M one fused pass; without replacement the same form plus per-cell thresholds for the few
  cells already drawn or output, so no [n, rows, V] block and no per-draft copy of a row;
- uniforms come from the host generator (`SeededRand.rng`) in the reference's order, so both backends draw the same
  keys for the same seed except where a uniform falls within rounding of a CDF boundary.
Truncated warps (top-k, top-p) leave a small support: this backend selects it where the rows lie and hands a
sparse `Joint` to the reference. Any other `Rand` (the tests' enumerators) gets the exact probabilities of each
categorical the closed form implies, materialised, so enumerations check the closed form itself.

The passes over whole rows (`_norms`, `_exp_blocks`, `_block_sums`, `_mass`, the residual's cells) are methods,
so the compiled CPU backend (`compiled.py`) replaces them and keeps everything else.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from backends.base import host_rows

from ..sampling import (CDF_BLOCK, RESIDUAL_EPS, TOP_P_HEAD, Draft, DraftWOR, Rand, SeededRand, Warp,
                        draw_without_replacement, mss, warp_entries)
from .protocols import Outputs
from .reference import _REF, NUMPY_CELL_SECONDS, LogProbRow, NumpyLaw

TORCH_CELL_SECONDS = (NUMPY_CELL_SECONDS[0] / 4, NUMPY_CELL_SECONDS[1] / 8)


def _is_seeded(rand) -> bool:
    return type(rand) is SeededRand


class TorchLogProbs:
    """Raw log-probs of [n, V] logits as (logits, each row's max and float64 normaliser), rows on demand."""

    def __init__(self, tm: "TorchRows", x, norms: dict[int, tuple[float, float]] | None = None) -> None:
        self.tm, self.x = tm, x  # [n, V] tensor on tm.device
        self.vocab = int(x.shape[1])
        self._norm: dict[int, tuple[float, float]] = norms or {}  # row -> (max, log-sum-exp)
        self.e = None  # exp(x - shift) of every row, once all rows are normalised together
        self.eb: np.ndarray | None = None  # its float64 block sums [n, blocks per row]
        self.shift: np.ndarray | None = None  # [n] float64: e = exp(x - shift) (about each row's log-sum-exp)
        # where each row's cells lie, for rows read in place (two equal entries: the same cells, so the same e)
        self.origin = list(x.rows._where) if isinstance(x, _InPlace) and hasattr(x.rows, "_where") else None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def _fill(self) -> None:
        n = len(self)
        todo = [i for i in range(n) if i not in self._norm]
        if todo:
            whole = len(todo) == n
            m, lse, e, eb, shift = self.tm._norms(self.whole() if whole else self.x[todo])
            self._norm.update(zip(todo, zip(m.tolist(), lse.tolist())))
            if whole:  # every row in one pass: a law at T = 1 scales e instead of exponentiating again
                self.e, self.eb, self.shift = e, eb, shift

    def whole(self):
        """Every row as one [n, V] tensor, for immediate use: rows read in place stay in place where they lie in
        one block of the runtime's buffer, and are copied once where they do not."""
        if isinstance(self.x, _InPlace):
            block = self.x.block()
            if block is not None:
                return block
            self.x = self.x[:]
        return self.x

    def lse_all(self) -> np.ndarray:
        """[n] float64 normalisers (every row not yet done, in one vectorised pass)."""
        self._fill()
        return np.array([self._norm[i][1] for i in range(len(self))])

    def max_all(self) -> np.ndarray:
        self._fill()
        return np.array([self._norm[i][0] for i in range(len(self))])

    def lse(self, i: int) -> float:
        v = self._norm.get(i)
        if v is None:
            m, lse, _, _, _ = self.tm._norms(self.x[i:i + 1])
            v = self._norm[i] = (float(m[0]), float(lse[0]))
        return v[1]

    def at(self, row: int, token: int) -> float:
        return float(self.x[row, token]) - self.lse(row)

    def row(self, i: int) -> LogProbRow:
        return LogProbRow(self, i)

    def dense(self, i: int) -> np.ndarray:
        return self.tm._host(self.x[i]).astype(np.float64) - self.lse(i)

    def argmax(self, i: int) -> int:
        """Row i's likeliest token (ties: the lower id): the raw logits' argmax, no normaliser needed."""
        return self.tm._argmax(self.x[i])


class TorchLaw:
    """A dense warped joint over n rows x V: p(r, t) = e[r, t] * scale_r with e = exp(x / T - base_r) float32 on the
    device and scale_r float64 on the host (0 where the row is not a valid parent). Draws, masses and lookups read
    e's per-row block sums and single blocks; the [n, V] product p is formed only where a verifier reads it."""

    def __init__(self, tm: "TorchRows", scale: np.ndarray, e, eb: np.ndarray, origin=None) -> None:
        self.tm = tm
        self.origin = origin  # TorchLogProbs.origin of its rows, or None
        self.n, self.vocab = int(e.shape[0]), int(e.shape[1])
        self.size_cells = self.n * self.vocab
        self._scale = scale
        self._e, self._eb = e, eb
        self._ef = e.view(-1)
        self._per_row = int(eb.shape[1])  # blocks per row: CDF_BLOCK cells each, a row's last one short
        self._p = self._pn = None
        self._blocks: np.ndarray | None = None
        self._len: int | None = None

    @property
    def p(self):
        """[n, V] float32 probabilities (computed once, where a verifier reads cells as a tensor)."""
        if self._p is None:
            self._p = self.tm._scaled(self._e, self._scale).view(self.n, self.vocab)
        return self._p

    @property
    def flat(self):
        return self.p.view(-1)

    def normalised(self):
        """p / total as flat float32 cells, in one pass over e (the verifiers' cells)."""
        if self._pn is None:
            total = self.total()
            self._pn = self.tm._scaled(self._e, self._scale / total) if total > 0 else self.flat
        return self._pn

    def blocks(self) -> np.ndarray:
        """Float64 block sums of p, row by row (no pass over the cells)."""
        if self._blocks is None:
            self._blocks = (self._eb * self._scale[:, None]).reshape(-1)
        return self._blocks

    def block_of(self, k: int) -> int:
        r, t = divmod(k, self.vocab)
        return r * self._per_row + t // CDF_BLOCK

    def segment(self, b: int) -> tuple[int, np.ndarray]:
        """(first cell, float64 cells) of block b."""
        r, j = divmod(b, self._per_row)
        lo = r * self.vocab + j * CDF_BLOCK
        hi = r * self.vocab + min((j + 1) * CDF_BLOCK, self.vocab)
        return lo, self.tm._host(self._ef[lo:hi]).astype(np.float64) * self._scale[r]

    def cell(self, k: int) -> float:
        return float(self._ef[k]) * float(self._scale[k // self.vocab])

    def __len__(self) -> int:
        if self._len is None:
            rows = np.flatnonzero(self._scale > 0)
            e = self._e if rows.size == self.n else self._e[self.tm.torch.as_tensor(rows, device=self._e.device)]
            self._len = int(self.tm.torch.count_nonzero(e))
        return self._len

    def at_most(self, n: int) -> int:
        """min(n, support size): blocks with mass each hold a pair, so the count is read only when they are few."""
        return n if int(np.count_nonzero(self.blocks() > 0)) >= n else min(n, len(self))

    @property
    def keys(self) -> np.ndarray:
        return np.flatnonzero(self.tm._host(self.flat) > 0).astype(np.int64)

    @property
    def probs(self) -> np.ndarray:
        f = self.tm._host(self.flat).astype(np.float64)
        f = f[f > 0]
        return f / f.sum()

    def lookup(self, keys) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        ok = (keys >= 0) & (keys < self.size_cells)
        out = np.zeros(keys.shape)
        if ok.any():
            cells = self.tm._cells_at(self._ef, keys[ok])
            out[ok] = cells * self._scale[keys[ok] // self.vocab] / self.total()
        return out

    def total(self) -> float:
        return float(self.blocks().sum())

    def sample(self, n: int, rand: Rand) -> np.ndarray:
        if not _is_seeded(rand):
            keys, probs = self.keys, self.probs
            return np.array([rand.categorical(keys, probs) for _ in range(n)], dtype=np.int64)
        return self.tm._draws(self, rand.rng.random(n), True)[0]

    def distinct(self, n: int, rand: Rand) -> tuple[np.ndarray, np.ndarray]:
        """Up to n keys drawn sequentially without replacement, and the mass not yet drawn before each."""
        n = self.at_most(n)
        if not _is_seeded(rand):
            keys, probs = self.keys, self.probs
            left, out, rest = probs.copy(), [], []
            for _ in range(n):
                rest.append(float(left.sum()))
                k = rand.categorical(keys, left / rest[-1])
                out.append(int(k))
                left[np.searchsorted(keys, k)] = 0.0
            return np.array(out, dtype=np.int64), np.array(rest)
        keys, values = self.tm._draws(self, rand.rng.random(n), False)
        total, drawn_mass, rest = self.total(), 0.0, []
        for v in values.tolist():
            rest.append((total - drawn_mass) / total)
            drawn_mass += v
        return keys, np.array(rest)

    def profile(self, tiny: float) -> tuple[np.ndarray, float]:
        """The probabilities >= tiny (float64, of the normalised law) and the mass of the rest."""
        total = self.total()
        big = self.tm._host(self.flat[self.flat >= tiny * total]).astype(np.float64) / total
        return big, float(1.0 - big.sum())

    def top(self, k: int) -> np.ndarray:
        """Keys of the k likeliest pairs, descending, ties by lower key, valued as `p` forms its cells: the cells
        of the valid rows above a cut on e, lowered until k of them outweigh every cell left out (`_head`)."""
        k = self.at_most(k)
        rows = np.flatnonzero(self._scale > 0)
        r, tok, worth = self.tm._top_cells(self._e, rows, self._scale[rows].astype(np.float32), k)
        keys = rows[r] * self.vocab + tok
        return keys[np.lexsort((keys, -worth))[:k]]


_SUB = 128  # one cell in _SUB of each row: where a head's cut lies


def _levels(sub: np.ndarray, need: int, *, every: float) -> list[float]:
    """Cuts for `_head`, from the worths of a subsample of one cell in _SUB: the values at the ranks that stand for
    about need + 2 * _SUB cells of the rows, 4x and 16x that, and last `every` (a cut that takes every cell)."""
    v = sub[np.isfinite(sub)].ravel()
    r0 = -(-need // _SUB) + 2
    if r0 >= v.size:
        return [every]
    last = min(16 * r0, v.size - 1)
    head = -np.sort(np.partition(-v, last)[:last + 1])  # the last + 1 largest, descending
    return [float(head[r]) for r in (r0, 4 * r0, 16 * r0) if r <= last] + [every]


class TorchRows:
    """The row math on torch tensors where the logits are (module docstring)."""

    name = "torch"

    def __init__(self, device: str = "cpu", dtype: str = "float32", threads: int | None = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():  # fail here, not in the middle of an answer
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        self.dtype = getattr(torch, dtype)
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.name = f"torch-{self.device.type}" + ("" if dtype == "float32" else f"-{dtype}")
        self._cell_seconds: tuple[float, float] | None = TORCH_CELL_SECONDS if self.device.type == "cpu" else None

    @property
    def off_host(self) -> bool:
        """Whether the rows lie in a device's own memory (a GPU's), apart from the host's."""
        return self.device.type != "cpu"

    @property
    def cell_seconds(self) -> tuple[float, float]:
        """(warp and draws, one residual-chain step of one draft) seconds per (beam, token) cell: the forest
        policy's prices. On a CPU the measured TORCH_CELL_SECONDS; on another device (a GPU, whose costs are not
        a CPU's) timed there once, at first use."""
        if self._cell_seconds is None:
            self._cell_seconds = self.time_cells()
        return self._cell_seconds

    def time_cells(self, rows: int = 4, vocab: int = 151_936, repeats: int = 5) -> tuple[float, float]:
        """Seconds per cell of a warp with its draws and of one residual-chain step, timed here on synthetic
        Qwen-sized rows (the median of `repeats` after a warm-up, waiting for the device each time)."""
        t = self.torch
        x = t.randn((rows, vocab), generator=t.Generator().manual_seed(0), dtype=self.dtype).mul_(3).to(self.device)
        rand, warp, scores = SeededRand(np.random.default_rng(0)), Warp(temperature=1.0), np.zeros(rows)
        wait = t.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def median_s(fn) -> float:
            fn()
            wait()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                wait()
                times.append(time.perf_counter() - t0)
            return float(np.median(times))

        def warp_and_draws():
            law = self.law(self.rows(x), scores, warp)
            law.sample(rows, rand)
            return law

        p = warp_and_draws()
        q = p.normalised().roll(1)  # another law over the same cells
        return median_s(warp_and_draws) / (rows * vocab), median_s(lambda: self._residual_mass(p.normalised(), q, 0.5)) / (
            rows * vocab)

    # -- tensors --------------------------------------------------------------------------------------
    def _tensor(self, a):
        t = self.torch
        if hasattr(a, "row") and not isinstance(a, (t.Tensor, np.ndarray)):  # rows read in place (backends.unique)
            return _InPlace(self, a)
        x = a if isinstance(a, t.Tensor) else t.from_numpy(np.ascontiguousarray(a))
        return x.to(device=self.device, dtype=self.dtype)

    _host = staticmethod(host_rows)  # a tensor's cells on the host

    def _norms(self, x):
        """(row maxima (0 for an all -inf row), normalisers, e, its block sums, e's shift): e = exp(x - shift) on the
        device, the rest on the host. e is the rows' softmax (one fused kernel, faster than a separate exp on a
        CPU), so shift = max - log(the softmax's largest cell), exp(0) scaled as every other cell; the normaliser
        is shift + log(float64 sum of e's float32 block sums), relative error ~1e-7 whatever the kernel's own
        float32 sum. Rows with no finite cell take exp(x - max) instead (a softmax of them is NaN)."""
        top = self._host(x.amax(dim=1)).astype(np.float64)
        m = np.where(np.isfinite(top), top, 0.0)
        if not np.isfinite(top).all():  # a softmax of a row with no finite cell is NaN: exp(x - max), 0 there
            e, eb = self._exp_blocks(x, m, 1.0)
            shift = m
        else:
            e = self.torch.softmax(x, dim=1)
            eb = self._block_sums(e)
            with np.errstate(divide="ignore"):
                shift = m - np.log(self._host(e.amax(dim=1)).astype(np.float64))
        with np.errstate(divide="ignore"):
            return m, shift + np.log(eb.sum(axis=1)), e, eb, shift

    def _exp_blocks(self, x, m: np.ndarray, inv_t: float):
        """e = exp((x - m) / T) [n, V] and its float64 sums over each row's CDF_BLOCK-cell blocks [n, blocks]."""
        t = self.torch
        e = t.sub(x, t.as_tensor(m, dtype=self.dtype, device=x.device)[:, None])
        if inv_t != 1.0:
            e.mul_(inv_t)
        e.exp_()
        return e, self._block_sums(e)

    def _block_sums(self, x) -> np.ndarray:
        """Float64 sums of consecutive CDF_BLOCK-cell blocks along the last axis (a row's last block may be short):
        [rows, blocks] for an [rows, N] tensor, [blocks] for a flat one."""
        t = self.torch
        rows = x if x.dim() == 2 else x.reshape(1, -1)
        n, size = int(rows.shape[0]), int(rows.shape[1])
        full = size // CDF_BLOCK
        parts = []
        if full:
            step = rows.stride(1)
            parts.append(rows.as_strided((n, full, CDF_BLOCK), (rows.stride(0), CDF_BLOCK * step, step),
                                         rows.storage_offset()).sum(dim=2))
        if size > full * CDF_BLOCK:
            parts.append(rows[:, full * CDF_BLOCK:].sum(dim=1, keepdim=True))
        sums = self._host(t.cat(parts, dim=1) if len(parts) > 1 else parts[0]).astype(np.float64)
        return sums if x.dim() == 2 else sums.reshape(-1)

    def _cells_at(self, flat, idx: np.ndarray) -> np.ndarray:
        """A flat tensor's cells at idx, float64 on the host."""
        return self._host(flat[self.torch.as_tensor(idx, device=flat.device)]).astype(np.float64)

    def _draws(self, law: TorchLaw, u: np.ndarray, replace: bool) -> tuple[np.ndarray, np.ndarray]:
        """The law's keys for the uniforms u by the inverse CDF over its block sums, then one block's cells: each
        draw from the whole law (replace) or from what the earlier draws left (their cells 0, their masses out of
        their blocks); and each drawn cell's value."""
        blocks = law.blocks().copy()
        zero: dict[int, float] = {}
        keys, values = [], []
        total = float(blocks.sum())
        for t in u:
            k = _icdf(law, blocks, zero, t * (total if replace else float(blocks.sum())))
            v = law.cell(k)
            if not replace:
                zero[k] = 0.0
                blocks[law.block_of(k)] -= v
            keys.append(k)
            values.append(v)
        return np.array(keys, dtype=np.int64), np.array(values)

    def _scaled(self, e, scale: np.ndarray):
        """Flat float32 cells e[r, t] * scale[r] (a law's probabilities)."""
        return (e * self._tensor(scale)[:, None]).view(-1)

    def _stack(self, rows):
        """Rows (1-d tensors) as one [n, V] tensor, copied."""
        return self.torch.stack(rows)

    def _argmax(self, row) -> int:
        """A row's first largest cell."""
        return int(self.torch.argmax(row))

    def _residual(self, p, q, s: float):
        """Flat cells max(p - s q, 0) (p itself at s = 0)."""
        return p if s == 0.0 else self.torch.sub(p, q, alpha=s).clamp_min_(0.0)

    def _residual_mass(self, p, q, s: float) -> float:
        """M(s) = sum over cells of max(p - s q, 0): one fused pass of add, clamp and a (cascaded) sum."""
        d = self.torch.add(p, q, alpha=-s) if s != 0.0 else p.clone()
        return float(d.clamp_min_(0.0).sum())

    def _residual_blocks(self, p, q, s: float):
        """(float64 block sums, the cells as `_FlatCells`) of max(p - s q, 0), for draws from it."""
        cells = self._residual(p, q, s)
        return self._block_sums(cells), _FlatCells(self, cells)

    def _top_cells(self, e, rows: np.ndarray, s: np.ndarray, k: int):
        """Candidates for the k cells of e's rows `rows` worth most, worth e * s (float32 products, s float32 [rows]):
        (positions in rows, tokens, worths as float64), holding every cell worth more than the k-th and enough
        of those worth as much. The cells above a cut, lowered until k of them outweigh every cell left out
        (`_head`)."""
        e = e if rows.size == int(e.shape[0]) else e[self.torch.as_tensor(rows, device=e.device)]

        def worth(r, cells):
            return (cells * s[r]).astype(np.float64)  # float32 products, as `p`

        sub = self._host(e[:, ::_SUB])
        levels = _levels(worth(np.arange(rows.size)[:, None], sub), k, every=0.0)
        r, tok, cells = self._head(e, worth, lambda level: np.minimum(level / s, 1.0).astype(np.float32), levels, k)
        return r, tok, worth(r, cells)

    def _head(self, x, worth, cut, levels: Sequence[float], need: int):
        """The cells of the [r, V] tensor x at or above a per-row cut, lowered level by level until `need` of the
        cells taken are worth more than any cell left out: `worth(rows, cells)` is float64 and monotone in the
        cell, `cut(level)` the [r] float32 cuts, and the last level takes every cell. One compare pass a level,
        no sort. Returns (rows, tokens, cells) on the host."""
        every = np.arange(int(x.shape[0]))
        for i, level in enumerate(levels):
            c = cut(level)
            rows, toks, cells = self._at_least(x, c)
            if i == len(levels) - 1 or np.count_nonzero(worth(rows, cells) > worth(every, c).max()) >= need:
                return rows, toks, cells

    def _at_least(self, x, c: np.ndarray):
        """(rows, tokens, cells) on the host of the cells of [r, V] x at or above their row's cut c."""
        if x.device.type == "cpu":  # numpy's compare and flatnonzero on the same memory: ~3x torch's on a CPU
            xn = x.numpy()
            rows, toks = np.divmod(np.flatnonzero(xn >= c[:, None]), xn.shape[1])
            return rows, toks, xn[rows, toks]
        return self._at_least_where_they_lie(x, c)

    def _at_least_where_they_lie(self, x, c: np.ndarray):
        """The same with torch's compare and nonzero on x's own device (a GPU's rows stay there; three arrays of
        the cells taken come back)."""
        t = self.torch
        idx = t.nonzero(x >= t.as_tensor(c, device=x.device)[:, None])
        return self._host(idx[:, 0]), self._host(idx[:, 1]), self._host(x[idx[:, 0], idx[:, 1]])

    # -- the interface --------------------------------------------------------------------------------
    def reads(self, device) -> bool:
        """Whether rows a runtime computes on `device` are read there in place: the same device (a CUDA device
        without an index is the current one)."""
        d = self.torch.device(device)
        if d.type != self.device.type:
            return False
        if d.type != "cuda":
            return True
        current = self.torch.cuda.current_device()
        return (d.index if d.index is not None else current) == (
            self.device.index if self.device.index is not None else current)

    def rows(self, logits) -> TorchLogProbs:
        return TorchLogProbs(self, self._tensor(logits))

    def stack(self, refs: Sequence[LogProbRow]) -> TorchLogProbs:
        whole = _one_result(refs)
        if whole is not None:
            return whole
        x = self._stack([r.src.x[r.i] for r in refs])
        if not any(r.i in r.src._norm for r in refs):  # none normalised yet: one pass for all, its e kept for the law
            out = TorchLogProbs(self, x)
            out._fill()
            for j, r in enumerate(refs):
                r.src._norm.setdefault(r.i, out._norm[j])
            return out
        for r in refs:
            r.src.lse(r.i)
        out = TorchLogProbs(self, x, {j: r.src._norm[r.i] for j, r in enumerate(refs)})
        if all(r.src.e is not None for r in refs):
            out.e = self._stack([r.src.e[r.i] for r in refs])
            out.eb = np.stack([r.src.eb[r.i] for r in refs])
            out.shift = np.array([r.src.shift[r.i] for r in refs])
        return out

    def law(self, rows: TorchLogProbs, scores, warp: Warp):
        """The warped joint of rows x V with raw row scores (spec §2.1); -inf scores mark invalid parents."""
        s = np.asarray(scores, dtype=np.float64)
        valid = np.isfinite(s)
        if not valid.any():
            raise ValueError("no valid (parent, token) pair: every entry of z is -inf")
        lse = np.where(valid, rows.lse_all(), 0.0)
        inv_t = 1.0 / warp.temperature
        m = rows.max_all()
        x = rows.whole()
        if 0 < warp.top_k < x.shape[1] * np.count_nonzero(valid):
            return self._top_k(x, s - lse, valid, warp)
        if inv_t == 1.0:
            if rows.e is None:
                _, _, rows.e, rows.eb, rows.shift = self._norms(x)
            e, eb, base = rows.e, rows.eb, rows.shift  # e = exp(x - base)
        else:  # x / T rounds a large logit too coarsely for a softmax: the exp of x - max, then scaled
            e, eb = self._exp_blocks(x, m, inv_t)  # exp((x - m) / T), once: the row sums and the law's cells
            base = m * inv_t
        with np.errstate(divide="ignore"):
            row_lse = base + np.log(eb.sum(axis=1))  # log sum_t exp(x_t / T)
        if warp.top_p < 1.0:
            return self._top_p(x, s - lse, valid, warp, row_lse)
        w = np.where(valid, (s - lse) * inv_t + row_lse, -np.inf)  # log mass of each row
        w_max = w[valid].max()
        log_z = w_max + math.log(float(np.exp(w[valid] - w_max).sum()))
        c = (s - lse) * inv_t - log_z  # p = exp(x / T + c) = e * exp(c + base)
        scale = np.where(valid, np.exp(np.where(valid, c + base, 0.0)), 0.0)
        return TorchLaw(self, scale, e, eb, rows.origin)

    def _top_k(self, x, off, valid, warp: Warp) -> NumpyLaw:
        """top-k (then top-p within it): every cell of the valid rows above a cut in z = x + off that k cells clear
        (`_head`, ties at the cut included), then the reference warp on those candidates."""
        V, vrows = int(x.shape[1]), np.flatnonzero(valid)
        off = off[vrows]
        xv = x if vrows.size == int(x.shape[0]) else x[self.torch.as_tensor(vrows, device=x.device)]

        def worth(r, cells):
            return (cells.astype(np.float64) + off[r]) / warp.temperature  # the order warp_entries cuts by

        sub = self._host(xv[:, ::_SUB]).astype(np.float64) + off[:, None]  # z of one cell in _SUB
        r, tok, cells = self._head(xv, worth, lambda level: (level - off).astype(np.float32),
                                   _levels(sub, warp.top_k, every=-np.inf), warp.top_k)
        z = cells.astype(np.float64) + off[r]
        ok = np.isfinite(z)
        keys, z = (vrows[r] * V + tok)[ok].astype(np.int64), z[ok]
        order = np.argsort(keys)
        return NumpyLaw(warp_entries(keys[order], z[order], V, warp))

    def _top_p(self, x, off, valid, warp: Warp, row_lse: np.ndarray) -> NumpyLaw:
        """top-p alone: each valid row's largest cells (a row's order does not depend on its score), a head grown
        until it holds top_p of the whole support's mass, then the reference warp on it."""
        t = self.torch
        V, vrows = int(x.shape[1]), np.flatnonzero(valid)
        off = off[vrows]
        w = off * (1.0 / warp.temperature) + row_lse[vrows]  # log of each row's sum of exp(z / T)
        k = TOP_P_HEAD
        while True:
            kk = min(V, k + 8)  # a few more: ties at the cut go to the lower key
            vals, idx = t.topk(x[t.as_tensor(vrows, device=x.device)], kk, dim=1)
            keys = (vrows[:, None] * V + self._host(idx)).reshape(-1).astype(np.int64)
            z = (self._host(vals).astype(np.float64) + off[:, None]).reshape(-1)
            ok = np.isfinite(z)
            keys, z = keys[ok], z[ok]
            order = np.argsort(keys)
            keys, z = keys[order], z[order]
            top = z.max() / warp.temperature
            head_total = float(np.exp(w - top).sum())
            law = warp_entries(keys, z, V, warp, head_total=head_total)
            # complete unless the cut reached a row's last candidate (a longer head could hold more of it)
            if kk == V or np.bincount(law.keys // V).max() < kk:
                return NumpyLaw(law)
            k = 8 * k

    def on_rows(self, q, parents: Sequence[Sequence[int]], counts: Sequence[int]):
        """q_rows(i, t) = (sum of q(j, t) over row i's parents j) / counts_i (spec §16.2), as an [n, V] tensor."""
        if isinstance(q, NumpyLaw):
            return _REF.on_rows(q, parents, counts)
        t = self.torch
        total = q.total()
        out = t.empty((len(parents), q.vocab), dtype=self.dtype, device=q._e.device)
        for i, (js, m) in enumerate(zip(parents, counts)):
            first = True
            for j in js:
                if q._scale[j] > 0:  # q's cells are e * scale: one pass per parent, no [n, V] product
                    a = float(q._scale[j]) / (m * total)
                    if first:  # 0 + a e, written once
                        t.mul(q._e[j], a, out=out[i])
                    else:
                        out[i].add_(q._e[j], alpha=a)
                    first = False
            if first:
                out[i].zero_()
        return _QRows(self, out)

    def _pair(self, p: "TorchLaw", q) -> "_Pair":
        """The verifiers' cells of p (normalised) and q on its rows, with the residual's passes over them."""
        return _Pair(self, p.normalised(), q.flat)

    def chain(self, p, q, n: int):
        if isinstance(p, NumpyLaw):
            return _REF.chain(p, q, n)
        return _Chain(self, p, q, n)

    def verify(self, chain, drafts: Sequence[Draft], width: int, rand: Rand) -> tuple[bool, Outputs]:
        """Sequential MSS with reset (spec §5 step 4) on the closed-form chain, or the reference's."""
        return mss(chain, drafts, width, rand)

    def verify_without(self, p, q, drafts: Sequence[DraftWOR], width: int, rand: Rand) -> tuple[bool, Outputs]:
        if isinstance(p, NumpyLaw):
            return _REF.verify_without(p, q, drafts, width, rand)
        return _without(self, p, q, drafts, width, rand)

    def distinct_keys(self, p, n: int, rand: Rand) -> list[int]:
        if isinstance(p, NumpyLaw):
            return draw_without_replacement(p.joint, n, rand)
        return [int(k) for k in p.distinct(n, rand)[0]]


def _one_result(refs: Sequence[LogProbRow]):
    """The `rows(...)` result whose rows refs are, all of them in order; None where they are not."""
    srcs = [r.src for r in refs]
    if all(s is srcs[0] for s in srcs) and [r.i for r in refs] == list(range(len(srcs[0]))):
        return srcs[0]
    return None


class _InPlace:
    """[n, V] logits read in place (`backends.unique.Rows`), as TorchLogProbs indexes them: a row is a tensor
    view of it, several rows a copy; only the rows a decoder reads are ever touched."""

    def __init__(self, tm: TorchRows, rows) -> None:
        self.tm, self.rows, self.shape = tm, rows, tuple(rows.shape)

    def _t(self, a):
        x = a if isinstance(a, self.tm.torch.Tensor) else self.tm.torch.from_numpy(a)  # device rows stay put
        return x.to(device=self.tm.device, dtype=self.tm.dtype)

    def block(self):
        """Every row as one tensor on the runtime's buffer (no copy on a CPU), or None where they are scattered."""
        b = self.rows.block()
        return None if b is None else self._t(b)

    def __getitem__(self, i):
        if isinstance(i, tuple):
            return float(self.rows.row(int(i[0]))[int(i[1])])
        if isinstance(i, slice):
            return self._t(self.rows.take(range(*i.indices(self.shape[0]))))
        if isinstance(i, (list, np.ndarray)):
            return self._t(self.rows.take(i))
        return self._t(self.rows.row(int(i)))


class _QRows:
    """A layer's q_beam on the target rows: [n, V] cells (sums <= 1 over valid parents)."""

    def __init__(self, tm: TorchRows, q) -> None:
        self.tm, self.q = tm, q
        self.flat = q.view(-1)

    def lookup(self, keys) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        ok = (keys >= 0) & (keys < self.flat.shape[0])
        out = np.zeros(keys.shape)
        if ok.any():
            idx = self.tm.torch.as_tensor(keys[ok], device=self.flat.device)
            out[ok] = self.tm._host(self.flat[idx]).astype(np.float64)
        return out


class _Pair:
    """p's normalised cells and q's on the same rows, flat float32 tensors: the residual max(p - s q, 0) read by
    `_Chain` and `_without` (its mass, its block sums and cells for a draw, single cells)."""

    def __init__(self, tm: TorchRows, pn, qf) -> None:
        self.tm, self.pn, self.qf = tm, pn, qf
        self.n_cells = int(pn.shape[0])

    def pq(self, k: int) -> tuple[float, float]:
        return float(self.pn[k]), float(self.qf[k])

    def mass(self, s: float) -> float:
        return self.tm._residual_mass(self.pn, self.qf, s)

    def blocks(self, s: float):
        """(float64 block sums, cells with `block_of`, `segment`, `value`, `dense`) of max(p - s q, 0)."""
        return self.tm._residual_blocks(self.pn, self.qf, s)

    def p_dense(self) -> np.ndarray:
        return self.tm._host(self.pn).astype(np.float64)


class _FlatCells:
    """A flat tensor's cells in consecutive CDF_BLOCK-cell blocks, read one block at a time."""

    def __init__(self, tm: TorchRows, flat) -> None:
        self.tm, self.flat = tm, flat

    def block_of(self, k: int) -> int:
        return k // CDF_BLOCK

    def segment(self, b: int) -> tuple[int, np.ndarray]:
        lo = b * CDF_BLOCK
        return lo, self.tm._host(self.flat[lo: lo + CDF_BLOCK]).astype(np.float64)

    def value(self, k: int) -> float:
        return float(self.flat[k])

    def dense(self) -> np.ndarray:
        """Every cell, float64 on the host (the tests' enumerators)."""
        return self.tm._host(self.flat).astype(np.float64)


def _icdf(cells, blocks: np.ndarray, override: dict[int, float], t: float) -> int:
    """The cell i with F(i-1) <= t < F(i), F the running sum of the cells (`cells.segment(b)`: a block's first cell
    and float64 cells, in key order) with the cells in `override` replaced by their values (`blocks`: the block
    sums, already net of the overrides); zero cells are never chosen."""
    blocks = blocks.copy()
    while True:
        cb = np.cumsum(blocks)
        b = min(int(cb.searchsorted(t, side="right")), blocks.size - 1)
        while b > 0 and blocks[b] <= 0:  # rounding past the end: the last block with mass
            b -= 1
        lo, seg = cells.segment(b)
        for k, v in override.items():
            if lo <= k < lo + seg.size:
                seg[k - lo] = v
        pos = np.flatnonzero(seg > 0)
        if pos.size:
            break
        blocks[b] = 0.0  # a block whose sum is rounding only
        t = min(t, float(blocks.sum()) * (1 - 1e-16))
    x = t - (cb[b - 1] if b else 0.0)
    i = int(np.cumsum(seg).searchsorted(x, side="right"))
    if i >= seg.size:  # past the block's running sum by rounding: its last positive cell
        i = int(pos[-1])
    return lo + i


class _Chain:
    """The with-replacement residual chain in closed form: R[c] = max(p - s_c q, 0) / Z_c (spec §16.10), grown only
    as far as the verifier and the width rule read it (each step is one pass over the rows)."""

    def __init__(self, tm: TorchRows, p: TorchLaw, q: _QRows, n: int) -> None:
        self.tm, self.p, self.q, self.n = tm, p, q, n
        self.s, self.Z = [0.0], [1.0]
        self._alpha: list[float] = []
        self._blocks: dict[int, tuple] = {}
        self._pair = None

    @property
    def cells(self) -> "_Pair":
        """p's and q's cells, as the backend reads them (formed at the first read)."""
        if self._pair is None:
            self._pair = self.tm._pair(self.p, self.q)
        return self._pair

    def _grow(self, c: int) -> None:
        """s_c and Z_c (and alpha up to c - 1): alpha_j = 1 - M(s_j + Z_j) / Z_j, M(s) = sum max(p - s q, 0)."""
        while len(self.s) <= c:
            s = self.s[-1] + self.Z[-1]
            mass_u = self.cells.mass(s)
            mass = mass_u / self.Z[-1]
            self._alpha.append(min(1.0, max(0.0, 1.0 - mass)))
            if mass < RESIDUAL_EPS:
                self.s.append(0.0)
                self.Z.append(1.0)
            else:
                self.s.append(s)
                self.Z.append(mass_u)

    def alphas(self, j: int) -> np.ndarray:
        """The first j acceptance chances (the width rule's input)."""
        self._grow(j)
        return np.array(self._alpha[:j])

    @property
    def alpha(self) -> np.ndarray:
        return self.alphas(self.n)

    def value(self, c: int, key: int) -> float:
        if not 0 <= key < self.cells.n_cells:
            return 0.0
        self._grow(c)
        pv, qv = self.cells.pq(key)
        if self.s[c] == 0.0:
            return pv / self.Z[c]
        return max(pv - self.s[c] * qv, 0.0) / self.Z[c]

    def _cells(self, c: int):
        """(float64 block sums, cells) of R[c] unnormalised, formed once per c and only where a draw reads them."""
        self._grow(c)
        if c not in self._blocks:
            self._blocks[c] = self.cells.blocks(self.s[c])
        return self._blocks[c]

    def draw(self, c: int, rand: Rand) -> int:
        blocks, cells = self._cells(c)
        if not _is_seeded(rand):
            S = np.flatnonzero(self.cells.p_dense() > 0)
            r = cells.dense()[S]
            return int(rand.categorical(S, r / r.sum()))
        return _icdf(cells, blocks, {}, rand.rng.random() * float(blocks.sum()))


def _without(tm: TorchRows, p: TorchLaw, q: _QRows, drafts: Sequence[DraftWOR], width: int,
             rand: Rand) -> tuple[bool, Outputs]:
    """Recursive rejection without replacement (spec §16.5), `sampling.verify_layer_without_replacement` in
    closed form. With u = the current target r times its mass Zu, every cell holds u(i) = max(p(i) - tau_i q(i), 0)
    (0 for cells already output): tau_i = tau, the run's threshold, for cells no draft has drawn; for a drawn cell the
    threshold it had when its draft was tested (q_j excludes it afterwards). A rejection of draft j adds Zu / rest_j
    to tau; an acceptance, or a residual below RESIDUAL_EPS, resets tau to 0 (r = p over the cells not output)."""
    if not 1 <= width == p.at_most(width):
        raise ValueError(f"width must be in 1..{len(p)} (pairs in supp(p)), got {width}")
    run = _Without(tm, p, q)
    for j, d in enumerate(drafts):
        if len(run.out) == width:
            break
        run.test(j, d, width, rand)
    if len(run.out) == width:
        return True, run.out
    # correction: one draw from r; fills: sequential draws from p over the cells not output
    run.emit(_draw_u(run.pair, run.tau, run.frozen, run.output_keys, rand), None)
    while len(run.out) < width:
        run.emit(_draw_u(run.pair, 0.0, {}, run.output_keys, rand), None)
    return False, run.out


class _Without:
    """The state of one `_without` run: the outputs, the drawn cells' thresholds, tau and Zu."""

    def __init__(self, tm: TorchRows, p: TorchLaw, q: _QRows) -> None:
        self.pair = tm._pair(p, q)
        self.n_cells = self.pair.n_cells
        self._cache: dict[int, tuple[float, float]] = {}
        self.out: Outputs = []
        self.output_keys: set[int] = set()
        self.frozen: dict[int, float] = {}  # drawn cell -> its threshold
        self.tau = 0.0
        self.p_out = 0.0  # mass of p on the cells output
        self.zu = self.left_mass()

    def cell(self, k: int) -> tuple[float, float]:
        v = self._cache.get(k)
        if v is None:
            v = self._cache[k] = self.pair.pq(k) if 0 <= k < self.n_cells else (0.0, 0.0)
        return v

    def pv(self, k: int) -> float:
        return self.cell(k)[0]

    def qv(self, k: int) -> float:
        return self.cell(k)[1]

    def u(self, k: int, at: float) -> float:
        if k in self.output_keys or not 0 <= k < self.n_cells:
            return 0.0
        return max(self.pv(k) - self.frozen.get(k, at) * self.qv(k), 0.0)

    def left_mass(self) -> float:  # p's mass on the cells not output (p normalised)
        return 1.0 - self.p_out

    def mass_at(self, t: float) -> float:  # sum of u over every cell with the run's threshold t
        pv, qv = self.pv, self.qv
        z = self.pair.mass(t)
        for k in self.output_keys:
            z -= max(pv(k) - t * qv(k), 0.0)
        for k, f in self.frozen.items():
            if k not in self.output_keys:
                z += max(pv(k) - f * qv(k), 0.0) - max(pv(k) - t * qv(k), 0.0)
        return max(z, 0.0)

    def reset(self) -> None:
        for k in self.frozen:
            self.frozen[k] = 0.0
        self.tau, self.zu = 0.0, self.left_mass()

    def emit(self, key: int, draft: int | None) -> None:
        self.out.append((int(key), draft))
        self.output_keys.add(int(key))
        self.p_out += self.pv(int(key))

    def test(self, j: int, d: DraftWOR, width: int, rand: Rand) -> None:
        """Draft j's test: accept it (tau resets) or reject it (tau rises, or resets on a tiny residual)."""
        if not d.qval > 0 or not d.rest > 0:
            raise ValueError(f"draft {j} has q {d.qval} and undrawn mass {d.rest}; a drawn pair needs both > 0")
        k = int(d.key)
        inside = 0 <= k < self.n_cells and self.pv(k) > 0
        r = self.u(k, self.tau) / self.zu if inside else 0.0
        if d.valid and inside and r > 0 and rand.bernoulli(min(1.0, r * d.rest / d.qval)):
            self.emit(k, j)
            if len(self.out) < width:
                self.reset()
        else:
            t_new = self.tau + self.zu / d.rest
            z_new = self.mass_at(t_new)
            if z_new / self.zu >= RESIDUAL_EPS:
                self.tau, self.zu = t_new, z_new
            else:
                self.reset()
        if inside and k not in self.frozen:
            self.frozen[k] = self.tau  # q_j subtracted at this cell up to now; later drafts exclude it


def _draw_u(pair: _Pair, tau: float, frozen: dict[int, float], output_keys: set[int], rand: Rand) -> int:
    """One draw from u / zu, u(i) = max(p(i) - tau_i q(i), 0) with the drawn cells' thresholds and output cells 0."""
    n_cells = pair.n_cells
    blocks, cells = pair.blocks(tau)
    override: dict[int, float] = {}
    for k, f in frozen.items():
        if f != tau and 0 <= k < n_cells:
            pv, qv = pair.pq(k)
            override[k] = max(pv - f * qv, 0.0)
    for k in output_keys:
        if 0 <= k < n_cells:
            override[k] = 0.0
    if not _is_seeded(rand):
        host = cells.dense()
        for k, v in override.items():
            host[k] = v
        S = np.flatnonzero(pair.p_dense() > 0)
        r = host[S]
        return int(rand.categorical(S, r / r.sum()))
    for k, v in override.items():
        blocks[cells.block_of(k)] += v - cells.value(k)
    blocks = np.maximum(blocks, 0.0)
    return _icdf(cells, blocks, override, rand.rng.random() * float(blocks.sum()))
