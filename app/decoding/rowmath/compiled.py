"""The CPU default: `tensors.TorchRows`'s algorithms with every pass over whole rows in a compiled kernel.

The torch backend spends its time on the number of passes (max, softmax, a block-sum pass, a second max, float64
widening) and on per-op dispatch, not on arithmetic. Here each of those is one kernel of `kernels.py` over the
rows where they lie (a torch CPU tensor and its numpy view share memory): a row's maximum, then one fused pass
that writes e = exp(x - max) and sums it in float64 blocks of CDF_BLOCK cells; a residual max(p - s q, 0) is
summed block by block without being written, and a draw reads only the block its uniform falls in. Everything
else (laws, chains, draws, without replacement) is the torch backend's code, so the two differ only in
float32 rounding (spec §16.10), and the tests hold both to the reference.
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np

from ..sampling import CDF_BLOCK, Rand, SeededRand, Warp
from . import kernels
from .tensors import TORCH_CELL_SECONDS, TorchRows

log = logging.getLogger(__name__)

# The forest policy's prices (warp and draws, one chain step, per cell): torch's, divided by what
# scripts/measure_rowmath.py timed for compiled against torch on 4 Qwen-sized rows in one run on a 2-core EPYC
# (1.57x and 1.75x; docs/measurements/rowmath.md).
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
        bit for bit, in two compiled calls and the law's few numpy steps on one value a row. None where the general
        path must run: a truncated warp, a rand other than the seeded stream, a row set with no valid parent or a
        row without finite mass, fewer blocks holding mass than distinct draws."""
        if type(rand) is not SeededRand or warp.top_p < 1.0:
            return None
        row = getattr(logits, "row", None)  # rows read in place (backends.unique.Rows)
        whole = logits if row is None else (logits.block() if hasattr(logits, "block") else None)
        if whole is None:
            whole = logits.take(range(len(logits)))
        x = np.ascontiguousarray(whole, dtype=np.float32)
        s = np.asarray(scores, dtype=np.float64)
        valid = np.isfinite(s)
        if x.ndim != 2 or not valid.any() or 0 < warp.top_k < x.shape[1] * np.count_nonzero(valid):
            return None
        step = getattr(self._scratch, "rows", None)
        if step is None or step.shape != x.shape:
            step = self._scratch.rows = kernels.RowsStep(*x.shape)
        inv_t = 1.0 / warp.temperature
        m, s1, s_t = step.law(x, inv_t)
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
        keys = step.draw(x, m, inv_t, scale, rand.rng.random(n), replace)
        vocab, out = x.shape[1], []
        for k in keys.tolist():
            r, t = divmod(k, vocab)
            out.append((r, t, float((x[r] if row is None else row(r))[t]) - float(lse_rows[r])))
        return out

    @staticmethod
    def _np(x) -> np.ndarray:
        """A CPU tensor's numpy view (shared memory; the kernels make any other layout C-contiguous float32)."""
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)

    def _norms(self, x):
        """(row maxima (0 for a row with no finite cell), normalisers, e = exp(x - max), e's block sums, the
        shift (the maxima)): one read for the maxima, one fused exp-and-block-sum pass."""
        xn = self._np(x)
        e = self.torch.empty(xn.shape, dtype=self.dtype)
        eb = np.empty((xn.shape[0], kernels.blocks(xn.shape[1])))
        m = kernels.norms(xn, e.numpy(), eb)
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

    def _scaled(self, e, scale: np.ndarray):
        out = self.torch.empty(int(e.shape[0]) * int(e.shape[1]), dtype=self.dtype)
        kernels.scaled(self._np(e), np.asarray(scale, dtype=np.float64), out.numpy())
        return out

    def _residual_mass(self, p, q, s: float) -> float:
        pn, qn = self._np(p), self._np(q)
        return float(kernels.residual_blocks(pn, qn, float(s), np.empty(kernels.blocks(pn.size))))

    def _residual_blocks(self, p, q, s: float):
        pn, qn = self._np(p), self._np(q)
        blocks = np.empty(kernels.blocks(pn.size))
        kernels.residual_blocks(pn, qn, float(s), blocks)
        return blocks, _ResidualCells(pn, qn, float(s))


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
