"""Serving an app in the tests: a real uvicorn server on a free port, and an engine wrapper that records."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

from app.engine.engine import Engine


@contextlib.contextmanager
def running(app):
    """Serve `app` with uvicorn on a free loopback port in a background thread; yield its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # startup, not an assertion: fails below only if the thread died
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class Recorder:
    """The real engine plus what the server made of it: each chat generation's final stats, in order.

    With `hold` set, the next generation pauses after its first text until its cancel Event is set,
    so a disconnect test does not race the model to the end of its answer.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine, self.finished, self.hold = engine, queue.Queue(), False
        self.holding = threading.Event()  # set while a held generation waits

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def chat(self, messages, params, *, cancel=None):
        stream, hold, self.hold = self.engine.chat(messages, params, cancel=cancel), self.hold, False
        return self._watch(stream, cancel if hold else None)

    def _watch(self, stream, hold):
        last = None
        try:
            for last in stream:
                yield last
                if hold is not None and last.text:
                    self.holding.set()
                    hold.wait(timeout=60)  # released by the server cancelling this request
                    hold = None
        finally:
            stream.close()
            self.finished.put(last.stats if last is not None else None)
