"""Progress of a model load by stage, and its cancellation, heard from deep inside the loaders.

The engine opens `tracking(LoadTracker(listener, cancel))` around a load; the code that does the slow work
(preset assembly and hashing in backends.modelfiles.presets, llama.cpp's load progress callback, the PyTorch loader's
tensors) asks `current()` and reports `(stage, fraction)`. A report raises `LoadCancelled` once the cancel
Event is set, so a load stops at the next report; llama.cpp hears it through its callback's return value.
Without a tracker open, `current()` is a silent one that never cancels: the loaders run as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from backends.base import BackendError

# The stages of a load, in the order they run, and how the UI names them.
STAGES = {
    "assemble": "assembling the preset's chunks",
    "hash": "checking the file's sha256",
    "probe": "testing llama.cpp's weight repack on this CPU (once per CPU and weight types)",
    "load": "loading the weights",
    "check": "checking the vocabularies",
    "switch": "switching (waits for the running answer)",
    "time": "timing the passes (warm-up)",
}
_EVERY_S = 0.1  # at most this often per stage, besides a stage's first and last report


class LoadCancelled(BackendError):
    """The user cancelled the load; whatever it had loaded is closed again."""


@dataclass(frozen=True)
class LoadStep:
    """One report: `stage` (a key of STAGES) of `role` ("target", "draft"; None: both) at `fraction` (0..1)."""

    stage: str
    role: str | None
    fraction: float
    detail: str = ""  # what it works on, e.g. a file name

    def __str__(self) -> str:
        who = f"{self.role}: " if self.role else ""
        what = f" {self.detail}" if self.detail else ""
        return f"{who}{STAGES.get(self.stage, self.stage)}{what} ({self.fraction:.0%})"


class LoadTracker:
    """Hands each report to `listener(LoadStep)` (throttled) and answers whether the load is cancelled."""

    def __init__(self, listener: Callable[[LoadStep], None] | None = None,
                 cancel: threading.Event | None = None) -> None:
        self.listener, self.cancel = listener, cancel
        self.role: str | None = None  # the model being loaded; the engine sets it
        self._last: tuple[str | None, str, float] | None = None  # (role, stage, when) of the last report sent
        self._stage: tuple[str | None, str] | None = None  # (role, stage) now

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def check(self) -> None:
        """Raise LoadCancelled once the load is cancelled."""
        if self.cancelled:
            raise LoadCancelled(f"cancelled while {self._doing()}; the models that were serving still serve")

    def report(self, stage: str, fraction: float, detail: str = "") -> None:
        """tell(), then check(): a cancelled load stops here."""
        self.tell(stage, fraction, detail)
        self.check()

    def tell(self, stage: str, fraction: float, detail: str = "") -> None:
        """Tell the listener: a new stage, its end, and otherwise at most every _EVERY_S."""
        self._stage = (self.role, stage)
        if self.listener is None:
            return
        now = time.monotonic()
        last = self._last
        if last is None or last[:2] != (self.role, stage) or fraction >= 1.0 or now - last[2] >= _EVERY_S:
            self._last = (self.role, stage, now)
            self.listener(LoadStep(stage, self.role, min(max(float(fraction), 0.0), 1.0), detail))

    def native(self, stage: str, detail: str = "") -> Callable[[float], bool]:
        """A callback for native code: reports, returns False to ask for a stop, never raises."""
        def callback(fraction: float) -> bool:
            try:
                self.report(stage, fraction, detail)
            except LoadCancelled:
                return False
            except Exception:  # noqa: BLE001 - an exception must never unwind through native frames
                return not self.cancelled
            return True

        return callback

    def bar(self, bar, stage: str, detail: str = "") -> "TrackedBar":
        """Wrap a tqdm bar (bytes) so that each update also reports `stage`."""
        return TrackedBar(bar, self, stage, detail)

    def _doing(self) -> str:
        if self._stage is None:
            return "starting"
        role, stage = self._stage
        return f"{role + ': ' if role else ''}{STAGES.get(stage, stage)}"


class TrackedBar:
    """A tqdm bar whose updates report a stage's fraction to a tracker (and so may raise LoadCancelled)."""

    def __init__(self, bar, tracker: LoadTracker, stage: str, detail: str) -> None:
        self._bar, self._tracker, self._stage, self._detail = bar, tracker, stage, detail
        self._done, self._total = 0, bar.total or 0

    def __enter__(self) -> "TrackedBar":
        self._bar.__enter__()
        self._tracker.report(self._stage, 0.0, self._detail)
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def update(self, n: int) -> None:
        self._bar.update(n)
        self._done += n
        self._tracker.report(self._stage, self._done / self._total if self._total else 1.0, self._detail)


_SILENT = LoadTracker()
_current: contextvars.ContextVar[LoadTracker] = contextvars.ContextVar("dsbd_load_tracker", default=_SILENT)


def current() -> LoadTracker:
    """The tracker of the load running in this thread (a silent one outside `tracking`)."""
    return _current.get()


@contextlib.contextmanager
def tracking(tracker: LoadTracker) -> Iterator[LoadTracker]:
    """Make `tracker` current() for the loads inside the block (this thread / context only)."""
    token = _current.set(tracker)
    try:
        yield tracker
    finally:
        _current.reset(token)
