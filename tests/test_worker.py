"""The supervised model process (app.engine.worker) on the real `tiny` preset: answers equal the in-process engine's,
errors keep their type, cancel works, and a killed model process (SIGKILL, SIGILL) ends one answer with a
clear error while the next request is answered by a fresh process with the same (or swapped-in) models.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from app.config import ConfigError, DecodeParams
from backends.registry import ModelSpec
from app.engine.engine import Engine, PromptTooLong
from app.engine.worker import WorkerEngine, death_cause
from backends.base import BackendError

# The repack off: what the probe picks on AMX CPUs anyway, and it skips the probe's 5 s metadata scan per load.
SPEC = ModelSpec(source="tiny", n_ctx=512, llama_extra_bufts="off")
HI = [{"role": "user", "content": "Say hello in five words."}]
LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
CRASH_MARKER = "DSBD_TEST_CRASH_MARKER"


@pytest.fixture(scope="module")
def inproc(tiny_gguf_path):
    e = Engine.load(SPEC, SPEC)
    yield e
    e.close()


@pytest.fixture(scope="module")
def worker(tiny_gguf_path):
    w = WorkerEngine.load(SPEC, SPEC)
    yield w
    w.close()


def _view(ev) -> tuple:
    return ev.text, ev.tokens, ev.live_beams, ev.done, ev.forest, ev.segments, ev.notice


def _crash_if_marked() -> None:
    """on_start hook (runs in the model process): die like a native crash while a marker file exists."""
    marker = os.environ.get(CRASH_MARKER)
    if marker and os.path.exists(marker):
        os.kill(os.getpid(), signal.SIGSEGV)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie has exited; only its parent's wait is missing


# -- the same answers, the same errors ------------------------------------------------------------
@pytest.mark.parametrize("params", [
    DecodeParams(mode="greedy", max_new_tokens=24),
    DecodeParams(mode="sample", max_new_tokens=24, seed=7),
    DecodeParams(mode="dsbd", max_new_tokens=24, beams=2, seed=3),
], ids=lambda p: p.mode)
def test_stream_equals_the_in_process_engine(worker, inproc, params):
    mine = list(worker.chat(HI, params))
    theirs = list(inproc.chat(HI, params))
    assert [_view(e) for e in mine] == [_view(e) for e in theirs]
    assert mine[-1].done and mine[-1].tokens > 0
    assert mine[-1].stats["mode"] == params.mode and mine[-1].stats["new_tokens"] == theirs[-1].stats["new_tokens"]
    ids = inproc.encode(HI)
    assert [_view(e) for e in worker.generate(ids, params)] == [_view(e) for e in theirs]


def test_prepare_reaches_the_model_process(worker):
    worker.prepare()  # the child's engine makes its contexts; the next answer runs on them
    assert list(worker.chat(HI, DecodeParams(mode="sample", max_new_tokens=4, seed=1)))[-1].done


def test_mirrored_state_and_tokenizer(worker, inproc):
    assert worker.describe() == inproc.describe()
    assert worker.specs == inproc.specs and worker.n_ctx == inproc.n_ctx
    wp, ip = worker.plan, inproc.plan  # their budgets read the free RAM at different moments
    assert (wp.mode, wp.context, wp.max_beams, wp.target, wp.draft) == (ip.mode, ip.context, ip.max_beams, ip.target,
                                                                        ip.draft)
    wt, it = worker.tokenizer, inproc.tokenizer
    for attr in ("n_vocab", "bos_id", "eos_id", "eos_ids", "add_bos", "vocab_type", "chat_template"):
        assert getattr(wt, attr) == getattr(it, attr), attr
    ids = it.encode("Hello, beams!", add_bos=it.add_bos)
    assert wt.encode("Hello, beams!", add_bos=wt.add_bos) == ids
    assert wt.decode(ids) == it.decode(ids) and wt.decode(ids[:1]) == it.decode(ids[:1])
    assert worker.encode(HI) == inproc.encode(HI)
    p = DecodeParams(mode="dsbd", beams=3)
    assert worker.check_params(p) == inproc.check_params(p)
    target_cost, draft_cost = worker.costs()  # adaptive forests' timed pass costs come back across the pipe
    assert type(target_cost).__name__ == type(draft_cost).__name__ == "CostCurve"
    out = worker.complete(inproc.encode(HI), DecodeParams(mode="sample", max_new_tokens=8, seed=1), n=2)
    ref = inproc.complete(inproc.encode(HI), DecodeParams(mode="sample", max_new_tokens=8, seed=1), n=2)
    assert [(c["text"], c["tokens"]) for c in out] == [(c["text"], c["tokens"]) for c in ref]


def test_errors_keep_their_type_message_and_fields(worker, inproc):
    bad = DecodeParams(mode="sample", temperature=-1.0)
    with pytest.raises(ConfigError) as want:
        inproc.chat(HI, bad)
    with pytest.raises(ConfigError) as got:
        worker.chat(HI, bad)  # raised when the stream is opened, as in-process
    assert type(got.value) is ConfigError and str(got.value) == str(want.value)
    with pytest.raises(ConfigError, match=str(want.value)[:20]):
        worker.check_params(bad)
    huge = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(PromptTooLong) as want:
        inproc.chat(huge, DecodeParams(mode="greedy"))
    with pytest.raises(PromptTooLong) as got:
        worker.chat(huge, DecodeParams(mode="greedy"))
    assert str(got.value) == str(want.value)
    assert (got.value.prompt, got.value.n_ctx, got.value.room) == (want.value.prompt, want.value.n_ctx, want.value.room)


def test_cancel_and_close_end_the_answer_and_free_the_engine(worker):
    cancel = threading.Event()
    events = []
    for ev in worker.chat(LONG, DecodeParams(mode="greedy", max_new_tokens=300), cancel=cancel):
        events.append(ev)
        if len(events) == 3:
            cancel.set()
    assert events[-1].done and events[-1].stats["finish_reason"] == "cancelled" and events[-1].tokens < 300
    # Cancelled before it starts: one empty, cancelled event (as the engine does for a queued request).
    cancel = threading.Event()
    cancel.set()
    events = list(worker.chat(HI, DecodeParams(mode="greedy"), cancel=cancel))
    assert len(events) == 1 and events[0].stats["finish_reason"] == "cancelled"
    # Closing a stream mid-answer (a client that went away) releases the engine for the next request.
    stream = worker.chat(LONG, DecodeParams(mode="greedy", max_new_tokens=300))
    next(stream)
    stream.close()
    t0 = time.perf_counter()
    assert list(worker.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done
    assert time.perf_counter() - t0 < 10
    # Opened but never iterated (the API opens n streams, then may stop early): closing it costs nothing.
    worker.chat(LONG, DecodeParams(mode="greedy", max_new_tokens=300)).close()
    assert list(worker.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done


# -- crashes ---------------------------------------------------------------------------------------
def test_death_cause_names_the_signal():
    assert death_cause(-signal.SIGILL) == "SIGILL: illegal instruction"
    assert death_cause(-signal.SIGKILL).startswith("SIGKILL: killed")
    assert death_cause(-signal.SIGABRT) == "SIGABRT: aborted"
    assert death_cause(3) == "exit code 3"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGILL], ids=lambda s: s.name)
def test_a_killed_model_process_ends_one_answer_and_the_next_one_works(worker, inproc, sig):
    pid, restarts = worker.pid, worker.restarts
    limits = Path(f"/proc/{pid}/limits").read_text()
    assert any(line.startswith("Max core file size") and line.split()[4] == "0" for line in limits.splitlines())
    got = []
    with pytest.raises(BackendError) as err:
        for ev in worker.chat(LONG, DecodeParams(mode="greedy", max_new_tokens=400)):
            got.append(ev)
            if len(got) == 2:
                os.kill(pid, sig)
    msg = str(err.value)
    assert msg.startswith(f"the model process died ({sig.name}: ") and "during this answer" in msg
    assert "send the message again" in msg and len(got) < 400
    params = DecodeParams(mode="greedy", max_new_tokens=12)
    again = list(worker.chat(HI, params))  # waits for the fresh process
    assert [_view(e) for e in again] == [_view(e) for e in inproc.chat(HI, params)]
    assert worker.pid != pid and worker.restarts == restarts + 1 and _gone(pid)


def test_swap_then_crash_restarts_with_the_swapped_models(tiny_gguf_path):
    with WorkerEngine.load(SPEC) as w:
        with pytest.raises(ConfigError, match="needs a draft"):
            w.chat(HI, DecodeParams(mode="sps"))
        seen = []
        info = w.swap(SPEC, SPEC, progress=seen.append)
        stages = [k for k, _ in itertools.groupby((s.stage, s.role) for s in seen)]
        assert "draft" in info and stages[-3:] == [("load", "draft"), ("check", None), ("switch", None)]
        pid = w.pid
        os.kill(pid, signal.SIGKILL)
        last = list(w.chat(HI, DecodeParams(mode="dsbd", beams=2, max_new_tokens=8, seed=1)))[-1]
        assert last.done and last.stats["mode"] == "dsbd" and last.tokens > 0
        assert w.pid != pid and w.specs == (SPEC, SPEC) and "draft" in w.describe()


def test_a_crash_loop_ends_with_a_clear_error_and_a_swap_recovers(tiny_gguf_path, tmp_path, monkeypatch):
    marker = tmp_path / "crash"
    monkeypatch.setenv(CRASH_MARKER, str(marker))  # inherited by every model process spawned from now on
    with WorkerEngine.load(SPEC, on_start=_crash_if_marked) as w:
        marker.touch()  # every reload now dies with SIGSEGV before loading
        os.kill(w.pid, signal.SIGKILL)
        for _ in range(2):  # each request gets the same clear error; no endless respawning behind it
            with pytest.raises(BackendError) as err:
                w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4))
            assert "failed 3 times in a row" in str(err.value) and "SIGSEGV" in str(err.value)
            assert "not restarting it again" in str(err.value)
        with pytest.raises(BackendError, match="3 times in a row"):
            w.describe()
        assert w.pid is None and w.restarts == 0
        marker.unlink()
        assert w.swap(SPEC)["target"]  # loading models from the Models tab starts a fresh process
        assert list(w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done


def test_a_crash_while_loading_at_startup_is_an_error_not_a_hang(tiny_gguf_path, tmp_path, monkeypatch):
    marker = tmp_path / "crash"
    marker.touch()
    monkeypatch.setenv(CRASH_MARKER, str(marker))
    with pytest.raises(BackendError, match=r"died \(SIGSEGV: segmentation fault\) while loading the models"):
        WorkerEngine.load(SPEC, on_start=_crash_if_marked)


def test_the_model_process_ends_with_the_server(tiny_gguf_path):
    w = WorkerEngine.load(SPEC)
    pid = w.pid
    w.close()
    assert _gone(pid)
    with pytest.raises(BackendError, match="closed"):
        w.chat(HI, DecodeParams(mode="greedy"))
    # The server process dies without closing anything: the model process notices its pipe close and exits.
    code = textwrap.dedent(f"""
        import os, signal
        from backends.registry import ModelSpec
        from app.engine.worker import WorkerEngine
        if __name__ == "__main__":
            w = WorkerEngine.load(ModelSpec(source="tiny", n_ctx=512, llama_extra_bufts="off"))
            print(w.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


def test_startup_load_errors_print_the_same_message(capsys, tmp_path, tiny_gguf_path):
    from app.cli import main

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    errs = []
    for flag in ([], ["--no-worker"]):
        assert main(["chat", "--no-browser", "--target", str(bad), "--llama-extra-bufts", "off", *flag]) == 2
        errs.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert errs[0] == errs[1] and errs[0].startswith("dsbd-chat: error:") and "broken.gguf" in errs[0]


# -- the chat tab over the worker --------------------------------------------------------------------
def test_chat_tab_shows_the_crash_and_the_next_message_answers(worker, tmp_path):
    pytest.importorskip("gradio")
    from app.serve.ui.chat import ChatUI, Session
    from app.storage import HistoryStore
    from app.serve.ui.settings import FIELDS, default_settings

    ui, s = ChatUI(worker, HistoryStore(tmp_path / "data")), Session()
    values = lambda n: [(default_settings() | {"mode": "greedy", "max_new_tokens": float(n)})[k] for k in FIELDS]  # noqa: E731
    ui.submit(s, "Write a long story about a lighthouse keeper.", "", *values(300))
    views = []
    for v in ui.generate(s):
        views.append(v)
        if len(views) == 2:
            os.kill(worker.pid, signal.SIGKILL)
    bubble = views[-1].chatbot[-1]["content"]
    assert bubble.startswith("⚠️ **Error:** the model process died (SIGKILL") and "send the message again" in bubble
    assert views[-1].status.startswith("Failed")
    ui.submit(s, "Say hello.", "", *values(8))
    views = list(ui.generate(s))
    assert views[-1].status.startswith("Done") and s.error is None
    assert s.chat["messages"][-1]["role"] == "assistant" and s.chat["messages"][-1]["content"].strip()


# -- the API over the worker ---------------------------------------------------------------------------
def test_api_answers_through_the_worker_and_reports_a_crash_in_band(worker, inproc):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from app.serve.api import build_api
    from app.engine.engine import final_event

    client = TestClient(build_api(worker))
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    tok = inproc.tokenizer
    ids = tok.encode("The capital of France is", add_bos=tok.add_bos)  # the API encodes through the worker
    assert r.json()["choices"][0]["text"] == final_event(inproc.generate(ids, DecodeParams(max_new_tokens=6))).text
    chunks = []
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": LONG, "max_tokens": 300, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
                if len(chunks) == 3:
                    os.kill(worker.pid, signal.SIGKILL)
    assert '"error"' in chunks[-1] and "the model process died (SIGKILL" in chunks[-1]
    r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# -- a hung model process, an engine that crashes on every answer -------------------------------------------
HANG_MARKER = "DSBD_TEST_HANG_MARKER"


def _break_decode_if_marked() -> None:
    """on_start hook: while a marker file exists, every llama_decode hangs ("hang") or segfaults ("crash")."""
    from backends.llamacpp.runtime import LlamaContext

    real = LlamaContext._decode

    def decode(self, *a, **k):
        marker = os.environ.get(HANG_MARKER)
        if marker and os.path.exists(marker):
            if Path(marker).read_text() == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(3600)
        return real(self, *a, **k)

    LlamaContext._decode = decode


def test_a_hung_model_process_is_replaced_and_the_next_answer_works(tiny_gguf_path, tmp_path, monkeypatch):
    marker = tmp_path / "hang"
    monkeypatch.setenv(HANG_MARKER, str(marker))
    # 15 s: a fresh process's first answer on this shared machine can take seconds; a hang takes an hour.
    with WorkerEngine.load(SPEC, on_start=_break_decode_if_marked, hung_after=15.0) as w:
        pid = w.pid
        marker.write_text("hang")
        t0 = time.monotonic()
        with pytest.raises(BackendError) as err:
            list(w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=8)))
        assert 15.0 <= time.monotonic() - t0 < 60
        msg = str(err.value)
        assert msg.startswith("the model process stopped answering (no progress for 15 s waiting for its first event")
        assert "replaced by a fresh one" in msg and "send the message again" in msg
        marker.unlink()
        w.hung_after = None  # the usual deadline again: a fresh process on a busy machine is slow, not hung
        assert list(w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done
        assert w.pid != pid and _gone(pid)


def test_the_per_event_deadline_follows_the_timed_pass_costs():
    from types import SimpleNamespace

    from app.engine import worker as wk
    from app.engine.auto import CostCurve

    fake = SimpleNamespace(hung_after=None, _costs=None, _state={"n_ctx": 512})
    assert WorkerEngine.deadline(fake, DecodeParams(), first=True) == wk.HUNG_UNTIMED_S
    slow, fast = CostCurve.of({1: 1.0, 64: 4.0}), CostCurve.of({1: 0.5, 64: 0.5})
    fake._costs = (slow, fast)
    p = DecodeParams(mode="dsbd", beams=2, gamma=3)  # W_S = 3: a forest of 3 x 3 + 2 target tokens, 3 draft passes
    step = slow(11) + 3 * fast(3)
    assert WorkerEngine.deadline(fake, p, first=False) == max(wk.HUNG_MIN_S, wk.HUNG_FACTOR * step)
    assert WorkerEngine.deadline(fake, p, first=True) == wk.HUNG_FACTOR * (step + slow(512) + fast(512))
    fake._costs = (CostCurve.of({1: 0.001}), None)  # fast passes: never below the floor
    assert WorkerEngine.deadline(fake, DecodeParams(), first=False) == wk.HUNG_MIN_S
    fake.hung_after = 2.5
    assert WorkerEngine.deadline(fake, p, first=True) == 2.5


def test_an_engine_that_crashes_on_every_answer_stops_being_restarted(tiny_gguf_path, tmp_path, monkeypatch):
    marker = tmp_path / "crash"
    monkeypatch.setenv(HANG_MARKER, str(marker))
    with WorkerEngine.load(SPEC, on_start=_break_decode_if_marked) as w:
        marker.write_text("crash")  # loads fine; every answer segfaults it
        for i in range(3):
            with pytest.raises(BackendError, match=r"died \(SIGSEGV"):
                list(w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))
        assert w.restarts == 2  # restarted after the first two crashes, not after the third
        for _ in range(2):  # then one clear error for every request, without starting another process
            with pytest.raises(BackendError) as err:
                w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4))
            msg = str(err.value)
            assert "died during each of the last 3 answers" in msg and "SIGSEGV" in msg
            assert "not restarting it again" in msg
        assert w.pid is None and w.restarts == 2
        marker.unlink()
        assert w.swap(SPEC)["target"]  # loading models again starts a fresh process
        assert list(w.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done
