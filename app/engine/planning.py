"""Memory plans for model specs: resolve the files (backends.registry), read their headers (offload.geometry)
and hand the planner plain numbers. One function per question, whichever edge asks (engine load, the Models
tab, `dsbd-chat plan`); no weights are read.

Fit badges (the Models tab and `dsbd-chat models`): `fit(target_geometry, draft_geometry, context=...) -> Fit`
plans a target with a draft and both KV caches at a context exactly as a load would (`memory_plan`'s decoding
settings) on this machine's free VRAM and available RAM: "gpu" (fits in VRAM), "offload" (fits with layers in
RAM), "cpu" (no GPU: fits in RAM), "no" (does not fit; `detail` says what would). `library_fits(entries, ...)`
and `hub_fits(listing, ...)` give one per library entry / per downloadable group of a Hub repo (one header
fetched per repo; other quantizations and split files scaled to their size)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from app.config import ACCEPTANCE_PRIOR, DecodeParams
from backends.base import BackendError
from backends.registry import ModelSpec, resolve
from offload.cost import PlanReport, plan_report
from offload.cost import profile as hardware_profile
from offload.geometry import ModelGeometry, read_geometry
from offload.plan import GiB, Budget, Plan, PlanError, PlanRequest, fmt_bytes, parse_size, plan

__all__ = ["Budget", "Fit", "PlanError", "PlanRequest", "budget_for", "fit", "geometries", "hub_fits", "library_fits",
           "parse_size", "plan_for", "plan_models"]


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
    return PlanRequest(context=target.n_ctx, mode=mode, ring=ring, beams=p.beams, draft_beams=p.draft_beams,
                       gamma=p.gamma, target_backend=target.backend,
                       draft_backend=draft.backend if draft is not None else "llamacpp", dtype=target.dtype)


def budget_for(device: str = "cuda") -> Budget:
    """The machine's free VRAM on `device` (0 without CUDA) and available RAM."""
    return Budget.detect(device=device if str(device).startswith("cuda") else "cuda")


def plan_for(target: ModelSpec, draft: ModelSpec | None = None, params: DecodeParams | None = None, *,
             mode: str = "auto", budget: Budget | None = None, ring: int = 2) -> Plan:
    """Plan these specs at these decoding settings (W, W_S, gamma); PlanError says what would fit."""
    (tgt, dft), _paths = geometries(target, draft)
    return plan(tgt, dft, request_for(target, draft, params, mode=mode, ring=ring),
                budget if budget is not None else budget_for(target.device))


def plan_models(target: ModelSpec, draft: ModelSpec | None, request: PlanRequest, *,
                vram: int | None = None, ram: int | None = None, vram_reserve: int | None = None,
                ram_reserve: int | None = None, device: str = "cuda", profile: str | None = None,
                h2d_gbps: float | None = None, tflops: float | None = None, mem_gbps: float | None = None,
                bench_json: str | None = None, acceptance: float = ACCEPTANCE_PRIOR) -> PlanReport:
    """`dsbd-chat plan`: the budget (explicit numbers, else a named profile's VRAM, else detected), the plan
    and, with a hardware profile (named or custom numbers), projected speeds."""
    hw = None
    if profile or any(x is not None for x in (h2d_gbps, tflops, mem_gbps)):
        hw = hardware_profile(profile, h2d_gbps=h2d_gbps, tflops=tflops, mem_gbps=mem_gbps)
    from_profile = vram is None and profile is not None
    if from_profile:
        vram = int(hw.vram_gb * GiB)
    kw = {k: v for k, v in (("vram_reserve", vram_reserve), ("ram_reserve", ram_reserve)) if v is not None}
    budget = Budget.detect(vram=vram, ram=ram, device=device if device.startswith("cuda") else "cuda", **kw)
    source = (f"VRAM {'profile ' + profile if from_profile else 'explicit' if vram is not None else 'detected'}, "
              f"RAM {'explicit' if ram is not None else 'detected'}")
    (tgt, dft), paths = geometries(target, draft)
    return plan_report(tgt, dft, request, replace(budget, source=source), hardware=hw, bench_json=bench_json,
                       acceptance=acceptance, paths=paths)


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


def fit(target: ModelGeometry, draft: ModelGeometry | None = None, *, context: int = 4096,
        budget: Budget | None = None, target_backend: str = "llamacpp") -> Fit:
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
    vram = f"{fmt_bytes(p.vram_bytes)} VRAM of {fmt_bytes(b.vram_avail)} usable, " if b.has_gpu else ""
    detail = f"{p.mode} at context {context}: {where}; needs {vram}{fmt_bytes(p.ram_bytes)} RAM of " \
             f"{fmt_bytes(b.ram_avail)} usable"
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
                 budget: Budget | None = None) -> dict[str, Fit]:
    """entry path -> Fit for every usable `backends.library.ModelEntry` (unreadable ones are left out)."""
    b = budget if budget is not None else budget_for()
    dgeo = draft_geometry(draft)
    out = {}
    for e in entries:
        if not e.usable:
            continue
        try:
            geo = read_geometry(e.path, name=e.name)
            out[e.path] = fit(sized(geo, e.size) if len(e.files) > 1 else geo, dgeo, context=context, budget=b)
        except BackendError as err:
            out[e.path] = Fit("no", "unknown", f"cannot size {e.name}: {err}")
    return out


def hub_fits(listing, *, draft: ModelSpec | str | None = None, context: int = 4096,
             budget: Budget | None = None) -> dict[str, Fit]:
    """group name -> Fit for the model groups of a `backends.hub.RepoFiles` (one header fetched: a single-file
    group's when there is one); raises backends.hub.HubError when the header cannot be fetched."""
    from backends import hub

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
    return {g.name: fit(sized(base, g.size, g.quant), dgeo, context=context, budget=b) for g in groups}
