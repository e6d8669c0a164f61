"""Thin layer over llama-cpp-python's ctypes API: process-wide init, log routing, safe model loading.

Everything here talks to `llama_cpp.llama_cpp` (the low-level bindings), never to the high-level `Llama`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
from pathlib import Path

import llama_cpp.llama_cpp as ll

from backends.load_progress import current as load_tracker
from backends.base import BackendError, BadModelFile, ThreadGovernor  # noqa: F401  (the runtime's)

log = logging.getLogger("backends.llamacpp.native")

_GGML_LOG_WARN, _GGML_LOG_ERROR, _GGML_LOG_CONT = 3, 4, 5  # enum ggml_log_level
_recent_errors: collections.deque[str] = collections.deque(maxlen=8)
_last_level = 0
_capture: list[str] | None = None  # set during a load: the lines that say where each tensor went
_PLACEMENT = ("assigned to device", "model buffer size", "buffer type overridden", "using device")


@ll.llama_log_callback
def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp prints to stderr by default; we keep it quiet (debug logging) but remember warnings and
    # errors so a failure can be explained in the exception message.
    global _last_level
    level = _last_level if level == _GGML_LOG_CONT else level
    _last_level = level
    msg = text.decode("utf-8", "replace")
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and msg.strip():
        _recent_errors.append(msg.strip())
    if _capture is not None and any(k in msg for k in _PLACEMENT):
        _capture.append(msg.strip())
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", msg.rstrip("\n"))


ll.llama_log_set(_on_log, ctypes.c_void_p(0))  # the module keeps `_on_log` alive for the process
ll.llama_backend_init()


def take_errors() -> str:
    """The llama.cpp warnings/errors logged since the last call, joined on one line."""
    out = " | ".join(_recent_errors)
    _recent_errors.clear()
    return out


def default_threads() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unable to tell
        n = None
    return max(1, n or os.cpu_count() or 1)


def check_gguf_header(path: Path) -> None:
    """Fail early, with the path in the message, for a missing file or one that is not GGUF."""
    if not path.is_file():
        raise BadModelFile(f"model file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise BadModelFile(
            f"{path} is not a GGUF file (starts with {head[:4]!r}, expected b'GGUF'); "
            "point to a .gguf model or convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    if len(head) < 8:
        raise BadModelFile(f"{path} is truncated ({path.stat().st_size} bytes); download it again")


class ModelHandle:
    """Owns one `llama_model *`; `ptr` raises once freed, so a stale user gets an error, not a segfault."""

    def __init__(self, path: Path, *, vocab_only: bool, n_gpu_layers: int = 0, extra_bufts: bool = True,
                 placement=None) -> None:
        """placement: an rpc.RPCDevices (devices list + head overrides), kept alive with the model."""
        global _capture
        check_gguf_header(path)
        params = ll.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = extra_bufts  # weight repack (AMX and others); off where it crashes (probe.py)
        if placement is not None:
            params.devices = placement.devices_ptr
            params.tensor_buft_overrides = placement.overrides_ptr
            if placement.split_ptr is not None:
                params.tensor_split = placement.split_ptr
        tracker = load_tracker()
        if not vocab_only:  # returning False from the callback makes llama.cpp stop and return NULL
            report = tracker.native("load", path.name)
            callback = ll.llama_progress_callback(lambda fraction, _user: report(fraction))
            params.progress_callback, params.progress_callback_user_data = callback, None
        self.placement, self.load_log = placement, []
        take_errors()
        _capture = self.load_log
        try:
            ptr = ll.llama_model_load_from_file(os.fsencode(path), params)
        finally:
            _capture = None
        if not ptr and tracker.cancelled:
            take_errors()
            tracker.check()  # raises LoadCancelled
        if not ptr:
            why = take_errors() or "no details logged"
            raise BackendError(
                f"llama.cpp could not load {path}: {why}. The file may be truncated or corrupt "
                f"({path.stat().st_size} bytes on disk): download it again or check its sha256."
            )
        self.path = path
        self._ptr = ptr
        self._vocab = ll.llama_model_get_vocab(ptr)

    @property
    def ptr(self):
        if self._ptr is None:
            raise BackendError(f"model {self.path.name} was closed")
        return self._ptr

    @property
    def vocab(self):
        self.ptr  # raises once closed: a NULL vocab would crash llama.cpp
        return self._vocab

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # value longer than the buffer (e.g. a chat template): ask again
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self._ptr is not None:
            ll.llama_model_free(self._ptr)
            self._ptr = None
            self._vocab = None
            self.placement = None  # its workers' connections close with the model

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may already be gone
            pass
