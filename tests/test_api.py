"""The OpenAI-compatible API, driven by the official `openai` client against a real uvicorn server.

The main server is `build_server` (API + mounted Gradio UI) over the real `tiny` engine; answers are
checked token for token against direct engine calls. Queue-full and backend errors use a fake engine.
"""

from __future__ import annotations

import queue
import socket
import threading

import httpx
import pytest

from app.serve.api import build_api, build_server, model_id
from app.config import DecodeParams
from backends.registry import ModelSpec
from app.decoding import derive_seed
from app.engine.engine import Engine
from backends.base import BackendError
from api_helpers import Recorder, running
from fake_engine import FakeEngine

openai = pytest.importorskip("openai")

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "List three colours."}]


@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    yield e
    with e.lock:  # a generation still running on a server thread (a failed test) must end first
        e.close()


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    rec = Recorder(tiny)
    with running(build_server(rec, api_key=KEY, data_dir=tmp_path_factory.mktemp("chats"))) as url:
        yield url, rec


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def direct(engine, **kw) -> str:
    """The same generation straight from the engine, for token-for-token comparisons."""
    last = None
    for last in engine.chat(MESSAGES, DecodeParams(**kw)):
        pass
    return last.text


def test_models_and_ui_on_one_server(served, client, tiny):
    models = client.models.list().data
    assert models[0].id == model_id(tiny) == "smollm2-135m-instruct-q4-1"  # the preset's name
    assert all(m.id.startswith("library/") for m in models[1:])  # then the model library
    assert models[0].model_extra["dsbd"]["target_backend"] == "llamacpp"
    assert client.models.retrieve(model_id(tiny)).id == model_id(tiny)
    page = httpx.get(served[0] + "/", timeout=30)  # the Gradio UI, mounted at "/", needs no key
    assert page.status_code == 200 and "gradio" in page.text.lower()


def test_chat_completion_matches_the_engine(client, tiny):
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == direct(tiny, mode="greedy", max_new_tokens=8)  # temperature 0 = greedy
    assert choice.finish_reason in ("stop", "length")
    stats = choice.model_extra["dsbd_stats"]
    assert stats["mode"] == "greedy" and r.usage.completion_tokens == stats["new_tokens"] <= 8
    assert r.usage.prompt_tokens == stats["prompt_tokens"] > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == model_id(tiny) and r.object == "chat.completion"


def test_streamed_chat_equals_non_streamed(client, tiny):
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == direct(tiny, mode="greedy", max_new_tokens=8)
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason in ("stop", "length") and last.model_extra["dsbd_stats"]["target_passes"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_n_completions_use_derived_seeds(client, tiny):
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=5, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for j, c in enumerate(r.choices):
        want = direct(tiny, mode="sample", max_new_tokens=8, temperature=0.9, seed=derive_seed(5, j))
        assert c.message.content == want
    assert r.usage.completion_tokens == sum(c.model_extra["dsbd_stats"]["new_tokens"] for c in r.choices)


def test_dsbd_extension_parameters(client):
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0.8, seed=1,
                                       extra_body={"dsbd": {"mode": "dsbd", "beams": 2, "gamma": 2,
                                                            "threshold": 0.8}})
    stats = r.choices[0].model_extra["dsbd_stats"]
    assert stats["mode"] == "dsbd" and stats["target_passes"] >= 1 and stats["draft_passes"] >= 1
    assert stats["acceptance_by_depth"]  # the draft forest was verified layer by layer
    assert r.choices[0].message.content.strip()


def test_auto_mode_says_what_it_picked(client, tiny):
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0.8, seed=2,
                                       extra_body={"dsbd": {"mode": "auto", "quality": "beam", "beams": 2}})
    stats = r.choices[0].model_extra["dsbd_stats"]
    auto = stats["auto"]
    assert auto["quality"] == "beam" and auto["setting"].split(":")[0] == stats["mode"]
    assert stats["mode"] in ("beam-sample", "dsbd") and auto["projected_tokens_per_s"] > 0


def test_raw_completions(client, tiny):
    r = client.completions.create(model="any", prompt=["1, 2, 3, 4,", "Colours: red,"], max_tokens=6,
                                  temperature=0, stop=["\n"])
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)
    assert all("\n" not in c.text for c in r.choices)
    s = list(client.completions.create(model="any", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                       stop=["\n"], stream=True))
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"extra_body": {"dsbd": {"mode": "dsbd", "threshold": 1.5}}}, "dsbd.threshold"),
    ({"extra_body": {"dsbd": {"mode": "turbo"}}}, "dsbd.mode"),
    ({"extra_body": {"dsbd": {"mode": "auto", "quality": "best"}}}, "dsbd.quality"),
    ({"extra_body": {"dsbd": {"beamz": 2}}}, "dsbd.beamz"),
    ({"extra_body": {"dsbd": {"mode": "dsbd"}}, "temperature": 0}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_parameters_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=MESSAGES, **body)
    assert e.value.param == param and e.value.type == "invalid_request_error"


def test_bad_json_and_unknown_route(served):
    url, headers = served[0], {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=headers
                   | {"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/engines", headers=headers)
    assert r.status_code == 404 and "error" in r.json()


def test_wrong_or_missing_key_is_401(served):
    bad = openai.OpenAI(base_url=served[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "invalid_api_key"
    assert httpx.get(served[0] + "/v1/models").status_code == 401


def test_prompt_too_long_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", max_tokens=8,
                                       messages=[{"role": "user", "content": "word " * 600}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "512-token context" in e.value.message


def _stream_then_close(url, client):
    stream = client.chat.completions.create(model="any", max_tokens=200, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Count from 1 to 100."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client goes away mid-answer


def _wait_then_hang_up(url, client, rec):
    # A non-streamed request on a raw socket, closed once its generation is under way.
    body = b'{"model": "any", "max_tokens": 200, "messages": [{"role": "user", "content": "Count to 100."}]}'
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert rec.holding.wait(timeout=60)


@pytest.mark.parametrize("hang_up", ["stream", "non-stream"])
def test_disconnect_cancels_the_generation(served, client, hang_up):
    url, rec = served
    rec.finished, rec.hold = queue.Queue(), True
    rec.holding.clear()
    if hang_up == "stream":
        _stream_then_close(url, client)
    else:
        _wait_then_hang_up(url, client, rec)
    stats = rec.finished.get(timeout=60)  # the server-side generation ended ...
    assert stats["finish_reason"] == "cancelled" and stats["new_tokens"] < 200  # ... because it was cancelled
    assert rec.lock.acquire(blocking=False)  # and left the engine free
    rec.lock.release()
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content


# -- queue and backend errors, on a fake engine ------------------------------------------------------
class HeldEngine(FakeEngine):
    """FakeEngine whose generations pause after every event until `go` is set."""

    def __init__(self) -> None:
        super().__init__(answer_words=4)
        self.go = threading.Event()

    def _run(self, *args):
        for ev in super()._run(*args):
            yield ev
            self.go.wait(timeout=60)


@pytest.fixture
def held():
    engine = HeldEngine()
    app = build_api(engine, max_waiting=1)
    with running(app) as url:
        yield url, engine, app
        engine.go.set()


def test_queue_full_is_503(held):
    url, engine, app = held
    body = {"model": "any", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running_one:
            assert any('"content": "Answer' in line for line in running_one.iter_lines())  # holds the engine
            with http.stream("POST", "/v1/chat/completions", json=body) as waiting_one:
                assert waiting_one.status_code == 200 and app.state.gate.waiting == 1
                fake = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
                with pytest.raises(openai.InternalServerError) as e:
                    fake.chat.completions.create(model="any", messages=body["messages"], max_tokens=8)
                assert e.value.status_code == 503 and e.value.code == "queue_full"
                engine.go.set()
                assert any(line == "data: [DONE]" for line in waiting_one.iter_lines())  # served once free
    assert app.state.gate.waiting == 0


def test_backend_error_is_500_with_its_message(held):
    url, engine, _ = held
    engine.fail_with = BackendError("the GPU fell off the bus")
    fake = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        fake.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert e.value.status_code == 500 and "fell off the bus" in e.value.message


def test_no_model_loaded_is_503_saying_what_to_do(held):
    url, engine, _ = held
    engine.unload("all")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert e.value.status_code == 503 and e.value.code == "model_not_loaded"
    assert "no model is loaded" in e.value.message and "Models tab" in e.value.message
    assert model_id(engine) == "dsbd-chat"


def test_models_lists_the_library_with_a_loaded_flag(tmp_path, monkeypatch, tiny_gguf_path):
    from gguf_files import write_gguf
    from hub_server import isolate

    paths = isolate(monkeypatch, tmp_path)
    write_gguf(paths["cache"] / "other.gguf", name="Other")
    engine = FakeEngine()
    engine.specs = (ModelSpec(source=str(tiny_gguf_path)), ModelSpec(source="tiny"))
    with running(build_api(engine)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        models = {m.id: m for m in client.models.list()}
        served = models[model_id(engine)]
        assert served.loaded is True and list(models)[0] == model_id(engine)  # the served model stays first
        tiny = next(m for m in models.values() if m.id.startswith("library/") and m.dsbd["preset"] == "tiny")
        assert tiny.loaded is True and tiny.dsbd["loaded_as"] == "target" and tiny.owned_by == "local"
        mine = next(m for m in models.values() if m.id.startswith("library/") and m.dsbd["name"] == "Other")
        assert mine.loaded is False and mine.dsbd["quant"] == "F32" and mine.dsbd["complete"] is True
        assert "path" not in mine.dsbd and str(tmp_path) not in str(mine.dsbd)  # no local paths over the API
        assert client.models.retrieve(mine.id).dsbd["name"] == "Other"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("library/nothing-here")


def test_models_after_an_unload_lists_the_library_only(tmp_path, monkeypatch):
    from hub_server import isolate

    isolate(monkeypatch, tmp_path)
    engine = FakeEngine()
    engine.unload("all")
    with running(build_api(engine)) as url:
        models = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).models.list()
        assert all(m.id.startswith("library/") and m.loaded is False for m in models)
