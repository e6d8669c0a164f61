"""Dynamic layer width (spec §6): the law of the acceptance count and the threshold rule.

alpha_j = chance that the j-th draft since the last acceptance is accepted (from `sampling.residual_chain`,
one residual step per j, the chain the verifier walks). Each acceptance resets p' to p_beam, so the drafts after
it face alpha_1, alpha_2, ... afresh; that renewal structure makes the DP below exact.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

# Slack on the threshold so t = P(>= K) computed with rounding still admits K.
TAIL_TOL = 1e-12


def acceptance_count_table(alpha: Sequence[float]) -> np.ndarray:
    """P [m+1, m+1]: P[n, k] = P(k of the first n drafts accepted), testing without stopping."""
    a = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)  # [m]; sums of min(r, q) may exceed 1 by ulps
    m = a.size
    surv = np.concatenate(([1.0], np.cumprod(1.0 - a)))  # [m+1] surv[n] = P(first n all rejected)
    first = a * surv[:m]  # [m] first[i] = P(first acceptance at draft i+1)
    P = np.zeros((m + 1, m + 1))  # [n, k]
    P[:, 0] = surv
    for n in range(1, m + 1):
        for k in range(1, n + 1):
            # first acceptance at draft i, then k-1 more among the remaining n-i drafts (renewal)
            P[n, k] = sum(first[i - 1] * P[n - i, k - 1] for i in range(1, n + 1))
    return P


def acceptance_count_law(alpha: Sequence[float]) -> np.ndarray:
    """[m+1]: P(k of all m drafts accepted), k = 0..m: row P[m, :] of `acceptance_count_table`, one column at a
    time (column k is column k-1 convolved with the first-acceptance law), O(m^2) in numpy instead of O(m^3)
    Python steps; equal to the table up to summation order (tests/test_rowmath.py)."""
    a = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
    m = a.size
    surv = np.concatenate(([1.0], np.cumprod(1.0 - a)))  # [m+1]
    first = a * surv[:m]  # [m]
    col = surv  # P[:, 0]
    law = np.empty(m + 1)
    law[0] = col[m]
    for k in range(1, m + 1):
        col = np.concatenate(([0.0], np.convolve(first, col)[:m]))  # P[n, k] = sum_i first[i-1] P[n-i, k-1]
        law[k] = col[m]
    return law


def tail_probabilities(alpha: Sequence[float]) -> np.ndarray:
    """[m+1]: tail[K] = P(at least K of the m drafts accepted); tail[W_L] is the layer's pass probability."""
    law = acceptance_count_law(alpha)
    return 1.0 - np.concatenate(([0.0], np.cumsum(law[:-1])))  # sum from k = 0 (the paper once wrote k = 1)


def _rule_k(alpha: Sequence[float], t: float) -> int:
    """max{K : P(at least K of the drafts accepted) >= t}; 0 for no drafts."""
    tail = tail_probabilities(alpha)  # [m+1], tail[0] = 1 so K >= 0 always exists
    return int(np.flatnonzero(tail >= t - TAIL_TOL).max())


def choose_width(alpha: Sequence[float], t: float, w_min: int, w_max: int) -> int:
    """W_L = clamp(max{K : P(at least K accepted) >= t}, w_min, w_max) (spec §6)."""
    if w_min > w_max:
        raise ValueError(f"w_min ({w_min}) must not exceed w_max ({w_max})")
    return min(w_max, max(w_min, _rule_k(alpha, t)))


def layer_width(alphas: Callable[[int], Sequence[float]], m: int, t: float, w_min: int, w_max: int) -> int:
    """`choose_width(alphas(m), t, w_min, w_max)`, reading only as many leading alphas as decide it (on the device
    backends each alpha costs a pass over the layer's rows). With K_j the rule's K on the first j drafts, the K of
    all m lies in [K_j, K_j + m - j]: the count among m drafts is at least the count among the first j and at most
    m - j more, path by path. So a fixed width (w_min = w_max) reads none, and a likely layer stops at W_max."""
    if w_min > w_max:
        raise ValueError(f"w_min ({w_min}) must not exceed w_max ({w_max})")
    j = 0
    while True:
        k = _rule_k(alphas(j), t) if j else 0
        lo, hi = min(w_max, max(w_min, k)), min(w_max, max(w_min, k + m - j))
        if lo == hi:
            return lo
        j = min(m, max(w_max, j + max(1, j // 2)))
