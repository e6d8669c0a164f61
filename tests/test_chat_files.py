"""The chat tab with files, its handlers driven directly over fake engines: chips and the context budget before
sending, what is sent (whole or retrieved), errors that stop a message, the history round trip, diffs and the
patched-file download."""

from __future__ import annotations

import pytest

gr = pytest.importorskip("gradio")

from app import attachments as att  # noqa: E402
from app.serve.ui.chat import ChatUI, Session, prompt_messages  # noqa: E402
from app.storage import HistoryStore  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from chat_file_helpers import CALC, FIXED, Answering  # noqa: E402
from ui_helpers import values  # noqa: E402


@pytest.fixture
def store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "data")


@pytest.fixture
def calc(tmp_path):
    p = tmp_path / "up" / "calc.py"
    p.parent.mkdir()
    p.write_text(CALC)
    return str(p)


def box(text: str, *paths: str) -> dict:
    return {"text": text, "files": list(paths)}


def test_chips_and_budget_before_sending(store, calc, tmp_path):
    ui = ChatUI(FakeEngine(n_ctx=4096), store)
    (tmp_path / "pic.png").write_bytes(b"\x89PNG\r\n\x1a\nxx")
    shown = ui.preview(Session(), box("Fix the bug", calc, str(tmp_path / "pic.png")), "", *values())
    tokens = len(att.render_whole(att.from_bytes("calc.py", CALC.encode())).split())
    assert f"📎 `calc.py` · {len(CALC)} B · {tokens:,} tokens" in shown
    assert "⚠️ pic.png is a PNG image, not text" in shown and "remove it" in shown
    assert f"Context: files {tokens:,} + history" in shown and "of 4,096 tokens · fits" in shown
    assert ui.preview(Session(), box("no files"), "", *values()) == ""


def test_a_file_goes_in_whole_and_comes_back_with_the_chat(store, calc):
    engine = Answering(n_ctx=4096)
    ui, s = ChatUI(engine, store), Session()
    v = ui.submit(s, box("Fix the bug", calc), "", *values())
    assert v.textbox == {"text": "", "files": []} and "Waiting" in v.status
    assert "📎 `calc.py`" in v.chatbot[-1]["content"] and "whole" in v.chatbot[-1]["content"]
    views = list(ui.generate(s))
    sent = engine.calls[-1][0][-1]["content"]
    assert sent == att.render("Fix the bug", [att.from_bytes("calc.py", CALC.encode())])
    # the answer rewrote the file: a diff in the bubble, the patched file to download
    final = views[-1]
    bubble = final.chatbot[-1]["content"]
    assert "**Changes to `calc.py`** (+1 −1)" in bubble and "-    return a - b\n+    return a + b" in bubble
    (path,) = final.patched["value"]
    assert final.patched["visible"] and open(path).read() == FIXED
    # reopened: files, plan and diff are back; the prompt is rebuilt the same
    again = ChatUI(engine, store)
    s2 = Session()
    out = again.open_chat(s2, s.chat["id"])
    assert prompt_messages(s2.chat)[0]["content"] == sent
    assert "📎 `calc.py`" in out[0][0]["content"] and "Changes to `calc.py`" in out[0][1]["content"]
    assert out[9]["visible"] and open(out[9]["value"][0]).read() == FIXED
    md = store.export(s2.chat, "md").read_text()
    assert "📎 calc.py" in md and "return a - b" in md


def test_unreadable_file_stops_the_message(store, tmp_path):
    (tmp_path / "old.txt").write_bytes("caf\xe9".encode("latin-1"))
    ui, s = ChatUI(FakeEngine(), store), Session()
    v = ui.submit(s, box("read it", str(tmp_path / "old.txt")), "", *values())
    assert v.status.startswith("Not sent: old.txt is not UTF-8") and "Remove the file" in v.status
    assert s.chat is None and not s.pending


def test_too_many_files_stops_the_message(store, calc):
    ui, s = ChatUI(FakeEngine(), store), Session()
    v = ui.submit(s, box("x", *[calc] * (att.MAX_FILES + 1)), "", *values())
    assert f"at most {att.MAX_FILES} per message" in v.status and not s.pending


def test_files_that_do_not_fit_are_retrieved_and_shown(store, tmp_path):
    lines = [f"Line {i} of the log: nothing happened today at all." for i in range(400)]
    lines[300] = "ERROR disk full on volume seven"
    (tmp_path / "app.log").write_text("\n".join(lines) + "\n")
    engine = FakeEngine(n_ctx=600, answer_words=4)
    ui, s = ChatUI(engine, store), Session()
    shown = ui.preview(s, box("why did the disk error happen?", str(tmp_path / "app.log")), "",
                       *values(max_new_tokens=64.0))
    assert "the relevant passages will be retrieved" in shown
    v = ui.submit(s, box("why did the disk error happen?", str(tmp_path / "app.log")), "",
                  *values(max_new_tokens=64.0))
    plan = att.ContextPlan.from_dict(s.chat["messages"][-1]["context"])
    assert plan.retrieved and any(p.start <= 301 <= p.end for p in plan.parts)
    assert "lines " in v.chatbot[-1]["content"] and "retrieved" in v.chatbot[-1]["content"]
    list(ui.generate(s))
    sent = engine.calls[-1][0][-1]["content"]
    assert "ERROR disk full on volume seven" in sent and att.RETRIEVAL_NOTE in sent
    assert len(sent.split()) < 600


def test_edit_last_keeps_the_files(store, calc):
    engine = Answering(n_ctx=4096)
    ui, s = ChatUI(engine, store), Session()
    ui.submit(s, box("Fix the bug", calc), "", *values())
    list(ui.generate(s))
    v = ui.start_edit(s)
    assert v.textbox == {"text": "Fix the bug", "files": []} and "Its files stay" in v.status
    ui.submit(s, box("Fix the bug, please"), "", *values())
    assert [a.name for a in att.message_files(s.chat["messages"][-1])] == ["calc.py"]
    assert len(s.chat["messages"]) == 1
