"""Tokenizers behind one small interface, and the draft/target vocabulary compatibility check.

The interface (`Tokenizer`) sits in backends.base beside the model protocol; two implementations: GGUF files
through llama.cpp's vocabulary (vocab-only load, in backends/llamacpp) and Hugging Face folders through the
`tokenizers` library (`HFTokenizer`, below). `load_tokenizer` is the factory that picks one by path.

Draft/target compatibility is one rule, `vocab_differences(draft, target) -> list[str]` (every reason, empty
when compatible; the rule is stated there), used at load (`check_compatible` raises `VocabMismatch`) and by
the model library on GGUF headers alone: `header_fingerprint(header) -> VocabFingerprint` (small, cached per
file) and `HeaderVocab(path, fingerprint)` (a vocabulary view that reads token texts only when fingerprints
differ). Header views compare token texts as stored in the file; compare them only with other header views.

Byte semantics: `decode` concatenates raw token bytes, so `decode(a + b) == decode(a) + decode(b)` and a
stream can decode token by token (a chunk may end inside a UTF-8 character). Control tokens (BOS, EOS,
chat markers) decode to b""; `piece` renders every token, specials included (use it for template text
such as the BOS / EOS strings).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from backends.base import BackendError, BadModelFile, Tokenizer

# End-of-generation texts llama.cpp also treats as EOG; used for tokenizer.json folders.
EOG_TEXTS = frozenset({
    "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
})


class VocabMismatch(BackendError):
    """Draft and target tokenizers do not map ids to the same tokens."""


def vocab_differences(draft: Tokenizer, target: Tokenizer, *, limit: int = 3) -> list[str]:
    """Every reason `draft` cannot draft for `target`; empty when it can. The one rule, used at load
    (`check_compatible`) and by the model library (GGUF headers, `HeaderVocab`):

    1. the same vocabulary type (bpe, spm, ...);
    2. the same BOS when a prompt starts with one (GGUF files name a BOS id even when it is never added);
    3. the same end-of-generation ids below the smaller vocabulary size;
    4. sizes may differ only by unused ids (padding rows of an embedding) at the end of the larger vocabulary;
       decoders then mask ids >= min(draft.n_vocab, target.n_vocab);
    5. every id below the smaller size has the same text, ids unused in both excepted. Special and control
       tokens count like any other (llama.cpp's speculative example skips ids 0-4 and compares BOS / EOS ids
       instead; here a draft must agree with the target on every id it can propose).

    Token differences are listed up to `limit`, then counted.
    """
    reasons = []
    if draft.vocab_type != target.vocab_type:
        reasons.append(f"vocabulary type differs: draft {draft.vocab_type} vs target {target.vocab_type}")
    d_bos = draft.bos_id if draft.add_bos else None
    t_bos = target.bos_id if target.add_bos else None
    if d_bos != t_bos:
        reasons.append(f"BOS differs: draft prepends {d_bos} vs target prepends {t_bos}")
    n = min(draft.n_vocab, target.n_vocab)
    d_eos = sorted(i for i in draft.eos_ids if i < n)
    t_eos = sorted(i for i in target.eos_ids if i < n)
    if d_eos != t_eos:
        reasons.append(f"EOS ids differ: draft {d_eos} vs target {t_eos}")
    big, tag = (draft, "draft") if draft.n_vocab > target.n_vocab else (target, "target")
    for i in range(n, big.n_vocab):
        if not big.is_unused(i):
            reasons.append(f"vocabulary size differs: draft {draft.n_vocab} vs target {target.n_vocab}, and id {i} "
                           f"({show_piece(big.piece(i))}) exists only in the {tag}")
            break
    if draft.vocab_type != target.vocab_type or _same_texts(draft, target):
        return reasons
    differ = []
    for i in range(n):
        if draft.is_unused(i) and target.is_unused(i):
            continue
        a, b = draft.piece(i), target.piece(i)
        if a != b:
            differ.append(i)
            if len(differ) <= limit:
                reasons.append(f"token {i} differs: draft {show_piece(a)} vs target {show_piece(b)}")
    if len(differ) > limit:
        reasons.append(f"{len(differ) - limit} more of the {n} shared ids differ ({len(differ)} in all)")
    return reasons


def show_piece(piece: bytes) -> str:
    """A token's bytes as quoted text for messages (invalid UTF-8 as escapes)."""
    return repr(piece.decode("utf-8", errors="backslashreplace"))


def _same_texts(a: Tokenizer, b: Tokenizer) -> bool:
    """True when both fingerprints prove every token text equal (same size and digest): no per-id loop."""
    fa, fb = _fingerprint(a), _fingerprint(b)
    return fa is not None and fb is not None and fa.same_texts(fb)


def _fingerprint(t: Tokenizer) -> "VocabFingerprint | None":
    """A tokenizer's vocabulary fingerprint: its own, or its GGUF file's header's (`gguf_path`, llama.cpp's
    tokenizers: two headers take 0.25 s to read where comparing 151,936 pieces takes 0.9 s)."""
    fp = getattr(t, "fingerprint", None)
    path = getattr(t, "gguf_path", None)
    if fp is None and path is not None:
        from offload.gguf_header import read_header

        try:
            fp = header_fingerprint(read_header(path))
        except BadModelFile:
            return None
    return fp


def check_compatible(draft: Tokenizer, target: Tokenizer) -> None:
    """Raise VocabMismatch naming every difference that breaks speculative decoding (`vocab_differences`)."""
    reasons = vocab_differences(draft, target)
    if reasons:
        raise VocabMismatch(f"{'; '.join(reasons)} (draft {draft.name!r}, target {target.name!r})")


# ---------------------------------------------------------------- GGUF headers: fingerprints and vocabularies


VOCAB_TYPES = {"llama": "spm", "gpt2": "bpe", "bert": "wpm", "t5": "ugm", "rwkv": "rwkv", "plamo2": "plamo2",
               "no_vocab": "none", "none": "none"}  # tokenizer.ggml.model -> llama.cpp's vocabulary type
_BOS_BY_DEFAULT = {"spm", "wpm"}  # add_bos when the header has no tokenizer.ggml.add_bos_token (llama.cpp's default)
_BOS_PRE = {"llama3", "llama-bpe"}  # BPE pre-tokenizers llama.cpp adds BOS for by default
UNUSED, CONTROL = 5, 3  # gguf.TokenType
# Token texts llama.cpp's vocabulary loader treats as end of generation whatever their type, and the
# fill-in-the-middle pad / repo / file-separator texts it also stops on (when the header names no such id).
LLAMA_EOG_TEXTS = EOG_TEXTS | {"</s>", "<|flush|>", "<|calls|>", "_<EOT>", "[EOT]", "[EOS]", "<end_of_utterance>",
                               "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
                               "[e~["}
FIM_STOP = {"pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
            "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "sep": ("<|file_sep|>",)}
CHECK_FROM = 5  # llama.cpp's speculative example compares token texts from this id on


@dataclass(frozen=True)
class VocabFingerprint:
    """What a GGUF header says about its tokenizer, small enough to cache per file.

    `tokens_sha256` hashes the token texts from id 5 on (ids 0-4 are kept verbatim in `first_tokens`), as
    llama.cpp's speculative check compares them; equal size, first tokens and digest mean equal texts.
    """

    vocab_type: str
    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: tuple[int, ...]
    first_tokens: tuple[str, ...]
    tokens_sha256: str
    n_used: int  # 1 + the last id that is not an unused (padding) id

    def same_texts(self, other: "VocabFingerprint") -> bool:
        return (self.n_vocab, self.first_tokens, self.tokens_sha256) == \
            (other.n_vocab, other.first_tokens, other.tokens_sha256)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VocabFingerprint":
        d = dict(d)
        d["eog_ids"], d["first_tokens"] = tuple(d["eog_ids"]), tuple(d["first_tokens"])
        return cls(**d)


def _meta_int(meta: dict, key: str) -> int | None:
    v = meta.get(key)
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 else None


def _token_kinds(header) -> tuple[list[str], np.ndarray]:
    texts = header.metadata.get("tokenizer.ggml.tokens")
    kinds = header.metadata.get("tokenizer.ggml.token_type")
    return texts, kinds if isinstance(kinds, np.ndarray) and kinds.size == len(texts) else np.ones(len(texts), np.int32)


def _unused_mask(texts: list[str], kinds: np.ndarray) -> np.ndarray:
    """Unused (padding) ids: type UNUSED, or control tokens named "...unused..." (llama.cpp marks those too)."""
    unused = kinds == UNUSED
    for i in np.flatnonzero(kinds == CONTROL):
        if "unused" in texts[i]:
            unused[i] = True
    return unused


def header_fingerprint(header) -> VocabFingerprint | None:
    """The fingerprint of a `offload.gguf_header.GGUFHeader` read with its token arrays; None without a
    vocabulary (a projector or adapter file)."""
    meta = header.metadata
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        return None
    texts, kinds = _token_kinds(header)
    n = len(texts)
    vtype = VOCAB_TYPES.get(str(meta.get("tokenizer.ggml.model", "")), str(meta.get("tokenizer.ggml.model")))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = vtype in _BOS_BY_DEFAULT or meta.get("tokenizer.ggml.pre") in _BOS_PRE
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    add_eos = add_eos if isinstance(add_eos, bool) else vtype == "wpm"
    eos = _meta_int(meta, "tokenizer.ggml.eos_token_id")
    by_text = {t: i for i, t in enumerate(texts) if t in LLAMA_EOG_TEXTS or t.startswith("<") or t.startswith("[")}
    eog = {i for t, i in by_text.items() if t in LLAMA_EOG_TEXTS}
    for kind, names in FIM_STOP.items():
        fim = _meta_int(meta, f"tokenizer.ggml.fim_{kind}_token_id")
        fim = fim if fim is not None else next((by_text[t] for t in names if t in by_text), None)
        eog.add(fim)
    eog.update((eos, _meta_int(meta, "tokenizer.ggml.eot_token_id"), _meta_int(meta, "tokenizer.ggml.eom_token_id")))
    eog = {i for i in eog if i is not None and i < n}
    unused = _unused_mask(texts, kinds)
    used = np.flatnonzero(~unused)
    h = hashlib.sha256()
    for t in texts[CHECK_FROM:]:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return VocabFingerprint(vocab_type=vtype, n_vocab=n, bos_id=_meta_int(meta, "tokenizer.ggml.bos_token_id"),
                            eos_id=eos, add_bos=add_bos, add_eos=add_eos, eog_ids=tuple(sorted(eog)),
                            first_tokens=tuple(texts[:CHECK_FROM]), tokens_sha256=h.hexdigest(),
                            n_used=int(used[-1]) + 1 if used.size else 0)


class HeaderVocab(Tokenizer):
    """A GGUF file's vocabulary from its header alone, enough for `vocab_differences` (no encode/decode).

    Built from a cached `VocabFingerprint`, it reads the token texts only when the rule needs them (the
    digests differ); `piece(i)` is the token text as stored in the file."""

    def __init__(self, path: str | Path, fingerprint: VocabFingerprint, *, name: str | None = None,
                 header=None) -> None:
        fp = self.fingerprint = fingerprint
        self.path = Path(path)
        self.name = name or self.path.name
        self.n_vocab, self.vocab_type = fp.n_vocab, fp.vocab_type
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = fp.bos_id, fp.eos_id, fp.add_bos, fp.add_eos
        self.eos_ids = frozenset(fp.eog_ids)
        self.chat_template = None
        self._texts: list[str] | None = None
        self._unused: np.ndarray | None = None
        if header is not None:
            self._take(header)

    @classmethod
    def from_file(cls, path: str | Path, *, name: str | None = None) -> "HeaderVocab":
        """Read the header now (raises offload.errors.BadModelFile; BackendError when it has no vocabulary)."""
        from offload.gguf_header import read_header

        header = read_header(path)
        fp = header_fingerprint(header)
        if fp is None:
            raise BackendError(f"{Path(path).name} has no tokenizer in its header (not a language model file?)")
        return cls(path, fp, name=name, header=header)

    def _take(self, header) -> None:
        texts, kinds = _token_kinds(header)
        self._texts, self._unused = texts, _unused_mask(texts, kinds)

    def _load(self) -> None:
        if self._texts is None:
            from offload.gguf_header import read_header

            header = read_header(self.path)
            if header_fingerprint(header) != self.fingerprint:
                raise BackendError(f"{self.path} changed since it was listed; list the models again")
            self._take(header)

    def piece(self, token: int) -> bytes:
        self._load()
        return self._texts[token].encode("utf-8", "surrogatepass") if 0 <= token < self.n_vocab else b""

    def is_unused(self, token: int) -> bool:
        if token >= self.fingerprint.n_used:
            return True
        self._load()
        return bool(self._unused[token])


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
