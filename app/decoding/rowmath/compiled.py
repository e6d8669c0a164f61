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

import numpy as np

from ..sampling import CDF_BLOCK
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
