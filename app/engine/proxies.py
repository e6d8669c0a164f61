"""What the supervisor (app.engine.worker.WorkerEngine) hands out in place of what lives in the model process:
an answer's stream of Events and the serving model's tokenizer; and `reply`, a reply message as its value or
its error."""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

from backends.base import BackendError

from app.engine.interface import ModelProcessLost
from app.engine.messages import Cancel, Drop, End, Failed, Go, Lost, Result, Streamed, unpack_exc

_POLL_S = 0.05  # how often a stream waiting for its next event looks at its cancel Event


def reply(msg):
    """A reply's value; raises the model process's error (with its type) or its death."""
    if isinstance(msg, Result):
        return msg.value
    if isinstance(msg, Failed):
        raise unpack_exc(msg.error)
    if isinstance(msg, Lost):
        raise ModelProcessLost(msg.why)
    raise BackendError(f"unexpected reply from the model process: {type(msg).__name__}")


class Stream:
    """The parent's side of one answer: iterates Events; `close()` stops it (as closing Engine's generator
    does); its cancel Event is forwarded to the child (the supervisor's handle on a model process) when set.
    An event later than the engine's deadline kills the (hung) child."""

    def __init__(self, child, rid: int, q: queue.SimpleQueue, cancel: threading.Event | None, *,
                 engine=None, params=None) -> None:
        self.child, self.rid, self.q, self.cancel = child, rid, q, cancel
        self.engine, self.params = engine, params
        self.started = self.finished = self.cancel_sent = False
        self.events = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        if not self.started:
            self.started = True
            self.child.send(Go(self.rid))
        limit = self.engine.deadline(self.params, first=self.events == 0) if self.engine is not None else None
        due = None if limit is None else time.monotonic() + limit
        while True:
            if self.cancel is not None and not self.cancel_sent and self.cancel.is_set():
                self.cancel_sent = True
                self.child.send(Cancel(self.rid))
            poll = self.cancel is not None and not self.cancel_sent
            wait = _POLL_S if poll else None
            if due is not None:
                wait = max(0.0, min(wait if wait is not None else 1.0, due - time.monotonic()))
            try:
                msg = self.q.get(timeout=wait) if wait is not None else self.q.get()
            except queue.Empty:
                if due is not None and time.monotonic() >= due and self.child.hung is None:
                    what = "its first event" if self.events == 0 else "the next event"
                    self.engine._hung(self.child, f"no progress for {limit:.0f} s waiting for {what} of an answer")
                continue
            if isinstance(msg, Streamed):
                self.events += 1
                return msg.event
            self._finish()
            if isinstance(msg, End):
                if self.engine is not None:
                    self.engine.answered()
                raise StopIteration
            reply(msg)  # raises the child's error or its death

    def _finish(self) -> None:
        self.finished = True
        self.child.forget(self.rid)

    def close(self) -> None:
        if not self.finished:
            self.child.send(Drop(self.rid))
            self._finish()



class RemoteTokenizer:
    """The serving model's tokenizer: plain attributes copied at load; encode / decode / piece asked of
    the model process (single-token decodes, the forest view's labels, are cached)."""

    def __init__(self, engine, attrs: dict) -> None:
        self.__dict__.update(attrs)
        self._engine, self._pieces = engine, {}

    def encode(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self._engine._call("tokenizer.encode", text, add_bos=add_bos, special=special)

    def decode(self, ids) -> bytes:
        ids = list(ids)
        if len(ids) == 1:
            got = self._pieces.get(ids[0])
            if got is None:
                got = self._pieces[ids[0]] = self._engine._call("tokenizer.decode", ids)
            return got
        return self._engine._call("tokenizer.decode", ids)

    def piece(self, token: int) -> bytes:
        return self._engine._call("tokenizer.piece", token)

    def is_eog(self, token: int) -> bool:
        return token in (self.eos_ids or ())
