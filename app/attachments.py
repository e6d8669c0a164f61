"""Files in a chat: read into text with stated limits, put into the prompt whole when they fit, else the passages
a question needs (BM25 over line chunks), and answers that rewrite a file turned into a diff and a patched file.

Pure Python (pypdf for PDFs); no gradio. The chat tab, the CLI (`generate --file`) and the API (content parts of
type "file") all read files through `from_bytes` / `read_path` and build prompts through `render`.

Errors are typed (`AttachmentError` and its subclasses), each naming the file and what to do about it.
"""

from __future__ import annotations

import codecs
import difflib
import io
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

MAX_FILE_BYTES = 4 * 1024 * 1024  # per file as uploaded (a PDF's size; text files are far smaller in practice)
MAX_TEXT_CHARS = 400_000  # per file after extraction (~100k tokens: more than any local context holds whole)
MAX_FILES = 8  # per message
MAX_PDF_PAGES = 500
CHUNK_LINES = 30  # retrieval passages: this many lines, or fewer when they would exceed CHUNK_CHARS
CHUNK_CHARS = 1600
ANSWER_MARGIN = 16  # tokens kept free beyond the answer and the forest (template tokens of the next turn)
DIFF_MIN_RATIO = 0.5  # a fenced block rewrites a file when its lines match at least this share of the file's

_BINARY_MAGIC = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
                 b"PK\x03\x04": "a ZIP archive (docx, xlsx and jar files are ZIP archives too)",
                 b"\x7fELF": "an executable", b"MZ": "a Windows executable", b"\x1f\x8b": "a gzip archive",
                 b"SQLite format 3": "an SQLite database", b"RIFF": "a media file", b"%!PS": "a PostScript file"}
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_LANG = {".py": "python", ".js": "javascript", ".ts": "typescript", ".json": "json", ".md": "markdown",
         ".csv": "csv", ".html": "html", ".css": "css", ".sh": "bash", ".c": "c", ".h": "c", ".cpp": "cpp",
         ".rs": "rust", ".go": "go", ".java": "java", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml",
         ".sql": "sql", ".rb": "ruby", ".txt": "", ".pdf": ""}


# --------------------------------------------------------------------------------------------------- errors

class AttachmentError(ValueError):
    """A file cannot be attached; the message names it and says why (and what to do)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class TooManyFiles(AttachmentError):
    pass


class FileTooLarge(AttachmentError):
    pass


class EmptyFile(AttachmentError):
    pass


class BinaryFile(AttachmentError):
    pass


class UnreadableFile(AttachmentError):
    pass


class UnsupportedEncoding(AttachmentError):
    pass


class PdfWithoutText(AttachmentError):
    pass


# ------------------------------------------------------------------------------------------------ the files

@dataclass(frozen=True)
class Limits:
    max_bytes: int = MAX_FILE_BYTES
    max_chars: int = MAX_TEXT_CHARS
    max_files: int = MAX_FILES
    max_pdf_pages: int = MAX_PDF_PAGES


LIMITS = Limits()


@dataclass(frozen=True)
class Attachment:
    """One file's text as the model sees it. size: bytes as uploaded; kind: text | pdf; encoding: how the bytes
    were decoded (pdf: pypdf's text layer)."""

    name: str
    text: str
    size: int
    kind: str = "text"
    encoding: str = "utf-8"

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Attachment":
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("text"), str):
            raise ValueError("an attachment needs a name and a text")
        return cls(name=d["name"], text=d["text"], size=int(d.get("size", len(d["text"].encode()))),
                   kind=str(d.get("kind", "text")), encoding=str(d.get("encoding", "utf-8")))


def human_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MB"


def clean_name(name: str) -> str:
    """The file's own name (no folders a client sent along), printable, at most 120 characters."""
    base = re.split(r"[\\/]", str(name or ""))[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip() or "attachment.txt"
    return base[:120]


def check_count(n: int, limits: Limits = LIMITS) -> None:
    if n > limits.max_files:
        raise TooManyFiles("", f"{n} files attached: at most {limits.max_files} per message; send the rest with "
                               "the next message")


def read_path(path: str | Path, limits: Limits = LIMITS, *, name: str | None = None) -> Attachment:
    """A file on disk -> Attachment (the size is checked before the file is read)."""
    p = Path(path)
    shown = clean_name(name or p.name)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise UnreadableFile(shown, f"{shown} is not a file")
        if size > limits.max_bytes:
            raise FileTooLarge(shown, f"{shown} is {human_size(size)}: files can be at most "
                                      f"{human_size(limits.max_bytes)}; attach the part that matters")
        data = p.read_bytes()
    except FileNotFoundError:
        raise UnreadableFile(shown, f"{shown}: no such file") from None
    except PermissionError:
        raise UnreadableFile(shown, f"{shown} cannot be read (permission denied)") from None
    except OSError as e:
        raise UnreadableFile(shown, f"{shown} cannot be read ({e.strerror or e})") from None
    return from_bytes(shown, data, limits)


def read_paths(paths: Iterable[str | Path], limits: Limits = LIMITS) -> list[Attachment]:
    paths = list(paths)
    check_count(len(paths), limits)
    return [read_path(p, limits) for p in paths]


def from_bytes(name: str, data: bytes, limits: Limits = LIMITS) -> Attachment:
    """Bytes of a file called `name` -> Attachment: PDF through its text layer, text through its encoding."""
    name = clean_name(name)
    if len(data) > limits.max_bytes:
        raise FileTooLarge(name, f"{name} is {human_size(len(data))}: files can be at most "
                                 f"{human_size(limits.max_bytes)}; attach the part that matters")
    if not data:
        raise EmptyFile(name, f"{name} is empty")
    if data[:5] == b"%PDF-":
        text, encoding, kind = _pdf_text(name, data, limits), "pdf", "pdf"
    else:
        text, encoding = _decode(name, data)
        kind = "text"
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if len(text) > limits.max_chars:
        raise FileTooLarge(name, f"{name} holds {len(text):,} characters of text: at most {limits.max_chars:,} per "
                                 "file; attach the part that matters")
    if not text.strip():
        raise EmptyFile(name, f"{name} holds no text (only white space)")
    return Attachment(name=name, text=text, size=len(data), kind=kind, encoding=encoding)


def _decode(name: str, data: bytes) -> tuple[str, str]:
    """UTF-8 (with or without a BOM), or UTF-16 / UTF-32 with a BOM; anything else is refused with where."""
    for bom, enc in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(enc), enc.replace("-sig", "")
            except UnicodeDecodeError as e:
                raise UnsupportedEncoding(name, f"{name} starts like {enc.upper()} but is not valid {enc.upper()} "
                                                f"(at byte {e.start})") from None
    for magic, what in _BINARY_MAGIC.items():
        if data.startswith(magic):
            raise BinaryFile(name, f"{name} is {what}, not text: attach text, code, Markdown, CSV, JSON or PDF")
    if b"\x00" in data[:8192]:
        raise BinaryFile(name, f"{name} is a binary file (it holds NUL bytes), not text: attach text, code, "
                               "Markdown, CSV, JSON or PDF")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnsupportedEncoding(name, f"{name} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start} is "
                                        "not valid UTF-8): save it as UTF-8 and attach it again") from None
    controls = sum(1 for ch in text[:8192] if ord(ch) < 32 and ch not in "\n\r\t\f\v\x1b")
    if controls > max(8, len(text[:8192]) // 50):
        raise BinaryFile(name, f"{name} looks binary ({controls} control characters in its start), not text")
    return text, "utf-8"


def _pdf_text(name: str, data: bytes, limits: Limits) -> str:
    """The PDF's text layer, page by page, each page under a '[page N]' line (what citations refer to)."""
    try:
        from pypdf import PdfReader
        from pypdf.errors import PyPdfError
    except ImportError:  # a dependency; only a broken install lacks it
        raise UnreadableFile(name, f"{name}: reading PDFs needs pypdf (pip install pypdf)") from None
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise UnreadableFile(name, f"{name} is a password-protected PDF: save an unprotected copy")
        pages = reader.pages
        if len(pages) > limits.max_pdf_pages:
            raise FileTooLarge(name, f"{name} has {len(pages)} pages: at most {limits.max_pdf_pages}; attach the "
                                     "pages that matter")
        texts = [(page.extract_text() or "").strip() for page in pages]
    except AttachmentError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError, NotImplementedError) as e:
        raise UnreadableFile(name, f"{name} is not a readable PDF ({type(e).__name__}: {e})") from None
    if not any(texts):
        raise PdfWithoutText(name, f"{name} has no text layer ({len(texts)} page(s) of images, a scan?): run it "
                                   "through OCR first, or paste its text")
    return "\n".join(f"[page {i}]\n{t}" for i, t in enumerate(texts, 1) if t)


# --------------------------------------------------------------------------------------------- the prompt

@dataclass(frozen=True)
class Part:
    """A piece of a file in the prompt: lines start..end (1-based, inclusive); the whole file when it is all."""

    name: str
    start: int
    end: int
    whole: bool = False

    def cite(self) -> str:
        return f"{self.name}" if self.whole else f"{self.name}:{self.start}-{self.end}"


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    return "`" * max(3, longest + 1)


def language(name: str) -> str:
    return _LANG.get(Path(name).suffix.lower(), "")


def render_whole(a: Attachment) -> str:
    """A whole file: a header naming it (size, lines) and its text in a fence no line of it can close."""
    fence = _fence(a.text)
    n = len(a.lines)
    return (f"File {a.name} ({human_size(a.size)}, {n} line{'s' * (n != 1)}):\n"
            f"{fence}{language(a.name)}\n{a.text.rstrip(chr(10))}\n{fence}")


def render_part(a: Attachment, part: Part) -> str:
    """A passage: a header naming the file and its line range, each line with its number (what to cite)."""
    lines = a.lines[part.start - 1:part.end]
    width = len(str(part.end))
    body = "\n".join(f"{i:>{width}}| {line}" for i, line in enumerate(lines, part.start))
    fence = _fence(body)
    return f"From {a.name}, lines {part.start}-{part.end} of {len(a.lines)}:\n{fence}\n{body}\n{fence}"


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


def unique_names(files: Sequence[Attachment]) -> list[Attachment]:
    """Files with distinct names (a second 'a.py' becomes 'a (2).py'): citations and diffs name files."""
    seen: Counter = Counter()
    out = []
    for a in files:
        seen[a.name] += 1
        if seen[a.name] > 1:
            p = Path(a.name)
            a = Attachment(f"{p.stem} ({seen[a.name]}){p.suffix}", a.text, a.size, a.kind, a.encoding)
        out.append(a)
    return out


def message_files(message: dict) -> list[Attachment]:
    """A stored chat message's attached files (none when it has none)."""
    return [Attachment.from_dict(d) for d in message.get("attachments") or []]


def message_content(message: dict) -> str:
    """What the model sees of a stored message: its files (whole, or the parts its plan chose) and its text."""
    files = message_files(message)
    if not files:
        return message["content"]
    plan = ContextPlan.from_dict(message.get("context"))
    return render(message["content"], files, plan.parts if plan is not None else None)


def task_prompt(item) -> str:
    """The user turn of a prompt-set item: a prompt string, or a task's prompt after its files ({name, text}),
    rendered as the chat sends attached files that fit."""
    if not isinstance(item, dict):
        return item
    return render(item["prompt"], task_files(item))


def task_files(item) -> list[Attachment]:
    """The files a prompt-set item attaches ({name, text} each; none for a prompt string)."""
    files = item.get("files") if isinstance(item, dict) else None
    return [Attachment(f["name"], f["text"], len(f["text"].encode())) for f in files or []]


# ------------------------------------------------------------------------------------- fit, then retrieval

def estimate_tokens(text: str) -> int:
    """Without a tokenizer: about 4 characters a token (English and code with BPE vocabularies)."""
    return max(1, math.ceil(len(text) / 4)) if text else 0


@dataclass
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
    def room_for_files(self) -> int:
        return self.n_ctx - self.history - self.answer

    @property
    def fits(self) -> bool:
        return self.total <= self.n_ctx

    def line(self) -> str:
        verdict = "fits" if self.fits else ("files too large: the relevant passages will be retrieved"
                                            if self.history + self.answer < self.n_ctx
                                            else "does not fit even without the files")
        return (f"Context: files {self.files:,} + history {self.history:,} + answer {self.answer:,} = "
                f"{self.total:,} of {self.n_ctx:,} tokens · {verdict}")


@dataclass
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
    from app.config import MODE_FACTS

    ws = params.draft_beams if params.draft_beams is not None else params.beams + 1
    facts = [MODE_FACTS[params.mode]] if MODE_FACTS[params.mode].concrete else \
        [f for f in MODE_FACTS.values() if f.concrete]
    tree = max(f.tree_tokens(ws, params.gamma, params.lookup_nodes) for f in facts)
    return params.max_new_tokens + tree + ANSWER_MARGIN


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


# --------------------------------------------------------------------------------------- answers as diffs

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


__all__ = ["Attachment", "AttachmentError", "TooManyFiles", "FileTooLarge", "EmptyFile", "BinaryFile",
           "UnreadableFile", "UnsupportedEncoding", "PdfWithoutText", "Limits", "LIMITS", "Part", "Budget",
           "ContextPlan", "BM25", "FileDiff", "from_bytes", "read_path", "read_paths", "check_count", "render",
           "render_whole", "render_part", "plan_context", "chunks", "terms", "diffs", "code_blocks",
           "estimate_tokens", "human_size", "clean_name", "unique_names", "message_files", "message_content",
           "task_prompt", "task_files"]
