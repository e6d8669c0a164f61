"""Model specs and resolution: a preset, a local file or folder, a Hugging Face id -> a verified local path.

`resolve(source)` turns whatever the user typed into a verified local path (presets through
backends.presets); `load_model(spec)` then hands that path to a runtime picked from `RUNTIMES`. Every failure
is one `RegistryError` line saying what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backends.base import BackendError, ModelNotFound, RegistryError
from backends.presets import PRESETS, cache_dir, downloaded_file, preset_file

if TYPE_CHECKING:
    from backends.base import Model

ROLES = ("target", "draft")
BACKENDS = ("llamacpp", "pytorch")
DTYPES = ("float32", "bfloat16", "float16")


class SpecError(BackendError, ValueError):
    """A model setting is out of range; the message says which and what is allowed."""


# ---------------------------------------------------------------- model specs


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


# ---------------------------------------------------------------- resolve


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    path: Path
    kind: str  # "gguf" | "safetensors"
    preset: str | None = None


_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:\S+)?")
_SNAPSHOT = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "vocab.txt"]


def resolve(source: str, *, role: str = "target", verify: bool = False) -> ResolvedModel:
    """Preset name, local .gguf, safetensors folder, or Hugging Face `org/name[:file.gguf]` -> local path.

    `role` picks a preset's draft or target file; `verify=True` re-hashes preset files even when a
    checksum marker says they are unchanged.
    """
    if role not in ROLES:
        raise RegistryError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if source in PRESETS:
        preset = PRESETS[source]
        path = preset_file(preset, role, verify=verify)
        return ResolvedModel(getattr(preset, role).name, path, "gguf", preset.name)
    path = Path(source).expanduser()
    if path.exists():
        return _resolve_local(path)
    if _is_hub_id(source):
        return _resolve_hub(source)
    raise ModelNotFound(
        f"{source}: no such file or folder (expected a preset: {', '.join(PRESETS)}, a .gguf file, "
        "a safetensors folder, or a Hugging Face id org/name[:file.gguf])"
    )


def _is_hub_id(source: str) -> bool:
    # "org/name" or "org/name:file.gguf"; "./x/y", "~/y" and "dir/file.gguf" are paths that do not exist.
    if source.startswith((".", "~", "/")) or not _HF_ID.fullmatch(source):
        return False
    return ":" in source or not source.endswith(".gguf")


def _resolve_local(path: Path) -> ResolvedModel:
    if path.is_file():
        if path.suffix == ".safetensors":
            raise RegistryError(
                f"{path}: pass the folder holding config.json, tokenizer.json and the .safetensors files"
            )
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise RegistryError(f"{path}: not a GGUF file (expected .gguf or a safetensors folder)")
        return ResolvedModel(path.stem, path.resolve(), "gguf")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files, pass one of them: {', '.join(ggufs[:3])}" if ggufs else ""
        raise ModelNotFound(f"{path}: not a safetensors checkpoint, missing {', '.join(missing)}{hint}")
    return ResolvedModel(path.resolve().name, path.resolve(), "safetensors")


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        # huggingface_hub reads the variable once at import; ask it rather than os.environ.
        return bool(getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)())
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _resolve_hub(source: str) -> ResolvedModel:
    """Download (or find in the HF cache) `org/name:file.gguf` or a safetensors snapshot of `org/name`."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError as e:
        raise RegistryError("Hugging Face ids need huggingface-hub: pip install 'huggingface-hub'") from e
    repo, _, filename = source.partition(":")
    if filename and not filename.endswith(".gguf"):
        raise RegistryError(f"{source}: only .gguf files can be picked with ':'; use {repo} for safetensors")
    if filename and ".." not in Path(filename).parts and (local := downloaded_file(repo, filename)).is_file():
        return ResolvedModel(Path(filename).stem, local, "gguf")  # `dsbd-chat models download` put it there
    try:
        if filename:
            # hf_hub_download shows a tqdm bar, resumes partial downloads and reads the cache offline.
            return ResolvedModel(Path(filename).stem, Path(hub.hf_hub_download(repo, filename)), "gguf")
        # Skip the duplicate original/consolidated weights some repos carry next to the HF layout.
        folder = hub.snapshot_download(
            repo, allow_patterns=_SNAPSHOT, ignore_patterns=["original/*", "consolidated*"]
        )
    except errors.LocalEntryNotFoundError as e:  # offline (or unreachable) and not cached
        raise RegistryError(_offline_message(source)) from e
    except errors.GatedRepoError as e:
        msg = f"{repo} is gated: accept its license on huggingface.co, then run hf auth login"
        raise RegistryError(msg) from e
    except errors.RepositoryNotFoundError as e:
        raise ModelNotFound(f"Hugging Face repo {repo} not found (private? run `hf auth login`)") from e
    except errors.EntryNotFoundError as e:
        raise ModelNotFound(f"{filename} not found in Hugging Face repo {repo}") from e
    except errors.OfflineModeIsEnabled as e:
        raise RegistryError(_offline_message(source)) from e
    except errors.HfHubHTTPError as e:
        raise RegistryError(f"Hugging Face Hub error for {source}: {str(e).splitlines()[0]}") from e
    except (ConnectionError, TimeoutError) as e:
        raise RegistryError(_offline_message(source)) from e
    except OSError as e:  # disk full, permissions in HF_HOME
        raise RegistryError(f"could not fetch {source}: {e}") from e
    except ValueError as e:  # HFValidationError: a malformed repo id
        raise ModelNotFound(f"{source}: not a valid Hugging Face id ({str(e).splitlines()[0]})") from e
    try:
        resolved = _resolve_local(Path(folder))
    except ModelNotFound as e:
        raise ModelNotFound(
            f"{repo} has no usable safetensors checkpoint ({e}); for GGUF use {repo}:<file>.gguf"
        ) from e
    return ResolvedModel(repo.split("/")[-1], resolved.path, "safetensors")


def _offline_message(source: str) -> str:
    if _hub_offline():
        return (
            f"HF_HUB_OFFLINE is set and {source} is not in the local Hugging Face cache: use a local .gguf "
            "file or safetensors folder, or unset HF_HUB_OFFLINE once (with network) to download it"
        )
    return (
        f"cannot reach the Hugging Face Hub (no network?) and {source} is not in the local cache: use a "
        "local .gguf file or safetensors folder, or HF_HUB_OFFLINE=1 with a copy cached earlier"
    )


# ---------------------------------------------------------------- runtimes


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
