"""Row math: the decoders' arithmetic over [rows, V] logits, behind one small interface (`protocols`).

- `reference.py`: the numpy reference, float64 (`sampling.py`'s functions): the oracle every test holds the others to;
- `compiled.py`: the CPU default: `tensors.py`'s algorithms with every pass over whole rows in one compiled kernel
  (`kernels.py`, numba): one read for a row's maximum, one fused exp pass for its normaliser and block sums;
- `tensors.py`: torch where the logits lie (CPU threads, or a CUDA device's rows read in place).

Which one runs: `DSBD_CHAT_ROWMATH` (auto, compiled, torch, torch-cuda, numpy); auto takes the first of compiled,
torch and the reference that loads here, with one log line for each that does not. Every backend draws the same
keys for the same seed (uniforms from the host generator in the reference's order, spec §16.10) except where a
uniform falls within rounding of a CDF boundary.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .protocols import Law, LogProbs, Outputs, RowMath
from .reference import NUMPY_CELL_SECONDS, LogProbRow, NumpyLaw, NumpyRows

log = logging.getLogger(__name__)

__all__ = ["Law", "LogProbs", "LogProbRow", "NUMPY_CELL_SECONDS", "NumpyLaw", "NumpyRows", "Outputs", "RowMath",
           "backend", "fall_back", "make", "out_of_memory", "prewarm", "use"]


_DEFAULT: list[object] = []
_MAKING = threading.Lock()


def make(name: str):
    """A backend by name: "compiled" (the CPU kernels), "numpy" (the reference), "torch" (CPU), "torch-float64"
    (CPU, float64 cells: the enumeration tests' exactness at 1e-12), "torch-cuda", or "auto" (compiled, else
    torch, else the reference, with one log line saying why)."""
    if name == "numpy":
        return NumpyRows()
    if name == "compiled":
        from .compiled import CompiledRows

        return CompiledRows()
    if name in ("torch", "torch-cpu"):
        return _tensors().TorchRows("cpu")
    if name == "torch-float64":
        return _tensors().TorchRows("cpu", dtype="float64")
    if name == "torch-cuda":
        return _tensors().TorchRows("cuda")
    if name == "auto":
        for fast in ("compiled", "torch"):
            try:
                return make(fast)
            except Exception as e:  # noqa: BLE001 - no compiler, no torch, a failed compile: the next one runs
                log.warning("row math: the %s backend cannot run here (%s); trying the next", fast, e)
        log.warning("row math: using the numpy reference")
        return NumpyRows()
    raise ValueError(f"unknown row-math backend {name!r}: use auto, compiled, torch, torch-cuda or numpy")


def _tensors():
    from . import tensors  # imports torch: only when a torch backend is asked for

    return tensors


def backend():
    """The process's row-math backend: DSBD_CHAT_ROWMATH (auto | compiled | torch | torch-cuda | numpy), default
    auto."""
    with _MAKING:
        if not _DEFAULT:
            name = os.environ.get("DSBD_CHAT_ROWMATH", "auto")
            try:
                _DEFAULT.append(make(name))
            except Exception as e:  # noqa: BLE001
                log.warning("row math: backend %r cannot run (%s); using the numpy reference", name, e)
                _DEFAULT.append(NumpyRows())
    return _DEFAULT[0]


def prewarm() -> None:
    """Make the process's backend in a background thread: importing torch takes a second or two, which a model
    load, waiting on native code meanwhile, hides from the first answer."""
    if not _DEFAULT:
        threading.Thread(target=backend, name="row-math", daemon=True).start()


def use(rm) -> None:
    """Make `rm` the process's backend (tests, scripts)."""
    _DEFAULT[:] = [rm]


def out_of_memory(e: BaseException) -> bool:
    """Whether e is torch's failure to allocate: a device's OutOfMemoryError, or its CPU allocator's RuntimeError."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(e, oom):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def fall_back(e: BaseException) -> str | None:
    """After the process's torch backend ran out of its device's memory: the numpy reference from now on, its rows
    in host memory, with one line in the log. Returns the backend given up, or None where nothing changed: a
    backend in host memory (the reference would need more of it) or the reference itself."""
    with _MAKING:
        rm = _DEFAULT[0] if _DEFAULT else None
        if not getattr(rm, "off_host", False):
            return None
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        log.warning("row math: %s ran out of memory (%s); using the numpy reference", rm.name, why)
        _DEFAULT[:] = [NumpyRows()]
        return rm.name
