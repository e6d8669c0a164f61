"""The match source's index (app/decoding/lookups.py MatchIndex): its sorted blocks for long sequences must
propose exactly what one plain table of every n-gram proposes, the same continuations in the same order
with the same shares, on random token streams and on real text; and a 100 KB file is indexed whole (its speed
is measured by scripts/measure_attachments.py, docs/measurements/attachments.md)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from app.decoding import lookups
from app.decoding.lookups import MAX_NGRAM, PER_KEY, MatchIndex

ROOT = Path(__file__).resolve().parents[1]


class PlainIndex:
    """The reference: every n-gram of every added sequence -> {next token: count}, in one dict."""

    def __init__(self, max_n: int = MAX_NGRAM) -> None:
        self.max_n, self.table = max_n, {}

    def add(self, seq, start: int = 0) -> None:
        seq = tuple(seq)
        for i in range(max(start, 1), len(seq)):
            for n in range(1, min(self.max_n, i) + 1):
                d = self.table.setdefault(seq[i - n:i], {})
                d[seq[i]] = d.get(seq[i], 0) + 1

    def propose(self, text):
        tail = tuple(text[-self.max_n:])
        for n in range(len(tail), 0, -1):
            d = self.table.get(tail[-n:])
            if d:
                total = sum(d.values())
                best = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:PER_KEY]
                return [(tok, n, c / total) for tok, c in best]
        return []


def _queries(seqs, rng, vocab, count):
    """Tails cut from the indexed text (long matches), mutated ones (matches that break) and random ones."""
    out = []
    for _ in range(count):
        seq = rng.choice(seqs)
        end = rng.randrange(0, len(seq) + 1)
        q = list(seq[max(0, end - rng.randrange(0, 12)):end])
        if q and rng.random() < 0.3:
            q[rng.randrange(len(q))] = rng.randrange(vocab)
        if rng.random() < 0.1:
            q = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        out.append(q)
    return out


def _same(seqs_and_starts, queries, max_n=MAX_NGRAM):
    fast, plain = MatchIndex(max_n), PlainIndex(max_n)
    for seq, start in seqs_and_starts:
        fast.add(seq, start)
        plain.add(seq, start)
    for q in queries:
        assert fast.propose(q) == plain.propose(q), q


@pytest.mark.parametrize("seed", range(6))
def test_blocks_and_small_adds_propose_what_one_plain_table_does_on_random_streams(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 8, 50, 1000])
    # a long prompt (a block), a second long sequence (another block) and the small adds of answer beams
    seqs = [([rng.randrange(vocab) for _ in range(rng.randrange(300, 2000))], rng.choice([0, 0, 5]))]
    seqs.append(([rng.randrange(vocab) for _ in range(700)], 0))
    for _ in range(20):
        beam = seqs[0][0][-8:] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        seqs.append((beam, rng.randrange(0, len(beam))))
    queries = _queries([s for s, _ in seqs], rng, vocab, 1500)
    _same(seqs, queries, max_n=rng.choice([1, 4, MAX_NGRAM]))


def test_a_block_equals_the_plain_table_at_every_start_and_on_short_sequences():
    rng = random.Random(7)
    seq = [rng.randrange(4) for _ in range(lookups.BLOCK_MIN + 40)]
    for start in (0, 1, 2, 9, 39, 41, 300):
        _same([(seq, start)], _queries([seq], rng, 4, 300))
    _same([([1, 2], 0), ([], 0), ([5], 0)], [[1], [2], [5], [], [1, 2]])


def _words(text):
    vocab = {}
    return [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+|[^\w\s]|\s+", text)]


def test_blocks_propose_what_one_plain_table_does_on_real_text():
    code = sorted((ROOT / "app" / "attachments").glob("*.py"))
    text = (ROOT / "README.md").read_text(encoding="utf-8") + "".join(p.read_text("utf-8") for p in code)
    rng = random.Random(3)
    for ids in (list(text.encode()[:60_000]), _words(text)):  # bytes (many repeats) and words
        answer = ids[-500:-300]  # an answer copying a stretch of the prompt, added as beams would be
        seqs = [(ids, 0), (ids[-8:] + answer, 8)]
        _same(seqs, _queries([ids, answer], rng, max(ids) + 1, 3000))


def test_a_100kb_attachment_is_indexed_whole():
    rng = np.random.default_rng(0)
    ids = rng.zipf(1.3, 30_000) % 50_000  # about the tokens of 100 KB of prose and code, Zipf-like repeats
    idx = MatchIndex()
    idx.add(ids.tolist())
    tail = ids[1000:1010].tolist()
    assert idx.propose(tail)[0][1] == MAX_NGRAM
