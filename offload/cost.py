"""The speed model: what one pass of a model costs on a machine, and the tokens/s that follows.

A machine's pass cost is a `CostProfile`: for the target and the draft, the seconds of one pass scoring n tokens
(a `CostCurve`). The plan, auto mode, the forest policy and the bench all price with one. A profile's curves come
from one of three sources:

    timed       this machine's passes, timed once and cached (app.engine.timing)
    curves      a file of seconds by tokens for another machine: published figures or scripts/gpu_profile.py
    datasheet   nominal numbers of a machine (`Datasheet`); the curves follow from where a plan puts each
                model's layers, by the roofline below

These are PROJECTIONS wherever the profile is not this machine's timed one. The datasheet roofline (one model
pass that scores n tokens, for a Placement from offload.plan):

    T_copy    = H / B_h2d                                  H: streamed weight bytes per pass
    T_gpu(n)  = max((R_gpu + K_gpu) / B_mem, 2 P_gpu n / F_gpu)      roofline: read weights + KV once, or matmul
    T_cpu(n)  = max((R_cpu + K_cpu) / B_ram, 2 P_cpu n / F_cpu)
    T_pass(n) = t_0 + max(T_copy, T_gpu(n)) + T_cpu(n)      ring >= 2: copies overlap GPU compute
              = t_0 + T_copy + T_gpu(n) + T_cpu(n)          ring = 1: no overlap

R = weight bytes read, P = matmul parameters (embedding lookup excluded), K = KV bytes read
(rows x context/2 x b: the mean committed length over a generation), t_0 = per-pass overhead (kernel
launches, Python). One decoding iteration costs one target pass and d draft passes and yields tau tokens:

    tok/s = tau / (T_target(n_t) + sum over the d draft passes of T_draft(n_d))

The caller (app/engine/planning.py, which knows the decoding modes) describes each setting to price as a
`ModeStats`: its plan request, n_t and each draft pass's n_d (app.config's Mode.target_tokens), tau and d
(from a `dsbd-chat bench --json` file, or assumed); this module plans its memory and prices its passes on the
profile's curves for that plan.
Not modelled: attention FLOPs, Layout R padding (a full-mode PyTorch pass computes W (1 + N_max) queries),
prefill, and the sampler's own time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Mapping

from offload.plan import MemoryBudget, Placement, PlanError, PlanRequest, format_bytes, plan

if TYPE_CHECKING:
    from offload.geometry import ModelGeometry
    from offload.plan import Plan


@dataclass(frozen=True)
class Datasheet:
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


DATASHEETS = {p.name: p for p in (
    # Nominal datasheet-level numbers, rounded; the GPU TFLOP/s are fp16 tensor throughput with fp32 accumulate.
    Datasheet("laptop-8gb", vram_gb=8, h2d_gbps=12, tflops=30, mem_gbps=256, cpu_tflops=0.6, ram_gbps=40),
    Datasheet("rtx3060-12gb", vram_gb=12, h2d_gbps=24, tflops=25, mem_gbps=360),
    Datasheet("rtx4090-24gb", vram_gb=24, h2d_gbps=25, tflops=165, mem_gbps=1008, cpu_tflops=1.5, ram_gbps=70),
    Datasheet("h200-141gb", vram_gb=139, h2d_gbps=50, tflops=790, mem_gbps=4300, cpu_tflops=2.0, ram_gbps=150),
    Datasheet("cpu-only", vram_gb=0, h2d_gbps=0, tflops=0, mem_gbps=0, cpu_tflops=1.0, ram_gbps=50,
                    overhead_ms=0.5),
)}


def datasheet(name: str | None = None, **custom: float | None) -> Datasheet:
    """A named datasheet, with any of its numbers overridden; without a name all of h2d/tflops/mem are needed."""
    given = {k: v for k, v in custom.items() if v is not None}
    if name is not None:
        if name not in DATASHEETS:
            raise PlanError(f"unknown datasheet {name!r}; choose one of: {', '.join(DATASHEETS)}")
        return replace(DATASHEETS[name], **given)
    missing = [k for k in ("h2d_gbps", "tflops", "mem_gbps") if k not in given]
    if missing:
        raise PlanError(f"custom hardware needs {', '.join('--' + k.replace('_', '-') for k in missing)} "
                        f"(or --cost-profile {' | '.join(DATASHEETS)})")
    given.setdefault("vram_gb", 0.0)
    return Datasheet(name="custom", **given)


# ---------------------------------------------------------------- pass costs


@dataclass(frozen=True)
class PassCost:
    seconds: float
    copy_s: float
    gpu_s: float
    cpu_s: float
    bound: str  # "h2d" | "gpu-memory" | "gpu-compute" | "cpu" | "overhead"


def pass_cost(pl: Placement, hw: Datasheet, n_tokens: int, *, kv_fill: float = 0.5) -> PassCost:
    """Time of one forward over `n_tokens` queries for a model placed as `pl` (formulas: module docstring)."""
    kv_read = pl.kv_rows * pl.kv_tokens * kv_fill * pl.kv_bytes_per_token
    on_gpu = pl.kv_gpu_bytes / pl.kv_bytes if pl.kv_bytes else 0.0
    copy = 0.0
    if pl.h2d_bytes:
        if hw.h2d_gbps <= 0:
            raise PlanError(f"datasheet {hw.name} has no host-to-device bandwidth but {pl.role} streams layers")
        copy = pl.h2d_bytes / (hw.h2d_gbps * 1e9)
    gpu_mem = gpu_flop = 0.0
    if pl.gpu_params:
        if hw.mem_gbps <= 0 or hw.tflops <= 0:
            raise PlanError(f"datasheet {hw.name} has no GPU numbers but the plan puts {pl.role} layers on a GPU")
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


# ---------------------------------------------------------------- the cost profile

CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64)  # tokens per pass a curve is timed or priced at


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one pass scoring n tokens: piecewise linear through measured points, linear beyond."""

    points: tuple[tuple[int, float], ...]  # (n, seconds), n ascending

    @classmethod
    def of(cls, costs: Mapping[int, float]) -> "CostCurve":
        if not costs:
            raise ValueError("a cost curve needs at least one measured point")
        pts, best = [], float("inf")
        # A pass scoring more tokens never costs less, and other processes only ever add time: clip each
        # point to the cheapest one at or above its n, so one disturbed measurement cannot lift the curve.
        for n, s in sorted(((int(n), float(s)) for n, s in costs.items()), reverse=True):
            best = min(best, s)
            pts.append((n, best))
        return cls(tuple(reversed(pts)))

    def __call__(self, n: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * n / pts[0][0]  # one point: assume proportional
        if n <= pts[0][0]:
            return pts[0][1]
        # Beyond the last point: extend the last segment's slope (compute-bound growth).
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1 or (n1, s1) == pts[-1]:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class Roofline:
    """A datasheet's pass costs of a model placed as `placement` (the roofline in the module docstring), called
    like a CostCurve."""

    placement: Placement
    datasheet: Datasheet

    def __call__(self, n: float) -> float:
        return pass_cost(self.placement, self.datasheet, max(1, round(n))).seconds

    @property
    def points(self) -> tuple[tuple[int, float], ...]:
        return tuple((n, self(n)) for n in CURVE_POINTS)


@dataclass(frozen=True)
class CostProfile:
    """A machine's pass costs: curves for the target and the draft (module docstring). `target` is None for
    the timed profile before its passes are timed, and for a datasheet before a plan places the models."""

    name: str
    machine: str  # "cpu" | "gpu": the machine class the costs describe ("" for this machine, timed)
    target: CostCurve | Roofline | None = None
    draft: CostCurve | Roofline | None = None
    datasheet: Datasheet | None = None  # the curves follow from each plan's placement
    vram_gb: float | None = None  # the machine's GPU memory, where the profile knows it (a plan's budget)
    source: str = "timed on this machine"
    description: str = ""

    @property
    def timed(self) -> bool:
        return self.target is None and self.datasheet is None

    def placed(self, p: "Plan") -> "CostProfile":
        """These costs for models placed as `p`: a datasheet's curves from the roofline, else unchanged."""
        if self.datasheet is None:
            return self
        hw = self.datasheet
        return replace(self, target=Roofline(p.target, hw), draft=Roofline(p.draft, hw) if p.draft is not None else None)


# ---------------------------------------------------------------- what to price


@dataclass(frozen=True)
class ModeStats:
    """One decoding setting to project: what to plan, what its passes score, and how far one target pass gets
    it (from a bench file, or assumed)."""

    mode: str  # decoding mode (bench label without its settings)
    label: str  # bench label, e.g. "dsbd:beams=2"
    request: PlanRequest  # its memory plan: the mode's shapes at its W, W_S and gamma
    drafts: bool  # a draft model runs (W_S, gamma and the draft passes apply)
    target_tokens: int  # n_t: tokens one target pass scores (measured distinct tokens where a bench file has them)
    draft_tokens: tuple[int, ...]  # tokens each of an iteration's draft passes scores
    tokens_per_target_pass: float  # tau
    draft_passes_per_target_pass: float  # d
    source: str  # "bench" | "assumed a=..." | "1 token/pass"


# ---------------------------------------------------------------- projections


@dataclass(frozen=True)
class Projection:
    """Projected (not measured) speed of one mode on one cost profile."""

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
    drafts: bool = False  # W_S, gamma and the draft passes apply (the table shows "-" otherwise)

    def as_dict(self) -> dict:
        out = {"kind": "projection", **asdict(self)}
        del out["drafts"]  # the mode's fact, not a projection
        return out


def project(target, draft, budget: MemoryBudget, costs: CostProfile, stats: list[ModeStats]) -> list[Projection]:
    """One projection per ModeStats: plan that setting's memory, then price its iteration on `costs`."""
    if costs.timed:
        raise PlanError("projections need another machine's cost profile (a datasheet or a curves file): "
                        "this machine's passes are timed only with the models loaded (`dsbd-chat bench`)")
    out = []
    for st in stats:
        if st.drafts and draft is None:
            continue
        req, n_t, n_d = st.request, st.target_tokens, st.draft_tokens
        common = dict(label=st.label, mode=st.mode, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma,
                      target_tokens=n_t, draft_passes=st.draft_passes_per_target_pass,
                      tokens_per_target_pass=st.tokens_per_target_pass, stats_source=st.source, drafts=st.drafts)
        try:
            p = plan(target, draft, req, budget)
        except PlanError as e:
            out.append(Projection(**common, fits=False, target_pass_ms=None, draft_pass_ms=None, tokens_per_s=None,
                                  bound="-", why=str(e).split(". To make it fit")[0]))
            continue
        priced = costs.placed(p)
        t = priced.target(n_t)
        drafts = [priced.draft(n) for n in n_d] if priced.draft is not None and p.draft is not None and n_d else []
        d_mean = sum(drafts) / len(drafts) if drafts else 0.0
        iteration = t + d_mean * st.draft_passes_per_target_pass
        bound = pass_cost(p.target, costs.datasheet, n_t).bound if costs.datasheet else "curve"
        out.append(Projection(**common, fits=True, target_pass_ms=t * 1e3,
                              draft_pass_ms=d_mean * 1e3 if drafts else None,
                              tokens_per_s=st.tokens_per_target_pass / iteration, bound=bound))
    return out


def describe(costs: CostProfile) -> str:
    """One line naming a profile's machine and where its numbers come from."""
    hw = costs.datasheet
    if hw is None:
        return f"{costs.name}: {costs.description or costs.source}"
    gpu = (f"{hw.vram_gb:g} GiB VRAM, H2D {hw.h2d_gbps:g} GB/s, {hw.tflops:g} TFLOP/s, {hw.mem_gbps:g} GB/s"
           if hw.has_gpu else "no GPU")
    return (f"{costs.name} (datasheet): {gpu}; CPU {hw.cpu_tflops:g} TFLOP/s, RAM {hw.ram_gbps:g} GB/s, "
            f"{hw.overhead_ms:g} ms/pass overhead")


def format_projections(costs: CostProfile, rows: list[Projection]) -> str:
    lines = [f"PROJECTIONS (not measurements) on the cost profile {describe(costs)}"]
    head = ("mode", "W", "W_S", "gamma", "target tok/pass", "target ms", "draft ms", "drafts/iter", "tokens/iter",
            "bound", "tok/s (proj.)", "stats")
    table = [head]
    for r in rows:
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        table.append((r.label, str(r.beams), str(r.draft_beams) if r.drafts else "-",
                      str(r.gamma) if r.drafts else "-", str(r.target_tokens),
                      f(r.target_pass_ms, ".2f"), f(r.draft_pass_ms, ".2f"),
                      f"{r.draft_passes:.2f}" if r.drafts else "-",
                      f"{r.tokens_per_target_pass:.2f}", r.bound,
                      f(r.tokens_per_s, ".1f") if r.fits else "does not fit", r.stats_source))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines += [f"  {r.label}: {r.why}" for r in rows if not r.fits]
    return "\n".join(lines)


# ---------------------------------------------------------------- the plan command's report


@dataclass(frozen=True)
class PlanReport:
    """`dsbd-chat plan`'s answer: the memory plan and, with a cost profile, the projected speeds."""

    target: "ModelGeometry"
    draft: "ModelGeometry | None"
    plan: "Plan"
    costs: CostProfile | None = None
    projections: tuple[Projection, ...] = ()
    paths: tuple[str, str | None] = ("", None)  # where the target and draft files are

    def as_dict(self) -> dict:
        out = {"plan": self.plan.as_dict(),
               "models": {"target": self.target.__dict__ | {"path": self.paths[0]},
                          "draft": self.draft.__dict__ | {"path": self.paths[1]} if self.draft else None}}
        if self.costs is not None:
            out |= {"cost_profile": {"name": self.costs.name, "machine": self.costs.machine,
                                     "described": describe(self.costs),
                                     "datasheet": self.costs.datasheet.__dict__ if self.costs.datasheet else None},
                    "projections": [x.as_dict() for x in self.projections]}
        return out

    def format(self) -> str:
        def one(role, g):
            return f"{role} {g.name} ({g.quant}, {g.n_layers} layers, {format_bytes(g.weight_bytes)})"

        lines = ["; ".join(one(r, g) for r, g in (("target", self.target), ("draft", self.draft)) if g is not None),
                 self.plan.format()]
        if self.costs is not None:
            lines += ["", format_projections(self.costs, list(self.projections))]
        return "\n".join(lines)
