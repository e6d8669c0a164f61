"""Memory plans for model specs: resolve the files (backends.registry), read their headers (offload.geometry)
and hand the planner plain numbers. One function per question, whichever edge asks (engine load, the Models
tab, `dsbd-chat plan`); no weights are read."""

from __future__ import annotations

from dataclasses import replace

from app.config import ACCEPTANCE_PRIOR, DecodeParams
from backends.registry import ModelSpec, resolve
from offload.cost import PlanReport, plan_report
from offload.cost import profile as hardware_profile
from offload.geometry import ModelGeometry, read_geometry
from offload.plan import GiB, Budget, Plan, PlanError, PlanRequest, parse_size, plan

__all__ = ["Budget", "PlanError", "PlanRequest", "budget_for", "geometries", "parse_size", "plan_for", "plan_models"]


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
