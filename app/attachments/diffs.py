"""Answers that rewrite an attached file: the answer's fenced block that rewrites it, as a unified diff and the
patched file."""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Sequence

from app.attachments.reading import Attachment

DIFF_MIN_RATIO = 0.5  # a fenced block rewrites a file when its lines match at least this share of the file's


_BLOCK = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)(?:\n)?^(?P=fence)[ \t]*$",
                    re.DOTALL | re.MULTILINE)


def code_blocks(answer: str) -> list[tuple[str, str]]:
    """(info string, body) of every closed fenced block of a Markdown answer."""
    return [(m.group("info").strip(), m.group("body")) for m in _BLOCK.finditer(answer)]


@dataclass(frozen=True)
class FileDiff:
    """An answer's block that rewrites an attached file: the unified diff and the patched file's text."""

    name: str
    patched: str
    diff: str
    ratio: float  # difflib's similarity of the block's lines to the file's
    added: int = 0
    removed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _similarity(a: list[str], b: list[str]) -> float:
    m = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if m.real_quick_ratio() < DIFF_MIN_RATIO or m.quick_ratio() < DIFF_MIN_RATIO:
        return 0.0
    return m.ratio()


def diffs(answer: str, files: Sequence[Attachment], min_ratio: float = DIFF_MIN_RATIO) -> list[FileDiff]:
    """For each attached file, the answer's fenced block that rewrites it best (similarity >= min_ratio, the
    block not equal to the file), as a unified diff and the patched file. A block names its file when its info
    string or first line mentions it; otherwise the likeliest file by similarity."""
    out = []
    blocks = code_blocks(answer)
    taken: set[int] = set()
    for a in files:
        old = a.text.rstrip("\n").split("\n")
        best, best_i = 0.0, None
        for i, (info, body) in enumerate(blocks):
            if i in taken:
                continue
            new = body.rstrip("\n").split("\n")
            r = _similarity(old, new)
            named = a.name in info or (new and a.name in new[0])
            if named:
                r = max(r, min_ratio)
            if r > best:
                best, best_i = r, i
        if best_i is None or best < min_ratio:
            continue
        body = blocks[best_i][1]
        patched = body.rstrip("\n") + ("\n" if a.text.endswith("\n") else "")
        if patched == a.text:
            continue
        taken.add(best_i)
        lines = list(difflib.unified_diff(a.text.splitlines(keepends=True), patched.splitlines(keepends=True),
                                          fromfile=f"a/{a.name}", tofile=f"b/{a.name}"))
        text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
        added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
        out.append(FileDiff(a.name, patched, text, round(best, 3), added, removed))
    return out
