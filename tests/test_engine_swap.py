"""Engine.swap on the real `tiny` preset: a failed swap closes what it loaded and the old models keep
answering exactly as before; a good swap serves the new models; loading never holds the engine lock."""

from __future__ import annotations

import threading

import pytest

import backends.registry
from app.config import DecodeParams
import helpers
from backends.registry import ModelSpec
from app.engine.engine import Engine
from backends.base import BackendError
from backends.tokenizer import VocabMismatch

MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = DecodeParams(mode="greedy", max_new_tokens=8)
SPS = DecodeParams(mode="sps", max_new_tokens=8, top_k=1, seed=1)  # runs the draft too
CTX = 512


def answer(engine, params=GREEDY) -> str:
    return helpers.answer(engine, params, MESSAGES)


@pytest.fixture
def engine(tiny_gguf_path):
    e = Engine.load(ModelSpec("tiny", n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX))
    yield e
    e.close()


class Loads:
    """Spy on backends.registry.load_model: `models` in load order; `hook(model, role)` runs after each."""

    def __init__(self, monkeypatch) -> None:
        self.models, self.hook, real = [], None, backends.registry.load_model

        def spy(spec, *, role="target", **kw):
            m = real(spec, role=role, **kw)
            self.models.append(m)
            if self.hook is not None:
                self.hook(m, role)
            return m
        monkeypatch.setattr(backends.registry, "load_model", spy)  # swap() imports it at call time


@pytest.fixture
def loads(monkeypatch) -> Loads:
    return Loads(monkeypatch)


def assert_closed(model) -> None:
    with pytest.raises(BackendError):
        model.context(rows=1, max_tokens=64)


def test_corrupt_file_keeps_the_old_models_serving(engine, tiny_gguf_path, tmp_path, loads):
    before, before_sps = answer(engine), answer(engine, SPS)
    old = (engine.target, engine.draft, engine.specs)
    bad = tmp_path / "truncated.gguf"
    with open(tiny_gguf_path, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    # The target (a new spec) loads, then the draft fails: the new target must be closed again.
    with pytest.raises(BackendError, match="truncated or corrupt"):
        engine.swap(ModelSpec(str(tiny_gguf_path), n_ctx=CTX), ModelSpec(str(bad), n_ctx=CTX))
    assert len(loads.models) == 1
    assert_closed(loads.models[0])
    assert (engine.target, engine.draft, engine.specs) == old
    assert answer(engine) == before and answer(engine, SPS) == before_sps


class Doctored:
    """The real tokenizer, but token 42 is spelled differently (so its file's header fingerprint no longer
    vouches for its texts)."""

    fingerprint = gguf_path = None

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def piece(self, token: int) -> bytes:
        return b"<doctored>" if token == 42 else self._tok.piece(token)


def test_vocabulary_mismatch_keeps_the_old_models_serving(engine, tiny_gguf_path, loads):
    before = answer(engine, SPS)
    old = (engine.target, engine.draft, engine.specs)

    def doctor(m, role):
        if role == "draft":
            m.tokenizer = Doctored(m.tokenizer)
    loads.hook = doctor
    with pytest.raises(VocabMismatch, match="token 42 differs"):
        engine.swap(ModelSpec(str(tiny_gguf_path), n_ctx=CTX), ModelSpec(str(tiny_gguf_path), n_ctx=CTX))
    assert len(loads.models) == 2
    for m in loads.models:
        assert_closed(m)
    assert (engine.target, engine.draft, engine.specs) == old
    assert answer(engine, SPS) == before


def test_swap_to_a_pytorch_target_serves_while_loading(engine, loads):
    old_target, old_draft = engine.target, engine.draft
    served = []

    def answer_meanwhile(m, role):
        assert not engine.lock.locked()  # loading happens outside the lock: the old models keep answering
        served.append(answer(engine))
    loads.hook = answer_meanwhile
    steps = []
    info = engine.swap(ModelSpec("tiny", backend="pytorch", n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX),
                       progress=steps.append)
    assert info["target_backend"] == "pytorch" and info["draft_backend"] == "llamacpp"
    assert engine.describe() == info and engine.specs[0].backend == "pytorch"
    assert len(loads.models) == 1 and served[0].strip()  # the unchanged draft spec was kept, not reloaded
    assert engine.draft is old_draft and engine.target is loads.models[0]
    assert engine.tokenizer is loads.models[0].tokenizer
    assert_closed(old_target)
    assert (steps[0].stage, steps[0].role) == ("load", "target") and steps[0].detail == "tiny"
    assert [s.role for s in steps if s.stage == "load"] == ["target"] * sum(s.stage == "load" for s in steps)
    assert (steps[-1].stage, steps[-1].fraction) == ("switch", 1.0)
    assert answer(engine).strip() and answer(engine, SPS).strip()


def test_swap_waits_for_the_running_answer(engine):
    stream = engine.chat(MESSAGES, GREEDY)
    first = next(stream)  # the generation now holds the lock
    done = threading.Event()
    t = threading.Thread(target=lambda: (engine.swap(*engine.specs), done.set()))
    t.start()
    assert not done.wait(0.3)
    rest = list(stream)
    t.join(10)
    assert done.is_set() and (rest or [first])[-1].done
    assert answer(engine).strip()


def test_loaded_objects_are_out_of_the_collectors_sight_and_a_swap_frees_what_died(engine, tiny_gguf_path):
    """A full garbage collection walks every object it tracks (one over the qwen-coder pair's took 141 ms inside
    an answer): after a load what lived is frozen, so a collection walks only what came after; a cycle that was
    frozen and then died is collected by the next swap, which freezes again."""
    import gc
    import weakref

    assert gc.get_freeze_count() > 0
    before = answer(engine)
    assert len(gc.get_objects()) < gc.get_freeze_count()  # the collector sees a fraction of what lives

    class Cycle:
        pass

    dead = Cycle()
    dead.me = dead
    gone = weakref.ref(dead)
    gc.freeze()  # as if it had lived at the load
    del dead
    gc.collect()
    assert gone() is not None  # frozen: a collection cannot reach it
    engine.swap(ModelSpec(str(tiny_gguf_path), n_ctx=CTX), ModelSpec("tiny", n_ctx=CTX))
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert answer(engine) == before
