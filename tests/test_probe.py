"""The llama.cpp weight-repack probe: overrides both ways, the cached verdict, and a real child process."""

from __future__ import annotations

import pytest

from backends.registry import ModelSpec
from backends.registry import SpecError
from backends.llamacpp import probe


def test_override_on_and_off_skip_the_probe(tmp_path, monkeypatch, tiny_gguf_path):
    monkeypatch.setattr(probe, "run_probe", lambda p: pytest.fail("probe must not run when overridden"))
    monkeypatch.delenv(probe.ENV, raising=False)
    assert probe.decide(tiny_gguf_path, "off", cache_file=tmp_path / "c.json") == \
        probe.Verdict(False, "set by --llama-extra-bufts=off")
    assert probe.decide(tiny_gguf_path, "on", cache_file=tmp_path / "c.json").extra_bufts is True
    monkeypatch.setenv(probe.ENV, "off")
    v = probe.decide(tiny_gguf_path, None, cache_file=tmp_path / "c.json")
    assert not v.extra_bufts and probe.ENV in v.reason


def test_bad_settings_are_named(monkeypatch):
    monkeypatch.setenv(probe.ENV, "maybe")
    with pytest.raises(ValueError, match=r"DSBD_CHAT_LLAMA_EXTRA_BUFTS must be one of auto, on, off"):
        probe.setting()
    with pytest.raises(SpecError, match="llama_extra_bufts must be auto, on or off"):
        ModelSpec(source="tiny", llama_extra_bufts="yes").validated()


@pytest.mark.parametrize("ok", [True, False])
def test_auto_probes_once_and_caches_the_verdict(tmp_path, monkeypatch, tiny_gguf_path, ok):
    monkeypatch.delenv(probe.ENV, raising=False)
    calls = []

    def fake(path):
        calls.append(path)
        return {"ok": ok, "why": "" if ok else "a test decode with the repack on died with SIGILL (illegal instruction)"}

    monkeypatch.setattr(probe, "run_probe", fake)
    cache = tmp_path / "probe.json"
    first = probe.decide(tiny_gguf_path, "auto", cache_file=cache)
    again = probe.decide(tiny_gguf_path, "auto", cache_file=cache)
    assert first == again and first.extra_bufts is ok and len(calls) == 1
    if not ok:
        assert "SIGILL" in first.reason and "known llama.cpp fault" in first.reason


def test_real_probe_child_reports_a_verdict_and_the_model_loads_with_it(tiny_gguf_path, tmp_path, monkeypatch):
    """The child really decodes; on an AMX CPU it dies (verdict off), elsewhere it passes. Either way the
    model then loads and decodes in this process with the verdict applied."""
    r = probe.run_probe(tiny_gguf_path)
    assert set(r) == {"ok", "why"} and (r["ok"] or "repack on" in r["why"])
    monkeypatch.delenv(probe.ENV, raising=False)
    monkeypatch.setenv("DSBD_CHAT_CACHE", str(tmp_path))
    from backends.llamacpp.runtime import LlamaModel

    with LlamaModel(tiny_gguf_path, n_threads=1) as m:
        assert m.repack.extra_bufts is r["ok"]
        assert m.info.extra["weight_repack"].startswith(f"llama.cpp weight repack {'on' if r['ok'] else 'off'}")
        with m.context(rows=1, max_tokens=32) as ctx:
            ctx.prefill([1, 2, 3])


def test_weight_types_are_read_once_per_file_version(tmp_path, monkeypatch, tiny_gguf_path):
    """A file's weight types are read from its header once, then cached by path, size and mtime."""
    import offload.gguf_header

    monkeypatch.setenv("DSBD_CHAT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(tiny_gguf_path.read_bytes())
    first = probe.weight_types(f)
    assert "Q4_1" in first

    def no_reader(*a, **k):
        raise AssertionError("the header was read again")

    monkeypatch.setattr(offload.gguf_header, "read_header", no_reader)
    assert probe.weight_types(f) == first  # cached
    with open(f, "ab") as out:  # a changed file (size, mtime) is read again
        out.write(b"\0" * 32)
    with pytest.raises(AssertionError, match="read again"):
        probe.weight_types(f)


def test_a_probe_is_a_load_stage_and_a_cancel_ends_its_child(tiny_gguf_path, tmp_path, monkeypatch):
    """The repack probe (a child loading and decoding the model) can take many seconds on a busy machine: the
    load reports it as its own stage, and Cancel ends the child; nothing is cached for a cancelled probe."""
    import os
    import sys
    import threading

    from backends.load_progress import LoadCancelled, LoadTracker, tracking

    monkeypatch.delenv(probe.ENV, raising=False)
    pid_file = tmp_path / "child.pid"
    slow = tmp_path / "slow-child"  # stands in for the Python child: says its pid, then takes its time
    slow.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    heard, cancel = [], threading.Event()
    tracker = LoadTracker(heard.append, cancel)
    tracker.role = "target"

    def press_cancel_once_the_child_runs():
        while not (pid_file.exists() and pid_file.read_text().strip()):
            threading.Event().wait(0.05)
        cancel.set()
    threading.Thread(target=press_cancel_once_the_child_runs, daemon=True).start()
    cache = tmp_path / "probe.json"
    with tracking(tracker), pytest.raises(LoadCancelled, match="testing llama.cpp's weight repack"):
        probe.decide(tiny_gguf_path, "auto", cache_file=cache)
    assert [(s.stage, s.role, s.detail) for s in heard] == [("probe", "target", tiny_gguf_path.name)]
    assert not cache.exists()
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(int(pid_file.read_text()), 0)
