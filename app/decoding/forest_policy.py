"""Cost-aware forests: before each DSBD iteration pick the draft depth gamma, the drafts per layer W_S and the
draft model's lookup nodes per layer (gamma = 0: no draft, one plain beam-sampling step), with the most
expected beam steps per second (spec §16.4), on the pass-cost curves of the machine or of a named cost profile.

    policy = ForestPolicy.for_params(params, target_cost, draft_cost, *, known=None, explore=0, seen=0,
                                     verify_cost=0.0, step_cost=0.0)
    g, ws = policy.choose(max_gamma=g, roots=n, draft_roots=m, q_rows=None)
    g, ws, lookups = policy.choose(max_gamma=g, roots=n, draft_roots=m, q_rows=None, with_lookups=True)
    policy.observe(depth, ws, outcomes=[bool, ...], passed=bool, by_cache=None, distinct=None, lookups=0)
    policy.settle(steps)          # after each iteration: the beam steps it advanced

    roots, draft_roots  distinct query tokens of the iteration's roots in the target / draft pass
    q_rows              probabilities of the latest drafted layer's joint q_beam, when it changed (any shape,
                        flattened): how many of W_S drafts drawn with replacement are distinct
    by_cache            the layer passed by the cache rule (spec §16.2) and not by acceptance
    distinct            distinct (parent, token) content keys among the layer's W_S drafts
    lookups             the layer's draft-model lookup nodes (spec §16.3)

The rate of a forest (g, W_S, L lookup nodes per layer):

    rate    = E[steps] / (C_target(roots + sum_l (D_l + L)) + C_draft(draft_roots) + sum_{l<g} C_draft(D_l)
                          + v(W_S) E[verified layers] + s)
    E[steps] = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_g,     E[verified layers] = 1 + a_1 + ... + a_1 ... a_{g-1}

D_l is the expected number of DISTINCT drafts of layer l (the unique-path runtimes score each content key
once): W_S without replacement; with replacement sum over pairs of 1 - (1 - q)^W_S on q_rows' profile, shrunk
toward the distinct counts observed at (depth, W_S). v is the verifier's seconds per verified layer, s the
decoder's seconds per iteration (`decoder_costs`). a_l is P(layer l passes):

    a_l = b_l + (1 - b_l) c_l(L)        b_l: P(pass by acceptance),  c_l(L): P(pass by the cache | not)

b_l(W_S) models a layer as the width DP of spec §6 does, with two acceptance rates per depth: beta1 for a
draft tested against p_beam (the first of the layer and each one after an acceptance) and betaR for one tested
after a rejection in a row; shrunk toward what was seen at (depth l, that W_S). beta1, betaR are the counts at
depth l shrunk toward depth l - 1's (depth 1: the priors, beta1 = config.ACCEPTANCE_PRIOR, betaR = 0.15).
c_l(L) is shrunk from the observed cache passes toward depth l - 1's and never falls as L grows.

Candidates: gamma 0..params.gamma, W_S on a grid from W to params.draft_beams (W, W+1, W+2, then doubling),
L on 0, 1, 2, 4, 8, ... up to params.lookup_nodes (0 unless params.lookup_sources names the draft).

Learning and exploration (spec §16.8): the counts live in an `Acceptance` that the engine keeps per model pair,
setting and cost profile, persists across processes (app/engine/learned.py) and hands, capped, to each
answer's policy as `known`. A policy whose estimate says "do not draft" still finds out, but only within a
budget: while fewer than `explore` layers were ever observed for the pair, it may draft the cheapest forest
that could pay if every layer passed (never one that could not), when the predicted extra time of all its
explorations stays within EXPLORE_SHARE of the time the plain step would have taken for every step advanced so
far over all answers (carried in the counts, so a fresh process continues where the last one stopped), and
within ANSWER_SHARE of this answer's own (so what earlier answers saved up is never spent in one burst).

Exactness: the choice reads only earlier iterations' counts, the fixed cost curves and the context (live beams,
budget, earlier layers' q); given the past, an iteration is an exact DSBD iteration with that (gamma, W_S, L)
(Theorems 1-3 hold for any past-determined gamma and W_S >= W), so the output law is unchanged. The choice reads
no clock (the verifier is priced by `decoder_costs`, never timed), so a seed reproduces an answer given the same
cost curves and counts.
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from app.config import ACCEPTANCE_PRIOR as PRIOR  # beta1 prior: sum(min(p, q)) of the qwen-coder pair
from app.config import MODE_FACTS

from . import rowmath
PRIOR_RETRY = 0.15  # betaR prior: qwen-coder chat (docs/measurements/qwen-auto-chat.json): 82% of depth-1 layers passed,
#                     60% of tested drafts accepted, mostly at the first try
STRENGTH = 4.0  # pseudo-observations behind each prior: a handful of layers outweigh it
PRIOR_CACHE = 0.3  # P(cache pass | acceptance failed) with the cache rule on: qwen-coder, code 0.48, chat 0.16
PRIOR_LOOKUP_HIT = 0.05  # each lookup node's chance to turn a failed layer into a cache pass (a guess; learnt)
CARRY = 64.0  # most pseudo-observations a carried count keeps: recent answers outweigh a long session
EXPLORE_SHARE = 0.015  # exploration may cost at most this share of the plain step's time for the steps advanced
ANSWER_SHARE = 0.05  # and at most this share within one answer (what earlier answers saved is not spent at once)
_TINY = 1e-4  # q entries below this count as ws * q distinct draws (1 - (1 - q)^ws ~ ws q)
GRIDS_KEPT = 64  # candidate grids kept across policies (_SHARED)

# Candidate grids by everything their values read (ForestPolicy._inputs) and their key: each answer's policy is
# new, and its first choices would otherwise rebuild the grids the answer before built from the same counts
# (about 8 ms an answer at the GPU caps). A grid is a pure function of that key, so sharing it changes no choice.
_SHARED: dict[tuple, tuple] = {}
_SHARED_LOCK = threading.Lock()


def count_law(beta1: float, beta_retry: float, ws: int) -> list[float]:
    """P(k of ws drafts accepted), k = 0..ws, when a draft is accepted w.p. beta1 after an acceptance (or first)
    and beta_retry after a rejection: the §6 recursion with alpha = (beta1, beta_retry, beta_retry, ...)."""
    return count_laws(beta1, beta_retry, (ws,))[ws]


def count_laws(beta1: float, beta_retry: float, widths: Sequence[int]) -> dict[int, list[float]]:
    """count_law at each W_S of `widths`, from one recursion: the law of n drafts is its n-th step's."""
    # first[k] / retry[k]: P(k accepted so far, and the next draft is a first try / a retry). Each entry of a
    # step is the sum of at most two products, so the result does not depend on the order it is summed in.
    first, retry, out, last = [1.0], [0.0], {}, max(widths)
    a1, ar = 1 - beta1, 1 - beta_retry
    for n in range(last + 1):
        if n in widths:
            out[n] = [f + r for f, r in zip(first, retry)]
        if n < last:
            first, retry = ([0.0] + [f * beta1 + r * beta_retry for f, r in zip(first, retry)],
                            [f * a1 + r * ar for f, r in zip(first, retry)] + [0.0])
    return out


def layer_pass(beta1: float, beta_retry: float, ws: int, t: float, w_min: int, w: int) -> float:
    """P(a layer of ws drafts accepts its width), the width from the §6 rule on the same acceptance law."""
    return layer_passes(beta1, beta_retry, (ws,), t, w_min, w)[0]


@functools.lru_cache(maxsize=4096)
def layer_passes(beta1: float, beta_retry: float, widths: tuple[int, ...], t: float, w_min: int,
                 w: int) -> tuple[float, ...]:
    """layer_pass at each W_S of `widths` from one count-law recursion. Kept per argument set: the policy asks
    it again every iteration, with the same rates until a drafted layer is learnt."""
    laws = count_laws(beta1, beta_retry, widths)
    out = []
    for ws in widths:
        tail = [sum(laws[ws][k:]) for k in range(ws + 1)]  # tail[K] = P(>= K accepted)
        k = max(K for K in range(ws + 1) if tail[K] >= t - 1e-12)
        width = min(w, max(w_min, k))
        out.append(tail[width] if width <= ws else 0.0)
    return tuple(out)


def expected_distinct(q, ws: int, *, replacement: bool = True) -> float:
    """E[distinct pairs among ws draws from the probabilities q] (spec §16.4): sum of 1 - (1 - q)^ws with
    replacement; without it, ws capped by the support."""
    q = np.asarray(q, dtype=np.float64).ravel()
    q = q[q > 0]
    if q.size == 0:
        return float(ws)
    q = q / q.sum()
    if not replacement:
        return float(min(ws, q.size))
    big = q[q >= _TINY]
    return float(np.sum(1.0 - (1.0 - big) ** ws) + ws * (1.0 - big.sum()))


def decoder_costs(params, vocab: int, rm=None) -> dict:
    """The decoder's own seconds, priced from cell counts: `verify_cost` (per verified layer, by W_S: the target
    side's warp and residual chain over W x |V| cells, the chain one pass per draft, plus the draft side's warp
    over W_S x |V| cells for the layer below) and `step_cost` (per iteration: the output step's warp over the
    rows carried, one in memory mode), for a target vocabulary of `vocab` ids, at the row-math backend's cell
    costs (`rm`, default the process's)."""
    warp, chain = _cell_seconds(rm)
    cells = params.beams * vocab
    carried = (params.beams if MODE_FACTS[params.mode].keeps_rows else 1) * vocab

    def verify_cost(ws: int) -> float:
        return cells * warp + (0.0 if params.top_k else cells * chain * ws) + ws * vocab * warp

    return {"verify_cost": verify_cost, "step_cost": carried * warp}


def lookup_layer_cost(params, vocab: int, rm=None) -> float:
    """The decoder's seconds per verified layer of lookup nodes only (a warp and draws, no residual chain) over
    its rows: W in full mode, the W_min outputs of the layer before in memory mode."""
    rows = params.beams if MODE_FACTS[params.mode].keeps_rows else params.min_beams
    return rows * vocab * _cell_seconds(rm)[0]


def _cell_seconds(rm=None) -> tuple[float, float]:
    """(warp and draws, residual chain per draft) seconds per (beam, token) cell of the row-math backend."""
    return (rm or rowmath.backend()).cell_seconds


def setting_key(params) -> tuple:
    """What acceptance counts depend on besides the model pair: the law, the widths and the warp."""
    return (params.mode, params.replacement, params.beams, params.min_beams, params.threshold, params.temperature,
            params.top_k, params.top_p)


def grid(lo: int, hi: int) -> tuple[int, ...]:
    """Candidate sizes from lo to hi: lo, lo + 1, lo + 2, then doubling, and hi (W_S up to 32 stays ~8 values)."""
    out, v = {lo, hi}, lo
    for step in (1, 2):
        out.add(min(hi, lo + step))
    v = max(lo, 2)
    while v < hi:
        v *= 2
        out.add(min(hi, v))
    return tuple(sorted(x for x in out if lo <= x <= hi))


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
    layers: int = 0  # verified layers ever observed
    plain_s: float = 0.0  # what the plain step would have taken for every step advanced (predicted seconds)
    explore_s: float = 0.0  # the predicted extra seconds every exploration cost (negative where it paid)

    def carried(self, cap: float = CARRY) -> "Acceptance":
        """A copy whose every count keeps at most `cap` observations (proportions unchanged)."""
        out = copy.deepcopy(self)
        for table, n_at in ((out.depth_draws, (1, 3)), (out.layer_runs, (1,)), (out.cache_runs, (1,)),
                            (out.distinct, (1,))):
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
    verify_cost: float | Callable[[int], float] = 0.0  # seconds per verified layer of W_S drafts
    step_cost: float = 0.0  # seconds every iteration pays outside the passes (its output step's warp), gamma 0 too
    explore: int = 0  # draft the cheapest forest until this many layers were observed for the pair
    max_drafts: int | None = None  # gamma x W_S at most (the runtime's sequence ids left after the lookup nodes)
    seen: int = 0  # layers observed for the pair before this policy
    known: Acceptance = field(default_factory=Acceptance)  # the counts (a carried copy, then this answer's too)
    chosen: list[tuple[int, int]] = field(default_factory=list)
    lookups_chosen: list[int] = field(default_factory=list)
    setting: object = None  # the caller's key for `known` (the engine's (model pair, setting_key))

    @classmethod
    def for_params(cls, params, target_cost, draft_cost, **kw) -> "ForestPolicy":
        """Candidates: gamma in 0..params.gamma, W_S on grid(W, params.draft_beams), draft lookup nodes on
        grid(0, params.lookup_nodes) when params.lookup_sources names the draft (the user's are the maxima, so
        memory plans and context checks sized for them still hold). The decoder always applies the cache rule."""
        looks = grid(0, params.lookup_nodes) if "draft" in params.lookup_sources else (0,)
        kw.setdefault("replacement", params.replacement != "without")
        kw.setdefault("lookups", looks)
        kw.setdefault("cache_rule", True)
        return cls(target_cost, draft_cost, gammas=tuple(range(params.gamma + 1)),
                   widths=grid(params.beams, params.draft_beams), threshold=params.threshold,
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
        """Layers observed for the pair: the carried counts' (they include every earlier answer's) and `seen`."""
        return self.seen + self.known.layers

    def __post_init__(self) -> None:
        self._profile: dict[int, float] = {}  # W_S -> E[distinct] on the latest q_rows
        self._rates: dict[tuple[int, int, int], float] = {}  # pass_rate memo, cleared by observe
        # acceptance_pass and cache_pass memo (cache_pass's recursion branches), cleared with _rates
        self._cache_rates: dict[tuple[int, int, int], float] = {}
        self._choice: dict[tuple, tuple] = {}  # choose memo (same counts, profile and context)
        self._fingerprint: tuple | None = None  # _inputs, until the counts or the profile change
        self._exploring: tuple[float, float] | None = None  # (forest seconds, plain seconds) while exploring
        self._plain_step = 0.0  # the latest plain step's predicted seconds
        self._answer = [0.0, 0.0]  # this answer's [plain seconds of its steps, predicted extra of its tries]
    # -- estimates -------------------------------------------------------------------------------------
    def draft_rates(self, depth: int) -> tuple[float, float]:
        """(beta1, betaR) at this depth, each shrunk toward the shallower depth's (depth 1: the priors)."""
        c1, cr = (self.prior, self.prior_retry) if depth <= 1 else self.draft_rates(depth - 1)
        a1, n1, ar, nr = self.known.depth_draws.get(depth, (0, 0, 0, 0))
        k = self.strength
        return (a1 + k * c1) / (n1 + k), (ar + k * cr) / (nr + k)

    def acceptance_pass(self, depth: int, ws: int) -> float:
        """b_l: P(the layer passes by acceptance)."""
        key = (depth, ws, -1)  # beside cache_pass's keys (lookups >= 0) in one memo
        if key not in self._cache_rates:  # every candidate W_S at this depth at once
            widths = tuple(sorted(set(self.widths) | {ws}))
            models = layer_passes(*self.draft_rates(depth), widths, self.threshold, self.min_beams, self.beams)
            for width, model in zip(widths, models):
                self._cache_rates.setdefault((depth, width, -1), _mean(
                    self.known.layer_runs.get((depth, width), (0, 0)), model, self.strength))
        return self._cache_rates[key]

    def cache_pass(self, depth: int, ws: int, lookups: int = 0) -> float:
        """c_l(L): P(the layer passes by the cache rule | not by acceptance), shrunk toward depth l - 1's
        (depth 1: the prior); never lower for more lookups."""
        key = (depth, ws, lookups)
        if key not in self._cache_rates:
            self._cache_columns(depth, ws, lookups)
        return self._cache_rates[key]

    def _cache_columns(self, depth: int, ws: int, lookups: int) -> None:
        """cache_pass at this W_S for every depth up to the deepest candidate (or `depth`) and every candidate
        lookup count (or those up to `lookups`, where it is none of them), depth by depth: a depth's model is the
        shallower depth's value at the same count, and a count's value the best of the counts up to it."""
        counts = set(self.lookups) | {0}
        looks = sorted(counts) if lookups in counts else [n for n in sorted(counts | {lookups}) if n <= lookups]
        c0, h = (PRIOR_CACHE, PRIOR_LOOKUP_HIT) if self.cache_rule else (0.0, 0.0)
        runs, above = self.known.cache_runs, None
        for d in range(1, max(depth, *self.gammas) + 1):
            best, column = 0.0, {}
            for n in looks:
                model = 1 - (1 - c0) * (1 - h) ** n if above is None else above[n]
                best = column[n] = max(best, _mean(runs.get((d, ws, n), (0, 0)), model, self.strength))
            for n, v in column.items():
                self._cache_rates.setdefault((d, ws, n), v)
            above = column

    def pass_rate(self, depth: int, ws: int, lookups: int = 0) -> float:
        key = (depth, ws, lookups)
        a = self._rates.get(key)
        if a is None:
            b = self.acceptance_pass(depth, ws)
            a = self._rates[key] = b + (1 - b) * self.cache_pass(depth, ws, lookups)
        return a

    def distinct_drafts(self, depth: int, ws: int) -> float:
        """D_l: expected distinct content keys among the layer's ws drafts."""
        model = self._profile.get(ws, float(ws))
        if not self.replacement:
            return model
        seen = self.known.distinct.get((depth, ws)) or self.known.distinct.get((1, ws))
        return min(float(ws), _mean(seen, model, self.strength)) if seen else model

    def set_profile(self, q_rows) -> None:
        """Price distinct drafts on this q (the latest drafted layer's joint: probabilities of any shape, or a
        row-math law, which reads only its cells >= _TINY): once per W_S candidate, since q may hold W x |V|
        entries. Without replacement a layer's distinct drafts are min(W_S, support): a law counts that from its
        block sums (`at_most`), with no pass over its cells."""
        if not self.replacement and hasattr(q_rows, "at_most"):
            self._set_profile({ws: float(q_rows.at_most(ws)) for ws in set(self.widths)})
            return
        if hasattr(q_rows, "profile"):
            size = len(q_rows)
            big, rest = q_rows.profile(_TINY) if size else (None, 0.0)
        else:
            q = np.asarray(q_rows, dtype=np.float64).ravel()
            q = q[q > 0]
            size = q.size
            if size:
                q /= q.sum()
                big = q[q >= _TINY]  # the rest counts ws * q (expected_distinct's rule): one pass over q in all
                rest = 1.0 - big.sum()
        if size == 0:
            self._profile = {}
            return
        if not self.replacement:
            self._set_profile({ws: float(min(ws, size)) for ws in set(self.widths)})
        else:
            self._set_profile({ws: float(np.sum(1.0 - (1.0 - big) ** ws) + ws * rest) for ws in set(self.widths)})

    def _set_profile(self, profile: dict[int, float]) -> None:
        """A new distinct-draft profile; the grids are priced again only where it differs (without replacement
        it is min(W_S, support), the same in most iterations)."""
        if profile != self._profile:
            self._forget_grids()
            self._profile = profile

    def verify_seconds(self, ws: int) -> float:
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
        budget. Ties keep the smaller forest. Explores within the budget (module docstring)."""
        if q_rows is not None:
            self.set_profile(q_rows)
        catch_up = self.draft_cost(draft_roots)  # every drafted forest's first draft pass, the same for all
        plain = self._plain_step = self.seconds(0, 0, roots=roots, draft_roots=draft_roots)
        best = self._best(max_gamma, roots, catch_up)
        self._exploring = None
        if best[0] == 0 and self.explore and self.observed < self.explore:
            trial = self._trial(max_gamma, roots, catch_up, plain)
            if trial is not None:
                best, self._exploring = trial
        self.chosen.append(best[:2])
        self.lookups_chosen.append(best[2])
        return best if with_lookups else best[:2]

    def _best(self, max_gamma: int, roots: int, catch_up: float) -> tuple:
        """The first candidate of the grid that no later one beats by more than a relative 1e-12 (a drafted
        one pays the catch-up pass too): the grid's rates in one array operation, and the candidate-by-candidate
        scan only where two rates near the best lie within that tolerance, where the scan's order decides. Once
        the plain step won on a grid, it wins at any dearer catch-up (no drafted rate rises, the plain one is
        fixed), so those choices read nothing."""
        grid = self._grid(max_gamma, roots)
        _, (steps, seconds, drafted), seen = self._choice[self._key(max_gamma, roots)]
        plain = grid[0][0] if grid[0][0][0] == 0 else None  # the one gamma-0 candidate comes first
        if plain is not None and catch_up >= seen.get("plain_from", np.inf):
            # the plain step won at a cheaper catch-up: every drafted rate only fell since, the plain one did not
            return plain
        r = steps / (seconds + drafted * catch_up)
        top = int(np.argmax(r))
        below = r[r < r[top]]
        if np.isfinite(r).all() and (below.size == 0 or below.max() * (1 + 1e-12) < r[top]):
            best = grid[top][0]
        else:
            best, best_rate = None, -1.0
            for forest, rate in zip(grid, r.tolist()):
                if rate > best_rate * (1 + 1e-12):
                    best, best_rate = forest[0], rate
        if best == plain:
            seen["plain_from"] = min(catch_up, seen.get("plain_from", np.inf))
        return best

    def _forget_grids(self) -> None:
        """The counts or the profile changed: every grid is priced again."""
        self._choice.clear()
        self._fingerprint = None

    def _inputs(self) -> tuple | None:
        """Everything a grid's values read besides its key (the costs, the candidates, the laws' settings, the
        counts, the distinct-draft profile), hashable; None where a cost curve is not (its grids stay this
        policy's own)."""
        if self._fingerprint is None:
            k = self.known
            counts = tuple(tuple(sorted((key, tuple(v)) for key, v in table.items()))
                           for table in (k.depth_draws, k.layer_runs, k.cache_runs, k.distinct))
            fp = (self.target_cost, self.draft_cost, self.step_cost, tuple(map(self.verify_seconds, self.widths)),
                  tuple(self.gammas), tuple(self.widths), tuple(self.lookups), self.max_drafts, self.threshold,
                  self.min_beams, self.beams, self.prior, self.prior_retry, self.strength, self.replacement,
                  self.cache_rule, counts, tuple(sorted(self._profile.items())))
            try:
                hash(fp)
            except TypeError:
                fp = ()
            self._fingerprint = fp
        return self._fingerprint or None

    def _key(self, max_gamma: int, roots: int) -> tuple:
        return tuple(sorted({min(g, max_gamma) for g in self.gammas})), roots

    def _grid(self, max_gamma: int, roots: int) -> list[tuple[tuple, float, float]]:
        """Every candidate (gamma, W_S, lookups), smallest first, with its expected steps and its seconds
        less the draft's catch-up pass; memoised until the counts or the profile change (the catch-up is the
        only part that changes every iteration: the draft's unscored suffix grows while it is not run), and
        taken from an earlier policy that priced it from the same inputs (_SHARED)."""
        key = self._key(max_gamma, roots)
        gammas = list(key[0])
        memo = self._choice.get(key)
        inputs = self._inputs() if memo is None else None
        if inputs is not None and (memo := _SHARED.get((inputs, key))) is not None:
            self._choice[key] = memo
        grid = memo[0] if memo is not None else None
        full = self._key(max(self.gammas), roots)
        if grid is None and key != full and set(gammas) <= set(full[0]):
            # a budget that caps gamma (an answer's last tokens): the full grid's candidates up to the cap, the
            # same values (each depth's sums do not read the deeper ones)
            whole = self._grid(max(self.gammas), roots)
            keep = [i for i, (f, _, _) in enumerate(whole) if f[0] in key[0]]
            grid = [whole[i] for i in keep]
            self._choice[key] = (grid, tuple(a[keep] for a in self._choice[full][1]), {})
        if grid is None:
            widths, looks = sorted(self.widths), sorted(set(self.lookups) or {0})
            deep = {(ws, n): sweep for ws in widths for n, sweep in self._depths(ws, looks, roots, gammas[-1]).items()}
            plain = (self.expected_steps(0, 0), self.seconds(0, 0, roots=roots, draft_roots=0))
            grid = [
                ((g, ws, n), *(deep[ws, n][g - 1] if g else plain))
                for g in gammas for ws in (widths if g > 0 else widths[:1]) for n in (looks if g > 0 else looks[:1])
                if self.max_drafts is None or g * ws <= self.max_drafts]
            arrays = (np.array([s for _, s, _ in grid]), np.array([t for _, _, t in grid]),
                      np.array([float(f[0] > 0) for f, _, _ in grid]))
            self._choice[key] = (grid, arrays, {})  # and what choices on it showed (where the plain step wins), the
            #                                         exploration's candidates (_trial)
        if inputs is not None and memo is None:
            with _SHARED_LOCK:
                _SHARED[inputs, key] = self._choice[key]
                while len(_SHARED) > GRIDS_KEPT:  # the oldest first
                    del _SHARED[next(iter(_SHARED))]
        return grid

    def _depths(self, ws: int, looks: Sequence[int], roots: int, top: int) -> dict[int, list[tuple[float, float]]]:
        """For each lookup count n in `looks`: (expected_steps, seconds with draft_roots 0 less the catch-up pass)
        for gamma = 1..top at this W_S, in one sweep over the depths (the same sums, in the same order, as those
        methods); the parts that do not read n are computed once."""
        base, verify = self.draft_cost(0), self.verify_seconds(ws)
        layers = [self.distinct_drafts(depth, ws) for depth in range(1, top + 1)]
        passes = [self.draft_cost(d) for d in layers]
        out = {}
        for n in looks:
            sweep, steps, run, verified, distinct, drafted = [], 1.0, 1.0, 0.0, 0.0, 0.0
            for depth, (d, cost) in enumerate(zip(layers, passes), start=1):
                verified += run
                run *= self.pass_rate(depth, ws, n)
                steps += run
                distinct += d
                target = self.target_cost(roots + distinct + n * depth)
                seconds = target + (base + drafted) + self.step_cost + verify * verified
                sweep.append((steps, seconds - base))
                drafted += cost
            out[n] = sweep
        return out

    def _trial(self, max_gamma: int, roots: int, catch_up: float, plain: float):
        """The forest to explore now, with (its seconds, the plain step's), or None: the cheapest drafted
        forest with the fewest lookups that could pay if every layer passed, if its predicted extra time fits
        the budget."""
        grid = self._grid(max_gamma, roots)
        _, (_, seconds, _), seen = self._choice[self._key(max_gamma, roots)]
        if "trial" not in seen:  # the drafted candidates with the fewest lookups, and gamma + 1 for each
            fewest = min(f[2] for f, _, _ in grid)
            seen["trial"] = (np.array([f[0] > 0 and f[2] == fewest for f, _, _ in grid]),
                             np.array([f[0] + 1.0 for f, _, _ in grid]))
        may, all_pass = seen["trial"]
        s = seconds + catch_up
        pays = may & (all_pass / s > 1.0 / plain * (1 + 1e-9))
        if not pays.any():
            return None
        i = int(np.argmin(np.where(pays, s, np.inf)))  # the cheapest; ties: the first in the grid
        forest, s = grid[i][0], float(s[i])
        extra = s - plain  # the worst case: the forest advances one step, as the plain step would
        k, (plain_s, explore_s) = self.known, self._answer
        if k.explore_s + extra > EXPLORE_SHARE * k.plain_s or explore_s + extra > ANSWER_SHARE * plain_s:
            return None
        return forest, (s, plain)

    def settle(self, steps: int) -> None:
        """After an iteration: the steps it advanced, for the exploration budget."""
        k = self.known
        k.plain_s += steps * self._plain_step
        self._answer[0] += steps * self._plain_step
        if self._exploring is not None:
            seconds, plain = self._exploring
            k.explore_s += seconds - steps * plain
            self._answer[1] += seconds - steps * plain
            self._exploring = None

    def observe(self, depth: int, ws: int, *, outcomes: Sequence[bool], passed: bool, by_cache: bool | None = None,
                distinct: int | None = None, lookups: int = 0) -> None:
        """One verified layer: the accept (True) / reject outcome of each draft it consumed, in draw order
        (invalid-parent drafts are rejections), and whether the layer passed (by either rule)."""
        self._rates.clear()
        self._cache_rates.clear()
        self._forget_grids()
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
        k.layers += 1
