"""The row math's reference: `sampling.py`'s float64 functions behind the backend interface (`protocols`).

Every other backend is held equal to this one by the tests (exact laws, seeded draws); it also serves the sparse
laws of truncated warps (top-k, top-p) for the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from backends.base import host_rows

from ..sampling import (ArrayChain, Draft, DraftWOR, Joint, Rand, Warp, draw_without_replacement, log_softmax,
                        residual_chain, sample_without_replacement, verify_layer, verify_layer_without_replacement,
                        warp_joint)
from .protocols import Outputs


class NumpyLogProbs:
    """Raw log-probs of [n, V] logits, float64 (today's `log_softmax`)."""

    def __init__(self, logits, lp: np.ndarray | None = None) -> None:
        self._logits = logits
        self._lp = lp

    @property
    def lp(self) -> np.ndarray:
        if self._lp is None:
            self._lp = log_softmax(host_rows(self._logits))  # a runtime's device rows come to the host here
        return self._lp

    def __len__(self) -> int:
        return int(np.shape(self._logits if self._lp is None else self._lp)[0])

    def at(self, row: int, token: int) -> float:
        return float(self.lp[row, token])

    def row(self, i: int) -> "LogProbRow":
        return LogProbRow(self, i)

    def dense(self, i: int) -> np.ndarray:
        return self.lp[i]

    def argmax(self, i: int) -> int:
        """Row i's likeliest token (ties: the lower id)."""
        return int(np.argmax(self.lp[i]))


class NumpyLaw:
    """A `Joint` with the law interface (also the torch backend's law for truncated warps)."""

    def __init__(self, joint: Joint) -> None:
        self.joint = joint
        self.vocab = joint.vocab

    keys = property(lambda self: self.joint.keys)
    probs = property(lambda self: self.joint.probs)

    def __len__(self) -> int:
        return len(self.joint)

    def at_most(self, n: int) -> int:
        """min(n, support size)."""
        return min(n, len(self.joint))

    def lookup(self, keys) -> np.ndarray:
        return self.joint.lookup(keys)

    def sample(self, n: int, rand: Rand) -> np.ndarray:
        return rand.draws(self.joint, n)

    def distinct(self, n: int, rand: Rand) -> tuple[np.ndarray, np.ndarray]:
        return sample_without_replacement(self.joint, n, rand)

    def profile(self, tiny: float) -> tuple[np.ndarray, float]:
        q = self.joint.probs / self.joint.probs.sum()
        big = q[q >= tiny]
        return big, float(1.0 - big.sum())

    def top(self, k: int) -> np.ndarray:
        """Keys of the k likeliest pairs, descending, ties by lower key."""
        q = self.joint
        k = min(k, len(q))
        top = np.argpartition(-q.probs, k - 1)[:k] if k < len(q) else np.arange(len(q))
        return q.keys[top[np.lexsort((q.keys[top], -q.probs[top]))]]


# Seconds per (beam, token) cell, for the forest policy's prices (forest_policy.decoder_costs): the warp with its
# draws, and one residual-chain step of one draft. Measured on Qwen-sized rows, 4 rows, by
# scripts/measure_rowmath.py (docs/measurements/rowmath.md); the numpy figures are the qwen-coder decoder's.
NUMPY_CELL_SECONDS = (0.014 / (4 * 151_936), 0.012 / (5 * 4 * 151_936))


class NumpyRows:
    """The reference backend: `sampling.py`'s float64 functions."""

    name = "numpy"
    device = "cpu"
    cell_seconds = NUMPY_CELL_SECONDS

    def reads(self, device) -> bool:
        """Whether a runtime on `device` should hand its rows over as tensors there: never (host numpy)."""
        return False

    def rows(self, logits) -> NumpyLogProbs:
        return NumpyLogProbs(logits)

    def stack(self, refs: Sequence["LogProbRow"]) -> NumpyLogProbs:
        return NumpyLogProbs(None, np.stack([r.dense() for r in refs]))

    def law(self, rows: NumpyLogProbs, scores, warp: Warp) -> NumpyLaw:
        z = np.asarray(scores, dtype=np.float64)[:, None] + rows.lp  # [n, V] joint raw log-scores
        return NumpyLaw(warp_joint(z, warp))

    def on_rows(self, q: NumpyLaw, parents: Sequence[Sequence[int]], counts: Sequence[int]) -> NumpyLaw:
        """q_rows(i, t) = (sum of q(j, t) over row i's parents j) / counts_i (spec §16.2)."""
        V, qj = q.vocab, q.joint
        par = qj.keys // V
        keys, vals = [], []
        for i, (js, m) in enumerate(zip(parents, counts)):
            if js:
                sel = np.isin(par, js)
                keys.append(i * V + qj.keys[sel] % V)
                vals.append(qj.probs[sel] / m)
        if not keys:
            return NumpyLaw(Joint(np.zeros(0, np.int64), np.zeros(0), V))
        uk, inv = np.unique(np.concatenate(keys), return_inverse=True)  # slots of one content add up
        sums = np.bincount(inv, weights=np.concatenate(vals), minlength=len(uk)).astype(np.float64)  # int64 if empty
        return NumpyLaw(Joint(uk.astype(np.int64), sums, V))

    def chain(self, p: NumpyLaw, q: NumpyLaw, n: int):
        S, R, alpha = residual_chain(p.joint, q.joint, n)
        return _RefChain(S, R, alpha)

    def verify(self, chain, drafts: Sequence[Draft], width: int, rand: Rand) -> tuple[bool, Outputs]:
        return verify_layer(drafts, chain.S, chain.R, width, rand)

    def verify_without(self, p: NumpyLaw, q: NumpyLaw, drafts: Sequence[DraftWOR], width: int,
                       rand: Rand) -> tuple[bool, Outputs]:
        q_S = q.lookup(p.keys) if drafts else np.zeros(len(p))
        return verify_layer_without_replacement(drafts, p.joint, q_S, width, rand)

    def distinct_keys(self, p: NumpyLaw, n: int, rand: Rand) -> list[int]:
        return draw_without_replacement(p.joint, n, rand)


_REF = NumpyRows()  # the torch backend hands sparse (truncated) laws to the reference


@dataclass(frozen=True)
class _RefChain(ArrayChain):
    alpha: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def alphas(self, j: int) -> np.ndarray:
        return self.alpha[:j]


class LogProbRow:
    """One row of a `rows(...)` result: what a beam reads of the target's log-probs after it."""

    __slots__ = ("src", "i")

    def __init__(self, src, i: int) -> None:
        self.src, self.i = src, i

    def __getitem__(self, token):
        if np.ndim(token):
            return self.dense()[token]
        return self.src.at(self.i, int(token))

    def __len__(self) -> int:
        return self.src.vocab if hasattr(self.src, "vocab") else int(np.shape(self.src.lp)[1])

    def dense(self) -> np.ndarray:
        """The whole row, float64 numpy (callers that need every cell)."""
        return self.src.dense(self.i)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.dense()
        return a if dtype is None else a.astype(dtype)

    def __neg__(self) -> np.ndarray:
        return -self.dense()


