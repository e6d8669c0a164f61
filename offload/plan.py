"""Memory planner: fit a target, a draft and their beams' KV into a VRAM and a RAM budget.

Inputs: each model's geometry (offload.geometry: layer sizes, KV shape; read from headers, never the
weights), the runtime that will hold it (its facts: offload.runtimes), the context, W / W_S / gamma, the
decoding modes to try as `ModeShape`s (app/engine/planning.py builds them from the app's mode facts; the planner
knows no mode by name), and the budgets. Output: a frozen `Plan` saying which layers sit on the GPU, which
stream from pinned RAM (PyTorch runtime), which run on the CPU (no GPU, or llama.cpp layers past
`n_gpu_layers`), the KV budget, whether the full mode (W rows) fits, the largest context and the most beams
that fit.

Given several shapes (auto mode with a draft: DSBD and its memory twin), the plan picks the one that fits
with the fewest weight bytes per pass outside VRAM (streamed or on CPU layers), the first on a tie: full mode
when its KV fits beside resident weights, memory mode when full mode's KV would push layers off the GPU
(spec §9: "memory mode when full mode does not fit the KV budget").

Priorities, highest first: whatever must be on the GPU (PyTorch: KV, embeddings, output head, activations;
llama.cpp: its compute buffer), then the draft's layers (it runs gamma passes per target pass, so a
resident byte of draft saves gamma transfers), then the target's layers. A PyTorch target that does not
fit keeps `ring` GPU buffers and streams the rest of its layers from pinned RAM (offload.stream).

KV (spec §9; b = KV bytes per token per row): the runtimes allocate whole rows of `context` tokens
(PyTorch: static [rows, heads, context + 1, dim]; llama.cpp: we size its unified cache the same way, the
worst case when no prefix is shared), so target KV = b x W x context in full mode (the spec's
b W (L + N_max) with L + N_max <= context) and b x context in memory mode (b (L + W_S gamma)). The draft's
context has as many rows as the target's.

Activation sizes are estimates (attention scores, MLP and logit buffers of the largest forward); a reserve
(default 512 MiB VRAM, 2 GiB RAM) absorbs the CUDA context, allocator slack and the app itself.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from offload.errors import BackendError
from offload.runtimes import DTYPE_BYTES, KV_TYPE_BYTES, RUNTIMES, Runtime, resident_mask

if TYPE_CHECKING:
    from offload.geometry import ModelGeometry

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def tree_tokens(nodes_per_layer: int, gamma: int) -> int:
    """Context cells one iteration's forest takes beyond the committed tokens: `nodes_per_layer` (W_S drafts, plus
    any lookup nodes) in each of gamma layers, and the next token's."""
    return nodes_per_layer * gamma + 1


@dataclass(frozen=True)
class ModeShape:
    """A decoding mode as memory sees it: plain facts, no decoding logic (app/engine/planning.py builds one
    from the mode's row of app.config.MODE_FACTS). The planner prints `name` and reasons with the rest."""

    name: str
    keeps_rows: bool  # W target (and draft) KV rows between steps; else one
    drafts: bool  # a draft model runs, and its tree (W_S x gamma tokens) rides on the target's pass
    # the same decoding carrying one row: the fix to offer when W rows do not fit
    memory_twin: "ModeShape | None" = None
    lookups: bool = False  # its forest layers may hold lookup nodes beside the drafts

    def rows(self, beams: int) -> int:
        return beams if self.keeps_rows else 1

    def tree_tokens(self, draft_beams: int, gamma: int, lookup_nodes: int = 0) -> int:
        """Context cells one iteration's forest needs beyond the committed tokens (1 without drafts: the next
        token's)."""
        per_layer = draft_beams + (lookup_nodes if self.lookups else 0) if self.drafts else 0
        return tree_tokens(per_layer, gamma)


SMALLER_QUANTS = (("Q5_K_M", 5.7), ("Q4_K_M", 4.85), ("Q3_K_M", 3.9), ("Q2_K", 3.35))  # typical bits/weight


class PlanError(BackendError):
    """The models do not fit the memory budget (or the request is invalid); the message says what would."""


# ---------------------------------------------------------------- sizes


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'8GiB' / '8GB' / '512MiB' / '8G' / '1.5 gib' / '1024' -> bytes. Bare K/M/G/T are binary (like `free -g`)."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"cannot read size {text!r}: use a number with a unit, like 8GiB, 8GB, 512MiB or 8G")
    number, prefix, binary, b = m.groups()
    power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
    base = 1000 if (prefix and b and not binary) else 1024  # GB = 10^9, GiB = G = 2^30
    return int(float(number) * base**power)


def format_bytes(n: int | float) -> str:
    """A size as people read it, in the binary units parse_size reads back: 512 B, 1.5 KiB, 93.8 MiB, 1.50 GiB. The
    one way the app writes a size: of a file, a model, memory."""
    for unit, size, digits in (("GiB", GiB, 2), ("MiB", MiB, 1), ("KiB", KiB, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class MemoryBudget:
    """Memory we may use, in bytes. vram = 0 means no GPU: every layer computes on the CPU."""

    vram: int
    ram: int
    vram_reserve: int = 512 * MiB
    ram_reserve: int = 2 * GiB
    source: str = "explicit"  # "explicit" | "detected" | a profile name

    @property
    def has_gpu(self) -> bool:
        return self.vram > 0

    @property
    def vram_avail(self) -> int:
        return max(0, self.vram - self.vram_reserve)

    @property
    def ram_avail(self) -> int:
        return max(0, self.ram - self.ram_reserve)

    @classmethod
    def detect(cls, *, vram: int | None = None, ram: int | None = None, device: str = "cuda", **kw) -> "MemoryBudget":
        """Explicit numbers where given; free VRAM from torch.cuda.mem_get_info and available RAM from psutil."""
        source = "explicit"
        if vram is None:
            vram, source = detect_vram(device), "detected"
        if ram is None:
            import psutil

            ram, source = psutil.virtual_memory().available, "detected"
        return cls(vram=vram, ram=ram, source=source, **kw)


# Where a GPU that torch could use shows itself on Linux: NVIDIA's driver, ROCm's kernel driver, WSL's GPU.
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def detect_vram(device: str = "cuda") -> int:
    """Free bytes on the CUDA device (0 without torch or CUDA). Asks offload.stream, the module that talks to
    the device, so importing the planner never imports torch; on a Linux machine with no GPU driver at all it
    does not ask (importing torch takes a second or two of a load there)."""
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _GPU_NODES):
        return 0
    try:
        from offload.stream import free_vram
    except ImportError:
        return 0
    return free_vram(device)


@dataclass(frozen=True)
class PlanRequest:
    """What to fit: one decoding mode, or the choice among several (auto), at these numbers.
    app/engine/planning.plan_request builds it from mode names and the app's limits."""

    # the modes to try: the one reading the fewest weights outside VRAM wins (first on a tie)
    shapes: tuple[ModeShape, ...]
    # the mode whose fit and most beams the plan reports (W rows: DSBD, or beam sampling without a draft)
    full: ModeShape
    beam_limit: int  # most beams W a request may ask for
    gamma_limit: int  # deepest draft a request may ask for
    context: int = 4096  # tokens per sequence: prompt + answer + draft tree (the engine's n_ctx)
    beams: int = 4  # W
    draft_beams: int | None = None  # W_S; None -> W + 1
    gamma: int = 3
    target_backend: str = "llamacpp"
    draft_backend: str = "llamacpp"
    dtype: str = "float32"  # weights and KV of a dequantising runtime (PyTorch)
    kv_type: str = "f32"  # llama.cpp KV cache
    ring: int = 2  # GPU buffers for streamed layers (2 = compute one while the next one copies)

    def validated(self) -> "PlanRequest":
        if not self.shapes:
            raise PlanError("a plan request needs at least one decoding mode")
        for b in (self.target_backend, self.draft_backend):
            if b not in RUNTIMES:
                raise PlanError(f"unknown backend {b!r}; choose {' or '.join(RUNTIMES)}")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
        if self.kv_type not in KV_TYPE_BYTES:
            raise PlanError(f"unknown kv type {self.kv_type!r}; choose one of: {', '.join(KV_TYPE_BYTES)}")
        if not 1 <= self.beams <= self.beam_limit:
            raise PlanError(f"beams must be between 1 and {self.beam_limit}, got {self.beams}")
        ws = self.beams + 1 if self.draft_beams is None else self.draft_beams
        if ws < self.beams:
            raise PlanError(f"draft beams (W_S={ws}) must be >= beams (W={self.beams})")
        if not 0 <= self.gamma <= self.gamma_limit:
            raise PlanError(f"gamma must be between 0 and {self.gamma_limit}, got {self.gamma}")
        if self.ring < 1:
            raise PlanError(f"ring must be >= 1, got {self.ring}")
        tree = tree_tokens(ws, self.gamma)
        if self.context < tree + 1:
            raise PlanError(f"context {self.context} cannot hold even the draft tree (W_S x gamma + 1 = {tree}) plus "
                            "a token")
        return replace(self, draft_beams=ws)


# ---------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Placement:
    """Where one model's weights, KV and buffers live."""

    role: str  # "target" | "draft"
    name: str
    runtime: str  # a key of offload.runtimes.RUNTIMES
    n_layers: int
    gpu_layers: int  # resident on the GPU
    streamed_layers: int  # pinned RAM -> GPU ring each pass (PyTorch runtime)
    cpu_layers: int  # computed on the CPU
    n_gpu_layers: int | None  # llama.cpp setting (n_layers + 1 also offloads the output layer); None: streamed
    ring: int  # GPU buffers for streamed layers
    device: str  # a streaming runtime's device ("cuda" | "cpu"); llama.cpp: where its layers mostly are
    kv_rows: int
    kv_tokens: int  # per row
    kv_bytes: int
    kv_gpu_bytes: int
    weight_gpu_bytes: int  # resident layers + ring buffers + embeddings/head on the GPU
    weight_ram_bytes: int  # streamed (pinned) + CPU layers + host-side embeddings/head
    activation_bytes: int  # estimate of the largest forward's transient buffers
    vram_bytes: int  # total on the GPU
    ram_bytes: int  # total in host memory (PyTorch on a GPU: peak while loading, the whole model on CPU)
    # per-pass traffic, for offload.cost
    h2d_bytes: int  # streamed weights copied per pass
    gpu_read_bytes: int  # weights read from VRAM per pass
    cpu_read_bytes: int  # weights read from RAM per pass by CPU compute
    gpu_params: int  # matmul parameters computed on the GPU (embedding lookup excluded)
    cpu_params: int
    kv_bytes_per_token: int  # b, per row


@dataclass(frozen=True)
class Plan:
    """A placement for one decoding mode plus what else would fit. Sizes in bytes."""

    mode: str
    context: int
    beams: int
    draft_beams: int
    gamma: int
    budget: MemoryBudget
    target: Placement
    draft: Placement | None
    vram_bytes: int
    ram_bytes: int
    kv_full_bytes: int  # target KV in full mode: b W context (spec §9: b W (L + N_max))
    kv_mem_bytes: int  # target KV in memory mode: b context (spec §9: b (L + W_S gamma))
    dsbd_full_fits: bool | None  # the full mode (W rows) fits; None without a draft
    max_beams: int  # most W for the full mode at this context; 0: none
    max_context: int  # largest context for `mode` at these beams
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        return format_plan(self)


# ---------------------------------------------------------------- one model


@dataclass(frozen=True)
class _Held:
    """A model as its runtime holds it: bytes per layer, embeddings, head, KV per token per layer."""

    geo: "ModelGeometry"
    role: str
    rt: Runtime
    layer: tuple[int, ...]
    embed: int
    head: int
    kv_token_layer: int

    @classmethod
    def of(cls, geo: "ModelGeometry", role: str, rt: Runtime, *, dtype: str, kv_type: str) -> "_Held":
        if rt.dequantizes:  # to the runtime dtype at load
            e = DTYPE_BYTES[dtype]
            return cls(geo, role, rt, tuple(p * e for p in geo.layer_params), geo.embed_params * e,
                       geo.head_params * e, 2 * geo.n_kv_heads * geo.head_dim * e)
        e = KV_TYPE_BYTES[kv_type]
        return cls(geo, role, rt, geo.layer_bytes, geo.embed_bytes, geo.head_bytes,
                   2 * geo.n_kv_heads * geo.head_dim * e)


def _activations(m: _Held, *, rows: int, ctx: int, tree: int, elem: int) -> int:
    """Largest forward's transient bytes (estimate): scores + mask, QKV/MLP activations, logits. `tree`: the
    forest's cells (tree_tokens), so each row's next token and the forest's nodes make rows + tree - 1 outputs."""
    g, chunk = m.geo, min(m.rt.batch, ctx)
    if m.rt.unified_kv:
        shapes = [(1, chunk, rows + tree - 1)]  # (rows, queries, outputs): one ubatch over the unified cache
    else:
        shapes = [(1, chunk, 0), (rows, tree, rows + tree - 1)]  # a prompt chunk; each row's suffix and tree
    worst = 0
    for r, q, outputs in shapes:
        scores = r * q * ctx * (g.n_heads * 4 + 1)  # [rows, heads, q, ctx] float32 worst case + bool mask
        hidden = r * q * (3 * g.hidden_dim + 6 * g.dim) * max(elem, 4)
        logits = outputs * g.vocab_size * 4 * 2  # runtime dtype + float32 copy
        worst = max(worst, scores + hidden + logits)
    return worst


def _fixed_gpu(m: _Held, *, rows: int, ctx: int, tree: int, elem: int) -> tuple[int, int]:
    """(bytes that must be on the GPU whatever the layer split, activation estimate)."""
    act = _activations(m, rows=rows, ctx=ctx, tree=tree, elem=elem)
    if m.rt.streams_layers:  # every layer computes on the GPU: embeddings, head and all KV live there
        kv = rows * (ctx + m.rt.scratch_slots) * m.kv_token_layer * len(m.layer)
        return m.embed + m.head + kv + act, act
    return act, act  # a compute buffer; layers and their KV may all stay on the CPU


def _place(m: _Held, *, rows: int, ctx: int, tree: int, elem: int, gpu: bool, layer_budget: int,
           ring: int) -> Placement:
    """Split one model's layers given `layer_budget` VRAM bytes left for its layers (after fixed parts)."""
    n = len(m.layer)
    fixed, act = _fixed_gpu(m, rows=rows, ctx=ctx, tree=tree, elem=elem)
    kv_layer = rows * (ctx + m.rt.scratch_slots) * m.kv_token_layer  # one layer's KV, all rows
    kv_total = kv_layer * n
    params_layers = sum(m.geo.layer_params)
    tied = m.geo.tied_embeddings  # the output projection is the embedding matrix
    params_head = m.geo.head_params + (m.geo.embed_params if tied else 0)
    head_read = m.head + (m.embed if tied else 0)
    common = dict(role=m.role, name=m.geo.name, runtime=m.rt.name, n_layers=n, kv_rows=rows, kv_tokens=ctx,
                  kv_bytes=kv_total, activation_bytes=act, kv_bytes_per_token=m.kv_token_layer * n)
    full = sum(m.layer) + m.embed + m.head
    if not gpu:  # everything on the CPU, in RAM
        host = full + kv_total + act + _host_logits(m)
        return Placement(**common, gpu_layers=0, streamed_layers=0, cpu_layers=n,
                         n_gpu_layers=None if m.rt.streams_layers else 0, ring=0, device="cpu",
                         kv_gpu_bytes=0, weight_gpu_bytes=0, weight_ram_bytes=full, vram_bytes=0, ram_bytes=host,
                         h2d_bytes=0, gpu_read_bytes=0, cpu_read_bytes=sum(m.layer) + head_read, gpu_params=0,
                         cpu_params=params_layers + params_head)
    if m.rt.streams_layers:
        return _place_streamed(m, common, fixed, layer_budget, ring, kv_total, params_layers + params_head, full,
                               head_read)
    return _place_split(m, common, fixed, layer_budget, kv_layer, act, params_head, head_read)


def _place_streamed(m, common, fixed, budget, ring, kv_total, params, full, head_read) -> Placement:
    n, big = len(m.layer), max(m.layer)
    k, r = n, 0
    if sum(m.layer) > budget:  # stream: keep `ring` buffers, then as many resident layers as still fit
        k = 0
        for cand in range(n - 1, -1, -1):
            r = min(ring, n - cand)
            mask = resident_mask(n, cand)
            if sum(b for b, res in zip(m.layer, mask) if res) + r * big <= budget:
                k = cand
                break
        r = min(ring, n - k)
    mask = resident_mask(n, k)
    resident = sum(b for b, res in zip(m.layer, mask) if res)
    streamed = sum(m.layer) - resident
    w_gpu = resident + r * big + m.embed + m.head
    return Placement(**common, gpu_layers=k, streamed_layers=n - k, cpu_layers=0, n_gpu_layers=None, ring=r,
                     device="cuda", kv_gpu_bytes=kv_total, weight_gpu_bytes=w_gpu, weight_ram_bytes=streamed,
                     vram_bytes=fixed + resident + r * big,
                     ram_bytes=full,  # loaded on the CPU first, then offloaded (stream.offload_model)
                     h2d_bytes=streamed, gpu_read_bytes=sum(m.layer) + head_read, cpu_read_bytes=0,
                     gpu_params=params, cpu_params=0)


def _host_logits(m: _Held) -> int:
    """A runtime's host output buffer (llama.cpp: n_outputs_max rows of float32 logits)."""
    return max(m.rt.batch, m.rt.max_seqs) * m.geo.vocab_size * 4 if m.rt.host_logits else 0


def _place_split(m, common, fixed, budget, kv_layer, act, params_head, head_read) -> Placement:
    n = len(m.layer)
    k, used = 0, 0
    for b in reversed(m.layer):  # llama.cpp offloads the last n_gpu_layers layers, each with its KV
        if used + b + kv_layer > budget:
            break
        used, k = used + b + kv_layer, k + 1
    # The output layer (a duplicate of the embeddings when tied) goes to the GPU only after every block.
    head_on_gpu = k == n and used + head_read <= budget
    gpu_w = sum(m.layer[n - k:]) + (head_read if head_on_gpu else 0)
    cpu_w = sum(m.layer[: n - k]) + (0 if head_on_gpu else m.head)
    cpu_read = cpu_w + (0 if head_on_gpu else head_read - m.head)
    logits = _host_logits(m)
    gpu_p = sum(m.geo.layer_params[n - k:]) + (params_head if head_on_gpu else 0)
    cpu_p = sum(m.geo.layer_params[: n - k]) + (0 if head_on_gpu else params_head)
    return Placement(**common, gpu_layers=k, streamed_layers=0, cpu_layers=n - k,
                     n_gpu_layers=k + head_on_gpu, ring=0, device="cuda" if k else "cpu",
                     kv_gpu_bytes=k * kv_layer, weight_gpu_bytes=gpu_w, weight_ram_bytes=cpu_w + m.embed,
                     vram_bytes=fixed + gpu_w + k * kv_layer if k else 0,  # no GPU layer: no GPU buffer
                     ram_bytes=cpu_w + m.embed + (n - k) * kv_layer + act + logits,
                     h2d_bytes=0, gpu_read_bytes=gpu_w, cpu_read_bytes=cpu_read, gpu_params=gpu_p, cpu_params=cpu_p)


# ---------------------------------------------------------------- whole plan


@dataclass(frozen=True)
class _Try:
    shape: ModeShape
    target: Placement
    draft: Placement | None
    vram: int
    ram: int
    fits: bool


def _try(tgt: "ModelGeometry", dft: "ModelGeometry | None", req: PlanRequest, budget: MemoryBudget, shape: ModeShape,
         *, context: int | None = None, beams: int | None = None) -> _Try:
    """Place both models for one mode; `fits` says whether both budgets hold."""
    ctx = req.context if context is None else context
    w = req.beams if beams is None else beams
    ws = req.draft_beams + (w - req.beams)  # keep W_S - W when trying other widths
    rows = shape.rows(w)
    uses_draft = shape.drafts and dft is not None
    tree = tree_tokens(ws if uses_draft else 0, req.gamma)
    held = [_Held.of(tgt, "target", RUNTIMES[req.target_backend], dtype=req.dtype, kv_type=req.kv_type)]
    if uses_draft:
        held.append(_Held.of(dft, "draft", RUNTIMES[req.draft_backend], dtype=req.dtype, kv_type=req.kv_type))
    elem = DTYPE_BYTES[req.dtype]
    fixed = {m.role: _fixed_gpu(m, rows=rows, ctx=ctx, tree=tree, elem=elem)[0] for m in held}
    left = budget.vram_avail - sum(fixed.values())
    # A streamed target needs its ring whatever the draft takes; keep room for it first.
    t = held[0]
    keep = min(req.ring, len(t.layer)) * max(t.layer) if t.rt.streams_layers and sum(t.layer) > left else 0
    placed = {}
    for m in reversed(held):  # draft layers before target layers (see module docstring)
        room = max(0, left - (keep if m.role == "draft" else 0))
        p = _place(m, rows=rows, ctx=ctx, tree=tree, elem=elem, gpu=budget.has_gpu, layer_budget=room,
                   ring=req.ring)
        left -= p.vram_bytes - fixed[m.role]
        placed[m.role] = p
    vram = sum(p.vram_bytes for p in placed.values())
    ram = sum(p.ram_bytes for p in placed.values())
    fits = vram <= budget.vram_avail and ram <= budget.ram_avail
    return _Try(shape, placed["target"], placed.get("draft"), vram, ram, fits)


def _slow_bytes(t: _Try) -> int:
    """Weight bytes per iteration that do not come from VRAM: streamed over PCIe or read by CPU layers."""
    return sum(p.h2d_bytes + p.cpu_read_bytes for p in (t.target, t.draft) if p is not None)


def max_context(tgt, dft, req: PlanRequest, budget: MemoryBudget, shape: ModeShape, *, beams: int | None = None) -> int:
    """Largest context (a multiple of 256 above 512) for `shape` that fits; 0 when even the smallest does not."""
    ws = req.draft_beams + ((beams or req.beams) - req.beams)
    lo = shape.tree_tokens(ws, req.gamma) + 1  # the forest and one committed token
    hi = tgt.n_ctx_train if dft is None or not shape.drafts else min(tgt.n_ctx_train, dft.n_ctx_train)
    hi = max(hi, lo)
    if not _try(tgt, dft, req, budget, shape, context=lo, beams=beams).fits:
        return 0
    while lo < hi:  # fits(lo) holds; find the largest fitting context in [lo, hi]
        mid = (lo + hi + 1) // 2
        if _try(tgt, dft, req, budget, shape, context=mid, beams=beams).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo - lo % 256 if lo >= 512 else lo


def max_beams(tgt, dft, req: PlanRequest, budget: MemoryBudget, shape: ModeShape) -> int:
    """Most beams W (up to the request's limit) for which `shape` fits at the requested context; 0 when none."""
    best = 0
    for w in range(1, req.beam_limit + 1):
        if req.draft_beams + (w - req.beams) < w or not _try(tgt, dft, req, budget, shape, beams=w).fits:
            break
        best = w
    return best


def plan(target: "ModelGeometry", draft: "ModelGeometry | None", request: PlanRequest, budget: MemoryBudget) -> Plan:
    """Placement for the requested mode, or for the pick among several (see the module docstring). Raises
    PlanError saying what would fit when nothing does."""
    req = request.validated()
    tries = [_try(target, draft, req, budget, s) for s in req.shapes]
    fitting = [t for t in tries if t.fits]
    if not fitting:
        raise PlanError(_no_fit_message(target, draft, req, budget, tries))
    # The mode whose weights come from VRAM the most (full mode's KV may push layers off the GPU); ties keep
    # the request's order.
    chosen = min(fitting, key=_slow_bytes)
    full = next((t for t in tries if t.shape == req.full), None) or _try(target, draft, req, budget, req.full)
    b = full.target.kv_bytes_per_token
    notes = []
    if len(tries) > 1 and chosen.shape != req.full:
        why = (f"would read {format_bytes(_slow_bytes(full))} of weights per pass outside VRAM ({chosen.shape.name}: "
               f"{format_bytes(_slow_bytes(chosen))})" if full.fits else
               f"needs {format_bytes(full.vram)} VRAM / {format_bytes(full.ram)} RAM")
        notes.append(f"{req.full.name} full mode {why}; memory-reduced mode carries one beam between iterations")
    if chosen.target.streamed_layers:
        notes.append(f"{chosen.target.streamed_layers} target layers stream from pinned RAM every pass "
                     f"({format_bytes(chosen.target.h2d_bytes)} per pass)")
    split = [p for p in (chosen.target, chosen.draft) if p is not None and p.n_gpu_layers is not None]
    if split and budget.has_gpu:
        notes.append(f"{RUNTIMES[split[0].runtime].label}: load " + " and ".join(
            f"the {p.role} with n_gpu_layers={p.n_gpu_layers}" for p in split))
    if (rt := RUNTIMES[req.target_backend]).unified_kv and chosen.shape.rows(req.beams) > 1:
        notes.append(f"{rt.label}'s unified cache stores shared prefixes once: its real KV use is lower than planned")
    return Plan(
        mode=chosen.shape.name, context=req.context, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma,
        budget=budget, target=chosen.target, draft=chosen.draft, vram_bytes=chosen.vram, ram_bytes=chosen.ram,
        kv_full_bytes=b * req.full.rows(req.beams) * req.context, kv_mem_bytes=b * req.context,
        dsbd_full_fits=full.fits if draft is not None else None,
        max_beams=max_beams(target, draft, req, budget, req.full),
        max_context=max_context(target, draft, req, budget, chosen.shape),
        notes=tuple(notes),
    )


# ---------------------------------------------------------------- messages


def _no_fit_message(tgt, dft, req: PlanRequest, budget: MemoryBudget, tries: list[_Try]) -> str:
    t = tries[-1]  # the least demanding mode we tried
    short = []
    if t.vram > budget.vram_avail:
        short.append(f"{format_bytes(t.vram)} VRAM but {format_bytes(budget.vram_avail)} is usable "
                     f"({format_bytes(budget.vram)} - {format_bytes(budget.vram_reserve)} reserve)")
    if t.ram > budget.ram_avail:
        short.append(f"{format_bytes(t.ram)} RAM but {format_bytes(budget.ram_avail)} is usable "
                     f"({format_bytes(budget.ram)} - {format_bytes(budget.ram_reserve)} reserve)")
    head = (f"{' / '.join(x.shape.name for x in tries)} at context {req.context}, W={req.beams}, "
            f"W_S={req.draft_beams}, gamma={req.gamma} does not fit: {t.shape.name} needs {' and '.join(short)}")
    fixes = []
    twin = req.shapes[0].memory_twin if len(req.shapes) == 1 else None
    if twin is not None and dft is not None and (mem := _try(tgt, dft, req, budget, twin)).fits:
        fixes.append(f"memory-reduced mode --mode {twin.name} (target KV {format_bytes(mem.target.kv_bytes)} "
                     f"instead of {format_bytes(t.target.kv_bytes)})")
    for s in dict.fromkeys(x.shape for x in reversed(tries)):
        if (c := max_context(tgt, dft, req, budget, s)) > 0:
            fixes.append(f"a smaller context: --context {c} (the largest that fits {s.name})")
            break
    if t.shape.keeps_rows and req.beams > 1 and (w := max_beams(tgt, dft, req, budget, t.shape)) > 0:
        fixes.append(f"fewer beams: --beams {w}")
    fixes += _smaller_weights(tgt, dft, req, budget, t.shape)
    if not fixes:
        need = [f"{format_bytes(t.vram - budget.vram_avail)} more VRAM" if t.vram > budget.vram_avail else "",
                f"{format_bytes(t.ram - budget.ram_avail)} more RAM" if t.ram > budget.ram_avail else ""]
        return (f"{head}. Free {' and '.join(x for x in need if x)}: no smaller context, beam count, mode, "
                "dtype or quant fits")
    return head + ". To make it fit, use " + "; or ".join(fixes)


def _smaller_weights(tgt, dft, req: PlanRequest, budget: MemoryBudget, shape: ModeShape) -> list[str]:
    """Hints for a lighter dtype (a dequantising runtime) or a smaller GGUF quant (the others), checked by
    re-planning."""
    out = []
    dequant = [RUNTIMES[b] for b in (req.target_backend, req.draft_backend) if RUNTIMES[b].dequantizes]
    if dequant and req.dtype == "float32":
        if _try(tgt, dft, replace(req, dtype="bfloat16"), budget, shape).fits:
            out.append(f"--dtype bfloat16 (halves {dequant[0].label} weights and KV)")
    for role in ("target", "draft"):
        geo = tgt if role == "target" else dft
        backend = req.target_backend if role == "target" else req.draft_backend
        if geo is None or RUNTIMES[backend].dequantizes or (role == "draft" and not shape.drafts):
            continue
        for quant, bpw in SMALLER_QUANTS:
            if bpw >= geo.bits_per_weight - 0.3:
                continue
            small = geo.with_bits_per_weight(bpw, quant)
            pair = (small, dft) if role == "target" else (tgt, small)
            if _try(*pair, req, budget, shape).fits:
                out.append(f"a {quant} quant of the {role} (~{format_bytes(small.weight_bytes)} instead of "
                           f"{format_bytes(geo.weight_bytes)} at {geo.quant})")
                break
    return out


def format_plan(p: Plan) -> str:
    """A human-readable table of the plan."""
    b = p.budget
    gpu = (f"VRAM {format_bytes(b.vram)} (usable {format_bytes(b.vram_avail)})" if b.has_gpu else "no GPU")
    lines = [
        f"budget ({b.source}): {gpu}, RAM {format_bytes(b.ram)} (usable {format_bytes(b.ram_avail)})",
        f"request: context {p.context}, W={p.beams}, W_S={p.draft_beams}, gamma={p.gamma}",
        f"mode: {p.mode}" + ("" if p.dsbd_full_fits is None else
                             f"  (dsbd full mode {'fits' if p.dsbd_full_fits else 'does not fit'})"),
        "",
    ]
    head = ("model", "runtime", "layers", "gpu", "streamed", "cpu", "n_gpu_layers", "weights GPU", "KV", "KV GPU",
            "VRAM", "RAM")
    rows = [head]
    for pl in filter(None, (p.target, p.draft)):
        rows.append((f"{pl.role}: {pl.name}"[:50], pl.runtime, str(pl.n_layers), str(pl.gpu_layers),
                     f"{pl.streamed_layers}" + (f" (ring {pl.ring})" if pl.ring else ""), str(pl.cpu_layers),
                     "-" if pl.n_gpu_layers is None else str(pl.n_gpu_layers), format_bytes(pl.weight_gpu_bytes),
                     format_bytes(pl.kv_bytes), format_bytes(pl.kv_gpu_bytes), format_bytes(pl.vram_bytes),
                     format_bytes(pl.ram_bytes)))
    rows.append(("total", "", "", "", "", "", "", "", "", "", format_bytes(p.vram_bytes), format_bytes(p.ram_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    kv_b = p.target.kv_bytes_per_token
    lines += [
        "",
        f"target KV: b = {format_bytes(kv_b)}/token/row; full mode b*W*context = {format_bytes(p.kv_full_bytes)}, "
        f"memory mode b*context = {format_bytes(p.kv_mem_bytes)}",
        f"max beams (full mode, context {p.context}): {p.max_beams}",
        f"max context ({p.mode}, W={p.beams}): {p.max_context}",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------- a target over RPC workers


@dataclass(frozen=True)
class HostShare:
    """One machine's part of an RPC target: its layers, their weights and KV, and what it has free."""

    host: str  # "this machine" or the worker's HOST:PORT and device
    first_layer: int | None  # None: no layer (the host keeps the head and embeddings)
    last_layer: int | None
    weight_bytes: int
    kv_bytes: int
    need_bytes: int  # weights + KV + compute buffer estimate (+ the draft and logits on the host)
    free_bytes: int

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes


def plan_hosts(geo: "ModelGeometry", workers: "list[tuple[str, int]]", *, context: int, rows: int,
               host_free: int, draft_bytes: int = 0, host_layers: int = 0, kv_type: str = "f32") -> tuple:
    """Per-machine memory of a target spread over RPC workers ((name, free bytes) each) the way the loader
    spreads it: the last n_layers - host_layers layers in proportion to free memory, the first ones, the
    embeddings, the output head (pinned to the host), the logits buffer and the draft on this machine."""
    n = geo.n_layers
    remote = max(0, n - max(0, host_layers))
    held = _Held.of(geo, "target", RUNTIMES["llamacpp"], dtype="float32", kv_type=kv_type)  # RPC is llama.cpp's
    kv_layer = rows * context * held.kv_token_layer
    act = _activations(held, rows=rows, ctx=context, tree=tree_tokens(0, 0), elem=4)
    total = float(sum(max(f, 1) for _, f in workers)) or 1.0
    share = [remote * max(f, 1) / total for _, f in workers]
    if share:
        share[-1] += 1.0  # the output layer's slot, which stays on the host
    cum, acc = [], 0.0
    for s in share:
        acc += s
        cum.append(acc / (remote + 1))
    owner: dict[int, int] = {}
    for j in range(remote):  # layer n - remote + j, as llama.cpp's upper_bound over the cumulative split
        owner[n - remote + j] = next((i for i, c in enumerate(cum) if c > j / (remote + 1)), len(cum) - 1)
    out = []
    host = list(range(n - remote))
    w_host = sum(geo.layer_bytes[i] for i in host) + held.embed + held.head
    need_host = w_host + len(host) * kv_layer + act + _host_logits(held) + draft_bytes
    out.append(HostShare("this machine", host[0] if host else None, host[-1] if host else None, w_host,
                         len(host) * kv_layer, need_host, host_free))
    for i, (name, free) in enumerate(workers):
        mine = sorted(k for k, o in owner.items() if o == i)
        w = sum(geo.layer_bytes[k] for k in mine)
        out.append(HostShare(name, mine[0] if mine else None, mine[-1] if mine else None, w, len(mine) * kv_layer,
                             w + len(mine) * kv_layer + (act if mine else 0), free))
    return tuple(out)


def format_hosts(shares) -> str:
    head = ("machine", "layers", "weights", "KV", "needs", "free", "fits")
    body = [(s.host, "-" if s.first_layer is None else f"{s.first_layer}-{s.last_layer}",
             *(format_bytes(n) for n in (s.weight_bytes, s.kv_bytes, s.need_bytes, s.free_bytes)),
             "yes" if s.fits else "NO") for s in shares]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *body)]
    return "\n".join(["per machine (target over RPC workers; the output head and the draft stay here):", *lines])
