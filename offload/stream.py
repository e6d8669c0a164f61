"""Layer streaming for the PyTorch runtime: non-resident layers live in (pinned) host memory and are copied
into a small ring of device buffers just before they run, the next ones prefetching while one computes.

The transformer does not change: `Transformer.layer_source` (any iterable of blocks) is swapped for a
`LayerStreamer`, which yields resident blocks as they are and streamed ones as a ring *shell*: a block
whose parameters are views into one flat device buffer that each copy refills. One flat host buffer per
streamed layer makes every transfer a single large memcpy (small copies waste PCIe bandwidth).

On CUDA the copies run on a side stream. Two events per ring slot order them: `ready` (the copy finished:
the compute stream waits on it before the layer runs) and `free` (the layer's kernels were queued: the copy
stream waits on it before overwriting the slot). With `ring` slots, copies run up to ring - 1 streamed
layers ahead; after a pass the first slots are refilled for the next pass while the head and the sampler run.
On CPU the same code runs with synchronous copies and no events, so the ring logic is tested everywhere.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from offload.errors import BackendError
from offload.runtimes import resident_mask

_ALIGN_BYTES = 256  # every view in a flat buffer starts 256-byte aligned, like a fresh allocation


def free_vram(device: str = "cuda") -> int:
    """Free bytes on the CUDA device (0 without CUDA or for a non-CUDA device)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return 0
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def _layout(module: nn.Module) -> tuple[list[tuple[str, torch.Size, int]], int, torch.dtype]:
    """[(parameter name, shape, element offset)], total elements (aligned), common dtype."""
    params = list(module.named_parameters())
    if any(True for _ in module.buffers()):
        raise ValueError("layer streaming supports parameter-only blocks (this block has buffers)")
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"layer streaming needs one dtype per block, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    out, off = [], 0
    for name, p in params:
        out.append((name, p.shape, off))
        off += -(-p.numel() // align) * align
    return out, off, dtype


def _point_into(module: nn.Module, layout, flat: torch.Tensor) -> None:
    """Make `module`'s parameters views into `flat` (contents are not copied)."""
    params = dict(module.named_parameters())
    for name, shape, off in layout:
        params[name].data = flat[off : off + shape.numel()].view(shape)


def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly `numel` elements.

    torch's caching host allocator (pin_memory=True) rounds every block up to a power of two, up to twice
    the RAM the planner counted, so we register an ordinary allocation with cudaHostRegister instead (as
    torch.distributed's state-dict stager does) and fall back to pin_memory=True if that is unavailable.
    """
    t = torch.empty(numel, dtype=dtype)
    try:
        ok = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), numel * t.element_size(), 0)) == 0
    except (AttributeError, RuntimeError, TypeError):
        ok = False
    if not ok:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    # Unpinned when this tensor object goes; views into it stay valid (merely pageable again).
    weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr()).atexit = False  # exit frees all
    return t


class _Slot:
    """One ring buffer: a shell block over a flat device tensor, plus its CUDA events."""

    def __init__(self, shell: nn.Module, flat: torch.Tensor, cuda: bool):
        self.shell, self.flat, self.holds = shell, flat, -1  # holds: streamed index now in the buffer
        self.ready = torch.cuda.Event() if cuda else None
        self.free = torch.cuda.Event() if cuda else None


class LayerStreamer:
    """An iterable of blocks for `Transformer.layer_source`; resident blocks on `device`, others streamed.

    layers: the model's blocks, in order (parameters on the CPU when streaming starts).
    resident: per layer, True = moved to `device` once; False = kept in host memory (pinned on CUDA).
    ring: device buffers for streamed layers (>= 1; 2 overlaps each copy with the previous layer's compute).
    trace: optional list receiving ("load", layer) and ("compute", layer) in issue order (tests).
    """

    def __init__(self, layers: Sequence[nn.Module], *, resident: Sequence[bool], device: str | torch.device,
                 ring: int = 2, trace: list | None = None):
        if len(resident) != len(layers):
            raise ValueError(f"resident has {len(resident)} entries for {len(layers)} layers")
        if ring < 1:
            raise ValueError(f"ring must be >= 1, got {ring}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._layers = list(layers)
        self._resident = tuple(bool(r) for r in resident)
        self._streamed = [i for i, r in enumerate(self._resident) if not r]  # streamed index -> layer index
        self._index = {i: j for j, i in enumerate(self._streamed)}  # layer index -> streamed index
        self.trace = trace
        self.loads = 0  # host -> device layer copies so far
        self.bytes_copied = 0
        for i, layer in enumerate(self._layers):
            if self._resident[i]:
                layer.to(self.device)
        self._host: list[torch.Tensor] = []
        self._slots: list[_Slot] = []
        if self._streamed:
            self._setup(min(ring, len(self._streamed)))
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda and self._streamed else None

    def _setup(self, ring: int) -> None:
        first = self._layers[self._streamed[0]]
        layout, numel, dtype = _layout(first)
        for i in self._streamed:
            layer = self._layers[i]
            lay, _, dt = _layout(layer)
            if [(s, o) for _, s, o in lay] != [(s, o) for _, s, o in layout] or dt != dtype:
                raise ValueError(f"layer {i} differs in shape or dtype from layer {self._streamed[0]}")
            # [numel] host store of layer i; pinned pages let the copy engine DMA without a staging copy.
            flat = _pinned_empty(numel, dtype) if self._cuda else torch.empty(numel, dtype=dtype)
            for (name, shape, off), (_, p) in zip(layout, layer.named_parameters()):
                flat[off : off + shape.numel()].copy_(p.detach().reshape(-1))
            _point_into(layer, layout, flat)  # the layer keeps working on the CPU and its state dict stays valid
            self._host.append(flat)
        for _ in range(ring):
            shell = copy.deepcopy(first)  # structure only: its parameters are re-pointed below
            flat = torch.empty(numel, dtype=dtype, device=self.device)  # [numel] one ring buffer
            _point_into(shell, layout, flat)
            self._slots.append(_Slot(shell, flat, self._cuda))

    @property
    def ring(self) -> int:
        return len(self._slots)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(self._streamed)

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied per pass when every streamed layer is loaded."""
        return sum(h.numel() * h.element_size() for h in self._host)

    def __len__(self) -> int:
        return len(self._layers)

    def _load(self, j: int) -> None:
        """Start copying streamed layer j into its slot (no-op when it is already there)."""
        slot = self._slots[j % len(self._slots)]
        if slot.holds == j:
            return
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(slot.free)  # the slot's previous layer has been queued to run
                slot.flat.copy_(self._host[j], non_blocking=True)
                slot.ready.record(self._copy_stream)
        else:
            slot.flat.copy_(self._host[j])
        slot.holds = j
        self.loads += 1
        self.bytes_copied += slot.flat.numel() * slot.flat.element_size()
        if self.trace is not None:
            self.trace.append(("load", self._streamed[j]))

    def __iter__(self):
        ring, n_streamed = len(self._slots), len(self._streamed)
        for i, layer in enumerate(self._layers):
            if self._resident[i]:
                if self.trace is not None:
                    self.trace.append(("compute", i))
                yield layer
                continue
            j = self._index[i]
            for k in range(j, min(j + ring, n_streamed)):  # this layer and up to ring - 1 ahead
                self._load(k)
            slot = self._slots[j % ring]
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            if self.trace is not None:
                self.trace.append(("compute", i))
            try:
                yield slot.shell
            finally:  # also when a forward is abandoned: the slot must not be refilled under running kernels
                if self._cuda:
                    slot.free.record(torch.cuda.current_stream(self.device))  # after the layer's kernels
        for k in range(min(ring, n_streamed)):  # prefetch the next pass's first streamed layers
            self._load(k)


def stream_layers(transformer: nn.Module, *, gpu_layers: int, device: str | torch.device = "cuda",
                  ring: int = 2, trace: list | None = None) -> LayerStreamer:
    """Keep `gpu_layers` layers (spread evenly) plus embeddings/norm/head on `device`, stream the rest.

    Swaps `transformer.layer_source`; the transformer's code is unchanged. Call on a model loaded on the CPU.
    """
    device = torch.device(device)
    for name, child in transformer.named_children():
        if name != "layers":
            child.to(device)  # embeddings, final norm, output head
    n = len(transformer.layers)
    streamer = LayerStreamer(transformer.layers, resident=resident_mask(n, gpu_layers), device=device,
                             ring=ring, trace=trace)
    transformer.layer_source = streamer
    return streamer


def offload_model(model, *, gpu_layers: int, device: str | torch.device = "cuda", ring: int = 2) -> LayerStreamer:
    """Offload a `backends.pytorch.runtime.PyTorchModel` loaded on the CPU (spec device "cpu"): afterwards its
    contexts put KV and inputs on `device` and its layers stream per `gpu_layers`. Make contexts after this."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"offload to {device} requested but CUDA is not available to torch")
    streamer = stream_layers(model.transformer, gpu_layers=gpu_layers, device=device, ring=ring)
    model.device = device
    info = model.info
    model.info = replace(info, extra={**info.extra, "device": str(device), "offload": {
        "gpu_layers": info.n_layers - len(streamer.streamed_layers), "streamed_layers": len(streamer.streamed_layers),
        "ring": streamer.ring, "streamed_bytes_per_pass": streamer.streamed_bytes}})
    return streamer
