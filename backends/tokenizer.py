"""Tokenizers behind one small interface, and the draft/target vocabulary compatibility check.

The interface (`Tokenizer`) sits in backends.base beside the model protocol; two implementations: GGUF files
through llama.cpp's vocabulary (vocab-only load, in backends/llamacpp) and Hugging Face folders through the
`tokenizers` library (`HFTokenizer`, below). `load_tokenizer` is the factory that picks one by path.

Byte semantics: `decode` concatenates raw token bytes, so `decode(a + b) == decode(a) + decode(b)` and a
stream can decode token by token (a chunk may end inside a UTF-8 character). Control tokens (BOS, EOS,
chat markers) decode to b""; `piece` renders every token, specials included (use it for template text
such as the BOS / EOS strings).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterable

from backends.base import BackendError, Tokenizer

# End-of-generation texts llama.cpp also treats as EOG; used for tokenizer.json folders.
EOG_TEXTS = frozenset({
    "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
})


class VocabMismatch(BackendError):
    """Draft and target tokenizers do not map ids to the same tokens."""


def check_compatible(draft: Tokenizer, target: Tokenizer) -> None:
    """Raise VocabMismatch naming the first difference that breaks speculative decoding.

    A size difference is accepted when every extra id of the larger vocabulary is unused (padding rows of
    the embedding); decoders then mask ids >= min(draft.n_vocab, target.n_vocab).
    """
    who = f"(draft {draft.name!r}, target {target.name!r})"
    if draft.vocab_type != target.vocab_type:
        raise VocabMismatch(f"vocabulary type differs: draft {draft.vocab_type} vs target {target.vocab_type} {who}")
    # BOS matters only when a prompt starts with it (GGUF files name a BOS id even when it is never added).
    d_bos = draft.bos_id if draft.add_bos else None
    t_bos = target.bos_id if target.add_bos else None
    if d_bos != t_bos:
        raise VocabMismatch(f"BOS differs: draft prepends {d_bos} vs target prepends {t_bos} {who}")
    n = min(draft.n_vocab, target.n_vocab)
    d_eos = sorted(i for i in draft.eos_ids if i < n)
    t_eos = sorted(i for i in target.eos_ids if i < n)
    if d_eos != t_eos:
        raise VocabMismatch(f"EOS ids differ: draft {d_eos} vs target {t_eos} {who}")
    big, tag = (draft, "draft") if draft.n_vocab > target.n_vocab else (target, "target")
    for i in range(n, big.n_vocab):
        if not big.is_unused(i):
            raise VocabMismatch(
                f"vocabulary size differs: draft {draft.n_vocab} vs target {target.n_vocab}, and id {i} "
                f"({big.piece(i)!r}) exists only in the {tag} {who}"
            )
    for i in range(n):
        if draft.is_unused(i) and target.is_unused(i):
            continue
        a, b = draft.piece(i), target.piece(i)
        if a != b:
            raise VocabMismatch(f"token {i} differs: draft {a!r} vs target {b!r} {who}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer for a .gguf file (llama.cpp, vocab only) or a folder holding tokenizer.json."""
    path = Path(path)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise BackendError(f"{path} has no tokenizer.json; expected a Hugging Face model folder")
        return HFTokenizer(path)
    if path.suffix.lower() == ".gguf" or path.is_file():
        from backends.llamacpp.tokenizer import GGUFTokenizer  # lazy: only GGUF users need llama_cpp

        return GGUFTokenizer.from_file(path)
    raise BackendError(f"no tokenizer found at {path}: pass a .gguf file or a folder with tokenizer.json")


def _gpt2_byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level BPE spells every byte as a printable character; invert that map.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_text(entry) -> str | None:
    return entry.get("content") if isinstance(entry, dict) else entry


class HFTokenizer(Tokenizer):
    """A Hugging Face folder: tokenizer.json (+ tokenizer_config.json, generation_config.json)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
        self._lock = threading.Lock()  # `encode_special_tokens` is a mutable flag on the shared object
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")

        self.name = folder.name
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        model = spec.get("model", {})
        kind = model.get("type", "").lower()
        self.vocab_type = {"bpe": "spm" if model.get("byte_fallback") else "bpe", "unigram": "ugm",
                           "wordpiece": "wpm"}.get(kind, kind or "unknown")
        self.bos_id = self._id_of(_token_text(cfg.get("bos_token")))
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_id = self._id_of(_token_text(cfg.get("eos_token")))
        if self.eos_id is None and gen_eos and isinstance(gen_eos[0], int):
            self.eos_id = gen_eos[0]
        eos = {self.eos_id, *gen_eos}
        added = spec.get("added_tokens", [])
        self._added = {t["id"]: t["content"] for t in added}  # raw text, never byte-level encoded
        self._special = frozenset(t["id"] for t in added if t.get("special"))
        eos.update(i for i in self._special if self._added[i] in EOG_TEXTS)
        self.eos_ids = frozenset(i for i in eos if isinstance(i, int))
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_id is not None and with_special[:1] == [self.bos_id]))
        self.chat_template = _chat_template(folder, cfg)
        dec = json.dumps(spec.get("decoder") or {})
        self._byte_level = '"ByteLevel"' in dec
        self._metaspace = '"Metaspace"' in dec or "\\u2581" in dec or "\u2581" in dec
        self._bytes = _gpt2_byte_decoder() if self._byte_level else None

    def _id_of(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    def encode(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        with self._lock:
            self._tok.encode_special_tokens = not special  # True = specials are split like plain text
            ids = self._tok.encode(text, add_special_tokens=False).ids
            self._tok.encode_special_tokens = False
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def piece(self, token: int) -> bytes:
        text = self._tok.id_to_token(token)
        if text is None:
            return b""
        if token in self._added:
            return self._added[token].encode()
        if self._bytes is not None:
            return bytes(self._bytes.get(c, 0) for c in text) if all(c in self._bytes for c in text) else text.encode()
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode() if self._metaspace else text.encode()

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(b"" if i in self._special else self.piece(i) for i in ids)

    def is_unused(self, token: int) -> bool:
        return self._tok.id_to_token(token) is None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(folder: Path, cfg: dict) -> str | None:
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl}
        tpl = named.get("default") or next(iter(named.values()), None)
    if tpl is None and (folder / "chat_template.jinja").is_file():
        tpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return tpl
