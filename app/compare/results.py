"""Saved comparisons of decoding modes: the store, blind votes, tallies with intervals, exports, prompt sets.

No gradio: the Compare tab (app/serve/ui/compare.py) and `dsbd-chat compare` both sit on top of this module.
A comparison is one prompt answered by several modes with the same seed, shown under neutral labels
(A, B, ...) in a random order; the vote names a label (or "tie" / "both-bad") and only then the modes
are shown. Each comparison is one JSON file beside the chat history, written atomically.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import random
import secrets
import statistics
import threading
import time
from dataclasses import replace
from itertools import combinations
from pathlib import Path
from typing import Callable, Iterable

from backends.base import BackendError

from app.config import ConfigError, DecodeParams

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
LABELS = "ABCDEFGHIJKLMNOP"
TIE, BOTH_BAD = "tie", "both-bad"
Z95 = 1.959963984540054  # two-sided 95% normal quantile


def _history():
    from app import storage

    return storage


class ResultsError(ValueError):
    """A comparison or run cannot be read, voted or exported as asked; the message says why."""


# ---------------------------------------------------------------- one comparison


def new_comparison(*, prompt: str, modes: list[str], seed: int, settings: dict, models: dict, system: str = "",
                   kind: str = "blind", run_id: str | None = None, item: int | None = None,
                   task: dict | None = None, rng: random.Random | None = None) -> dict:
    """A fresh comparison with the modes in a random order under labels A, B, ... (not yet answered)."""
    if len(modes) > len(LABELS):
        raise ConfigError(f"at most {len(LABELS)} modes in one comparison, got {len(modes)}")
    order = list(modes)
    (rng or random.Random()).shuffle(order)  # the blind order: label i -> order[i]
    now = time.time()
    return {"version": FORMAT_VERSION, "id": _history().new_id(), "created": now, "updated": now, "kind": kind,
            "run_id": run_id, "item": item, "prompt": prompt, "system": system, "seed": seed,
            "seed_policy": "same seed for every mode", "settings": dict(settings), "models": dict(models),
            "task": task, "answers": [{"label": LABELS[i], "mode": m, "params": {}, "text": "", "stats": {},
                                       "error": None, "passed": None} for i, m in enumerate(order)],
            "vote": None}


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


def answer_all(engine, rec: dict, params: dict[str, DecodeParams], *, cancel: threading.Event | None = None,
               on_answer: Callable[[int], None] | None = None) -> bool:
    """Fill rec's answers in label order, one generation at a time, all with rec's seed; grade code tasks.
    Returns False when cancelled before the last answer finished (the record is then incomplete)."""
    messages = ([{"role": "system", "content": rec["system"]}] if rec.get("system", "").strip() else []) + \
        [{"role": "user", "content": rec["prompt"]}]
    for i, a in enumerate(rec["answers"]):
        if cancel is not None and cancel.is_set():
            return False
        p = replace(params[a["mode"]], seed=rec["seed"])
        a["params"] = p.as_dict()
        a |= generate_answer(engine, messages, p, cancel)
        if cancel is not None and cancel.is_set() and a["stats"].get("finish_reason") == "cancelled":
            return False
        if rec.get("task") and not a["error"]:
            from app.compare.bench import grade

            a["passed"] = grade(a["text"], rec["task"])
        if on_answer is not None:
            on_answer(i)
    return True


def choices_of(rec: dict) -> list[str]:
    return [a["label"] for a in rec["answers"]] + [TIE, BOTH_BAD]


def apply_vote(rec: dict, choice: str) -> dict:
    """Record the vote on `rec` (a label, 'tie' or 'both-bad'); returns rec."""
    choice = {"both bad": BOTH_BAD}.get(choice, choice)
    if choice not in choices_of(rec):
        raise ResultsError(f"vote must be one of {choices_of(rec)}, got {choice!r}")
    winner = next((a["mode"] for a in rec["answers"] if a["label"] == choice), None)
    rec["vote"] = {"choice": choice, "winner": winner, "at": time.time()}
    return rec


def needs_vote(rec: dict) -> bool:
    """A complete blind comparison nobody has voted on yet (graded code tasks don't wait for votes)."""
    return rec.get("vote") is None and rec.get("kind") in ("blind", "set") and not rec.get("task") \
        and len(rec.get("answers", ())) >= 2


def pair_name(rec: dict) -> str:
    """The model pair a comparison ran on: 'target + draft' (or 'target, no draft')."""
    m = rec.get("models") or {}
    return f"{m.get('target', '?')} + {m['draft']}" if m.get("draft") else f"{m.get('target', '?')}, no draft"


def _validate(rec: object, rec_id: str) -> dict:
    if not isinstance(rec, dict) or rec.get("id") != rec_id:
        raise ValueError("not a comparison for this file name")
    answers = rec.get("answers")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and isinstance(a.get("mode"), str)
                                                and isinstance(a.get("label"), str) for a in answers):
        raise ValueError("answers must be a list of {label, mode, ...}")
    if not isinstance(rec.get("prompt"), str):
        raise ValueError("prompt must be text")
    return rec


# ---------------------------------------------------------------- the store


class ResultStore:
    """Comparisons as `<root>/compare/<id>.json`, prompt-set runs as `<root>/compare/runs/<id>.json`,
    beside the chat history (`<root>/chats`); exports and reports in `<root>/exports`."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = _history().resolve_data_dir(root).resolve()
        self.dir = self.root / "compare"
        self.runs_dir = self.dir / "runs"
        self.exports_dir = self.root / "exports"
        self.corrupt_dir = self.root / "corrupt"
        for d in (self.runs_dir, self.exports_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.notices: list[str] = []  # files moved aside while listing

    def _path(self, folder: Path, rec_id: str) -> Path:
        path = (folder / f"{_history().check_id(rec_id)}.json").resolve()
        if path.parent != folder:
            raise ResultsError(f"id {rec_id!r} escapes the results folder")
        return path

    def save(self, rec: dict) -> None:
        rec["updated"] = time.time()
        _history().atomic_write(self._path(self.dir, rec["id"]), json.dumps(rec, ensure_ascii=False, indent=1))

    def load(self, rec_id: str) -> dict:
        path = self._path(self.dir, rec_id)
        try:
            return _validate(json.loads(path.read_text(encoding="utf-8")), rec_id)
        except FileNotFoundError:
            raise ResultsError(f"comparison {rec_id} does not exist") from None
        except (ValueError, UnicodeDecodeError) as e:
            self._move_aside(path, e)
            raise ResultsError(f"comparison file {path.name} is unreadable ({e}); moved it aside") from None

    def _move_aside(self, path: Path, why) -> None:
        self.corrupt_dir.mkdir(parents=True, exist_ok=True)
        dest = self.corrupt_dir / f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}.json"
        try:
            os.replace(path, dest)
            self.notices.append(f"{path.name} was unreadable ({why}); moved to {dest}")
        except OSError:
            pass

    def list(self) -> list[dict]:
        """Every readable comparison, oldest first (unreadable files are moved aside with a notice)."""
        out = []
        for path in self.dir.glob("*.json"):
            try:
                out.append(self.load(path.stem))
            except ValueError:  # unreadable (moved aside) or not one of ours (a stray file name)
                continue
        out.sort(key=lambda r: (r.get("created", 0), r["id"]))
        return out

    def vote(self, rec_id: str, choice: str) -> dict:
        rec = apply_vote(self.load(rec_id), choice)
        self.save(rec)
        return rec

    def pending(self) -> list[dict]:
        return [r for r in self.list() if needs_vote(r)]

    def import_records(self, records: Iterable[dict]) -> int:
        """Save records read from an export (same ids: the imported copy wins). Returns how many."""
        n = 0
        for rec in records:
            _validate(rec, rec.get("id"))
            _history().check_id(rec["id"])
            _history().atomic_write(self._path(self.dir, rec["id"]), json.dumps(rec, ensure_ascii=False, indent=1))
            n += 1
        return n

    # -- prompt-set runs
    def save_run(self, run: dict) -> None:
        run["updated"] = time.time()
        _history().atomic_write(self._path(self.runs_dir, run["id"]), json.dumps(run, ensure_ascii=False, indent=1))

    def load_run(self, run_id: str) -> dict:
        try:
            return json.loads(self._path(self.runs_dir, run_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ResultsError(f"prompt-set run {run_id} does not exist") from None

    def list_runs(self) -> list[dict]:
        runs = []
        for path in self.runs_dir.glob("*.json"):
            try:
                runs.append(self.load_run(path.stem))
            except (ResultsError, ValueError):
                continue
        runs.sort(key=lambda r: r.get("created", 0), reverse=True)
        return runs

    def export(self, records: list[dict], fmt: str, *, name: str = "comparisons") -> Path:
        if fmt not in ("json", "csv"):
            raise ResultsError(f"export format must be 'json' or 'csv', got {fmt!r}")
        path = self.exports_dir / f"{name}.{fmt}"
        _history().atomic_write(path, to_json(records) if fmt == "json" else to_csv(records))
        return path


# ---------------------------------------------------------------- tallies and intervals


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (95% by default); (0, 1) when n = 0.
    Chosen over the normal (Wald) interval because it stays inside [0, 1] and behaves at k = 0 or n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def mean_ci(xs: list[float], z: float = Z95) -> tuple[float | None, float | None]:
    """Mean and the half-width of its normal-approximation 95% interval (None with fewer than 2 values)."""
    if not xs:
        return None, None
    if len(xs) < 2:
        return statistics.mean(xs), None
    return statistics.mean(xs), z * statistics.stdev(xs) / math.sqrt(len(xs))


def _mode_order(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for a in sorted(r["answers"], key=lambda a: a["mode"]):
            seen.setdefault(a["mode"], None)
    return sorted(seen)


def pair_tallies(records: list[dict]) -> dict[tuple[str, str], dict]:
    """Per unordered mode pair (a, b), a < b: wins of a, ties, losses of a over the voted comparisons holding
    both. 'tie' and 'both-bad' count as ties (both_bad says how many were the latter); when a third mode won
    a comparison, the pair's own order is unknown and that comparison is not counted for it.
    win_rate = wins / (wins + losses) with its Wilson 95% interval (ties left out)."""
    out: dict[tuple[str, str], dict] = {}
    for r in records:
        vote = r.get("vote")
        if not vote:
            continue
        modes = sorted({a["mode"] for a in r["answers"]})
        for a, b in combinations(modes, 2):
            t = out.setdefault((a, b), {"wins": 0, "ties": 0, "losses": 0, "both_bad": 0})
            if vote["choice"] in (TIE, BOTH_BAD):
                t["ties"] += 1
                t["both_bad"] += vote["choice"] == BOTH_BAD
            elif vote["winner"] == a:
                t["wins"] += 1
            elif vote["winner"] == b:
                t["losses"] += 1
    for t in out.values():
        n = t["wins"] + t["losses"]
        t["votes"] = n + t["ties"]
        t["win_rate"] = t["wins"] / n if n else None
        t["win_ci"] = wilson(t["wins"], n)
    return dict(sorted(out.items()))


def mode_summary(records: list[dict]) -> dict[str, dict]:
    """Per mode over the answers without an error: runs, median tok/s (with quartiles), mean log-prob with
    its 95% interval, pass rate (graded answers, Wilson interval), blind win rate = comparisons it won /
    voted comparisons it took part in (Wilson interval; a tie or both-bad is not a win)."""
    out: dict[str, dict] = {}
    for mode in _mode_order(records):
        ans = [(r, a) for r in records for a in r["answers"] if a["mode"] == mode]
        ok = [a for _, a in ans if not a.get("error") and a.get("stats", {}).get("tokens_per_s") is not None]
        tps = sorted(a["stats"]["tokens_per_s"] for a in ok)
        lp = [a["stats"]["mean_target_logprob"] for a in ok if a["stats"].get("mean_target_logprob") is not None]
        graded = [a["passed"] for _, a in ans if a.get("passed") is not None]
        voted = [r for r, _ in ans if r.get("vote")]
        won = sum(r["vote"]["winner"] == mode for r in voted)
        q = statistics.quantiles(tps, n=4, method="inclusive") if len(tps) > 1 else [tps[0]] * 3 if tps else None
        lp_mean, lp_half = mean_ci(lp)
        out[mode] = {
            "answers": len(ans), "errors": len(ans) - len(ok),
            "tokens_per_s_median": statistics.median(tps) if tps else None,
            "tokens_per_s_q1": q[0] if q else None, "tokens_per_s_q3": q[2] if q else None,
            "mean_target_logprob": lp_mean, "mean_target_logprob_ci": lp_half,
            "graded": len(graded), "passed": sum(graded),
            "pass_rate": sum(graded) / len(graded) if graded else None,
            "pass_ci": wilson(sum(graded), len(graded)) if graded else None,
            "votes": len(voted), "won": won,
            "win_rate": won / len(voted) if voted else None,
            "win_ci": wilson(won, len(voted)) if voted else None,
        }
    return out


def bench_runs(records: list[dict]) -> list[dict]:
    """Answers as app.compare.bench runs ({mode, stats, passed}), for bench.summarize (acceptance, widths)."""
    runs = []
    for r in records:
        for a in r["answers"]:
            st = a.get("stats") or {}
            if a.get("error") or "acceptance_by_depth" not in st or "tokens_per_s" not in st:
                continue
            runs.append({"mode": a["mode"], "stats": st} | ({"passed": a["passed"]} if a.get("passed") is not None
                                                             else {}))
    return runs


def by_pair(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(pair_name(r), []).append(r)
    return out


# ---------------------------------------------------------------- export / import

CSV_FIELDS = ("id", "created", "updated", "kind", "run_id", "item", "prompt", "system", "seed", "seed_policy",
              "label", "mode", "text", "error", "passed", "tokens_per_s", "mean_target_logprob", "new_tokens",
              "vote", "winner", "vote_json", "settings_json", "models_json", "task_json", "params_json",
              "stats_json")


def to_json(records: list[dict]) -> str:
    return json.dumps({"version": FORMAT_VERSION, "comparisons": records}, ensure_ascii=False, indent=1)


def _j(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def to_csv(records: list[dict]) -> str:
    """One row per answer (a comparison spans as many rows as it has answers, in label order). Readable
    columns first; the *_json columns carry the nested objects so `from_csv` restores every field."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in records:
        vote = r.get("vote")
        for a in r["answers"]:
            st = a.get("stats") or {}
            w.writerow({"id": r["id"], "created": repr(r.get("created")), "updated": repr(r.get("updated")),
                        "kind": r.get("kind"), "run_id": r.get("run_id") or "", "item": _j(r.get("item")),
                        "prompt": r["prompt"], "system": r.get("system", ""), "seed": _j(r.get("seed")),
                        "seed_policy": r.get("seed_policy", ""), "label": a["label"], "mode": a["mode"],
                        "text": a.get("text", ""), "error": a.get("error") or "", "passed": _j(a.get("passed")),
                        "tokens_per_s": st.get("tokens_per_s", ""),
                        "mean_target_logprob": st.get("mean_target_logprob", ""),
                        "new_tokens": st.get("new_tokens", ""),
                        "vote": vote["choice"] if vote else "", "winner": (vote or {}).get("winner") or "",
                        "vote_json": _j(vote), "settings_json": _j(r.get("settings", {})),
                        "models_json": _j(r.get("models", {})), "task_json": _j(r.get("task")),
                        "params_json": _j(a.get("params", {})), "stats_json": _j(st)})
    return buf.getvalue()


def from_csv(text: str) -> list[dict]:
    """Inverse of to_csv."""
    out: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text)):
        rec = out.get(row["id"])
        if rec is None:
            rec = out[row["id"]] = {
                "version": FORMAT_VERSION, "id": row["id"], "created": float(row["created"]),
                "updated": float(row["updated"]), "kind": row["kind"], "run_id": row["run_id"] or None,
                "item": json.loads(row["item"]), "prompt": row["prompt"], "system": row["system"],
                "seed": json.loads(row["seed"]), "seed_policy": row["seed_policy"],
                "settings": json.loads(row["settings_json"]), "models": json.loads(row["models_json"]),
                "task": json.loads(row["task_json"]), "answers": [], "vote": json.loads(row["vote_json"])}
        rec["answers"].append({"label": row["label"], "mode": row["mode"], "params": json.loads(row["params_json"]),
                               "text": row["text"], "stats": json.loads(row["stats_json"]),
                               "error": row["error"] or None, "passed": json.loads(row["passed"])})
    return list(out.values())


def read_export(path: str | os.PathLike) -> list[dict]:
    """Comparisons from a JSON or CSV export."""
    path = Path(path)
    with path.open(encoding="utf-8", newline="") as f:  # newline="": a \r\n inside an answer stays as written
        text = f.read()
    if path.suffix.lower() == ".csv":
        return from_csv(text)
    data = json.loads(text)
    return data["comparisons"] if isinstance(data, dict) else data


# ---------------------------------------------------------------- prompt sets


def parse_prompts(text: str, *, name: str = "pasted") -> list:
    """Prompts from pasted text or a file's text: .jsonl = one JSON per line (a string, {"prompt": ...}, or a
    code task {"prompt", "tests", ...}); anything else = one prompt per non-empty line."""
    items: list = []
    if name.lower().endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name} line {n}: not JSON ({e.msg})") from None
            if isinstance(obj, str):
                items.append(obj)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                items.append(obj if obj.get("tests") else obj["prompt"])
            else:
                raise ConfigError(f"{name} line {n}: expected a string or an object with a 'prompt'")
    else:
        items = [line.strip() for line in text.splitlines() if line.strip()]
    if not items:
        raise ConfigError(f"no prompts in {name}")
    return items


def load_prompt_source(source: str) -> list:
    """A packaged suite name (chat, code), a bench .json file, or a .jsonl / .txt file of prompts."""
    from app.compare.bench import load_suite

    if source.endswith((".jsonl", ".txt")):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"prompt file {source} does not exist")
        return parse_prompts(path.read_text(encoding="utf-8"), name=path.name)
    return load_suite(source)


def new_run(*, source: str, items: list, params: dict[str, DecodeParams], settings: dict, models: dict,
            seed: int | None = None, system: str = "") -> dict:
    """A prompt-set run: every item answered by every mode (label -> params); resumable from `done`."""
    if not items:
        raise ConfigError("the prompt set is empty")
    if len(params) < 2:
        raise ConfigError("pick at least two modes to compare")
    now = time.time()
    return {"version": FORMAT_VERSION, "id": _history().new_id(), "created": now, "updated": now, "source": source,
            "items": items, "modes": list(params), "params": {m: p.as_dict() for m, p in params.items()},
            "settings": dict(settings), "models": dict(models), "system": system,
            "seed": secrets.randbelow(2**31) if seed is None else int(seed),
            "done": [], "comparisons": [], "state": "new", "error": None}


def params_of_run(run: dict) -> dict[str, DecodeParams]:
    """The per-mode settings a run started with (a resume uses these, not today's panel)."""
    return {m: DecodeParams(**(d | {"stop": tuple(d.get("stop") or ())})) for m, d in run["params"].items()}


def run_items(engine, store: ResultStore, run: dict, params: dict[str, DecodeParams], *,
              cancel: threading.Event, rng: random.Random | None = None,
              on_item: Callable[[dict, dict], None] | None = None) -> dict:
    """Answer the run's remaining items (one comparison each, seed = run seed + item index), saving each
    comparison and the run after every item, so a stop or a crash loses at most the item in flight."""
    run["state"], run["error"] = "running", None
    store.save_run(run)
    try:
        for i, item in enumerate(run["items"]):
            if i in run["done"]:
                continue
            if cancel.is_set():
                break
            task = item if isinstance(item, dict) else None
            rec = new_comparison(prompt=task["prompt"] if task else item, modes=run["modes"],
                                 seed=run["seed"] + i, settings=run["settings"], models=run["models"],
                                 system=run.get("system", ""), kind="set", run_id=run["id"], item=i, task=task,
                                 rng=rng)
            if not answer_all(engine, rec, params, cancel=cancel):
                break  # the item in flight is dropped; a resume answers it again
            store.save(rec)
            run["done"].append(i)
            run["comparisons"].append(rec["id"])
            store.save_run(run)
            if on_item is not None:
                on_item(run, rec)
        run["state"] = "done" if len(run["done"]) == len(run["items"]) else "stopped"
    except Exception as e:  # the background thread must leave a readable state behind
        log.exception("prompt-set run %s failed", run["id"])
        run["state"], run["error"] = "failed", f"{type(e).__name__}: {e}"
    store.save_run(run)
    return run


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
