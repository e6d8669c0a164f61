"""A small local stand-in for the Hugging Face Hub, for offline tests that drive huggingface_hub for real.

`FakeHub` is a threaded http.server on 127.0.0.1 (a free port) speaking the few routes the app uses:

- `GET /api/models?search=&filter=gguf&sort=&limit=`: model search (HfApi.list_models)
- `GET /api/models/<org>/<name>`: model info with its files (HfApi.model_info)
- `GET /api/models/<org>/<name>/tree/<revision>[/<folder>]?recursive=`: the repo tree with LFS sha256
  (HfApi.list_repo_tree)
- `GET|HEAD /<org>/<name>/resolve/<revision>/<file>`: file bytes with `Range` support (206 + Content-Range),
  and the headers hf_hub_download expects (ETag, X-Repo-Commit, X-Linked-Etag, X-Linked-Size)
- `HEAD /`: the reachability probe

Use it as a context manager; `env()` gives the environment (HF_ENDPOINT) that points huggingface_hub at it:

    with FakeHub() as hub:
        hub.add_repo("org/model-GGUF", {"model-Q4_K_M.gguf": data}, downloads=10)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)

`isolate(monkeypatch, root)` points the model cache, the Hugging Face cache and the home folder (LM Studio,
Jan) at empty folders under `root`, so a test sees only the files it writes.

Faults for tests: `drop_after[file] = n` closes the connection after n body bytes (once), `hold_after[file] =
n` stops sending after n body bytes (setting `holding`) until `released` is set (once: a download caught
mid-file), `throttle_s` sleeps
per 64 KiB sent, `corrupt[file] = bytes` serves other bytes than the tree's sha256 says, `private` repos need
`Authorization: Bearer <token>` (401 otherwise), `gated` repos answer 403 GatedRepo. `requests` records
(method, path, Range header). The server stops itself after `lifetime_s` even if a test forgets it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

SEND_CHUNK = 64 << 10


def isolate(monkeypatch, root) -> dict:
    """Empty model cache, HF cache and home under `root` (a pathlib.Path); returns them by name."""
    from pathlib import Path

    root = Path(root)
    paths = {"cache": root / "cache", "hf": root / "hf" / "hub", "home": root / "home"}
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("DSBD_CHAT_CACHE", str(paths["cache"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(paths["hf"]))
    monkeypatch.setenv("HOME", str(paths["home"]))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return paths


@dataclass
class Repo:
    files: dict[str, bytes]
    downloads: int = 0
    likes: int = 0
    last_modified: str = "2025-01-01T00:00:00.000Z"
    gguf: dict | None = None
    private: bool = False
    gated: bool = False
    commit: str = "0" * 40
    sha: dict = field(default_factory=dict)  # file -> sha256 hex (of the true bytes)


class FakeHub:
    def __init__(self, *, token: str = "test-token", lifetime_s: float = 600.0) -> None:
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.drop_after: dict[str, int] = {}
        self.hold_after: dict[str, int] = {}
        self.released = threading.Event()
        self.holding = threading.Event()  # set when a held download has stopped sending
        self.corrupt: dict[str, bytes] = {}
        self.throttle_s = 0.0
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    # -- setup
    def add_repo(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        r = Repo(files=dict(files), **kw)
        r.commit = hashlib.sha1(repo_id.encode()).hexdigest()
        r.sha = {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}
        self.repos[repo_id] = r
        return r

    def env(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}

    # -- lifecycle
    def start(self) -> "FakeHub":
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- routes
    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        url = urlsplit(h.path)
        path, query = unquote(url.path), parse_qs(url.query)
        with self._lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        try:
            if path in ("", "/"):
                return self._send(h, 200, b"", "text/plain", head=head)
            if path == "/api/models":
                return self._json(h, self._search(query), head)
            if path.startswith("/api/models/"):
                rest = path[len("/api/models/"):]
                parts = rest.split("/")
                repo_id = "/".join(parts[:2])
                repo = self._repo(h, repo_id)
                if repo is None:
                    return
                if len(parts) == 2:
                    return self._json(h, self._info(repo_id, repo), head)
                if len(parts) >= 4 and parts[2] == "tree":
                    folder = "/".join(parts[4:])
                    recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                    return self._json(h, self._tree(repo, folder, recursive), head)
                return self._error(h, 404, "EntryNotFound", head)
            parts = path.strip("/").split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
                repo = self._repo(h, repo_id)
                if repo is None:
                    return
                if filename not in repo.files:
                    return self._error(h, 404, "EntryNotFound", head)
                return self._file(h, repo, filename, head)
            return self._error(h, 404, "RepoNotFound", head)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _repo(self, h, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", h.command == "HEAD")
            return None
        if repo.private and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "RepoNotFound", h.command == "HEAD")
            return None
        if repo.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 403, "GatedRepo", h.command == "HEAD")
            return None
        return repo

    def _search(self, query: dict) -> list[dict]:
        text = query.get("search", [""])[0].lower()
        filters = [f.lower() for f in query.get("filter", [])]
        out = []
        for rid, r in self.repos.items():
            if r.private or (text and text not in rid.lower()):
                continue
            if "gguf" in filters and not any(f.endswith(".gguf") for f in r.files):
                continue
            item = {"id": rid, "_id": rid, "modelId": rid, "downloads": r.downloads, "likes": r.likes,
                    "lastModified": r.last_modified, "gated": r.gated, "tags": ["gguf"], "private": False}
            if r.gguf:
                item["gguf"] = r.gguf
            out.append(item)
        sort = query.get("sort", [""])[0]
        if sort in ("downloads", "likes", "lastModified"):
            out.sort(key=lambda m: m[sort], reverse=True)
        limit = int(query.get("limit", ["1000"])[0])
        return out[:limit]

    def _info(self, repo_id: str, r: Repo) -> dict:
        return {"id": repo_id, "_id": repo_id, "modelId": repo_id, "sha": r.commit, "downloads": r.downloads,
                "likes": r.likes, "lastModified": r.last_modified, "private": r.private, "gated": r.gated,
                "tags": ["gguf"], "siblings": [{"rfilename": f} for f in r.files]}

    def _tree(self, r: Repo, folder: str, recursive: bool) -> list[dict]:
        out, dirs = [], set()
        prefix = f"{folder}/" if folder else ""
        for name, data in sorted(r.files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            out.append({"type": "file", "oid": oid, "size": len(data), "path": name,
                        "lfs": {"oid": r.sha[name], "size": len(data), "pointerSize": 134}})
        out += [{"type": "directory", "oid": "1" * 40, "path": d} for d in sorted(dirs)]
        return out

    def _file(self, h, r: Repo, name: str, head: bool) -> None:
        data = self.corrupt.get(name, r.files[name])
        total, start, end = len(data), 0, len(data) - 1
        status = 200
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[len("bytes="):].partition("-")
            start = int(a) if a else 0
            end = min(int(b), total - 1) if b else total - 1
            if start >= total:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{total}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        body = data[start:end + 1]
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{r.sha[name]}"')
        h.send_header("X-Linked-Etag", f'"{r.sha[name]}"')
        h.send_header("X-Linked-Size", str(total))
        h.send_header("X-Repo-Commit", r.commit)
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        h.end_headers()
        if head:
            return
        limit = self.drop_after.pop(name, None)
        hold = self.hold_after.pop(name, None)
        sent = 0
        while sent < len(body):
            if hold is not None and sent >= hold:
                h.wfile.flush()
                self.holding.set()
                self.released.wait(60)  # the test does what it must mid-download, then releases
                hold = None
            piece = body[sent:sent + SEND_CHUNK]
            if limit is not None and sent + len(piece) > limit:
                h.wfile.write(piece[:max(0, limit - sent)])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(2)  # an abrupt end mid-body, as a dropped connection
                return
            h.wfile.write(piece)
            sent += len(piece)
            if self.throttle_s:
                h.wfile.flush()
                time.sleep(self.throttle_s)

    # -- replies
    def _json(self, h, data, head: bool) -> None:
        self._send(h, 200, json.dumps(data).encode(), "application/json", head=head)

    def _error(self, h, status: int, code: str, head: bool) -> None:
        body = json.dumps({"error": f"{code} (fake hub)"}).encode()
        self._send(h, status, body, "application/json", head=head, extra={"X-Error-Code": code,
                                                                          "X-Error-Message": code})

    @staticmethod
    def _send(h, status: int, body: bytes, ctype: str, *, head: bool, extra: dict | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)
