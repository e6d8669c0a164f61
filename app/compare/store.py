"""Comparisons and prompt-set runs on disk, beside the chat history (one JSON file each, written atomically),
and their JSON / CSV exports."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Iterable

from app.compare.records import FORMAT_VERSION, ResultsError, _validate, apply_vote, needs_vote
from app.storage import DataFolder, atomic_write, check_id


class ResultStore(DataFolder):
    """Comparisons as `<root>/compare/<id>.json`, prompt-set runs as `<root>/compare/runs/<id>.json`,
    beside the chat history (`<root>/chats`); exports and reports in `<root>/exports`."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        super().__init__(root)
        self.dir = self.compare_dir
        for d in (self.runs_dir, self.exports_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.notices: list[str] = []  # files moved aside while listing

    def _path(self, folder: Path, rec_id: str) -> Path:
        return self.json_file(folder, rec_id, ResultsError, what="id", place="results")

    def _write(self, folder: Path, rec: dict) -> None:
        atomic_write(self._path(folder, rec["id"]), json.dumps(rec, ensure_ascii=False, indent=1))

    @staticmethod
    def _read_all(folder: Path, load) -> list[dict]:
        """Every file of `folder` that `load` reads (unreadable or stray ones are skipped)."""
        out = []
        for path in folder.glob("*.json"):
            try:
                out.append(load(path.stem))
            except ValueError:  # unreadable (moved aside) or not one of ours (a stray file name)
                continue
        return out

    def save(self, rec: dict) -> None:
        rec["updated"] = time.time()
        self._write(self.dir, rec)

    def load(self, rec_id: str) -> dict:
        path = self._path(self.dir, rec_id)
        try:
            return _validate(json.loads(path.read_text(encoding="utf-8")), rec_id)
        except FileNotFoundError:
            raise ResultsError(f"comparison {rec_id} does not exist") from None
        except (ValueError, UnicodeDecodeError) as e:
            if (dest := self.move_aside(path)) is not None:
                self.notices.append(f"{path.name} was unreadable ({e}); moved to {dest}")
            raise ResultsError(f"comparison file {path.name} is unreadable ({e}); moved it aside") from None

    def list(self) -> list[dict]:
        """Every readable comparison, oldest first (unreadable files are moved aside with a notice)."""
        out = self._read_all(self.dir, self.load)
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
            check_id(rec["id"])
            self._write(self.dir, rec)
            n += 1
        return n

    # -- prompt-set runs
    def save_run(self, run: dict) -> None:
        run["updated"] = time.time()
        self._write(self.runs_dir, run)

    def load_run(self, run_id: str) -> dict:
        try:
            return json.loads(self._path(self.runs_dir, run_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ResultsError(f"prompt-set run {run_id} does not exist") from None

    def list_runs(self) -> list[dict]:
        runs = self._read_all(self.runs_dir, self.load_run)  # ResultsError is a ValueError
        runs.sort(key=lambda r: r.get("created", 0), reverse=True)
        return runs

    def export(self, records: list[dict], fmt: str, *, name: str = "comparisons") -> Path:
        if fmt not in ("json", "csv"):
            raise ResultsError(f"export format must be 'json' or 'csv', got {fmt!r}")
        path = self.exports_dir / f"{name}.{fmt}"
        atomic_write(path, to_json(records) if fmt == "json" else to_csv(records))
        return path


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
