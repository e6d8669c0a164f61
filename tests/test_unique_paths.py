"""Unique-path evaluation (spec §16.1, §16.6 item 1): same answers with it on and off, the inner context is fed
each distinct sequence once, and forest logits through the wrapper equal sequential ones in both runtimes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from app.config import MODE_FACTS, ConfigError, DecodeParams
from app.decoding import start
from app.decoding.beams import Stopper
from app.decoding.metrics import Metrics
from backends.base import ROOT, AcceptedPath, Forest, host_rows
from backends.unique import CountingContext, Rows, UniquePaths
from refmodel import RefContext, TableModel, bigram

V = 6  # token 0 is EOS
MODES = ("greedy", "sample", "beam", "beam-sample", "beam-sample-repl", "sps", "dsbd", "dsbd-mem")
REPEATING = ("beam-sample-repl", "dsbd", "dsbd-mem")  # modes whose forests repeat sequences on a peaked target


class Recording(RefContext):
    """The reference context, recording every token sequence it is fed; asserts none repeats before a commit
    (but one fed without its logits, which may come again with them)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.pending: dict[tuple[int, ...], bool] = {}  # sequence -> fed with its logits
        self.fed = 0
        self.computed = 0  # logits rows computed
        self.strict = False  # True behind UniquePaths: a repeated sequence is an error

    def _saw(self, seq, logits: bool = True) -> None:
        seq = tuple(seq)
        assert not (self.strict and (self.pending.get(seq) or (seq in self.pending and not logits))), \
            f"sequence {seq} fed twice before a commit"
        self.pending[seq] = self.pending.get(seq, False) or logits
        self.fed += 1

    def _logits(self, seq):
        self.computed += 1
        return super()._logits(seq)

    def evaluate(self, forest: Forest):
        for r, suf in enumerate(forest.suffix):
            for j in range(len(suf)):
                self._saw(self._rows[r] + list(suf[: j + 1]), j == len(suf) - 1)
        out = super().evaluate(forest)
        for n, o in zip(self._nodes[len(self._nodes) - len(forest.tokens):], forest.output_flags):
            self._saw(n.seq, o)
        return out

    def tokens(self, row: int) -> list[int]:
        return list(self._rows[row])

    def commit(self, paths) -> None:
        super().commit(paths)
        self.pending.clear()

    def prefill(self, ids) -> None:
        super().prefill(ids)
        self.pending.clear()


class RecordingModel(TableModel):
    def context(self, *, rows: int, max_tokens: int) -> Recording:
        return Recording(self, rows, max_tokens)


def peaked(seed: int, sharp: float) -> RecordingModel:
    table = np.random.default_rng(seed).normal(size=(V, V)) * sharp  # [prev, next]
    return RecordingModel(lambda seq: table[seq[-1]], V)


TARGET, DRAFT = peaked(3, 2.0), peaked(4, 1.5)  # peaked: beams and drafts repeat; answers still vary by seed


def run(mode: str, seed: int, unique: bool, views: bool = False, partial: bool = False):
    """One answer; `partial`: the inner contexts return only the nodes asked for (as llama.cpp's do)."""
    params = DecodeParams(mode=mode, seed=seed, max_new_tokens=12, beams=3, draft_beams=5, gamma=3,
                          min_beams=1).validated()
    t, d = TARGET.context(rows=3, max_tokens=256), DRAFT.context(rows=3, max_tokens=256)
    inner = (t, d)
    t.partial_outputs = d.partial_outputs = partial
    if unique:
        t.strict = d.strict = True
        # the rows as the engine reads them: the target's in place, the draft's too where a forest reads them
        t, d = UniquePaths(t, views=views), UniquePaths(d, views=views and MODE_FACTS[mode].forest)
    stopper = Stopper(eos_ids=frozenset({0}), decode=TARGET.tokenizer.decode)
    steps = list(start(params, target=t, draft=d, prompt=[1, 2], stopper=stopper, metrics=Metrics(mode=mode),
                       vocab=V))
    out = steps[-1].output
    return (out.tokens, out.score), (t, d), inner


@pytest.mark.parametrize("mode", MODES)
def test_on_and_off_give_identical_tokens_and_scores(mode):
    query = distinct = 0
    answers = set()
    for seed in range(20):
        off, _, _ = run(mode, seed, unique=False)
        on, wrapped, inner = run(mode, seed, unique=True)
        assert on == off, seed
        assert run(mode, seed, unique=True, views=True)[0] == off, seed
        assert run(mode, seed, unique=True, views=True, partial=True)[0] == off, seed
        answers.add(on[0])
        for w, ctx in zip(wrapped, inner):
            assert w.distinct_tokens == ctx.fed  # the counter is what the inner context received
            assert w.distinct_tokens <= w.query_tokens
            query, distinct = query + w.query_tokens, distinct + w.distinct_tokens
    if mode in REPEATING:
        assert distinct < 0.8 * query, (query, distinct)  # repeats occurred and were not fed
    if mode not in ("greedy", "beam"):
        assert len(answers) >= 10  # the seeds explore different paths


# -- what the inner context is asked for ---------------------------------------------------------------------

class Spy:
    """Tracks the caller's view: each entry's explicit sequence; counts distinct ones since the last commit."""

    def __init__(self, ctx: UniquePaths, rows: list[list[int]]) -> None:
        self.ctx, self.rows = ctx, rows
        self.suffix = [[] for _ in rows]
        self.nodes: list[list[int]] = []
        self.node_row: list[int] = []
        self.seen: set[tuple[int, ...]] = set()

    def evaluate(self, forest: Forest, model: TableModel):
        entries = []  # (sequence, gets logits)
        for r, suf in enumerate(forest.suffix):
            for j in range(len(suf)):
                entries.append((self.rows[r] + self.suffix[r] + list(suf[: j + 1]), j == len(suf) - 1))
        suffix = [s + list(forest.suffix[r]) if r < len(forest.suffix) else s for r, s in enumerate(self.suffix)]
        for t, p, r in zip(forest.tokens, forest.parents, forest.rows):
            seq = (self.rows[r] + suffix[r] if p == ROOT else self.nodes[p]) + [t]
            self.nodes.append(seq)
            self.node_row.append(r)
            entries.append((seq, True))
        new = {tuple(s) for s, _ in entries} - self.seen
        self.seen |= new
        out = self.ctx.evaluate(forest)
        self.suffix = suffix
        assert (self.ctx.last_query, self.ctx.last_distinct) == (len(entries), len(new))
        want = [model.fn(s) for s, logits in entries if logits]
        got = list(out.roots) + list(out.nodes)
        assert out.root_rows == tuple(r for r, s in enumerate(forest.suffix) if s)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, np.float32(w))
        return out

    def commit(self, paths) -> None:
        self.ctx.commit(paths)
        self.rows = [self.nodes[p.nodes[-1]] if p.nodes else self.rows[p.row] + self.suffix[p.row] for p in paths]
        self.suffix, self.nodes, self.node_row, self.seen = [[] for _ in paths], [], [], set()
        assert [self.ctx.tokens(r) for r in range(self.ctx.rows)] == self.rows
        assert [self.ctx.inner.tokens(r) for r in range(self.ctx.rows)] == self.rows
        assert self.ctx.lengths() == [len(r) for r in self.rows]


def context_model():
    """Logits that depend on the whole sequence, so a wrong row hand-out cannot go unnoticed."""
    return RecordingModel(lambda seq: np.sin(np.arange(V) * (1 + len(seq)) + sum((i + 1) * t for i, t in
                                                                                  enumerate(seq))), V)


def test_duplicate_rows_and_nodes_are_fed_once_across_layers_and_commits():
    model = context_model()
    inner = model.context(rows=4, max_tokens=64)
    ctx = UniquePaths(inner)
    ctx.prefill([1, 2, 3])
    spy = Spy(ctx, [[1, 2, 3]])
    # One row; a node twice, and a child under each copy (equal keys: one inner node each).
    spy.evaluate(Forest(suffix=((4,),), tokens=(5, 5, 2), parents=(ROOT, ROOT, ROOT), rows=(0, 0, 0)), model)
    assert ctx.last_distinct == 3 and inner.fed == 3
    spy.evaluate(Forest(tokens=(1, 1, 3), parents=(0, 1, 1), rows=(0, 0, 0)), model)
    assert ctx.last_distinct == 2
    # Commit duplicated rows through both copies of the duplicated node: 4 rows, 3 of them equal.
    spy.commit([AcceptedPath(0, (0, 3)), AcceptedPath(0, (1, 4)), AcceptedPath(0, (2,)), AcceptedPath(0, (0,))])
    assert spy.rows[0] == spy.rows[1] and spy.rows[0][:-1] == spy.rows[3]
    # Equal rows with equal suffixes are one root; a node under each copy of a row is one node.
    spy.evaluate(Forest(suffix=((2,), (2,), (2,), (1,)), tokens=(3, 3, 3, 4, 3), parents=(ROOT,) * 5,
                        rows=(0, 1, 2, 3, 0)), model)
    assert (ctx.last_query, ctx.last_distinct) == (9, 6)  # rows 0 and 1 give one root, one node under it
    spy.evaluate(Forest(tokens=(5, 5, 5), parents=(0, 1, 2), rows=(0, 1, 2)), model)
    assert ctx.last_distinct == 2
    spy.commit([AcceptedPath(1, (1, 6)), AcceptedPath(3), AcceptedPath(1, (1, 6))])
    # Multi-token suffixes sharing a prefix (a draft after a full pass): the shared token is fed once.
    spy.evaluate(Forest(suffix=((3, 4), (2, 1), (3, 5))), model)
    assert (ctx.last_query, ctx.last_distinct) == (6, 5)
    spy.evaluate(Forest(tokens=(1, 1), parents=(ROOT, ROOT), rows=(0, 2)), model)
    spy.commit([AcceptedPath(2, (1,)), AcceptedPath(0), AcceptedPath(2)])
    spy.evaluate(Forest(suffix=((1,), (1,), (1,))), model)
    assert ctx.query_tokens > ctx.distinct_tokens == inner.fed


def test_an_entry_scored_by_an_earlier_call_is_not_fed_again():
    model = context_model()
    inner = model.context(rows=2, max_tokens=64)
    ctx = UniquePaths(inner)
    ctx.prefill([1, 2])
    spy = Spy(ctx, [[1, 2]])
    spy.evaluate(Forest(suffix=((3,),), tokens=(4,), parents=(ROOT,), rows=(0,)), model)
    spy.commit([AcceptedPath(0), AcceptedPath(0)])
    spy.evaluate(Forest(suffix=((4,), ()), tokens=(5,), parents=(ROOT,), rows=(0,)), model)
    fed, passes = inner.fed, model.passes
    spy.evaluate(Forest(suffix=((), (4,)), tokens=(5,), parents=(ROOT,), rows=(1,)), model)  # row 1 = row 0
    assert ctx.last_distinct == 0 and inner.fed == fed and model.passes == passes  # no pass at all
    spy.commit([AcceptedPath(1, (1,)), AcceptedPath(0, (0,))])



def test_suffixes_fed_as_chains_of_nodes_return_logits_at_the_ends_only():
    """Rows catching up with suffixes that share a prefix (a draft after passes it sat out): the tokens after the
    shared prefix go in as chains of nodes, and a context that can skip outputs computes logits only where a row
    ends; a later node inside such a chain is fed again, with its logits."""
    model = context_model()
    inner = model.context(rows=3, max_tokens=64)
    inner.partial_outputs = inner.strict = True
    ctx = UniquePaths(inner)
    ctx.prefill([1, 2])
    spy = Spy(ctx, [[1, 2]])
    spy.evaluate(Forest(suffix=((3,),)), model)
    spy.commit([AcceptedPath(0)] * 3)
    computed = inner.computed
    spy.evaluate(Forest(suffix=((4, 5, 1, 2), (4, 5, 3, 1, 5), (4, 5, 3))), model)  # checks every row's logits
    assert ctx.last_distinct == 7 and inner.fed == 1 + 7
    assert inner.computed - computed == 4  # the three ends and the shared prefix's end; none of (4,5,1), (4,5,3,1)
    out = ctx.evaluate(Forest(tokens=(1,), parents=(ROOT,), rows=(2,)))  # row 2 + 1 = the inside of row 1's chain
    assert ctx.last_distinct == 1 and inner.computed - computed == 5
    np.testing.assert_array_equal(out.nodes[0], np.float32(model.fn([1, 2, 3, 4, 5, 3, 1])))
    ctx.commit([AcceptedPath(2, (0,)), AcceptedPath(1)])
    assert [ctx.tokens(r) for r in range(2)] == [[1, 2, 3, 4, 5, 3, 1], [1, 2, 3, 4, 5, 3, 1, 5]]
    assert [inner.tokens(r) for r in range(2)] == [ctx.tokens(r) for r in range(2)]


STATE = ("_tokens", "_ckey", "_suffix", "_rkey", "_has_nodes", "_ifed", "_ibusy", "_inode", "_at", "_placed", "_owned",
         "_nodes", "_epoch", "evaluations", "query_tokens", "distinct_tokens", "last_query", "last_distinct", "passes")


@pytest.mark.parametrize("views", [False, True])
def test_a_plain_step_leaves_the_state_the_planned_evaluate_leaves(views):
    """A one-token step after the only row's commit skips the plan: its logits, the counters and every piece of the
    wrapper's state, after the step and after its commit, are what the planned evaluate leaves (here with the
    shortcut turned off), through steps, forests, two-row commits and back to one row."""
    model = context_model()
    fast, slow = (UniquePaths(model.context(rows=2, max_tokens=256), views=views) for _ in range(2))
    slow._one_token = lambda forest: False
    script = [Forest(suffix=((3,),)), [AcceptedPath(0)], Forest(suffix=((4,),)), [AcceptedPath(0)],
              Forest(suffix=((5, 1),)), [AcceptedPath(0)],  # two tokens: planned
              Forest(suffix=((2,),), tokens=(4,), parents=(ROOT,), rows=(0,)), [AcceptedPath(0, (0,))],
              Forest(suffix=((1,),)), [AcceptedPath(0), AcceptedPath(0)],  # two rows: planned
              Forest(suffix=((3,), (4,))), [AcceptedPath(1)], Forest(suffix=((5,),)), [AcceptedPath(0)]]
    for ctx in (fast, slow):
        ctx.prefill([1, 2])
    took = []
    for op in script:
        for ctx in (fast, slow):
            if isinstance(op, Forest):
                took.append(ctx._one_token(op))
                out = ctx.evaluate(op)
                ctx.out = (out.root_rows, np.asarray(out.roots).tolist(), np.asarray(out.nodes).shape)
            else:
                ctx.commit(op)
                ctx.out = [ctx.tokens(r) for r in range(ctx.rows)]
        assert fast.out == slow.out, op
        for name in STATE:
            assert getattr(fast, name) == getattr(slow, name), (op, name)
        assert len(fast._arrays) == len(slow._arrays)
        assert [ctx.inner.tokens(r) for r in range(ctx.rows)] == [fast.inner.tokens(r) for r in range(fast.rows)]
    assert took.count(True) == 4, took  # the steps on one row took the shortcut; the rest planned


def test_invalid_forests_and_paths_raise_and_change_nothing():
    model = context_model()
    ctx = UniquePaths(model.context(rows=2, max_tokens=64))
    ctx.prefill([1, 2])
    with pytest.raises(ValueError, match="parent"):
        ctx.evaluate(Forest(suffix=((3,),), tokens=(4,), parents=(0,), rows=(0,)))
    with pytest.raises(ValueError, match="row 1 out of range"):
        ctx.evaluate(Forest(suffix=((3,),), tokens=(4,), parents=(ROOT,), rows=(1,)))
    with pytest.raises(ValueError, match="suffix"):
        ctx.evaluate(Forest(suffix=((3,), (4,))))
    out = ctx.evaluate(Forest(suffix=((3,),), tokens=(4,), parents=(ROOT,), rows=(0,)))
    assert out.nodes.shape == (1, V)
    with pytest.raises(ValueError, match="pending nodes"):
        ctx.evaluate(Forest(suffix=((3,),)))
    with pytest.raises(ValueError, match="chain"):
        ctx.commit([AcceptedPath(0, (1,))])
    ctx.commit([AcceptedPath(0, (0,))])
    assert ctx.tokens(0) == [1, 2, 3, 4] and ctx.evaluations == 1


def test_counting_context_counts_every_entry_as_fed():
    ctx = CountingContext(bigram(V, 1).context(rows=2, max_tokens=64))
    ctx.prefill([1, 2])
    ctx.evaluate(Forest(suffix=((3,),), tokens=(4, 4), parents=(ROOT, ROOT), rows=(0, 0)))
    assert (ctx.last_query, ctx.last_distinct, ctx.counters()["query_tokens_per_pass"]) == (3, 3, 3.0)


def test_unique_paths_setting_is_validated():
    assert DecodeParams(unique_paths=False).validated().unique_paths is False
    with pytest.raises(ConfigError, match="unique_paths must be true or false"):
        DecodeParams(unique_paths="no").validated()


# -- forest == sequential through the wrapper, both runtimes (spec §13.5) ------------------------------------

def is_tensor(a) -> bool:
    return type(a).__module__.startswith("torch")


def shares(a, b) -> bool:
    """Two tensors on the same memory (neither is a copy)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def forest_case(ctx: UniquePaths, prompt: list[int], logits_of, tol: float, device_rows: bool = False) -> None:
    """Duplicated rows and nodes, layer by layer, a commit through deduplicated nodes and rows, one more pass;
    every entry's logits against `logits_of(sequence)` (a from-scratch forward). `device_rows`: the runtime hands
    its rows over as tensors."""
    rows = [list(prompt)]
    suffix = [[]]
    nodes: list[list[int]] = []
    worst = 0.0

    def check(out, forest):
        nonlocal worst, suffix
        want = []
        for r, s in enumerate(forest.suffix):
            suffix[r] = suffix[r] + list(s)
            if s:
                want.append(rows[r] + suffix[r])
        for t, p, r in zip(forest.tokens, forest.parents, forest.rows):
            nodes.append((rows[r] + suffix[r] if p == ROOT else nodes[p]) + [t])
            want.append(nodes[-1])
        got = list(out.roots) + list(out.nodes)
        assert len(got) == len(want)
        for g, seq in zip(got, want):
            assert is_tensor(g) == device_rows  # device rows stay tensors through the wrapper
            worst = max(worst, float(np.abs(host_rows(g).astype(np.float64) - logits_of(seq)).max()))
        assert worst <= tol, worst

    handed: list[tuple[np.ndarray, np.ndarray]] = []  # every row handed out, with a copy taken then
    last: list = []  # with views: the previous evaluate's rows
    blocks: list[bool] = []  # with views: whether each result's rows were one block

    def step(forest):
        out = ctx.evaluate(forest)
        if ctx.views:  # read in place: the earlier rows no longer read; these are the pass's own
            for rows_ in last:
                with pytest.raises(RuntimeError, match="read after the context's next call"):
                    rows_[0]
                with pytest.raises(RuntimeError, match="read after the context's next call"):
                    rows_.block()
            assert isinstance(out.nodes, Rows) or len(out.nodes) == 0
            last[:] = [r for r in (out.roots, out.nodes) if len(r)]
            for r in last:  # a block of rows in order is the inner result itself; scattered rows are no block
                b = r.block()
                blocks.append(b is not None)
                assert b is None or (np.array_equal(host_rows(b), np.asarray(r)) and
                                     (shares(b, r.row(0)) if is_tensor(b) else not b.flags.owndata))
        check(out, forest)
        if not ctx.views:
            handed.extend((g, host_rows(g).copy()) for g in list(out.roots) + list(out.nodes))
            assert all(np.array_equal(host_rows(g), c) for g, c in handed)  # later passes never change them

    def commit(paths):
        nonlocal rows, suffix, nodes
        ctx.commit(paths)
        rows = [nodes[p.nodes[-1]] if p.nodes else rows[p.row] + suffix[p.row] for p in paths]
        suffix, nodes = [[] for _ in paths], []
        assert [ctx.tokens(r) for r in range(ctx.rows)] == rows
        assert [ctx.inner.tokens(r) for r in range(ctx.rows)] == rows  # the runtime holds the same tokens
        assert ctx.lengths() == [len(r) for r in rows]

    ctx.prefill(prompt[:-1])
    rows, suffix = [list(prompt[:-1])], [[]]
    step(Forest(suffix=((prompt[-1],),), tokens=(11, 11, 12), parents=(ROOT, ROOT, ROOT), rows=(0, 0, 0)))
    step(Forest(tokens=(13, 13, 14), parents=(0, 1, 2), rows=(0, 0, 0)))
    assert ctx.last_distinct == 2
    step(Forest(tokens=(11, 15), parents=(ROOT, ROOT), rows=(0, 0)))  # 11 again: the first pass's row, kept
    assert ctx.last_distinct == 1
    # new rows 0 and 1 are equal
    commit([AcceptedPath(0, (1, 4)), AcceptedPath(0, (0, 3)), AcceptedPath(0, (2, 5)), AcceptedPath(0, (1,))])
    step(Forest(suffix=((7,), (7,), (8,), (7,)), tokens=(20, 20, 21, 20), parents=(ROOT,) * 4, rows=(0, 1, 0, 2)))
    assert (ctx.last_query, ctx.last_distinct) == (8, 6)
    step(Forest(tokens=(22, 22, 23), parents=(0, 1, 3), rows=(0, 1, 2)))
    assert ctx.last_distinct == 2
    # Keep row 1's copy of the duplicated chain (its inner nodes are row 0's), twice, and a plain root.
    commit([AcceptedPath(1, (1, 5)), AcceptedPath(1, (1, 5)), AcceptedPath(3), AcceptedPath(2, (3, 6))])
    step(Forest(suffix=((30, 31), (30, 32), (33,), (34,)), tokens=(40, 40), parents=(ROOT, ROOT), rows=(0, 1)))
    assert (ctx.last_query, ctx.last_distinct) == (8, 7)  # the 30 both rows start with, once
    commit([AcceptedPath(1, (1,)), AcceptedPath(2), AcceptedPath(0)])
    step(Forest(suffix=((41,), (42,), (43,))))
    assert ctx.distinct_tokens < ctx.query_tokens
    # Rows catching up on suffixes that share a prefix: chains of nodes, with logits where rows end
    commit([AcceptedPath(0)] * 3)
    step(Forest(suffix=((50, 51, 52, 53), (50, 51, 54, 55, 56), (50, 51, 54))))
    assert ctx.last_distinct == 7
    assert not ctx.views or (any(blocks) and not all(blocks))


def test_llamacpp_forest_through_the_wrapper_equals_sequential(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("backends.llamacpp")
    from llama_helpers import TOL, load, make_oracle, write_random_llama

    model = load(write_random_llama(tmp_path / "random.gguf"))
    oracle = make_oracle(model)
    try:
        for views in (False, True):  # copies, and views of llama.cpp's output buffer
            with UniquePaths(model.context(rows=4, max_tokens=512), views=views) as ctx:
                forest_case(ctx, [1, 5, 200, 17, 42, 99, 3, 150, 260, 9], lambda s: oracle(s).astype(np.float64),
                            TOL)
    finally:
        oracle.close()
        model.close()


def test_pytorch_forest_through_the_wrapper_equals_sequential():
    pytest.importorskip("torch")
    from backends.pytorch.model import init_random
    from torch_helpers import F64_TOL, TINY_ARGS, scratch_logits, wrap

    model = wrap(init_random(TINY_ARGS, seed=0))
    for views in (False, True):
        for device_rows in (False, True):  # host numpy rows, and tensors where the model computed them
            inner = model.context(rows=4, max_tokens=64, logits_dtype=np.float64)
            inner.device_rows = device_rows
            forest_case(UniquePaths(inner, views=views), [5, 17, 3, 42, 8, 9, 60], lambda s: scratch_logits(model, s),
                        F64_TOL, device_rows)


# -- the engine on the real tiny preset ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_gguf_path):
    from app.engine.engine import Engine
    from backends.registry import ModelSpec

    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    yield e
    e.close()


@pytest.mark.parametrize("mode", ["dsbd", "beam-sample-repl"])
def test_engine_answers_with_unique_paths_on_and_off(engine, mode):
    from app.engine.engine import final_event

    msgs = [{"role": "user", "content": "Name a colour."}]
    base = DecodeParams(mode=mode, max_new_tokens=8, seed=2, beams=3, draft_beams=5, gamma=3, top_k=20,
                        temperature=0.7)
    on = final_event(engine.chat(msgs, base))
    off = final_event(engine.chat(msgs, replace(base, unique_paths=False)))
    for ev, unique in ((on, True), (off, False)):
        s = ev.stats
        assert ev.text.strip() and s["unique_paths"] is unique
        assert 0 < s["distinct_tokens_per_pass"] <= s["query_tokens_per_pass"]
        if mode == "dsbd":
            assert 0 < s["draft_distinct_tokens_per_pass"] <= s["draft_query_tokens_per_pass"]
    assert off.stats["distinct_tokens_per_pass"] == off.stats["query_tokens_per_pass"]


def test_bench_settings_and_summary_and_the_stats_panel_carry_the_counts():
    from app.compare.bench import parse_mode, summarize
    from app.serve.ui.forest import forest_svg
    from app.serve.ui.stats import stats_markdown

    assert parse_mode("beam-sample-repl:unique_paths=false", DecodeParams())[1].unique_paths is False
    assert parse_mode("dsbd:unique_paths=true", DecodeParams())[1].unique_paths is True
    with pytest.raises(ConfigError, match="true or false"):
        parse_mode("dsbd:unique_paths=maybe", DecodeParams())
    stats = {"tokens_per_s": 1.0, "acceptance_by_depth": {}, "widths_histogram": {}, "steps_per_target_pass": 1.0,
             "peak_kv_bytes_target": 0, "peak_kv_bytes_draft": 0, "mean_target_logprob": None, "new_tokens": 4,
             "draft_passes": 0, "unique_paths": True}
    runs = [{"mode": "m", "stats": stats | {"target_passes": 1, "query_tokens_per_pass": 10.0,
                                            "distinct_tokens_per_pass": 4.0}},
            {"mode": "m", "stats": stats | {"target_passes": 3, "query_tokens_per_pass": 2.0,
                                            "distinct_tokens_per_pass": 2.0}}]
    s = summarize(runs, ["m"])["m"]
    assert (s["query_tokens_per_pass"], s["distinct_tokens_per_pass"]) == (4.0, 2.5)  # weighted by passes
    line = stats_markdown(runs[0]["stats"] | {"draft_query_tokens_per_pass": 6.0,
                                              "draft_distinct_tokens_per_pass": 3.0}, memory=False)
    assert "**Query / distinct tokens per pass:** target 10.0 / 4.0 · draft 6.0 / 3.0" in line
    forest = {"gamma": 1, "draft_beams": 2, "query_tokens": 7, "distinct_tokens": 3,
              "layers": [{"width": 1, "passed": True, "nodes": [{"parent": 0, "token": 1, "status": "accepted"}]}]}
    assert "Target pass: 7 query / 3 distinct tokens." in forest_svg(forest)


def test_engine_runs_the_best_quality_preset_without_replacement(engine):
    """The real tiny pair through the engine with the Best quality preset's settings (drafts without
    replacement, lookup nodes, adaptive forest): an answer, distinct beams in every drafted layer's outputs, and
    the layer counts the bench reads."""
    from app.engine.engine import final_event
    from app.serve.ui.settings import load_presets, params_from

    best = params_from(load_presets()["Best quality"]["settings"])
    assert best.replacement == "without"
    msgs = [{"role": "user", "content": "Name a colour."}]
    for forest in ("adaptive", "fixed"):  # fixed: the forest surely drafts, whatever this CPU's costs say
        ev = final_event(engine.chat(msgs, replace(best, max_new_tokens=12, seed=3, forest=forest)))
        s = ev.stats
        assert ev.text.strip() and s["mode"] == "dsbd"
        if forest == "fixed":
            layers = s["acceptance_by_depth"].values()
            assert sum(x["attempted"] for x in layers) > 0
            assert all(x["passed"] >= x["passed_by_cache"] >= 0 for x in layers)
            # without replacement no two drafts of a layer repeat: the pass computes every query token
            assert s["distinct_tokens_per_pass"] == s["query_tokens_per_pass"]
