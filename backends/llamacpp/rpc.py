"""The target over several machines through llama.cpp's RPC backend (ggml-rpc): workers and remote devices.

A worker (`dsbd-chat rpc-worker`) serves its machine's devices to one client through the wheel's own
`ggml_backend_rpc_start_server`, so both ends speak the same protocol version. The client adds each worker
with `ggml_backend_rpc_add_server` and passes the returned devices to ONE model load through
`llama_model_params.devices`; the registry is never registered globally, so every other load (the draft)
stays on local devices. The output head is pinned to the host's CPU (`tensor_buft_overrides`): otherwise,
without a local GPU, it lands on the last worker and every forest node's logits (vocabulary x 4 bytes)
cross the network.

The native client aborts the whole process when it cannot connect, when the handshake fails and when a
worker dies mid-run. So every endpoint is checked from Python first (backends/remote.py: TCP connect plus
the protocol's hello, short timeouts) and the RPC target loads in the supervised model process
(app.engine.worker). llama_cpp itself is imported on first native use.
"""

from __future__ import annotations

import ctypes
import re
import socket
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from backends.remote import (  # noqa: F401  re-exported: the plain-Python half of this module
    CHECK_TIMEOUT_S, DEFAULT_PORT, PROTOCOL_MAJOR, REBUILD, SECURITY, NoRPCSupport, RPCError, WorkerInfo,
    WorkerUnreachable, check, check_all, first_unreachable, is_loopback, join, parse_endpoints, split)

HEAD_PATTERN = r"^(output|output_norm)\.weight$"  # the untied output projection and its norm
TIED_HEAD_PATTERN = r"^token_embd\.weight$"  # a tied head is a duplicate of the embeddings

# ---------------------------------------------------------------- native bindings


def supported() -> bool:
    """Whether the installed llama-cpp-python was built with GGML_RPC (llama_supports_rpc)."""
    try:
        import llama_cpp.llama_cpp as ll
    except ImportError:
        return False
    return bool(ll.llama_supports_rpc()) and _lib_dir() is not None and any(_lib_dir().glob("libggml-rpc*"))


def require_support() -> None:
    if not supported():
        raise NoRPCSupport("this llama-cpp-python was built without RPC support (llama_supports_rpc() is false); "
                           f"rebuild it once with: {REBUILD}")


def _lib_dir() -> Path | None:
    import llama_cpp

    d = Path(llama_cpp.__file__).parent / "lib"
    return d if d.is_dir() else None


class _Lib:
    """ctypes prototypes of the ggml-rpc and ggml backend-device functions this module calls."""

    def __init__(self) -> None:
        import backends.llamacpp._native  # noqa: F401  backend init and quiet logging first

        d = _lib_dir()
        name = {"darwin": "libggml-rpc.dylib", "win32": "ggml-rpc.dll"}.get(sys.platform, "libggml-rpc.so")
        base = {"darwin": "libggml-base.dylib", "win32": "ggml-base.dll"}.get(sys.platform, "libggml-base.so")
        ggml = {"darwin": "libggml.dylib", "win32": "ggml.dll"}.get(sys.platform, "libggml.so")
        self.rpc, self.base, self.ggml = (ctypes.CDLL(str(d / n)) for n in (name, base, ggml))
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self._proto(self.rpc, "ggml_backend_rpc_add_server", vp, [cp])
        self._proto(self.rpc, "ggml_backend_rpc_start_server", None, [cp, cp, sz, sz, ctypes.POINTER(vp)])
        self._proto(self.base, "ggml_backend_reg_dev_count", sz, [vp])
        self._proto(self.base, "ggml_backend_reg_dev_get", vp, [vp, sz])
        self._proto(self.base, "ggml_backend_dev_name", cp, [vp])
        self._proto(self.base, "ggml_backend_dev_description", cp, [vp])
        self._proto(self.base, "ggml_backend_dev_type", ctypes.c_int, [vp])
        self._proto(self.base, "ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self._proto(self.base, "ggml_backend_dev_buffer_type", vp, [vp])
        self._proto(self.ggml, "ggml_backend_dev_count", sz, [])
        self._proto(self.ggml, "ggml_backend_dev_get", vp, [sz])
        self._proto(self.ggml, "ggml_backend_dev_by_type", vp, [ctypes.c_int])

    @staticmethod
    def _proto(lib, name, restype, argtypes) -> None:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes

    def memory(self, dev) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


_DEV_CPU, _DEV_GPU, _DEV_IGPU = 0, 1, 2  # enum ggml_backend_dev_type
_lib: _Lib | None = None
_live: "weakref.WeakSet[RPCDevices]" = weakref.WeakSet()  # held by loaded models (ModelHandle.placement)
_registries: dict[str, int] = {}  # endpoint -> ggml_backend_reg_t: the native client keeps one per endpoint


def lib() -> _Lib:
    global _lib
    if _lib is None:
        require_support()
        _lib = _Lib()
    return _lib


@dataclass(frozen=True)
class Device:
    """One device a model load may use: a worker's (endpoint set) or a local GPU."""

    name: str  # llama.cpp's device name: RPC0, RPC1, CUDA0 ...
    description: str
    endpoint: str | None
    free: int
    total: int

    def where(self) -> str:
        return f"{self.name} ({self.endpoint})" if self.endpoint else f"{self.name} (this machine: {self.description})"


def _remote(endpoint: str) -> list[tuple[int, Device]]:
    L = lib()
    reg = _registries.get(endpoint)
    if reg is None:
        reg = L.rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RPCError(f"llama.cpp could not add the RPC worker {endpoint}")
        _registries[endpoint] = reg
    out = []
    for i in range(L.base.ggml_backend_reg_dev_count(reg)):
        dev = L.base.ggml_backend_reg_dev_get(reg, i)
        free, total = L.memory(dev)
        out.append((dev, Device(L.base.ggml_backend_dev_name(dev).decode(),
                                L.base.ggml_backend_dev_description(dev).decode(), endpoint, free, total)))
    return out


def _local_gpus() -> list[tuple[int, Device]]:
    L = lib()
    out = []
    for i in range(L.ggml.ggml_backend_dev_count()):
        dev = L.ggml.ggml_backend_dev_get(i)
        if L.base.ggml_backend_dev_type(dev) in (_DEV_GPU, _DEV_IGPU):
            free, total = L.memory(dev)
            out.append((dev, Device(L.base.ggml_backend_dev_name(dev).decode(),
                                    L.base.ggml_backend_dev_description(dev).decode(), None, free, total)))
    return out


def _check_unused(endpoints: Sequence[str], timeout: float) -> None:
    """check() every worker before the native client can abort on a dead one. A worker a live model of this
    process already uses is skipped: it serves one client, this process, and would not answer a second."""
    busy = {ep for p in list(_live) for ep in p.endpoints}
    check_all([ep for ep in endpoints if ep not in busy], timeout=timeout)


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]  # llama_model_tensor_buft_override


class RPCDevices:
    """What one RPC model load passes to llama.cpp: the NULL-terminated device list (local GPUs, then every
    worker's devices) and the overrides keeping the output head on the host CPU. Holds the ctypes arrays
    for as long as the model lives."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = CHECK_TIMEOUT_S) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if not self.endpoints:
            raise RPCError("no RPC endpoints given")
        require_support()
        _check_unused(self.endpoints, timeout)
        picked = _local_gpus() + [d for ep in self.endpoints for d in _remote(ep)]
        self.devices = tuple(d for _, d in picked)
        self._devs = (ctypes.c_void_p * (len(picked) + 1))(*(p for p, _ in picked), None)
        cpu_buft = lib().base.ggml_backend_dev_buffer_type(lib().ggml.ggml_backend_dev_by_type(_DEV_CPU))
        pats = [HEAD_PATTERN, TIED_HEAD_PATTERN]
        self._patterns = [p.encode() for p in pats]  # the structs point into these bytes
        self._overrides = (_Override * (len(pats) + 1))(*(_Override(p, cpu_buft) for p in self._patterns),
                                                         _Override(None, None))
        self._split = None
        _live.add(self)

    def spread(self, n_layers: int) -> None:
        """Split n_layers over the devices in proportion to their free memory (llama.cpp's own rule), counting
        the output layer's slot on the last device: llama.cpp gives it a share, and ours stays on the host."""
        import llama_cpp.llama_cpp as ll

        free = [max(d.free, 1) for d in self.devices]
        total = float(sum(free))
        share = [n_layers * f / total for f in free]
        share[-1] += 1.0
        self._split = (ctypes.c_float * max(ll.llama_max_devices(), len(share)))(*share)

    @property
    def split_ptr(self):
        return None if self._split is None else ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))

    @property
    def devices_ptr(self) -> int:
        return ctypes.cast(self._devs, ctypes.c_void_p).value

    @property
    def overrides_ptr(self) -> int:
        return ctypes.cast(self._overrides, ctypes.c_void_p).value


def worker_memory(endpoints: Sequence[str], *, timeout: float = CHECK_TIMEOUT_S) -> list[Device]:
    """Each worker's devices with their free / total memory (for `dsbd-chat plan --rpc` and `models`)."""
    eps = parse_endpoints(endpoints)
    require_support()
    _check_unused(eps, timeout)
    return [d for ep in eps for _, d in _remote(ep)]


# ---------------------------------------------------------------- placement read back from the load log


_ASSIGNED = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
_BUFFER = re.compile(r"load_tensors:\s+([^\s\[]+)(?:\[([^\]]*)\])? model buffer size =\s+([0-9.]+) MiB")
_OVERRIDE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")


def summarize(lines: Sequence[str], devices: Sequence[Device], n_layers: int) -> dict:
    """llama.cpp's load log -> {layers: {device: [first, last]...}, head, buffers MiB}: where each part lives."""
    where = {d.name: d.where() for d in devices}
    layers: dict[int, str] = {}
    buffers: dict[str, float] = {}
    head = "host CPU"
    for line in lines:
        if m := _ASSIGNED.search(line):
            i, dev = int(m.group(1)), m.group(2)
            if i < n_layers:
                layers[i] = dev
            elif dev != "CPU":
                head = where.get(dev, dev)
        elif m := _BUFFER.search(line):  # "RPC0[host:port]": the bracket names the worker
            key = m.group(2) or ("host CPU" if m.group(1).startswith("CPU") else m.group(1))
            buffers[key] = buffers.get(key, 0.0) + float(m.group(3))
        elif (m := _OVERRIDE.search(line)) and m.group(1) in ("output.weight", "token_embd.weight"):
            head = "host CPU"
    spans: list[list] = []
    for i in sorted(layers):
        dev = layers[i]
        if spans and spans[-1][0] == dev and spans[-1][2] == i - 1:
            spans[-1][2] = i
        else:
            spans.append([dev, i, i])
    parts = [f"layers {a}-{b}" if a != b else f"layer {a}" for _, a, b in spans]
    text = "; ".join(f"{p} on {'the host CPU' if dev == 'CPU' else where.get(dev, dev)}"
                     for p, (dev, _, _) in zip(parts, spans))
    return {"layers": text + f"; output head on the {head}" if text else f"output head on the {head}",
            "buffers_mib": {k: round(v, 1) for k, v in buffers.items()}}


# ---------------------------------------------------------------- the worker


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, threads: int | None = None,
          cache: str | None = None) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to one client at a time; blocks until killed.

    llama.cpp prints the endpoint and the devices it serves. Ctrl+C (SIGINT) ends the process: the native
    accept loop never returns, so the default Python handler cannot run.
    """
    from backends.llamacpp._native import default_threads

    endpoint = join(host, port)
    split(endpoint)
    L = lib()
    gpus = [d for d, _ in _local_gpus()]
    devs = gpus or [L.ggml.ggml_backend_dev_by_type(_DEV_CPU)]
    arr = (ctypes.c_void_p * len(devs))(*devs)
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl+C kills the blocked native loop at once
    _port_free(host, port)
    sys.stdout.flush()
    L.rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache.encode() if cache else None,
                                        threads or default_threads(), len(devs), arr)
    raise RPCError(f"the RPC server on {endpoint} stopped (could the port be in use?)")


def _port_free(host: str, port: int) -> None:
    """The native server aborts when it cannot bind: say so first."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RPCError(f"cannot listen on {join(host, port)}: {e.strerror or e} (another worker on that "
                           "port? pick one with --port; a --host this machine does not own?)") from None
