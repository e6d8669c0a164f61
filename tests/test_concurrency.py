"""Many clients at once against one real server (API + UI, tiny engine): no cross-talk, a client that hangs
up stops only its own generation, everyone else completes. The soak run (scripts/soak.py) is `slow`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.serve.api import build_server
from app.config import DecodeParams
from backends.registry import ModelSpec
from app.engine.engine import Engine
from api_helpers import Recorder, running

openai = pytest.importorskip("openai")

CLIENTS = 8
MAX_TOKENS = 12
FRUITS = ["apples", "pears", "plums", "figs", "dates", "limes", "kiwis", "grapes", "cherries", "melons"]
QUITTER = [{"role": "user", "content": "Count from 1 to 100, one number per line."}]


def request(i: int) -> dict:
    """Client i's request: its own prompt; even clients greedy, odd ones seeded sampling."""
    r = {"messages": [{"role": "user", "content": f"Write one short sentence about {FRUITS[i]}."}],
         "max_tokens": MAX_TOKENS, "seed": 1000 + i, "temperature": 0 if i % 2 == 0 else 0.8}
    return r


def params_of(r: dict) -> DecodeParams:  # what the API makes of it (app.serve.api.decode_params)
    greedy = r["temperature"] == 0
    return DecodeParams(mode="greedy" if greedy else "sample", max_new_tokens=r["max_tokens"],
                        temperature=1.0 if greedy else r["temperature"], seed=r["seed"])


class Tagged(Recorder):
    """Recorder that holds only the quitter's generation (after its first text, until it is cancelled)
    and files every finished generation's stats under its prompt."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.by_prompt: dict[str, dict] = {}

    def chat(self, messages, params, *, cancel=None):
        quitter = messages == QUITTER
        stream = self.engine.chat(messages, params, cancel=cancel)
        return self._tag(messages[-1]["content"], self._watch(stream, cancel if quitter else None))

    def _tag(self, prompt, events):
        last = None
        try:
            for last in events:
                yield last
        finally:
            events.close()
            self.by_prompt[prompt] = last.stats if last is not None and last.done else None


@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512))
    yield e
    with e.lock:
        e.close()


def _alone(engine, r: dict) -> str:
    last = None
    for last in engine.chat(r["messages"], params_of(r)):
        pass
    return last.text


def test_concurrent_streams_no_cross_talk_and_one_hang_up(tiny, tmp_path):
    requests = [request(i) for i in range(CLIENTS)]
    want = [_alone(tiny, r) for r in requests]  # each request run alone first: the references
    assert len(set(want)) == CLIENTS  # distinct prompts give distinct answers, so a mix-up would show
    rec = Tagged(tiny)
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(CLIENTS + 2)  # the clients, the quitter and this thread

    with running(build_server(rec, data_dir=tmp_path)) as url:
        def client(i: int) -> None:
            try:
                api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
                start.wait(30)
                text, finish = "", None
                for chunk in api.chat.completions.create(model="any", stream=True, **requests[i]):
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                assert finish in ("stop", "length")
                got[i] = text
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        def quitter() -> None:
            try:
                api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
                start.wait(30)
                stream = api.chat.completions.create(model="any", stream=True, messages=QUITTER, max_tokens=200,
                                                     temperature=0)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                stream.close()  # hangs up mid-answer
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        threads.append(threading.Thread(target=quitter, daemon=True))
        for t in threads:
            t.start()
        start.wait(30)
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not errors, errors
        assert got == dict(enumerate(want))  # every client got exactly its own answer
        for r in requests:
            assert rec.by_prompt[r["messages"][0]["content"]]["finish_reason"] in ("stop", "length")
        for _ in range(300):  # the quitter's server side may still be winding down
            if QUITTER[0]["content"] in rec.by_prompt:
                break
            time.sleep(0.1)
        stopped = rec.by_prompt[QUITTER[0]["content"]]
        assert stopped["finish_reason"] == "cancelled" and stopped["new_tokens"] < 200
        assert rec.lock.acquire(timeout=10)  # the engine is free again
        rec.lock.release()


@pytest.mark.slow
def test_soak_script_short_run(tmp_path):
    """scripts/soak.py for ~1 minute: mixed chat / compare / API load, no errors, RSS growth bounded."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "soak.py"), "--minutes", "1", "--warmup-s", "20",
                        "--data-dir", str(tmp_path / "data"), "--json", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["requests"] > 10
    assert set(report["by_kind"]) >= {"api-stream", "api-chat", "api-completion", "api-hangup", "ui-chat",
                                      "ui-compare"}
    assert report["rss_growth"] < 0.10
