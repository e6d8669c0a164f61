"""Small explicit models the decoding tests share (tests/test_decoding.py, tests/test_exact_real.py,
tests/test_forest_policy.py): a bigram target / draft pair with pass costs for the adaptive policy, and a pair
whose logits hash the whole sequence."""

from __future__ import annotations

import zlib

import numpy as np

from app.engine.auto import CostCurve
from refmodel import TableModel, bigram


V = 4  # token 0 is EOS
TARGET = bigram(V, 11)
DRAFT = bigram(V, 12, sharp=1.0)  # a different model: many rejections


# Pass costs under which the adaptive forest policy (tests/test_forest_policy.py) changes gamma and W_S with the
# acceptance it sees on TARGET / DRAFT (gamma 0-2, W_S 2-3): sample_arm asserts that it did vary.
VARYING = (CostCurve.of({1: 1.0, 2: 1.1, 4: 1.3, 5: 1.7, 6: 1.8, 8: 2.1}), CostCurve.of({1: 0.3, 8: 0.36}))


# --- a model whose logits depend on the whole sequence (bigram tables only see the last token) -------------

SV = 12  # vocabulary of the sequence-hash model; EOS off so every answer has max_new_tokens tokens


def hashed(salt: int, scale: float = 1.3):
    """A TableModel over SV tokens whose logits are normal draws seeded by the whole sequence (and `salt`)."""
    def fn(seq):
        return np.random.default_rng(zlib.crc32(np.asarray(seq, np.int32).tobytes()) + salt).normal(size=SV) * scale
    m = TableModel(fn, SV)
    m.tokenizer.eos_ids = frozenset()
    return m


SEQ_TARGET, SEQ_DRAFT = hashed(0), hashed(99, 3.9)  # an unrelated draft: most layers fail
