"""Model resolution: a preset, a local file or folder, a Hugging Face id -> a verified local path.

`resolve(source)` turns whatever the user typed into a verified local path (presets through
backends.modelfiles.presets); every failure is one `RegistryError` line saying what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from backends.base import ModelNotFound, RegistryError
from backends.modelfiles.presets import PRESETS, downloaded_file, preset_file

ROLES = ("target", "draft")


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
    from backends.modelfiles.hub import reachable

    # An endpoint that does not answer: the HF cache alone, at once (huggingface_hub would retry for ~23 s first).
    cached_only = {} if reachable() else {"local_files_only": True}
    try:
        if filename:
            # hf_hub_download shows a tqdm bar, resumes partial downloads and reads the cache offline.
            return ResolvedModel(Path(filename).stem, Path(hub.hf_hub_download(repo, filename, **cached_only)),
                                 "gguf")
        # Skip the duplicate original/consolidated weights some repos carry next to the HF layout.
        folder = hub.snapshot_download(
            repo, allow_patterns=_SNAPSHOT, ignore_patterns=["original/*", "consolidated*"], **cached_only
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
