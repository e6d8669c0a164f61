"""llama.cpp (GGUF) backend: the only package in the project that imports `llama_cpp`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from backends.llamacpp.runtime import LlamaContext, LlamaModel
from backends.llamacpp.tokenizer import GGUFTokenizer

if TYPE_CHECKING:  # type only: backends must not import the app layer at run time
    from app.config import ModelSpec

__all__ = ["load", "LlamaModel", "LlamaContext", "GGUFTokenizer"]


def load(path: Path, spec: "ModelSpec", *, kv_type: str = "f32") -> LlamaModel:
    """Load a GGUF file with the threads / GPU layers of `spec`. Raises BackendError naming the path.

    kv_type "f32" (default) keeps logits independent of batching; "f16" halves KV memory (see runtime).
    """
    spec = spec.validated()
    return LlamaModel(Path(path), n_threads=spec.n_threads, n_gpu_layers=spec.n_gpu_layers or 0, kv_type=kv_type,
                      extra_bufts=spec.llama_extra_bufts)
