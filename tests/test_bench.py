"""Bench harness: modes parsing, auto mode in run_bench, pass rate, summaries, peak memory."""

from __future__ import annotations

import json

import pytest

from app.compare import bench
from app.config import ConfigError, DecodeParams
from helpers import ADD_TASK
from fake_engine import FakeEngine


def test_edit_suite_references_pass_and_the_pasted_code_fails():
    """The edit suite grades the edit, not the paste: each reference passes, the unedited code does not."""
    tasks = bench.load_suite("edit")
    assert len(tasks) >= 8
    for t in tasks:
        pasted = t["prompt"].split("```python\n")[1].split("```")[0]
        assert bench.grade(f"```python\n{t['reference']}```", t), t["entry_point"]
        assert not bench.grade(f"```python\n{pasted}```", t), t["entry_point"]


def test_edit_files_suite_sends_the_files_and_grades_the_edit():
    """The suite with attached files: the prompt holds each file as the chat renders it; references pass,
    the unedited file does not."""
    tasks = bench.load_suite("edit-files")
    assert len(tasks) >= 5
    for t in tasks:
        (f,) = t["files"]
        text = bench.prompt_text(t)
        assert text.startswith(f"File {f['name']} (") and f["text"].rstrip("\n") in text
        assert text.endswith(t["prompt"])
        assert bench.grade(f"```python\n{t['reference']}```", t), t["entry_point"]
        assert not bench.grade(f"```python\n{f['text']}```", t), t["entry_point"]


def test_parse_mode_accepts_auto_with_a_quality_level():
    base = DecodeParams(max_new_tokens=8)
    label, p = bench.parse_mode("auto:quality=beam", base)
    assert label == "auto:quality=beam" and (p.mode, p.quality) == ("auto", "beam")
    assert bench.parse_mode("auto:level=dynamic", base)[1].quality == "dynamic"  # the older spelling
    with pytest.raises(ConfigError, match="quality level 'best'"):
        bench.parse_mode("auto:quality=best", base)


def test_run_bench_resolves_auto_records_passes_and_summarizes(tmp_path):
    tasks = [ADD_TASK, {**ADD_TASK, "prompt": "Again add(a, b)."}]
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
    machine = json.loads(out.read_text())["machine"]  # which machine the figures are from
    assert machine["cores"] >= 1 and isinstance(machine["flags"], list) and machine["cost_profile"] is None
    # A finished file resumes to the same runs without running anything again; the engine relearns from
    # them, auto's runs as the setting it picked.
    fresh = FakeEngine(n_ctx=400)
    again = bench.run_bench(fresh, modes=["sample", "dsbd", "auto"], prompts=tasks,
                            base=DecodeParams(max_new_tokens=12, seed=0), out=out, progress=False)
    assert again["runs"] == json.loads(json.dumps(res["runs"]))  # JSON turns int keys into strings
    assert fresh.calls == [] and [p.mode for p, _ in fresh.observed] == ["sample", "dsbd", "sample"] * 2


@pytest.mark.skipif(bench._high_water_mark() is None, reason="the kernel keeps no peak RSS here (Linux only)")
def test_peak_rss_sees_a_short_lived_allocation():
    with bench.PeakRSS() as rss:
        start = rss.peak
        block = bytearray(64 << 20)  # 64 MiB, touched, then freed at once: no sampler could be sure to see it
        block[::4096] = b"x" * len(block[::4096])
        del block
    assert rss.peak - start >= 48 << 20


def test_split_modes_keeps_several_settings_with_their_mode():
    """The --modes help's own example (dsbd:beams=2,gamma=4) is one mode with two settings, not a mode named
    'gamma=4'."""
    assert bench.split_modes("sample, dsbd:beams=2,gamma=4,forest=adaptive,beam-sample,dsbd-mem:gamma=1") == [
        "sample", "dsbd:beams=2,gamma=4,forest=adaptive", "beam-sample", "dsbd-mem:gamma=1"]
    label, p = bench.parse_mode(bench.split_modes("dsbd:beams=2,gamma=4")[0], DecodeParams())
    assert (p.beams, p.gamma, p.draft_beams) == (2, 4, 3)


def test_the_decoders_own_time_is_reported_as_a_share_and_per_iteration():
    """Everything outside the model passes is the decoder's: its share of decode time and its ms per iteration."""
    runs = [{"stats": {"new_tokens": 10, "decode_s": 2.0, "pass_s": 1.5, "draft_pass_s": 0.3, "iterations": 8}},
            {"stats": {"new_tokens": 6, "decode_s": 1.0, "pass_s": 0.9, "iterations": 2}}]
    out = bench._outcomes(runs)
    assert out["decoder_share"] == pytest.approx((0.2 + 0.1) / 3.0)
    assert out["decoder_ms_per_iteration"] == pytest.approx(1e3 * 0.3 / 10)
    assert out["tokens_per_s_overall"] == pytest.approx(16 / 3.0)


def test_a_warp_given_on_the_command_line_is_the_law_of_preset_modes_too():
    """`--temperature 0.7 --top-k 20` with `preset:Best quality` runs the preset at T 0.7, top-k 20 (the law the
    plain modes beside it run); without the flags the preset's own warp; a setting in the spec wins over both."""
    from app.cli import _given_warp, build_parser

    def settings(*argv):
        a = build_parser().parse_args(["bench", "--modes", "beam-sample,preset:Best quality", *argv])
        keep = _given_warp(a)
        base = DecodeParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, beams=4)
        return {m: bench.parse_mode(m, base, keep=keep)[1] for m in bench.split_modes(a.modes)}, keep

    given, keep = settings("--temperature", "0.7", "--top-k", "20")
    assert keep == ("temperature", "top_k")
    for p in given.values():
        assert (p.temperature, p.top_k, p.top_p) == (0.7, 20, 1.0)
    assert given["preset:Best quality"].mode == "dsbd" and given["preset:Best quality"].replacement == "without"
    own, keep = settings()
    assert keep == () and (own["preset:Best quality"].temperature, own["preset:Best quality"].top_k) == (1.0, 0)
    base = DecodeParams(temperature=0.7)
    spec = bench.parse_mode("preset:Best quality,temperature=1.2", base, keep=("temperature",))[1]
    assert spec.temperature == 1.2


def test_compare_keeps_a_given_warp_for_preset_modes_too(tmp_path):
    from app.cli import _given_warp, build_parser
    from app.compare import runner
    from app.compare.store import ResultStore

    a = build_parser().parse_args(["compare", "--modes", "beam-sample,preset:Best quality", "--top-p", "0.9"])
    keep = _given_warp(a)
    base = DecodeParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    _, params, _ = runner.prepare(ResultStore(tmp_path), resume=None, modes=a.modes, suite="chat", prompts=1,
                                  base=base, keep=keep)
    assert [p.top_p for p in params.values()] == [0.9, 0.9]
    assert a.temperature == 1.0 and a.top_k == 0  # not given: DecodeParams' defaults
