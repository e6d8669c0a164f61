"""llama.cpp's threads when not pinned: the governor gives a core back while another program keeps it busy."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

pytest.importorskip("llama_cpp")
from backends.llamacpp._native import ThreadGovernor  # noqa: E402

SPIN = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end:\n    pass\n"


@pytest.mark.skipif((psutil.cpu_count() or 1) < 2, reason="needs two cores")
def test_a_busy_core_costs_one_thread_and_comes_back():
    cores = psutil.cpu_count()
    gov = ThreadGovernor(cores, interval=0.3)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])  # bounded: stops by itself after 20 s
    try:
        time.sleep(0.5)
        gov.threads()  # the interval that saw the spinner start
        time.sleep(1.0)
        assert gov.threads() <= cores - 1
    finally:
        spinner.kill()
        spinner.wait()
    time.sleep(1.0)
    gov.threads()
    time.sleep(1.0)
    assert gov.threads() >= 1 and gov.current <= cores


def test_pinned_threads_have_no_governor(tiny_gguf_path):
    from backends import llamacpp
    from backends.registry import ModelSpec

    pinned = llamacpp.load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), n_threads=1))
    auto = llamacpp.load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path)))
    try:
        assert pinned.governor is None and pinned.n_threads == 1
        assert auto.governor is not None and auto.governor.most == auto.n_threads
    finally:
        pinned.close()
        auto.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_governor_reads_the_system_busy_time_as_psutil_does():
    from backends.base import _ProcStat

    stat = _ProcStat.open()
    t = psutil.cpu_times()
    busy = stat.busy()
    want = sum(t) - t.idle - t.iowait - t.guest - t.guest_nice  # psutil's sum counts guest time twice
    assert busy == pytest.approx(want, abs=0.5)  # read a moment apart, in ticks of 10 ms
    gov = ThreadGovernor(2)
    assert gov._stat is not None and gov._sample()[1] >= busy


def test_a_line_that_is_not_linux_s_gives_no_reading(tmp_path):
    import os

    from backends.base import _ProcStat

    odd = tmp_path / "stat"
    odd.write_bytes(b"intr 1 2 3\n")
    assert _ProcStat(os.open(odd, os.O_RDONLY)).busy() is None
