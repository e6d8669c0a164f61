"""A reference implementation of the backend protocol over explicit sequences (no KV tricks at all).

`TableModel(fn)` scores a sequence with `fn(tokens) -> logits [V]`. Its context keeps every row and
every pending node as a plain token list, so it is the oracle for both the decoders' use of the
protocol (it asserts on misuse) and the real runtimes' forest/commit behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.base import ROOT, AcceptedPath, ContextFull, Forest, Logits, ModelInfo


class CharTokenizer:
    """Token i is the character chr(ord('a') + i - 1); token 0 is EOS."""

    def __init__(self, vocab: int) -> None:
        self.n_vocab, self.bos_id, self.eos_ids = vocab, None, frozenset({0})
        self.vocab_type, self.add_bos, self.chat_template, self.name = "char", False, None, "char"

    def encode(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return [ord(c) - ord("a") + 1 for c in text]

    def decode(self, ids) -> bytes:
        return "".join("" if i == 0 else chr(ord("a") + i - 1) for i in ids).encode()

    def piece(self, i: int) -> bytes:
        return self.decode([i])

    def is_eog(self, i: int) -> bool:
        return i in self.eos_ids


def bigram(vocab: int, seed: int, *, sharp: float = 1.5) -> "TableModel":
    """A random bigram table model: logits depend on the last token only."""
    table = np.random.default_rng(seed).normal(size=(vocab, vocab)) * sharp  # [prev, next]
    return TableModel(lambda seq: table[seq[-1]], vocab)


class TableModel:
    def __init__(self, fn, vocab: int, name: str = "table") -> None:
        self.fn, self.vocab = fn, vocab
        self.info = ModelInfo(name=name, backend="reference", vocab_size=vocab, n_ctx_train=1 << 16,
                              n_layers=1, kv_bytes_per_token=1, weight_bytes=0)
        self.tokenizer = CharTokenizer(vocab)
        self.passes = 0

    def context(self, *, rows: int, max_tokens: int) -> "RefContext":
        return RefContext(self, rows, max_tokens)

    def close(self) -> None:
        pass


@dataclass
class _Node:
    row: int
    parent: int
    token: int
    seq: list[int]


class RefContext:
    partial_outputs = False  # True: honours Forest.outputs, as llama.cpp's context does

    def __init__(self, model: TableModel, max_rows: int, max_tokens: int) -> None:
        self.model, self.max_rows, self.max_tokens = model, max_rows, max_tokens
        self._rows: list[list[int]] = []
        self._fed: dict[int, list[int]] = {}
        self._nodes: list[_Node] = []

    @property
    def rows(self) -> int:
        return len(self._rows)

    def lengths(self) -> list[int]:
        return [len(r) for r in self._rows]

    def prefill(self, ids) -> None:
        self._rows, self._fed, self._nodes = [list(ids)], {}, []

    def _logits(self, seq: list[int]) -> np.ndarray:
        if len(seq) > self.max_tokens:
            raise ContextFull(f"{len(seq)} tokens > {self.max_tokens}")
        return np.asarray(self.model.fn(seq), dtype=np.float32)

    def evaluate(self, forest: Forest) -> Logits:
        self.model.passes += 1
        root_rows, roots = [], []
        for r, suffix in enumerate(forest.suffix):
            if suffix:
                assert r not in self._fed, f"row {r}: suffix fed twice before a commit"
                self._fed[r] = list(suffix)
                root_rows.append(r)
                roots.append(self._logits(self._rows[r] + self._fed[r]))
        assert self.partial_outputs or not forest.outputs, "Forest.outputs for a context that returns every node"
        nodes = []
        for t, p, r, out in zip(forest.tokens, forest.parents, forest.rows, forest.output_flags):
            assert r in self._fed, f"row {r}: node before its suffix was fed"
            if p == ROOT:
                seq = self._rows[r] + self._fed[r] + [t]
            else:
                assert self._nodes[p].row == r, "a node's parent lies in another row"
                seq = self._nodes[p].seq + [t]
            self._nodes.append(_Node(r, p, t, seq))
            if out:
                nodes.append(self._logits(seq))
        v = self.model.vocab
        return Logits(tuple(root_rows), np.array(roots).reshape(-1, v), np.array(nodes).reshape(-1, v))

    def commit(self, paths) -> None:
        assert 0 < len(paths) <= self.max_rows, f"{len(paths)} rows > {self.max_rows}"
        new = []
        for path in paths:
            seq = self._rows[path.row] + self._fed.get(path.row, [])
            parent = ROOT
            for n in path.nodes:
                node = self._nodes[n]
                assert node.row == path.row and node.parent == parent, "commit path is not a chain"
                seq.append(node.token)
                parent = n
            new.append(seq)
        self._rows, self._fed, self._nodes = new, {}, []

    def truncate(self, n: int) -> None:
        self._rows = [r[:n] for r in self._rows]
        self._fed, self._nodes = {}, []

    def kv_bytes(self) -> int:
        return sum(map(len, self._rows)) + sum(map(len, self._fed.values())) + len(self._nodes)

    def close(self) -> None:
        pass


__all__ = ["TableModel", "RefContext", "bigram", "CharTokenizer", "AcceptedPath"]
