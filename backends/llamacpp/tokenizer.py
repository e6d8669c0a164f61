"""GGUF tokenizer through llama.cpp's vocabulary (a vocab-only load reads metadata, no weights)."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Iterable

import llama_cpp.llama_cpp as ll

from backends.llamacpp._native import ModelHandle
from backends.base import Tokenizer

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
_UNUSED = ll.LLAMA_TOKEN_ATTR_UNUSED


class GGUFTokenizer(Tokenizer):
    """llama.cpp tokenization for one GGUF model (shares the model's handle when built by the runtime)."""

    def __init__(self, handle: ModelHandle, *, owner: bool = False) -> None:
        self._h = handle
        self._owner = owner  # a standalone tokenizer frees its handle; the runtime's leaves it to the model
        v = handle.vocab
        self.name = handle.meta("general.name") or handle.path.stem
        self.gguf_path = handle.path  # the file whose header fingerprint vouches for these token texts
        self.n_vocab = ll.llama_vocab_n_tokens(v)
        self.vocab_type = VOCAB_TYPES.get(ll.llama_vocab_type(v), "unknown")
        bos = ll.llama_vocab_bos(v)
        self.bos_id = bos if bos >= 0 else None
        eos = ll.llama_vocab_eos(v)
        self.eos_id = eos if eos >= 0 else None
        self.add_bos = bool(ll.llama_vocab_get_add_bos(v))
        # llama.cpp's own end-of-generation set (EOS, EOT, EOM and known end markers).
        eog = {i for i in range(self.n_vocab) if ll.llama_vocab_is_eog(v, i)}
        self.eos_ids = frozenset(eog | ({self.eos_id} if self.eos_id is not None else set()))
        tpl = ll.llama_model_chat_template(handle.ptr, None)
        self.chat_template = tpl.decode("utf-8", "replace") if tpl else None
        self._buf = ctypes.create_string_buffer(256)
        self._buf_lock = threading.Lock()  # one tokenizer serves an answer and a load's vocabulary check at once
        self._text: dict[int, bytes] = {}  # token -> its text piece (decode), filled as tokens are met

    @classmethod
    def from_file(cls, path: Path) -> "GGUFTokenizer":
        """A standalone tokenizer that owns a vocab-only handle."""
        return cls(ModelHandle(Path(path), vocab_only=True), owner=True)

    def encode(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        for _ in range(2):  # second try with the exact size llama.cpp asked for
            out = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._h.vocab, data, len(data), out, cap, False, special)
            if n >= 0:
                break
            cap = -n
        ids = list(out[:n])
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def _piece(self, token: int, special: bool) -> bytes:
        with self._buf_lock:
            n = ll.llama_token_to_piece(self._h.vocab, token, self._buf, len(self._buf), 0, special)
            if n < 0:
                self._buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._h.vocab, token, self._buf, len(self._buf), 0, special)
            return self._buf.raw[:n]

    def piece(self, token: int) -> bytes:
        return self._piece(token, True)

    def decode(self, ids: Iterable[int]) -> bytes:
        # special=False renders control tokens as b"" (text pieces of user-defined tokens stay). A token's piece is
        # fixed by the vocabulary, so each is asked of llama.cpp once (a stream decodes a token or two per step).
        text, out = self._text, []
        for i in ids:
            piece = text.get(i)
            if piece is None:
                piece = text[int(i)] = self._piece(int(i), False)
            out.append(piece)
        return b"".join(out)

    def is_unused(self, token: int) -> bool:
        return bool(ll.llama_vocab_get_attr(self._h.vocab, token) & _UNUSED)

    def close(self) -> None:
        if self._owner:
            self._h.close()
