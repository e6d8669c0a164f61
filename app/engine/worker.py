"""The engine in a supervised child process: a native crash ends one answer, never the chat server.

llama.cpp can die with SIGILL (AMX), SIGSEGV or abort, and the kernel can OOM-kill a process; in-process
that takes the whole server down. `WorkerEngine` runs `app.engine.engine.Engine` in a "spawn" child (no forked
threads or llama state) and speaks a small RPC over a Pipe (typed messages, app.engine.messages): a call
answers once; a stream is opened (validation errors are raised at once, as in-process), started on the first
`next`, then sends one pickled `Event` per step. Exceptions come back with their type, message and attributes
(PromptTooLong stays one).

When the child dies, every request in flight fails with ModelProcessLost naming the signal, and a fresh
child loads the same models (the swapped-in ones after a swap) while the server keeps serving. Three
failed loads in a row end the respawns, and so do three answers in a row that each killed a freshly loaded
child: every request then gets that error instead of an endless loop.

A child that stops answering (a hung native call, a network stall under an RPC target) is replaced: a stream
that gets no event within a deadline (HUNG_FACTOR x the timed pass costs, at least HUNG_MIN_S) kills it.
With an RPC target (backends.llamacpp.rpc) a lost worker aborts the child; the answer then names the worker,
and while a worker is down the next request checks it again and reloads once it answers.
The child ignores Ctrl+C (the parent closes it) and exits when the pipe closes (the parent died).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from typing import Callable, Sequence

from backends.base import BackendError
from backends.load_progress import LoadCancelled

from app.config import DecodeParams
from app.engine.timing import TIMED
from app.engine.interface import ModelEngine, ModelProcessLost, NoModelLoaded
from app.engine.messages import (Call, Cancel, Close, LoadFailed, LoadProgress, Lost, Open, Opened, Ready,
                                 unpack_exc)
from app.engine.proxies import RemoteTokenizer, Stream, reply
from app.engine.worker_child import child_main
from backends.registry import ModelSpec

log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often a load waiting for the model process looks at its cancel Event

MAX_LOAD_FAILURES = 3  # failed (re)loads in a row before the supervisor stops respawning
MAX_ANSWER_CRASHES = 3  # answers in a row that killed the model process before it stops respawning
HUNG_FACTOR = 50.0  # an event this many times later than the timed passes predict: stuck, not slow
HUNG_MIN_S = 180.0  # never sooner: on an overloaded machine a first event can take a minute
HUNG_UNTIMED_S = 600.0  # per event, before the passes are timed
_WHY = {"SIGILL": "illegal instruction",
        "SIGSEGV": "segmentation fault", "SIGABRT": "aborted", "SIGBUS": "bus error",
        "SIGFPE": "arithmetic fault", "SIGKILL": "killed, e.g. out of memory",
        "SIGTERM": "terminated"}


def death_cause(exitcode: int | None) -> str:
    """'SIGILL: illegal instruction ...' for a signal, 'exit code N' otherwise."""
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
        return f"{name}: {_WHY.get(name) or (signal.strsignal(-exitcode) or name).lower()}"
    return f"exit code {exitcode}"



# -- the parent --------------------------------------------------------------------------------------
class _Child:
    """One model process: its pipe, the requests waiting on it, and the thread reading its replies."""

    def __init__(self, conn, proc) -> None:
        self.conn, self.proc = conn, proc
        self.hung: str | None = None  # why the supervisor killed it for not answering
        self.lock = threading.Lock()  # guards pending / dead (never held while blocked on the pipe)
        self.send_lock = threading.Lock()  # one message at a time on the pipe
        self.pending: dict[int, tuple[queue.SimpleQueue, str]] = {}
        self.dead: str | None = None  # the cause once it died

    def register(self, rid: int, kind: str) -> queue.SimpleQueue:
        q = queue.SimpleQueue()
        with self.lock:
            if self.dead is not None:  # answered at once, as if it had died with this request
                q.put(Lost(rid, _died(self.dead, kind)))
            else:
                self.pending[rid] = (q, kind)
        return q

    def forget(self, rid: int) -> None:
        with self.lock:
            self.pending.pop(rid, None)

    def send(self, msg) -> None:
        try:
            with self.send_lock:
                self.conn.send(msg)
        except (OSError, EOFError, ValueError):  # it died: the reader fails the pending requests
            pass


def _died(cause: str, kind: str, *, lost: tuple[str, str] | None = None, hung: str | None = None) -> str:
    if lost is not None and kind == "answer":
        return (f"lost the RPC worker {lost[0]} ({lost[1]}) during this answer; the model process ended ({cause}) "
                "(restarting; check the worker)")
    if lost is not None:
        return (f"lost the RPC worker {lost[0]} ({lost[1]}); the model process ended ({cause}) "
                "(restarting; check the worker)")
    if hung is not None and kind == "answer":
        return (f"the model process stopped answering ({hung}); it was replaced by a fresh one with the same "
                "models; send the message again")
    return {
        "answer": f"the model process died ({cause}) during this answer; it is restarting with the same models; "
                  "send the message again",
        "swap": f"the model process died ({cause}) while loading the new models; it is restarting with the "
                "previous models",
        "load": f"the model process died ({cause}) while loading the models",
    }.get(kind, f"the model process died ({cause}); it is restarting with the same models; try again")


class WorkerEngine(ModelEngine):
    """An Engine in a supervised child process, with the Engine's interface as the UI, API and CLI use it.

    `WorkerEngine.load(target, draft)` returns once the models are loaded, raising the same errors as
    `Engine.load` (ConfigError, PlanError, BackendError...). `on_start` (a picklable function) runs in each
    new model process before it loads: tests use it to crash a load on purpose.
    """

    policy = None  # auto's timing lives in the model process (bench reads engine.policy)

    def __init__(self, target: ModelSpec, draft: ModelSpec | None = None, *, budget=None,
                 max_load_failures: int = MAX_LOAD_FAILURES, max_answer_crashes: int = MAX_ANSWER_CRASHES,
                 hung_after: float | None = None, on_start: Callable[[], None] | None = None,
                 profile: str = TIMED) -> None:
        """hung_after: a fixed per-event deadline in seconds (None: from the timed pass costs); profile: the cost
        profile adaptive forests are priced with (app.engine.timing), kept across restarts of the process."""
        self._budget, self._on_start, self.max_load_failures = budget, on_start, max_load_failures
        self._profile = profile
        self.max_answer_crashes, self.hung_after = max_answer_crashes, hung_after
        self._costs = None  # (target, draft) CostCurves once timed: the deadlines follow them
        self._crashes = 0  # answers in a row that ended with the model process dying
        self._retry_lock = threading.Lock()  # one reload at a time while an RPC worker is down
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        # starting | ready | waiting (an RPC worker is down) | broken | empty (unloaded) | closed
        self._phase = "starting"
        self._broken: str | None = None
        self._state: dict = {}
        self._child: _Child | None = None
        self.restarts = 0  # model processes started after a crash (for tests and logs)
        self._saved: list[list[dict]] = []  # remember_chats: each new model process gets them too
        self._child = self._start(target, draft)
        self._phase = "ready"

    @classmethod
    def load(cls, target: ModelSpec, draft: ModelSpec | None = None, *, budget=None, profile: str = TIMED,
             **kw) -> "WorkerEngine":
        return cls(target, draft, budget=budget, profile=profile, **kw)

    # -- the mirrored state ------------------------------------------------------------------------
    @property
    def specs(self) -> tuple[ModelSpec | None, ModelSpec | None]:
        return self._state.get("specs", (None, None))

    @property
    def plan(self):
        return self._state.get("plan")

    @property
    def n_ctx(self) -> int:
        return self._state.get("n_ctx", 0)

    @property
    def pid(self) -> int | None:
        """The model process's pid (None while it restarts)."""
        child = self._child
        return child.proc.pid if child is not None else None

    @property
    def tokenizer(self) -> "RemoteTokenizer | None":
        return self._tokenizer  # None once unloaded

    def describe(self) -> dict:
        self._ready()  # a broken worker says why
        return dict(self._state["describe"])

    # -- calls -------------------------------------------------------------------------------------
    def check_params(self, params: DecodeParams) -> DecodeParams:
        return self._call("check_params", params)

    def resolve(self, params: DecodeParams):
        return self._call("resolve", params)

    def pick(self, params: DecodeParams):
        return self._call("pick", params)

    def costs(self) -> tuple:
        self._costs = self._call("costs", kind="answer")  # times the passes on first use: not asked twice
        return self._costs

    def prepare(self) -> None:
        return self._call("prepare", kind="answer")  # waits for a running answer, as one does

    def use_cost_profile(self, name: str) -> dict:
        described = self._call("use_cost_profile", name)
        self._profile, self._costs = name, None  # a restarted model process prices with it too
        self._state["describe"] = described
        return dict(described)

    def observe(self, params: DecodeParams, stats: dict) -> None:
        return self._call("observe", params, stats)

    def encode(self, messages: list[dict]) -> list[int]:
        return self._call("encode", messages)

    def remember_chats(self, chats: Sequence[list[dict]]) -> None:
        self._saved = [list(c) for c in chats]
        with self._cv:
            ready = self._phase == "ready"
        if ready:  # otherwise the next model process is started with them
            self._call("remember_chats", self._saved)

    def complete(self, prompt: Sequence[int], params: DecodeParams, *, n: int = 1) -> list[dict]:
        return self._call("complete", list(prompt), params, n=n, kind="answer")

    def swap(self, target: ModelSpec, draft: ModelSpec | None = None, *, progress=None,
             cancel: threading.Event | None = None) -> dict:
        """Engine.swap in the model process (the old models keep serving if it fails or is cancelled). With
        no models (unloaded) or a broken worker (crash loop), a fresh process loads these models instead;
        cancelling that load ends the process."""
        with self._cv:
            fresh = self._phase in ("broken", "waiting", "empty")
        if fresh:
            child = self._start(target, draft, progress=progress, cancel=cancel)
            with self._cv:
                if self._phase == "closed":
                    self._kill(child)
                    raise BackendError("the engine is closed")
                self._child, self._phase, self._broken, self._crashes = child, "ready", None, 0
                self._cv.notify_all()
            return self.describe()
        child = self._ready()
        rid = next(self._ids)
        q = child.register(rid, "swap")
        try:
            child.send(Call(rid, "swap", (target, draft), {"progress": progress is not None,
                                                          "cancel": cancel is not None}))
            asked = False  # Cancel sent
            while True:
                try:
                    msg = q.get(timeout=_POLL_S if cancel is not None and not asked else None)
                except queue.Empty:
                    if cancel.is_set():
                        child.send(Cancel(rid))
                        asked = True
                    continue
                if isinstance(msg, LoadProgress):
                    if progress is not None:
                        progress(*msg.args, **msg.kwargs)
                    continue
                info, state = reply(msg)
                self._adopt(state)
                return info
        finally:
            child.forget(rid)

    def _unload_all(self) -> None:
        """Unloading both models ends the model process (its memory is freed at once)."""
        self._ready()  # a running restart finishes first; a broken or empty engine says so
        with self._cv:
            child, self._child = self._child, None
            self._phase, self._state, self._tokenizer, self._costs = "empty", {}, None, None
            self._cv.notify_all()
        if child is not None:
            self._kill(child)

    def generate(self, prompt: Sequence[int], params: DecodeParams, *,
                 cancel: threading.Event | None = None) -> "Stream":
        """Stream one completion, as Engine.generate: ConfigError / PromptTooLong are raised here."""
        return self._open("generate", (list(prompt), params), cancel)

    def chat(self, messages: list[dict], params: DecodeParams, *,
             cancel: threading.Event | None = None) -> "Stream":
        return self._open("chat", (messages, params), cancel)

    def close(self) -> None:
        """Stop the model process (it gets a moment to exit, then is killed)."""
        with self._cv:
            child, self._phase, self._child = self._child, "closed", None
            self._cv.notify_all()
        if child is not None:
            self._kill(child)

    def __enter__(self) -> "WorkerEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------------
    def _ready(self) -> _Child:
        """The serving child; waits while one restarts; raises when broken or closed. While an RPC worker is
        down, each request checks it again and reloads the models once it answers."""
        while True:
            with self._cv:
                while self._phase == "starting":
                    self._cv.wait()
                if self._phase == "broken":
                    raise BackendError(self._broken)
                if self._phase == "empty":
                    raise NoModelLoaded()
                if self._phase == "closed":
                    raise BackendError("the engine is closed")
                if self._phase == "ready":
                    return self._child
            self._reload_after_worker()

    def _reload_after_worker(self) -> None:
        """Phase "waiting": raise at once while a worker still fails the check, else load in a new process."""
        from backends.remote import WorkerUnreachable, first_unreachable

        with self._retry_lock:
            with self._cv:
                if self._phase != "waiting":
                    return
            target, draft = self.specs
            down = first_unreachable(target.rpc)
            if down is None:
                try:
                    child = self._start(target, draft)
                except WorkerUnreachable as e:
                    down = (e.endpoint, e.why)
                except Exception as e:  # noqa: BLE001 - a load that fails for another reason: say so, stay waiting
                    raise BackendError(f"the RPC workers answer again, but loading {target.source} failed: {e}") from e
                else:
                    with self._cv:
                        if self._phase == "closed":
                            self._kill(child)
                            raise BackendError("the engine is closed")
                        self._child, self._phase, self._broken = child, "ready", None
                        self.restarts += 1
                        self._cv.notify_all()
                    log.warning("the RPC workers answer again: the model process restarted (pid %s)", child.proc.pid)
                    return
            raise BackendError(f"the RPC worker {down[0]} is down ({down[1]}): start it again (dsbd-chat rpc-worker "
                               "on that machine); the next message retries, and so does loading models in the "
                               "Models tab")

    def _call(self, name: str, *args, kind: str = "call", **kwargs):
        for attempt in (1, 2):
            child = self._ready()
            rid = next(self._ids)
            q = child.register(rid, kind)
            try:
                child.send(Call(rid, name, args, kwargs))
                msg = q.get()
            finally:
                child.forget(rid)
            # A quick call that met a process already dying (killed a moment ago) is asked again of the new one.
            if not isinstance(msg, Lost) or kind != "call" or attempt == 2:
                return reply(msg)

    def _open(self, name: str, args: tuple, cancel: threading.Event | None) -> "Stream":
        for attempt in (1, 2):
            child = self._ready()
            rid = next(self._ids)
            q = child.register(rid, "answer")
            msg = None
            try:
                child.send(Open(rid, name, args))
                msg = q.get()
                if isinstance(msg, Opened):
                    return Stream(child, rid, q, cancel, engine=self, params=args[1])
                # Opening only validates: if the process was already dying, open it again on the new one.
                if not isinstance(msg, Lost) or attempt == 2:
                    reply(msg)  # raises
            finally:
                if not isinstance(msg, Opened):
                    child.forget(rid)

    def _adopt(self, state: dict) -> None:
        self._state = state
        self._tokenizer = RemoteTokenizer(self, state["tokenizer"])

    def _start(self, target: ModelSpec, draft: ModelSpec | None, *, progress=None,
               cancel: threading.Event | None = None) -> _Child:
        """Spawn a model process, wait for its load; raise the load's error (or its death) if it fails.
        `progress(LoadStep)` hears the load's stages; setting `cancel` ends the process (LoadCancelled)."""
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=child_main, args=(theirs, target, draft, self._budget, self._on_start,
                                                    self._profile, self._saved),
                           name="dsbd-model", daemon=True)
        proc.start()
        theirs.close()  # only the child holds its end now: its death is our EOF
        child = _Child(mine, proc)
        q = child.register(0, "load")
        threading.Thread(target=self._read, args=(child,), name=f"dsbd-worker-{proc.pid}", daemon=True).start()
        last = None
        while True:
            try:
                msg = q.get(timeout=_POLL_S if cancel is not None else None)
            except queue.Empty:
                if cancel.is_set():
                    child.forget(0)
                    self._kill(child)
                    raise LoadCancelled(f"cancelled while {last or 'starting the model process'}; the model process "
                                        "that was loading ended") from None
                continue
            if not isinstance(msg, LoadProgress):
                break
            last = msg.args[0] if msg.args else last
            if progress is not None:
                progress(*msg.args, **msg.kwargs)
        child.forget(0)
        if not isinstance(msg, Ready):
            self._kill(child)
            if isinstance(msg, LoadFailed):
                raise unpack_exc(msg.error)
            raise ModelProcessLost(msg.why)
        self._adopt(msg.state)
        return child

    def _read(self, child: _Child) -> None:
        """The child's replies -> the waiting requests; on EOF: fail them all, then respawn if it served."""
        conn = child.conn
        try:
            while True:
                msg = conn.recv()
                with child.lock:
                    entry = child.pending.get(msg.rid)
                if entry is not None:
                    entry[0].put(msg)
        except (EOFError, OSError):
            pass
        child.proc.join(5)
        if child.proc.exitcode is None:  # closed its pipe but still running: not trusted any more
            child.proc.kill()
            child.proc.join(5)
        cause = death_cause(child.proc.exitcode)
        if child.hung:
            cause = f"stopped answering: {child.hung}"
        with child.lock:
            child.dead = cause
            pending, child.pending = list(child.pending.values()), {}
        conn.close()
        lost = self._lost_worker(child.proc.exitcode) if pending or (self._child is child and self._phase == "ready") \
            else None
        answers = any(kind == "answer" for _, kind in pending)
        with self._cv:
            serving = self._child is child and self._phase == "ready"
            if serving:
                self._child, self._phase = None, "starting"
                self._crashes += answers and lost is None  # a worker that went away is not the engine's fault
        if serving:
            log.error("the model process (pid %s) died: %s; restarting it", child.proc.pid, cause)
        for q, kind in pending:
            q.put(Lost(0, _died(cause, kind, lost=lost, hung=child.hung)))
        if serving:
            if self._crashes >= self.max_answer_crashes:
                with self._cv:
                    self._stop_restarting(
                        f"the model process died during each of the last {self._crashes} answers (last: {cause}) "
                        f"although {self.specs[0].source} loads: not restarting it again: try another mode or "
                        "smaller settings after loading the models again in the Models tab, or restart dsbd-chat "
                        "(see README, Troubleshooting)")
                log.error("not restarting the model process: %d answers in a row crashed it", self._crashes)
                return
            self._respawn(cause)

    def _stop_restarting(self, why: str) -> None:
        """Under self._cv: every request gets `why` until models are loaded again (not after close)."""
        if self._phase != "closed":
            self._phase, self._broken = "broken", why
            self._cv.notify_all()

    def _lost_worker(self, exitcode: int | None) -> tuple[str, str] | None:
        """(endpoint, why) of an RPC worker of the target that no longer answers; with every worker answering,
        an abort (the native client's reaction to a broken connection) still names them: one restarted."""
        target = self.specs[0]
        if target is None or not target.rpc:
            return None
        from backends.remote import first_unreachable

        down = first_unreachable(target.rpc)
        if down is None and exitcode == -signal.SIGABRT:
            return (f"at one of {', '.join(target.rpc)}" if len(target.rpc) > 1 else target.rpc[0],
                    "its connection broke; every worker answers again now")
        return down

    def answered(self) -> None:
        """A stream ended normally: the crash-in-a-row count starts again."""
        self._crashes = 0

    def deadline(self, params, *, first: bool) -> float:
        """Seconds an event may take before the model process counts as hung (see HUNG_FACTOR)."""
        if self.hung_after is not None:
            return self.hung_after
        costs = self._costs
        if costs is None:
            return HUNG_UNTIMED_S
        target, draft = costs
        try:
            p = params.validated()
        except Exception:  # noqa: BLE001 - the child validated it already; any estimate will do
            p = DecodeParams()
        gamma = max(p.gamma, 6) if p.mode == "auto" else p.gamma
        drafted = p.uses_draft or p.mode == "auto"
        n = (p.draft_beams or p.beams) * gamma + p.beams if drafted else p.beams
        step = target(n) + (gamma * draft(p.draft_beams or p.beams) if drafted and draft is not None else 0.0)
        if first:  # the first event also prefills the prompt: at most the whole context
            step += target(self._state.get("n_ctx", 4096)) + (draft(self._state.get("n_ctx", 4096)) if draft else 0.0)
        return max(HUNG_MIN_S, HUNG_FACTOR * step)

    def _hung(self, child: _Child, why: str) -> None:
        """Kill a model process that stopped answering; the reader then fails its requests and respawns."""
        if child.hung is None:
            child.hung = why
            log.error("the model process (pid %s) %s: replacing it", child.proc.pid, why)
            try:
                child.proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _respawn(self, cause: str) -> None:
        """Load the current specs in a new process; after max_load_failures in a row, stay broken."""
        failures, last = 0, cause
        while True:
            target, draft = self.specs
            try:
                child = self._start(target, draft)
            except Exception as e:  # noqa: BLE001 - each failure counts towards the crash loop
                if type(e).__name__ == "WorkerUnreachable":  # not a crash loop: wait for the worker (_ready)
                    with self._cv:
                        if self._phase != "closed":
                            self._phase, self._broken = "waiting", str(e)
                            self._cv.notify_all()
                    log.error("an RPC worker is down, the models load again once it answers: %s", e)
                    return
                failures += 1
                last = str(e)
                log.error("restarting the model process failed (%d/%d): %s", failures, self.max_load_failures, e)
                with self._cv:
                    if self._phase == "closed":
                        return
                    if failures >= self.max_load_failures:
                        self._stop_restarting(
                            f"the model process failed {failures} times in a row while loading {target.source}"
                            f"{f' + {draft.source}' if draft else ''} (last: {last}); not restarting it again: "
                            "load other models in the Models tab or restart dsbd-chat (see README, Troubleshooting)")
                        return
                time.sleep(min(2.0, 0.25 * failures))
                continue
            with self._cv:
                if self._phase == "closed":
                    self._kill(child)
                    return
                self._child, self._phase = child, "ready"
                self.restarts += 1
                self._cv.notify_all()
            log.warning("the model process restarted (pid %s) with %s", child.proc.pid, target.source)
            return

    @staticmethod
    def _kill(child: _Child) -> None:
        """Ask the process to exit (it does at once), then make sure it did."""
        child.send(Close(0))
        child.proc.join(5)
        if child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
