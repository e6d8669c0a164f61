"""llama.cpp runtime: forest == sequential, commit keeps KV, prefix reuse, limits and load errors.

Two models. Equivalence oracles run on a tiny random llama with f32 weights written here with `gguf`:
its logits move smoothly with rounding, so one tolerance separates a wrong mask (O(1) differences) from
summation order. The real `tiny` preset (Q4_1) re-quantizes activations to 8 bits inside every matmul,
so a one-ulp change in attention (a masked sibling shifts which SIMD lane a cell is summed in) can flip
an int8 rounding and move logits by up to ~1 (KL ~1e-3); real-weight checks use a looser, measured bound.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends.registry import ModelSpec
from backends.base import ROOT, AcceptedPath, BackendError, ContextFull, Forest
from llama_helpers import (PROMPT_IDS, TOL, Tree, check_logits, deepest, iterate, load, make_oracle, rows_of,
                           three_rows, write_random_llama)
from prefill_history import history_does_not_count

gguf = pytest.importorskip("gguf")
llamacpp = pytest.importorskip("backends.llamacpp")

TINY_KL = 0.05  # tiny Q4_1 model vs from-scratch; measured worst here: 0.011 (max |dlogit| 1.1)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = load(write_random_llama(tmp_path_factory.mktemp("gguf") / "random.gguf"))
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    m = load(tiny_gguf_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def oracle(model):
    run = make_oracle(model)
    yield run
    run.close()


# -- model facts --------------------------------------------------------------------------------------

def test_info(tiny, tiny_gguf_path):
    info = tiny.info
    assert info.backend == "llamacpp" and info.vocab_size == 49152 and info.n_layers == 30
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 kv heads x 64, f32 cache
    assert info.weight_bytes == tiny_gguf_path.stat().st_size
    assert info.n_ctx_train == 8192
    f16 = llamacpp.load(tiny_gguf_path, ModelSpec(source="tiny", n_threads=1), kv_type="f16")
    assert f16.info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    f16.close()


# -- forest == sequential (random f32 model) ------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forest_one_call_equals_sequential(model, oracle, seed):
    with three_rows(model) as ctx:
        rows = rows_of(ctx)
        assert len({tuple(r) for r in rows}) == 3
        tree = Tree(rows, seed, vocab=model.info.vocab_size)
        ids = list(range(len(tree.tokens)))
        out = ctx.evaluate(tree.forest(ids, with_suffix=True))
        assert out.roots.dtype == np.float32 and out.nodes.dtype == np.float32
        check_logits(out, tree, ids, oracle, roots=True)


@pytest.mark.parametrize("seed", [3, 4])
def test_forest_layer_by_layer_equals_sequential(model, oracle, seed):
    with three_rows(model) as ctx:
        tree = Tree(rows_of(ctx), seed, vocab=model.info.vocab_size)
        for d in range(1, max(tree.depth) + 1):
            ids = [i for i, dd in enumerate(tree.depth) if dd == d]
            check_logits(ctx.evaluate(tree.forest(ids, with_suffix=d == 1)), tree, ids, oracle, roots=d == 1)
        # Late siblings: new children under a node and a root whose subtrees were decoded earlier.
        late = [tree.add(250 + k, p, 0, 0) for k, p in enumerate((0, 1, ROOT))]
        check_logits(ctx.evaluate(tree.forest(late, with_suffix=False)), tree, late, oracle, roots=False)


# -- commit then step == recompute ----------------------------------------------------------------------


def test_commit_then_step_equals_recompute(model, oracle):
    v = model.info.vocab_size
    with three_rows(model) as ctx:
        # Full-depth path, a duplicated row (shorter copy of the same chain), a row failing at depth 0,
        # row 1 dropped.
        iterate(ctx, oracle, 5, lambda t: [AcceptedPath(0, deepest(t, 0)), AcceptedPath(0, deepest(t, 0)[:2]),
                                           AcceptedPath(2)], v)
        assert ctx.rows == 3
        # Second iteration on the compacted rows: positions continue after the kept paths.
        iterate(ctx, oracle, 6, lambda t: [AcceptedPath(1, deepest(t, 1)), AcceptedPath(1, deepest(t, 1)),
                                           AcceptedPath(0, deepest(t, 0)[:1]), AcceptedPath(2)], v)
        assert ctx.rows == 4


def test_freed_cell_reused_out_of_order(model, oracle):
    """Keep the second of two siblings: the next token lands in the freed cell below a live one."""
    prompt = [1, 100, 101, 102, 103]
    with model.context(rows=2, max_tokens=64) as ctx:
        ctx.prefill(prompt)
        ctx.evaluate(Forest(tokens=(9, 10), parents=(ROOT, ROOT), rows=(0, 0)))
        ctx.commit([AcceptedPath(0, (1,))])
        out = ctx.evaluate(Forest(suffix=((7,),), tokens=(8,), parents=(ROOT,), rows=(0,)))
        assert np.abs(out.roots[0] - oracle(prompt + [10, 7])).max() <= TOL
        assert np.abs(out.nodes[0] - oracle(prompt + [10, 7, 8])).max() <= TOL


def distinct_cells(rows: list[list[int]]) -> int:
    trie: set[tuple[int, ...]] = set()
    for r in rows:
        trie.update(tuple(r[:k]) for k in range(1, len(r) + 1))
    return len(trie)


def test_kv_bytes_counts_shared_cells(model):
    with three_rows(model) as ctx:
        per = model.info.kv_bytes_per_token
        rows = rows_of(ctx)
        assert ctx.kv_bytes() == distinct_cells(rows) * per
        ctx.evaluate(Forest(suffix=((1,), (2,), ()), tokens=(5, 6), parents=(ROOT, 0), rows=(0, 0)))
        assert ctx.kv_bytes() == (distinct_cells(rows) + 4) * per
        ctx.commit([AcceptedPath(0, (0,)), AcceptedPath(0, (0,))])
        assert ctx.kv_bytes() == (len(rows[0]) + 2) * per  # a duplicated row shares its cells


# -- prefill / truncate ---------------------------------------------------------------------------------

def test_prefill_after_rows(model, oracle):
    """A prompt after several rows: one row, its logits right (what it keeps: the history tests below)."""
    with three_rows(model) as ctx:
        other = ctx.tokens(1)[:-2] + [77, 78, 79]  # shares all but the last two tokens of row 1
        ctx.prefill(other[:-1])
        assert ctx.rows == 1 and ctx.lengths() == [len(other) - 1]
        assert ctx.kv_bytes() == (len(other) - 1) * model.info.kv_bytes_per_token
        out = ctx.evaluate(Forest(suffix=((other[-1],),)))
        assert np.abs(out.roots[0] - oracle(other)).max() <= TOL
        ctx.prefill(PROMPT_IDS[:5])  # a strict prefix of the row
        out = ctx.evaluate(Forest(suffix=((PROMPT_IDS[5],),)))
        assert np.abs(out.roots[0] - oracle(PROMPT_IDS[:6])).max() <= TOL


def test_prefill_in_chunks(model, oracle):
    with model.context(rows=1, max_tokens=200, n_batch=16) as ctx:
        ids = [(i * 37) % 260 + 3 for i in range(70)]
        ctx.prefill(ids[:-1])  # 5 decodes of <= 16 tokens
        out = ctx.evaluate(Forest(suffix=((ids[-1],),)))
        assert np.abs(out.roots[0] - oracle(ids)).max() <= TOL


def test_truncate(model, oracle):
    with three_rows(model) as ctx:
        ctx.evaluate(Forest(suffix=((9,), (9,), (9,)), tokens=(5,), parents=(ROOT,), rows=(1,)))
        before = ctx.lengths()
        n = len(PROMPT_IDS) + 1
        ctx.truncate(n)
        assert ctx.lengths() == [min(k, n) for k in before]
        rows = rows_of(ctx)
        out = ctx.evaluate(Forest(suffix=((21,), (22,), (23,))))
        for k in range(3):
            assert np.abs(out.roots[k] - oracle(rows[k] + [21 + k])).max() <= TOL


# -- limits and errors ----------------------------------------------------------------------------------

def test_context_full(model):
    with model.context(rows=2, max_tokens=256) as ctx:
        with pytest.raises(ContextFull, match="300 tokens"):
            ctx.prefill([5] * 300)
        ctx.prefill([3 + i % 250 for i in range(250)])
        ctx.evaluate(Forest(tokens=(1, 2, 3, 4, 5, 6), parents=(ROOT,) * 6, rows=(0,) * 6))  # exactly 256 cells
        with pytest.raises(ContextFull, match="256"):
            ctx.evaluate(Forest(tokens=(7,), parents=(0,), rows=(0,)))
        # Duplicated rows share cells: committing two one-node paths frees four of the six pending cells.
        ctx.commit([AcceptedPath(0, (0,)), AcceptedPath(0, (1,))])
        ctx.evaluate(Forest(suffix=((8,), (9,)), tokens=(1, 2), parents=(ROOT, ROOT), rows=(0, 1)))
        with pytest.raises(ContextFull, match="rows"):
            ctx.commit([AcceptedPath(0)] * 3)  # more rows than the context was made for
    with model.context(rows=1, max_tokens=64, max_seqs=3) as ctx:
        ctx.prefill(PROMPT_IDS)
        with pytest.raises(ContextFull, match="sequence ids"):
            ctx.evaluate(Forest(tokens=(1, 2, 3, 4), parents=(ROOT,) * 4, rows=(0,) * 4))
        ctx.evaluate(Forest(tokens=(1, 2, 3), parents=(ROOT,) * 3, rows=(0,) * 3))  # the failed call left no trace
    with model.context(rows=1, max_tokens=64, n_batch=4) as ctx:
        with pytest.raises(ContextFull, match="batch"):
            ctx.evaluate(Forest(tokens=(1,) * 5, parents=(ROOT,) * 5, rows=(0,) * 5))


def test_invalid_forests(model):
    with model.context(rows=2, max_tokens=128) as ctx:
        ctx.prefill(PROMPT_IDS)
        with pytest.raises(ValueError, match="parent"):
            ctx.evaluate(Forest(tokens=(1,), parents=(3,), rows=(0,)))
        with pytest.raises(ValueError, match="out of range"):
            ctx.evaluate(Forest(tokens=(10**6,), parents=(ROOT,), rows=(0,)))
        with pytest.raises(ValueError, match="suffix"):
            ctx.evaluate(Forest(suffix=((5,), (6,))))  # two suffixes for one row
        ctx.evaluate(Forest(tokens=(1,), parents=(ROOT,), rows=(0,)))
        with pytest.raises(ValueError, match="suffix"):
            ctx.evaluate(Forest(suffix=((5,),)))  # the row already has pending nodes
        with pytest.raises(ValueError, match="chain"):
            ctx.commit([AcceptedPath(0, (5,))])
        assert ctx.evaluate(Forest()).nodes.shape == (0, model.info.vocab_size)


@pytest.mark.parametrize("kind", ["truncated", "magic", "missing", "empty"])
def test_bad_files_raise(tiny_gguf_path, tmp_path, kind):
    bad = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        with open(tiny_gguf_path, "rb") as f:
            bad.write_bytes(f.read(3_000_000))
    elif kind == "magic":
        with open(tiny_gguf_path, "rb") as f:
            bad.write_bytes(b"GGML" + f.read(4096)[4:])
    elif kind == "empty":
        bad.write_bytes(b"")
    with pytest.raises(BackendError) as err:
        load(bad)
    msg = str(err.value)
    assert str(bad) in msg
    assert {"truncated": "truncated or corrupt", "magic": "not a GGUF file", "missing": "not found",
            "empty": "not a GGUF file"}[kind] in msg


def test_closed_model_raises(model):
    m = load(model.info.extra["path"])
    ctx = m.context(rows=1, max_tokens=32)
    m.close()
    with pytest.raises(BackendError, match="closed"):
        ctx.prefill([1, 2, 3])
    with pytest.raises(BackendError, match="closed"):
        m.context(rows=1, max_tokens=32)


# -- the real tiny model -----------------------------------------------------------------------------

def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max())
    q = np.exp(q_logits - q_logits.max())
    p, q = p / p.sum(), q / q.sum()
    return float((p * np.log(p / q)).sum())


def test_tiny_forest_and_commit_match_sequential(tiny):
    """Real weights: same protocol checks; equal within 8-bit activation re-quantization noise."""
    oracle = make_oracle(tiny)
    prompt = tiny.tokenizer.encode(PROMPT)
    worst_kl = worst_dl = 0.0
    with three_rows(tiny, prompt) as ctx:
        tree = Tree(rows_of(ctx), 0, vocab=5000, depth=2)
        ids = list(range(len(tree.tokens)))
        out = ctx.evaluate(tree.forest(ids, with_suffix=True))
        got = list(out.roots) + list(out.nodes)
        want = [oracle(r + list(s)) for r, s in zip(tree.rows, tree.suffix)] + [oracle(tree.seq(i)) for i in ids]
        ctx.commit([AcceptedPath(0, deepest(tree, 0)), AcceptedPath(1), AcceptedPath(0, deepest(tree, 0))])
        step = ctx.evaluate(Forest(suffix=((7,),) * 3))
        got += list(step.roots)
        want += [oracle(r + [7]) for r in rows_of(ctx)]
        for g, w in zip(got, want):
            worst_kl, worst_dl = max(worst_kl, kl(w, g)), max(worst_dl, float(np.abs(g - w).max()))
    oracle.close()
    assert worst_kl <= TINY_KL, (worst_kl, worst_dl)


# -- Layout U bookkeeping against a model of llama.cpp's cell rules (no weights, many random steps) ------

class SimKV:
    """llama.cpp's unified cache as far as Layout U relies on it: cells with a position and a set of
    sequence ids; seq_rm / seq_cp over [p0, p1); the batch checks of llama_batch_allocr::init; and
    visibility = the query's FIRST id is on the cell and the cell's position is <= the query's."""

    def __init__(self) -> None:
        self.cells: list[list] = []  # [pos, seq set, label]

    def _range(self, p0: int, p1: int) -> tuple[int, float]:
        return max(p0, 0), (float("inf") if p1 < 0 else p1)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        lo, hi = self._range(p0, p1)
        for c in self.cells:
            if lo <= c[0] < hi:
                c[1].discard(seq)
        self.cells = [c for c in self.cells if c[1]]

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        lo, hi = self._range(p0, p1)
        for c in self.cells:
            if src in c[1] and lo <= c[0] < hi:
                c[1].add(dst)

    def span(self, seq: int) -> tuple[int, int]:
        ps = [c[0] for c in self.cells if seq in c[1]]
        return (min(ps), max(ps)) if ps else (-1, -1)

    def decode(self, tokens, pos, seqs, labels) -> None:
        by_seq: dict[int, list[int]] = {}
        for p, ss in zip(pos, seqs):
            for s in ss:
                by_seq.setdefault(s, []).append(p)
        for s, ps in by_seq.items():
            last = self.span(s)[1]
            assert last < 0 or min(ps) == last + 1, f"seq {s}: positions not consecutive with the cache"
            assert max(ps) - min(ps) + 1 == len(set(ps)) == len(ps), f"seq {s}: positions not continuous"
            assert ps == sorted(ps), f"seq {s}: decreasing positions"
        for ss in seqs:
            for s in ss[1:]:
                assert self.span(s) == self.span(ss[0]), f"coupled seqs {ss[0]} and {s} diverged"
        new = [[p, set(ss), lab] for p, ss, lab in zip(pos, seqs, labels)]
        self.cells += new
        for p, ss, lab in zip(pos, seqs, labels):
            seen = sorted((c[0], c[2]) for c in self.cells if ss[0] in c[1] and c[0] <= p)
            assert seen == [(k, lab[:k + 1]) for k in range(p + 1)], f"query {lab} sees {seen}"

    def check_row(self, seq: int, tokens: list[int]) -> None:
        got = sorted((c[0], c[2]) for c in self.cells if seq in c[1])
        assert got == [(k, tuple(tokens[:k + 1])) for k in range(len(tokens))]


def random_forest(lay, rng: random.Random) -> Forest:
    """Suffixes for some rows without pending nodes, then up to 6 nodes under roots or pending nodes."""
    busy = {n.row for n in lay._nodes}
    suffix = tuple(() if r in busy or rng.random() < 0.3 else tuple(rng.randrange(50) for _ in range(rng.randint(1, 2)))
                   for r in range(lay.rows))
    row_of = [n.row for n in lay._nodes]
    toks, pars = [], []
    for _ in range(rng.randint(0, 6)):
        r = rng.randrange(lay.rows)
        pars.append(rng.choice([ROOT] + [i for i, rr in enumerate(row_of) if rr == r]))
        toks.append(rng.randrange(50))
        row_of.append(r)
    return Forest(suffix=suffix, tokens=tuple(toks), parents=tuple(pars), rows=tuple(row_of[len(lay._nodes):]))


def batch_labels(lay, b, forest: Forest, path_of: dict[int, tuple]) -> list[tuple]:
    """Each token of a planned batch labelled with the whole sequence it ends (the path a query must see);
    records each new pending node's path in `path_of`."""
    seqs = {r: lay.tokens(r) + lay._rows[r].suffix for r in range(lay.rows)}
    labels = []
    for r, suf in b.suffix.items():
        for t in suf:
            seqs[r] = seqs[r] + [t]
            labels.append(tuple(seqs[r]))
    for k, (t, p, r) in enumerate(zip(forest.tokens, forest.parents, forest.rows)):
        path_of[len(lay._nodes) + k] = (path_of[p] if p != ROOT else tuple(seqs[r])) + (t,)
        labels.append(path_of[len(lay._nodes) + k])
    return labels


def random_paths(lay, rng: random.Random) -> list[AcceptedPath]:
    """1-5 chains from random rows, stopping at random depths (duplicates, drops and depth 0 included)."""
    paths = []
    for _ in range(rng.randint(1, 5)):
        r, chain, prev = rng.randrange(lay.rows), [], ROOT
        while True:
            kids = [i for i, n in enumerate(lay._nodes) if n.row == r and n.parent == prev]
            if not kids or rng.random() < 0.3:
                break
            prev = rng.choice(kids)
            chain.append(prev)
        paths.append(AcceptedPath(r, tuple(chain)))
    return paths


@pytest.mark.parametrize("n_seq", [64, 8])
def test_layout_random_walk(n_seq):
    """Hundreds of evaluate / commit / truncate / prefill steps, some decodes failing; every query sees exactly its
    own path, and every spare id holds exactly the first cells of the row it is kept on."""
    from backends.llamacpp.layout import LayoutU

    rng = random.Random(7)
    for _ in range(30):
        sim, lay = SimKV(), LayoutU(n_seq=n_seq, max_rows=6, n_vocab=50)
        path_of: dict[int, tuple] = {}  # pending node -> its full token sequence
        seq, _ = lay.start_prefill([1, 2, 3], sim)
        sim.decode([1, 2, 3], [0, 1, 2], [[seq]] * 3, [(1,), (1, 2), (1, 2, 3)])
        lay.extend_prefill([1, 2, 3])
        for _ in range(40):
            op = rng.random()
            if op < 0.6:
                forest = random_forest(lay, rng)
                try:
                    b = lay.plan(forest)
                except ContextFull:  # out of sequence ids: nothing may have changed
                    continue
                labels = batch_labels(lay, b, forest, path_of)
                lay.stage(b, sim)
                if rng.random() < 0.15:  # llama_decode failed: the cache goes back to what the layout holds
                    lay.unstage(b, sim)
                else:
                    sim.decode(b.tokens, b.pos, b.seqs, labels)
                    lay.apply(b)
            elif op < 0.85:
                lay.commit(random_paths(lay, rng), sim)
            elif op < 0.95:
                lay.truncate(rng.randint(1, 12), sim)
            else:
                rows = [lay.tokens(r) for r in range(lay.rows)]
                ids = rng.choice(rows)[: rng.randint(0, 10)] + [rng.randrange(50) for _ in range(2)]
                seq, start = lay.start_prefill(ids, sim)
                sim.decode(ids[start:], list(range(start, len(ids))), [[seq]] * (len(ids) - start),
                           [tuple(ids[:k + 1]) for k in range(start, len(ids))])
                lay.extend_prefill(ids[start:])
            if op >= 0.6:
                path_of.clear()
            assert lay.cells == len(sim.cells)  # our count is llama.cpp's occupied cells
            if not lay._nodes and not any(r.suffix for r in lay._rows):
                for r in range(lay.rows):
                    sim.check_row(lay._rows[r].seq, lay.tokens(r))
            assert not lay._spare.keys() & lay._tip.keys()
            for s, (r, h) in lay._spare.items():
                assert 0 < h <= len(lay.tokens(r))
                sim.check_row(s, lay.tokens(r)[:h])
            for s in set(range(n_seq)) - lay._spare.keys() - lay._tip.keys():
                assert sim.span(s) == (-1, -1)  # an id neither live nor spare holds nothing


class Counting(SimKV):
    """SimKV that records, per copy or removal, how many cells gained or lost the id: ("cp" | "rm", n)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, int]] = []

    def _held(self, seq: int) -> int:
        return sum(seq in c[1] for c in self.cells)

    def seq_rm(self, seq, p0, p1) -> None:
        before = self._held(seq)
        super().seq_rm(seq, p0, p1)
        self.moves.append(("rm", before - self._held(seq)))

    def seq_cp(self, src, dst, p0, p1) -> None:
        before = self._held(dst)
        super().seq_cp(src, dst, p0, p1)
        self.moves.append(("cp", self._held(dst) - before))


def twins(names: tuple[str, str], prompt: list[int], *, n_seq: int) -> tuple[dict, dict]:
    """Two layouts, each on its own counting cache holding `prompt`; the second keeps no spare ids (it shares nothing,
    so every dropped id is removed and every branch or duplicate gets the whole prefix, as before spares)."""
    from backends.llamacpp.layout import LayoutU

    lays = {k: LayoutU(n_seq=n_seq, max_rows=6, n_vocab=50) for k in names}
    lays[names[1]]._common = lambda j, h, r: 0
    kv = {k: Counting() for k in names}
    for k, lay in lays.items():
        seq, _ = lay.start_prefill(prompt, kv[k])
        kv[k].decode(prompt, list(range(len(prompt))), [[seq]] * len(prompt),
                     [tuple(prompt[:i + 1]) for i in range(len(prompt))])
        lay.extend_prefill(prompt)
    return lays, kv


def test_a_commit_asks_llama_cpp_to_remove_only_cells_that_are_there():
    """Each llama_memory_seq_rm walks the whole cache (13-16 us at 4,096 cells): over a random walk of forests and
    commits, every removal a commit asks for takes at least one cell, and the cache it leaves is the layout's."""
    from backends.llamacpp.layout import LayoutU

    rng = random.Random(11)
    calls = 0
    for _ in range(20):
        sim, lay = Counting(), LayoutU(n_seq=64, max_rows=6, n_vocab=50)
        seq, _ = lay.start_prefill([1, 2, 3], sim)
        sim.decode([1, 2, 3], [0, 1, 2], [[seq]] * 3, [(1,), (1, 2), (1, 2, 3)])
        lay.extend_prefill([1, 2, 3])
        for _ in range(30):
            forest = random_forest(lay, rng)
            try:
                b = lay.plan(forest)
            except ContextFull:
                continue
            lay.stage(b, sim)
            sim.cells += [[p, set(ss), None] for p, ss in zip(b.pos, b.seqs)]
            lay.apply(b)
            sim.moves = []
            lay.commit(random_paths(lay, rng), sim)
            removals = [n for verb, n in sim.moves if verb == "rm"]
            assert all(n > 0 for n in removals), removals
            calls += len(removals)
            assert lay.cells == len(sim.cells)
            for r in range(lay.rows):
                assert sorted(c[0] for c in sim.cells if lay._rows[r].seq in c[1]) == list(range(len(lay.tokens(r))))
    assert calls > 50  # commits that free cells still free them


def test_a_duplicate_on_a_dropped_rows_id_moves_only_the_cells_past_their_prefix():
    """A commit that drops a row and duplicates another puts the duplicate on the dropped row's id, which holds
    the prompt they share: over a random walk after a 200-token prompt, the cells in use equal those of a twin
    that gives every duplicate a fresh id (so llama.cpp places the next tokens alike), each query still sees
    exactly its own path, and after the first step (one row becoming four: full copies either way) the copies and
    removals update far fewer cells."""
    rng = random.Random(5)
    prompt = [rng.randrange(50) for _ in range(200)]
    moved = {"reuse": 0, "fresh": 0}
    for _ in range(6):
        lays, kv = twins(("reuse", "fresh"), prompt, n_seq=64)
        for step in range(25):
            state = rng.getstate()
            for k, lay in lays.items():
                rng.setstate(state)  # the same forest and paths for both
                forest = Forest(suffix=tuple((rng.randrange(50),) for _ in range(lay.rows)))
                b = lay.plan(forest)
                labels = [tuple(lay.tokens(r)) + (t,) for r, suf in b.suffix.items() for t in suf]
                kv[k].decode(b.tokens, b.pos, b.seqs, labels)
                lay.apply(b)
                paths = [AcceptedPath(rng.randrange(lay.rows)) for _ in range(4)]  # four beams resampled
                lay.commit(paths, kv[k])
            cells = {k: sorted((c[0], c[2]) for c in kv[k].cells) for k in lays}
            assert cells["reuse"] == cells["fresh"]
            assert [lays["reuse"].tokens(r) for r in range(lays["reuse"].rows)] == \
                [lays["fresh"].tokens(r) for r in range(lays["fresh"].rows)]
            for r in range(lays["reuse"].rows):
                kv["reuse"].check_row(lays["reuse"]._rows[r].seq, lays["reuse"].tokens(r))
        for k in lays:
            moved[k] += sum(n for _, n in kv[k].moves)
    assert moved["reuse"] * 10 < moved["fresh"], moved


def test_a_forests_branches_take_spare_ids_and_move_only_the_cells_past_their_prefix():
    """After a 200-token prompt, forests and commits (beams dropped, duplicated, extended) on a layout whose dropped
    ids stay on as spares and on a twin that removes them: every query sees exactly its own path, the cells in use
    are equal after every step (llama.cpp places the next tokens alike), and the spares' branches and duplicates
    update far fewer cells (a fresh id gets the whole prompt, and its removal walks it again)."""
    rng = random.Random(9)
    prompt = [rng.randrange(50) for _ in range(200)]
    moved = {"spare": 0, "fresh": 0}
    for _ in range(4):
        lays, kv = twins(("spare", "fresh"), prompt, n_seq=24)
        path_of = {k: {} for k in lays}
        for step in range(30):
            state = rng.getstate()
            for k, lay in lays.items():
                rng.setstate(state)  # the same forest and paths for both
                forest = random_forest(lay, rng)
                try:
                    b = lay.plan(forest)
                except ContextFull:
                    continue
                lay.stage(b, kv[k])
                kv[k].decode(b.tokens, b.pos, b.seqs, batch_labels(lay, b, forest, path_of[k]))
                lay.apply(b)
                if rng.random() < 0.7:
                    lay.commit(random_paths(lay, rng), kv[k])
                    path_of[k].clear()
            assert sorted((c[0], c[2]) for c in kv["spare"].cells) == sorted((c[0], c[2]) for c in kv["fresh"].cells)
            assert [lays["spare"].tokens(r) for r in range(lays["spare"].rows)] == \
                [lays["fresh"].tokens(r) for r in range(lays["fresh"].rows)]
        assert lays["spare"]._spare and not lays["fresh"]._spare
        for k in lays:
            moved[k] += sum(n for _, n in kv[k].moves)
    assert moved["spare"] * 10 < moved["fresh"], moved


def test_a_plain_steps_commit_is_the_general_commit():
    """Committing the only row with its suffix (a plain step) takes a shortcut that calls llama.cpp for nothing:
    rows, ids, shared prefixes and cell counts equal the general commit's (turned off on a twin), and the cache
    the general one's native calls leave is the one the layout describes."""
    from backends.llamacpp.layout import LayoutU

    class Recording(SimKV):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def seq_rm(self, *a) -> None:
            self.calls += 1
            super().seq_rm(*a)

    rng = random.Random(3)
    fast, slow = LayoutU(n_seq=32, max_rows=6, n_vocab=50), LayoutU(n_seq=32, max_rows=6, n_vocab=50)
    slow._keeps_its_row = lambda paths: False
    kv = {id(fast): Recording(), id(slow): Recording()}
    took = 0
    for lay in (fast, slow):
        seq, _ = lay.start_prefill([1, 2, 3], kv[id(lay)])
        kv[id(lay)].decode([1, 2, 3], [0, 1, 2], [[seq]] * 3, [(1,), (1, 2), (1, 2, 3)])
        lay.extend_prefill([1, 2, 3])
    for step in range(60):
        one = ((rng.randrange(50),),) + ((),) * (fast.rows - 1)  # a plain step on row 0 (the only row, mostly)
        forest = Forest(suffix=one) if step % 7 else random_forest(fast, rng)
        for lay in (fast, slow):
            b = lay.plan(forest)
            seqs = {r: lay.tokens(r) + lay._rows[r].suffix for r in range(lay.rows)}
            labels, path_of = [], {}
            for r, suf in b.suffix.items():
                for t in suf:
                    seqs[r] = seqs[r] + [t]
                    labels.append(tuple(seqs[r]))
            for k, (t, par, r) in enumerate(zip(forest.tokens, forest.parents, forest.rows)):
                path_of[k] = (path_of[par] if par != ROOT else tuple(seqs[r])) + (t,)
                labels.append(path_of[k])
            lay.stage(b, kv[id(lay)])
            kv[id(lay)].decode(b.tokens, b.pos, b.seqs, labels)
            lay.apply(b)
        paths = [AcceptedPath(0)] if step % 7 else random_paths(fast, rng)
        calls, shortcut = kv[id(fast)].calls, fast._keeps_its_row(paths)
        took += shortcut
        for lay in (fast, slow):
            lay.commit(paths, kv[id(lay)])
        if shortcut:
            assert kv[id(fast)].calls == calls
        assert [(r.seq, r.tokens, r.suffix) for r in fast._rows] == [(r.seq, r.tokens, r.suffix) for r in slow._rows]
        assert (fast._tip, fast._shared, fast.committed_cells, fast._nodes) == \
            (slow._tip, slow._shared, slow.committed_cells, slow._nodes)
        assert fast.cells == len(kv[id(fast)].cells) == len(kv[id(slow)].cells)
    assert took > 20


# -- a prompt's cache does not depend on what the context did before -------------------------------------

def _decoded(ctx) -> list[int]:
    """Counts the tokens each llama_decode of `ctx` feeds, in a list the test reads."""
    fed, inner = [], ctx._decode

    def counting(tokens, *a):
        fed.append(len(tokens))
        return inner(tokens, *a)

    ctx._decode = counting
    return fed


def _answer(ctx, rng: random.Random) -> None:
    """Random forests and commits past the prompt, as an answer leaves the cache (cells freed between)."""
    for _ in range(4):
        ctx.evaluate(random_forest(ctx._layout, rng))
        ctx.commit(random_paths(ctx._layout, rng)[:4])


def _history_does_not_count(model, base: list[int]) -> None:
    history_does_not_count(lambda: model.context(rows=4, max_tokens=256, n_batch=16), base, 16, _answer, _decoded)


def test_a_prompts_logits_do_not_depend_on_what_the_context_answered_before(tiny):
    """Which cells of earlier prompts and answers a prompt keeps (tiny's Q4_1 weights give the same logits in
    any batch: the next test holds the numbers on weights where batching moves them)."""
    _history_does_not_count(tiny, tiny.tokenizer.encode(PROMPT * 3))


@pytest.mark.qwen
def test_on_weights_whose_logits_move_with_batching_a_prompt_after_other_chats_is_fresh():
    """The qwen-coder 0.5B model's K-quant weights: a cell's K and V depend on the batch that wrote it, and a
    prompt whose first 20 tokens were cached from a shorter prompt gets last logits ~0.2 away from a fresh
    context's (before prompts kept only whole chunks)."""
    from backends.modelfiles.resolution import resolve

    try:
        path = resolve("qwen-coder", role="draft").path
    except Exception as e:  # noqa: BLE001 - the extra is optional
        pytest.skip(f"qwen-coder files unavailable: {e}")
    from backends import llamacpp

    m = llamacpp.load(path, ModelSpec(source=str(path), n_threads=2))
    try:
        vocab = m.info.vocab_size
        _history_does_not_count(m, [(i * 7919) % (vocab - 200) + 100 for i in range(60)])
    finally:
        m.close()
