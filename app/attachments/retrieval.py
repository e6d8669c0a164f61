"""Fitting files into the context: whole when they fit the room the rest of the prompt and the answer leave, else
the passages a question needs (BM25 over line chunks); the budget shown for it."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from app.attachments.reading import Attachment
from app.attachments.rendering import RETRIEVAL_NOTE, Part, render, render_part

CHUNK_LINES = 30  # retrieval passages: this many lines, or fewer when they would exceed CHUNK_CHARS
CHUNK_CHARS = 1600
ANSWER_MARGIN = 16  # tokens kept free beyond the answer and the forest (template tokens of the next turn)


def estimate_tokens(text: str) -> int:
    """Without a tokenizer: about 4 characters a token (English and code with BPE vocabularies)."""
    return max(1, math.ceil(len(text) / 4)) if text else 0


@dataclass(frozen=True)
class Budget:
    """The context the next answer needs, in tokens: files + history (system prompt, earlier turns, the new
    text) + answer (+ the decoder's forest) against the window."""

    files: int
    history: int
    answer: int
    n_ctx: int

    @property
    def total(self) -> int:
        return self.files + self.history + self.answer

    @property
    def fits(self) -> bool:
        return self.total <= self.n_ctx

    def line(self) -> str:
        verdict = "fits" if self.fits else ("files too large: the relevant passages will be retrieved"
                                            if self.history + self.answer < self.n_ctx
                                            else "does not fit even without the files")
        return (f"Context: files {self.files:,} + history {self.history:,} + answer {self.answer:,} = "
                f"{self.total:,} of {self.n_ctx:,} tokens · {verdict}")


@dataclass(frozen=True)
class ContextPlan:
    """What goes into the prompt for one message's files: all of them whole, or retrieved parts."""

    parts: list[Part] | None  # None: every file whole
    tokens: int  # of the rendered files
    chunks: int = 0  # passages the files were split into (retrieval)

    @property
    def retrieved(self) -> bool:
        return self.parts is not None

    def as_dict(self) -> dict:
        return {"parts": None if self.parts is None else [asdict(p) for p in self.parts], "tokens": self.tokens,
                "chunks": self.chunks}

    @classmethod
    def from_dict(cls, d: dict | None) -> "ContextPlan | None":
        if not isinstance(d, dict):
            return None
        parts = d.get("parts")
        try:
            return cls(None if parts is None else [Part(**p) for p in parts], int(d.get("tokens", 0)),
                       int(d.get("chunks", 0)))
        except (TypeError, ValueError):  # an edited chat file: the files go in whole
            return None

    def describe(self, files: Sequence[Attachment]) -> str:
        if not self.retrieved:
            return f"{len(files)} file(s) whole, {self.tokens:,} tokens"
        cites = ", ".join(p.cite() for p in self.parts) or "nothing"
        return f"retrieved {len(self.parts)} of {self.chunks} passages ({self.tokens:,} tokens): {cites}"


def answer_reserve(params) -> int:
    """Tokens an answer with these DecodeParams needs beyond the prompt: the answer, the decoder's forest (auto:
    the largest any mode it may pick would need) and a small margin."""
    from app.engine.planning import tree_tokens  # lazy: reading files needs no engine

    return params.max_new_tokens + tree_tokens(params) + ANSWER_MARGIN


def fit(question: str, files: Sequence[Attachment], *, rest: int, reserve: int, n_ctx: int,
        count: Callable[[str], int] = estimate_tokens) -> tuple[ContextPlan, Budget]:
    """The files' plan for one message and the budget shown for it: `rest` = tokens of the prompt without the
    files (template, system prompt, earlier turns, the new text), `reserve` = answer_reserve(params)."""
    room = n_ctx - rest - reserve
    plan = plan_context(question, files, max(room, 0), count)
    whole = plan.tokens if not plan.retrieved else count(render("", files))
    return plan, Budget(files=whole, history=rest, answer=reserve, n_ctx=n_ctx)


def chunks(a: Attachment, lines: int = CHUNK_LINES, chars: int = CHUNK_CHARS) -> list[Part]:
    """Consecutive line ranges of at most `lines` lines and about `chars` characters (a longer line stands alone)."""
    out, start, size = [], 1, 0
    all_lines = a.lines
    for i, line in enumerate(all_lines, 1):
        if i > start and (i - start >= lines or size + len(line) > chars):
            out.append(Part(a.name, start, i - 1))
            start, size = i, 0
        size += len(line) + 1
    if all_lines:
        out.append(Part(a.name, start, len(all_lines)))
    return out


def terms(text: str) -> list[str]:
    """Lower-case words and numbers; identifiers also split at case changes and underscores."""
    out = []
    for w in re.findall(r"\w+", text):
        low = w.lower()
        out.append(low)
        pieces = [p.lower() for p in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", w)]
        if len(pieces) > 1:
            out += pieces
    return out


class BM25:
    """Okapi BM25 over documents of terms (k1, b as in Robertson and Zaragoza's usual defaults)."""

    def __init__(self, docs: Sequence[Sequence[str]], k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs]
        self.len = [len(d) for d in docs]
        self.avg = (sum(self.len) / len(docs)) if docs else 0.0
        df: Counter = Counter()
        for c in self.tf:
            df.update(c.keys())
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: Sequence[str]) -> list[float]:
        q = [t for t in set(query) if t in self.idf]
        out = []
        for tf, n in zip(self.tf, self.len):
            norm = self.k1 * (1 - self.b + self.b * n / (self.avg or 1))
            out.append(sum(self.idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in q if t in tf))
        return out


def plan_context(question: str, files: Sequence[Attachment], room: int,
                 count: Callable[[str], int] = estimate_tokens) -> ContextPlan:
    """Every file whole when they fit in `room` tokens; else the best BM25 passages for the question (and the
    files' names) that fit, in file and line order, adjacent ones merged. The first passage of each file goes
    in when nothing scores (a question with no word of the files)."""
    whole = count(render("", files))
    if whole <= room:
        return ContextPlan(None, whole)
    passages = [p for a in files for p in chunks(a)]
    by_name = {a.name: a for a in files}
    docs = [terms(p.name + "\n" + "\n".join(by_name[p.name].lines[p.start - 1:p.end])) for p in passages]
    scores = BM25(docs).scores(terms(question))
    order = sorted(range(len(passages)), key=lambda i: (-scores[i], i))
    if not any(s > 0 for s in scores):
        firsts = {}
        for i, p in enumerate(passages):
            firsts.setdefault(p.name, i)
        order = list(firsts.values()) + [i for i in range(len(passages)) if i not in firsts.values()]
    chosen: list[int] = []
    used = count(RETRIEVAL_NOTE)
    for i in order:
        cost = count(render_part(by_name[passages[i].name], passages[i])) + 2
        if used + cost > room:
            continue
        chosen.append(i)
        used += cost
    parts = _merge([passages[i] for i in sorted(chosen)])
    return ContextPlan(parts, count(render("", files, parts)) if parts else used, len(passages))


def _merge(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for p in parts:
        if out and out[-1].name == p.name and out[-1].end + 1 == p.start:
            out[-1] = Part(p.name, out[-1].start, p.end)
        else:
            out.append(p)
    return out
