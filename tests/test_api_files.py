"""Files in API requests: OpenAI's content parts of type "file" (file_data as base64, a data: URL or bare, and
filename), rendered into the user turn whole or as retrieved passages, and every error a client can cause."""

from __future__ import annotations

import base64

import httpx
import pytest

from app import attachments as att
from app.serve.api import build_api
from fake_engine import FakeEngine
from api_helpers import running

openai = pytest.importorskip("openai")

CODE = "def add(a, b):\n    return a - b\n"


def part(name: str, data: bytes, *, url: bool = True) -> dict:
    b64 = base64.b64encode(data).decode()
    return {"type": "file", "file": {"filename": name, "file_data": f"data:text/plain;base64,{b64}" if url else b64}}


@pytest.fixture
def served():
    engine = FakeEngine(n_ctx=400, answer_words=4)
    with running(build_api(engine)) as url:
        yield url, engine


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "any", "max_tokens": 8} | body, timeout=30)


def test_openai_client_file_part_reaches_the_model_whole(served):
    url, engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="any", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Fix the bug."}, part("calc.py", CODE.encode())]}])
    sent = engine.calls[-1][0][-1]["content"]
    assert sent == att.render("Fix the bug.", [att.from_bytes("calc.py", CODE.encode())])
    info = r.model_extra["dsbd_files"]
    assert info["files"] == [{"name": "calc.py", "size": len(CODE), "kind": "text"}]
    assert info["retrieved"] is False and info["parts"] is None and info["budget"]["n_ctx"] == 400


def test_bare_base64_and_two_files_of_one_name(served):
    url, engine = served
    r = post(url, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare."}, part("a.txt", b"one\n", url=False), part("a.txt", b"two\n")]}]})
    assert r.status_code == 200
    sent = engine.calls[-1][0][-1]["content"]
    assert "File a.txt (4 B, 1 line):" in sent and "File a (2).txt (4 B, 1 line):" in sent


def test_files_too_large_for_the_context_are_retrieved_and_cited(served):
    url, engine = served
    doc = "".join(f"Section {i} talks about apples and pears, item {i}.\n" for i in range(200))
    doc += "The secret password is swordfish.\n" + "".join(f"Filler line {i} about bananas.\n" for i in range(100))
    r = post(url, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is the secret password?"}, part("notes.txt", doc.encode())]}]})
    assert r.status_code == 200, r.text
    info = r.json()["dsbd_files"]
    assert info["retrieved"] is True and info["parts"]
    sent = engine.calls[-1][0][-1]["content"]
    assert "swordfish" in sent and att.RETRIEVAL_NOTE in sent
    assert any(p.startswith("notes.txt:") for p in info["parts"])


@pytest.mark.parametrize("file,param,code,message", [
    ({"filename": "x.txt", "file_data": "data:text/plain;base64,@@@"}, "messages.0.content.1.file.file_data",
     "invalid_file_data", "x.txt: file_data is not valid base64"),
    ({"filename": "x.txt", "file_data": "data:text/plain,hello"}, "messages.0.content.1.file.file_data",
     "invalid_file_data", "file_data must be base64"),
    ({"filename": "x.txt", "file_id": "file-123"}, "messages.0.content.1.file.file_data", "file_data_required",
     "file_id needs the Files API"),
    ({"filename": "pic.png", "file_data": base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()},
     "messages.0.content.1.file", "invalid_file", "pic.png is a PNG image, not text"),
    ({"filename": "old.txt", "file_data": base64.b64encode("caf\xe9".encode("latin-1")).decode()},
     "messages.0.content.1.file", "invalid_file", "old.txt is not UTF-8"),
])
def test_bad_file_parts_are_400_naming_the_part(served, file, param, code, message):
    url, engine = served
    r = post(url, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                            {"type": "file", "file": file}]}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and message in err["message"]
    assert not engine.calls


def test_too_many_files_is_400(served):
    url, _ = served
    r = post(url, {"messages": [{"role": "user", "content": [part(f"f{i}.txt", b"x") for i in
                                                             range(att.MAX_FILES + 1)]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_files"
    assert f"at most {att.MAX_FILES} per message" in r.json()["error"]["message"]


def test_unknown_part_type_is_400(served):
    url, _ = served
    r = post(url, {"messages": [{"role": "user", "content": [{"type": "video", "video": {}}]}]})
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["param"]
