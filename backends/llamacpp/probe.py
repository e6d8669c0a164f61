"""Whether llama.cpp's weight repack ("extra buffer types") is safe on this CPU, decided once and cached.

On CPUs with AMX, llama.cpp repacks weights into its AMX buffer type and the first matmul can die with
SIGILL (an upstream fault: llama.cpp issue 20824). Loading with `use_extra_bufts = False` avoids it, at some
speed cost on CPUs where the repack works. So, per llama-cpp-python build, CPU and set of weight types, a
child process loads the model with the repack on and decodes a few tokens; if the child dies, the repack
stays off. The verdict is cached in a JSON file; `DSBD_CHAT_LLAMA_EXTRA_BUFTS=on|off|auto` or
`--llama-extra-bufts` overrides it.

Run as `python -m backends.llamacpp.probe MODEL.gguf` to probe one file by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from backends.cpu import cpu_id, cpu_summary
from backends.load_progress import current as load_tracker

ENV = "DSBD_CHAT_LLAMA_EXTRA_BUFTS"
SETTINGS = ("auto", "on", "off")
PROBE_TIMEOUT_S = 180
_POLL_S = 0.2  # how often a running probe looks at its load's cancel Event
_lock = threading.Lock()


@dataclass(frozen=True)
class Verdict:
    """Whether to load with extra buffer types, and why (shown in `dsbd-chat models` and the Models tab)."""

    extra_bufts: bool
    reason: str

    def describe(self) -> str:
        return f"llama.cpp weight repack {'on' if self.extra_bufts else 'off'}: {self.reason}"


def setting(value: str | None = None) -> str:
    """The effective setting: an explicit value, else $DSBD_CHAT_LLAMA_EXTRA_BUFTS, else auto."""
    v = (value if value not in (None, "", "auto") else os.environ.get(ENV, "auto")).strip().lower()
    if v not in SETTINGS:
        src = "--llama-extra-bufts" if value not in (None, "", "auto") else f"${ENV}"
        raise ValueError(f"{src} must be one of {', '.join(SETTINGS)}, got {v!r}")
    return v


def decide(path: Path, value: str | None = None, *, cache_file: Path | None = None) -> Verdict:
    """on / off as asked; auto: the cached probe verdict for this build, CPU and file's weight types."""
    v = setting(value)
    if v != "auto":
        how = "--llama-extra-bufts" if value in ("on", "off") else f"${ENV}"
        return Verdict(v == "on", f"set by {how}={v}")
    try:
        key = probe_key(path)
    except Exception as e:  # an unreadable header: load with the safe setting and let the loader explain
        return Verdict(False, f"weight types unreadable ({type(e).__name__}), so the safe setting")
    cache_file = cache_file or _cache_file()
    with _lock:
        cached = _read(cache_file).get(key)
        if cached is None:
            cached = run_probe(path) | {"cpu": _cpu_hash(), "types": weight_types(path)}
            store = _read(cache_file)
            store[key] = cached
            _write(cache_file, store)
    if cached["ok"]:
        return Verdict(True, f"probe passed on this CPU ({cpu_summary()})")
    return Verdict(False, f"{cached['why']}: known llama.cpp fault with the AMX repack (issue 20824); "
                          f"probe result cached in {cache_file}")


def run_probe(path: Path, *, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Load `path` with the repack on and decode in a child process; {ok, why}. A load's tracker hears it as
    the "probe" stage; a cancelled load ends the child (LoadCancelled, nothing cached)."""
    cmd = [sys.executable, "-m", "backends.llamacpp.probe", "--child", str(path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_project_root(), os.environ.get("PYTHONPATH")])))
    tracker = load_tracker()
    tracker.report("probe", 0.0, path.name)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        due = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if tracker.cancelled or time.monotonic() > due:
                    proc.kill()
                    proc.communicate()
                    tracker.check()  # raises LoadCancelled
                    return {"ok": False, "why": f"a test decode with the repack on did not finish in {timeout:.0f} s"}
    tracker.tell("probe", 1.0, path.name)
    if proc.returncode == 0 and "probe ok" in out:
        return {"ok": True, "why": ""}
    if proc.returncode < 0:
        return {"ok": False, "why": f"a test decode with the repack on died with {signal_name(-proc.returncode)}"}
    tail = (err or out).strip().splitlines()[-1:] or ["no output"]
    return {"ok": False, "why": f"a test decode with the repack on failed (exit {proc.returncode}: {tail[0][:200]})"}


def signal_name(sig: int) -> str:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
    what = {"SIGILL": "illegal instruction", "SIGSEGV": "segmentation fault", "SIGABRT": "abort",
            "SIGBUS": "bus error", "SIGKILL": "killed, out of memory?", "SIGFPE": "arithmetic fault"}.get(name)
    return f"{name} ({what})" if what else name


def probe_key(path: Path) -> str:
    """Build (llama-cpp-python version + library file), CPU (model + flags) and the file's weight types."""
    parts = [build_id(), cpu_id(), ",".join(weight_types(path))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def build_id() -> str:
    """The llama-cpp-python version and its library files (name, size, mtime): a rebuild changes it."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    libs = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in lib.glob("*") if p.is_file()) \
        if lib.is_dir() else []
    return f"{llama_cpp.__version__}|{libs!r}"


def weight_types(path: Path) -> list[str]:
    """The tensor types in a GGUF file, from its header (no weights read, the tokenizer arrays skipped). Cached per
    file (path, size, mtime)."""
    st = Path(path).stat()
    key = f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"
    f = _cache_file().with_name("gguf-types.json")
    known = _read(f)
    if isinstance(known.get(key), list):
        return known[key]
    from offload.gguf_header import read_header

    types = sorted({t.type_name for t in read_header(path, keep=()).tensors})
    _write(f, {k: v for k, v in known.items() if Path(k.split("|")[0]).exists()} | {key: types})
    return types


def probe_summary() -> str:
    """One line for `dsbd-chat models`: the override, or the cached verdicts for this CPU."""
    v = setting()
    if v != "auto":
        return f"llama.cpp weight repack {v} (set by ${ENV})"
    seen = [e for e in _read(_cache_file()).values() if e.get("cpu") == _cpu_hash()]
    if not seen:
        return "llama.cpp weight repack: auto (probed at the first load of a GGUF file on this CPU)"
    parts = [f"{'on' if e['ok'] else 'off'} for {'/'.join(e.get('types', [])) or '?'}"
             + ("" if e["ok"] else f" ({e['why']}: known llama.cpp fault)") for e in seen]
    return "llama.cpp weight repack " + "; ".join(parts)


def _cpu_hash() -> str:
    return hashlib.sha256(cpu_id().encode()).hexdigest()[:16]


def _cache_file() -> Path:
    root = os.environ.get("DSBD_CHAT_CACHE") or Path.home() / ".cache" / "dsbd-chat"
    return Path(root) / "llama-probe.json"


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _read(f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(f: Path, data: dict) -> None:
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=".probe.", suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=1)
        os.replace(tmp, f)
    except OSError:  # a read-only cache only costs a probe per start
        pass


def _child(path: str) -> int:
    """Load with the repack on, decode a 16-token batch and one more token; print 'probe ok'."""
    import llama_cpp.llama_cpp as ll

    import backends.llamacpp._native  # noqa: F401  quiet logging (a callback kept alive) and backend init

    mp = ll.llama_model_default_params()
    mp.use_extra_bufts = True
    model = ll.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        print("cannot load the model", file=sys.stderr)
        return 2
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 32, 32, 1, 1
    ctx = ll.llama_init_from_model(model, cp)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    for start, n in ((0, 16), (16, 1)):
        batch = ll.llama_batch_init(n, 0, 1)
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = (start + i * 7) % n_vocab, start + i, 1, i == n - 1
            batch.seq_id[i][0] = 0
        if ll.llama_decode(ctx, batch) != 0:
            print("llama_decode failed", file=sys.stderr)
            return 3
        ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    print("probe ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        return _child(args[1])
    if len(args) != 1:
        print("usage: python -m backends.llamacpp.probe MODEL.gguf", file=sys.stderr)
        return 2
    path = Path(args[0])
    print(f"CPU: {cpu_summary()}")
    r = run_probe(path)
    print("repack works here" if r["ok"] else f"repack unsafe here: {r['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
