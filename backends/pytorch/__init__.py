"""PyTorch runtime: a compact Llama/Qwen2 transformer over a static KV cache (Layout R, spec §7)."""

from __future__ import annotations

import pathlib

from backends.base import BackendError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load(path: pathlib.Path, spec) -> "PyTorchModel":
    """Load a .gguf file or a Hugging Face safetensors folder as a `backends.base.Model`.

    `spec` is an app.config.ModelSpec; its dtype and device are used (torch is imported lazily so
    that importing this package costs nothing when the llama.cpp backend is chosen).
    """
    import torch

    from backends.pytorch.runtime import PyTorchModel, model_info

    path = pathlib.Path(path)
    spec = spec.validated()
    if spec.dtype not in DTYPES:
        raise BackendError(f"dtype {spec.dtype!r} is not supported; choose one of: {', '.join(DTYPES)}")
    dtype = getattr(torch, DTYPES[spec.dtype])
    try:
        device = torch.device(spec.device)
    except RuntimeError as e:
        raise BackendError(f"bad device {spec.device!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"device {spec.device!r} requested but CUDA is not available to torch")
    if path.is_dir():
        from backends.pytorch.safetensors_loader import load_safetensors as loader
    elif path.suffix.lower() == ".gguf":
        from backends.pytorch.gguf_loader import load_gguf as loader
    elif not path.exists():
        raise BackendError(f"model not found: {path}")
    else:
        raise BackendError(f"{path.name}: expected a .gguf file or a safetensors checkpoint folder")
    transformer, extra = loader(path, dtype=dtype, device=device)
    name = path.stem if path.is_file() else path.name
    info = model_info(transformer, name=name, dtype=dtype, device=device, extra=extra)
    return PyTorchModel(transformer, info=info, device=device, dtype=dtype, tokenizer_path=path)


def __getattr__(name: str):
    # Lazy re-exports keep `import backends.pytorch` torch-free.
    if name in ("PyTorchModel", "PyTorchContext"):
        from backends.pytorch import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
