"""Soak test: mixed chat / compare / API load against a local dsbd-chat server for N minutes.

    python scripts/soak.py                      # 30 minutes, in-process server on the tiny preset
    python scripts/soak.py --minutes 2 --json soak.json
    python scripts/soak.py --url http://127.0.0.1:7860 --pid 1234   # an already running server (API load only)

In-process (the default) it loads the tiny engine, serves `app.serve.api.build_server` on a free 127.0.0.1 port and
drives: streamed / plain chat completions, raw completions and clients hanging up mid-stream over HTTP,
plus the Chat and Compare tabs' handlers (ChatUI / CompareUI, with history saves) on the same engine.
RSS of the server process is sampled with psutil; after the warm-up it must grow by less than --max-growth,
and no request may fail. Loopback only; requests and duration are bounded. Exit status 0 = pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French.",
           "List two prime numbers.", "Describe a cat in one sentence.", "Count from 1 to 10."]
API_MODES = [{"temperature": 0}, {"temperature": 0.8}, {"temperature": 0.7, "dsbd": {"mode": "dsbd", "beams": 2}},
             {"temperature": 0.7, "dsbd": {"mode": "sps", "gamma": 3}}, {"temperature": 0, "dsbd": {"mode": "beam",
                                                                                                    "beams": 2}},
             {"temperature": 0.8, "dsbd": {"mode": "auto", "quality": "beam", "beams": 2}}]


class Soak:
    def __init__(self, a, url: str, engine=None) -> None:
        self.a, self.url, self.engine = a, url.rstrip("/"), engine
        self.deadline = time.monotonic() + a.minutes * 60
        self.lock = threading.Lock()
        self.count: Counter = Counter()
        self.errors: list[str] = []
        self.stop = threading.Event()

    # -- bookkeeping -------------------------------------------------------------------------------
    def more(self) -> bool:
        with self.lock:
            ok = not self.stop.is_set() and time.monotonic() < self.deadline and \
                sum(self.count.values()) < self.a.max_requests and len(self.errors) < 20
            return ok

    def done(self, kind: str, error: str | None = None) -> None:
        with self.lock:
            self.count[kind] += 1
            if error:
                self.errors.append(f"{kind}: {error}"[:500])
                print(f"soak: error: {kind}: {error}"[:500], file=sys.stderr, flush=True)

    # -- API load over HTTP -------------------------------------------------------------------------
    def api_worker(self, seed: int) -> None:
        rng = random.Random(seed)
        headers = {"Authorization": f"Bearer {self.a.api_key}"} if self.a.api_key else {}
        with httpx.Client(base_url=self.url, timeout=120, headers=headers) as http:
            while self.more():
                kind = rng.choice(["api-stream", "api-stream", "api-chat", "api-completion", "api-hangup"])
                body = {"model": "any", "max_tokens": rng.randint(4, self.a.max_tokens), "seed": rng.randrange(1000),
                        **rng.choice(API_MODES)}
                try:
                    if kind == "api-completion":
                        r = http.post("/v1/completions", json=body | {"prompt": rng.choice(PROMPTS)})
                        r.raise_for_status()
                        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                    elif kind == "api-chat":
                        r = http.post("/v1/chat/completions", json=body | self._messages(rng))
                        r.raise_for_status()
                        assert r.json()["choices"][0]["message"]["content"] is not None
                    else:
                        self._stream(http, body | self._messages(rng) | {"stream": True}, hang_up=kind == "api-hangup")
                    self.done(kind)
                except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                    self.done(kind, f"{type(e).__name__}: {e}")

    @staticmethod
    def _messages(rng) -> dict:
        return {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}

    @staticmethod
    def _stream(http, body: dict, *, hang_up: bool) -> None:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if hang_up and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return  # leaving the block closes the connection mid-answer
        if not hang_up:
            raise RuntimeError("stream ended without [DONE]")

    # -- the UI's Chat and Compare handlers on the same engine (in-process only) ----------------------
    def ui_worker(self, seed: int) -> None:
        from app.serve.ui.chat import ChatUI, Session
        from app.serve.ui.compare import CompareUI
        from app.storage import HistoryStore
        from app.serve.ui.settings import FIELDS, default_settings

        rng = random.Random(seed)
        store = HistoryStore(self.a.data_dir)
        from app.compare.store import ResultStore

        chat_ui, compare_ui = ChatUI(self.engine, store), CompareUI(self.engine, ResultStore(self.a.data_dir))
        session, turns = Session(), 0
        while self.more():
            mode = rng.choice(["greedy", "sample", "dsbd", "dsbd-mem", "auto"])
            s = default_settings() | {"mode": mode, "quality": rng.choice(["fast", "beam", "dynamic"]), "beams": 2.0,
                                      "max_new_tokens": float(rng.randint(4, self.a.max_tokens)),
                                      "seed": float(rng.randrange(1000))}
            values = [s[k] for k in FIELDS]
            kind = "ui-compare" if rng.random() < 0.25 else "ui-chat"
            try:
                if kind == "ui-chat":
                    if turns >= 3:  # a fresh chat now and then keeps prompts short and exercises new saves
                        chat_ui.new_chat(session, "", *values)
                        turns = 0
                    chat_ui.submit(session, rng.choice(PROMPTS), "", *values)
                    for _ in chat_ui.generate(session):
                        pass
                    turns += 1
                    if session.error:
                        raise RuntimeError(session.error)
                    assert session.chat["messages"][-1]["role"] == "assistant"
                    store.load(session.chat["id"])  # what was saved reads back
                else:
                    last, cs = None, Session()
                    for last in compare_ui.run(cs, rng.choice(PROMPTS), ["greedy", "sps", "dsbd", "auto"], True, "",
                                               *values, progress=lambda *a, **k: None):
                        pass
                    if last is None or not str(last[2]).startswith("Done: 4"):
                        raise RuntimeError(f"compare: {last and last[2]}")
                    if "dsbd-card-error" in str(last[0]):
                        raise RuntimeError("a compare card shows an error")
                    voted = compare_ui.vote(cs, rng.choice(["A", "B", "C", "D", "tie", "both-bad"]))  # blind, saved
                    if not str(voted[2]).startswith("Vote saved"):
                        raise RuntimeError(f"compare vote: {voted[2]}")
                self.done(kind)
            except Exception as e:  # noqa: BLE001
                self.done(kind, f"{type(e).__name__}: {e}")


@contextlib.contextmanager
def local_server(a):
    """Tiny engine + build_server on a free loopback port, uvicorn in a thread; yields (url, engine)."""
    import uvicorn

    from app.serve.api import build_server
    from backends.registry import ModelSpec
    from app.engine.engine import Engine

    engine = Engine.load(ModelSpec(source=a.preset, n_ctx=1024), ModelSpec(source=a.preset, n_ctx=1024))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_server(engine, api_key=a.api_key, data_dir=a.data_dir)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("soak: the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        with engine.lock:
            engine.close()


def sample_rss(proc: psutil.Process, soak: Soak, samples: list, every: float) -> None:
    t0 = time.monotonic()
    while not soak.stop.wait(every):
        samples.append((round(time.monotonic() - t0, 1), proc.memory_info().rss))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=None, help="RSS baseline after this (default: 10%% of the "
                                                                 "run, at least 20 s)")
    ap.add_argument("--api-clients", type=int, default=3)
    ap.add_argument("--ui-clients", type=int, default=1, help="in-process only")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after warm-up (0.10 = 10%%)")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--url", help="an already running local server (loopback only); default: start one in-process")
    ap.add_argument("--pid", type=int, help="that server's process id, for RSS (without it: no RSS check)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--data-dir", default=None, help="chat history folder for the UI load (default: a temp dir)")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    if not 0 < a.minutes <= 24 * 60 or a.max_requests < 1:
        ap.error("--minutes must be in (0, 1440] and --max-requests >= 1")
    if a.url and urlparse(a.url).hostname not in LOOPBACK:
        ap.error(f"--url must be a loopback address ({', '.join(LOOPBACK)}): this script only loads your own machine")
    import tempfile

    with contextlib.ExitStack() as stack:
        if a.data_dir is None:
            a.data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="dsbd-soak-"))
        if a.url:
            url, engine, proc = a.url, None, psutil.Process(a.pid) if a.pid else None
        else:
            url, engine = stack.enter_context(local_server(a))
            proc = psutil.Process()
        warmup = a.warmup_s if a.warmup_s is not None else max(20.0, a.minutes * 6)
        soak = Soak(a, url, engine)
        samples: list = []
        load = [threading.Thread(target=soak.api_worker, args=(i,), daemon=True) for i in range(a.api_clients)]
        if engine is not None:
            load += [threading.Thread(target=soak.ui_worker, args=(100 + i,), daemon=True)
                     for i in range(a.ui_clients)]
        workers = load + ([threading.Thread(target=sample_rss, args=(proc, soak, samples, a.sample_s), daemon=True)]
                          if proc is not None else [])
        t0 = time.monotonic()
        print(f"soak: {a.minutes:g} min against {url} ({a.api_clients} API + "
              f"{a.ui_clients if engine else 0} UI clients)", flush=True)
        for t in workers:
            t.start()
        try:
            while soak.more() and any(t.is_alive() for t in load):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        soak.stop.set()
        for t in workers:
            t.join(180)
        elapsed = time.monotonic() - t0
    after = [rss for t, rss in samples if t >= warmup]
    growth = None
    if len(after) >= 4:  # baseline: the first samples after warm-up; end: the last ones (medians, robust)
        k = max(2, len(after) // 10)
        base, end = statistics.median(after[:k]), statistics.median(after[-k:])
        growth = (end - base) / base
    report = {"url": url, "seconds": round(elapsed, 1), "requests": sum(soak.count.values()),
              "by_kind": dict(soak.count), "errors": soak.errors, "warmup_s": warmup,
              "rss_mb": [(t, round(r / 2**20, 1)) for t, r in samples], "rss_growth": growth,
              "max_growth": a.max_growth}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print(f"soak: {report['requests']} requests in {elapsed:.0f} s {dict(soak.count)}; errors: {len(soak.errors)}; "
          f"RSS growth after warm-up: {'n/a' if growth is None else f'{growth:+.1%}'}", flush=True)
    failed = bool(soak.errors) or (growth is not None and growth >= a.max_growth)
    if proc is not None and growth is None:
        print("soak: too few RSS samples after the warm-up to judge growth (run longer)", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
