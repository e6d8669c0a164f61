"""Saved comparisons and prompt-set runs as records: what one holds, blind votes, prompt sets.

A comparison is one prompt answered by several modes with the same seed, shown under neutral labels
(A, B, ...) in a random order; the vote names a label (or "tie" / "both-bad") and only then the modes
are shown. A run is a prompt set answered item by item (app.compare.runner), resumable from its `done` list.
"""

from __future__ import annotations

import json
import random
import secrets
import time
from pathlib import Path

from app.config import ConfigError, DecodeParams
from app.storage import new_id

FORMAT_VERSION = 1
LABELS = "ABCDEFGHIJKLMNOP"
TIE, BOTH_BAD = "tie", "both-bad"


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
    return {"version": FORMAT_VERSION, "id": new_id(), "created": now, "updated": now, "kind": kind,
            "run_id": run_id, "item": item, "prompt": prompt, "system": system, "seed": seed,
            "seed_policy": "same seed for every mode", "settings": dict(settings), "models": dict(models),
            "task": task, "answers": [{"label": LABELS[i], "mode": m, "params": {}, "text": "", "stats": {},
                                       "error": None, "passed": None} for i, m in enumerate(order)],
            "vote": None}


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
    return {"version": FORMAT_VERSION, "id": new_id(), "created": now, "updated": now, "source": source,
            "items": items, "modes": list(params), "params": {m: p.as_dict() for m, p in params.items()},
            "settings": dict(settings), "models": dict(models), "system": system,
            "seed": secrets.randbelow(2**31) if seed is None else int(seed),
            "done": [], "comparisons": [], "state": "new", "error": None}


def params_of_run(run: dict) -> dict[str, DecodeParams]:
    """The per-mode settings a run started with (a resume uses these, not today's panel)."""
    return {m: DecodeParams(**(d | {"stop": tuple(d.get("stop") or ())})) for m, d in run["params"].items()}
