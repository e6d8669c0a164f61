"""Cost-aware forests: before each DSBD iteration pick the draft depth gamma and the drafts per layer W_S
(gamma = 0: no draft, one plain beam-sampling step, spec R2), and the lookup nodes per layer, with the most
expected beam steps per second (spec §16.4).

Calls (the decoder's; every keyword after the first three is optional, so older callers keep working):

    policy = ForestPolicy.for_params(params, target_cost, draft_cost, *, known=None, explore=0, seen=0,
                                     verify_cost=0.0, step_cost=0.0)
    g, ws = policy.choose(max_gamma=g, roots=n, draft_roots=m, q_rows=None)
    g, ws, lookups = policy.choose(max_gamma=g, roots=n, draft_roots=m, q_rows=None, with_lookups=True)
    policy.observe(depth, ws, outcomes=[bool, ...], passed=bool, by_cache=None, distinct=None, lookups=0,
                   verify_s=None)

    roots, draft_roots  distinct query tokens of the iteration's roots in the target / draft pass
    q_rows              probabilities of the latest drafted layer's joint q_beam (any shape, flattened; its
                        support is enough, e.g. after top-k): how peaked q is, hence how many of W_S drafts
                        drawn with replacement are distinct (one pass over it per call, ~20 ms for 4 x 152k)
    by_cache            the layer passed by the cache rule (spec §16.2) and not by acceptance (None: unknown,
                        counted as acceptance, the meaning `passed` always had)
    distinct            distinct (parent, token) content keys among the layer's W_S drafts
    lookups, verify_s   the layer's lookup nodes (spec §16.3); seconds the verifier spent on the layer
    params.replacement  "with" (default) | "without" (spec §16.5: all W_S drafts of a layer are distinct)
    params.lookup_nodes the most lookup nodes per layer (default 0); params.cache_rule (default: True) sets
                        the prior chance of a cache pass; observed by_cache counts teach it either way

The rate of a forest (g, W_S, L lookup nodes per layer):

    rate    = E[steps] / (C_target(roots + sum_l (D_l + L)) + C_draft(draft_roots) + sum_{l<g} C_draft(D_l)
                          + v(W_S) E[verified layers] + s)
    E[steps] = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g,     E[verified layers] = 1 + a_1 + ... + a_1 ... a_{g-1}

D_l is the expected number of DISTINCT drafts of layer l (the unique-path runtimes score each content key
once): W_S without replacement; with replacement sum over pairs of 1 - (1 - q)^W_S on q_rows' profile (deeper
layers draw from the distinct parents, each as peaked as the layers before), shrunk toward the distinct counts
observed at (depth, W_S). v is the verifier's seconds per verified layer (observed verify_s per W_S, else
`verify_cost`; `decoder_costs` gives priors from the measured decoder time), plus `step_cost` per iteration.
a_l is P(layer l passes):

    a_l = b_l + (1 - b_l) c_l(L)        b_l: P(pass by acceptance),  c_l(L): P(pass by the cache | not)

b_l(W_S) models a layer as the width DP of spec §6 does, with two acceptance rates per depth: beta1 for a
draft tested against p_beam (the first of the layer and each one after an acceptance) and betaR for one tested
after a rejection in a row (against the residual, which q rarely hits again with replacement):

    W_L = clamp(max{K : P(>= K of W_S accepted) >= t}, W_min, W),   b_l(W_S) ~ P(>= W_L of W_S accepted)

shrunk toward what was seen at (depth l, that W_S): (passed + k model) / (verified + k). beta1, betaR are the
counts at depth l (invalid-parent drafts count as rejections) shrunk toward depth l - 1's rates (depth 1: the
priors, beta1 = 0.66 = app.engine.auto.PRIOR_ACCEPTANCE, betaR = 0.15). c_l(L) is shrunk from the observed
cache passes toward depth l - 1's (depth 1: 1 - (1 - c0)(1 - h)^L), and never falls as L grows: a lookup node
can only add hits.

Learning across answers: the counts live in an `Acceptance` (the engine keeps one per model pair and setting,
hands a decayed copy to each answer's policy as `known`, and stores the answer's counts back). `explore` > 0:
while fewer than `explore` layers were ever observed for the pair (`seen` before this answer plus this
answer's), draft with the cheapest drafted forest, so a policy whose prior says "do not draft" still finds out.

Exactness: the choice reads only earlier iterations' counts, the fixed cost curves and the context (live beams,
budget, earlier layers' q); given the past, an iteration is an exact DSBD iteration with that (gamma, W_S, L)
(Theorems 1-3 hold for any past-determined gamma and W_S >= W), so the output law is unchanged. Without
verify_s the choice is deterministic, so a seed reproduces an answer given the same cost curves and counts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

from app.config import ACCEPTANCE_PRIOR as PRIOR  # beta1 prior: sum(min(p, q)) of the qwen-coder pair
PRIOR_RETRY = 0.15  # betaR prior: qwen-coder chat (docs/measurements/qwen-auto-chat.json): 82% of depth-1 layers passed,
#                     60% of tested drafts accepted, mostly at the first try
STRENGTH = 4.0  # pseudo-observations behind each prior: a handful of layers outweigh it
PRIOR_CACHE = 0.3  # P(cache pass | acceptance failed) with the cache rule on: qwen-coder, code 0.48, chat 0.16
PRIOR_LOOKUP_HIT = 0.05  # each lookup node's chance to turn a failed layer into a cache pass (a guess; learnt)
CARRY = 64.0  # most pseudo-observations a carried count keeps: recent answers outweigh a long session
_TINY = 1e-4  # q entries below this count as ws * q distinct draws (1 - (1 - q)^ws ~ ws q)


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


def expected_distinct(q, ws: int, *, replacement: bool = True) -> float:
    """E[distinct pairs among ws draws from the probabilities q] (spec §16.4): sum of 1 - (1 - q)^ws with
    replacement; without it, ws capped by the support."""
    import numpy as np

    q = np.asarray(q, dtype=np.float64).ravel()
    q = q[q > 0]
    if q.size == 0:
        return float(ws)
    q = q / q.sum()
    if not replacement:
        return float(min(ws, q.size))
    big = q[q >= _TINY]
    return float(np.sum(1.0 - (1.0 - big) ** ws) + ws * (1.0 - big.sum()))


# The decoder's own time, measured on qwen-coder (W = 4, |V| = 151,936; docs/measurements/decoder-time.md): about
# 14 ms per verified layer with top-k 20 (log-softmax and the joint warp over W x |V| cells dominate) and 26 ms
# with top-k off (the residual chain runs over all cells). Scaled per (beam, token) cell for other shapes.
_WARP_S_PER_CELL = 0.014 / (4 * 151_936)
_CHAIN_S_PER_CELL = 0.012 / (4 * 151_936)


def decoder_costs(params, vocab: int) -> dict:
    """Priors for `verify_cost` (seconds per verified layer) and `step_cost` (per iteration) from the measured
    decoder time, for a target vocabulary of `vocab` ids; observed verify_s replace the first."""
    cells = params.beams * vocab
    warp = cells * _WARP_S_PER_CELL
    return {"verify_cost": warp + (0.0 if params.top_k else cells * _CHAIN_S_PER_CELL), "step_cost": warp}


def setting_key(params) -> tuple:
    """What acceptance counts depend on besides the model pair: the law, the widths and the warp."""
    return (params.mode, str(getattr(params, "replacement", "with") or "with"), params.beams, params.min_beams,
            params.threshold, params.temperature, params.top_k, params.top_p)


def _mean(pair, prior: float, k: float) -> float:
    hit, n = pair
    return (hit + k * prior) / (n + k)


@dataclass
class Acceptance:
    """What a policy learns, as counts: carried across the answers of one model pair and setting."""

    # depth -> [first tries accepted, first tries, retries accepted, retries]
    depth_draws: dict[int, list[float]] = field(default_factory=dict)
    # (depth, W_S) -> [passed (by acceptance, or by either rule where by_cache was not reported), verified]
    layer_runs: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # (depth, W_S, lookups) -> [passed by the cache rule, layers that did not pass by acceptance]
    cache_runs: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)
    distinct: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (depth, W_S) -> [sum, layers]
    verify: dict[int, list[float]] = field(default_factory=dict)  # W_S -> [seconds, layers]
    layers: int = 0  # verified layers ever observed

    def carried(self, cap: float = CARRY) -> "Acceptance":
        """A copy whose every count keeps at most `cap` observations (proportions unchanged)."""
        out = copy.deepcopy(self)
        for table, n_at in ((out.depth_draws, (1, 3)), (out.layer_runs, (1,)), (out.cache_runs, (1,)),
                            (out.distinct, (1,)), (out.verify, (1,))):
            for row in table.values():
                for i in n_at:  # row[i] counts observations, row[i - 1] what they summed to
                    if row[i] > cap:
                        f = cap / row[i]
                        row[i - 1] *= f
                        row[i] *= f
        return out


@dataclass
class ForestPolicy:
    """Chooser of (gamma, W_S[, lookups]); `observe` each verified layer, `choose` before each iteration."""

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
    replacement: bool = True  # drafts drawn with replacement (spec §4) or without (§16.5)
    lookups: Sequence[int] = (0,)  # candidate lookup nodes per layer
    cache_rule: bool = False  # the decoder passes layers by the cache rule: sets c's prior
    verify_cost: float | Callable[[int], float] = 0.0  # seconds per verified layer of W_S drafts (prior)
    step_cost: float = 0.0  # seconds every iteration pays outside the passes (its output step's warp), gamma 0 too
    explore: int = 0  # draft the cheapest forest until this many layers were observed for the pair
    seen: int = 0  # layers observed for the pair before this policy
    known: Acceptance = field(default_factory=Acceptance)  # the counts (a carried copy, then this answer's too)
    chosen: list[tuple[int, int]] = field(default_factory=list)
    lookups_chosen: list[int] = field(default_factory=list)
    setting: object = None  # the caller's key for `known` (the engine's (model pair, setting_key))

    @classmethod
    def for_params(cls, params, target_cost, draft_cost, **kw) -> "ForestPolicy":
        """Candidates: gamma in 0..params.gamma, W_S in W..params.draft_beams, lookup nodes 0..params.lookup_nodes
        (the user's are the maxima, so memory plans and context checks sized for them still hold)."""
        kw.setdefault("replacement", str(getattr(params, "replacement", "with") or "with") != "without")
        kw.setdefault("lookups", tuple(range(int(getattr(params, "lookup_nodes", 0) or 0) + 1)))
        kw.setdefault("cache_rule", bool(getattr(params, "cache_rule", True)))  # the decoder always applies it
        return cls(target_cost, draft_cost, gammas=tuple(range(params.gamma + 1)),
                   widths=tuple(range(params.beams, params.draft_beams + 1)), threshold=params.threshold,
                   min_beams=params.min_beams, beams=params.beams, **kw)

    # Read-only views kept for callers that inspect the counts directly.
    @property
    def depth_draws(self) -> dict:
        return self.known.depth_draws

    @property
    def layer_runs(self) -> dict:
        return self.known.layer_runs

    @property
    def observed(self) -> int:
        """Layers observed for the pair: before this policy and by it."""
        return self.seen + self.known.layers - self._start_layers

    def __post_init__(self) -> None:
        self._start_layers = self.known.layers
        self._profile: dict[int, float] = {}  # W_S -> E[distinct] on the latest q_rows

    # -- estimates -------------------------------------------------------------------------------------
    def draft_rates(self, depth: int) -> tuple[float, float]:
        """(beta1, betaR) at this depth, each shrunk toward the shallower depth's (depth 1: the priors)."""
        c1, cr = (self.prior, self.prior_retry) if depth <= 1 else self.draft_rates(depth - 1)
        a1, n1, ar, nr = self.known.depth_draws.get(depth, (0, 0, 0, 0))
        k = self.strength
        return (a1 + k * c1) / (n1 + k), (ar + k * cr) / (nr + k)

    def acceptance_pass(self, depth: int, ws: int) -> float:
        """b_l: P(the layer passes by acceptance)."""
        model = layer_pass(*self.draft_rates(depth), ws, self.threshold, self.min_beams, self.beams)
        return _mean(self.known.layer_runs.get((depth, ws), (0, 0)), model, self.strength)

    def cache_pass(self, depth: int, ws: int, lookups: int = 0) -> float:
        """c_l(L): P(the layer passes by the cache rule | not by acceptance), shrunk toward depth l - 1's
        (depth 1: the prior); never lower for more lookups."""
        best = 0.0
        for n in sorted(set(self.lookups) | {0, lookups}):
            if n > lookups:
                break
            if depth <= 1:
                c0, h = (PRIOR_CACHE, PRIOR_LOOKUP_HIT) if self.cache_rule else (0.0, 0.0)
                model = 1 - (1 - c0) * (1 - h) ** n
            else:
                model = self.cache_pass(depth - 1, ws, n)
            best = max(best, _mean(self.known.cache_runs.get((depth, ws, n), (0, 0)), model, self.strength))
        return best

    def pass_rate(self, depth: int, ws: int, lookups: int = 0) -> float:
        b = self.acceptance_pass(depth, ws)
        return b + (1 - b) * self.cache_pass(depth, ws, lookups)

    def distinct_drafts(self, depth: int, ws: int) -> float:
        """D_l: expected distinct content keys among the layer's ws drafts."""
        model = self._profile.get(ws, float(ws))
        if not self.replacement:
            return model
        seen = self.known.distinct.get((depth, ws)) or self.known.distinct.get((1, ws))
        return min(float(ws), _mean(seen, model, self.strength)) if seen else model

    def set_profile(self, q_rows) -> None:
        """Price distinct drafts on this q (the latest drafted layer's joint): once per W_S candidate, since q
        may hold W x |V| entries."""
        import numpy as np

        q = np.asarray(q_rows, dtype=np.float64).ravel()
        q = q[q > 0]
        if q.size == 0:
            self._profile = {}
            return
        q /= q.sum()
        big = q[q >= _TINY]  # the rest counts ws * q (expected_distinct's rule): one pass over q in all
        if not self.replacement:
            self._profile = {ws: float(min(ws, q.size)) for ws in set(self.widths)}
        else:
            rest = 1.0 - big.sum()
            self._profile = {ws: float(np.sum(1.0 - (1.0 - big) ** ws) + ws * rest) for ws in set(self.widths)}

    def verify_seconds(self, ws: int) -> float:
        s = self.known.verify.get(ws)
        if s and s[1] > 0:
            return s[0] / s[1]
        return self.verify_cost(ws) if callable(self.verify_cost) else float(self.verify_cost)

    def expected_steps(self, g: int, ws: int, lookups: int = 0) -> float:
        steps, run = 1.0, 1.0
        for depth in range(1, g + 1):
            run *= self.pass_rate(depth, ws, lookups)
            steps += run
        return steps

    def seconds(self, g: int, ws: int, *, roots: int, draft_roots: int, lookups: int = 0) -> float:
        """One iteration: the target pass over roots + the distinct forest, g draft passes, the verifier."""
        if g == 0:
            return self.target_cost(roots) + self.step_cost
        distinct = [self.distinct_drafts(d, ws) for d in range(1, g + 1)]
        target = self.target_cost(roots + sum(distinct) + lookups * g)
        drafts = self.draft_cost(draft_roots) + sum(self.draft_cost(d) for d in distinct[:-1])
        verified, run = 0.0, 1.0
        for depth in range(1, g + 1):
            verified += run
            run *= self.pass_rate(depth, ws, lookups)
        return target + drafts + self.step_cost + self.verify_seconds(ws) * verified

    def rate(self, g: int, ws: int, *, roots: int, draft_roots: int, lookups: int = 0) -> float:
        return self.expected_steps(g, ws, lookups) / self.seconds(g, ws, roots=roots, draft_roots=draft_roots,
                                                                  lookups=lookups)

    # -- choice and learning ---------------------------------------------------------------------------
    def choose(self, *, max_gamma: int, roots: int, draft_roots: int, q_rows=None, with_lookups: bool = False):
        """(gamma, W_S) with the best rate, or (gamma, W_S, lookups) with with_lookups; gamma capped by the
        budget. Ties keep the smaller forest. While exploring: the cheapest drafted forest."""
        if q_rows is not None:
            self.set_profile(q_rows)
        widths, looks = sorted(self.widths), sorted(set(self.lookups) or {0})
        gammas = sorted({min(g, max_gamma) for g in self.gammas})
        drafted = [g for g in gammas if g > 0]
        if self.explore and self.observed < self.explore and drafted:
            best = (drafted[0], widths[0], looks[0])
        else:
            best, best_rate = None, -1.0
            for g in gammas:
                for ws in widths if g > 0 else widths[:1]:
                    for n in looks if g > 0 else looks[:1]:
                        r = self.rate(g, ws, roots=roots, draft_roots=draft_roots, lookups=n)
                        if r > best_rate * (1 + 1e-12):
                            best, best_rate = (g, ws, n), r
        self.chosen.append(best[:2])
        self.lookups_chosen.append(best[2])
        return best if with_lookups else best[:2]

    def observe(self, depth: int, ws: int, *, outcomes: Sequence[bool], passed: bool, by_cache: bool | None = None,
                distinct: int | None = None, lookups: int = 0, verify_s: float | None = None) -> None:
        """One verified layer: the accept (True) / reject outcome of each draft it consumed, in draw order
        (invalid-parent drafts are rejections), and whether the layer passed (by either rule)."""
        k = self.known
        d = k.depth_draws.setdefault(depth, [0, 0, 0, 0])
        first = True
        for ok in outcomes:
            i = 0 if first else 2
            d[i] += int(ok)
            d[i + 1] += 1
            first = bool(ok)
        by_acceptance = bool(passed) and not by_cache
        r = k.layer_runs.setdefault((depth, ws), [0, 0])
        r[0] += int(by_acceptance)
        r[1] += 1
        if by_cache is not None and not by_acceptance:
            c = k.cache_runs.setdefault((depth, ws, int(lookups)), [0, 0])
            c[0] += int(bool(passed))
            c[1] += 1
        if distinct is not None:
            s = k.distinct.setdefault((depth, ws), [0, 0])
            s[0] += int(distinct)
            s[1] += 1
        if verify_s is not None:
            v = k.verify.setdefault(ws, [0.0, 0])
            v[0] += float(verify_s)
            v[1] += 1
        k.layers += 1
