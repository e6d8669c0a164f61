"""Memory planning in the engine: a plan that cannot fit refuses before loading, full DSBD
switches to memory-reduced mode when its KV does not fit, and an out-of-memory error frees the caches and
retries once with a lighter setting, or fails with a message, never aborting the process."""

from __future__ import annotations

import pytest

from app.config import DecodeParams
from backends.registry import ModelSpec
from app.engine.engine import Engine
from backends.base import BackendError
from backends.base import OutOfMemory as OutOfMemoryError
from app.engine.planning import MemoryBudget, PlanError, plan_for

MESSAGES = [{"role": "user", "content": "Name a colour."}]
TINY = ModelSpec(source="tiny", n_ctx=1024)


def final(events):
    last = None
    for last in events:
        pass
    return last


def test_plan_that_cannot_fit_refuses_before_loading(tiny_gguf_path, monkeypatch):
    import backends.registry as registry

    monkeypatch.setattr(registry, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(PlanError, match=r"does not fit: dsbd-mem needs [\d.]+ MiB RAM but 64.0 MiB is usable"):
        Engine.load(TINY, TINY, budget=MemoryBudget(vram=0, ram=64 << 20, ram_reserve=0))


def test_full_dsbd_switches_to_memory_mode_when_its_kv_does_not_fit(tiny_gguf_path):
    params = DecodeParams(mode="dsbd")
    full = plan_for(TINY, TINY, params, mode="dsbd", budget=MemoryBudget(vram=0, ram=1 << 40, ram_reserve=0))
    mem = plan_for(TINY, TINY, params, mode="dsbd-mem", budget=MemoryBudget(vram=0, ram=1 << 40, ram_reserve=0))
    between = MemoryBudget(vram=0, ram=(full.ram_bytes + mem.ram_bytes) // 2, ram_reserve=0)
    engine = Engine.load(TINY, TINY, budget=between)
    try:
        assert engine.plan.mode == "dsbd-mem" and engine.plan.max_beams < 4
        ev = final(engine.chat(MESSAGES, DecodeParams(mode="dsbd", beams=4, max_new_tokens=6, seed=1)))
        assert ev.stats["mode"] == "dsbd-mem"
        assert "running dsbd-mem" in ev.notice and ev.stats["notice"] == ev.notice
        small = final(engine.chat(MESSAGES, DecodeParams(mode="dsbd", beams=1, max_new_tokens=6, seed=1)))
        assert small.stats["mode"] == "dsbd" and small.notice is None
    finally:
        engine.close()


class Starved:
    """A real model whose contexts fail to allocate above `max_rows` rows (an injected OOM)."""

    def __init__(self, model, max_rows: int) -> None:
        self._m, self.max_rows = model, max_rows
        self.info, self.tokenizer = model.info, model.tokenizer

    def context(self, *, rows: int, max_tokens: int):
        if rows > self.max_rows:
            raise OutOfMemoryError(f"CUDA out of memory: {rows} rows")
        return self._m.context(rows=rows, max_tokens=max_tokens)

    def close(self) -> None:
        self._m.close()


@pytest.fixture(scope="module")
def starved(tiny_gguf_path):
    from backends.registry import load_model

    t, d = load_model(TINY), load_model(TINY, role="draft")
    engine = Engine(Starved(t, 1), Starved(d, 1), n_ctx=1024)
    yield engine
    engine.close()


def test_oom_retries_once_with_memory_reduced_dsbd(starved):
    ev = final(starved.chat(MESSAGES, DecodeParams(mode="dsbd", beams=3, max_new_tokens=6, seed=2)))
    assert ev.done and ev.text
    assert ev.stats["mode"] == "dsbd-mem"
    assert "out of memory with dsbd and 3 beams: retried with dsbd-mem" in ev.notice


def test_oom_halves_beams_for_beam_search(starved):
    ev = final(starved.chat(MESSAGES, DecodeParams(mode="beam", beams=2, max_new_tokens=4)))
    assert ev.done and "retried with beam and 1 beams" in ev.notice


def test_oom_that_persists_is_a_clear_error_and_the_engine_survives(starved):
    # 4 beams -> 2 beams still exceeds the injected limit: one retry only, then a message
    with pytest.raises(BackendError, match=r"out of memory during beam with 2 beams \(already retried.*dsbd-chat plan"):
        final(starved.chat(MESSAGES, DecodeParams(mode="beam", beams=4, max_new_tokens=4)))
    assert final(starved.chat(MESSAGES, DecodeParams(mode="greedy", max_new_tokens=4))).text


# -- the row math out of memory ----------------------------------------------------------------------------------

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.32 GiB (GPU 0; 7.79 GiB total capacity)"
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 2490368000 bytes. Error code 12 (Cannot allocate memory)")


def failing_rows(*, device: bool, fail_at: int):
    """The torch row math, whose `fail_at`-th law fails to allocate: as a GPU's would (its rows apart from the
    host's memory, torch's OutOfMemoryError) with device, else as on the host (torch's CPU allocator)."""
    import torch


    from app.decoding.rowmath import tensors

    class Failing(tensors.TorchRows):
        off_host = device
        laws = 0

        def law(self, *a, **k):
            self.laws += 1
            if self.laws == fail_at:
                raise torch.OutOfMemoryError(CUDA_OOM) if device else RuntimeError(CPU_OOM)
            return super().law(*a, **k)

    rm = Failing("cpu")
    rm.name = "torch-cuda" if device else rm.name
    return rm


@pytest.fixture(scope="module")
def plain(tiny_gguf_path):
    engine = Engine.load(TINY)
    yield engine
    engine.close()


def test_row_math_out_of_device_memory_answers_on_the_reference_with_one_log_line(plain, monkeypatch, caplog):
    """The GPU's row math runs out of memory before the answer's first event: the answer is the reference's (the
    same seeded answer as the numpy row math gives), the user is told, the log has one line, and the process
    stays on the reference."""
    from app.decoding import rowmath

    params = DecodeParams(mode="beam-sample", beams=2, max_new_tokens=8, seed=4)
    monkeypatch.setattr(rowmath, "_DEFAULT", [rowmath.NumpyRows()])
    want = final(plain.chat(MESSAGES, params))
    rm = failing_rows(device=True, fail_at=1)
    monkeypatch.setattr(rowmath, "_DEFAULT", [rm])
    with caplog.at_level("WARNING", logger=rowmath.__name__):
        ev = final(plain.chat(MESSAGES, params))
    assert ev.done and ev.text == want.text and ev.stats["new_tokens"] == want.stats["new_tokens"]
    assert "the row math (torch-cuda) ran out of memory: this answer ran on the host (the numpy reference)" in ev.notice
    assert [r.getMessage() for r in caplog.records] == [
        f"row math: torch-cuda ran out of memory ({CUDA_OOM}); using the numpy reference"]
    assert rowmath.backend().name == "numpy" and rm.laws == 1
    again = final(plain.chat(MESSAGES, params))
    assert again.text == want.text and again.notice is None


def test_row_math_out_of_device_memory_mid_answer_is_a_clear_error_and_the_next_answer_runs(plain, monkeypatch):
    from app.decoding import rowmath

    monkeypatch.setattr(rowmath, "_DEFAULT", [failing_rows(device=True, fail_at=4)])
    params = DecodeParams(mode="beam-sample", beams=2, max_new_tokens=8, seed=4, stop=())
    seen = []
    with pytest.raises(BackendError, match=r"the row math \(torch-cuda\) ran out of memory during this answer; it "
                                           r"runs on the host now \(the numpy reference\): send the message again"):
        for ev in plain.chat(MESSAGES, params):
            seen.append(ev)
    assert seen and not seen[-1].done  # the answer had begun
    assert rowmath.backend().name == "numpy"
    assert final(plain.chat(MESSAGES, params)).done


def test_row_math_out_of_host_memory_takes_the_lighter_setting_and_keeps_its_backend(plain, monkeypatch):
    """On the host the reference would need more of the same memory: a torch allocation failure there is an
    out-of-memory error like any other (one retry, lighter), and the backend stays."""
    from app.decoding import rowmath

    rm = failing_rows(device=False, fail_at=1)
    monkeypatch.setattr(rowmath, "_DEFAULT", [rm])
    ev = final(plain.chat(MESSAGES, DecodeParams(mode="beam-sample", beams=2, max_new_tokens=6, seed=4)))
    assert ev.done and ev.text
    assert "out of memory with beam-sample and 2 beams: retried with beam-sample and 1 beams" in ev.notice
    assert rowmath.backend() is rm
