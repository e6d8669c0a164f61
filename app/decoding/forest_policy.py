"""Cost-aware forests (issue 13, item 1): before each DSBD iteration pick the draft depth gamma and the drafts
per layer W_S (gamma = 0: no draft, one plain beam-sampling step, spec R2) with the most expected beam steps
per second:

    rate(g, W_S) = E[steps | g, W_S] / (C_target(n_roots + W_S g) + C_draft(n_draft_roots) + (g - 1) C_draft(W_S))
    E[steps]     = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g          (a_l: P(layer l passes | it is verified))

C are the engine's timed pass costs (app.engine.auto.CostCurve). a_l(W_S) models a layer the way the width DP of spec
§6 does, with two acceptance rates per depth: beta1 for a draft tested against p_beam (the first of the layer
and each one after an acceptance) and betaR for a draft tested after a rejection in a row (against the
residual, which q rarely hits again: drafts drawn with replacement repeat q's favourite pairs). Then

    W_L = clamp(max{K : P(>= K of W_S accepted) >= t}, W_min, W),   a_l(W_S) ~ P(>= W_L of W_S accepted)

shrunk toward what this answer saw at (depth l, that W_S): (passed + k model) / (verified + k). beta1, betaR
are this answer's counts at depth l (invalid-parent drafts count as rejections) shrunk toward depth l - 1's
rates (depth 1: the priors, beta1 = 0.66 = app.engine.auto.PRIOR_ACCEPTANCE, betaR = 0.15). The per-(depth, W_S)
counts correct what the two-rate model gets wrong within a few layers.

Exactness: the choice reads only earlier iterations' counts, the fixed cost curves and the context (live beams,
budget); given the past, an iteration is an exact DSBD iteration with that (gamma, W_S) (Theorems 1-3 hold for
any past-determined gamma and W_S >= W), so the output law is unchanged. The choice is deterministic, so a seed
reproduces an answer given the same cost curves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

PRIOR = 0.66  # beta1 prior: app.engine.auto.PRIOR_ACCEPTANCE (sum(min(p, q)) of the qwen-coder pair); kept equal by a test
PRIOR_RETRY = 0.15  # betaR prior: qwen-coder chat (docs/measurements/qwen-auto-chat.json): 82% of depth-1 layers passed,
#                     60% of tested drafts accepted, mostly at the first try
STRENGTH = 4.0  # pseudo-observations behind each prior: a handful of layers outweigh it


def count_law(beta1: float, beta_retry: float, ws: int) -> list[float]:
    """P(k of ws drafts accepted), k = 0..ws, when a draft is accepted w.p. beta1 after an acceptance (or first)
    and beta_retry after a rejection: the §6 recursion with alpha = (beta1, beta_retry, beta_retry, ...)."""
    law = {(0, True): 1.0}  # (accepted so far, next draft is a first try) -> probability
    for _ in range(ws):
        nxt: dict = {}
        for (k, first), pr in law.items():
            a = beta1 if first else beta_retry
            nxt[(k + 1, True)] = nxt.get((k + 1, True), 0.0) + pr * a
            nxt[(k, False)] = nxt.get((k, False), 0.0) + pr * (1 - a)
        law = nxt
    out = [0.0] * (ws + 1)
    for (k, _), pr in law.items():
        out[k] += pr
    return out


def layer_pass(beta1: float, beta_retry: float, ws: int, t: float, w_min: int, w: int) -> float:
    """P(a layer of ws drafts accepts its width), the width from the §6 rule on the same acceptance law."""
    law = count_law(beta1, beta_retry, ws)
    tail = [sum(law[k:]) for k in range(ws + 1)]  # tail[K] = P(>= K accepted)
    k = max(K for K in range(ws + 1) if tail[K] >= t - 1e-12)
    width = min(w, max(w_min, k))
    return tail[width] if width <= ws else 0.0


@dataclass
class ForestPolicy:
    """Per-generation chooser of (gamma, W_S); `observe` each verified layer, `choose` before each iteration."""

    target_cost: Callable[[int], float]  # seconds of a target pass scoring n tokens
    draft_cost: Callable[[int], float]
    gammas: Sequence[int]  # candidate depths (0 = do not draft)
    widths: Sequence[int]  # candidate W_S (each >= W)
    threshold: float  # t
    min_beams: int  # W_min
    beams: int  # W
    prior: float = PRIOR
    prior_retry: float = PRIOR_RETRY
    strength: float = STRENGTH
    # depth -> [first tries accepted, first tries, retries accepted, retries]
    depth_draws: dict[int, list[int]] = field(default_factory=dict)
    layer_runs: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (depth, W_S) -> [passed, verified]
    chosen: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def for_params(cls, params, target_cost, draft_cost, **kw) -> "ForestPolicy":
        """Candidates: gamma in 0..params.gamma and W_S in W..params.draft_beams (the user's are the maxima,
        so memory plans and context checks sized for them still hold)."""
        return cls(target_cost, draft_cost, gammas=tuple(range(params.gamma + 1)),
                   widths=tuple(range(params.beams, params.draft_beams + 1)), threshold=params.threshold,
                   min_beams=params.min_beams, beams=params.beams, **kw)

    # -- estimates -------------------------------------------------------------------------------------
    def draft_rates(self, depth: int) -> tuple[float, float]:
        """(beta1, betaR) at this depth, each shrunk toward the shallower depth's (depth 1: the priors)."""
        c1, cr = (self.prior, self.prior_retry) if depth <= 1 else self.draft_rates(depth - 1)
        a1, n1, ar, nr = self.depth_draws.get(depth, (0, 0, 0, 0))
        k = self.strength
        return (a1 + k * c1) / (n1 + k), (ar + k * cr) / (nr + k)

    def pass_rate(self, depth: int, ws: int) -> float:
        model = layer_pass(*self.draft_rates(depth), ws, self.threshold, self.min_beams, self.beams)
        passed, seen = self.layer_runs.get((depth, ws), (0, 0))
        return (passed + self.strength * model) / (seen + self.strength)

    def expected_steps(self, g: int, ws: int) -> float:
        steps, run = 1.0, 1.0
        for depth in range(1, g + 1):
            run *= self.pass_rate(depth, ws)
            steps += run
        return steps

    def seconds(self, g: int, ws: int, *, roots: int, draft_roots: int) -> float:
        """One iteration: the target pass over roots + the forest, and g draft passes."""
        if g == 0:
            return self.target_cost(roots)
        return self.target_cost(roots + ws * g) + self.draft_cost(draft_roots) + (g - 1) * self.draft_cost(ws)

    def rate(self, g: int, ws: int, *, roots: int, draft_roots: int) -> float:
        return self.expected_steps(g, ws) / self.seconds(g, ws, roots=roots, draft_roots=draft_roots)

    # -- choice and learning ---------------------------------------------------------------------------
    def choose(self, *, max_gamma: int, roots: int, draft_roots: int) -> tuple[int, int]:
        """(gamma, W_S) with the best rate; gamma capped by the budget. Ties keep the smaller forest."""
        best, best_rate = None, -1.0
        for g in sorted({min(g, max_gamma) for g in self.gammas}):
            for ws in sorted(self.widths) if g > 0 else sorted(self.widths)[:1]:
                r = self.rate(g, ws, roots=roots, draft_roots=draft_roots)
                if r > best_rate * (1 + 1e-12):
                    best, best_rate = (g, ws), r
        self.chosen.append(best)
        return best

    def observe(self, depth: int, ws: int, *, outcomes: Sequence[bool], passed: bool) -> None:
        """One verified layer: the accept (True) / reject outcome of each draft it consumed, in draw order
        (invalid-parent drafts are rejections), and whether the layer passed."""
        d = self.depth_draws.setdefault(depth, [0, 0, 0, 0])
        first = True
        for ok in outcomes:
            i = 0 if first else 2
            d[i] += int(ok)
            d[i + 1] += 1
            first = bool(ok)
        r = self.layer_runs.setdefault((depth, ws), [0, 0])
        r[0] += int(passed)
        r[1] += 1
