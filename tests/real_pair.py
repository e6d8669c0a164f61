"""Real-model helpers for exactness checks on real vocabularies.

`SequentialModel` wraps a loaded runtime model so that every query's logits are a function of its token
sequence alone: each distinct sequence is scored once, from scratch on a one-row context (prompt prefix reused),
and cached. Two decoders reading through it see bit-identical logits for the same sequence, whatever forest or
batch they put it in, so a difference in distribution between them is the algorithm's, not the runtime's.
`Recorder` does the opposite: it passes a real context through and records, per query, its sequence and the
logits the forest pass gave, to be compared with sequential scoring afterwards.
"""

from __future__ import annotations

import numpy as np

from backends.base import Forest
from refmodel import RefContext, TableModel


class SequentialModel(TableModel):
    """A TableModel whose fn scores a sequence with the real model, one sequence per pass, cached."""

    def __init__(self, model, *, temperature: float = 1.0, n_ctx: int = 512) -> None:
        self.real, self.cache, self.temperature = model, {}, temperature
        self.ctx = model.context(rows=1, max_tokens=n_ctx)
        super().__init__(self.score, model.info.vocab_size, name=model.info.name)
        self.tokenizer = model.tokenizer

    def score(self, seq) -> np.ndarray:
        key = tuple(int(t) for t in seq)
        got = self.cache.get(key)
        if got is None:
            self.ctx.prefill(list(key[:-1]))
            got = self.ctx.evaluate(Forest(suffix=((key[-1],),))).roots[0].astype(np.float32)
            self.cache[key] = got
        return got / self.temperature if self.temperature != 1.0 else got

    def close(self) -> None:
        self.ctx.close()


class Recorder:
    """A Context that forwards to `real` and records (sequence, logits) for every query it answers."""

    def __init__(self, real, vocab: int) -> None:
        self.real = real
        self.shadow = RefContext(TableModel(lambda seq: np.zeros(1, np.float32), 1), 1 << 10, 1 << 20)
        self.seen: list[tuple[tuple[int, ...], np.ndarray]] = []

    @property
    def rows(self) -> int:
        return self.real.rows

    def lengths(self):
        return self.real.lengths()

    def prefill(self, ids) -> None:
        self.real.prefill(ids)
        self.shadow.prefill(ids)

    def evaluate(self, forest: Forest):
        out = self.real.evaluate(forest)
        rows = [r for r, s in enumerate(forest.suffix) if s]
        base = len(self.shadow._nodes)
        self.shadow.evaluate(forest)
        for i, r in enumerate(rows):
            seq = tuple(self.shadow._rows[r] + self.shadow._fed[r])
            self.seen.append((seq, out.roots[i]))
        for j in range(len(forest.tokens)):
            self.seen.append((tuple(self.shadow._nodes[base + j].seq), out.nodes[j]))
        return out

    def commit(self, paths) -> None:
        self.real.commit(paths)
        self.shadow.commit(paths)

    def truncate(self, n: int) -> None:
        self.real.truncate(n)
        self.shadow.truncate(n)

    def kv_bytes(self) -> int:
        return self.real.kv_bytes()

    def close(self) -> None:
        pass
