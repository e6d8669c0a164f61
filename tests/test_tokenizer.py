"""Tokenizers (GGUF via llama.cpp, Hugging Face folders) and the draft/target compatibility check."""

from __future__ import annotations

import json

import pytest

from backends.base import BackendError
from backends.tokenizer import (HFTokenizer, Tokenizer, VocabMismatch, check_compatible, load_tokenizer,
                               vocab_differences)

TEXTS = ["Hello world", "héllo wörld — 你好 🙂", "  two  spaces\nand\ttabs", "<|im_end|> as text", ""]


@pytest.fixture(scope="module")
def gguf_tok(tiny_gguf_path):
    pytest.importorskip("backends.llamacpp")
    tok = load_tokenizer(tiny_gguf_path)
    yield tok
    tok.close()


class Doctored(Tokenizer):
    """Another tokenizer's view with some answers changed (pieces, specials, extra ids)."""

    def __init__(self, base: Tokenizer, *, pieces=None, extra=0, extra_unused=True, **attrs) -> None:
        for k in ("name", "n_vocab", "bos_id", "eos_id", "eos_ids", "vocab_type", "add_bos", "chat_template"):
            setattr(self, k, attrs.get(k, getattr(base, k)))
        self.n_vocab = base.n_vocab + extra
        self._base, self._pieces, self._extra_unused = base, pieces or {}, extra_unused

    def piece(self, token: int) -> bytes:
        if token >= self._base.n_vocab:
            return f"[PAD{token}]".encode()
        return self._pieces.get(token, self._base.piece(token))

    def is_unused(self, token: int) -> bool:
        return token >= self._base.n_vocab and self._extra_unused


# -- GGUF ---------------------------------------------------------------------------------------------

def test_gguf_round_trip(gguf_tok):
    for text in TEXTS:
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids) == text.encode()
        # Streaming: decoding token by token gives the same bytes (chunks may split UTF-8 characters).
        assert b"".join(gguf_tok.decode([i]) for i in ids) == text.encode()


def test_gguf_special_text_is_plain_unless_asked(gguf_tok):
    im_end = gguf_tok.encode("<|im_end|>", special=True)
    assert len(im_end) == 1 and gguf_tok.piece(im_end[0]) == b"<|im_end|>"
    assert im_end[0] not in gguf_tok.encode("<|im_end|>")  # user text never becomes the control token
    assert gguf_tok.decode(im_end) == b""  # control tokens are not shown
    assert gguf_tok.is_eog(im_end[0])


def test_gguf_specials_and_metadata(gguf_tok, tiny_gguf_path):
    import gguf

    field = gguf.GGUFReader(tiny_gguf_path).fields["tokenizer.ggml.eos_token_id"]
    eos = int(field.parts[field.data[0]][0])
    assert gguf_tok.eos_id == eos and eos in gguf_tok.eos_ids and gguf_tok.is_eog(eos)
    assert gguf_tok.n_vocab == 49152 and gguf_tok.vocab_type == "bpe"
    assert gguf_tok.bos_id is not None and gguf_tok.encode("hi", add_bos=True)[0] == gguf_tok.bos_id
    assert gguf_tok.encode("hi")[0] != gguf_tok.bos_id
    assert "im_start" in (gguf_tok.chat_template or "")
    assert gguf_tok.name


def test_compatible_same_model(gguf_tok, tiny_gguf_path):
    other = load_tokenizer(tiny_gguf_path)
    check_compatible(other, gguf_tok)
    other.close()
    with pytest.raises(BackendError, match="closed"):
        other.encode("x")


def test_two_gguf_files_of_one_vocabulary_are_checked_by_their_fingerprints(tmp_path, monkeypatch):
    """Equal header fingerprints prove every token text equal: the check at load reads no piece. One token
    changed changes the fingerprint, and the per-id comparison names it."""
    from backends.llamacpp.tokenizer import GGUFTokenizer
    from gguf_files import SPM_TOKENS, SPM_TYPES, write_gguf

    changed = list(SPM_TOKENS)
    changed[40] = "doctored"
    paths = [write_gguf(tmp_path / f"{n}.gguf", tokens=t, types=SPM_TYPES)[0]
             for n, t in (("a", SPM_TOKENS), ("b", SPM_TOKENS), ("c", changed))]
    a, b, c = (load_tokenizer(p) for p in paths)
    read = []
    piece = GGUFTokenizer.piece
    monkeypatch.setattr(GGUFTokenizer, "piece", lambda self, i: read.append(i) or piece(self, i))
    try:
        check_compatible(a, b)
        assert read == [] and a.gguf_path == paths[0]
        with pytest.raises(VocabMismatch, match="token 40 differs"):
            check_compatible(c, a)
        assert len(read) > 40
    finally:
        for t in (a, b, c):
            t.close()


def test_pieces_read_from_two_threads_at_once_are_the_pieces(gguf_tok):
    """A load's vocabulary check reads every piece while an answer decodes with the same tokenizer."""
    import threading

    ids = range(0, gguf_tok.n_vocab, 3)
    want = [gguf_tok.piece(i) for i in ids]
    wrong = []
    readers = [threading.Thread(target=lambda: wrong.extend(i for i, w in zip(ids, want) if gguf_tok.piece(i) != w))
               for _ in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    assert wrong == []


@pytest.mark.parametrize(
    "change, words",
    [
        ({"pieces": {1000: b"<doctored>"}}, ["token 1000", "<doctored>"]),
        ({"eos_ids": frozenset({0})}, ["EOS ids differ"]),
        ({"bos_id": 7, "add_bos": True}, ["BOS differs", "prepends 7"]),
        ({"vocab_type": "spm"}, ["vocabulary type differs", "spm", "bpe"]),
        ({"extra": 3, "extra_unused": False}, ["vocabulary size differs", "49152", "only in the draft"]),
    ],
)
def test_incompatible_named(gguf_tok, change, words):
    draft = Doctored(gguf_tok, **change)
    with pytest.raises(VocabMismatch) as err:
        check_compatible(draft, gguf_tok)
    for w in words:
        assert w in str(err.value)
    if "pieces" in change:  # both texts are shown
        assert gguf_tok.piece(1000).decode() in str(err.value)


def test_padding_ids_allowed(gguf_tok):
    padded = Doctored(gguf_tok, extra=64)  # e.g. an embedding padded to a multiple of 64
    assert padded.n_vocab == gguf_tok.n_vocab + 64
    assert vocab_differences(padded, gguf_tok) == [] and vocab_differences(gguf_tok, padded) == []
    check_compatible(padded, gguf_tok)  # the check at load agrees: it raises on any difference
    check_compatible(gguf_tok, padded)


# -- Hugging Face folder --------------------------------------------------------------------------------

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "héllo wörld"] * 20


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return folder


def test_hf_tokenizer(hf_folder):
    tok = load_tokenizer(hf_folder)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_type == "bpe" and tok.bos_id is None and not tok.add_bos
    assert tok.eos_id == 2 and tok.eos_ids == frozenset({0, 2}) and tok.name == "tiny-bpe"
    assert "<|im_start|>" in tok.chat_template
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text.encode()
        assert b"".join(tok.decode([i]) for i in ids) == text.encode()
    assert 2 not in tok.encode("<|im_end|>") and tok.encode("<|im_end|>", special=True) == [2]
    assert tok.piece(2) == b"<|im_end|>" and tok.decode([2]) == b""
    space_the = tok.encode(" the")
    assert tok.piece(space_the[0]).startswith(b" ")  # byte-level 'Ġ' comes back as a real space
    check_compatible(tok, load_tokenizer(hf_folder / "tokenizer.json"))


def test_hf_vs_gguf_mismatch(hf_folder, gguf_tok):
    with pytest.raises(VocabMismatch, match="differ"):
        check_compatible(load_tokenizer(hf_folder), gguf_tok)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(BackendError, match="no tokenizer found"):
        load_tokenizer(tmp_path / "nothing-here")
    with pytest.raises(BackendError, match="tokenizer.json"):
        load_tokenizer(tmp_path)  # an existing folder without tokenizer.json
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not gguf at all")
    pytest.importorskip("backends.llamacpp")
    with pytest.raises(BackendError, match="not a GGUF file"):
        load_tokenizer(bad)
