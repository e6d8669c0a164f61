"""The Hugging Face Hub for GGUF models: search, a repo's files by quantization, headers, resumable downloads.

Everything goes through `huggingface_hub` (its `HfApi`, its HTTP session, its auth headers) at the endpoint
`$HF_ENDPOINT` names when the call is made (huggingface.co by default), and honours `HF_HUB_OFFLINE`.

Downloads land in the model cache, `<cache>/hub/<org>/<name>/<file>` (`presets.downloaded_file`):
plain files the model library lists and `--target org/name:file.gguf` finds without the network. A download
writes `<file>.part` and a sidecar `<file>.part.json` (repo, file, revision, size, sha256); a stop, a lost
connection or a killed app leaves both, and the next start continues with an HTTP Range request from the bytes
on disk. The finished file is checked against the Hub's sha256 (LFS) before it gets its name. huggingface_hub's
own hf_hub_download is not used for this: it writes each attempt to a fresh temporary name and deletes it on
failure, so a stopped download starts over.

Public API (plain data and callbacks, no printing; errors are `HubError` subclasses with what to do):

- `search(query, *, sort="downloads", limit=20) -> list[HubModel]`: GGUF repos; sort "downloads", "recent",
  "likes" or "trending".
- `family_drafts(family, *, below_params=None, limit=10) -> list[HubModel]`: repos of the same family (a local
  entry's `family`) smaller than the target, for draft suggestions from the Hub.
- `repo_files(repo, *, revision="main") -> RepoFiles`: its .gguf files (`HubFile`: size, sha256, quantization,
  shard) and the same grouped per quantization (`QuantGroup`, split shards together, `complete` when every
  shard is listed).
- `fetch_header(repo, filename, *, revision="main") -> Path`: the file's GGUF header only (HTTP Range, grown
  until it parses), cached under `<cache>/.library/hub-headers/`; readable by `offload.gguf_header`,
  `offload.geometry` and `backends.tokenizer.HeaderVocab` like a local file.
- `download_file(repo, filename, *, revision="main", progress=None, stop=None) -> Path`: one file, blocking,
  resuming a partial one; `progress(DownloadProgress)` a few times a second; setting the `stop` Event pauses it
  (`DownloadStopped`, the partial file kept).
- `DownloadManager(on_progress=None, parallel=1)`: a queue on worker threads: `add`, `jobs`, `get`, `pause`,
  `resume`, `cancel(id, confirm=False) -> CancelPlan` (without confirm it only says what would be lost),
  `remove`, `wait`, `close`. Partial downloads left by an earlier run come back as paused jobs.
- `partial_downloads() -> list[DownloadProgress]`, `download_path(repo, filename) -> Path`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import shutil
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Callable

from offload.gguf_header import HeaderTruncated, parse_header, shard_of
from offload.plan import format_bytes
from backends.base import ModelNotFound, RegistryError, atomic_write
from backends.modelfiles.presets import cache_dir, downloaded_file

CHUNK = 1 << 20  # bytes per read while downloading
SORTS = {"downloads": "downloads", "recent": "last_modified", "likes": "likes", "trending": "trending_score"}
HEADER_FIRST, HEADER_MAX = 4 << 20, 256 << 20  # header fetch: first Range size, and the most we fetch
DISK_MARGIN = 64 << 20  # keep this much free beyond the download
PROGRESS_EVERY_S = 0.25
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[0-9A-Za-z]{1,4}){0,3}|TQ[12]_0|BF16|FP?16|FP?32|MXFP4(?:_MOE)?)"
                    r"(?![A-Za-z0-9])", re.IGNORECASE)


class HubError(RegistryError):
    """The Hub could not do what was asked; the message says why and what to do."""


class HubOffline(HubError):
    """No network (or HF_HUB_OFFLINE): nothing was fetched."""


class HubAuth(HubError):
    """401 / 403: a login, a token or a license acceptance is needed."""


class HubNotFound(HubError, ModelNotFound):
    """404: no such repo or file."""


class ChecksumMismatch(HubError):
    """The downloaded bytes do not match the Hub's sha256; the partial file was deleted."""


class NotEnoughSpace(HubError):
    """Not enough free disk space for the download; nothing was started."""


class DownloadStopped(HubError):
    """Paused (the partial file is kept and resumes) or cancelled (it was deleted)."""


# ---------------------------------------------------------------- plain data


@dataclass(frozen=True)
class HubModel:
    id: str
    downloads: int | None = None
    likes: int | None = None
    last_modified: str | None = None  # ISO time
    gated: bool = False
    params: int | None = None  # from the Hub's GGUF summary, when it gives one
    arch: str | None = None
    context_length: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HubFile:
    path: str  # in the repo
    size: int
    sha256: str | None  # LFS files (every GGUF on the Hub); None for small git files
    blob_id: str
    quant: str  # "Q4_K_M", or "unknown"
    shard: tuple[int, int] | None  # (i, n) of a split GGUF
    kind: str  # "model" | "mmproj" (a vision projector)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QuantGroup:
    """One downloadable model: a single file, or every shard of a split one."""

    name: str  # the file (single) or the shard stem (split)
    quant: str
    files: tuple[HubFile, ...]
    size: int
    shards: int
    complete: bool  # every shard is in the repo
    kind: str

    def as_dict(self) -> dict:
        return asdict(self) | {"files": [f.as_dict() for f in self.files]}


@dataclass(frozen=True)
class RepoFiles:
    repo: str
    revision: str
    files: tuple[HubFile, ...]
    groups: tuple[QuantGroup, ...]  # smallest first

    def group(self, quant_or_name: str) -> QuantGroup:
        """The group whose quantization or name is `quant_or_name` (case-insensitive); HubNotFound otherwise."""
        key = quant_or_name.lower()
        hits = [g for g in self.groups if g.kind == "model" and key in (g.quant.lower(), g.name.lower())]
        if len(hits) == 1:
            return hits[0]
        have = ", ".join(f"{g.quant} ({g.name})" for g in self.groups if g.kind == "model") or "none"
        what = "matches several files" if hits else "is not in the repo"
        raise HubNotFound(f"{quant_or_name} {what} {self.repo}; its GGUF models: {have}")

    def as_dict(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "files": [f.as_dict() for f in self.files],
                "groups": [g.as_dict() for g in self.groups]}


@dataclass(frozen=True)
class DownloadProgress:
    """One download as the UI and the CLI show it."""

    id: str  # "org/name:file"
    repo: str
    filename: str
    state: str  # "queued" | "running" | "paused" | "done" | "failed" | "cancelled"
    done: int  # bytes on disk
    total: int  # bytes of the file (0 until known)
    speed: float = 0.0  # bytes per second, recent
    eta: float | None = None  # seconds left at that speed
    path: str = ""  # the final file
    error: str | None = None

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"fraction": self.fraction}


@dataclass(frozen=True)
class CancelPlan:
    """What cancelling a download would throw away; `cancelled` once it was done (confirm=True)."""

    job: DownloadProgress
    bytes_lost: int
    files: tuple[str, ...]
    cancelled: bool

    def describe(self) -> str:
        head = "cancelled" if self.cancelled else "cancel"
        return (f"{head} {self.job.filename} from {self.job.repo}: "
                f"{'deleted' if self.cancelled else 'deletes'} {format_bytes(self.bytes_lost)} downloaded so far")


# ---------------------------------------------------------------- the Hub, errors


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    return bool(constants.HF_HUB_OFFLINE)


def _offline_error(what: str, detail: str | None = None) -> HubOffline:
    if detail is None:
        return HubOffline(f"no network: HF_HUB_OFFLINE is set, so {what} cannot reach the Hub; unset HF_HUB_OFFLINE "
                          "to search and download, or use the models already on disk (dsbd-chat models list)")
    return HubOffline(f"no network: {what} cannot reach {endpoint()} ({detail}); check the connection (or a proxy: "
                      "HTTPS_PROXY), then try again; a partial download continues where it stopped. Models already "
                      "on disk: dsbd-chat models list")


def _transport_error(e: BaseException) -> bool:
    """A connection-level failure of huggingface_hub's HTTP client (httpx or its fork)."""
    mod = type(e).__module__.split(".")[0]
    if mod.startswith("httpx"):
        base = getattr(importlib.import_module(mod), "TransportError", None)
        return base is not None and isinstance(e, base)
    return isinstance(e, (ConnectionError, TimeoutError))


def _status_error(status: int, what: str, *, repo: str, filename: str | None = None,
                  code: str | None = None) -> HubError:
    if status == 401:
        return HubAuth(f"{what}: the Hub answered 401 (not logged in, or the token is wrong): run `hf auth login` or "
                       f"set HF_TOKEN; a private repo needs a token that can read {repo}")
    if status == 403:
        if code == "GatedRepo" or "gated" in (code or "").lower():
            return HubAuth(f"{repo} is gated: accept its license on {endpoint()}/{repo} while logged in, then run "
                           "`hf auth login` here")
        return HubAuth(f"{what}: the Hub answered 403 (forbidden): your token cannot read {repo}; check it with "
                       "`hf auth whoami`")
    if status == 404:
        if filename and code != "RepoNotFound":
            return HubNotFound(f"{filename} not found in {repo} (dsbd-chat models download {repo} lists its files)")
        return HubNotFound(f"repo {repo} not found on {endpoint()} (a typo? a private repo needs `hf auth login`)")
    if status == 416:
        return HubError(f"{what}: the server refused the byte range (416); delete the partial file and try again")
    return HubError(f"{what}: the Hub answered HTTP {status}; try again later")


def _hub_error(e: BaseException, what: str, *, repo: str, filename: str | None = None) -> BaseException:
    """Translate huggingface_hub / HTTP exceptions into our HubError family (others are returned as is)."""
    from huggingface_hub import errors

    if isinstance(e, HubError):
        return e
    if isinstance(e, errors.OfflineModeIsEnabled):
        return _offline_error(what)
    response = getattr(e, "response", None)
    if isinstance(e, errors.HfHubHTTPError) and response is not None:
        return _status_error(response.status_code, what, repo=repo, filename=filename,
                             code=response.headers.get("X-Error-Code"))
    if _transport_error(e):
        return _offline_error(what, str(e).splitlines()[0] if str(e) else type(e).__name__)
    if isinstance(e, ValueError):  # HFValidationError: a malformed repo id
        return HubNotFound(f"{repo}: not a valid Hugging Face repo id, expected org/name ({str(e).splitlines()[0]})")
    return e


_last_ok: dict[str, float] = {}  # endpoint -> when it last answered (monotonic seconds)


def _reach(what: str) -> None:
    """Fail fast, with a clear message, when offline or the endpoint is unreachable (checked once a minute per
    endpoint): huggingface_hub's own calls would retry a dead connection for half a minute first."""
    if offline():
        raise _offline_error(what)
    url = endpoint()
    if time.monotonic() - _last_ok.get(url, -math.inf) < 60:
        return
    from huggingface_hub.utils import get_session

    try:
        get_session().head(url, timeout=10, follow_redirects=False)
    except Exception as e:  # noqa: BLE001 (classified below)
        err = _hub_error(e, what, repo="")
        if isinstance(err, HubError):
            raise err from e
        raise
    _last_ok[url] = time.monotonic()


def reachable() -> bool:
    """Whether the Hub endpoint answers (False offline); the same once-a-minute check as every Hub call. Advice
    only: any failure of the check counts as not answering."""
    try:
        _reach("reaching the Hugging Face Hub")
    except Exception:  # noqa: BLE001 - the caller then reads the local cache, which says what is missing
        return False
    return True


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


# ---------------------------------------------------------------- search and files


def search(query: str, *, sort: str = "downloads", limit: int = 20) -> list[HubModel]:
    """GGUF repos matching `query` (empty: the most popular), sorted by `sort` (see SORTS)."""
    if sort not in SORTS:
        raise HubError(f"unknown sort {sort!r}; choose one of: {', '.join(SORTS)}")
    if not 1 <= limit <= 1000:
        raise HubError(f"limit must be between 1 and 1000, got {limit}")
    what = f"searching for {query!r}"
    _reach(what)
    try:
        found = list(_api().list_models(search=query.strip() or None, filter="gguf", sort=SORTS[sort], limit=limit,
                                        expand=["downloads", "likes", "lastModified", "gated", "gguf"]))
    except Exception as e:  # noqa: BLE001 (classified)
        raise _hub_error(e, what, repo=query) from e
    out = []
    for m in found:
        g = getattr(m, "gguf", None) or {}
        lm = getattr(m, "last_modified", None)
        out.append(HubModel(id=m.id, downloads=getattr(m, "downloads", None), likes=getattr(m, "likes", None),
                            last_modified=lm.isoformat() if lm else None, gated=bool(getattr(m, "gated", False)),
                            params=g.get("total"), arch=g.get("architecture"), context_length=g.get("context_length")))
    return out


def family_drafts(family: str, *, below_params: int | None = None, limit: int = 10) -> list[HubModel]:
    """GGUF repos of a model family (general.basename, e.g. "Qwen2.5-Coder"), most downloaded first, smaller
    than `below_params` where the Hub states a size: draft candidates to download. Whether one can draft for a
    target is a header question: `fetch_header` then `library.check_pair`."""
    found = search(family, sort="downloads", limit=max(limit * 3, limit))
    keep = [m for m in found if below_params is None or m.params is None or m.params < below_params]
    return keep[:limit]


def quant_of(path: str) -> str:
    """The quantization a GGUF file name states ("…-Q4_K_M.gguf" -> "Q4_K_M"), else "unknown"."""
    for part in reversed(PurePosixPath(path).parts):
        hits = _QUANT.findall(part.removesuffix(".gguf"))
        if hits:
            q = hits[-1].upper()
            return {"FP16": "F16", "FP32": "F32"}.get(q, q)
    return "unknown"


def _kind(path: str) -> str:
    return "mmproj" if "mmproj" in PurePosixPath(path).name.lower() else "model"


def _check_repo(repo: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo or ""):
        raise HubNotFound(f"{repo!r}: not a Hugging Face repo id, expected org/name (e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF)")


def _tree(repo: str, *, revision: str, path: str | None = None) -> list:
    from huggingface_hub.hf_api import RepoFile

    what = f"listing {repo}"
    _check_repo(repo)
    _reach(what)
    try:
        items = list(_api().list_repo_tree(repo, path_in_repo=path, recursive=path is None, revision=revision))
    except Exception as e:  # noqa: BLE001 (classified)
        raise _hub_error(e, what, repo=repo) from e
    return [f for f in items if isinstance(f, RepoFile)]


def _hub_file(f) -> HubFile:
    sh = shard_of(PurePosixPath(f.path).name)
    return HubFile(path=f.path, size=int(f.lfs.size if f.lfs else f.size), sha256=f.lfs.sha256 if f.lfs else None,
                   blob_id=f.blob_id, quant=quant_of(f.path), shard=(sh[1], sh[2]) if sh else None, kind=_kind(f.path))


def repo_files(repo: str, *, revision: str = "main") -> RepoFiles:
    """The repo's .gguf files and the same grouped into downloadable models (see the module docstring)."""
    files = tuple(_hub_file(f) for f in _tree(repo, revision=revision) if f.path.lower().endswith(".gguf"))
    groups: dict[tuple, list[HubFile]] = {}
    for f in files:
        sh = shard_of(PurePosixPath(f.path).name)
        key = (str(PurePosixPath(f.path).parent), sh[0], sh[2]) if sh else (f.path,)
        groups.setdefault(key, []).append(f)
    out = []
    for key, members in groups.items():
        members.sort(key=lambda f: f.shard or (1, 1))
        n = key[2] if len(key) == 3 else 1
        name = f"{key[0]}/{key[1]}".removeprefix("./") if len(key) == 3 else key[0]
        out.append(QuantGroup(name=name, quant=members[0].quant, files=tuple(members),
                              size=sum(f.size for f in members), shards=n,
                              complete=len({f.shard for f in members}) == n, kind=members[0].kind))
    out.sort(key=lambda g: (g.kind != "model", g.size))
    return RepoFiles(repo=repo, revision=revision, files=files, groups=tuple(out))


def _remote(repo: str, filename: str, revision: str) -> HubFile:
    parent = str(PurePosixPath(filename).parent)
    for f in _tree(repo, revision=revision, path=None if parent == "." else parent):
        if f.path == filename:
            return _hub_file(f)
    raise _status_error(404, f"downloading {filename}", repo=repo, filename=filename)


def _url(repo: str, filename: str, revision: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, filename, revision=revision, endpoint=endpoint())


def _headers(extra: dict | None = None) -> dict:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(headers=extra or {})


def download_path(repo: str, filename: str) -> Path:
    """Where `filename` of `repo` is (or will be) downloaded."""
    _check_repo(repo)
    parts = PurePosixPath(filename).parts
    if not filename.lower().endswith(".gguf") or ".." in parts or PurePosixPath(filename).is_absolute():
        raise HubError(f"{filename!r}: pick a .gguf file of the repo by its path (no '..')")
    return downloaded_file(repo, filename)


# ---------------------------------------------------------------- headers


def fetch_header(repo: str, filename: str, *, revision: str = "main") -> Path:
    """The GGUF header of a file on the Hub (fetched with HTTP Range requests, cached); see the module docstring."""
    from huggingface_hub.utils import get_session

    folder = cache_dir() / ".library" / "hub-headers"
    key = hashlib.sha256(f"{repo}\0{filename}\0{revision}".encode()).hexdigest()[:24]
    out = folder / f"{key}.gguf"
    if out.is_file():
        return out
    what = f"reading the header of {filename}"
    _check_repo(repo)
    _reach(what)
    n, url = HEADER_FIRST, _url(repo, filename, revision)
    while True:
        try:
            r = get_session().get(url, headers=_headers({"Range": f"bytes=0-{n - 1}"}), follow_redirects=True,
                                  timeout=60)
        except Exception as e:  # noqa: BLE001 (classified)
            raise _hub_error(e, what, repo=repo, filename=filename) from e
        if r.status_code not in (200, 206):
            raise _status_error(r.status_code, what, repo=repo, filename=filename, code=r.headers.get("X-Error-Code"))
        data = r.content
        try:
            data = data[:parse_header(data, name=filename, keep=()).data_offset]  # keep the header, not weights
            break
        except HeaderTruncated as e:
            if r.status_code == 200 or len(data) < n or n >= HEADER_MAX:
                raise HubError(f"{filename}: its GGUF header did not parse from {len(data)} bytes ({e})") from e
            n = min(HEADER_MAX, max(e.need + (1 << 20), 2 * n))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------- one download


def _part(dest: Path) -> tuple[Path, Path]:
    return dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")


class _Meter:
    """Bytes per second over the last few seconds, and the ETA at that rate."""

    def __init__(self) -> None:
        self.samples: deque = deque(maxlen=64)

    def add(self, done: int) -> float:
        now = time.monotonic()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > 5:
            self.samples.popleft()
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def _check_space(folder: Path, need: int, filename: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need + DISK_MARGIN:
        raise NotEnoughSpace(f"not enough disk space for {filename}: it needs {format_bytes(need)} more and "
                             f"{format_bytes(free)} are free in {folder}; free some space, or set DSBD_CHAT_CACHE to "
                             "a folder on a larger disk")


def _hash_prefix(path: Path, n: int, h) -> None:
    with open(path, "rb") as f:
        left = n
        while left > 0 and (block := f.read(min(CHUNK, left))):
            h.update(block)
            left -= len(block)


class _Transfer:
    """One file's download: the bytes on disk, their running hash, and the progress it reports."""

    def __init__(self, repo: str, filename: str, revision: str, remote: HubFile, dest: Path,
                 report: Callable[[DownloadProgress], None]) -> None:
        self.repo, self.filename, self.revision, self.remote, self.dest = repo, filename, revision, remote, dest
        self.report, self.job = report, f"{repo}:{filename}"
        self.part, self.side = _part(dest)
        self.offset = self.done = 0
        self.h = self._new_hash()
        self.meter, self.last = _Meter(), 0.0

    def _new_hash(self):
        # the Hub states a sha256 for LFS files, else git's blob hash
        return hashlib.sha256() if self.remote.sha256 else hashlib.sha1(b"blob %d\0" % self.remote.size)

    def prepare(self) -> None:
        """Keep the partial file when its sidecar names the same file, else start an empty one; hash what is kept."""
        remote = self.remote
        facts = {"repo": self.repo, "filename": self.filename, "revision": self.revision, "size": remote.size,
                 "sha256": remote.sha256, "blob_id": remote.blob_id}
        old = _read_sidecar(self.side)
        offset = self.part.stat().st_size if self.part.is_file() and old and _same_file(old, facts) else 0
        if offset > remote.size:
            offset = 0
        _check_space(self.dest.parent, remote.size - offset, self.filename)
        if offset == 0:
            self.part.parent.mkdir(parents=True, exist_ok=True)
            self.part.write_bytes(b"")
        _write_sidecar(self.side, facts)
        self.h = self._new_hash()
        if offset:
            _hash_prefix(self.part, offset, self.h)
        self.meter, self.offset, self.done = _Meter(), offset, offset

    def tick(self, state: str = "running", force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            speed = self.meter.add(self.done)
            eta = (self.remote.size - self.done) / speed if speed > 0 else None
            self.report(DownloadProgress(self.job, self.repo, self.filename, state, self.done, self.remote.size, speed,
                                         eta, str(self.dest)))

    def fetch(self, stop: threading.Event | None) -> None:
        """Stream the missing bytes onto the partial file (a Range request from what is there) until done or stopped."""
        from huggingface_hub.utils import get_session

        repo, filename, what = self.repo, self.filename, f"downloading {self.filename}"
        headers = _headers({"Range": f"bytes={self.offset}-"} if self.offset else None)
        answered = False
        try:
            with get_session().stream("GET", _url(repo, filename, self.revision), headers=headers,
                                      follow_redirects=True, timeout=60) as r:
                answered = True
                if r.status_code not in (200, 206):
                    raise _status_error(r.status_code, what, repo=repo, filename=filename,
                                        code=r.headers.get("X-Error-Code"))
                mode = "ab"
                if self.offset and r.status_code == 200:  # the server ignored the Range: start over
                    self.offset = self.done = 0
                    self.h = self._new_hash()
                    mode = "wb"
                with open(self.part, mode) as out:
                    try:
                        for block in r.iter_bytes():  # as the bytes arrive: a dropped connection loses none
                            if stop is not None and stop.is_set():
                                break
                            out.write(block)
                            self.h.update(block)
                            self.done += len(block)
                            self.tick()
                    finally:
                        out.flush()
                        os.fsync(out.fileno())
        except HubError:
            raise
        except Exception as e:  # noqa: BLE001 (classified)
            err = _hub_error(e, what, repo=repo, filename=filename)
            if answered and _transport_error(e):
                err = HubError(f"connection lost: {filename} stopped at {format_bytes(self.done)} of "
                               f"{format_bytes(self.remote.size)} "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); start the download again "
                               "to continue from there")
            raise err from e

    def finish(self, stop: threading.Event | None) -> Path:
        """Check the whole file against the Hub's hash and give it its name (a paused one stays partial)."""
        filename, size, done = self.filename, self.remote.size, self.done
        if stop is not None and stop.is_set() and done < size:
            self.tick("paused", force=True)
            raise DownloadStopped(f"{filename} paused at {format_bytes(done)} of {format_bytes(size)}; resume to "
                                  "continue")
        if done != size:
            raise HubError(f"{filename}: the connection ended at {done:,} of {size:,} bytes; start the download "
                           "again to continue from there")
        want = self.remote.sha256 or self.remote.blob_id
        if self.h.hexdigest() != want:
            self.part.unlink(missing_ok=True)
            self.side.unlink(missing_ok=True)
            kind = "sha256" if self.remote.sha256 else "git hash"
            raise ChecksumMismatch(f"{filename} is damaged: its {kind} is {self.h.hexdigest()[:12]}..., the Hub says "
                                   f"{want[:12]}...; the download was deleted, start it again")
        os.chmod(self.part, 0o644)
        os.replace(self.part, self.dest)
        self.side.unlink(missing_ok=True)
        self.tick("done", force=True)
        return self.dest


def download_file(repo: str, filename: str, *, revision: str = "main",
                  progress: Callable[[DownloadProgress], None] | None = None,
                  stop: threading.Event | None = None) -> Path:
    """Download one file into the model cache, resuming a partial one; see the module docstring."""
    dest = download_path(repo, filename)
    report = progress or (lambda p: None)
    remote = _remote(repo, filename, revision)
    if dest.is_file() and dest.stat().st_size == remote.size:
        report(DownloadProgress(f"{repo}:{filename}", repo, filename, "done", remote.size, remote.size,
                                path=str(dest)))
        return dest
    transfer = _Transfer(repo, filename, revision, remote, dest, report)
    transfer.prepare()
    transfer.tick(force=True)
    if transfer.offset < remote.size:
        transfer.fetch(stop)
    return transfer.finish(stop)


def _same_file(old: dict, new: dict) -> bool:
    return all(old.get(k) == new.get(k) for k in ("repo", "filename", "size", "sha256", "blob_id"))


def _read_sidecar(side: Path) -> dict | None:
    try:
        d = json.loads(side.read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def _write_sidecar(side: Path, facts: dict) -> None:
    atomic_write(side, json.dumps(facts))


def partial_downloads() -> list[DownloadProgress]:
    """Downloads a stop, a lost connection or a closed app left behind, as paused jobs."""
    root = cache_dir() / "hub"
    out = []
    if not root.is_dir():
        return out
    for side in sorted(root.rglob("*.part.json")):
        facts = _read_sidecar(side)
        part = side.with_name(side.name.removesuffix(".json"))
        if not facts or not isinstance(facts.get("repo"), str) or not isinstance(facts.get("filename"), str):
            continue
        done = part.stat().st_size if part.is_file() else 0
        dest = side.with_name(side.name.removesuffix(".part.json"))
        out.append(DownloadProgress(f"{facts['repo']}:{facts['filename']}", facts["repo"], facts["filename"], "paused",
                                    done, int(facts.get("size") or 0), path=str(dest)))
    return out


# ---------------------------------------------------------------- the queue


class _Job:
    def __init__(self, p: DownloadProgress, revision: str) -> None:
        self.p, self.revision = p, revision
        self.stop = threading.Event()
        self.cancel = False
        self.finished = threading.Event()


class DownloadManager:
    """Downloads one after another (`parallel` at a time) on worker threads; see the module docstring.

    `on_progress(DownloadProgress)` is called from the worker threads on every change (a few times a second while
    running); `jobs()` is the same information on demand."""

    def __init__(self, *, on_progress: Callable[[DownloadProgress], None] | None = None, parallel: int = 1,
                 restore: bool = True) -> None:
        if parallel < 1:
            raise HubError(f"parallel must be >= 1, got {parallel}")
        self._on_progress = on_progress
        self._lock = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[str] = deque()
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"download-{i}", daemon=True)
                         for i in range(parallel)]
        if restore:
            for p in partial_downloads():
                self._jobs[p.id] = _Job(p, _read_sidecar(Path(p.path + ".part.json")).get("revision", "main"))
        for w in self._workers:
            w.start()

    # -- queries
    def jobs(self) -> list[DownloadProgress]:
        with self._lock:
            return [j.p for j in self._jobs.values()]

    def get(self, job_id: str) -> DownloadProgress:
        with self._lock:
            return self._job(job_id).p

    def _job(self, job_id: str) -> _Job:
        j = self._jobs.get(job_id)
        if j is None:
            raise HubError(f"no download {job_id!r} (downloads: {', '.join(self._jobs) or 'none'})")
        return j

    # -- actions
    def add(self, repo: str, filename: str, *, revision: str = "main") -> DownloadProgress:
        """Queue `filename` of `repo` (a job already queued, running or paused is returned as it is)."""
        dest = download_path(repo, filename)
        job_id = f"{repo}:{filename}"
        with self._lock:
            if self._closed:
                raise HubError("the download manager is closed")
            j = self._jobs.get(job_id)
            if j is not None and j.p.state in ("queued", "running"):
                return j.p
            if j is not None and j.p.state == "paused":
                return self._requeue(j)
            part, _ = _part(dest)
            j = _Job(DownloadProgress(job_id, repo, filename, "queued", part.stat().st_size if part.is_file() else 0,
                                      0, path=str(dest)), revision)
            self._jobs[job_id] = j
            self._queue.append(job_id)
            self._lock.notify_all()
        self._emit(j.p)
        return j.p

    def pause(self, job_id: str) -> DownloadProgress:
        with self._lock:
            j = self._job(job_id)
            if j.p.state == "queued":
                self._queue.remove(job_id)
                j.p = replace(j.p, state="paused")
            elif j.p.state == "running":
                j.stop.set()  # the worker marks it paused when the current chunk is written
            p = j.p
        self._emit(p)
        return p

    def resume(self, job_id: str) -> DownloadProgress:
        with self._lock:
            j = self._job(job_id)
            if j.p.state not in ("paused", "failed"):
                return j.p
            p = self._requeue(j)
        self._emit(p)
        return p

    def _requeue(self, j: _Job) -> DownloadProgress:
        j.stop.clear()
        j.finished.clear()
        j.p = replace(j.p, state="queued", error=None)
        self._queue.append(j.p.id)
        self._lock.notify_all()
        return j.p

    def cancel(self, job_id: str, *, confirm: bool = False) -> CancelPlan:
        """Without `confirm`: what cancelling would delete. With it: stop the download, delete its partial file."""
        with self._lock:
            j = self._job(job_id)
            part, side = _part(Path(j.p.path))
            lost = part.stat().st_size if part.is_file() else 0
            files = tuple(str(f) for f in (part, side) if f.exists())
            if j.p.state in ("done", "cancelled"):
                raise HubError(f"{job_id} is {j.p.state}: nothing to cancel (delete a downloaded model from the "
                               "library)")
            if not confirm:
                return CancelPlan(j.p, lost, files, cancelled=False)
            if j.p.state == "running":
                j.cancel = True
                j.stop.set()
            elif j.p.state in ("queued", "paused", "failed"):
                if j.p.id in self._queue:
                    self._queue.remove(j.p.id)
                j.p = replace(j.p, state="cancelled", done=0)
                j.finished.set()
                for f in (part, side):
                    f.unlink(missing_ok=True)
            running = j.p.state == "running"
        if running:
            j.finished.wait(30)
        with self._lock:
            p = j.p
        self._emit(p)
        return CancelPlan(p, lost, files, cancelled=True)

    def remove(self, job_id: str) -> None:
        """Drop a finished, failed or cancelled job from the list (a download on disk stays)."""
        with self._lock:
            j = self._job(job_id)
            if j.p.state in ("queued", "running", "paused"):
                raise HubError(f"{job_id} is {j.p.state}: pause or cancel it first")
            del self._jobs[job_id]

    def wait(self, job_id: str, timeout: float | None = None) -> DownloadProgress:
        """Block until the job is done, failed, paused or cancelled (or `timeout` passes); its state then."""
        with self._lock:
            j = self._job(job_id)
        j.finished.wait(timeout)
        return self.get(job_id)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers; a running download pauses (its partial file resumes on the next start)."""
        with self._lock:
            self._closed = True
            for j in self._jobs.values():
                if j.p.state == "running":
                    j.stop.set()
            self._lock.notify_all()
        for w in self._workers:
            w.join(timeout)

    # -- workers
    def _emit(self, p: DownloadProgress) -> None:
        if self._on_progress is not None:
            try:
                self._on_progress(p)
            except Exception:  # noqa: BLE001 (a UI callback must not kill a download)
                pass

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                j = self._jobs[self._queue.popleft()]
                j.p = replace(j.p, state="running")
            self._run(j)

    def _run(self, j: _Job) -> None:
        def progress(p: DownloadProgress) -> None:
            with self._lock:
                if j.p.state == "running":
                    j.p = replace(p, state="running") if p.state != "done" else p
            self._emit(p)

        try:
            download_file(j.p.repo, j.p.filename, revision=j.revision, progress=progress, stop=j.stop)
            with self._lock:
                j.p = replace(j.p, state="done", done=j.p.total or j.p.done, speed=0.0, eta=0.0)
        except DownloadStopped:
            with self._lock:
                if j.cancel:
                    part, side = _part(Path(j.p.path))
                    part.unlink(missing_ok=True)
                    side.unlink(missing_ok=True)
                    j.p = replace(j.p, state="cancelled", done=0, speed=0.0, eta=None)
                else:
                    j.p = replace(j.p, state="paused", speed=0.0, eta=None)
        except Exception as e:  # noqa: BLE001 (a failed download is reported on its job, the queue goes on)
            with self._lock:
                j.p = replace(j.p, state="failed", error=str(e), speed=0.0, eta=None)
        finally:
            j.cancel = False
            j.finished.set()
        self._emit(j.p)
