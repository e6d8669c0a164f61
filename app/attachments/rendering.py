"""Rendering files into a user turn: a whole file under a header naming it, or passages with their line numbers,
each in a fence none of its lines can close."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from app.attachments.reading import Attachment, format_bytes

_LANG = {".py": "python", ".js": "javascript", ".ts": "typescript", ".json": "json", ".md": "markdown",
         ".csv": "csv", ".html": "html", ".css": "css", ".sh": "bash", ".c": "c", ".h": "c", ".cpp": "cpp",
         ".rs": "rust", ".go": "go", ".java": "java", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml",
         ".sql": "sql", ".rb": "ruby", ".txt": "", ".pdf": ""}


@dataclass(frozen=True)
class Part:
    """A piece of a file in the prompt: lines start..end (1-based, inclusive); the whole file when it is all."""

    name: str
    start: int
    end: int
    whole: bool = False

    def cite(self) -> str:
        return f"{self.name}" if self.whole else f"{self.name}:{self.start}-{self.end}"


def fenced(text: str, info: str = "") -> str:
    """`text` (less its trailing newlines) in a Markdown code fence none of its lines can close: three backticks,
    or one more than its longest run of them; `info` after the opening fence (a language)."""
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip(chr(10))}\n{fence}"


def language(name: str) -> str:
    return _LANG.get(Path(name).suffix.lower(), "")


def render_whole(a: Attachment) -> str:
    """A whole file: a header naming it (size, lines) and its text in a fence no line of it can close."""
    n = len(a.lines)
    return f"File {a.name} ({format_bytes(a.size)}, {n} line{'s' * (n != 1)}):\n{fenced(a.text, language(a.name))}"


def render_part(a: Attachment, part: Part) -> str:
    """A passage: a header naming the file and its line range, each line with its number (what to cite)."""
    lines = a.lines[part.start - 1:part.end]
    width = len(str(part.end))
    body = "\n".join(f"{i:>{width}}| {line}" for i, line in enumerate(lines, part.start))
    return f"From {a.name}, lines {part.start}-{part.end} of {len(a.lines)}:\n{fenced(body)}"


RETRIEVAL_NOTE = ("Only the passages below of the attached files fit in the context. Answer from them and cite "
                  "the file and lines you used, like [name:12-20].")


def render(question: str, files: Sequence[Attachment], parts: Sequence[Part] | None = None) -> str:
    """The user turn the model sees: the files (whole, or the chosen parts in file and line order), then the text."""
    if not files:
        return question
    by_name = {a.name: a for a in files}
    if parts is None:
        blocks = [render_whole(a) for a in files]
    else:
        blocks = [RETRIEVAL_NOTE] + [render_whole(by_name[p.name]) if p.whole else render_part(by_name[p.name], p)
                                     for p in parts if p.name in by_name]
    return "\n\n".join(blocks + ([question] if question else []))
