"""A prompt's cache and the chats before it: the check both runtimes' tests run (tests/test_llamacpp.py,
tests/test_pytorch.py) through `backends.base.PrefillReuse`."""

from __future__ import annotations

import random
from typing import Callable

import numpy as np

from backends.base import Forest


def last_logits(ctx, ids) -> np.ndarray:
    ctx.prefill(ids[:-1])
    return np.array(ctx.evaluate(Forest(suffix=((ids[-1],),))).roots[0])


def history_does_not_count(context: Callable, base: list[int], chunk: int, answer: Callable,
                           fed: Callable) -> None:
    """Prompts after other prompts and answers get the last logits a fresh context gives them, bit for bit, and
    write what PrefillReuse says: whole aligned chunks of an earlier prompt kept, the same prompt kept whole, a
    next turn that continues the row an answer left keeps the row, and that turn edited keeps it up to the edit.

    context(): a fresh context writing prompts in chunks of `chunk` tokens; answer(ctx, rng): forests and commits
    past the prompt; fed(ctx): a list that gets the token count of each forward pass ctx runs from then on.
    `base`: at least 2 * chunk + 13 token ids."""
    rng = random.Random(0)
    b = base[:2 * chunk + 5] + [rng.randrange(100, 5000) for _ in range(8)]  # shares 2 chunks + 5: keeps 2 chunks
    c = base[:5] + [rng.randrange(100, 5000) for _ in range(20)]  # shares 5 with b: keeps none
    fresh = {}
    for name, ids in (("b", b), ("c", c)):
        fresh[name] = last_logits(context(), ids)
    ctx = context()
    counts = fed(ctx)
    last_logits(ctx, base[:20])  # written as whole chunks, a partial one and one token: none of it is kept
    last_logits(ctx, base[:2 * chunk + 13])
    for name, ids, kept in (("b", b, 2 * chunk), ("c", c, 0), ("b", b, 0), ("b", b, len(b) - 1)):
        answer(ctx, rng)
        if kept == len(b) - 1:  # the same prompt again, straight after its own prefill: every cell kept
            ctx.prefill(b[:-1])
        counts.clear()
        got = last_logits(ctx, ids)
        assert sum(counts[:-1]) == len(ids) - 1 - kept, (name, counts)
        assert np.array_equal(got, fresh[name]), (name, float(np.abs(got - fresh[name]).max()))
    answer(ctx, rng)  # the next turn: the prompt continues the row the answer left; only its new tokens are fed
    row = max((ctx.tokens(r) for r in range(ctx.rows)), key=len)
    counts.clear()
    ctx.prefill(list(row) + [11, 12, 13])
    assert counts == [3]
    counts.clear()
    ctx.prefill(list(row) + [14])  # that turn edited: it keeps the chat up to the edit
    assert counts == [1]
