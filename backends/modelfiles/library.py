"""The model library: the GGUF files on this machine, found where they are (nothing is copied or imported).

Where it looks (`folders()`): the model cache (`presets.cache_dir()`, downloads from `hub` included), the preset
files, the Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub), folders the
user added (`add_folder`, remembered in `<cache>/.library/folders.json`), and LM Studio's and Jan's model folders
when they exist. Per file, from the GGUF header alone: name, architecture, parameters, quantization, context length,
size on disk, completeness (split GGUFs `name-00001-of-00003.gguf` are one entry; a missing shard or a file shorter
than its header says is "incomplete" with the reason), chat template present, and a tokenizer fingerprint. What a
header said is cached by (path, size, mtime) in `<cache>/.library/headers.json`, so an unchanged folder lists
without reading headers.

Public API (plain data, no printing; every error is a `LibraryError` with an actionable message):

- `scan(*, dirs=(), progress=None) -> Scan`: every entry (`Scan.entries: list[ModelEntry]`), the folders looked
  at (`Scan.folders: list[Folder]`), and how many headers were read vs. taken from the cache (`read`,
  `cached`). `dirs` adds folders for this scan only; `progress(done, total, path)` is called per header read.
- `folders(dirs=()) -> list[Folder]`; `user_folders() -> list[Path]`; `add_folder(path) -> list[Path]`;
  `remove_folder(path) -> list[Path]` (the remembered folders afterwards).
- `find(path, entries=None) -> ModelEntry`: the entry holding `path` (any shard of a split model).
- `match_source(source, role, entries) -> ModelEntry | None`: the entry a `--target` / `--draft` source names
  (a path, a preset and role, a downloaded `org/name:file.gguf`), without resolving or fetching anything.
- `card(path) -> ModelCard`: the entry plus every header key (long strings and arrays truncated) and the chat
  template's text.
- `plan_delete(path, entries=None) -> DeletePlan` (the files and the bytes a delete would free, or why it is
  refused) and `delete(plan) -> int` (bytes freed). Nothing is deleted without a plan.
- `check_pair(draft, target) -> Compatibility`: whether `draft` can draft for `target` (paths; GGUF pairs are
  checked from their headers, anything else through the tokenizers the runtimes load), with every reason.
  The rule is `backends.tokenizer.vocab_differences`, the same one the engine applies at load.
- `suggest_drafts(target, entries=None) -> DraftAdvice`: compatible local files first, ranked by size ratio
  to the target (1/20 to 1/4 is the sweet spot), then every refused file with its reasons, and what the app
  can do without a draft model.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from backends.base import BackendError, atomic_write
from offload.gguf_header import GGUFHeader, metadata_card, read_header, shard_of
from backends.modelfiles.presets import cache_dir, list_models
from backends.tokenizer import HeaderVocab, VocabFingerprint, header_fingerprint, load_tokenizer, vocab_differences
from offload.errors import BadModelFile
from offload.plan import format_bytes  # noqa: F401  (the one size format; the Models tab's)

RECORD_VERSION = 1  # bump when the cached per-file record changes shape
IDEAL_RATIO = (1 / 20, 1 / 4)  # draft size / target size where speculative decoding pays best
_MAX_DEPTH = 8  # folder levels below a library folder (LM Studio: publisher/repo/file)
_LABEL = re.compile(r"^\s*(?:\d+x)?(\d+(?:\.\d+)?)\s*([KMBT])\s*$", re.IGNORECASE)


class LibraryError(BackendError):
    """A library operation cannot be done as asked; the message says why and what to do."""


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Folder:
    """One place the library looks: its path, what it is, and whether it exists."""

    path: str
    source: str  # "models cache" | "preset" | "Hugging Face cache" | "folder" | "LM Studio" | "Jan"
    exists: bool
    remembered: bool = False  # a folder the user added (remove_folder forgets it)


@dataclass(frozen=True)
class ModelEntry:
    """One model on disk: a single .gguf file, or the shards of a split one (`files`, in order)."""

    id: str  # unique within a scan: the file name's slug (a suffix tells duplicates apart)
    name: str
    path: str  # the file to load (the first shard of a split model)
    files: tuple[str, ...]
    source: str  # see Folder.source
    folder: str  # the library folder it was found under
    size: int  # bytes on disk, every shard
    mtime: float
    complete: bool
    problem: str | None  # why it is incomplete or unreadable
    kind: str = "model"  # general.type: "model", "mmproj" (a vision projector), "adapter", ...
    arch: str | None = None
    params: int | None = None  # parameter count (tensor elements; from general.size_label when shards are missing)
    params_label: str | None = None  # "1.5B"
    quant: str | None = None
    context_length: int | None = None
    n_layers: int | None = None
    chat_template: bool = False
    family: str | None = None  # general.basename, for finding drafts of the same family
    repo: str | None = None  # Hugging Face repo (HF cache, or a download into the model cache)
    preset: str | None = None  # preset name when this is a preset's file
    preset_role: str | None = None  # "target", "draft" or "target+draft"
    fingerprint: VocabFingerprint | None = field(default=None, repr=False)

    @property
    def usable(self) -> bool:
        """A complete language-model file (not a projector or an adapter)."""
        return self.complete and self.kind == "model"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["files"] = list(self.files)
        d["fingerprint"] = self.fingerprint.as_dict() if self.fingerprint else None
        return d


@dataclass(frozen=True)
class Scan:
    entries: list[ModelEntry]
    folders: list[Folder]
    read: int  # headers read from disk in this scan
    cached: int  # files whose header facts came from the cache
    seconds: float

    def as_dict(self) -> dict:
        return {"models": [e.as_dict() for e in self.entries], "folders": [asdict(f) for f in self.folders],
                "read": self.read, "cached": self.cached, "seconds": self.seconds}


@dataclass(frozen=True)
class ModelCard:
    entry: ModelEntry
    metadata: dict  # every header key -> JSON-friendly value (long strings and arrays truncated)
    chat_template: str | None
    tensors: int

    def as_dict(self) -> dict:
        return {"model": self.entry.as_dict(), "metadata": self.metadata, "chat_template": self.chat_template,
                "tensors": self.tensors}


@dataclass(frozen=True)
class DeletePlan:
    """What deleting an entry would remove; `refused` says why it may not be deleted here (None: it may)."""

    entry: ModelEntry
    files: tuple[str, ...]  # every path that will be removed (HF cache: the blob and the links to it)
    bytes: int  # disk space freed
    refused: str | None = None

    def describe(self) -> str:
        if self.refused:
            return f"{self.entry.name}: {self.refused}"
        return (f"delete {self.entry.name} ({len(self.files)} file{'s' * (len(self.files) != 1)}, "
                f"frees {format_bytes(self.bytes)}): " + ", ".join(self.files))

    def as_dict(self) -> dict:
        return {"model": self.entry.as_dict(), "files": list(self.files), "bytes": self.bytes,
                "refused": self.refused}


@dataclass(frozen=True)
class Compatibility:
    draft: str
    target: str
    compatible: bool
    reasons: tuple[str, ...]  # empty when compatible

    def as_dict(self) -> dict:
        return asdict(self) | {"reasons": list(self.reasons)}


@dataclass(frozen=True)
class DraftCandidate:
    entry: ModelEntry
    compatible: bool
    reasons: tuple[str, ...]  # why it is refused (empty when compatible)
    ratio: float | None  # draft size / target size (parameters, else bytes)
    note: str  # how well the size suits a draft

    def as_dict(self) -> dict:
        return {"model": self.entry.as_dict(), "compatible": self.compatible, "reasons": list(self.reasons),
                "ratio": self.ratio, "note": self.note}


@dataclass(frozen=True)
class DraftAdvice:
    target: str
    candidates: tuple[DraftCandidate, ...]  # compatible ones first (best first), then the refused ones

    @property
    def compatible(self) -> tuple[DraftCandidate, ...]:
        return tuple(c for c in self.candidates if c.compatible)

    def as_dict(self) -> dict:
        return {"target": self.target, "candidates": [c.as_dict() for c in self.candidates]}


# ---------------------------------------------------------------- small helpers


def format_params(n: int | None) -> str | None:
    if not n:
        return None
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def _label_params(label) -> int | None:
    """general.size_label ("1.5B", "8x7B", "135M") -> a parameter count."""
    m = _LABEL.match(str(label or ""))
    if not m:
        return None
    mult = str(label).lower().split("x")[0] if "x" in str(label).lower() else "1"
    try:
        k = int(mult)
    except ValueError:
        k = 1
    return int(k * float(m.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()])


def state_dir() -> Path:
    """Where the library keeps its state: remembered folders and the header cache."""
    return cache_dir() / ".library"


def _atomic_write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data))


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default  # missing or damaged: the library rebuilds what it caches


# ---------------------------------------------------------------- folders


def user_folders() -> list[Path]:
    data = _read_json(state_dir() / "folders.json", {})
    items = data.get("folders", []) if isinstance(data, dict) else []
    return [Path(p) for p in items if isinstance(p, str)]


def _save_folders(paths: list[Path]) -> None:
    try:
        _atomic_write_json(state_dir() / "folders.json", {"folders": [str(p) for p in paths]})
    except OSError as e:
        raise LibraryError(f"could not remember the folders in {state_dir()}: {e.strerror or e}; set "
                           "DSBD_CHAT_CACHE to a writable folder") from e


def add_folder(path: str | Path) -> list[Path]:
    """Remember `path` as a library folder (scanned in place from now on); returns the remembered folders."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise LibraryError(f"{p}: no such folder; pass a folder that holds .gguf files")
    p = p.resolve()
    paths = user_folders()
    if p not in paths:
        paths.append(p)
        _save_folders(paths)
    return paths


def remove_folder(path: str | Path) -> list[Path]:
    """Forget a folder added with `add_folder` (its files stay where they are)."""
    p = Path(path).expanduser()
    paths = user_folders()
    keep = [q for q in paths if q != p and q != p.resolve()]
    if len(keep) == len(paths):
        listed = ", ".join(str(q) for q in paths) or "none"
        raise LibraryError(f"{p} is not a remembered folder (remembered: {listed})")
    _save_folders(keep)
    return keep


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment at call time (as huggingface_hub reads it)."""
    if env := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def _lmstudio_dirs(home: Path) -> list[Path]:
    out = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    settings = _read_json(home / ".lmstudio" / "settings.json", {})
    if isinstance(settings, dict) and isinstance(settings.get("downloadsFolder"), str):
        out.insert(0, Path(settings["downloadsFolder"]).expanduser())  # a folder moved in LM Studio's settings
    return out


def _jan_dirs(home: Path) -> list[Path]:
    data = [home / ".local" / "share" / "Jan" / "data", home / "Library" / "Application Support" / "Jan" / "data",
            home / "AppData" / "Roaming" / "Jan" / "data"]
    return [home / "jan" / "models"] + [d / sub for d in data for sub in ("llamacpp/models", "models")]


def folders(dirs: Iterable[str | Path] = ()) -> list[Folder]:
    """Every folder a scan looks at, in order; the app's own and the user's always, others when present."""
    home = Path.home()
    out = [Folder(str(cache_dir()), "models cache", cache_dir().is_dir()),
           Folder(str(hf_cache_dir()), "Hugging Face cache", hf_cache_dir().is_dir())]
    out += [Folder(str(p), "folder", p.is_dir(), remembered=True) for p in user_folders()]
    out += [Folder(str(Path(p).expanduser().absolute()), "folder", Path(p).expanduser().is_dir()) for p in dirs]
    for source, paths in (("LM Studio", _lmstudio_dirs(home)), ("Jan", _jan_dirs(home))):
        out += [Folder(str(p), source, True) for p in paths if p.is_dir()]
    seen, unique = set(), []
    for f in out:
        if f.path not in seen:
            seen.add(f.path)
            unique.append(f)
    return unique


def _walk(root: Path) -> Iterable[Path]:
    """.gguf files under `root` (hidden folders and partial downloads skipped; symlinked files followed)."""
    base = len(root.parts)
    for here, subdirs, files in os.walk(root, followlinks=False):
        depth = len(Path(here).parts) - base
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and depth < _MAX_DEPTH)
        for name in sorted(files):
            if name.lower().endswith(".gguf") and not name.startswith("."):
                yield Path(here) / name


def _hf_files(root: Path) -> Iterable[tuple[Path, str]]:
    """(snapshot path, repo id) of every .gguf file in a Hugging Face cache (models--org--name/snapshots/...)."""
    try:
        repos = sorted(d for d in root.iterdir() if d.name.startswith("models--") and d.is_dir())
    except OSError:
        return
    for d in repos:
        repo = d.name.removeprefix("models--").replace("--", "/")
        for path in _walk(d / "snapshots"):
            if path.exists():  # a link to a blob that was deleted
                yield path, repo


def _preset_paths() -> dict[str, tuple[str, str, str]]:
    """realpath -> (preset, role, name) of the preset files present on disk (reads checksum markers, never hashes)."""
    out = {}
    for row in list_models():
        loc = Path(row["location"])
        if row["status"] in ("verified", "unverified", "mismatch") and loc.is_file():
            out[os.path.realpath(loc)] = (row["preset"], row["role"], row["name"])
    return out


# ---------------------------------------------------------------- per-file records (cached)


def _record(path: Path) -> dict:
    """What the header of one file says, as a JSON-friendly dict (an `error` key when it cannot be read)."""
    try:
        h = read_header(path)
    except BadModelFile as e:
        return {"error": str(e)}
    meta = h.metadata
    fp = header_fingerprint(h)
    missing = h.missing_bytes
    return {
        "name": meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
        "kind": _str(meta.get("general.type")) or ("mmproj" if h.arch == "clip" else "model"),
        "arch": h.arch, "params": h.n_params, "size_label": _str(meta.get("general.size_label")),
        "family": _str(meta.get("general.basename")), "quant": h.quant, "context_length": h.context_length,
        "n_layers": h.n_layers, "chat_template": "tokenizer.chat_template" in meta,
        "split": list(h.split) if h.split else None, "expected_size": h.expected_size, "missing_bytes": missing,
        "fingerprint": fp.as_dict() if fp else None,
    }


def _str(v) -> str | None:
    return v if isinstance(v, str) and v else None


class _HeaderCache:
    """path -> (size, mtime_ns, record), in <state>/headers.json; rewritten atomically when it changed."""

    def __init__(self) -> None:
        self.path = state_dir() / "headers.json"
        data = _read_json(self.path, {})
        ok = isinstance(data, dict) and data.get("version") == RECORD_VERSION
        self.items: dict = data.get("files", {}) if ok else {}
        self.dirty = not ok and bool(data)
        self.read = self.cached = 0

    def get(self, path: Path, st: os.stat_result, progress, done: int, total: int) -> dict:
        key = str(path)
        hit = self.items.get(key)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            self.cached += 1
            return hit["record"]
        if progress:
            progress(done, total, key)
        record = _record(path)
        self.read += 1
        self.items[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "record": record}
        self.dirty = True
        return record

    def save(self, seen: set[str]) -> None:
        stale = [k for k in self.items if k not in seen and not os.path.exists(k)]
        for k in stale:
            del self.items[k]
        if self.dirty or stale:
            try:
                _atomic_write_json(self.path, {"version": RECORD_VERSION, "files": self.items})
            except OSError:
                pass  # the cache only saves time; the next scan reads the headers again


# ---------------------------------------------------------------- scan


def scan(*, dirs: Iterable[str | Path] = (), progress: Callable[[int, int, str], None] | None = None) -> Scan:
    """Every model in the library folders (plus `dirs` for this scan); see the module docstring."""
    t0 = time.perf_counter()
    where = folders(dirs)
    found: list[tuple[Path, Folder, str | None]] = []  # (path, folder, repo)
    for f in where:
        root = Path(f.path)
        if not f.exists:
            continue
        if f.source == "Hugging Face cache":
            found += [(p, f, repo) for p, repo in _hf_files(root)]
        else:
            found += [(p, f, _download_repo(root, p)) for p in _walk(root)]
    presets = _preset_paths()
    for real, (preset, _role, _name) in presets.items():
        found.append((Path(real), Folder(str(Path(real).parent), "preset", True), None))
    cache = _HeaderCache()
    files: list[tuple[Path, Folder, str | None, os.stat_result, dict]] = []
    seen_real: set[str] = set()
    for i, (path, f, repo) in enumerate(found):
        try:
            st = path.stat()
            real = os.path.realpath(path)
        except OSError:
            continue
        if real in seen_real:
            continue  # the same file reached twice (a folder inside another, a link): listed once
        seen_real.add(real)
        files.append((path, f, repo, st, cache.get(path, st, progress, i, len(found))))
    cache.save({str(p) for p, *_ in files})
    entries = _group(files, presets)
    return Scan(entries=_with_ids(entries), folders=where, read=cache.read, cached=cache.cached,
                seconds=time.perf_counter() - t0)


def _download_repo(root: Path, path: Path) -> str | None:
    """org/name of a file downloaded into the model cache (<cache>/hub/org/name/...), else None."""
    try:
        rel = path.relative_to(root).parts
    except ValueError:
        return None
    return f"{rel[1]}/{rel[2]}" if len(rel) >= 4 and rel[0] == "hub" else None


def _group(files, presets) -> list[ModelEntry]:
    """Files -> entries: split shards of one model (same folder, stem and count) become one entry."""
    groups: dict[tuple, list] = {}
    for item in files:
        path = item[0]
        sh = shard_of(path.name)
        key = (str(path.parent), sh[0], sh[2]) if sh else (str(path),)
        groups.setdefault(key, []).append(item)
    entries = []
    for key, items in groups.items():
        if len(key) == 1:
            entries.append(_entry(items, None, presets))
        else:
            items.sort(key=lambda it: shard_of(it[0].name)[1])
            entries.append(_entry(items, key[2], presets))
    entries.sort(key=lambda e: (e.source != "preset", e.name.lower(), e.path))
    return entries


def _entry(items, shards: int | None, presets) -> ModelEntry:
    first_path, folder, repo, _st, first = items[0]
    problems = []
    records = [it[4] for it in items]
    for path, _f, _r, st, rec in items:
        if "error" in rec:
            problems.append(rec["error"])
        elif rec.get("missing_bytes"):
            problems.append(f"{path.name} is truncated: {format_bytes(st.st_size)} of "
                            f"{format_bytes(rec['expected_size'])} (an interrupted download or copy?)")
    if shards is not None:
        have = {shard_of(it[0].name)[1] for it in items}
        stem = shard_of(first_path.name)[0]
        missing = [i for i in range(1, shards + 1) if i not in have]
        if missing:
            names = ", ".join(f"{stem}-{i:05d}-of-{shards:05d}.gguf" for i in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            problems.insert(0, f"missing shard{'s' * (len(missing) > 1)} {', '.join(map(str, missing[:3]))}{more} "
                               f"of {shards} ({names})")
    # The first shard carries the model's metadata; a shard-only file (no shard 1) still names its arch.
    meta = next((r for r in records if "error" not in r and (r.get("split") or [0])[0] == 0), None) or \
        next((r for r in records if "error" not in r), {})
    preset = presets.get(os.path.realpath(first_path))
    complete = not problems
    params = sum(r.get("params") or 0 for r in records) if complete and meta else None
    params = params or _label_params(meta.get("size_label"))
    base_name = shard_of(first_path.name)[0] if shards else first_path.stem
    fp = meta.get("fingerprint")
    return ModelEntry(
        id="", name=preset[2] if preset else (meta.get("name") or base_name),
        path=str(first_path), files=tuple(str(it[0]) for it in items),
        source="preset" if preset else folder.source, folder=folder.path,
        size=sum(it[3].st_size for it in items), mtime=max(it[3].st_mtime for it in items),
        complete=complete, problem="; ".join(problems) or None, kind=meta.get("kind") or "model",
        arch=meta.get("arch"), params=params, params_label=meta.get("size_label") or format_params(params),
        quant=meta.get("quant"), context_length=meta.get("context_length"), n_layers=meta.get("n_layers"),
        chat_template=bool(meta.get("chat_template")), family=meta.get("family"), repo=repo,
        preset=preset[0] if preset else None, preset_role=preset[1] if preset else None, fingerprint=VocabFingerprint.from_dict(fp) if fp else None,
    )


def _with_ids(entries: list[ModelEntry]) -> list[ModelEntry]:
    out, used = [], set()
    for e in entries:
        sh = shard_of(Path(e.path).name)
        stem = sh[0] if sh else Path(e.path).stem
        base = re.sub(r"[^a-z0-9._]+", "-", stem.lower()).strip("-") or "model"
        ident, k = base, 2
        while ident in used:
            ident, k = f"{base}-{k}", k + 1
        used.add(ident)
        out.append(replace(e, id=ident))
    return out


def find(path: str | Path, entries: list[ModelEntry] | None = None) -> ModelEntry:
    """The library entry holding `path` (a file of it, any shard), named by its id, or by a source as --target
    takes it (a preset, a downloaded org/name:file.gguf); LibraryError when there is none."""
    p = Path(path).expanduser()
    real = os.path.realpath(p)
    entries = scan().entries if entries is None else entries
    for e in entries:
        if any(real == os.path.realpath(f) or str(p) == f for f in e.files) or str(path) == e.id:
            return e
    if hit := match_source(str(path), "target", entries) or match_source(str(path), "draft", entries):
        return hit
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _entry_for_file(p)
    raise LibraryError(f"{path} is not a model in the library (dsbd-chat models list shows them; add its folder "
                       "to the library first)")


def _entry_for_file(path: Path) -> ModelEntry:
    """An entry for a .gguf file outside the library folders (not cached, not deletable)."""
    st = path.stat()
    (entry,) = _group([(path, Folder(str(path.parent), "file", True), None, st, _record(path))], _preset_paths())
    return replace(entry, id=path.stem.lower(), source="file")


def match_source(source: str, role: str, entries: list[ModelEntry]) -> ModelEntry | None:
    """The entry a model source (as --target / --draft take it) names, found without resolving or fetching
    anything: a path, a preset (name and role), or a downloaded `org/name:file.gguf`; None when none does."""
    p = Path(source).expanduser()
    real = os.path.realpath(p) if p.exists() else None
    repo, _, filename = source.partition(":")
    for e in entries:
        if real is not None and real in {os.path.realpath(f) for f in e.files}:
            return e
        if e.preset == source and e.preset_role and role in e.preset_role.split("+"):
            return e
        if filename and e.repo == repo and Path(e.path).as_posix().endswith("/" + filename):
            return e
    return None


# ---------------------------------------------------------------- card


def card(path: str | Path, entries: list[ModelEntry] | None = None) -> ModelCard:
    """The metadata card of a library entry (or any .gguf file): every header key, truncated for display."""
    entry = find(path, entries)
    try:
        header: GGUFHeader = read_header(entry.path, keep=())
    except BadModelFile as e:
        raise LibraryError(f"cannot read the header of {entry.path}: {e}") from e
    tpl = header.metadata.get("tokenizer.chat_template")
    return ModelCard(entry=entry, metadata=metadata_card(header), chat_template=tpl if isinstance(tpl, str) else None,
                     tensors=len(header.tensors))


# ---------------------------------------------------------------- delete


def plan_delete(path: str | Path, entries: list[ModelEntry] | None = None) -> DeletePlan:
    """What deleting the entry holding `path` would remove and free; nothing is deleted here."""
    entries = scan().entries if entries is None else entries
    entry = find(path, entries)
    if entry.source == "file":
        return DeletePlan(entry, (), 0, refused=f"{entry.path} is not in a library folder; delete it yourself or "
                                                "add its folder to the library first")
    if entry.preset and not _under(entry.path, cache_dir()):
        dist = Path(entry.path).parent.name.replace("_", "-")
        return DeletePlan(entry, (), 0, refused=f"this file belongs to the installed package {dist}: remove it with "
                                                f"pip uninstall {dist}")
    files: list[Path] = []
    freed = 0
    for f in map(Path, entry.files):
        if f.is_symlink() and entry.source == "Hugging Face cache":  # snapshot links -> one blob
            blob = Path(os.path.realpath(f))
            files += _links_to(blob, f) + [blob]
            freed += blob.stat().st_size if blob.exists() else 0
        else:
            files.append(f)  # a link elsewhere goes alone: the file it points to is not the library's
            freed += 0 if f.is_symlink() else f.stat().st_size
    if entry.preset:  # the presets module's checksum marker of an assembled preset file
        files += [m for m in (cache_dir() / f"{Path(entry.path).name}.sha256",) if m.is_file()]
    unique = tuple(dict.fromkeys(str(f) for f in files))
    return DeletePlan(entry, unique, freed)


def _under(path: str | Path, folder: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(folder))
        return True
    except ValueError:
        return False


def _links_to(blob: Path, link: Path) -> list[Path]:
    """Every snapshot link of this repo that points at `blob` (other revisions share blobs)."""
    snapshots = next((p for p in link.parents if p.name == "snapshots"), None)
    if snapshots is None:
        return [link]
    out = []
    for p in snapshots.rglob("*"):
        if p.is_symlink() and os.path.realpath(p) == str(blob):
            out.append(p)
    return out or [link]


def delete(plan: DeletePlan) -> int:
    """Remove the files of a `plan_delete` plan; returns the bytes freed. Raises LibraryError when the plan
    was refused or a file cannot be removed (the files removed before the failure stay removed)."""
    if plan.refused:
        raise LibraryError(plan.refused)
    freed = 0
    for f in map(Path, plan.files):
        try:
            size = 0 if f.is_symlink() else f.stat().st_size
            f.unlink()
            freed += size
        except FileNotFoundError:
            continue
        except OSError as e:
            raise LibraryError(f"could not delete {f}: {e.strerror or e}") from e
    return freed


# ---------------------------------------------------------------- compatibility and draft suggestions


def _vocab_of(path: str | Path, entry: ModelEntry | None = None) -> HeaderVocab:
    if entry is not None and entry.fingerprint is not None:
        return HeaderVocab(entry.path, entry.fingerprint, name=entry.name)
    try:
        return HeaderVocab.from_file(path)
    except BadModelFile as e:
        raise LibraryError(f"cannot read the tokenizer of {path}: {e}") from e


def check_pair(draft: str | Path, target: str | Path, *, draft_entry: ModelEntry | None = None,
               target_entry: ModelEntry | None = None) -> Compatibility:
    """Whether `draft` can draft for `target`, with every reason it cannot (`vocab_differences`).

    Two .gguf files are compared from their headers; a safetensors folder (or a mix) through the tokenizers
    the runtimes load, as the engine does at load."""
    d, t = Path(draft), Path(target)
    if d.suffix.lower() == ".gguf" and t.suffix.lower() == ".gguf":
        dv, tv = _vocab_of(d, draft_entry), _vocab_of(t, target_entry)
        reasons = vocab_differences(dv, tv)
    else:
        dv, tv = load_tokenizer(d), load_tokenizer(t)
        try:
            reasons = vocab_differences(dv, tv)
        finally:
            for tok in (dv, tv):
                getattr(tok, "close", lambda: None)()
    return Compatibility(draft=str(d), target=str(t), compatible=not reasons, reasons=tuple(reasons))


def _size(e: ModelEntry) -> float:
    return float(e.params or e.size)


def _size_note(ratio: float | None, same: bool) -> str:
    lo, hi = IDEAL_RATIO
    if same:
        return "the target itself: works, but drafting with the same model gains nothing"
    if ratio is None:
        return "size unknown"
    frac = f"1/{1 / ratio:.0f} of the target" if ratio < 1 else f"{ratio:.1f}x the target"
    if ratio >= 1:
        return f"{frac}: not smaller than the target, no speed-up"
    if ratio > hi:
        return f"{frac}: large for a draft, drafting costs much of what it saves"
    if ratio < lo:
        return f"{frac}: very small, fast but its guesses are accepted less often"
    return f"{frac}: a good draft size"


def _rank(c: DraftCandidate) -> tuple:
    lo, hi = IDEAL_RATIO
    r = c.ratio
    if r is None or r >= 1:
        return (2, 0.0)
    centre = math.sqrt(lo * hi)
    return (0 if lo <= r <= hi else 1, abs(math.log(r / centre)))


def suggest_drafts(target: str | Path | ModelEntry, entries: list[ModelEntry] | None = None) -> DraftAdvice:
    """Local draft candidates for `target` (see the module docstring)."""
    entries = scan().entries if entries is None else entries
    t = target if isinstance(target, ModelEntry) else find(target, entries)
    if not t.usable:
        raise LibraryError(f"{t.name} cannot be a target: {t.problem or f'it is a {t.kind} file, not a model'}")
    t_real = os.path.realpath(t.path)
    good, refused = [], []
    for e in entries:
        if e.kind != "model":
            continue
        same = os.path.realpath(e.path) == t_real
        ratio = _size(e) / _size(t) if _size(t) else None
        if not e.complete:
            refused.append(DraftCandidate(e, False, (f"incomplete: {e.problem}",), ratio, ""))
            continue
        try:
            reasons = check_pair(e.path, t.path, draft_entry=e, target_entry=t).reasons
        except (LibraryError, BackendError) as err:
            reasons = (str(err),)
        c = DraftCandidate(e, not reasons, tuple(reasons), ratio, _size_note(ratio, same))
        (good if c.compatible else refused).append(c)
    good.sort(key=lambda c: (os.path.realpath(c.entry.path) == t_real, _rank(c)))
    return DraftAdvice(target=t.path, candidates=tuple(good + refused))
