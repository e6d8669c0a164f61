"""Pass-cost timing and its on-disk cache (app/engine/timing.py): a second load reads the cache, any change of
the key (model file, threads, timing method) times again, a corrupt cache file is ignored with a log line."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest

import app.engine.timing as timing
from app.engine.timing import CostCurve, cached_costs
from refmodel import bigram


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSBD_CHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / timing.CACHE_NAME


@pytest.fixture
def timed(monkeypatch):
    """Counts the real timing runs (measure_costs calls), passing them through."""
    calls = []
    real = timing.measure_costs

    def counting(model, ns, **kw):
        calls.append((model.info.name, tuple(ns)))
        return real(model, ns, **kw)

    monkeypatch.setattr(timing, "measure_costs", counting)
    return calls


class _Ctx:
    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, ids) -> None:
        pass

    def evaluate(self, forest) -> None:
        self.model.passes += 1

    def truncate(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def filed(tmp_path, name="m.gguf", seed=3, threads=2):
    """A table model that says it was loaded from a file (what the cache keys on); its timing contexts only
    count passes."""
    f = tmp_path / name
    if not f.exists():
        f.write_bytes(b"GGUF weights")
    m = bigram(5, seed)
    m.info = replace(m.info, name=name, extra={"path": str(f)})
    m.n_threads = threads
    m.passes = 0
    m.context = lambda **kw: _Ctx(m)
    return m


NS = (1, 2, 4)


def test_second_load_reads_the_cache(tmp_path, cache, timed):
    model = filed(tmp_path)
    first = cached_costs(model, NS)
    assert len(timed) == 1 and set(first) == set(NS) and all(s > 0 for s in first.values())
    assert model.passes == 3 * len(NS)  # a warm-up and two timed runs per point
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["file"] == str(tmp_path / "m.gguf") and entry["seconds"] == {str(n): first[n] for n in NS}
    fresh = filed(tmp_path)  # a new load of the same file
    again = cached_costs(fresh, NS)
    assert again == first and len(timed) == 1 and fresh.passes == 0


def test_a_changed_key_times_again(tmp_path, cache, timed):
    cached_costs(filed(tmp_path), NS)
    st = (tmp_path / "m.gguf").stat()
    os.utime(tmp_path / "m.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file was replaced
    cached_costs(filed(tmp_path), NS)
    assert len(timed) == 2
    cached_costs(filed(tmp_path, threads=4), NS)  # another thread count
    cached_costs(filed(tmp_path), (1, 8))  # another timing method
    cached_costs(filed(tmp_path, name="other.gguf"), NS)  # another file
    assert len(timed) == 5
    cached_costs(filed(tmp_path, threads=4), NS)  # each of them is cached now
    assert len(timed) == 5 and len(json.loads(cache.read_text())) == 5


def test_a_corrupt_cache_file_is_ignored_with_a_log_line(tmp_path, cache, timed, caplog):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="app.engine.timing"):
        costs = cached_costs(filed(tmp_path), NS)
    assert len(timed) == 1 and set(costs) == set(NS)
    assert any("corrupt pass-cost cache" in r.getMessage() and str(cache) in r.getMessage() for r in caplog.records)
    assert len(json.loads(cache.read_text())) == 1  # rewritten, valid
    # an entry of the wrong shape is re-timed too, not trusted
    data = json.loads(cache.read_text())
    key = next(iter(data))
    data[key]["seconds"] = {"1": "fast"}
    cache.write_text(json.dumps(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="app.engine.timing"):
        cached_costs(filed(tmp_path), NS)
    assert len(timed) == 2 and any("malformed pass-cost entry" in r.getMessage() for r in caplog.records)


def test_a_model_without_a_file_is_timed_each_time(tmp_path, cache, timed):
    m = filed(tmp_path)
    m.info = replace(m.info, extra={})
    cached_costs(m, NS)
    cached_costs(m, NS)
    assert len(timed) == 2 and not cache.exists()


def test_engine_load_reuses_the_cached_costs(tmp_path, cache, timed, monkeypatch):
    import backends.tokenizer
    from app.engine.engine import Engine

    monkeypatch.setattr(backends.tokenizer, "check_compatible", lambda draft, target: None)  # table tokenizers
    first = Engine(filed(tmp_path, "t.gguf", 3), filed(tmp_path, "d.gguf", 4), n_ctx=256)
    t1, d1 = first.costs()
    # The engine times point by point (answers may run between the points): one run per point and model.
    assert timed == [(m, (n,)) for m in ("t.gguf", "d.gguf") for n in timing.CAL_POINTS] and isinstance(t1, CostCurve)
    second = Engine(filed(tmp_path, "t.gguf", 3), filed(tmp_path, "d.gguf", 4), n_ctx=256)  # the next start
    t2, d2 = second.costs()
    assert len(timed) == 2 * len(timing.CAL_POINTS) and (t2, d2) == (t1, d1)


def test_one_cost_curve_for_the_plan_auto_and_the_policy():
    import offload.cost
    from app.engine import auto

    assert auto.CostCurve is CostCurve is offload.cost.CostCurve and timing.CAL_POINTS == offload.cost.CURVE_POINTS


def test_retime_keeps_the_lower_figure_per_point(tmp_path, cache, timed, monkeypatch):
    """A timing disturbed by other processes is too high: re-timing on request keeps the lower of old and new."""
    first = cached_costs(filed(tmp_path), NS)
    data = json.loads(cache.read_text())
    (key,) = data
    data[key]["seconds"] = {"1": 9.0, "2": 1e-9, "4": 9.0}  # 1 and 4 disturbed; 2 impossibly fast
    cache.write_text(json.dumps(data))
    assert cached_costs(filed(tmp_path), NS) == {1: 9.0, 2: 1e-9, 4: 9.0} and len(timed) == 1  # trusted
    monkeypatch.setenv(timing.RETIME, "1")
    again = cached_costs(filed(tmp_path), NS)
    assert len(timed) == 2 and again[2] == 1e-9 and again[1] < 9.0 and again[4] < 9.0
    assert {int(n): s for n, s in json.loads(cache.read_text())[key]["seconds"].items()} == again
    assert set(first) == set(again)


# ---------------------------------------------------------------------------------------- learnt from answers

def test_the_answers_passes_correct_the_timed_curve_point_by_point():
    """Nothing learnt: the timed curve. Passes at n count at the point nearest n; the points they did not
    reach move with the level they saw; the latest answers outweigh old ones; the curve never falls with n."""
    timed = {1: 0.1, 4: 0.2, 16: 0.4}
    costs = timing.PassCosts(timed)
    assert costs.curve() == CostCurve.of(timed) and not costs.observe({}, {})
    assert costs.observe({"6": 40}, {"6": 1.5 * CostCurve.of(timed)(6)})  # JSON keys; 6 is nearest 4 in log scale
    level = (40 * 1.5 + timing.LEARN_STRENGTH) / (40 + timing.LEARN_STRENGTH)
    own = (40 * 1.5 + timing.LEARN_STRENGTH * level) / (40 + timing.LEARN_STRENGTH)
    curve = costs.curve()
    assert set(costs.ratios) == {4}
    assert curve(4) == pytest.approx(0.2 * own) and curve(1) == pytest.approx(0.1 * level)
    assert curve(16) == pytest.approx(0.4 * level) and curve(1) <= curve(4) <= curve(16)
    for _ in range(20):  # the machine got quicker: the passes now cost what was timed
        costs.observe({4: 50, 16: 50}, {4: 0.2, 16: 0.4})
    assert costs.ratios[4][1] == timing.LEARN_CAP
    assert costs.curve()(4) == pytest.approx(0.2, rel=0.01) and costs.curve()(16) == pytest.approx(0.4, rel=0.01)
    assert not costs.observe({4: 3}, {4: 0.0}) and not costs.observe({4: 0}, {4: 0.3})  # no pass, no time: nothing


def test_a_counting_context_times_each_pass_by_the_tokens_it_fed():
    from backends.base import ROOT, Forest
    from backends.unique import CountingContext, UniquePaths
    from refmodel import bigram

    m = bigram(7, 1)
    for wrap in (CountingContext, UniquePaths):
        ctx = wrap(m.context(rows=1, max_tokens=32))
        ctx.prefill([1, 2])
        ctx.evaluate(Forest(suffix=((3,),), tokens=(4, 4), parents=(ROOT, ROOT), rows=(0, 0)))  # unique: 2 fed
        ctx.truncate(2)
        ctx.evaluate(Forest(suffix=((5,),)))
        c = ctx.counters()
        assert set(c["pass_s_by_tokens"]) == set(c["passes_by_tokens"]) - {0}
        assert all(s >= 0 for s in c["pass_s_by_tokens"].values())
        assert sum(len(t) for t in ctx.pass_times.values()) == c["evaluations"] == 2
        assert set(c["pass_s_by_tokens"]) == ({1, 2} if wrap is UniquePaths else {1, 3})
