"""What adaptive forests learn persists across processes (app/engine/learned.py), and cost profiles price them
for another machine (app/engine/timing.py cost profiles, app/compare/projection.py)."""

from __future__ import annotations

import json
import logging

import pytest

from app.config import ConfigError, DecodeParams, load_presets
from app.decoding.forest_policy import Acceptance
from app.decoding.lookups import Calibration
from app.engine import learned
from app.engine.learned import Learned, acceptance_from_json, acceptance_to_json
from app.engine.planning import plan_for
from app.engine.timing import CAL_POINTS, CostCurve, cost_profile, profile_names
from offload.cost import datasheet, pass_cost
from offload.plan import GiB, MemoryBudget
from backends.registry import ModelSpec


def counts() -> Acceptance:
    a = Acceptance(layers=7, plain_s=3.5, explore_s=0.02)
    a.depth_draws[1] = [3.0, 5.0, 1.0, 4.0]
    a.layer_runs[(1, 4)] = [2.0, 5.0]
    a.cache_runs[(2, 4, 1)] = [1.0, 3.0]
    a.distinct[(1, 4)] = [14.0, 5.0]
    return a


def test_acceptance_survives_json_exactly():
    a = counts()
    assert acceptance_from_json(json.loads(json.dumps(acceptance_to_json(a)))) == a


def test_a_store_written_with_verifier_timings_still_loads(tmp_path):
    """An older version also stored the verifier's seconds per layer ("verify"); such an entry loads, the
    timings are dropped, and storing again no longer writes them."""
    old = acceptance_to_json(counts()) | {"verify": {"4": [0.1, 5.0]}}
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"key": {"when": 1.0, "acceptance": old}}))
    store = Learned(path)
    assert store.acceptance("key") == counts()
    store.store("key", acceptance=store.acceptance("key"))
    assert "verify" not in json.loads(path.read_text())["key"]["acceptance"]


def test_store_is_bounded_and_keeps_the_most_recent(tmp_path, monkeypatch):
    monkeypatch.setattr(learned, "MAX_ENTRIES", 3)
    store = Learned(tmp_path / "k.json")
    for i in range(5):
        store.store(f"key{i}", acceptance=counts(), calibration=Calibration({"match:4:0": [1.0, 2.0]}))
    data = json.loads((tmp_path / "k.json").read_text())
    assert sorted(data) == ["key2", "key3", "key4"]
    assert store.acceptance("key4") == counts().carried()
    assert store.calibration("key4").table == {"match:4:0": [1.0, 2.0]}
    assert store.acceptance("key0") is None and store.acceptance(None) is None


def test_a_corrupt_store_is_ignored_with_a_log_line_and_rewritten(tmp_path, caplog):
    path = tmp_path / "k.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="app.engine.timing"):
        assert Learned(path).acceptance("key") is None
    assert any("corrupt forest knowledge cache" in r.getMessage() for r in caplog.records)
    Learned(path).store("key", acceptance=counts())
    assert Learned(path).acceptance("key") is not None


def test_the_retime_switch_starts_afresh(tmp_path, monkeypatch):
    path = tmp_path / "k.json"
    Learned(path).store("key", acceptance=counts())
    monkeypatch.setenv("DSBD_CHAT_RETIME", "1")
    fresh = Learned(path)
    assert fresh.acceptance("key") is None
    fresh.store("key", acceptance=Acceptance(layers=1))
    monkeypatch.delenv("DSBD_CHAT_RETIME")
    assert Learned(path).acceptance("key").layers == 1  # what the fresh start learnt replaces the old


def test_a_new_engine_on_the_same_files_starts_from_what_the_last_one_learnt(tiny_gguf_path):
    from app.engine.engine import Engine

    params = DecodeParams(mode="dsbd", beams=2, draft_beams=3, gamma=3, max_new_tokens=16, seed=3,
                          forest="adaptive", lookup_nodes=2, lookup_sources=("draft", "match")).validated()
    msgs = [{"role": "user", "content": "Say hello."}]
    first = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        list(first.chat(msgs, params))
        (key,) = first._acceptance
        (cal,) = first._calibration
        taught, calibrated = first._acceptance[key], first._calibration[cal]
    finally:
        first.close()
    second = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        policy = second._forest_policy(params, second.costs())
        assert policy.setting == key and policy.known.plain_s == pytest.approx(taught.plain_s)
        assert policy.known.layers == taught.layers
        from app.decoding.beams import Stopper

        builder = second._node_builder(params, [1, 2, 3], Stopper(eos_ids=frozenset({2})), second.costs())
        assert builder.calibration.table == pytest.approx(calibrated.carried().table)
    finally:
        second.close()


# ---------------------------------------------------------------------------------------------- cost profiles

def test_cost_profiles_load_and_name_their_source():
    assert {"timed", "rtx4090-1.5b", "rtx4090-7b"} <= set(profile_names())
    p = cost_profile("rtx4090-7b")
    assert p.machine == "gpu" and "not measured by dsbd-chat" in p.source.lower()
    assert p.target(64) / p.target(1) < 2.5  # a GPU pass: 64 tokens cost about what a few do
    assert p.draft(1) < p.target(1)
    assert cost_profile("timed").target is None
    with pytest.raises(ValueError, match="rtx4090-1.5b"):
        cost_profile("my-laptop")


def test_presets_carry_caps_per_machine_class():
    cpu, gpu = load_presets("cpu"), load_presets("gpu")
    assert set(cpu) == set(gpu) == {"Fast", "Balanced", "Best quality"}
    for name in cpu:
        assert gpu[name]["settings"]["draft_beams"] >= cpu[name]["settings"]["draft_beams"]
        assert gpu[name]["settings"]["lookup_nodes"] >= cpu[name]["settings"]["lookup_nodes"]
        assert DecodeParams(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in gpu[name]["settings"].items()}).validated()
    assert gpu["Best quality"]["settings"]["draft_beams"] == 32 and gpu["Best quality"]["settings"]["gamma"] == 8


def test_bench_modes_name_presets_with_the_machines_caps():
    from app.compare.bench import parse_mode

    base = DecodeParams(max_new_tokens=8)
    label, p = parse_mode("preset:Best quality,gamma=2", base, "gpu")
    assert label == "preset:Best quality,gamma=2"
    assert (p.mode, p.replacement, p.draft_beams, p.gamma) == ("dsbd", "without", 32, 2)
    assert parse_mode("preset:Balanced", base, "cpu")[1].lookup_sources == ("draft", "match")
    assert parse_mode("dsbd:lookup_sources=match+recycled", base)[1].lookup_sources == ("match", "recycled")
    with pytest.raises(ConfigError, match="unknown preset"):
        parse_mode("preset:Turbo", base)


def test_projection_swaps_measured_passes_for_the_profiles_costs():
    from app.compare.projection import projected_seconds

    prof = cost_profile("rtx4090-1.5b")
    stats = {"decode_s": 10.0, "pass_s": 8.0, "draft_pass_s": 1.0, "passes_by_tokens": {"4": 10, "20": 5},
             "draft_passes_by_tokens": {"4": 3, "0": 2}}
    got = projected_seconds(stats, prof)
    passes = 10 * prof.target(4) + 5 * prof.target(20) + 3 * prof.draft(4)  # a pass of 0 new tokens is free
    assert got["pass_s"] == pytest.approx(passes) and got["decoder_s"] == pytest.approx(1.0)
    assert got["seconds"] == pytest.approx(passes + 1.0)
    assert projected_seconds(stats, cost_profile("timed")) is None


def test_an_engine_prices_forests_with_a_named_profile_without_timing(tiny_gguf_path, monkeypatch):
    from app.engine import engine as engine_module
    from app.engine.engine import Engine

    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        monkeypatch.setattr(engine_module, "cached_costs", lambda *a, **k: pytest.fail("a named profile times nothing"))
        assert e.use_cost_profile("rtx4090-1.5b")["machine"] == "gpu"
        target, draft = e.costs()
        assert isinstance(target, CostCurve) and target(1) == pytest.approx(cost_profile("rtx4090-1.5b").target(1))
        with pytest.raises(ConfigError, match="unknown cost profile"):
            e.use_cost_profile("nope")
        assert e.describe()["cost_profile"] == "rtx4090-1.5b"
        # A datasheet prices the same two models by the roofline of where a plan puts them in its VRAM.
        assert e.use_cost_profile("rtx4090-24gb")["machine"] == "gpu"
        target, draft = e.costs()
        placed = plan_for(*e.specs, budget=MemoryBudget.detect(vram=24 * GiB)).target
        assert target(4) == pytest.approx(pass_cost(placed, datasheet("rtx4090-24gb"), 4).seconds)
        assert draft is not None and draft(1) > 0
    finally:
        e.close()


def test_the_profile_script_measures_a_curve_the_app_reads(tmp_path):
    """scripts/gpu_profile.py on this CPU with a toy shape: a profile file --cost-profile takes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_profile

    out = tmp_path / "toy.json"
    assert gpu_profile.main(["--target", "test", "--draft", "test", "--device", "cpu", "--dtype", "float32",
                             "--context", "16", "--repeats", "1", "--out", str(out)]) == 0
    p = cost_profile(str(out))
    assert p.name == "toy" and p.machine == "cpu" and p.target(128) > 0 and p.draft(1) > 0
    out.write_text('{"machine": "tpu"}')
    with pytest.raises(ValueError, match="cannot read the cost profile"):
        cost_profile(str(out))


def test_answers_do_not_wait_for_the_pass_timing_of_a_fresh_load(tiny_gguf_path, monkeypatch):
    """While the load's warm-up times the passes (point by point, answers between the points), an adaptive
    answer runs at once without a forest, the plain step of its law from the same stream, and says so; auto
    takes its level's simplest setting. Once timed, forests are priced again."""
    import threading

    from app.engine import engine as engine_module
    from app.engine.engine import Engine

    started, release, points = threading.Event(), threading.Event(), []

    def slow_timing(model, ns, *, hold):
        for n in ns:
            with hold():
                points.append(n)
            started.set()
            release.wait(30)  # a long timing; the answer below runs meanwhile
        return {n: 0.01 * n for n in ns}

    monkeypatch.setattr(engine_module, "cached_costs", slow_timing)
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        warm = threading.Thread(target=e.costs, daemon=True)
        warm.start()
        assert started.wait(30)
        ids = e.tokenizer.encode("The river")
        best = DecodeParams(mode="dsbd", forest="adaptive", beams=2, min_beams=2, draft_beams=3, gamma=3,
                            max_new_tokens=8, seed=5, temperature=1.0)
        *_, last = e.generate(ids, best)
        assert "still being timed" in (last.notice or "") and last.stats["draft_passes"] == 0
        *_, plain = e.generate(ids, DecodeParams(mode="beam-sample-repl", beams=2, max_new_tokens=8, seed=5,
                                                 temperature=1.0))
        assert last.text == plain.text  # no forest: beam sampling's step, the same stream
        *_, auto = e.generate(ids, DecodeParams(mode="auto", quality="beam", beams=2, max_new_tokens=4, seed=1))
        assert auto.stats["auto"]["setting"] == "beam-sample" and "pricing" in auto.stats["auto"]
        release.set()
        warm.join(30)
        assert not warm.is_alive() and points == list(CAL_POINTS) * 2  # target then draft, point by point
        *_, priced = e.generate(ids, best)
        assert "still being timed" not in (priced.notice or "")
    finally:
        release.set()
        e.close()


def test_pass_costs_learnt_from_answers_price_the_next_answer_and_the_next_start(tiny_gguf_path, tmp_path,
                                                                                 monkeypatch):
    """A real answer's passes correct the timed curve the engine prices forests and auto with, and a new engine
    on the same file starts from that correction rather than from the bare timing."""
    from app.engine.engine import Engine
    from app.engine.timing import PassCosts

    monkeypatch.setenv("DSBD_CHAT_CACHE", str(tmp_path / "cache"))
    params = DecodeParams(mode="sample", max_new_tokens=12, seed=2, temperature=1.0)
    first = Engine.load(ModelSpec(source="tiny", n_ctx=512))
    try:
        timed_curve, _ = first.costs()
        learner = first.policy.passes[0]
        assert isinstance(learner, PassCosts) and not learner.ratios and timed_curve == CostCurve.of(learner.timed)
        *_, last = first.generate(first.tokenizer.encode("The river"), params)
        seen = last.stats["pass_s_by_tokens"]
        assert set(seen) == {1} and last.stats["passes_by_tokens"][1] == learner.ratios[1][1]
        learnt, _ = first.costs()
        assert learnt(1) != timed_curve(1) and learnt == learner.curve()
        ratio = learner.ratios[1][0] / learner.ratios[1][1]
        assert ratio == pytest.approx(seen[1] / timed_curve(1))
    finally:
        first.close()
    second = Engine.load(ModelSpec(source="tiny", n_ctx=512))
    try:
        again, _ = second.costs()
        assert second.policy.passes[0].ratios == pytest.approx(learner.ratios) and again(1) == pytest.approx(learnt(1))
    finally:
        second.close()
