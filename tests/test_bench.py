"""Bench harness: the code grader, the code suite's self-check, auto mode in run_bench, pass rate, plots."""

from __future__ import annotations

import json
import time

import pytest

from app.compare import bench
from app.config import ConfigError, DecodeParams
from tests.fake_engine import FakeEngine

TASK = {"prompt": "Write add(a, b).", "entry_point": "add", "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}


def test_grader_passes_a_correct_solution_in_a_code_block():
    answer = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone. ```python\nbroken(\n```"
    assert bench.grade(answer, TASK)


def test_grader_fails_a_wrong_solution():
    assert not bench.grade("```python\ndef add(a, b):\n    return a - b\n```", TASK)


def test_grader_times_out_an_infinite_loop():
    assert not bench.grade("```python\ndef add(a, b):\n    while True:\n        pass\n```", TASK, timeout=1.0)


def test_grader_takes_the_whole_answer_without_a_code_block():
    assert bench.grade("def add(a, b):\n    return a + b\n", TASK)
    assert not bench.grade("The answer is a + b.", TASK)  # prose is a syntax error, not a crash of ours


def test_grader_takes_a_block_cut_off_by_max_tokens():
    assert bench.extract_code("x\n```python\ndef add(a, b):\n    return a + b\n") == "def add(a, b):\n    return a + b\n"


def test_code_suite_loads_and_every_reference_passes_its_tests():
    tasks = bench.load_suite("code")
    assert len(tasks) >= 20
    for t in tasks:
        assert f"`{t['entry_point']}(" in t["prompt"] and t["tests"]
        assert bench.grade(f"```python\n{t['reference']}```", t), t["entry_point"]
        assert t["entry_point"] in t["reference"]


def test_edit_suite_references_pass_and_the_pasted_code_fails():
    """The edit suite grades the edit, not the paste: each reference passes, the unedited code does not."""
    tasks = bench.load_suite("edit")
    assert len(tasks) >= 8
    for t in tasks:
        pasted = t["prompt"].split("```python\n")[1].split("```")[0]
        assert bench.grade(f"```python\n{t['reference']}```", t), t["entry_point"]
        assert not bench.grade(f"```python\n{pasted}```", t), t["entry_point"]


def test_parse_mode_accepts_auto_with_a_quality_level():
    base = DecodeParams(max_new_tokens=8)
    label, p = bench.parse_mode("auto:quality=beam", base)
    assert label == "auto:quality=beam" and (p.mode, p.quality) == ("auto", "beam")
    assert bench.parse_mode("auto:level=dynamic", base)[1].quality == "dynamic"  # the older spelling
    with pytest.raises(ConfigError, match="quality level 'best'"):
        bench.parse_mode("auto:quality=best", base)


def test_run_bench_resolves_auto_records_passes_and_summarizes(tmp_path):
    tasks = [TASK, {**TASK, "prompt": "Again add(a, b)."}]
    out = tmp_path / "b.json"
    res = bench.run_bench(FakeEngine(n_ctx=400), modes=["sample", "dsbd", "auto"], prompts=tasks,
                          base=DecodeParams(max_new_tokens=12, seed=0), out=out, progress=False)
    auto_runs = [r for r in res["runs"] if r["mode"] == "auto"]
    assert [r["setting"] for r in auto_runs] == ["sample", "sample"]
    assert all(r["passed"] is False for r in res["runs"])  # the fake answers words, not code
    s = res["summary"]
    assert s["sample"]["pass_rate"] == 0.0 and s["auto"]["settings"] == {"sample": 2}
    assert s["sample"]["peak_rss_bytes"] >= max(r["peak_rss_bytes"] for r in res["runs"] if r["mode"] == "sample") > 0
    assert s["dsbd"]["draft_token_share"] == 0.5 and "draft_token_share" not in s["sample"]  # fake: every other word
    assert json.loads(out.read_text())["summary"]["auto"]["runs"] == 2
    # A finished file resumes to the same runs without running anything again; the engine relearns from
    # them, auto's runs as the setting it picked.
    fresh = FakeEngine(n_ctx=400)
    again = bench.run_bench(fresh, modes=["sample", "dsbd", "auto"], prompts=tasks,
                            base=DecodeParams(max_new_tokens=12, seed=0), out=out, progress=False)
    assert again["runs"] == json.loads(json.dumps(res["runs"]))  # JSON turns int keys into strings
    assert fresh.calls == [] and [p.mode for p, _ in fresh.observed] == ["sample", "dsbd", "sample"] * 2


def test_pareto_keeps_only_non_dominated_points():
    pts = [(10, -1.0), (6, -0.5), (7, -0.9), (3, -0.6), (5, -0.4)]
    assert bench.pareto(pts) == [(10, -1.0), (7, -0.9), (6, -0.5), (5, -0.4)]


def test_plot_writes_speed_acceptance_and_width_pngs(tmp_path):
    def mode(tps, lp, acc=None, widths=None):
        return {"tokens_per_s_median": tps, "mean_target_logprob": lp, "acceptance_by_depth": acc or {},
                "widths_histogram": widths or {}}

    result = {"config": {"models": {"target": "synthetic"}}, "summary": {
        "sample": mode(10, -1.0), "beam-sample": mode(6, -0.5),
        "sps": mode(8, -1.1, {"1": 0.7, "2": 0.6, "3": 0.8}),
        "dsbd": mode(4, -0.9, {"1": 0.6, "2": 0.75}, {"1": 30, "2": 5, "4": 3})}}
    written = bench.plot(result, tmp_path / "out.png")
    assert [p.name for p in written] == ["out.png", "out-acceptance.png", "out-widths.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_peak_rss_sees_a_short_lived_allocation():
    with bench.PeakRSS() as rss:
        start = rss.peak
        block = bytearray(64 << 20)  # 64 MiB, touched, then freed before the block ends
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.1)
        del block
    assert rss.peak - start >= 48 << 20


def test_split_modes_keeps_several_settings_with_their_mode():
    """The --modes help's own example (dsbd:beams=2,gamma=4) used to split into a mode named 'gamma=4'."""
    assert bench.split_modes("sample, dsbd:beams=2,gamma=4,forest=adaptive,beam-sample,dsbd-mem:gamma=1") == [
        "sample", "dsbd:beams=2,gamma=4,forest=adaptive", "beam-sample", "dsbd-mem:gamma=1"]
    label, p = bench.parse_mode(bench.split_modes("dsbd:beams=2,gamma=4")[0], DecodeParams())
    assert (p.beams, p.gamma, p.draft_beams) == (2, 4, 3)
