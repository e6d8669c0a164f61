"""Model specs and their runtimes: `load_model(spec)` resolves `spec.source` (backends.modelfiles.resolution) and
hands the path to a runtime picked from `RUNTIMES`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backends.base import BackendError, RegistryError
from backends.modelfiles.presets import cache_dir
from backends.modelfiles.resolution import resolve

if TYPE_CHECKING:
    from backends.base import Model

BACKENDS = ("llamacpp", "pytorch")
DTYPES = ("float32", "bfloat16", "float16")


class SpecError(BackendError, ValueError):
    """A model setting is out of range; the message says which and what is allowed."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to run it."""

    source: str  # preset role ("tiny"), local .gguf, safetensors folder, or "org/name[:file.gguf]"
    backend: str = "llamacpp"
    dtype: str = "float32"  # pytorch only
    device: str = "cpu"  # pytorch only: cpu | cuda | cuda:N
    n_threads: int | None = None  # llama.cpp; None = physical cores
    n_gpu_layers: int | None = None  # llama.cpp; None = from the memory plan (0 without a GPU)
    n_ctx: int = 4096
    llama_extra_bufts: str = "auto"  # llama.cpp weight repack: on | off | auto ($DSBD_CHAT_LLAMA_EXTRA_BUFTS, probe)
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers HOST:PORT holding this model's layers (the target only)
    quant: str | None = None  # llama.cpp: run a requantized copy (backends/llamacpp/quantize.py), made once, cached

    def validated(self) -> ModelSpec:
        """Check every field; raises SpecError."""
        if self.backend not in BACKENDS:
            raise SpecError(f"unknown backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise SpecError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        for name, value, lo, hi in (("n_ctx", self.n_ctx, 16, 1 << 20), ("n_gpu_layers", self.n_gpu_layers, -1, 100_000),
                                    ("n_threads", self.n_threads, 1, 1024)):
            if value is None and name != "n_ctx":
                continue  # unset: the memory plan / physical cores decide
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"{name} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                raise SpecError(f"{name} must be between {lo} and {hi}, got {value}")
        if self.llama_extra_bufts not in ("auto", "on", "off"):
            raise SpecError(f"llama_extra_bufts must be auto, on or off, got {self.llama_extra_bufts!r}")
        if self.rpc:
            from backends.remote import parse_endpoints  # plain Python: no native library loaded

            if self.backend != "llamacpp":
                raise SpecError("--rpc spreads a llama.cpp (GGUF) target over RPC workers: use --target-backend "
                                "llamacpp")
            if not isinstance(self.rpc, tuple) or parse_endpoints(self.rpc) != self.rpc:
                raise SpecError(f"rpc must be a tuple of HOST:PORT endpoints, got {self.rpc!r}")
        if self.quant is not None:
            from backends.llamacpp.quantize import TYPES  # plain Python: no native library loaded

            if self.quant not in TYPES:
                raise SpecError(f"unknown quantization {self.quant!r}; choose one of: {', '.join(TYPES)}")
            if self.backend != "llamacpp":
                raise SpecError("a requantized copy runs on llama.cpp: use --draft-backend llamacpp with --draft-quant")
        return self


def _llamacpp(path: Path, spec: ModelSpec) -> "Model":
    from backends.llamacpp import load  # lazy: llama_cpp is heavy and only needed for this runtime

    return load(path, spec)


def _pytorch(path: Path, spec: ModelSpec) -> "Model":
    from backends.pytorch import load  # lazy: importing torch takes seconds

    return load(path, spec)


RUNTIMES: dict[str, Callable[[Path, ModelSpec], "Model"]] = {"llamacpp": _llamacpp, "pytorch": _pytorch}


def load_model(spec: ModelSpec, *, role: str = "target", verify: bool = False) -> "Model":
    """Resolve `spec.source` and load it with the runtime `spec.backend` names."""
    spec = spec.validated()
    resolved = resolve(spec.source, role=role, verify=verify)
    if resolved.kind == "safetensors" and spec.backend == "llamacpp":
        raise RegistryError(
            f"{spec.source} is a safetensors checkpoint and llama.cpp reads only GGUF: "
            f"use --{role}-backend pytorch, or pass a .gguf file"
        )
    path = resolved.path
    if spec.quant is not None:  # a cheaper copy of the same weights, made once beside the original
        from backends.llamacpp.quantize import requantized

        path = requantized(path, spec.quant, folder=cache_dir())
    model = RUNTIMES[spec.backend](path, spec)
    if resolved.preset is not None:  # our name for a preset file reads better than its GGUF general.name
        model.info = replace(model.info, name=resolved.name)
    return model
