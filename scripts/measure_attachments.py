"""Attachment costs: a ~100 KB text file read, tokenized and indexed (the prompt's n-gram table, what every DSBD
answer builds over its prompt, and the cross-chat index), retrieval over it, and the diff of a rewritten file.
Medians of --repeats. Writes JSON (--json) and prints it.

    python scripts/measure_attachments.py --preset tiny --json docs/measurements/attachments.json
"""

from __future__ import annotations

import json
import statistics
import time

from _common import ROOT_DIR, machine, pair_arguments


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = pair_arguments(runs=5, max_tokens=0)
    ap.add_argument("--kb", type=int, default=100)
    a = ap.parse_args()
    from app import attachments as att
    from app.decoding.lookups import CorpusIndex, MatchIndex
    from backends import llamacpp
    from backends.registry import ModelSpec, resolve

    # ~100 KB of the project's own prose and code (what users attach: documents and source files)
    text = ""
    for p in ["README.md", *sorted(str(x.relative_to(ROOT_DIR)) for x in (ROOT_DIR / "app").rglob("*.py"))]:
        text += (ROOT_DIR / p).read_text(encoding="utf-8")
        if len(text.encode()) >= a.kb * 1024:
            break
    data = text.encode()[: a.kb * 1024].decode("utf-8", "ignore").encode()
    model = llamacpp.load(resolve(a.preset, role="target").path, ModelSpec(source=a.preset, n_threads=a.threads))
    tok = model.tokenizer
    out: dict = {"preset": a.preset, "bytes": len(data), "repeats": a.runs}
    out["read_s"], f = timed(lambda: att.from_bytes("doc.md", data), a.runs)
    out["tokenize_s"], ids = timed(lambda: tok.encode(att.render_whole(f)), a.runs)
    out["tokens"] = len(ids)
    out["match_index_s"], _ = timed(lambda: MatchIndex().add(ids), a.runs)
    out["corpus_index_s"], _ = timed(lambda: CorpusIndex().add("doc", ids), a.runs)
    out["retrieval_s"], plan = timed(lambda: att.plan_context("How are attachments rendered into the prompt?",
                                                              [f], 3000, lambda s: len(tok.encode(s))), a.runs)
    out["retrieval_parts"] = [p.cite() for p in plan.parts]
    rewritten = f.text.replace("def ", "def  ", 20)
    fence = "`" * 12  # longer than any fence inside the file
    out["diff_s"], d = timed(lambda: att.diffs(f"{fence}\n{rewritten}\n{fence}", [f]), a.runs)
    out["diff_changed_lines"] = d[0].added if d else 0
    model.close()
    text_out = json.dumps(out | {"machine": machine()}, indent=1)
    print(text_out)
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(text_out + "\n")


if __name__ == "__main__":
    main()
