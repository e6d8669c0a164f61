"""Answering comparisons: one mode at a time through the engine, a prompt set item by item as a generator
(`run_items` yields after every saved item: the CLI prints progress, the UI refreshes, a resume continues),
and `SetRunner`, which drives that generator in a background thread for the Compare tab."""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import replace
from typing import Callable, Iterator

from app.attachments import task_prompt as prompt_text
from app.compare.grading import grade
from app.compare.records import ResultsError, load_prompt_source, needs_vote, new_comparison, new_run, params_of_run
from app.compare.stats import mode_summary
from app.compare.store import ResultStore
from app.config import ConfigError, DecodeParams
from backends.base import BackendError

log = logging.getLogger(__name__)


def generate_answer(engine, messages: list[dict], params: DecodeParams,
                    cancel: threading.Event | None = None) -> dict:
    """Run one mode to the end: {text, stats, error}; a failure becomes an error, never an exception."""
    stream = None
    try:
        stream = iter(engine.chat(messages, params, cancel=cancel))
        last = None
        for last in stream:
            if last.error:
                raise BackendError(last.error)
        if last is None:
            return {"text": "", "stats": {}, "error": "the engine returned nothing"}
        return {"text": last.text, "stats": last.stats or {}, "error": None}
    except (ConfigError, ValueError, BackendError) as e:
        return {"text": "", "stats": {}, "error": str(e)}
    except Exception as e:  # one broken mode must not end the comparison
        log.exception("compare: %s failed", params.mode)
        return {"text": "", "stats": {}, "error": f"internal error: {type(e).__name__}: {e}"}
    finally:
        if stream is not None and hasattr(stream, "close"):
            stream.close()


def iter_answers(engine, rec: dict, params: dict[str, DecodeParams], *,
                 cancel: threading.Event | None = None) -> Iterator[tuple[int, bool]]:
    """Fill rec's answers in label order, one generation at a time, all with rec's seed; grade code tasks.
    Yields (i, False) as answer i starts and (i, True) once it is in; stops early when cancelled (the
    record is then incomplete)."""
    messages = ([{"role": "system", "content": rec["system"]}] if rec.get("system", "").strip() else []) + \
        [{"role": "user", "content": rec["prompt"]}]
    for i, a in enumerate(rec["answers"]):
        if cancel is not None and cancel.is_set():
            return
        yield i, False
        p = replace(params[a["mode"]], seed=rec["seed"])
        a["params"] = p.as_dict()
        a |= generate_answer(engine, messages, p, cancel)
        if cancel is not None and cancel.is_set() and a["stats"].get("finish_reason") == "cancelled":
            return
        if rec.get("task") and not a["error"]:
            a["passed"] = grade(a["text"], rec["task"])
        yield i, True


def answer_all(engine, rec: dict, params: dict[str, DecodeParams], *, cancel: threading.Event | None = None,
               on_answer: Callable[[int], None] | None = None) -> bool:
    """iter_answers to the end; True when every answer is in (False: cancelled before the last finished)."""
    done = 0
    for i, finished in iter_answers(engine, rec, params, cancel=cancel):
        if finished:
            done = i + 1
            if on_answer is not None:
                on_answer(i)
    return done == len(rec["answers"])


def iter_run(engine, store: ResultStore, run: dict, params: dict[str, DecodeParams], *,
             cancel: threading.Event, rng: random.Random | None = None) -> Iterator[dict]:
    """Answer the run's remaining items (one comparison each, seed = run seed + item index), saving each
    comparison and the run after every item, so a stop or a crash loses at most the item in flight.
    Yields each saved comparison; the run's state says how it ended (done, stopped, failed)."""
    run["state"], run["error"] = "running", None
    store.save_run(run)
    try:
        for i, item in enumerate(run["items"]):
            if i in run["done"]:
                continue
            if cancel.is_set():
                break
            task = item if isinstance(item, dict) else None
            rec = new_comparison(prompt=prompt_text(item), modes=run["modes"],
                                 seed=run["seed"] + i, settings=run["settings"], models=run["models"],
                                 system=run.get("system", ""), kind="set", run_id=run["id"], item=i, task=task,
                                 rng=rng)
            if not answer_all(engine, rec, params, cancel=cancel):
                break  # the item in flight is dropped; a resume answers it again
            store.save(rec)
            run["done"].append(i)
            run["comparisons"].append(rec["id"])
            store.save_run(run)
            yield rec
        run["state"] = "done" if len(run["done"]) == len(run["items"]) else "stopped"
    except Exception as e:  # the background thread must leave a readable state behind
        log.exception("prompt-set run %s failed", run["id"])
        run["state"], run["error"] = "failed", f"{type(e).__name__}: {e}"
    store.save_run(run)


def run_items(engine, store: ResultStore, run: dict, params: dict[str, DecodeParams], *,
              cancel: threading.Event, rng: random.Random | None = None,
              on_item: Callable[[dict, dict], None] | None = None) -> dict:
    """iter_run to the end, calling on_item(run, comparison) after each saved item; returns the run."""
    for rec in iter_run(engine, store, run, params, cancel=cancel, rng=rng):
        if on_item is not None:
            on_item(run, rec)
    return run


def open_run(store: ResultStore, run_id: str) -> tuple[dict, dict[str, DecodeParams]]:
    """A stopped run read back for a resume, with the settings it started with (not today's panel)."""
    run = store.load_run(run_id)
    if run["state"] == "done":
        raise ResultsError(f"run {run_id} is complete")
    return run, params_of_run(run)


def prepare(store: ResultStore, *, resume: str | None, modes: str, suite: str, prompts: int,
            base: DecodeParams, keep: tuple[str, ...] = ()) -> tuple[dict | None, dict[str, DecodeParams], list]:
    """Before any model loads: (the run to resume or None, params per mode label, a new run's items).
    `modes` is a bench mode list ("greedy,dsbd:beams=2"); bad settings fail here. `keep`: bench.parse_mode's."""
    if resume:
        run, params = open_run(store, resume)
        return run, params, run["items"]
    from app.compare.bench import parse_mode, split_modes

    params = dict(parse_mode(m, base, keep=keep) for m in split_modes(modes))
    if len(params) < 2:
        raise ConfigError(f"--modes needs at least two modes to compare, got {modes!r}")
    return None, params, load_prompt_source(suite)[: prompts or None]


def start(engine, store: ResultStore, run: dict | None, params: dict[str, DecodeParams], *, items: list,
          source: str, settings: dict, seed: int | None = None, system: str = "") -> tuple[dict, dict]:
    """With the models loaded: check every mode can run here, then a new run (run None) or the resumed one,
    which must have been made with these models."""
    params = {m: engine.check_params(p) for m, p in params.items()}
    if run is None:
        run = new_run(source=source, items=items, params=params, settings=settings, models=engine.describe(),
                      seed=seed, system=system)
    elif run["models"] != engine.describe():
        raise ResultsError(f"run {run['id']} was made with {run['models']}; load the same models to resume it")
    return run, params


def stop(store: ResultStore, run: dict) -> None:
    """Mark a run interrupted from outside (Ctrl-C) as stopped: resumable."""
    run["state"] = "stopped"
    store.save_run(run)


def summary(store: ResultStore, run: dict) -> tuple[dict, list[dict]]:
    """({run, state, done, prompts, waiting_for_votes, summary per mode}, the run's comparisons)."""
    records = [store.load(i) for i in run["comparisons"]]
    return {"run": run["id"], "state": run["state"], "done": len(run["done"]), "prompts": len(run["items"]),
            "waiting_for_votes": sum(needs_vote(r) for r in records), "summary": mode_summary(records)}, records


class SetRunner:
    """One prompt-set run at a time in a background thread (the engine's lock still serialises every
    generation, so chats interleave between the run's answers). `stop()` ends it after the answer in flight."""

    def __init__(self, engine, store: ResultStore) -> None:
        self.engine, self.store = engine, store
        self.run: dict | None = None
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, run: dict, params: dict[str, DecodeParams], *, rng: random.Random | None = None,
              on_item: Callable[[dict, dict], None] | None = None) -> threading.Thread:
        if self.running:
            raise ResultsError("a prompt-set run is already going: stop it first")
        for p in params.values():
            self.engine.check_params(p)  # a mode that cannot run fails here, not in the thread
        self.run, self.cancel = run, threading.Event()
        self.thread = threading.Thread(target=run_items, args=(self.engine, self.store, run, params),
                                       kwargs={"cancel": self.cancel, "rng": rng, "on_item": on_item},
                                       name=f"prompt-set-{run['id']}", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        self.cancel.set()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def progress(self) -> tuple[int, int, str]:
        """(items done, items, state) of the current or last run."""
        if self.run is None:
            return 0, 0, "idle"
        state = self.run["state"]
        if state == "running" and self.cancel.is_set():
            state = "stopping"
        return len(self.run["done"]), len(self.run["items"]), state
