"""What the planner, the engine and the runtimes agree on about each model runtime, stated once.

offload/ is the lowest floor, so the runtimes (backends/), the planner (offload.plan) and the engine (app/engine)
all read these facts here: a runtime's limits, how it holds KV and where its layers may go. No code asks for a
runtime by name elsewhere; it reads the runtime's row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """One model runtime as memory planning and context sizing see it: plain facts."""

    name: str  # ModelSpec.backend and ModelInfo.backend
    label: str  # how messages name it
    # True: every layer computes on the GPU, and layers VRAM cannot hold stream from pinned RAM (offload.stream);
    # False: the last n_gpu_layers layers sit on the GPU with their KV, the rest compute on the CPU
    streams_layers: bool
    unified_kv: bool  # one cache of KV cells shared by every row (shared prefixes stored once); else one per row
    dequantizes: bool  # weights and KV in the runtime dtype (DTYPE_BYTES); else the file's blocks, KV_TYPE_BYTES
    batch: int  # most tokens one forward takes: a prompt is fed in chunks of this size, a forest must fit in one
    max_seqs: int = 0  # sequence ids one context may use (rows and forest branches); 0: no bound
    scratch_slots: int = 0  # KV slots per row beyond the context (where padded queries write)
    host_logits: bool = False  # keeps float32 logits for max(batch, max_seqs) outputs in host RAM


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    # llama.cpp: n_batch bounds the forest (its compute buffer grows with it); 256 sequence ids are compiled in
    Runtime("llamacpp", "llama.cpp", streams_layers=False, unified_kv=True, dequantizes=False, batch=512,
            max_seqs=256, host_logits=True),
    # PyTorch: static KV [rows, heads, context + 1, dim]; the prefill chunk bounds the [q, slots] mask
    Runtime("pytorch", "PyTorch", streams_layers=True, unified_kv=False, dequantizes=True, batch=256,
            scratch_slots=1),
)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # dequantising runtimes: weights and KV
KV_TYPE_BYTES = {"f32": 4, "f16": 2}  # KV cache types of the others (llama.cpp's default is f32)


def resident_mask(n_layers: int, resident: int) -> tuple[bool, ...]:
    """Which layers stay on the GPU: streamed ones spread evenly, so each copy overlaps resident compute."""
    streamed = n_layers - max(0, min(resident, n_layers))
    out = [True] * n_layers
    for i in range(streamed):
        out[(2 * i + 1) * n_layers // (2 * streamed)] = False
    return tuple(out)
