"""The row math's interface: what the decoders call, whichever backend computes it (spec §2, §5, §16.5, §16.10).

    rm = rowmath.backend()                  # the process's backend (`__init__`)
    rows = rm.rows(logits)                  # raw log-probs: one normaliser per row, computed when first read
    p = rm.law(rows, scores, warp)          # the warped joint over (row, token): p_beam, or q_beam (spec §2.1)
    p.sample(n, rand); p.distinct(n, rand)  # i.i.d. draws; sequential draws without replacement (+ masses left)
    q_on = rm.on_rows(q, parents, counts)   # a layer's q_beam mapped onto the target's rows (spec §16.2)
    chain = rm.chain(p, q_on, n)            # the residual chain: acceptance chances, R[c](key), draws from R[c]
    rm.verify(chain, drafts, width, rand)   # MSS with reset over the layer (spec §5 step 4, `sampling.mss`)
    rm.verify_without(p, q_on, drafts, width, rand)   # recursive rejection without replacement (spec §16.5)
    rm.plain_step(logits, score, warp, rand)  # optional (compiled): one row's law, draw and log-prob, fused
    rm.beam_step(logits, scores, warp, rand, n, replace)  # optional (compiled): n draws over several rows, fused

Keys are flat: row * V + token. Uniforms come from `rand` in the reference's order, one per decision.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..sampling import Chain, Draft, DraftWOR, Rand, Warp

Outputs = list[tuple[int, int | None]]  # a layer's slots: (key, index of the accepted draft, or None for a draw)


class LogProbs(Protocol):
    """Raw log-probs of [n, V] logits, each row normalised when first read."""

    def __len__(self) -> int: ...

    def at(self, row: int, token: int) -> float: ...

    def row(self, i: int): ...  # a `reference.LogProbRow`: what a beam keeps of its target row

    def dense(self, i: int) -> np.ndarray: ...  # one row's float64 log-probs

    def argmax(self, i: int) -> int: ...  # row i's likeliest token, ties to the lower id


class Law(Protocol):
    """A warped joint over (row, token) pairs: p_beam or q_beam."""

    vocab: int

    def __len__(self) -> int: ...  # the support's size

    def at_most(self, n: int) -> int: ...  # min(n, support size)

    def lookup(self, keys) -> np.ndarray: ...  # float64 probabilities of flat keys (0 outside the support)

    def sample(self, n: int, rand: Rand) -> np.ndarray: ...  # n i.i.d. keys, one uniform each

    def distinct(self, n: int, rand: Rand) -> tuple[np.ndarray, np.ndarray]: ...  # without replacement, masses left

    def profile(self, tiny: float) -> tuple[np.ndarray, float]: ...  # probabilities >= tiny, mass of the rest

    def top(self, k: int) -> np.ndarray: ...  # the k likeliest keys, descending, ties by lower key


class ResidualChain(Chain, Protocol):
    """`sampling.Chain` (R[c](key), a draw from R[c]) plus the width rule's acceptance chances."""

    def alphas(self, j: int) -> np.ndarray: ...


class RowMath(Protocol):
    """A backend: the reference (`reference.NumpyRows`), torch where the rows lie (`tensors.TorchRows`), or the
    compiled CPU kernels (`compiled.CompiledRows`)."""

    name: str
    cell_seconds: tuple[float, float]  # the forest policy's prices: warp and draws, one chain step, per cell

    def reads(self, device) -> bool: ...  # whether a runtime's rows on `device` are read there in place

    def rows(self, logits) -> LogProbs: ...

    def stack(self, refs: Sequence) -> LogProbs: ...

    def law(self, rows: LogProbs, scores, warp: Warp) -> Law: ...

    def on_rows(self, q: Law, parents: Sequence[Sequence[int]], counts: Sequence[int]): ...

    def chain(self, p: Law, q, n: int) -> ResidualChain: ...

    def verify(self, chain: ResidualChain, drafts: Sequence[Draft], width: int,
               rand: Rand) -> tuple[bool, Outputs]: ...

    def verify_without(self, p: Law, q, drafts: Sequence[DraftWOR], width: int,
                       rand: Rand) -> tuple[bool, Outputs]: ...

    def distinct_keys(self, p: Law, n: int, rand: Rand) -> list[int]: ...
