"""UI handlers driven directly (no server, no browser) over the fake engine."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

gr = pytest.importorskip("gradio")

from app.config import MODES, DecodeParams  # noqa: E402
from app.serve.ui import build_app, launch_kwargs  # noqa: E402
from app.serve.ui.chat import ChatUI, ChatView, Session, drop_oldest_pair, prompt_messages  # noqa: E402
from app.compare.store import ResultStore  # noqa: E402
from app.serve.ui.compare import CompareUI, cards_html, scatter  # noqa: E402
from app.serve.ui.forest import COLOURS, forest_svg, origin_html  # noqa: E402
from app.storage import ENV_VAR, HistoryError, HistoryStore, check_id, resolve_data_dir  # noqa: E402
from app.serve.ui.settings import (FIELDS, load_presets, params_from, settings_from_values,  # noqa: E402
                                   visibility, widget_updates)
from app.serve.ui.stats import stats_markdown  # noqa: E402
from backends.base import BackendError  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from ui_helpers import say, values  # noqa: E402


@pytest.fixture
def store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "data")


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def ui(engine, store) -> ChatUI:
    return ChatUI(engine, store)


def roles(session: Session) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in session.chat["messages"]]


# -- chat -----------------------------------------------------------------------------------------
def test_send_streams_live_beams_then_answer_with_stats(ui, store):
    s = Session()
    first = ui.submit(s, "hello there", "Be brief.", *values(mode="beam", beams=2.0))
    assert first.textbox == {"text": "", "files": []} and first.chatbot[-1] == {"role": "user", "content": "hello there"}
    views = list(ui.generate(s))
    streaming = [v.chatbot[-1]["content"] for v in views[:-1]]
    assert any("deciding between 2 beams" in c for c in streaming)
    assert any("Deciding between 2 beams" in v.status for v in views[:-1])
    final = views[-1]
    assert roles(s) == [("user", "hello there"), ("assistant", s.chat["messages"][1]["content"])]
    assert s.chat["messages"][1]["content"].startswith("Answer 1 to hello:")
    assert "tok/s" in final.stats and "| beam |" in final.stats
    assert "deciding" not in final.chatbot[-1]["content"]
    assert final.status.startswith("Done")
    # saved, listed, and the system prompt reached the engine
    assert store.load(s.chat["id"])["messages"][1]["stats"]["mode"] == "beam"
    assert [c for _, c in final.chats["choices"]] == [s.chat["id"]]
    assert ui.engine.calls[-1][0][0] == {"role": "system", "content": "Be brief."}


def test_dsbd_answer_shows_forest_and_acceptance(ui):
    s = Session()
    views = say(ui, s, "forest please", mode="dsbd", beams=2.0, draft_beams=3.0)
    final = views[-1]
    assert "Acceptance by layer" in final.stats and "Widths chosen" in final.stats and "Peak KV" in final.stats
    assert "<svg" in final.forest and COLOURS["accepted"] in final.forest and "L2" in final.forest
    assert any(isinstance(v.forest, str) and "<svg" in v.forest for v in views[:-1])  # live forest
    assert "Answer by origin" in final.forest and 'class="dsbd-tok-draft">Answer' in final.forest
    assert "from the draft:** 6 of 12 tokens (50%)" in final.stats


def test_stop_ends_only_this_tabs_generation(ui):
    a, b = Session(), Session()
    ui.submit(a, "long answer please", "", *values())
    gen = ui.generate(a)
    next(gen), next(gen)
    assert ui.stop(b) == "Stopping…"  # another tab's Stop: no effect on a
    assert not a.cancel.is_set()
    assert ui.stop(a) == "Stopping…"
    rest = list(gen)
    assert rest[-1].status.startswith("Stopped after")
    answer = a.chat["messages"][-1]
    assert answer["stats"]["finish_reason"] == "cancelled"
    assert len(answer["content"].split()) < ui.engine.answer_words
    # the next generation gets a fresh Event: the old Stop does not leak into it
    views = say(ui, a, "again")
    assert views[-1].status.startswith("Done")


def test_stop_while_queued_cancels_the_pending_answer(ui):
    s = Session()
    ui.submit(s, "hi", "", *values())
    assert ui.stop(s) == "Cancelled before it started."
    assert [type(x) for x in list(ui.generate(s))] == [ChatView]
    assert roles(s) == [("user", "hi")] and not ui.engine.calls


def test_regenerate_replaces_the_last_answer(ui):
    s = Session()
    say(ui, s, "question one")
    ui.regenerate(s, "", *values())
    views = list(ui.generate(s))
    assert [r for r, _ in roles(s)] == ["user", "assistant"]
    assert s.chat["messages"][1]["content"].startswith("Answer 2 to question")
    assert views[-1].status.startswith("Done")
    assert ui.regenerate(Session(), "", *values()).status == "Nothing to regenerate yet."


def test_edit_and_resend_replaces_the_last_user_turn(ui):
    s = Session()
    say(ui, s, "first question")
    say(ui, s, "second question")
    v = ui.start_edit(s)
    assert v.textbox == {"text": "second question", "files": []} and "Editing" in v.status
    views = say(ui, s, "edited question")
    assert [c for r, c in roles(s) if r == "user"] == ["first question", "edited question"]
    assert len(s.chat["messages"]) == 4 and s.chat["messages"][-1]["content"].startswith("Answer 3 to edited")
    assert views[-1].status.startswith("Done")
    # the model saw the edited turn, not the old one
    assert [m["content"] for m in ui.engine.calls[-1][0] if m["role"] == "user"] == ["first question",
                                                                                       "edited question"]


def test_new_chat_starts_empty_and_keeps_the_old_one(ui, store):
    s = Session()
    say(ui, s, "keep me")
    old = s.chat["id"]
    v = ui.new_chat(s, "sys", *values(mode="dsbd"))
    assert v.chatbot == [] and s.chat["id"] != old and s.chat["settings"]["mode"] == "dsbd"
    assert [c["id"] for c in store.list_chats()[0]] == [old]


def test_prompt_too_long_shows_error_and_drop_oldest_retries(store):
    eng = FakeEngine(n_ctx=120)
    ui, s = ChatUI(eng, store), Session()
    for i in range(3):
        say(ui, s, f"turn{i} " + "word " * 10, max_new_tokens=40.0)
    assert [r for r, _ in roles(s)] == ["user", "assistant"] * 3
    views = say(ui, s, "turn3 " + "word " * 10, max_new_tokens=40.0)
    final = views[-1]
    assert "Error" in final.chatbot[-1]["content"] and "context" in final.chatbot[-1]["content"]
    assert final.drop["visible"] is True and s.too_long
    ui.drop_and_retry(s, "", *values(max_new_tokens=40.0))
    views = list(ui.generate(s))
    assert views[-1].status.startswith("Dropped the")
    assert s.chat["context_from"] > 0 and s.chat["messages"][-1]["content"].startswith("Answer")
    assert views[-1].drop["visible"] is False
    assert "no longer sent to the model" in " ".join(m["content"] for m in views[-1].chatbot)
    # the engine saw only the kept turns
    assert eng.calls[-1][0][0]["content"].startswith(s.chat["messages"][s.chat["context_from"]]["content"][:5])


def test_prompt_too_long_with_a_single_huge_turn_stays_an_error(store):
    ui, s = ChatUI(FakeEngine(n_ctx=50), store), Session()
    say(ui, s, "word " * 80)
    ui.drop_and_retry(s, "", *values())
    views = list(ui.generate(s))
    assert "Error" in views[-1].chatbot[-1]["content"] and views[-1].drop["visible"] is True


@pytest.mark.parametrize("err", [BackendError("the GPU fell off"), ValueError("template broke"),
                                 RuntimeError("bug")])
def test_engine_errors_become_an_error_bubble(ui, err):
    s = Session()
    ui.engine.fail_with = err
    views = say(ui, s, "hi")
    assert "⚠️" in views[-1].chatbot[-1]["content"] and str(err) in views[-1].chatbot[-1]["content"]
    assert views[-1].status.startswith("Failed")
    assert say(ui, s, "again")[-1].status.startswith("Done")  # the tab keeps working


def test_config_error_for_a_mode_without_draft(store):
    ui, s = ChatUI(FakeEngine(draft=False), store), Session()
    views = say(ui, s, "hi", mode="sps")
    assert "needs a draft model" in views[-1].chatbot[-1]["content"]
    views = say(ui, s, "hi", mode="beam", beams=2.0, min_beams=5.0, temperature=0.0)  # hidden: ignored
    assert views[-1].status.startswith("Done")
    views = say(ui, s, "hi", mode="dsbd", beams=2.0, min_beams=5.0)  # shown: the engine's message
    assert "min_beams must be between 1 and 2" in views[-1].chatbot[-1]["content"]


def test_error_raised_mid_stream(ui, monkeypatch):
    def broken(*a, **k):
        yield from ()
        raise BackendError("the context filled up during generation")
    monkeypatch.setattr(ui.engine, "chat", broken)
    s = Session()
    views = say(ui, s, "hi")
    assert "context filled up" in views[-1].chatbot[-1]["content"]


def test_context_helpers():
    chat = {"system": "S", "context_from": 0, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}
    assert prompt_messages(chat)[0] == {"role": "system", "content": "S"}
    assert drop_oldest_pair(chat) and chat["context_from"] == 2
    assert [m["content"] for m in prompt_messages(chat)] == ["S", "c"]
    assert not drop_oldest_pair(chat)  # the last user turn always stays


# -- history ----------------------------------------------------------------------------------------
def test_history_open_rename_delete_export(ui, store):
    s = Session()
    say(ui, s, "about beams", "sys prompt", mode="dsbd", beams=3.0, draft_beams=4.0, seed=7.0)
    cid = s.chat["id"]
    t = Session()
    out = ui.open_chat(t, cid)
    view, panel = ChatView(*out[:len(ChatView._fields)]), out[len(ChatView._fields):]
    assert len(panel) == len(FIELDS)
    assert roles(t) == roles(s) and view.system == "sys prompt"
    assert "d1: 100%" in view.stats  # stats survive the JSON round trip (int keys become strings)
    restored = {k: u["value"] for k, u in zip(FIELDS, panel)}
    assert restored["mode"] == "dsbd" and restored["beams"] == 3.0 and restored["seed"] == 7.0
    assert panel[FIELDS.index("draft_beams")]["visible"] and not panel[FIELDS.index("select")]["visible"]

    v = ui.rename(t, "  My   beams chat ")
    assert store.load(cid)["title"] == "My beams chat" and "Renamed" in v.status
    assert v.chats["choices"][0][0].startswith("My beams chat")

    f, msg = ui.export(t, "json")
    exported = json.loads(open(f["value"], encoding="utf-8").read())
    assert exported["id"] == cid and "Exported" in msg
    f, _ = ui.export(t, "md")
    md = open(f["value"], encoding="utf-8").read()
    assert md.startswith("# My beams chat") and "**You:**" in md and "about beams" in md
    assert os.path.dirname(f["value"]) == str(store.exports_dir)

    v = ui.delete(t, "", *values())
    assert "Deleted" in v.status and store.list_chats()[0] == [] and t.chat["messages"] == []


def test_corrupt_history_file_is_moved_aside(ui, store):
    s = Session()
    say(ui, s, "good chat")
    bad = store.chats_dir / "20240101-000000-abcdef.json"
    bad.write_text("{not json", encoding="utf-8")
    (store.chats_dir / "20240101-000000-badbad.json").write_text(json.dumps({"id": "other"}), encoding="utf-8")
    v = ui.on_load(Session())
    assert "unreadable" in v.status and "moved it aside" in v.status
    assert [c for _, c in v.chats["choices"]] == [s.chat["id"]]
    assert not bad.exists() and len(list(store.corrupt_dir.iterdir())) == 2
    # opening a chat whose file went bad meanwhile: a notice, not a crash
    store.path_of(s.chat["id"]).write_text("[]", encoding="utf-8")
    out = ui.open_chat(Session(), s.chat["id"])
    assert "unreadable" in out[2]


@pytest.mark.parametrize("bad", ["../x", "..", "a/b", "a\\b", "/etc/passwd", "", ".hidden", "x" * 65,
                                 "C:evil", "ok\x00"])
def test_path_traversal_is_rejected(store, ui, bad):
    with pytest.raises(HistoryError):
        check_id(bad)
    with pytest.raises(HistoryError):
        store.path_of(bad)
    with pytest.raises(HistoryError):
        store.export({"id": bad, "messages": []}, "md")
    out = ui.open_chat(Session(), bad)
    assert "not a valid chat id" in out[2] if bad else out[2] == gr.skip()  # "" = nothing selected
    assert not any(p.name != "chats" and p.name != "exports" for p in store.root.iterdir())


def test_export_format_is_checked(store):
    chat = store.new_chat()
    with pytest.raises(HistoryError):
        store.export(chat, "../../evil")


def test_atomic_save_leaves_no_temp_files(store):
    chat = store.new_chat(system="s")
    chat["messages"].append({"role": "user", "content": "héllo ✓"})
    for _ in range(3):
        store.save(chat)
    assert [p.name for p in store.chats_dir.iterdir()] == [f"{chat['id']}.json"]
    assert store.load(chat["id"])["messages"][0]["content"] == "héllo ✓"


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_data_dir() == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if os.name == "posix" and not os.uname().sysname == "Darwin":
        assert resolve_data_dir() == tmp_path / "xdg" / "dsbd-chat"


# -- decoding panel ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,shown,hidden", [
    ("greedy", {"max_new_tokens", "seed"}, {"temperature", "beams", "gamma", "draft_beams", "select"}),
    ("sample", {"temperature", "top_k", "top_p"}, {"beams", "gamma", "threshold"}),
    ("beam", {"beams"}, {"temperature", "gamma", "draft_beams"}),
    ("beam-sample", {"beams", "temperature", "top_p"}, {"gamma", "select"}),
    ("sps", {"gamma", "temperature"}, {"beams", "draft_beams", "threshold", "min_beams", "select"}),
    ("dsbd", {"beams", "draft_beams", "gamma", "threshold", "min_beams", "temperature"}, {"select"}),
    ("dsbd-mem", {"beams", "draft_beams", "gamma", "threshold", "min_beams", "select"}, set()),
])
def test_per_mode_parameter_visibility(mode, shown, hidden):
    vis = visibility(mode)
    assert vis["mode"] and all(vis[k] for k in shown) and not any(vis[k] for k in hidden)
    ups = dict(zip(FIELDS, widget_updates({"mode": mode})))
    assert all(ups[k]["visible"] == vis[k] for k in FIELDS)


def test_each_knob_is_labelled_and_explained_as_the_glossary_says():
    from app.config import KNOBS
    from app.serve.ui.settings import DecodingPanel

    with gr.Blocks():
        w = DecodingPanel().widgets
    for name in set(FIELDS) & set(KNOBS):
        assert (w[name].label, w[name].info) == (KNOBS[name].label, KNOBS[name].plain), name


def test_every_mode_has_a_visibility_rule():
    assert {m: visibility(m)["mode"] for m in MODES} == {m: True for m in MODES}


def test_params_from_widget_values():
    p = params_from(settings_from_values(*values(mode="dsbd", beams=2.0, draft_beams=0.0, gamma=3.0, seed=None)))
    assert p == DecodeParams(**(p.as_dict() | {"stop": (), "lookup_sources": tuple(p.as_dict()["lookup_sources"])}))
    assert (p.mode, p.beams, p.draft_beams, p.gamma, p.seed, p.max_new_tokens) == ("dsbd", 2, None, 3, None, 64)
    assert isinstance(p.beams, int) and p.validated().draft_beams == 3
    assert params_from({"seed": 5.0}).seed == 5 and params_from({"seed": -1}).seed is None


def test_presets_exist_and_validate():
    presets = load_presets()
    assert list(presets) == ["Fast", "Balanced", "Best quality"]
    fast, bal, best = (params_from(presets[n]["settings"]).validated() for n in presets)
    assert fast.mode in ("sps", "dsbd-mem")
    # The bench: Balanced beat beam sampling's speed at beam-sample-repl's log-prob; Best quality keeps every
    # layer at W beams drafted without replacement (W_min = W: conventional beam sampling's law, spec 16.5) and
    # lets the forest size follow the hardware.
    assert (bal.mode, bal.beams, bal.forest) == ("dsbd-mem", 4, "adaptive")
    assert (best.mode, best.beams, best.min_beams, best.forest, best.replacement) == \
        ("dsbd", 4, 4, "adaptive", "without")
    assert all(set(presets[n]["settings"]) >= {"forest", "min_beams", "draft_beams", "replacement", "lookup_nodes"}
               for n in presets)


def test_preset_keeps_length_and_seed():
    from app.serve.ui.settings import DecodingPanel

    with gr.Blocks():
        panel = DecodingPanel()
    ups = dict(zip(FIELDS, panel.on_preset("Fast")))
    assert ups["mode"]["value"] == "dsbd-mem" and ups["beams"]["value"] == 2
    assert ups["max_new_tokens"] == gr.skip() and ups["seed"] == gr.skip()
    assert dict(zip(FIELDS, panel.on_mode("beam")))["beams"]["visible"] is True


# -- compare, stats, forest -----------------------------------------------------------------------------
def test_compare_runs_modes_in_order_with_progress(store):
    eng = FakeEngine(draft=False)
    seen = []
    out = list(CompareUI(eng, ResultStore(store.root)).run(Session(), "compare me", ["sps", "greedy", "beam"], False,
                                                           "", *values(beams=2.0),
                                                           progress=lambda *a, **k: seen.append(a)))
    assert [p.mode for _, p in eng.calls] == ["greedy", "beam"]  # MODES order; sps failed before running
    cards, fig, status, *_ = out[-1]
    assert cards.count('class="dsbd-card"') == 3 and "needs a draft model" in cards
    assert "tok/s" in cards and "target passes" in cards and "mean log-p" in cards
    assert fig is not None and fig.axes[0].get_xlabel().startswith("speed")
    assert status.startswith("Done: 3 mode(s)") and seen[0][0] == (0, 3)
    assert "waiting" in out[0][0]


def test_compare_needs_prompt_and_modes(tmp_path):
    out = list(CompareUI(FakeEngine(), ResultStore(tmp_path)).run(Session(), " ", ["greedy"], True, "", *values(),
                                                                 progress=lambda *a, **k: None))
    assert "Enter a prompt" in out[-1][2]
    assert scatter([]) is None and "dsbd-cards" in cards_html([])


def test_compare_stop(store):
    s = Session()
    gen = CompareUI(FakeEngine(), ResultStore(store.root)).run(s, "p", ["greedy", "beam", "sample"], False, "",
                                                               *values(), progress=lambda *a, **k: None)
    next(gen)
    s.cancel.set()
    out = list(gen)
    assert out[-1][2].startswith("Stopped")


def test_stats_markdown_is_compact_and_complete():
    eng = FakeEngine()
    ev = list(eng.chat([{"role": "user", "content": "x"}], DecodeParams(mode="dsbd", beams=2, max_new_tokens=8)))[-1]
    md = stats_markdown(ev.stats)
    for bit in ("tok/s", "first token", "target passes", "steps / pass", "mean log-p", "d1:", "W=", "Peak KV", "RAM"):
        assert bit in md
    assert len(md.splitlines()) <= 8


def test_origin_html_marks_and_escapes_runs():
    html = origin_html([("<b>", True), (" & x", False)])
    assert '<span class="dsbd-tok-draft">&lt;b&gt;</span><span class="dsbd-tok-target"> &amp; x</span>' in html
    assert "43% of the characters" in html  # 3 of 7
    assert origin_html(None) == "" and origin_html([]) == ""


def test_forest_svg_decodes_tokens():
    f = {"gamma": 1, "layers": [{"width": 1, "passed": False, "corrections": [5],
                                 "nodes": [{"parent": 0, "token": 1, "status": "accepted"},
                                           {"parent": 0, "token": 2, "status": "rejected"}]}]}
    html = forest_svg(f, lambda ids: b"<b>&" if ids == [1] else b" x")
    assert "&lt;b&gt;&amp;" in html and "␣x" in html and "+" in html and "<svg" in html
    assert COLOURS["rejected"] in html and COLOURS["correction"] in html
    assert "No draft forest" in forest_svg(None)
    assert "#2" in forest_svg(f)  # no tokenizer: ids


# -- app -------------------------------------------------------------------------------------------------
def test_build_app_and_launch_kwargs(tmp_path):
    app = build_app(FakeEngine(), data_dir=tmp_path)
    kw = launch_kwargs(app)
    assert ".dsbd-cards" in kw["css"] and kw["allowed_paths"] == [str((tmp_path / "exports").resolve())]
    assert isinstance(app, gr.Blocks)


def test_the_app_hands_the_saved_chats_to_the_engine_newest_first(tmp_path):
    from app.storage import HistoryStore

    store = HistoryStore(tmp_path)
    for i, text in enumerate(["first chat", "second chat"]):
        chat = store.new_chat(system="Be brief." if i else "")
        chat["messages"] = [{"role": "user", "content": text, "attachments": [{"name": "a.py", "text": "x = 1\n"}]},
                            {"role": "assistant", "content": "ok"}]
        store.save(chat)
        time.sleep(0.01)
    handed = []
    engine = FakeEngine()
    engine.remember_chats = handed.append
    build_app(engine, data_dir=tmp_path)
    (chats,) = handed
    assert [[m["role"] for m in c] for c in chats] == [["system", "user", "assistant"], ["user", "assistant"]]
    assert "second chat" in chats[0][1]["content"] and "x = 1" in chats[0][1]["content"]  # the files as sent


def test_session_state_is_not_copied():
    import copy

    s = Session()
    assert copy.deepcopy(s) is s and isinstance(s.cancel, type(threading.Event()))
