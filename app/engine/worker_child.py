"""The model process's side of `app.engine.worker.WorkerEngine`: load the models, then serve the supervisor's
calls and streams (typed messages, app.engine.messages) until the pipe closes.

The main thread only reads the pipe, so EOF (the supervisor died) ends the process at once; each call and
stream runs on its own thread against the one `Engine`, which serialises generations itself.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

from backends.base import BackendError
from backends.host import keep_freed_rows

from app.engine.messages import (Call, Cancel, Close, Drop, End, Failed, Go, LoadFailed, LoadProgress, Open, Opened,
                                 Ready, Result, Streamed, pack_exc)
from backends.registry import ModelSpec

TOKENIZER_ATTRS = ("name", "n_vocab", "bos_id", "eos_id", "eos_ids", "vocab_type", "add_bos", "chat_template")
# What the supervisor may call on the child's Engine (streams: "generate" / "chat", opened separately).
CALLS = frozenset({"describe", "check_params", "resolve", "pick", "costs", "prepare", "observe", "encode", "complete",
                   "swap", "use_cost_profile", "remember_chats", "tokenizer.encode", "tokenizer.decode",
                   "tokenizer.piece"})


class _Served:
    """One request inside the child: its cancel Event, whether the parent started or dropped the stream."""

    def __init__(self) -> None:
        self.cancel, self.go, self.dropped = threading.Event(), threading.Event(), False


def child_main(conn, target: ModelSpec, draft: ModelSpec | None, budget, on_start, profile: str = "timed",
               saved=()) -> None:
    """Entry point of the model process: load, report, then serve requests until the pipe closes. `saved`: the
    chats the supervisor was told to remember (Engine.remember_chats)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's: it closes this process
    keep_freed_rows()
    try:  # a crash must not leave a core file of the size of the models behind
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        pass
    send_lock = threading.Lock()

    def send(msg) -> None:
        try:
            with send_lock:
                conn.send(msg)
        except (OSError, EOFError):  # the parent is gone
            os._exit(0)

    engine = None
    served: dict[int, _Served] = {}

    def load() -> None:
        nonlocal engine
        try:
            if on_start is not None:
                on_start()
            from app.engine.engine import Engine

            engine = Engine.load(target, draft, budget=budget, profile=profile,
                                 progress=lambda step: send(LoadProgress(0, (step,))))
            if saved:
                engine.remember_chats(saved)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            send(LoadFailed(0, pack_exc(e)))
            return
        send(Ready(0, _state(engine)))

    threading.Thread(target=load, name="dsbd-load", daemon=True).start()
    while True:  # the main thread only reads the pipe: EOF (the parent died) ends the process at once
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        rid = msg.rid
        if isinstance(msg, Close):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if isinstance(msg, Call):
            name, args, kwargs = msg.name, msg.args, dict(msg.kwargs)
            if kwargs.pop("cancel", None):  # a load the user may cancel: Cancel(rid) sets this Event
                kwargs["cancel"] = served.setdefault(rid, _Served()).cancel
            if name.startswith("tokenizer."):  # fast and read-only: answered inline
                _serve_call(engine, rid, name, args, kwargs, send)
            else:
                threading.Thread(target=_serve_call, args=(engine, rid, name, args, kwargs, send, served),
                                 name=f"dsbd-call-{rid}", daemon=True).start()
        elif isinstance(msg, Open):
            s = served[rid] = _Served()
            threading.Thread(target=_serve_stream, args=(engine, rid, msg.name, msg.args, s, send, served),
                             name=f"dsbd-stream-{rid}", daemon=True).start()
        elif isinstance(msg, (Go, Cancel, Drop)):
            s = served.get(rid)
            if s is not None:
                if isinstance(msg, Cancel):
                    s.cancel.set()
                elif isinstance(msg, Drop):  # the parent closed the stream: stop at the next step, or never start
                    s.dropped = True
                    s.cancel.set()
                s.go.set()


def _state(engine) -> dict:
    """What the parent mirrors: specs, plan, n_ctx, describe() and the tokenizer's plain attributes."""
    plan = engine.plan
    try:
        pickle.dumps(plan)
    except Exception:
        plan = None
    tok = engine.tokenizer
    return {"specs": engine.specs, "plan": plan, "n_ctx": engine.n_ctx, "describe": engine.describe(),
            "tokenizer": {k: getattr(tok, k, None) for k in TOKENIZER_ATTRS}, "pid": os.getpid()}


def _serve_call(engine, rid: int, name: str, args, kwargs, send, served: dict | None = None) -> None:
    try:
        if name not in CALLS:
            raise BackendError(f"the model process has no call {name!r}")
        fn = engine
        for part in name.split("."):
            fn = getattr(fn, part)
        if name == "swap" and kwargs.pop("progress", None):
            kwargs["progress"] = lambda *a, **k: send(LoadProgress(rid, a, k))
        result = fn(*args, **kwargs)
        if name == "swap":
            result = (result, _state(engine))
        send(Result(rid, result))
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        send(Failed(rid, pack_exc(e)))
    finally:
        if served is not None:
            served.pop(rid, None)


def _serve_stream(engine, rid: int, name: str, args, s: _Served, send, served: dict) -> None:
    gen = None
    try:
        gen = getattr(engine, name)(*args, cancel=s.cancel)  # ConfigError / PromptTooLong: raised here
        send(Opened(rid))
        s.go.wait()
        if s.dropped:
            return
        for ev in gen:
            if s.dropped:
                break
            send(Streamed(rid, ev))
        else:
            send(End(rid))
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        send(Failed(rid, pack_exc(e)))
    finally:
        if gen is not None:
            gen.close()  # releases the engine lock
        served.pop(rid, None)

