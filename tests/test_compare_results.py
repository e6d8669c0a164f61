"""Blind comparisons, saved results, tallies with intervals, exports, prompt sets, the report.

Fast: the fake engine and hand-made records. One test runs `dsbd-chat compare` on the real `tiny` model.
"""

from __future__ import annotations

import json
import random
import re
import threading

import pytest

gr = pytest.importorskip("gradio")

import app.compare as R  # noqa: E402
from app.config import MODES, DecodeParams  # noqa: E402
from app.compare.report import figure, mode_table_html, pair_table_html, write_report  # noqa: E402
from app.serve.ui.chat import Session  # noqa: E402
from app.serve.ui.compare import CompareUI  # noqa: E402
from app.serve.ui.settings import FIELDS, default_settings  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402

NOP = lambda *a, **k: None  # noqa: E731  (a gr.Progress stand-in)


def values(**over) -> list:
    s = default_settings() | {"mode": "greedy", "max_new_tokens": 12.0, "beams": 2.0} | over
    return [s[k] for k in FIELDS]


def rec(modes, choice=None, *, tps=None, lp=None, passed=None, models=None) -> dict:
    """A finished comparison with answers A, B, ... in `modes` order and an optional vote."""
    r = R.new_comparison(prompt="p", modes=list(modes), seed=1, settings={}, rng=random.Random(0),
                         models=models or {"target": "t", "draft": "d"})
    r["answers"] = [dict(a, mode=m, label=R.LABELS[i]) for i, (a, m) in enumerate(zip(r["answers"], modes))]
    for i, a in enumerate(r["answers"]):
        a["stats"] = {"tokens_per_s": (tps or {}).get(a["mode"], 10.0 + i),
                      "mean_target_logprob": (lp or {}).get(a["mode"], -1.0)}
        a["passed"] = (passed or {}).get(a["mode"])
    if choice is not None:
        R.apply_vote(r, choice)
    return r


# -- intervals and tallies on known counts ---------------------------------------------------------------
@pytest.mark.parametrize("k,n,lo,hi", [(8, 10, 0.4902, 0.9433), (5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775),
                                       (10, 10, 0.7225, 1.0), (1, 1, 0.2065, 1.0), (45, 100, 0.3561, 0.5476)])
def test_wilson_interval_known_values(k, n, lo, hi):
    got = R.wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)
    assert R.wilson(0, 0) == (0.0, 1.0)


def test_wilson_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(3, 7), (17, 40), (0, 3), (99, 100)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert R.wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_pair_tallies_and_mode_summary_on_known_counts():
    records = ([rec(["dsbd", "greedy"], "A") for _ in range(6)]  # dsbd wins 6
               + [rec(["greedy", "dsbd"], "A") for _ in range(2)]  # greedy wins 2
               + [rec(["dsbd", "greedy"], "tie"), rec(["greedy", "dsbd"], "both-bad")]  # 2 ties, 1 both bad
               + [rec(["dsbd", "greedy"])]  # not voted: not counted
               + [rec(["sample", "dsbd", "greedy"], "A")])  # sample beats both; dsbd vs greedy unknown
    t = R.pair_tallies(records)
    assert t[("dsbd", "greedy")] | {} == t[("dsbd", "greedy")]
    dg = t[("dsbd", "greedy")]
    assert (dg["wins"], dg["ties"], dg["losses"], dg["both_bad"], dg["votes"]) == (6, 2, 2, 1, 10)
    assert dg["win_rate"] == pytest.approx(0.75) and dg["win_ci"] == R.wilson(6, 8)
    assert (t[("dsbd", "sample")]["wins"], t[("dsbd", "sample")]["losses"]) == (0, 1)
    assert (t[("greedy", "sample")]["wins"], t[("greedy", "sample")]["losses"]) == (0, 1)
    ms = R.mode_summary(records)
    assert (ms["dsbd"]["won"], ms["dsbd"]["votes"]) == (6, 11)  # ties, losses and sample's win are not wins
    assert ms["dsbd"]["win_ci"] == R.wilson(6, 11)
    assert (ms["sample"]["won"], ms["sample"]["votes"]) == (1, 1)
    assert ms["dsbd"]["answers"] == 12 and ms["dsbd"]["errors"] == 0


def test_mode_summary_medians_logprob_ci_and_pass_rate():
    records = [rec(["a", "b"], tps={"a": x, "b": 2 * x}, lp={"a": lpv, "b": -2.0},
                   passed={"a": ok, "b": True})
               for x, lpv, ok in [(1.0, -1.0, True), (2.0, -2.0, False), (3.0, -3.0, True), (10.0, -2.0, True)]]
    records[0]["answers"][1]["error"] = "boom"  # b's first answer failed: not in its speed or log-prob
    ms = R.mode_summary(records)
    a, b = ms["a"], ms["b"]
    assert a["tokens_per_s_median"] == 2.5 and (a["tokens_per_s_q1"], a["tokens_per_s_q3"]) == (1.75, 4.75)
    assert a["mean_target_logprob"] == pytest.approx(-2.0)
    assert a["mean_target_logprob_ci"] == pytest.approx(1.959964 * (2 / 3) ** 0.5 / 2, rel=1e-5)  # stdev sqrt(2/3)
    assert (a["passed"], a["graded"], a["pass_rate"]) == (3, 4, 0.75) and a["pass_ci"] == R.wilson(3, 4)
    assert b["errors"] == 1 and b["tokens_per_s_median"] == 6.0 and b["win_rate"] is None


def test_vote_rejects_unknown_choice():
    r = rec(["a", "b"])
    with pytest.raises(R.ResultsError):
        R.apply_vote(r, "C")
    assert R.apply_vote(r, "both bad")["vote"]["choice"] == "both-bad"  # the UI's wording is accepted


# -- the store: restart, exports ------------------------------------------------------------------------
def test_votes_survive_a_restart_and_corrupt_files_are_moved_aside(tmp_path):
    store = R.ResultStore(tmp_path)
    records = [rec(["dsbd", "greedy"]) for _ in range(3)]
    for r in records:
        store.save(r)
    store.vote(records[0]["id"], "A")
    store.vote(records[1]["id"], "tie")
    (store.dir / "torn-1.json").write_text('{"id": "torn-1", "answ')
    again = R.ResultStore(tmp_path)  # the app starting again
    loaded = {r["id"]: r for r in again.list()}
    assert set(loaded) == {r["id"] for r in records}
    assert loaded[records[0]["id"]]["vote"]["winner"] == "dsbd"
    assert loaded[records[1]["id"]]["vote"]["choice"] == "tie"
    assert [r["id"] for r in again.pending()] == [records[2]["id"]]
    assert len(again.notices) == 1 and "torn-1.json" in again.notices[0]
    assert (tmp_path / "corrupt").is_dir()
    assert (tmp_path / "compare").is_dir() and (tmp_path / "exports").is_dir()  # beside chats/ of the history


def test_ids_cannot_escape_the_folder(tmp_path):
    store = R.ResultStore(tmp_path)
    for bad in ("../x", "a/b", ""):
        with pytest.raises(ValueError):
            store.load(bad)


def test_csv_and_json_round_trip(tmp_path):
    records = [rec(["dsbd", "greedy"], "A"), rec(["sps", "sample", "beam"], "both-bad", passed={"sps": True}),
               rec(["greedy", "beam"])]
    records[0]["answers"][0]["text"] = 'line one\nline "two", with, commas\r\nand ünïcode ✓'
    records[0]["answers"][1]["error"] = "mode 'greedy' broke"
    records[1]["task"] = {"prompt": "p", "tests": ["assert True"]}
    records[2]["answers"][0]["stats"]["acceptance_by_depth"] = {"1": {"accepted": 3, "tested": 4, "rate": 0.75}}
    store = R.ResultStore(tmp_path / "a")
    for r in records:
        store.save(r)
    records = store.list()
    for fmt in ("json", "csv"):
        path = store.export(records, fmt)
        back = R.read_export(path)
        assert back == records, fmt
        fresh = R.ResultStore(tmp_path / f"b-{fmt}")
        assert fresh.import_records(back) == 3
        assert fresh.list() == records
        assert R.pair_tallies(fresh.list()) == R.pair_tallies(records)
    header = (tmp_path / "a" / "exports" / "comparisons.csv").read_text().splitlines()[0]
    assert header.startswith("id,created,updated,kind") and "tokens_per_s" in header


# -- prompt sets: parse, stop and resume --------------------------------------------------------------
def test_parse_prompts_txt_and_jsonl():
    assert R.parse_prompts("one\n\n two \n", name="x.txt") == ["one", "two"]
    items = R.parse_prompts('"a"\n{"prompt": "b"}\n{"prompt": "c", "tests": ["assert 1"]}\n', name="p.jsonl")
    assert items == ["a", "b", {"prompt": "c", "tests": ["assert 1"]}]
    with pytest.raises(ValueError, match="line 1"):
        R.parse_prompts("{nope", name="p.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        R.parse_prompts("\n \n")
    assert len(R.load_prompt_source("code")) >= 8 and isinstance(R.load_prompt_source("chat")[0], str)


def _params(*modes) -> dict:
    return {m: DecodeParams(mode=m, max_new_tokens=6, beams=2) for m in modes}


def test_background_run_stops_and_resumes_without_repeating(tmp_path):
    engine, store = FakeEngine(), R.ResultStore(tmp_path)
    params = _params("greedy", "beam")
    run = R.new_run(source="pasted", items=[f"prompt {i}" for i in range(5)], params=params, settings={},
                    models=engine.describe(), seed=100)
    runner = R.SetRunner(engine, store)

    def stop_after_two(r, rec):
        if len(r["done"]) == 2:
            runner.stop()

    runner.start(run, params, on_item=stop_after_two)
    runner.join(60)
    assert not runner.running and runner.progress() == (2, 5, "stopped")
    saved = store.load_run(run["id"])
    assert saved["state"] == "stopped" and saved["done"] == [0, 1] and len(store.list()) == 2
    calls_before = len(engine.calls)

    again = R.SetRunner(engine, R.ResultStore(tmp_path))  # as after a restart: the run read back from disk
    again.start(store.load_run(run["id"]), R.params_of_run(saved))
    again.join(60)
    assert again.progress() == (5, 5, "done")
    assert len(engine.calls) - calls_before == 3 * 2  # only the three missing prompts, two modes each
    recs = store.list()
    assert sorted(r["item"] for r in recs) == [0, 1, 2, 3, 4]
    assert {r["prompt"] for r in recs} == {f"prompt {i}" for i in range(5)}
    assert all(r["seed"] == 100 + r["item"] for r in recs)  # the same seed for both modes of a prompt
    assert all({p.seed for _, p in engine.calls[2 * i: 2 * i + 2]} == {engine.calls[2 * i][1].seed}
               for i in range(5))
    assert len(store.pending()) == 5  # chat prompts wait for blind votes


def test_run_stopped_mid_answer_drops_that_item(tmp_path):
    engine, store = FakeEngine(answer_words=20), R.ResultStore(tmp_path)
    params = _params("greedy", "sample")
    run = R.new_run(source="x", items=["a", "b"], params=params, settings={}, models={}, seed=0)
    cancel = threading.Event()
    real = engine._run

    def cancel_midway(*a, **k):  # the user presses Stop while the second answer of item 0 streams
        for i, ev in enumerate(real(*a, **k)):
            if len(engine.calls) == 2 and i == 3:
                cancel.set()
            yield ev

    engine._run = cancel_midway
    R.run_items(engine, store, run, params, cancel=cancel)
    assert run["state"] == "stopped" and run["done"] == [] and store.list() == []


def test_code_suite_is_graded_by_hidden_tests(tmp_path):
    engine, store = FakeEngine(), R.ResultStore(tmp_path)
    task = R.load_prompt_source("code")[0]
    params = _params("greedy", "beam")
    run = R.new_run(source="code", items=[task], params=params, settings={}, models={}, seed=0)
    orig = engine._run

    def answers_with_reference(messages, params, *a, **k):  # greedy "writes" the reference solution
        for ev in orig(messages, params, *a, **k):
            if ev.done and params.mode == "greedy":
                ev = type(ev)(**(vars(ev) | {"text": f"```python\n{task['reference']}```"}))
            yield ev

    engine._run = answers_with_reference
    R.run_items(engine, store, run, params, cancel=threading.Event())
    (r,) = store.list()
    assert {a["mode"]: a["passed"] for a in r["answers"]} == {"greedy": True, "beam": False}
    assert not R.needs_vote(r)  # graded: no blind vote asked
    ms = R.mode_summary([r])
    assert ms["greedy"]["pass_rate"] == 1.0 and ms["beam"]["pass_rate"] == 0.0


def test_an_answer_rewriting_a_prompt_sets_file_shows_the_chats_diff(tmp_path):
    from html import unescape

    from app import attachments as att
    from app.serve.ui.compare import SOURCES, blind_cards_html

    engine, store = FakeEngine(), R.ResultStore(tmp_path)
    ui = CompareUI(engine, store)
    assert "files suite" in SOURCES and ui._items("files suite", "", None)[0] == "edit-files"
    task = R.load_prompt_source("edit-files")[0]
    answer = f"Here it is:\n```python\n{task['reference']}```"
    orig = engine._run

    def greedy_rewrites_the_file(messages, params, *a, **k):
        assert task["files"][0]["text"] in messages[-1]["content"]  # the file went into the prompt
        for ev in orig(messages, params, *a, **k):
            if ev.done and params.mode == "greedy":
                ev = type(ev)(**(vars(ev) | {"text": answer}))
            yield ev

    engine._run = greedy_rewrites_the_file
    params = _params("greedy", "beam")
    R.run_items(engine, store, R.new_run(source="edit-files", items=[task], params=params, settings={}, models={},
                                         seed=0), params, cancel=threading.Event())
    (r,) = store.list()
    choices = ui.saved_choices()["choices"]
    assert choices == [(choices[0][0], r["id"])] and task["prompt"][:40] in choices[0][0]  # the question, not the file
    html = ui.show(r["id"])
    want = att.diffs(answer, att.task_files(task))  # what the chat shows for this answer and file
    assert len(want) == 1 and want[0].added > 0
    assert html.count('class="dsbd-card-diff"') == 1  # the greedy answer's; beam's text rewrites nothing
    assert f"Changes to <code>{want[0].name}</code> (+{want[0].added} −{want[0].removed})" in html
    shown = re.search(r"<pre>(.*?)</pre>", html, re.S).group(1)
    assert unescape(re.sub(r"<[^>]+>", "", shown)) == want[0].diff
    assert ui.show(None) == "" and "does not exist" in ui.show("20990101-000000-abcdef")
    assert blind_cards_html(r, 2).count('class="dsbd-card-diff"') == 1  # a blind view hides modes, not diffs


# -- the Compare tab's handlers ------------------------------------------------------------------------
def _mode_names_in(html: str) -> set[str]:
    return {m for m in MODES if re.search(rf"(?<![\w-]){re.escape(m)}(?![\w-])", html)}


def test_blind_order_is_random_and_hidden_until_the_vote(tmp_path):
    ui = CompareUI(FakeEngine(), R.ResultStore(tmp_path), rng=random.Random(3))
    orders = set()
    for _ in range(12):
        s = Session()
        out = list(ui.run(s, "tell me", ["greedy", "beam", "sample"], True, "", *values(), progress=NOP))
        cards, plot, status, radio, btn = out[-1]
        assert status.startswith("Done: 3 answers") and "Seed" in status
        for view in out:  # every view the browser got before the vote: labels only
            assert _mode_names_in(str(view[0]) + str(view[2])) == set(), view
            assert "tok/s" not in str(view[0])
        assert radio["visible"] and [v for _, v in radio["choices"]] == ["A", "B", "C", "tie", "both-bad"]
        orders.add(tuple(a["mode"] for a in s.compare["answers"]))
        cards, plot, status, *_ = ui.vote(s, "B")
        assert _mode_names_in(cards) == {"greedy", "beam", "sample"} and "tok/s" in cards and "your pick" in cards
        assert plot is not None and "Vote saved: B" in status
    assert len(orders) >= 4  # 3! = 6 orders; 12 seeded draws hit at least 4 of them
    assert len(ui.store.list()) == 12 and ui.store.pending() == []


def test_blind_same_seed_and_random_seed_drawn_once(tmp_path):
    eng = FakeEngine()
    ui = CompareUI(eng, R.ResultStore(tmp_path), rng=random.Random(1))
    list(ui.run(Session(), "x", ["greedy", "sample"], True, "", *values(seed=-1), progress=NOP))
    seeds = {p.seed for _, p in eng.calls}
    assert len(seeds) == 1 and None not in seeds
    list(ui.run(Session(), "x", ["greedy", "sample"], True, "", *values(seed=7), progress=NOP))
    assert {p.seed for _, p in eng.calls[2:]} == {7}


def test_blind_drops_modes_that_cannot_run_and_needs_two(tmp_path):
    ui = CompareUI(FakeEngine(draft=False), R.ResultStore(tmp_path))
    out = list(ui.run(Session(), "x", ["greedy", "sps"], True, "", *values(), progress=NOP))
    assert "Need two modes" in out[-1][2] and "sps cannot run here" in out[-1][2]
    out = list(ui.run(Session(), "x", ["greedy"], True, "", *values(), progress=NOP))
    assert "at least two modes" in out[-1][2]


def test_blind_stop_saves_nothing(tmp_path):
    ui, s = CompareUI(FakeEngine(), R.ResultStore(tmp_path)), Session()
    gen = ui.run(s, "p", ["greedy", "beam", "sample"], True, "", *values(), progress=NOP)
    next(gen)
    s.cancel.set()
    out = list(gen)
    assert out[-1][2].startswith("Stopped") and ui.store.list() == []


def test_pending_vote_comes_back_after_a_restart(tmp_path):
    ui, s = CompareUI(FakeEngine(), R.ResultStore(tmp_path)), Session()
    list(ui.run(s, "first", ["greedy", "beam"], True, "", *values(), progress=NOP))  # not voted
    ui2, s2 = CompareUI(FakeEngine(), R.ResultStore(tmp_path)), Session()
    cards, _, status, radio, _ = ui2.next_pending(s2)
    assert "Answer A" in cards and _mode_names_in(cards) == set() and "first" in status and radio["visible"]
    cards, *_ = ui2.vote(s2, "tie")
    assert _mode_names_in(cards) == {"greedy", "beam"}
    assert ui2.next_pending(Session())[2] == "No comparison waits for a vote."


def test_open_mode_labels_answers_and_saves(tmp_path):
    eng = FakeEngine(draft=False)
    seen = []
    ui = CompareUI(eng, R.ResultStore(tmp_path))
    out = list(ui.run(Session(), "compare me", ["sps", "greedy", "beam"], False, "", *values(),
                      progress=lambda *a, **k: seen.append(a)))
    assert [p.mode for _, p in eng.calls] == ["greedy", "beam"]  # MODES order; sps failed before running
    cards, fig, status, *_ = out[-1]
    assert cards.count('class="dsbd-card"') == 3 and "needs a draft model" in cards and "tok/s" in cards
    assert fig is not None and status.startswith("Done: 3 mode(s)") and seen[0][0] == (0, 3)
    (r,) = ui.store.list()
    assert r["kind"] == "open" and not R.needs_vote(r)


def test_results_view_export_and_report(tmp_path):
    ui, s = CompareUI(FakeEngine(), R.ResultStore(tmp_path)), Session()
    for choice in ("A", "B", "tie"):
        list(ui.run(s, "q", ["greedy", "dsbd"], True, "", *values(), progress=NOP))
        ui.vote(s, choice)
    list(ui.run(s, "q", ["greedy", "dsbd"], True, "", *values(), progress=NOP))  # left waiting
    head, modes_html, pairs_html, listing, runs = ui.results_view()
    assert "**4** saved comparisons, **3** voted, **1** waiting" in head
    assert "dsbd</code> vs <code>greedy" in pairs_html and "(hidden until the vote)" in listing
    f, msg = ui.export("csv")
    assert f["visible"] and msg.startswith("Exported 4")
    img, files, msg = ui.report()
    assert img.endswith(".png") and len(files["value"]) == 2 and "1 model pair" in msg
    html = open(files["value"][1], encoding="utf-8").read()
    assert "data:image/png;base64," in html and "Wilson" in html and "fake-target" in html


def test_set_handlers_start_stop_tick_resume(tmp_path):
    eng = FakeEngine(delay=0.01)
    ui = CompareUI(eng, R.ResultStore(tmp_path))
    bar, status, timer = ui.set_start("paste", "a\nb\nc", None, 0, ["greedy"], "", *values())
    assert status.startswith("Not started") and "two modes" in status
    bar, status, timer = ui.set_start("paste", "a\nb\nc", None, 2, ["greedy", "beam"], "", *values())
    assert "Running 2 prompts × 2 modes" in status and timer.active
    ui.runner.join(60)
    bar, status, timer, runs = ui.set_tick()
    assert "2 / 2 prompts" in bar and "Finished" in status and not timer.active
    assert ui.set_resume(None)[1].startswith("Not resumed")


def test_report_figure_has_error_bars_and_pictures():
    eng = FakeEngine()
    records = []
    for choice in ("A", "B", "A"):
        r = R.new_comparison(prompt="p", modes=["greedy", "dsbd"], seed=1, settings={}, models=eng.describe())
        R.answer_all(eng, r, _params("greedy", "dsbd"))
        records.append(R.apply_vote(r, choice))
    fig = figure(records)
    ax_lp, ax_pass, ax_win, ax_acc, ax_wid, _ = fig.axes
    assert ax_lp.containers and ax_win.containers  # errorbar containers: one per mode
    assert ax_acc.patches and ax_wid.patches  # dsbd's acceptance and widths bars
    assert "no data yet" in [t.get_text() for t in ax_pass.texts]  # nothing graded
    assert "<table" in mode_table_html(records) and "greedy" in pair_table_html(records)


def test_report_one_page_per_model_pair(tmp_path):
    a = [rec(["x", "y"], "A", models={"target": "big", "draft": "small"})]
    b = [rec(["x", "y"], "B", models={"target": "other"})]
    paths = write_report(a + b, tmp_path)
    assert sorted(p.name for p in paths) == ["report-big-small.html", "report-big-small.png",
                                             "report-other-no-draft.html", "report-other-no-draft.png"]


# -- CLI -----------------------------------------------------------------------------------------------
def test_cli_compare_code_suite_on_real_tiny(tmp_path, capsys, tiny_gguf_path):
    """The one real path: `dsbd-chat compare` on the tiny preset, graded, saved, exported, reported."""
    from app.cli import main

    rc = main(["compare", "--suite", "code", "--prompts", "1", "--modes", "greedy,sps:gamma=2", "--max-tokens",
               "24", "--seed", "5", "--ctx", "1024", "--data-dir", str(tmp_path), "--json",
               "--export", str(tmp_path / "out.csv"), "--report", str(tmp_path / "rep")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "done" and out["done"] == 1 and out["waiting_for_votes"] == 0
    assert set(out["summary"]) == {"greedy", "sps:gamma=2"}
    for s in out["summary"].values():
        assert s["graded"] == 1 and s["pass_rate"] in (0.0, 1.0) and s["tokens_per_s_median"] > 0
    (r,) = R.ResultStore(tmp_path).list()
    assert r["seed"] == 5 and {a["params"]["seed"] for a in r["answers"]} == {5}
    assert {a["mode"] for a in r["answers"]} == {"greedy", "sps:gamma=2"} and r["models"]["target"]
    assert R.read_export(tmp_path / "out.csv") == [r]
    assert len(out["report"]) == 2


def test_cli_compare_rejects_bad_modes_before_loading(tmp_path, capsys):
    from app.cli import main

    assert main(["compare", "--modes", "greedy,dsbd:bogus=1", "--data-dir", str(tmp_path)]) == 2
    assert "unknown setting 'bogus'" in capsys.readouterr().err


def test_set_from_an_uploaded_jsonl_file(tmp_path):
    eng = FakeEngine()
    ui = CompareUI(eng, R.ResultStore(tmp_path / "data"))
    f = tmp_path / "mine.jsonl"
    f.write_text('"first"\n{"prompt": "second"}\n', encoding="utf-8")
    assert ui.set_start("upload", "", None, 0, ["greedy", "beam"], "", *values())[1].startswith("Not started")
    bar, status, timer = ui.set_start("upload", "", str(f), 0, ["greedy", "beam"], "", *values())
    assert "Running 2 prompts" in status
    ui.runner.join(60)
    run = ui.store.load_run(ui.runner.run["id"])
    assert run["source"] == "file mine.jsonl" and run["state"] == "done"
    assert sorted(r["prompt"] for r in ui.store.list()) == ["first", "second"]


def test_cli_compare_ctrl_c_then_resume_on_real_tiny(tmp_path, capsys, monkeypatch, tiny_gguf_path):
    """Ctrl-C in the middle of `dsbd-chat compare` keeps the finished prompts; --resume answers only the rest."""
    from app.cli import main
    from app.compare import runner

    real, calls = runner.answer_all, []

    def interrupted_on_the_second_prompt(engine, rec, *a, **k):
        calls.append(rec["item"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(engine, rec, *a, **k)

    monkeypatch.setattr(runner, "answer_all", interrupted_on_the_second_prompt)
    common = ["--max-tokens", "8", "--ctx", "512", "--data-dir", str(tmp_path), "--json"]
    assert main(["compare", "--suite", "chat", "--prompts", "3", "--modes", "greedy,sample", *common]) == 130
    err = capsys.readouterr().err
    run_id = re.search(r"--resume (\S+)", err).group(1)
    run = R.ResultStore(tmp_path).load_run(run_id)
    assert run["state"] == "stopped" and run["done"] == [0]
    assert main(["compare", "--resume", run_id, *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["state"], out["done"], out["waiting_for_votes"]) == ("done", 3, 3)
    assert calls == [0, 1, 1, 2]  # the interrupted prompt again, then the last; the first is not repeated
    assert sorted(r["item"] for r in R.ResultStore(tmp_path).list()) == [0, 1, 2]


def test_import_an_export_into_another_app(tmp_path):
    a = CompareUI(FakeEngine(), R.ResultStore(tmp_path / "a"))
    s = Session()
    list(a.run(s, "q", ["greedy", "dsbd"], True, "", *values(), progress=NOP))
    a.vote(s, "A")
    f, _ = a.export("csv")
    b = CompareUI(FakeEngine(), R.ResultStore(tmp_path / "b"))
    assert b.import_file(f["value"]).startswith("Imported 1 comparisons")
    assert b.store.list() == a.store.list()
    bad = tmp_path / "x.json"
    bad.write_text('{"comparisons": [{"id": "../evil", "answers": [], "prompt": ""}]}')
    assert b.import_file(str(bad)).startswith("Not imported")
    assert not (tmp_path / "b" / "evil.json").exists() and len(b.store.list()) == 1


def test_iter_answers_streams_each_answer_in_label_order_and_stops_when_cancelled():
    eng = FakeEngine()
    rec = R.new_comparison(prompt="p", modes=["greedy", "dsbd"], seed=1, settings={}, models=eng.describe())
    assert list(R.iter_answers(eng, rec, _params("greedy", "dsbd"))) == [(0, False), (0, True), (1, False), (1, True)]
    assert all(a["text"] and a["params"]["seed"] == 1 for a in rec["answers"])
    stopped = threading.Event()
    stopped.set()
    fresh = R.new_comparison(prompt="p", modes=["greedy", "dsbd"], seed=1, settings={}, models=eng.describe())
    assert list(R.iter_answers(eng, fresh, _params("greedy", "dsbd"), cancel=stopped)) == []
    assert not R.answer_all(eng, fresh, _params("greedy", "dsbd"), cancel=stopped)


def test_iter_run_yields_each_saved_comparison_and_leaves_the_run_done(tmp_path):
    eng, store = FakeEngine(), R.ResultStore(tmp_path)
    params = _params("greedy", "dsbd")
    run = R.new_run(source="pasted", items=["a", "b", "c"], params=params, settings={}, models=eng.describe(), seed=5)
    seen = [rec["prompt"] for rec in R.iter_run(eng, store, run, params, cancel=threading.Event())]
    assert seen == ["a", "b", "c"] and run["state"] == "done" and run["done"] == [0, 1, 2]
    assert [r["prompt"] for r in store.list()] == ["a", "b", "c"]
