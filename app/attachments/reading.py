"""Reading files: bytes or a path -> an `Attachment` (its text as the model sees it), with stated limits and typed
errors that name the file and say what to do."""

from __future__ import annotations

import codecs
import io
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from offload.plan import format_bytes

MAX_FILE_BYTES = 4 * 1024 * 1024  # per file as uploaded (a PDF's size; text files are far smaller in practice)
MAX_TEXT_CHARS = 400_000  # per file after extraction (~100k tokens: more than any local context holds whole)
MAX_FILES = 8  # per message
MAX_PDF_PAGES = 500

_BINARY_MAGIC = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
                 b"PK\x03\x04": "a ZIP archive (docx, xlsx and jar files are ZIP archives too)",
                 b"\x7fELF": "an executable", b"MZ": "a Windows executable", b"\x1f\x8b": "a gzip archive",
                 b"SQLite format 3": "an SQLite database", b"RIFF": "a media file", b"%!PS": "a PostScript file"}
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


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
            raise FileTooLarge(shown, f"{shown} is {format_bytes(size)}: files can be at most "
                                      f"{format_bytes(limits.max_bytes)}; attach the part that matters")
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
        raise FileTooLarge(name, f"{name} is {format_bytes(len(data))}: files can be at most "
                                 f"{format_bytes(limits.max_bytes)}; attach the part that matters")
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
