"""`auto` mode: pick the decoding mode and its gamma / W_S with the best projected tokens/s ("goodput")
at the quality level the user chose.

    projected tok/s = tau / (C_target(n_t) + sum over the iteration's draft passes of C_draft(n_d))

C(n) is the measured time of one pass scoring n tokens (app.engine.timing: timed once per model file, build,
CPU and thread count and cached on disk, on the engine's first auto or adaptive request, so users who never
pick them pay nothing; piecewise linear between 1, 2, 4, ..., 64 tokens); n_t and the draft passes follow app.config.MODE_FACTS.
tau, the expected tokens per target pass, comes from per-depth layer pass rates a_l (spec §11 with one a per depth):

    tau(gamma) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_gamma      (= (1 - a^(gamma+1)) / (1 - a) for equal a)

The a_l are exponential moving averages over finished generations (observe), per (mode, W, W_S, W_min);
unobserved settings start from a_l = app.config.ACCEPTANCE_PRIOR. A second moving average per
mode, projected / measured seconds per target pass, folds in what the pass model leaves out (sampler and
Python time, fewer live beams). It is per pass, not per returned token, on purpose: a beam mode's answer can
be much shorter than the beam steps it took to settle (on the code suite a 21-token beam-sample answer ran at
1.2 tok/s, a fifth of that mode's median), and that overrun depends on the prompt, not on the mode, so it
would only add noise to the choice between the modes of a level.

Quality levels (config.QUALITY_LEVELS; every candidate of a level keeps the user's T, top-k, top-p, W and t):
    fast     sample, sps(gamma): exact draws from the target's sampling distribution.
    beam     beam-sample (W), dsbd with W_min >= 2: at least two beams at every step, so the output is
             chosen among several sampled continuations. dsbd-mem is NOT here: it carries one beam between
             iterations (spec §9) and measured at sampling quality (log-prob -1.07 vs sample's -0.98 in the
             bench, docs/measurements).
    dynamic  dsbd with W_min = W (gamma 0..6, W_S): W beams at every step, so the output law is beam sampling
             with replacement (spec §11, fixed width) whatever the draft does; the draft only buys speed, and
             gamma = 0 (no draft) is a candidate where drafting does not pay. The bench found no narrower setting
             (smaller t or W_min) at beam sampling's log-prob.
    Without a draft model every level falls back to its draft-free mode (sample, beam-sample).
No exploration: a setting never run keeps its prior until observed (the engine observes every finished
generation, whatever its mode, so earlier turns and bench runs teach it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from app.config import ACCEPTANCE_PRIOR, MODE_FACTS, ConfigError, DecodeParams
from app.config import QUALITY_LEVELS as LEVELS
from app.engine.timing import CostCurve

PRIOR_ACCEPTANCE = ACCEPTANCE_PRIOR
GAMMAS = (1, 2, 3, 4, 5, 6)
EMA = 0.3  # weight of the newest generation: recent turns matter, one odd answer does not flip the choice


def _key(p: DecodeParams) -> tuple:
    return (p.mode, p.beams, p.draft_beams, p.min_beams)


@dataclass
class AutoPolicy:
    """Calibrated pass costs + running acceptance estimates -> the fastest setting of a quality level."""

    target_cost: CostCurve
    draft_cost: CostCurve | None
    rates: dict[tuple, list[float]] = field(default_factory=dict)  # _key -> EMA of pass rate per depth
    efficiency: dict[str, float] = field(default_factory=dict)  # mode -> EMA of projected / measured s per pass
    # (target, draft) app.engine.timing.PassCosts that learn the curves from the answers' passes (timed costs
    # only: a named cost profile prices another machine)
    passes: tuple = ()

    @classmethod
    def from_costs(cls, target_costs: Mapping[int, float], draft_costs: Mapping[int, float] | None = None):
        return cls(CostCurve.of(target_costs), CostCurve.of(draft_costs) if draft_costs else None)

    @classmethod
    def simplest(cls, base: DecodeParams, level: str, *, drafted: bool) -> DecodeParams:
        """A level's first (simplest) candidate: what auto runs while the passes are still being timed."""
        unit = CostCurve.of({1: 1.0})
        return cls(unit, unit if drafted else None).candidates(base, level)[0]

    # -- estimates ---------------------------------------------------------------------------------
    def pass_rates(self, p: DecodeParams, depth: int) -> list[float]:
        """a_1..a_depth for params p: observed where known, the deepest observed (else the prior) beyond."""
        seen = self.rates.get(_key(p), [])
        fill = seen[-1] if seen else PRIOR_ACCEPTANCE
        return [seen[i] if i < len(seen) else fill for i in range(depth)]

    def tokens_per_pass(self, p: DecodeParams) -> float:
        """tau: expected tokens per target pass (1 without a draft)."""
        if not p.uses_draft:
            return 1.0
        tau, run = 1.0, 1.0
        for a in self.pass_rates(p, p.gamma):
            run *= a
            tau += run
        return tau

    def iteration_s(self, p: DecodeParams) -> float:
        n_t, drafts = MODE_FACTS[p.mode].target_tokens(p.beams, p.draft_beams, p.gamma)
        if drafts and self.draft_cost is None:
            raise ConfigError(f"mode {p.mode!r} needs a draft model", field="mode")
        return self.target_cost(n_t) + sum(self.draft_cost(n) for n in drafts)

    def projected_tps(self, p: DecodeParams) -> float:
        return self.efficiency.get(p.mode, 1.0) * self.tokens_per_pass(p) / self.iteration_s(p)

    def learn_passes(self, stats: Mapping) -> None:
        """Fold one answer's timed passes into the curves (timed costs only: `passes` is empty otherwise)."""
        for i, prefix in enumerate(("", "draft_")):
            costs = self.passes[i] if i < len(self.passes) else None
            if costs is not None and costs.observe(stats.get(f"{prefix}passes_by_tokens"),
                                                   stats.get(f"{prefix}pass_s_by_tokens")):
                if i == 0:
                    self.target_cost = costs.curve()
                else:
                    self.draft_cost = costs.curve()

    def observe(self, params: DecodeParams, stats: Mapping) -> None:
        """Fold one finished generation's stats into the estimates (params as run: a concrete mode)."""
        params = params.validated()
        if params.mode == "auto":
            raise ValueError("observe() takes the setting auto picked, not 'auto'")
        self.learn_passes(stats)
        if params.uses_draft and self.draft_cost is None:
            return  # DSBD without a draft model (model-free lookup nodes): not a setting auto picks from
        if params.uses_draft:
            layers = stats.get("acceptance_by_depth") or {}
            new = []
            for d in sorted(layers, key=int):
                L = layers[d]
                if not L.get("attempted"):
                    break
                new.append(L["passed"] / L["attempted"])
            old = self.rates.get(_key(params), [])
            if new:  # average depth by depth; a depth only one side has keeps that side's value
                self.rates[_key(params)] = [
                    (1 - EMA) * old[i] + EMA * new[i] if i < len(old) and i < len(new) else
                    (new[i] if i < len(new) else old[i]) for i in range(max(len(old), len(new)))]
        passes, seconds = stats.get("target_passes") or 0, stats.get("decode_s") or 0.0
        if passes >= 4 and seconds > 0:  # a few passes say little about speed
            ratio = self.iteration_s(params) * passes / seconds
            old = self.efficiency.get(params.mode)
            self.efficiency[params.mode] = ratio if old is None else (1 - EMA) * old + EMA * ratio

    # -- choice --------------------------------------------------------------------------------------
    def candidates(self, base: DecodeParams, level: str) -> list[DecodeParams]:
        """Every setting of a level, validated; drafted modes only with a draft model."""
        if level not in LEVELS:
            raise ConfigError(f"unknown auto level {level!r}; choose one of: {', '.join(LEVELS)}", field="quality")
        w = base.beams
        drafted = self.draft_cost is not None

        def ws_options(mode: str, min_beams: int) -> list[int]:
            # W_S is only offered where it was seen (or is the default W + 1): its acceptance is not modelled.
            seen = {k[2] for k in self.rates if k[0] == mode and k[1] == w and k[3] == min_beams}
            return sorted(seen | {w + 1})

        out: list[DecodeParams] = []
        if level == "fast":
            out.append(replace(base, mode="sample", draft_beams=None))
            if drafted:
                out += [replace(base, mode="sps", gamma=g, draft_beams=None) for g in GAMMAS]
        elif level == "beam":
            wmin = max(2, base.min_beams) if w >= 2 else 1
            out.append(replace(base, mode="beam-sample", draft_beams=None))
            if drafted and w >= 2:
                out += [replace(base, mode="dsbd", gamma=g, draft_beams=ws, min_beams=wmin)
                        for ws in ws_options("dsbd", wmin) for g in GAMMAS]
        elif drafted:  # W_min = W: every layer keeps W beams (narrower settings lost beam quality in the bench)
            out += [replace(base, mode="dsbd", gamma=g, draft_beams=max(ws, w), min_beams=w)
                    for ws in ws_options("dsbd", w) for g in (0, *GAMMAS)]
        else:
            out.append(replace(base, mode="beam-sample", draft_beams=None))
        return [p.validated() for p in out]

    def choose(self, base: DecodeParams, level: str = "fast") -> DecodeParams:
        """The candidate with the best projected tok/s (ties: the earlier, i.e. simpler, one)."""
        return max(self.candidates(base, level), key=self.projected_tps)

    def explain(self, base: DecodeParams, level: str = "fast") -> list[tuple[str, float]]:
        """(setting, projected tok/s) per candidate, best first: for logs and the bench JSON."""
        rows = [(describe(p), self.projected_tps(p)) for p in self.candidates(base, level)]
        return sorted(rows, key=lambda r: -r[1])


def describe(p: DecodeParams) -> str:
    """A bench-style label: 'sps:gamma=4', 'dsbd:gamma=3,draft_beams=5,min_beams=2'."""
    if not p.uses_draft:
        return p.mode
    opts = f"gamma={p.gamma}"
    if p.mode != "sps":
        opts += f",draft_beams={p.draft_beams},min_beams={p.min_beams}"
    return f"{p.mode}:{opts}"

