"""The two recipes of docs/architecture.md, held by following them with a toy: a new decoding mode is one row
of app.config.MODE_FACTS plus its decoder; a new runtime is its backend package, its row of facts in
offload/runtimes.py and its loader in backends.registry. Nothing else may need an edit: the plan, the engine's
validation and context sizing, and the decoder table take the toy as they are."""

from __future__ import annotations

from dataclasses import replace

import pytest

import app.decoding
import backends.registry as registry
from app.config import MODE_FACTS, ConfigError, DecodeParams, Mode
from app.engine.engine import Engine, final_event
from app.engine.planning import plan_for
from backends.registry import ModelSpec
from offload.plan import MemoryBudget, GiB
from offload.runtimes import RUNTIMES

MESSAGES = [{"role": "user", "content": "List three colours."}]
TINY = ModelSpec(source="tiny", n_ctx=512)
ROOMY = MemoryBudget(vram=0, ram=64 * GiB)
# Beam search's facts under a new name: the same W rows, no draft.
TOY_MODE = Mode("toy", needs_draft=False, beams=True, keeps_rows=True, samples=False, verifier="none",
                draft_width="W")


@pytest.fixture
def toy_mode(monkeypatch):
    """The recipe for a mode: its row of MODE_FACTS and its decoder (here beam search, by another name)."""
    from app.decoding import baselines

    monkeypatch.setitem(MODE_FACTS, "toy", TOY_MODE)
    table = app.decoding._decoders
    monkeypatch.setattr(app.decoding, "_decoders", lambda: {**table(), "toy": baselines.beam_search})


def test_a_new_mode_is_one_row_of_mode_facts_and_its_decoder(toy_mode, tiny_gguf_path):
    plan = plan_for(TINY, None, DecodeParams(beams=3), mode="toy", budget=ROOMY)
    assert plan.mode == "toy" and plan.target.kv_rows == 3  # W rows, as its facts say
    with pytest.raises(ConfigError, match="min_beams"):  # validated like any mode
        DecodeParams(mode="toy", beams=2, min_beams=3).validated()
    engine = Engine.load(TINY, budget=ROOMY)
    try:
        params = DecodeParams(mode="toy", beams=2, max_new_tokens=12)
        assert engine.check_params(params).mode == "toy"
        toy = final_event(engine.chat(MESSAGES, params))
        beam = final_event(engine.chat(MESSAGES, replace(params, mode="beam")))
    finally:
        engine.close()
    assert toy.stats["mode"] == "toy" and toy.text == beam.text and toy.tokens == beam.tokens > 0


def test_a_new_draft_mode_is_refused_without_a_draft(toy_mode, monkeypatch, tiny_gguf_path):
    monkeypatch.setitem(MODE_FACTS, "toy", replace(TOY_MODE, needs_draft=True, uses_draft=True, verifier="dsbd",
                                                   draft_width="W+1"))
    plan = plan_for(TINY, TINY, DecodeParams(beams=2), mode="toy", budget=ROOMY)
    assert plan.mode == "toy" and plan.draft is not None and plan.draft.kv_rows == 2
    engine = Engine.load(TINY, budget=ROOMY)
    try:
        with pytest.raises(ConfigError, match="mode 'toy' needs a draft model"):
            engine.check_params(DecodeParams(mode="toy"))
    finally:
        engine.close()


def test_a_new_runtime_is_its_package_its_facts_and_its_loader(monkeypatch, tiny_gguf_path):
    """A toy runtime: llama.cpp's package under another name, with llama.cpp's facts."""
    monkeypatch.setitem(RUNTIMES, "toy", replace(RUNTIMES["llamacpp"], name="toy", label="Toy"))
    llamacpp = registry.RUNTIMES["llamacpp"]

    def load(path, spec):
        model = llamacpp(path, replace(spec, backend="llamacpp"))
        model.info = replace(model.info, backend="toy")
        return model

    monkeypatch.setitem(registry.RUNTIMES, "toy", load)
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, "toy"))
    spec = replace(TINY, backend="toy")
    plan = plan_for(spec, None, DecodeParams(beams=2), mode="beam", budget=ROOMY)
    assert plan.target.runtime == "toy" and plan.target.n_gpu_layers == 0
    assert any(n.startswith("Toy's unified cache") for n in plan.notes)
    engine = Engine.load(spec, budget=ROOMY)
    try:
        assert engine.describe()["target_backend"] == "toy"
        params = DecodeParams(mode="beam", beams=2, max_new_tokens=12)
        toy = final_event(engine.chat(MESSAGES, params))
    finally:
        engine.close()
    engine = Engine.load(TINY, budget=ROOMY)
    try:
        llama = final_event(engine.chat(MESSAGES, params))
    finally:
        engine.close()
    assert toy.text == llama.text and toy.tokens == llama.tokens > 0


def test_every_runtime_the_registry_loads_has_its_facts_and_its_package():
    from pathlib import Path

    assert set(registry.RUNTIMES) == set(registry.BACKENDS) == set(RUNTIMES)
    root = Path(__file__).resolve().parent.parent
    assert all((root / "backends" / name / "__init__.py").is_file() for name in RUNTIMES)
