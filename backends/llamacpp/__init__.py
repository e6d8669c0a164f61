"""llama.cpp (GGUF) backend: the only package in the project that imports `llama_cpp`."""

from __future__ import annotations

from pathlib import Path

from backends.llamacpp.runtime import LlamaContext, LlamaModel
from backends.llamacpp.tokenizer import GGUFTokenizer

__all__ = ["load", "LlamaModel", "LlamaContext", "GGUFTokenizer"]


def load(path: Path, spec, *, kv_type: str = "f32") -> LlamaModel:
    """Load a GGUF file with the threads / GPU layers of `spec` (a backends.registry.ModelSpec). Raises
    BackendError naming the path.

    kv_type "f32" (default) keeps logits independent of batching; "f16" halves KV memory (see runtime).
    """
    spec = spec.validated()
    rpc = spec.rpc
    layers = spec.n_gpu_layers if spec.n_gpu_layers is not None else (-1 if rpc else 0)  # RPC: all on the workers
    return LlamaModel(Path(path), n_threads=spec.n_threads, n_gpu_layers=layers, kv_type=kv_type,
                      extra_bufts=spec.llama_extra_bufts, rpc=rpc)
