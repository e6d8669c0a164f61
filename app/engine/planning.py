"""Memory plans for model specs: resolve the files (backends.modelfiles.resolution), read their headers
(offload.geometry) and hand the planner plain facts: each decoding mode as a `ModeShape` read from
app.config.MODE_FACTS, the app's limits, what to price. One function per question, whichever edge asks (engine load,
the Models tab, `dsbd-chat plan`); no weights are read.

Fit badges (the Models tab and `dsbd-chat models`): `model_fit(target_geometry, draft_geometry, context=...) -> Fit`
plans a target with a draft and both KV caches at a context exactly as a load would (`memory_plan`'s decoding
settings) on this machine's free VRAM and available RAM: "gpu" (fits in VRAM), "offload" (fits with layers in
RAM), "cpu" (no GPU: fits in RAM), "no" (does not fit; `detail` says what would). `library_fits(entries, ...)`
and `hub_fits(listing, ...)` give one per library entry / per downloadable group of a Hub repo (one header
fetched per repo; other quantizations and split files scaled to their size)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from app.config import ACCEPTANCE_PRIOR, MAX_BEAMS, MAX_GAMMA, MODE_FACTS, DecodeParams, Mode
from backends.base import BackendError
from backends.modelfiles.resolution import resolve
from backends.registry import ModelSpec
from app.engine.timing import TIMED, cost_profile
from offload.cost import CostProfile, ModeStats, PlanReport, datasheet, project
from offload.geometry import ModelGeometry, read_geometry
from offload.plan import GiB, MemoryBudget, ModeShape, Plan, PlanError, PlanRequest, format_bytes, parse_size, plan

__all__ = ["MemoryBudget", "Fit", "PlanError", "PlanRequest", "budget_for", "model_fit", "format_bytes", "geometries",
           "hub_fits", "library_fits", "parse_size", "plan_for", "plan_models", "plan_request", "shape", "tree_tokens"]

# The mode whose fit and most beams a plan reports, and auto's first choice (beside its memory twin): full-mode
# DSBD with a draft, beam sampling without one.
FULL_MODE = {True: "dsbd", False: "beam-sample"}
PROJECTED_MODES = ("sample", "beam-sample", "sps", "dsbd", "dsbd-mem")  # `plan --cost-profile` without a bench file


def shape(mode: str) -> ModeShape:
    """A mode as the planner sees it, read from its row of MODE_FACTS."""
    f = MODE_FACTS[mode]
    return ModeShape(mode, keeps_rows=f.keeps_rows, drafts=f.uses_draft,
                     memory_twin=shape(f.memory_twin) if f.memory_twin else None, lookups=f.forest)


def tree_tokens(params: DecodeParams) -> int:
    """Context cells one iteration's forest needs with these settings beyond the committed tokens (auto: the most
    any mode it may pick needs; W_S unset: W + 1)."""
    f = MODE_FACTS[params.mode]
    modes = [params.mode] if f.concrete else [m for m, g in MODE_FACTS.items() if g.concrete]
    ws = params.beams + 1 if params.draft_beams is None else params.draft_beams
    return max(shape(m).tree_tokens(ws, params.gamma, params.lookup_nodes) for m in modes)


def _shapes(mode: str, full: ModeShape) -> tuple[ModeShape, ...]:
    """The modes a plan for `mode` tries: auto, the full mode and its memory twin; any other, itself."""
    if mode == "auto":
        return (full, full.memory_twin) if full.memory_twin else (full,)
    concrete = [m for m, f in MODE_FACTS.items() if f.concrete]
    if mode not in concrete:
        raise PlanError(f"unknown mode {mode!r}; choose auto or one of: {', '.join(concrete)}")
    return (shape(mode),)


def plan_request(mode: str = "auto", *, draft: bool, **numbers) -> PlanRequest:
    """The planner's request for `mode`, with or without a draft model; `numbers` are PlanRequest's (context,
    beams, draft_beams, gamma, runtimes, dtype, kv_type, ring)."""
    full = shape(FULL_MODE[draft])
    return PlanRequest(_shapes(mode, full), full, beam_limit=MAX_BEAMS, gamma_limit=MAX_GAMMA, **numbers)


def geometries(target: ModelSpec, draft: ModelSpec | None) -> tuple[tuple[ModelGeometry, ModelGeometry | None],
                                                                      tuple[str, str | None]]:
    """((target, draft) geometries, (target, draft) file paths) of two specs' files."""
    t = resolve(target.source, role="target")
    d = resolve(draft.source, role="draft") if draft is not None else None
    geo = (read_geometry(t.path, name=t.name), read_geometry(d.path, name=d.name) if d is not None else None)
    return geo, (str(t.path), str(d.path) if d is not None else None)


def request_for(target: ModelSpec, draft: ModelSpec | None, params: DecodeParams | None = None, *,
                mode: str = "auto", ring: int = 2) -> PlanRequest:
    """The planner's request for these specs and decoding settings (defaults: DecodeParams')."""
    p = params or DecodeParams()
    runtimes = {"target_backend": target.backend} | ({"draft_backend": draft.backend} if draft is not None else {})
    return plan_request(mode, draft=draft is not None, context=target.n_ctx, ring=ring, beams=p.beams,
                        draft_beams=p.draft_beams, gamma=p.gamma, dtype=target.dtype, **runtimes)


def budget_for(device: str = "cuda") -> MemoryBudget:
    """The machine's free VRAM on `device` (0 without CUDA) and available RAM."""
    return MemoryBudget.detect(device=device if str(device).startswith("cuda") else "cuda")


def plan_for(target: ModelSpec, draft: ModelSpec | None = None, params: DecodeParams | None = None, *,
             mode: str = "auto", budget: MemoryBudget | None = None, ring: int = 2) -> Plan:
    """Plan these specs at these decoding settings (W, W_S, gamma); PlanError says what would fit."""
    (tgt, dft), _paths = geometries(target, draft)
    return plan(tgt, dft, request_for(target, draft, params, mode=mode, ring=ring),
                budget if budget is not None else budget_for(target.device))


def plan_models(target: ModelSpec, draft: ModelSpec | None, request: PlanRequest, *,
                vram: int | None = None, ram: int | None = None, vram_reserve: int | None = None,
                ram_reserve: int | None = None, device: str = "cuda", profile: str = TIMED,
                h2d_gbps: float | None = None, tflops: float | None = None, mem_gbps: float | None = None,
                bench_json: str | None = None, acceptance: float = ACCEPTANCE_PRIOR) -> PlanReport:
    """`dsbd-chat plan`: the budget (explicit numbers, else the cost profile's VRAM, else detected), the plan
    and, with another machine's cost profile (named, a curves file, or custom datasheet numbers), projected
    speeds: of each mode in a bench file at its measured acceptance, else of PROJECTED_MODES at the assumed
    `acceptance`."""
    costs = projection_costs(profile, h2d_gbps=h2d_gbps, tflops=tflops, mem_gbps=mem_gbps)
    from_profile = vram is None and costs is not None and costs.vram_gb is not None
    if from_profile:
        vram = int(costs.vram_gb * GiB)
    kw = {k: v for k, v in (("vram_reserve", vram_reserve), ("ram_reserve", ram_reserve)) if v is not None}
    budget = MemoryBudget.detect(vram=vram, ram=ram, device=device if device.startswith("cuda") else "cuda", **kw)
    source = (f"VRAM {'cost profile ' + costs.name if from_profile else 'explicit' if vram is not None else 'detected'}, "
              f"RAM {'explicit' if ram is not None else 'detected'}")
    budget = replace(budget, source=source)
    (tgt, dft), paths = geometries(target, draft)
    report = PlanReport(tgt, dft, plan(tgt, dft, request, budget), paths=paths)
    if costs is None:
        return report
    base = request.validated()
    stats = read_bench(bench_json, base) if bench_json else \
        [assumed_stats(m, base, acceptance=acceptance) for m in PROJECTED_MODES]
    return replace(report, costs=costs, projections=tuple(project(tgt, dft, budget, costs, stats)))


def projection_costs(profile: str = TIMED, **custom: float | None) -> CostProfile | None:
    """The cost profile `plan` projects with: custom datasheet numbers (over the named datasheet, if any), else
    the named profile; None for this machine's timed passes (a plan loads no model to time)."""
    if any(v is not None for v in custom.values()):
        hw = datasheet(None if profile == TIMED else profile, **custom)
        return CostProfile(hw.name, machine="gpu" if hw.has_gpu else "cpu", datasheet=hw, vram_gb=hw.vram_gb,
                           source="datasheet (custom numbers, roofline)")
    if profile == TIMED:
        return None
    try:
        return cost_profile(profile)
    except ValueError as e:
        raise PlanError(str(e)) from None


def placed_profile(costs: CostProfile, target: ModelSpec, draft: ModelSpec | None) -> CostProfile:
    """A datasheet cost profile priced for these models as a load would place them in its machine's VRAM (the
    roofline per placement); any other profile unchanged. PlanError when they do not fit there."""
    if costs.datasheet is None:
        return costs
    budget = MemoryBudget.detect(vram=int((costs.vram_gb or 0) * GiB))
    return costs.placed(plan_for(target, draft, budget=budget))


# ---------------------------------------------------------------- what `plan` projects


def _facts(mode: str) -> Mode:
    """A label's mode facts; a label no concrete mode has (auto, in a bench file) prices as one row, like greedy."""
    f = MODE_FACTS.get(mode)
    return f if f is not None and f.concrete else MODE_FACTS["greedy"]


def _priced(mode: str, label: str, base: PlanRequest, *, w: int, ws: int, g: int, tau: float, d: float,
            source: str, distinct: float | None = None, draft_distinct: float | None = None) -> ModeStats:
    """A setting to project: `base`'s runtimes and context at this mode, W, W_S and gamma; its passes' tokens
    from the mode's facts, or the distinct tokens per pass a bench file measured."""
    f = _facts(mode)
    ws = max(ws, w)
    n_t, n_d = f.target_tokens(w, ws, g)
    if distinct:  # the bench's distinct tokens per pass replace the forest's full size
        n_t = max(1, round(distinct))
    if draft_distinct and n_d:
        n_d = [max(1, round(draft_distinct))] * len(n_d)
    request = replace(base, shapes=_shapes(mode, base.full), beams=w, draft_beams=ws, gamma=g)
    return ModeStats(mode, label, request, f.uses_draft, n_t, tuple(n_d), tau, d, source)


def assumed_stats(mode: str, base: PlanRequest, *, acceptance: float | None = None) -> ModeStats:
    """`mode` at `base`'s W, W_S and gamma: tau = (1 - a^(gamma+1)) / (1 - a) for draft modes (standard
    speculative sampling) with d = gamma, 1 otherwise; a draft mode needs the assumed acceptance a."""
    f = _facts(mode)
    if not f.uses_draft:
        w = base.beams if f.beams else 1
        return _priced(mode, mode, base, w=w, ws=w, g=0, tau=1.0, d=0.0, source="1 token/pass")
    if acceptance is None:
        raise PlanError(f"{mode} needs an assumed acceptance (or a bench file) to project its speed")
    a = min(max(acceptance, 0.0), 0.999)
    tau = (1 - a ** (base.gamma + 1)) / (1 - a)
    w, ws = (1, 1) if f.verifier == "sps" else (base.beams, base.draft_beams)
    return _priced(mode, mode, base, w=w, ws=ws, g=base.gamma, tau=tau, d=float(base.gamma),
                   source=f"assumed a={acceptance:g}")


def read_bench(path: str | Path, base: PlanRequest) -> list[ModeStats]:
    """Each mode of `dsbd-chat bench --json FILE` output (or its printed summary) at its measured acceptance
    (tau = 1 / target_passes_per_token, d = draft_passes / target_passes of its runs), W, W_S and gamma
    (`base`'s where the file does not say)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read bench file {path}: {e}") from e
    summary = data.get("summary", data) if isinstance(data, dict) else None
    if not isinstance(summary, dict) or not summary:
        raise PlanError(f"{path}: expected `dsbd-chat bench --json` output (an object with a 'summary' per mode)")
    config = data.get("config", {}).get("base", {}) if "summary" in data else {}
    runs = data.get("runs", []) if "summary" in data else []
    out = []
    for label, s in summary.items():
        mode, _, opts = label.partition(":")
        kw = {k: config.get(k) for k in ("beams", "draft_beams", "gamma")}
        for item in filter(None, opts.split(",")):
            key, _, value = item.partition("=")
            kw[key.strip().replace("-", "_")] = value
        f = _facts(mode)
        w = int(kw.get("beams") or base.beams) if f.beams else 1  # one row otherwise
        g = int(kw.get("gamma") if kw.get("gamma") is not None else base.gamma)
        ws = kw.get("draft_beams")
        ws = 1 if f.verifier == "sps" else int(ws) if ws is not None else base.draft_beams or w + 1  # sps: a chain
        try:
            per_token = float(s["target_passes_per_token"])
            tau = 1 / per_token if per_token > 0 else float(s["steps_per_target_pass"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{path}: mode {label!r} lacks target_passes_per_token / steps_per_target_pass") from e
        mine = [r["stats"] for r in runs if r.get("mode") == label and isinstance(r.get("stats"), dict)]
        target = sum(r.get("target_passes", 0) for r in mine)
        d = sum(r.get("draft_passes", 0) for r in mine) / target if target else \
            (float(g) if f.uses_draft else 0.0)
        try:
            out.append(_priced(mode, label, base, w=w, ws=ws, g=g, tau=tau, d=d, source="bench",
                               distinct=s.get("distinct_tokens_per_pass"),
                               draft_distinct=s.get("draft_distinct_tokens_per_pass")))
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
    return out


# ---------------------------------------------------------------- fit badges


FIT_LABELS = {"gpu": "fits in VRAM", "offload": "fits with offloading", "cpu": "fits in RAM (no GPU: runs on the CPU)",
              "no": "does not fit"}


@dataclass(frozen=True)
class Fit:
    badge: str  # "gpu" | "offload" | "cpu" | "no"
    label: str
    detail: str  # the plan in one line, or the planner's reason and what would fit
    vram_bytes: int = 0
    ram_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def model_fit(target: ModelGeometry, draft: ModelGeometry | None = None, *, context: int = 4096,
        budget: MemoryBudget | None = None, target_backend: str = "llamacpp") -> Fit:
    """Whether `target` (with `draft` and both KV caches at `context`) fits this machine, as a load would plan it."""
    params = DecodeParams(mode="dsbd" if draft is not None else "beam-sample")  # as engine.memory_plan plans a load
    req = request_for(ModelSpec(source=target.name, n_ctx=context, backend=target_backend),
                      ModelSpec(source=draft.name) if draft is not None else None, params)
    b = budget if budget is not None else budget_for()
    try:
        p = plan(target, draft, req, b)
    except PlanError as e:
        return Fit("no", FIT_LABELS["no"], str(e))
    placed = [x for x in (p.target, p.draft) if x is not None]
    if not b.has_gpu:
        badge = "cpu"
    elif all(x.cpu_layers == 0 and x.streamed_layers == 0 for x in placed):
        badge = "gpu"
    else:
        badge = "offload"
    t = p.target
    where = (f"target {t.gpu_layers}/{t.n_layers} layers on the GPU" if b.has_gpu else "everything on the CPU")
    vram = f"{format_bytes(p.vram_bytes)} VRAM of {format_bytes(b.vram_avail)} usable, " if b.has_gpu else ""
    detail = f"{p.mode} at context {context}: {where}; needs {vram}{format_bytes(p.ram_bytes)} RAM of " \
             f"{format_bytes(b.ram_avail)} usable"
    return Fit(badge, FIT_LABELS[badge], detail, p.vram_bytes, p.ram_bytes)


def sized(geo: ModelGeometry, size: int, quant: str | None = None) -> ModelGeometry:
    """`geo` as a file of `size` bytes: another quantization of the same model (weights scaled to the size), or
    a split model whose header (its first shard) lists only some layers (the rest spread over every layer)."""
    if geo.weight_bytes >= 0.9 * size:
        return geo.with_bits_per_weight(8 * size / max(1, geo.n_params), quant or geo.quant)
    n = geo.n_layers
    per = max(0, size - geo.embed_bytes - geo.head_bytes) // max(1, n)
    bpw = geo.bits_per_weight or 8.0
    return replace(geo, quant=quant or geo.quant, layer_bytes=(per,) * n, layer_params=(int(per * 8 / bpw),) * n)


def draft_geometry(draft: ModelSpec | str | None) -> ModelGeometry | None:
    """The geometry of a draft given as a spec (the loaded or chosen one), a source string, or None."""
    if draft is None:
        return None
    spec = draft if isinstance(draft, ModelSpec) else ModelSpec(source=str(draft))
    d = resolve(spec.source, role="draft")
    return read_geometry(d.path, name=d.name)


def library_fits(entries, *, draft: ModelSpec | str | None = None, context: int = 4096,
                 budget: MemoryBudget | None = None) -> dict[str, Fit]:
    """entry path -> Fit for every usable `backends.modelfiles.library.ModelEntry` (unreadable ones are left out)."""
    b = budget if budget is not None else budget_for()
    dgeo = draft_geometry(draft)
    out = {}
    for e in entries:
        if not e.usable:
            continue
        try:
            geo = read_geometry(e.path, name=e.name)
            out[e.path] = model_fit(sized(geo, e.size) if len(e.files) > 1 else geo, dgeo, context=context, budget=b)
        except BackendError as err:
            out[e.path] = Fit("no", "unknown", f"cannot size {e.name}: {err}")
    return out


def hub_fits(listing, *, draft: ModelSpec | str | None = None, context: int = 4096,
             budget: MemoryBudget | None = None) -> dict[str, Fit]:
    """group name -> Fit for the model groups of a `backends.modelfiles.hub.RepoFiles` (one header fetched: a
    single-file group's when there is one); raises backends.modelfiles.hub.HubError when the header cannot be
    fetched."""
    from backends.modelfiles import hub

    groups = [g for g in listing.groups if g.kind == "model"]
    if not groups:
        return {}
    probe = min(groups, key=lambda g: (g.shards > 1, g.size))
    path = hub.fetch_header(listing.repo, probe.files[0].path, revision=listing.revision)
    base = read_geometry(path, name=probe.name)
    if probe.shards > 1:
        base = sized(base, probe.size)
    b = budget if budget is not None else budget_for()
    dgeo = draft_geometry(draft)
    return {g.name: model_fit(sized(base, g.size, g.quant), dgeo, context=context, budget=b) for g in groups}
