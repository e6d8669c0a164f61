"""Attached files: every limit and its message, encodings, PDFs, the prompt they make, fit then retrieval, answers
as diffs, and the chat history round trip."""

from __future__ import annotations

import io
import json

import pytest

from app import attachments as att
from app.attachments import (Attachment, BinaryFile, EmptyFile, FileTooLarge, Limits, PdfWithoutText, TooManyFiles,
                             UnreadableFile, UnsupportedEncoding)
from app.storage import HistoryStore, to_markdown


def pdf_with_text(lines: list[str]) -> bytes:
    """A one-page PDF whose content stream draws `lines` in Helvetica (written by hand: xref offsets exact)."""
    ops = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({t}) Tj T*" for t in lines) + " ET"
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            "/Resources << /Font << /F1 5 0 R >> >> >>",
            f"<< /Length {len(ops)} >>\nstream\n{ops}\nendstream",
            "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = io.BytesIO(), []
    out.write(b"%PDF-1.4\n")
    for i, body in enumerate(objs, 1):
        offsets.append(out.tell())
        out.write(f"{i} 0 obj\n{body}\nendobj\n".encode())
    xref = out.tell()
    out.write(f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode())
    out.write("".join(f"{o:010d} 00000 n \n" for o in offsets).encode())
    out.write(f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode())
    return out.getvalue()


def blank_pdf(pages: int = 1) -> bytes:
    from pypdf import PdfWriter

    w = PdfWriter()
    for _ in range(pages):
        w.add_blank_page(width=200, height=200)
    buf = io.BytesIO()
    w.write(buf)
    return buf.getvalue()


# -- reading files ------------------------------------------------------------------------------------
def test_text_code_markdown_csv_json_read_as_text():
    for name, body in [("notes.txt", "plain\n"), ("calc.py", "def f(x):\n    return x\n"), ("r.md", "# T\n"),
                       ("t.csv", "a,b\n1,2\n"), ("d.json", '{"k": [1, 2]}')]:
        a = att.from_bytes(name, body.encode())
        assert (a.name, a.text, a.size, a.kind, a.encoding) == (name, body, len(body.encode()), "text", "utf-8")


def test_crlf_becomes_lf_and_folders_leave_the_name():
    a = att.from_bytes("C:\\Users\\me\\win.txt", b"one\r\ntwo\r\n")
    assert a.name == "win.txt" and a.text == "one\ntwo\n"
    assert att.from_bytes("../../etc/x.txt", b"x").name == "x.txt"


@pytest.mark.parametrize("data,encoding", [
    ("héllo ✓\n".encode("utf-8-sig"), "utf-8"),
    ("héllo ✓\n".encode("utf-16"), "utf-16"),
    ("héllo ✓\n".encode("utf-32"), "utf-32"),
])
def test_utf_boms_are_decoded(data, encoding):
    a = att.from_bytes("u.txt", data)
    assert a.text == "héllo ✓\n" and a.encoding == encoding


def test_latin1_file_is_refused_with_the_offset():
    with pytest.raises(UnsupportedEncoding) as e:
        att.from_bytes("old.txt", "caf\xe9 au lait".encode("latin-1"))
    assert str(e.value) == ("old.txt is not UTF-8 (byte 0xe9 at offset 3 is not valid UTF-8): save it as UTF-8 "
                            "and attach it again")
    assert e.value.name == "old.txt"


def test_broken_utf16_after_its_bom_is_an_encoding_error():
    with pytest.raises(UnsupportedEncoding, match="starts like UTF-16 but is not valid UTF-16"):
        att.from_bytes("b.txt", b"\xff\xfe\x00\xd8")  # a lone surrogate


@pytest.mark.parametrize("data,what", [
    (b"\x89PNG\r\n\x1a\n....", "a PNG image"),
    (b"PK\x03\x04rest", "a ZIP archive"),
    (b"\x7fELF\x02\x01", "an executable"),
])
def test_known_binary_formats_are_named(data, what):
    with pytest.raises(BinaryFile, match=f"x.bin is {what}"):
        att.from_bytes("x.bin", data)


def test_nul_bytes_and_control_characters_are_binary():
    with pytest.raises(BinaryFile, match="it holds NUL bytes"):
        att.from_bytes("blob.dat", b"abc\x00def")
    with pytest.raises(BinaryFile, match="looks binary"):
        att.from_bytes("ctl.dat", bytes(range(1, 9)) * 20)


def test_size_limits_per_file_and_after_extraction():
    small = Limits(max_bytes=100, max_chars=10)
    with pytest.raises(FileTooLarge) as e:
        att.from_bytes("big.txt", b"x" * 101, small)
    assert str(e.value) == "big.txt is 101 B: files can be at most 100 B; attach the part that matters"
    with pytest.raises(FileTooLarge, match="holds 11 characters of text: at most 10 per file"):
        att.from_bytes("long.txt", b"x" * 11, small)


def test_size_is_checked_before_a_path_is_read(tmp_path):
    p = tmp_path / "big.log"
    p.write_bytes(b"y" * 2048)
    with pytest.raises(FileTooLarge, match=r"big.log is 2.0 KiB: files can be at most 1.0 KiB"):
        att.read_path(p, Limits(max_bytes=1024))


def test_count_limit():
    att.check_count(att.MAX_FILES)
    with pytest.raises(TooManyFiles) as e:
        att.check_count(att.MAX_FILES + 1)
    assert str(e.value) == (f"{att.MAX_FILES + 1} files attached: at most {att.MAX_FILES} per message; send the rest "
                            "with the next message")


def test_empty_and_blank_files():
    with pytest.raises(EmptyFile, match="e.txt is empty"):
        att.from_bytes("e.txt", b"")
    with pytest.raises(EmptyFile, match=r"w.txt holds no text \(only white space\)"):
        att.from_bytes("w.txt", b" \n\t\n")


def test_missing_folder_and_unreadable_paths(tmp_path):
    with pytest.raises(UnreadableFile, match="nope.txt: no such file"):
        att.read_path(tmp_path / "nope.txt")
    with pytest.raises(UnreadableFile, match="is not a file"):
        att.read_path(tmp_path)


def test_pdf_text_layer_by_page():
    a = att.from_bytes("report.pdf", pdf_with_text(["Revenue grew 12 percent.", "Costs fell."]))
    assert a.kind == "pdf" and a.text.startswith("[page 1]\n")
    assert "Revenue grew 12 percent." in a.text and "Costs fell." in a.text


def test_pdf_without_text_says_scan():
    with pytest.raises(PdfWithoutText) as e:
        att.from_bytes("scan.pdf", blank_pdf(2))
    assert str(e.value) == ("scan.pdf has no text layer (2 page(s) of images, a scan?): run it through OCR first, "
                            "or paste its text")


def test_broken_pdf_and_page_limit():
    with pytest.raises(UnreadableFile, match="broken.pdf is not a readable PDF"):
        att.from_bytes("broken.pdf", b"%PDF-1.4\nnot really a pdf")
    with pytest.raises(FileTooLarge, match="many.pdf has 3 pages: at most 2"):
        att.from_bytes("many.pdf", blank_pdf(3), Limits(max_pdf_pages=2))


# -- the prompt ----------------------------------------------------------------------------------------
def test_whole_file_rendering_names_it_and_fences_it_safely():
    a = att.from_bytes("doc.md", b"text\n```py\ncode\n```\n")
    out = att.render("Summarise.", [a])
    assert out.startswith("File doc.md (20 B, 4 lines):\n````markdown\ntext\n```py")
    assert out.endswith("```\n````\n\nSummarise.")


def test_parts_carry_line_numbers_and_ranges():
    a = Attachment("m.py", "\n".join(f"line {i}" for i in range(1, 21)) + "\n", 100)
    out = att.render("q", [a], [att.Part("m.py", 9, 11)])
    assert att.RETRIEVAL_NOTE in out
    assert "From m.py, lines 9-11 of 20:\n```\n 9| line 9\n10| line 10\n11| line 11\n```" in out


def test_same_names_get_numbered():
    a = [Attachment("a.py", "x", 1), Attachment("a.py", "y", 1), Attachment("b.py", "z", 1)]
    assert [f.name for f in att.unique_names(a)] == ["a.py", "a (2).py", "b.py"]


# -- fit, then retrieval ----------------------------------------------------------------------------------
def _manual(topics: list[str], lines_each: int = 30) -> Attachment:
    lines = []
    for t in topics:
        lines += [f"## {t}"] + [f"The {t} section explains {t} settings, line {i}." for i in range(lines_each - 1)]
    return Attachment("manual.md", "\n".join(lines) + "\n", 0)


def test_files_that_fit_go_whole():
    a = _manual(["intro"], 5)
    plan, budget = att.fit("What is this?", [a], rest=50, reserve=100, n_ctx=4096)
    assert not plan.retrieved and plan.parts is None
    assert budget.fits and budget.files == plan.tokens and budget.total == plan.tokens + 150
    assert "fits" in budget.line() and "of 4,096 tokens" in budget.line()


def test_retrieval_picks_the_chunk_that_answers():
    a = _manual(["intro", "install", "gpu", "rpc", "security", "troubleshooting"])
    b = Attachment("other.txt", "Nothing about the topic here.\n" * 40, 0)
    plan, budget = att.fit("How do I set up the rpc workers?", [a, b], rest=40, reserve=200, n_ctx=700)
    assert plan.retrieved and not budget.fits and "retrieved" in budget.line()
    assert plan.tokens <= 700 - 240
    (part,) = plan.parts  # room for one passage: the rpc section's (lines 91-120)
    assert part.name == "manual.md" and part.start <= 95 and part.end >= 115
    text = att.render("q", [a, b], plan.parts)
    assert f"From manual.md, lines {part.start}-{part.end} of 180:" in text and "rpc settings" in text
    assert "intro" not in text and "Nothing about" not in text
    assert f"manual.md:{part.start}-{part.end}" in plan.describe([a, b])


def test_identifiers_match_their_parts():
    assert att.terms("parseHTTPRequest max_tokens") == ["parsehttprequest", "parse", "http", "request",
                                                        "max_tokens", "max", "tokens"]


def test_bm25_prefers_rare_terms():
    scores = att.BM25([["the", "cat"], ["the", "dog"], ["the", "the"]]).scores(["the", "dog"])
    assert scores.index(max(scores)) == 1


def test_nothing_scores_first_passage_of_each_file():
    a = _manual(["alpha", "beta"], 30)
    plan = att.plan_context("zzz qqq", [a], room=500)
    assert plan.parts and plan.parts[0].start == 1


def test_plan_round_trips():
    plan = att.ContextPlan([att.Part("a.py", 1, 30)], 120, 9)
    assert att.ContextPlan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan
    assert att.ContextPlan.from_dict({"parts": [{"nme": 1}]}) is None  # a hand-edited chat: files go in whole


# -- answers as diffs -----------------------------------------------------------------------------------
CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"


def test_fenced_block_that_rewrites_a_file_becomes_a_diff():
    answer = ("Fixed the bug:\n\n```python\n" + CALC.replace("a - b", "a + b") + "```\n\nThat's it.")
    (d,) = att.diffs(answer, [Attachment("calc.py", CALC, len(CALC)), Attachment("x.md", "# unrelated\n", 12)])
    assert d.name == "calc.py" and d.patched == CALC.replace("a - b", "a + b")
    assert (d.added, d.removed) == (1, 1) and d.ratio > 0.8
    assert d.diff.startswith("--- a/calc.py\n+++ b/calc.py\n@@")
    assert "-    return a - b\n+    return a + b\n" in d.diff


def test_unrelated_or_unchanged_blocks_are_no_diff():
    files = [Attachment("calc.py", CALC, len(CALC))]
    assert att.diffs("```python\nprint('hello world')\n```", files) == []
    assert att.diffs("```python\n" + CALC + "```", files) == []
    assert att.diffs("no code here", files) == []


def test_a_block_naming_its_file_is_taken_even_when_rewritten_a_lot():
    files = [Attachment("calc.py", CALC, len(CALC))]
    (d,) = att.diffs("```python\n# calc.py\nimport operator\nadd = operator.add\n```", files)
    assert d.name == "calc.py" and "+add = operator.add" in d.diff


# -- the chat history -----------------------------------------------------------------------------------
def test_history_round_trip_and_exports(tmp_path):
    store = HistoryStore(tmp_path)
    chat = store.new_chat()
    a = att.from_bytes("calc.py", CALC.encode())
    chat["messages"].append({"role": "user", "content": "fix it", "attachments": [a.as_dict()],
                             "context": att.ContextPlan(None, 40).as_dict()})
    store.save(chat)
    again = store.load(chat["id"])
    assert att.message_files(again["messages"][0]) == [a]
    assert att.chat_prompt(again["messages"]).messages[0]["content"] == att.render("fix it", [a])
    md = to_markdown(again)
    assert "📎 calc.py" in md and "return a - b" in md
    assert json.loads(store.export(again, "json").read_text())["messages"][0]["attachments"][0]["name"] == "calc.py"


def test_bad_attachments_field_is_a_corrupt_chat(tmp_path):
    from app.storage import CorruptChat

    store = HistoryStore(tmp_path)
    chat = store.new_chat()
    chat["messages"].append({"role": "user", "content": "x", "attachments": [{"name": 3}]})
    store.path_of(chat["id"]).write_text(json.dumps(chat))
    with pytest.raises(CorruptChat, match="attachments must be a list"):
        store.load(chat["id"])


def test_patched_file_export_stays_in_the_data_folder(tmp_path):
    store = HistoryStore(tmp_path)
    chat = store.new_chat()
    p = store.export_patched(chat, "../../evil name.py", "x = 1\n")
    assert p.parent == store.exports_dir / chat["id"] and p.name == "evil_name.py"
    assert p.read_text() == "x = 1\n"
