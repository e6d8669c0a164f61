"""This machine as the runtimes see it: CPU facts (from /proc/cpuinfo, with no runtime loaded), what
a loaded model's pass costs depend on, and the RPC front door (support check, workers' devices, serving as a
worker). The native sides load on use; the rest of the app reaches them only through here.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from backends.cpu import cpu_id, cpu_summary

# glibc's malloc hands a freed block above its mmap threshold back to the kernel and trims the heap's free top,
# so a decoder that allocates the same few-MB rows every step pays fresh page faults each time (a W_S 8 x gamma 3
# forest's temporaries: about a fifth of its decoder time on a 2-core EPYC, docs/measurements/rowmath.md).
# 64 rows of 151,936 float32 cells are 39 MB: below 32 MB such a layer's e paid its page faults at every call
# (12.7 ms against the kernel's 2.4 ms for 64 rows, rowmath.md).
MMAP_THRESHOLD = 128 << 20  # bytes: blocks this large still come from (and return to) the kernel
TRIM_THRESHOLD = 256 << 20  # free heap kept for the next step's rows before any is returned


def keep_freed_rows() -> bool:
    """Let freed blocks below MMAP_THRESHOLD stay in the heap (glibc's mallopt; elsewhere nothing): whether set."""
    try:
        mallopt = ctypes.CDLL(None).mallopt if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return mallopt is not None and bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and \
        bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))


def cpu_report() -> dict[str, str]:
    """What the CPU runtime uses here ("cpu": e.g. 'AVX2, AVX-512, AMX') and the llama.cpp weight-repack
    verdicts for this CPU ("llama_weight_repack"), for `dsbd-chat models` and the engine's description."""
    from backends.llamacpp.probe import probe_summary  # the llama.cpp package: loads llama_cpp

    return {"cpu": cpu_summary(), "llama_weight_repack": probe_summary()}


def machine_facts(cost_profile: str | None = None) -> dict:
    """The machine a measurement ran on, for its JSON: CPU model, the flags that decide llama.cpp's speed, cores,
    the GPU (None without CUDA) and, where the times are projected, the cost profile that priced them."""
    import os
    import sys

    model, _, flags = cpu_id().partition("|")
    gpu = None
    torch = sys.modules.get("torch")  # only where torch is already loaded: this must stay cheap
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {"cpu": model, "flags": sorted(set(flags.split()) & {"avx2", "avx512f", "avx512_bf16", "amx_tile", "asimd"}),
            "cores": os.cpu_count(), "gpu": gpu, "cost_profile": cost_profile}


def timing_identity(model) -> dict | None:
    """What a loaded model's pass costs depend on, for caching them: its file (path, size, mtime), runtime and
    build, CPU (model + flags), threads and weight placement. None when it has no file to key on."""
    info = model.info
    path = info.extra.get("path")
    try:
        st = Path(path).stat() if path else None
    except OSError:
        st = None
    if st is None:
        return None
    if info.backend == "llamacpp":
        from backends.llamacpp.probe import build_id  # loads llama_cpp

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


# ---------------------------------------------------------------- RPC workers (llama.cpp), native side on use


def require_rpc() -> None:
    """Raise backends.remote.NoRPCSupport, with the exact rebuild command, when the install lacks RPC."""
    from backends.llamacpp import rpc

    rpc.require_support()


def rpc_endpoints(text: str | None) -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...] as normalised endpoints (none for an empty text); an install without RPC support
    says how to rebuild it."""
    if not text:
        return ()
    from backends.remote import parse_endpoints

    endpoints = parse_endpoints(text)
    if endpoints:
        require_rpc()
    return endpoints


def rpc_devices(endpoints) -> list[dict]:
    """Each RPC worker's devices: {endpoint, device, description, free, total} (bytes), each worker checked first."""
    from backends.llamacpp import rpc

    return [{"endpoint": d.endpoint, "device": d.name, "description": d.description, "free": d.free,
             "total": d.total} for d in rpc.worker_memory(endpoints)]


def serve_rpc(host: str, port: int, *, threads: int | None = None, cache: str | None = None) -> None:
    """Serve this machine's devices to one client at a time as an RPC worker (blocks; Ctrl+C ends it)."""
    from backends.llamacpp import rpc

    rpc.serve(host, port, threads=threads, cache=cache)
