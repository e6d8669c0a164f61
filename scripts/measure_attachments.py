"""Attachment costs: a ~100 KB text file read, tokenized and indexed (the prompt's n-gram index, what every DSBD
answer builds over its prompt, beside the plain table of every n-gram it replaced, and the cross-chat index), a
lookup in each, retrieval over it, and the diff of a rewritten file. Medians of --runs, and whether the indexes
meet their speed goals (GOALS). Writes JSON (--json) and prints it.

    python scripts/measure_attachments.py --preset tiny --json docs/measurements/attachments.json
"""

from __future__ import annotations

import platform
import random
import statistics
import subprocess
import time

from _common import ROOT_DIR, emit, machine, pair_arguments

# Seconds a 100 KB attachment may take to index: the prompt's index before an answer's first token, the
# cross-chat index once per chat after an answer.
GOALS = {"match_index_s": 0.2, "corpus_index_s": 1.0}


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def lookups_s(cls, ids, tails, repeats: int) -> float:
    """Median seconds of proposing every tail from a fresh index (as each answer's builder starts cold)."""
    times = []
    for _ in range(repeats):
        idx = cls()
        idx.add(ids)
        t0 = time.perf_counter()
        for t in tails:
            idx.propose(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = pair_arguments(runs=5, max_tokens=0)
    ap.add_argument("--kb", type=int, default=100)
    a = ap.parse_args()
    from app import attachments as att
    from app.decoding.lookups import CorpusIndex, MatchIndex
    from backends import llamacpp
    from backends.modelfiles.resolution import resolve
    from backends.registry import ModelSpec
    from test_match_index import PlainIndex  # the reference the fast index is held equal to

    # ~100 KB of the project's own prose and code (what users attach: documents and source files)
    text = ""
    for p in ["README.md", *sorted(str(x.relative_to(ROOT_DIR)) for x in (ROOT_DIR / "app").rglob("*.py"))]:
        text += (ROOT_DIR / p).read_text(encoding="utf-8")
        if len(text.encode()) >= a.kb * 1024:
            break
    data = text.encode()[: a.kb * 1024].decode("utf-8", "ignore").encode()
    model = llamacpp.load(resolve(a.preset, role="target").path, ModelSpec(source=a.preset, n_threads=a.threads))
    tok = model.tokenizer
    out: dict = {"preset": a.preset, "bytes": len(data), "repeats": a.runs, "cpu": cpu_name()}
    out["read_s"], f = timed(lambda: att.from_bytes("doc.md", data), a.runs)
    out["tokenize_s"], ids = timed(lambda: tok.encode(att.render_whole(f)), a.runs)
    out["tokens"] = len(ids)
    out["match_index_s"], _ = timed(lambda: MatchIndex().add(ids), a.runs)
    out["match_index_plain_s"], _ = timed(lambda: PlainIndex().add(ids), a.runs)
    rng = random.Random(0)  # lookups as the builder makes them: tails of the text, half with a changed token
    tails = [list(ids[e - 8:e]) for e in (rng.randrange(8, len(ids)) for _ in range(5000))]
    for t in tails[::2]:
        t[rng.randrange(8)] = rng.randrange(tok.n_vocab)
    for name, cls in (("match_propose_us", MatchIndex), ("match_propose_plain_us", PlainIndex)):
        out[name] = 1e6 * lookups_s(cls, ids, tails, a.runs) / len(tails)
    out["corpus_index_s"], _ = timed(lambda: CorpusIndex().add("doc", ids), a.runs)
    out["goals_met"] = {name: out[name] < limit for name, limit in GOALS.items()}
    out["retrieval_s"], plan = timed(lambda: att.plan_context("How are attachments rendered into the prompt?",
                                                              [f], 3000, lambda s: len(tok.encode(s))), a.runs)
    out["retrieval_parts"] = [p.cite() for p in plan.parts]
    rewritten = f.text.replace("def ", "def  ", 20)
    out["diff_s"], d = timed(lambda: att.diffs(att.fenced(rewritten), [f]), a.runs)
    out["diff_changed_lines"] = d[0].added if d else 0
    model.close()
    emit(out | {"machine": machine()}, a.json)


if __name__ == "__main__":
    main()
