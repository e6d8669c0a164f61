"""One chat with files, sent through each edge (the CLI's `generate --file`, the API's file parts, the Chat tab's
message box): the model gets the same messages from all three, an earlier turn's files included as they went in
when it was sent (its retrieved passages, not the whole file)."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

gr = pytest.importorskip("gradio")

from app import attachments as att  # noqa: E402
from app.cli import main  # noqa: E402
from app.serve.api import build_api  # noqa: E402
from app.serve.ui.chat import ChatUI, Session  # noqa: E402
from app.storage import HistoryStore  # noqa: E402
from api_helpers import running  # noqa: E402
from chat_file_helpers import CALC, Answering, AnsweringCli  # noqa: E402
from ui_helpers import values  # noqa: E402

N_CTX = 1400
MAX_TOKENS = 64
SYSTEM = "You are a careful engineer."
ASK_LOG = "Why did the disk fill up on volume seven?"
ASK_FIX = "Now fix the bug in calc.py."


@pytest.fixture
def files(tmp_path):
    lines = [f"Line {i} of the log: the nightly job ran and nothing happened today." for i in range(600)]
    lines[420] = "ERROR disk full on volume seven: the backup job wrote twice"
    log, calc = tmp_path / "app.log", tmp_path / "calc.py"
    log.write_text("\n".join(lines) + "\n")
    calc.write_text(CALC)
    return str(log), str(calc)


def part(path: str) -> dict:
    data = base64.b64encode(open(path, "rb").read()).decode()
    return {"type": "file", "file": {"filename": path.rsplit("/", 1)[-1], "file_data": data}}


def chat_tab(tmp_path, turns: list[tuple[str, str]]) -> Answering:
    engine = Answering(n_ctx=N_CTX)
    ui, s = ChatUI(engine, HistoryStore(tmp_path / "data")), Session()
    for text, path in turns:
        ui.submit(s, {"text": text, "files": [path]}, SYSTEM, *values(max_new_tokens=float(MAX_TOKENS)))
        list(ui.generate(s))
        assert s.error is None, s.error
    return engine


def api(messages: list[dict]) -> tuple[Answering, dict]:
    engine = Answering(n_ctx=N_CTX)
    with running(build_api(engine)) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "any", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages})
    assert r.status_code == 200, r.text
    return engine, r.json()["dsbd_files"]


def test_cli_api_and_chat_tab_send_the_same_prompt(tmp_path, files, monkeypatch, capsys):
    log, calc = files
    chat = chat_tab(tmp_path, [(ASK_LOG, log), (ASK_FIX, calc)])
    first, second = chat.calls[0][0], chat.calls[1][0]
    assert att.RETRIEVAL_NOTE in first[1]["content"] and "ERROR disk full" in first[1]["content"]

    cli = AnsweringCli(n_ctx=N_CTX)
    monkeypatch.setattr("app.cli.open_engine", lambda *a, **kw: cli)
    assert main(["generate", "--prompt", ASK_LOG, "--system", SYSTEM, "--file", log, "--mode", "greedy",
                 "--max-tokens", str(MAX_TOKENS), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == Answering.answer
    assert cli.encoded[-1] == first

    one, info = api([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": [{"type": "text", "text": ASK_LOG}, part(log)]}])
    assert one.calls[-1][0] == first and info["retrieved"] and info["message"] == 1

    # the follow-up: the first turn's file goes in as it went in when sent, on every edge
    two, info = api([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": [{"type": "text", "text": ASK_LOG}, part(log)]},
                     {"role": "assistant", "content": Answering.answer},
                     {"role": "user", "content": [{"type": "text", "text": ASK_FIX}, part(calc)]}])
    assert two.calls[-1][0] == second and second[:2] == first
    assert second[3]["content"] == att.render(ASK_FIX, [att.from_bytes("calc.py", CALC.encode())])
    assert info["message"] == 3 and not info["retrieved"]
