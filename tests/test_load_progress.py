"""Loading models by stage, cancelling a load, unloading: on the real `tiny` file, in process and through the
supervised model process. A cancelled or failed load closes what it loaded and the old models keep answering;
llama.cpp stops inside its own load when its progress callback says so."""

from __future__ import annotations

import itertools
import threading

import pytest

import backends.load_progress
import backends.registry
from app.config import ConfigError, DecodeParams
from app.engine.engine import Engine
from app.engine.interface import NoModelLoaded
from backends.base import BackendError
from backends.load_progress import STAGES, LoadCancelled, LoadStep, LoadTracker
import helpers
from backends.registry import ModelSpec

HI = [{"role": "user", "content": "Name three colours."}]
GREEDY = DecodeParams(mode="greedy", max_new_tokens=6)
SPS = DecodeParams(mode="sps", max_new_tokens=6, top_k=1, seed=1)
CTX = 512


def answer(engine, params=GREEDY) -> str:
    return helpers.answer(engine, params, HI)


def stages(steps) -> list[tuple[str, str | None]]:
    """(stage, role) in the order heard, repeats folded."""
    return [k for k, _ in itertools.groupby((s.stage, s.role) for s in steps)]


class CancelWhen:
    """A progress listener that presses Cancel once `when(step)` holds; keeps every step heard."""

    def __init__(self, when) -> None:
        self.when, self.steps, self.cancel = when, [], threading.Event()

    def __call__(self, step: LoadStep) -> None:
        self.steps.append(step)
        if self.when(step):
            self.cancel.set()


@pytest.fixture
def every_report(monkeypatch):
    monkeypatch.setattr(backends.load_progress, "_EVERY_S", 0.0)  # no throttling: each tensor / block is heard


@pytest.fixture(scope="module")
def engine(tiny_gguf_path):
    e = Engine.load(ModelSpec("tiny", n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX))
    yield e
    e.close()


@pytest.fixture
def loads(monkeypatch):
    """Every model backends.registry.load_model returned, in order."""
    models, real = [], backends.registry.load_model

    def spy(spec, *, role="target", **kw):
        models.append(real(spec, role=role, **kw))
        return models[-1]
    monkeypatch.setattr(backends.registry, "load_model", spy)
    return models


def assert_closed(model) -> None:
    with pytest.raises(BackendError):
        model.context(rows=1, max_tokens=64)


# -- the tracker ---------------------------------------------------------------------------------------------
def test_tracker_throttles_reports_and_raises_once_cancelled():
    heard, cancel = [], threading.Event()
    t = LoadTracker(heard.append, cancel)
    t.role = "target"
    for i in range(1000):  # a fast stage: its first and last report, not a thousand
        t.report("load", i / 999)
    assert [s.fraction for s in heard][0] == 0.0 and heard[-1].fraction == 1.0 and len(heard) < 50
    t.role = "draft"
    t.report("load", 0.5, "d.gguf")  # a new role or stage is always heard
    assert str(heard[-1]) == "draft: loading the weights d.gguf (50%)"
    cancel.set()
    with pytest.raises(LoadCancelled, match="cancelled while draft: loading the weights; the models that were"):
        t.report("load", 0.6)
    assert t.native("load")(0.7) is False  # llama.cpp's callback: False asks it to stop, nothing raised
    assert backends.load_progress.current().native("load")(0.5) is True  # no load tracked here: never cancels
    assert set(STAGES) >= {"assemble", "hash", "load", "switch", "time"}


# -- in process ----------------------------------------------------------------------------------------------
def test_cancel_inside_llama_cpp_closes_the_loaded_target_and_keeps_serving(engine, tiny_gguf_path, loads,
                                                                            every_report):
    before = (engine.target, engine.draft, engine.specs, answer(engine, SPS))
    path = str(tiny_gguf_path)
    # Cancel while llama.cpp reads the draft: its callback's report of the file (not our 0 % at the start).
    press = CancelWhen(lambda s: s.role == "draft" and s.detail == tiny_gguf_path.name and 0 < s.fraction < 1)
    with pytest.raises(LoadCancelled, match="cancelled while draft: loading the weights"):
        engine.swap(ModelSpec(path, n_ctx=CTX), ModelSpec(path, n_ctx=CTX), progress=press, cancel=press.cancel)
    assert stages(press.steps) == [("load", "target"), ("load", "draft")]
    target_load = [s.fraction for s in press.steps if s.role == "target"]
    assert target_load[-1] == 1.0 and any(0 < f < 1 for f in target_load)  # llama.cpp's callback, reported
    assert press.steps[-1].fraction < 1  # llama.cpp stopped within the draft's load
    assert len(loads) == 1  # the target loaded, the draft never returned
    assert_closed(loads[0])
    assert (engine.target, engine.draft, engine.specs, answer(engine, SPS)) == before


def test_pytorch_loader_reports_tensors_and_stops_between_them(engine, loads, every_report):
    before = answer(engine)
    press = CancelWhen(lambda s: s.detail.startswith("tensor 3 of"))
    with pytest.raises(LoadCancelled, match="cancelled while target: loading the weights"):
        engine.swap(ModelSpec("tiny", backend="pytorch", n_ctx=CTX), None, progress=press, cancel=press.cancel)
    details = [s.detail.rsplit(" of ", 1)[0] for s in press.steps]
    assert details == ["tiny", "tensor 1", "tensor 2", "tensor 3"]  # stopped before reading tensor 3
    assert loads == [] and answer(engine) == before and engine.draft is not None


def test_cancel_while_the_switch_waits_for_a_running_answer(engine):
    before = engine.specs
    stream = engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=40))
    next(stream)  # the answer holds the engine now
    press = CancelWhen(lambda s: s.stage == "switch")
    err = []
    t = threading.Thread(target=lambda: err.append(_raises(lambda: engine.swap(
        ModelSpec("tiny", n_ctx=CTX), None, progress=press, cancel=press.cancel))))
    t.start()
    t.join(120)
    assert not t.is_alive() and isinstance(err[0], LoadCancelled) and "switching" in str(err[0])
    assert list(stream)[-1].done  # the answer went on to its end
    assert engine.specs == before and answer(engine, SPS)


def test_unload_the_draft_then_everything_then_load_again(tiny_gguf_path):
    engine = Engine.load(ModelSpec("tiny", n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX))
    try:
        target = engine.target
        info = engine.unload("draft")
        assert "draft" not in info and engine.target is target and engine.draft is None
        with pytest.raises(ConfigError, match="needs a draft model"):
            engine.chat(HI, SPS)
        assert engine.unload("all") is None and engine.specs == (None, None)
        assert_closed(target)
        for call in (lambda: answer(engine), engine.describe, lambda: engine.encode(HI)):
            with pytest.raises(NoModelLoaded, match="no model is loaded: load a target .* in the Models tab"):
                call()
        steps = []
        info = engine.swap(ModelSpec("tiny", n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX), progress=steps.append)
        assert info["draft"] and answer(engine, SPS).strip()
        assert stages(steps)[-4:] == [("load", "target"), ("load", "draft"), ("check", None), ("switch", None)]
        with pytest.raises(ConfigError, match="unload takes 'draft' or 'all'"):
            engine.unload("target")
    finally:
        engine.close()


def _raises(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


# -- through the supervised model process ---------------------------------------------------------------------
def test_worker_progress_cancel_unload_and_load_into_a_fresh_process(tiny_gguf_path):
    from app.engine.worker import WorkerEngine

    spec = ModelSpec("tiny", n_ctx=CTX, llama_extra_bufts="off")
    with WorkerEngine.load(spec) as w:
        pid, before = w.pid, answer(w)
        # Cancel in the model process: the parent hears its stages and gets LoadCancelled back, typed.
        press = CancelWhen(lambda s: s.role == "draft")
        with pytest.raises(LoadCancelled, match="cancelled while"):
            w.swap(spec, ModelSpec(str(tiny_gguf_path), n_ctx=CTX), progress=press, cancel=press.cancel)
        assert stages(press.steps)[0] == ("load", "draft")
        assert w.pid == pid and w.specs == (spec, None) and answer(w) == before

        # Unload: the process ends, requests say what to do.
        assert w.unload("all") is None and w.pid is None and w.tokenizer is None
        with pytest.raises(NoModelLoaded, match="Models tab"):
            w.chat(HI, GREEDY)
        with pytest.raises(NoModelLoaded):
            w.describe()

        # Loading into a fresh process: cancelled at its first report, the process ends and nothing loads ...
        press = CancelWhen(lambda s: True)
        with pytest.raises(LoadCancelled, match="the model process that was loading ended"):
            w.swap(spec, spec, progress=press, cancel=press.cancel)
        assert w.pid is None and press.steps
        with pytest.raises(NoModelLoaded):
            w.describe()
        # ... and uncancelled, the stages of the new process's load arrive as it goes.
        steps = []
        info = w.swap(spec, spec, progress=steps.append)
        assert info["draft"] and w.pid not in (None, pid) and answer(w, SPS).strip()
        assert stages(steps)[-3:] == [("load", "target"), ("load", "draft"), ("check", None)]
