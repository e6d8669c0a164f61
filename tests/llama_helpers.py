"""A tiny random llama for the llama.cpp tests (tests/test_llamacpp.py, tests/test_rpc.py, tests/test_unique_paths.py):
its GGUF writer and loader, a from-scratch oracle, random forests over it and the checks of a forest's logits.

f32 weights: logits move smoothly with rounding, so one tolerance (TOL) separates a wrong mask (O(1)
differences) from summation order.
"""

from __future__ import annotations

import random

import numpy as np

from backends.base import ROOT, AcceptedPath, Forest
from backends.registry import ModelSpec

TOL = 1e-4  # random f32 model; measured worst here: 1.2e-6


def write_random_llama(path, *, seed: int = 0, n_embd: int = 64, n_layer: int = 3, n_head: int = 4,
                       n_head_kv: int = 2, n_ff: int = 128):
    """A llama-architecture GGUF with random f32 weights and a byte-level SentencePiece vocab (269 ids)."""
    from gguf_files import write_gguf

    return write_gguf(path, name="random-llama", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                      n_head_kv=n_head_kv, context=1024, add_bos=None, chat_template=None, seed=seed, unk=0,
                      scores=True, embed_scale=1.0)[0]


def load(path):
    from backends import llamacpp

    # One thread: the CI box is shared, and spinning ggml workers collapse under oversubscription.
    return llamacpp.load(path, ModelSpec(source=str(path), n_threads=1))


def make_oracle(model):
    """Logits after an explicit token sequence, computed from scratch in a separate context."""
    ref = model.context(rows=1, max_tokens=256, max_seqs=1)
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def run(seq) -> np.ndarray:
        seq = tuple(seq)
        if seq not in cache:
            ref.truncate(0)  # nothing cached to reuse: a true from-scratch pass
            ref.prefill(seq[:-1])
            cache[seq] = ref.evaluate(Forest(suffix=((seq[-1],),))).roots[0]
        return cache[seq]

    run.close = ref.close
    return run


PROMPT_IDS = [1, 5, 200, 17, 42, 42, 99, 3, 150, 260, 261, 7, 8, 9]  # random model: any ids < 269


def three_rows(model, prompt=PROMPT_IDS, **kw):
    """A context with 3 different rows made by committing duplicated paths from one prompt."""
    ctx = model.context(rows=4, max_tokens=512, **kw)
    ctx.prefill(prompt[:-1])
    ctx.evaluate(Forest(suffix=((prompt[-1],),), tokens=(11, 12, 13), parents=(ROOT, ROOT, 0), rows=(0, 0, 0)))
    ctx.commit([AcceptedPath(0, (0, 2)), AcceptedPath(0, (1,)), AcceptedPath(0, (0,))])
    return ctx


class Tree:
    """A random forest in breadth-first order, with the explicit token path of every node."""

    def __init__(self, rows: list[list[int]], seed: int, *, vocab: int, depth: int = 3) -> None:
        rng = random.Random(seed)
        tok = lambda: rng.randrange(3, vocab)  # noqa: E731
        self.rows = rows
        self.suffix = tuple((tok(),) for _ in rows)
        self.tokens, self.parents, self.row_of, self.depth = [], [], [], []
        frontier = {r: [ROOT] for r in range(len(rows) - 1)}  # the last row stays childless
        for d in range(1, depth + 1):
            for r, parents in frontier.items():
                nxt = []
                for p in parents:
                    for _ in range(rng.choice((1, 2, 2, 3)) if d < depth else rng.choice((1, 2))):
                        nxt.append(self.add(tok(), p, r, d))
                if d == 1:  # a duplicate (parent, token) pair: same text, distinct cells
                    nxt.append(self.add(self.tokens[nxt[0]], ROOT, r, d))
                frontier[r] = nxt[:4]

    def add(self, tok: int, parent: int, row: int, depth: int) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.row_of.append(row)
        self.depth.append(depth)
        return len(self.tokens) - 1

    def seq(self, i: int) -> list[int]:
        r, path = self.row_of[i], []
        while i != ROOT:
            path.append(self.tokens[i])
            i = self.parents[i]
        return self.rows[r] + list(self.suffix[r]) + path[::-1]

    def forest(self, ids: list[int], with_suffix: bool) -> Forest:
        return Forest(
            suffix=self.suffix if with_suffix else (),
            tokens=tuple(self.tokens[i] for i in ids),
            parents=tuple(self.parents[i] for i in ids),
            rows=tuple(self.row_of[i] for i in ids),
        )


def check_logits(out, tree: Tree, ids: list[int], oracle, roots: bool, tol: float = TOL) -> float:
    """Max |logit - from-scratch logit| over the call's roots and nodes; asserts it is within tol."""
    worst = 0.0
    if roots:
        assert out.root_rows == tuple(range(len(tree.rows)))
        for k, r in enumerate(out.root_rows):
            worst = max(worst, float(np.abs(out.roots[k] - oracle(tree.rows[r] + list(tree.suffix[r]))).max()))
    assert out.nodes.shape[0] == len(ids)
    for k, i in enumerate(ids):
        worst = max(worst, float(np.abs(out.nodes[k] - oracle(tree.seq(i))).max()))
    assert worst <= tol
    return worst


def rows_of(ctx) -> list[list[int]]:
    return [ctx.tokens(r) for r in range(ctx.rows)]


def deepest(tree: Tree, row: int) -> tuple[int, ...]:
    leaf = max((i for i, r in enumerate(tree.row_of) if r == row), key=lambda i: tree.depth[i])
    chain = []
    while leaf != ROOT:
        chain.append(leaf)
        leaf = tree.parents[leaf]
    return tuple(chain[::-1])


def iterate(ctx, oracle, seed: int, choose, vocab: int) -> None:
    """Evaluate a forest, commit the paths `choose` picks, then check one step per row from scratch."""
    rows = rows_of(ctx)
    tree = Tree(rows, seed, vocab=vocab)
    ids = list(range(len(tree.tokens)))
    check_logits(ctx.evaluate(tree.forest(ids, with_suffix=True)), tree, ids, oracle, roots=True)
    paths = choose(tree)
    ctx.commit(paths)
    want = [rows[p.row] + list(tree.suffix[p.row]) + [tree.tokens[n] for n in p.nodes] for p in paths]
    assert rows_of(ctx) == want
    assert ctx.lengths() == [len(w) for w in want]
    step = Tree(want, seed + 100, vocab=vocab, depth=1)
    step_ids = list(range(len(step.tokens)))
    check_logits(ctx.evaluate(step.forest(step_ids, with_suffix=True)), step, step_ids, oracle, roots=True)
    ctx.commit([AcceptedPath(r) for r in range(ctx.rows)])  # the step's suffix becomes committed history
