"""Cost model: project tokens/s per decoding mode from pass costs and acceptance statistics.

These are PROJECTIONS from nominal hardware numbers, not measurements. Formulas (one model pass that
scores n tokens, for a Placement from offload.plan):

    T_copy    = H / B_h2d                                  H: streamed weight bytes per pass
    T_gpu(n)  = max((R_gpu + K_gpu) / B_mem, 2 P_gpu n / F_gpu)      roofline: read weights + KV once, or matmul
    T_cpu(n)  = max((R_cpu + K_cpu) / B_ram, 2 P_cpu n / F_cpu)
    T_pass(n) = t_0 + max(T_copy, T_gpu(n)) + T_cpu(n)      ring >= 2: copies overlap GPU compute
              = t_0 + T_copy + T_gpu(n) + T_cpu(n)          ring = 1: no overlap

R = weight bytes read, P = matmul parameters (embedding lookup excluded), K = KV bytes read
(rows x context/2 x b: the mean committed length over a generation), t_0 = per-pass overhead (kernel
launches, Python). One decoding iteration costs one target pass and d draft passes and yields tau tokens:

    tok/s = tau / (T_target(n_t) + sum over the d draft passes of T_draft(n_d))

    mode             n_t (target tokens scored)   draft passes (tokens each)     tau
    greedy, sample   1                            -                              1
    beam, beam-*     W                            -                              1
    sps              1 + gamma                    gamma (1)                      1 / target_passes_per_token
    dsbd             W + W_S gamma                gamma (W, then W_S)            1 / target_passes_per_token
    dsbd-mem         1 + W_S gamma                gamma (1, then W_S)            1 / target_passes_per_token

tau and d come from a `dsbd-chat bench --json` file when given (tau = 1 / target_passes_per_token,
d = draft_passes / target_passes from its runs); otherwise tau = (1 - a^(gamma+1)) / (1 - a) with an
assumed per-token acceptance a (the caller's prior: app.config.ACCEPTANCE_PRIOR) and d = gamma.
Not modelled: attention FLOPs, Layout R padding (a full-mode PyTorch pass computes W (1 + N_max) queries),
prefill, and the sampler's own time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from typing import TYPE_CHECKING

from offload.plan import DRAFT_MODES, SHAPES, Budget, GiB, Placement, PlanError, PlanRequest, Shape, plan

if TYPE_CHECKING:
    from offload.geometry import ModelGeometry
    from offload.plan import Plan

_ONE_ROW = Shape(beams=False, keeps_rows=False, drafts=False)


def _shape(mode: str) -> Shape:
    """A mode's shape; a label the planner does not know (auto, in a bench file) prices as one row."""
    return SHAPES.get(mode, _ONE_ROW)

DEFAULT_MODES = ("sample", "beam-sample", "sps", "dsbd", "dsbd-mem")


@dataclass(frozen=True)
class HardwareProfile:
    """Nominal numbers of a machine (GB = 10^9 bytes)."""

    name: str
    vram_gb: float  # GPU memory, GiB (0 = no GPU)
    h2d_gbps: float  # pinned host -> device copy bandwidth
    tflops: float  # dense fp16/bf16 matmul throughput of the GPU
    mem_gbps: float  # GPU memory bandwidth
    cpu_tflops: float = 1.0  # CPU matmul throughput (llama.cpp CPU layers, CPU-only runs)
    ram_gbps: float = 50.0  # host memory bandwidth
    overhead_ms: float = 1.0  # per pass: kernel launches, Python, synchronisation

    @property
    def has_gpu(self) -> bool:
        return self.vram_gb > 0


PROFILES = {p.name: p for p in (
    # Nominal datasheet-level numbers, rounded; the GPU TFLOP/s are fp16 tensor throughput with fp32 accumulate.
    HardwareProfile("laptop-8gb", vram_gb=8, h2d_gbps=12, tflops=30, mem_gbps=256, cpu_tflops=0.6, ram_gbps=40),
    HardwareProfile("rtx3060-12gb", vram_gb=12, h2d_gbps=24, tflops=25, mem_gbps=360),
    HardwareProfile("rtx4090-24gb", vram_gb=24, h2d_gbps=25, tflops=165, mem_gbps=1008, cpu_tflops=1.5, ram_gbps=70),
    HardwareProfile("h200-141gb", vram_gb=139, h2d_gbps=50, tflops=790, mem_gbps=4300, cpu_tflops=2.0, ram_gbps=150),
    HardwareProfile("cpu-only", vram_gb=0, h2d_gbps=0, tflops=0, mem_gbps=0, cpu_tflops=1.0, ram_gbps=50,
                    overhead_ms=0.5),
)}


def profile(name: str | None = None, **custom: float | None) -> HardwareProfile:
    """A named profile, with any of its numbers overridden; without a name all of h2d/tflops/mem are needed."""
    given = {k: v for k, v in custom.items() if v is not None}
    if name is not None:
        if name not in PROFILES:
            raise PlanError(f"unknown hardware profile {name!r}; choose one of: {', '.join(PROFILES)}")
        return replace(PROFILES[name], **given)
    missing = [k for k in ("h2d_gbps", "tflops", "mem_gbps") if k not in given]
    if missing:
        raise PlanError(f"custom hardware needs {', '.join('--' + k.replace('_', '-') for k in missing)} "
                        f"(or --profile {' | '.join(PROFILES)})")
    given.setdefault("vram_gb", 0.0)
    return HardwareProfile(name="custom", **given)


# ---------------------------------------------------------------- pass costs


@dataclass(frozen=True)
class PassCost:
    seconds: float
    copy_s: float
    gpu_s: float
    cpu_s: float
    bound: str  # "h2d" | "gpu-memory" | "gpu-compute" | "cpu" | "overhead"


def pass_cost(pl: Placement, hw: HardwareProfile, n_tokens: int, *, kv_fill: float = 0.5) -> PassCost:
    """Time of one forward over `n_tokens` queries for a model placed as `pl` (formulas: module docstring)."""
    kv_read = pl.kv_rows * pl.kv_tokens * kv_fill * pl.kv_bytes_per_token
    on_gpu = pl.kv_gpu_bytes / pl.kv_bytes if pl.kv_bytes else 0.0
    copy = 0.0
    if pl.h2d_bytes:
        if hw.h2d_gbps <= 0:
            raise PlanError(f"profile {hw.name} has no host-to-device bandwidth but {pl.role} streams layers")
        copy = pl.h2d_bytes / (hw.h2d_gbps * 1e9)
    gpu_mem = gpu_flop = 0.0
    if pl.gpu_params:
        if hw.mem_gbps <= 0 or hw.tflops <= 0:
            raise PlanError(f"profile {hw.name} has no GPU numbers but the plan puts {pl.role} layers on a GPU")
        gpu_mem = (pl.gpu_read_bytes + kv_read * on_gpu) / (hw.mem_gbps * 1e9)
        gpu_flop = 2 * pl.gpu_params * n_tokens / (hw.tflops * 1e12)
    cpu_mem = (pl.cpu_read_bytes + kv_read * (1 - on_gpu)) / (hw.ram_gbps * 1e9) if pl.cpu_params else 0.0
    cpu_flop = 2 * pl.cpu_params * n_tokens / (hw.cpu_tflops * 1e12) if pl.cpu_params else 0.0
    gpu, cpu = max(gpu_mem, gpu_flop), max(cpu_mem, cpu_flop)
    overlapped = max(copy, gpu) if pl.ring >= 2 else copy + gpu
    t0 = hw.overhead_ms / 1e3
    parts = {"h2d": copy, "gpu-memory": gpu_mem, "gpu-compute": gpu_flop, "cpu": cpu, "overhead": t0}
    return PassCost(seconds=t0 + overlapped + cpu, copy_s=copy, gpu_s=gpu, cpu_s=cpu,
                    bound=max(parts, key=parts.get))


# ---------------------------------------------------------------- acceptance statistics


@dataclass(frozen=True)
class ModeStats:
    """How far one target pass gets a mode (from a bench file, or assumed)."""

    mode: str  # decoding mode (bench label without its settings)
    label: str  # bench label, e.g. "dsbd:beams=2"
    beams: int
    draft_beams: int
    gamma: int
    tokens_per_target_pass: float  # tau
    draft_passes_per_target_pass: float  # d
    source: str  # "bench" | "assumed a=..."
    # measured distinct tokens per target / draft pass (unique paths score each sequence once); None: W_S * gamma
    target_tokens: float | None = None
    draft_tokens: float | None = None


def assumed_stats(mode: str, *, beams: int, draft_beams: int, gamma: int,
                  acceptance: float | None = None) -> ModeStats:
    """tau = (1 - a^(gamma+1)) / (1 - a) for draft modes (standard speculative sampling), 1 otherwise;
    a draft mode needs the assumed acceptance a."""
    shape = _shape(mode)
    if not shape.drafts:
        w = beams if shape.beams else 1
        return ModeStats(mode, mode, w, w, 0, 1.0, 0.0, "1 token/pass")
    if acceptance is None:
        raise PlanError(f"{mode} needs an assumed acceptance (or a bench file) to project its speed")
    a = min(max(acceptance, 0.0), 0.999)
    tau = (1 - a ** (gamma + 1)) / (1 - a)
    w, ws = (1, 1) if shape.chain else (beams, draft_beams)
    return ModeStats(mode, mode, w, ws, gamma, tau, float(gamma), f"assumed a={acceptance:g}")


def read_bench(path: str | Path, *, beams: int = 4, draft_beams: int | None = None, gamma: int = 3) -> list[ModeStats]:
    """Acceptance statistics per mode from `dsbd-chat bench --json FILE` output (or its printed summary)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read bench file {path}: {e}") from e
    summary = data.get("summary", data) if isinstance(data, dict) else None
    if not isinstance(summary, dict) or not summary:
        raise PlanError(f"{path}: expected `dsbd-chat bench --json` output (an object with a 'summary' per mode)")
    base = data.get("config", {}).get("base", {}) if "summary" in data else {}
    runs = data.get("runs", []) if "summary" in data else []
    out = []
    for label, s in summary.items():
        mode, _, opts = label.partition(":")
        kw = {k: base.get(k) for k in ("beams", "draft_beams", "gamma")}
        for item in filter(None, opts.split(",")):
            key, _, value = item.partition("=")
            kw[key.strip().replace("-", "_")] = value
        shape = _shape(mode)
        w = int(kw.get("beams") or beams) if shape.beams else 1  # one row otherwise
        g = int(kw.get("gamma") if kw.get("gamma") is not None else gamma)
        ws = kw.get("draft_beams")
        ws = 1 if shape.chain else int(ws) if ws is not None else draft_beams or w + 1  # sps drafts one chain
        try:
            per_token = float(s["target_passes_per_token"])
            tau = 1 / per_token if per_token > 0 else float(s["steps_per_target_pass"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{path}: mode {label!r} lacks target_passes_per_token / steps_per_target_pass") from e
        mine = [r["stats"] for r in runs if r.get("mode") == label and isinstance(r.get("stats"), dict)]
        target = sum(r.get("target_passes", 0) for r in mine)
        d = sum(r.get("draft_passes", 0) for r in mine) / target if target else \
            (float(g) if mode in DRAFT_MODES else 0.0)
        out.append(ModeStats(mode, label, w, ws, g, tau, d, "bench", s.get("distinct_tokens_per_pass"),
                             s.get("draft_distinct_tokens_per_pass")))
    return out


# ---------------------------------------------------------------- projections


@dataclass(frozen=True)
class Projection:
    """Projected (not measured) speed of one mode on one hardware profile."""

    label: str
    mode: str
    fits: bool
    beams: int
    draft_beams: int
    gamma: int
    target_tokens: int  # n_t
    target_pass_ms: float | None
    draft_pass_ms: float | None  # mean over the iteration's draft passes
    draft_passes: float  # d
    tokens_per_target_pass: float  # tau
    tokens_per_s: float | None
    bound: str  # what limits the target pass
    stats_source: str
    why: str = ""  # when it does not fit

    def as_dict(self) -> dict:
        return {"kind": "projection", **asdict(self)}


def queries(mode: str, w: int, ws: int, g: int) -> tuple[int, list[int]]:
    """(target tokens scored per pass, tokens scored by each draft pass)."""
    shape = _shape(mode)
    roots = w if shape.keeps_rows or (shape.beams and not shape.drafts) else 1
    if not shape.drafts:
        return roots, []
    ws = 1 if shape.chain else ws
    return roots + ws * g, ([roots] + [ws] * (g - 1)) if g else []


def project(target, draft, request: PlanRequest, budget: Budget, hw: HardwareProfile,
            stats: list[ModeStats]) -> list[Projection]:
    """One projection per ModeStats: plan that mode's memory, then price its iteration."""
    out = []
    for st in stats:
        if st.mode in DRAFT_MODES and draft is None:
            continue
        req = replace(request, mode=st.mode, beams=st.beams, gamma=st.gamma,
                      draft_beams=max(st.draft_beams, st.beams))
        n_t, n_d = queries(st.mode, st.beams, req.draft_beams, st.gamma)
        if st.target_tokens:  # the bench's distinct tokens per pass replace the forest's full size
            n_t = max(1, round(st.target_tokens))
        if st.draft_tokens and n_d:
            n_d = [max(1, round(st.draft_tokens))] * len(n_d)
        common = dict(label=st.label, mode=st.mode, beams=st.beams, draft_beams=req.draft_beams, gamma=st.gamma,
                      target_tokens=n_t, draft_passes=st.draft_passes_per_target_pass,
                      tokens_per_target_pass=st.tokens_per_target_pass, stats_source=st.source)
        try:
            p = plan(target, draft, req, budget)
        except PlanError as e:
            out.append(Projection(**common, fits=False, target_pass_ms=None, draft_pass_ms=None, tokens_per_s=None,
                                  bound="-", why=str(e).split(". To make it fit")[0]))
            continue
        t = pass_cost(p.target, hw, n_t)
        drafts = [pass_cost(p.draft, hw, n).seconds for n in n_d] if p.draft is not None and n_d else []
        d_mean = sum(drafts) / len(drafts) if drafts else 0.0
        iteration = t.seconds + d_mean * st.draft_passes_per_target_pass
        out.append(Projection(**common, fits=True, target_pass_ms=t.seconds * 1e3,
                              draft_pass_ms=d_mean * 1e3 if drafts else None,
                              tokens_per_s=st.tokens_per_target_pass / iteration, bound=t.bound))
    return out


def format_projections(hw: HardwareProfile, rows: list[Projection]) -> str:
    gpu = (f"{hw.vram_gb:g} GiB VRAM, H2D {hw.h2d_gbps:g} GB/s, {hw.tflops:g} TFLOP/s, {hw.mem_gbps:g} GB/s"
           if hw.has_gpu else "no GPU")
    lines = [f"PROJECTIONS (cost model, not measurements) for {hw.name}: {gpu}; CPU {hw.cpu_tflops:g} TFLOP/s, "
             f"RAM {hw.ram_gbps:g} GB/s, {hw.overhead_ms:g} ms/pass overhead"]
    head = ("mode", "W", "W_S", "gamma", "target tok/pass", "target ms", "draft ms", "drafts/iter", "tokens/iter",
            "bound", "tok/s (proj.)", "stats")
    table = [head]
    for r in rows:
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        table.append((r.label, str(r.beams), str(r.draft_beams) if r.mode in DRAFT_MODES else "-",
                      str(r.gamma) if r.mode in DRAFT_MODES else "-", str(r.target_tokens),
                      f(r.target_pass_ms, ".2f"), f(r.draft_pass_ms, ".2f"),
                      f"{r.draft_passes:.2f}" if r.mode in DRAFT_MODES else "-",
                      f"{r.tokens_per_target_pass:.2f}", r.bound,
                      f(r.tokens_per_s, ".1f") if r.fits else "does not fit", r.stats_source))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines += [f"  {r.label}: {r.why}" for r in rows if not r.fits]
    return "\n".join(lines)


# ---------------------------------------------------------------- the plan command's report


@dataclass(frozen=True)
class PlanReport:
    """`dsbd-chat plan`'s answer: the memory plan and, with a hardware profile, the projected speeds."""

    target: "ModelGeometry"
    draft: "ModelGeometry | None"
    plan: "Plan"
    hardware: HardwareProfile | None = None
    projections: tuple[Projection, ...] = ()
    paths: tuple[str, str | None] = ("", None)  # where the target and draft files are

    def as_dict(self) -> dict:
        out = {"plan": self.plan.as_dict(),
               "models": {"target": self.target.__dict__ | {"path": self.paths[0]},
                          "draft": self.draft.__dict__ | {"path": self.paths[1]} if self.draft else None}}
        if self.hardware is not None:
            out |= {"hardware": self.hardware.__dict__, "projections": [x.as_dict() for x in self.projections]}
        return out

    def format(self) -> str:
        def one(role, g):
            return f"{role} {g.name} ({g.quant}, {g.n_layers} layers, {g.weight_bytes / GiB:.2f} GiB)"

        lines = ["; ".join(one(r, g) for r, g in (("target", self.target), ("draft", self.draft)) if g is not None),
                 self.plan.format()]
        if self.hardware is not None:
            lines += ["", format_projections(self.hardware, list(self.projections))]
        return "\n".join(lines)


def plan_report(target: "ModelGeometry", draft: "ModelGeometry | None", request: PlanRequest, budget: Budget, *,
                hardware: HardwareProfile | None = None, bench_json: str | Path | None = None,
                acceptance: float | None = None, modes: tuple[str, ...] = DEFAULT_MODES,
                paths: tuple[str, str | None] = ("", None)) -> PlanReport:
    """Plan `request`; with a hardware profile, project each of `modes` from a bench file's acceptance or
    from the assumed `acceptance`."""
    p = plan(target, draft, request, budget)
    if hardware is None:
        return PlanReport(target, draft, p, paths=paths)
    req = request.validated()
    if bench_json:
        stats = read_bench(bench_json, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma)
    else:
        stats = [assumed_stats(m, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma,
                               acceptance=acceptance) for m in modes]
    rows = project(target, draft, req, budget, hardware, stats)
    return PlanReport(target, draft, p, hardware, tuple(rows), paths)
