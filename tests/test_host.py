"""This machine's process settings (backends/host.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

from backends.host import keep_freed_rows


def test_freed_rows_stay_in_the_heap_on_glibc_and_nothing_happens_elsewhere():
    """The CLI and the model process keep freed row-sized blocks in the heap (glibc's mallopt accepts both
    thresholds); on another C library the call is a no-op that reports False, never an error."""
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    code = "from backends.host import keep_freed_rows; print(keep_freed_rows())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(glibc)
    assert keep_freed_rows() is glibc  # and calling it again changes nothing
