"""The row-math backends (app/decoding/rowmath/, spec §16.10): the torch backend's closed forms have the
reference's law exactly (enumerations within 1e-12 in float64), and in float32 on Qwen-sized rows it draws the
reference's keys for the same seed; negative controls for the closed-form shortcuts must fail."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.decoding import rowmath
from app.decoding.rowmath import tensors
from app.decoding.sampling import Draft, DraftWOR, Joint, SeededRand, Warp, residual_chain, verify_layer
from app.decoding.width import acceptance_count_law, acceptance_count_table, choose_width
from dsbd_helpers import enumerate_paths, layer_cases, make_drafts

EXACT = 1e-12
CASES = layer_cases()
SHAPES = [(ws, wl) for ws in (1, 2, 3) for wl in range(1, ws + 1)]
BACKENDS = {"numpy": rowmath.NumpyRows(), "torch-float64": rowmath.make("torch-float64")}


@pytest.fixture(params=["torch", "compiled"])
def fast(request):
    """The float32 backends: torch on the CPU, and the compiled kernels (the CPU default) where numba runs."""
    if request.param == "compiled":
        pytest.importorskip("numba", reason="the compiled kernels need numba")
    return rowmath.make(request.param)


def torch_law(tm, p: Joint, n_rows: int):
    """p as a torch dense law: rows of log p with row scores log(row mass), so p_beam = p."""
    table = np.zeros((n_rows, p.vocab))
    table.reshape(-1)[p.keys] = p.probs
    mass = table.sum(axis=1)
    with np.errstate(divide="ignore"):
        rows = tm.rows(np.log(table))
        return tm.law(rows, np.log(mass), Warp())


def torch_q(tm, q: Joint, n_rows: int):
    table = np.zeros((n_rows, q.vocab))
    keys = q.keys[q.keys < n_rows * q.vocab]
    table.reshape(-1)[keys] = q.lookup(keys)
    return tensors._QRows(tm, tm._tensor(table).view(n_rows, q.vocab))


def laws(p: Joint, q: Joint, valid, W_S: int, W_L: int, run) -> dict:
    """Law of the output keys over every i.i.d. draft tuple and every outcome of the verifier's randomness."""
    law: dict = {}
    for idx in itertools.product(range(len(q)), repeat=W_S):
        keys = np.array([q.keys[i] for i in idx])
        w = float(np.prod(q.probs[list(idx)]))
        drafts = make_drafts(keys, q, valid)
        for (_, out), pr in enumerate_paths(lambda rand: run(drafts, rand)):
            k = tuple(key for key, _ in out)
            law[k] = law.get(k, 0.0) + w * pr
    return law


def laws_without(p: Joint, q: Joint, valid, W_S: int, W_L: int, run) -> dict:
    law: dict = {}
    for idx in itertools.permutations(range(len(q)), W_S):
        w, left, drafts = 1.0, 1.0, []
        for i in idx:
            k = int(q.keys[i])
            drafts.append(DraftWOR(k, float(q.probs[i]), left, bool(valid[k // q.vocab])))
            w *= q.probs[i] / left
            left -= q.probs[i]
        for (_, out), pr in enumerate_paths(lambda rand: run(drafts, rand)):
            k = tuple(key for key, _ in out)
            law[k] = law.get(k, 0.0) + w * pr
    return law


def gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def reference_with(p, q, W_S, W_L):
    S, R, _ = residual_chain(p, q, W_S)
    return lambda drafts, rand: verify_layer(drafts, S, R, W_L, rand)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("W_S,W_L", SHAPES)
def test_torch_chain_and_verify_have_the_reference_law(name, W_S, W_L):
    p, q, valid = CASES[name]
    tm = BACKENDS["torch-float64"]
    n_rows = len(valid)
    pt, qt = torch_law(tm, p, n_rows), torch_q(tm, q, n_rows)
    chain = tm.chain(pt, qt, W_S)
    assert np.allclose(chain.alpha, residual_chain(p, q, W_S)[2], atol=EXACT, rtol=0)
    want = laws(p, q, valid, W_S, W_L, reference_with(p, q, W_S, W_L))
    got = laws(p, q, valid, W_S, W_L, lambda drafts, rand: tm.verify(chain, drafts, W_L, rand))
    assert gap(got, want) < EXACT


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("W_S,W_L", SHAPES)
def test_torch_verify_without_replacement_has_the_reference_law(name, W_S, W_L):
    p, q, valid = CASES[name]
    if W_S > len(q) or W_L > len(p):
        pytest.skip("not enough distinct pairs")
    tm, ref = BACKENDS["torch-float64"], BACKENDS["numpy"]
    n_rows = len(valid)
    pt, qt = torch_law(tm, p, n_rows), torch_q(tm, q, n_rows)
    pr, qr = rowmath.NumpyLaw(p), rowmath.NumpyLaw(q)
    want = laws_without(p, q, valid, W_S, W_L, lambda d, rand: ref.verify_without(pr, qr, d, W_L, rand))
    got = laws_without(p, q, valid, W_S, W_L, lambda d, rand: tm.verify_without(pt, qt, d, W_L, rand))
    assert gap(got, want) < EXACT


def test_negative_control_a_chain_without_its_scalar_moves_the_law(monkeypatch):
    """The closed form's threshold s_c accumulates the masses Z (s_1 = 1: r_1 = norm(max(p - q, 0))); a chain whose
    scalar forgets them (s_c = c / 2, half of q taken out per rejection) must fail the same enumeration."""
    p, q, valid = CASES["random"]
    tm = BACKENDS["torch-float64"]
    pt, qt = torch_law(tm, p, len(valid)), torch_q(tm, q, len(valid))
    chain = tm.chain(pt, qt, 3)
    want = laws(p, q, valid, 3, 2, reference_with(p, q, 3, 2))
    chain.alphas(3)  # the chain grown to its end, then its thresholds replaced
    chain.s = [c / 2 for c in range(len(chain.s))]
    chain.Z = [1.0] + [chain.cells.mass(s) for s in chain.s[1:]]
    got = laws(p, q, valid, 3, 2, lambda drafts, rand: tm.verify(chain, drafts, 2, rand))
    assert gap(got, want) > 1e-3


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_distinct_draws_are_sequential_draws_without_replacement(backend):
    """rm.distinct_keys' law (and each draw's recorded mass left) is sequential sampling without replacement."""
    p, _, valid = CASES["three_parents"]
    rm = BACKENDS[backend]
    law = torch_law(rm, p, len(valid)) if backend != "numpy" else rowmath.NumpyLaw(p)
    want: dict = {}
    for idx in itertools.permutations(range(len(p)), 3):
        w, left = 1.0, 1.0
        for i in idx:
            w *= p.probs[i] / left
            left -= p.probs[i]
        want[tuple(int(p.keys[i]) for i in idx)] = w
    got: dict = {}
    for keys, pr in enumerate_paths(lambda rand: tuple(rm.distinct_keys(law, 3, rand))):
        got[keys] = got.get(keys, 0.0) + pr
    assert gap(got, want) < EXACT
    keys, rest = law.distinct(3, SeededRand(np.random.default_rng(0)))
    assert np.allclose(rest, [1.0, 1.0 - p.lookup(keys[:1])[0], 1.0 - p.lookup(keys[:2]).sum()], atol=1e-12)


def qwen_rows(rng, n: int) -> np.ndarray:
    x = rng.normal(0, 2, (n, 151_936)).astype(np.float32)
    for r in range(n):
        x[r, rng.integers(0, x.shape[1], 8)] += 14
    return x


@pytest.fixture(scope="module")
def qwen_pair():
    rng = np.random.default_rng(3)
    x = qwen_rows(rng, 4)
    return x, x + rng.normal(0, 1, x.shape).astype(np.float32), np.array([-1.0, -1.5, -3.0, -2.2])


@pytest.mark.parametrize("warp", [Warp(), Warp(0.7), Warp(1.0, top_k=20), Warp(0.7, top_p=0.9),
                                  Warp(0.8, top_k=50, top_p=0.95)], ids=str)
def test_float32_backends_draw_the_references_keys_on_qwen_sized_rows(qwen_pair, warp, fast):
    x, _, scores = qwen_pair
    ref, tm = rowmath.NumpyRows(), fast
    pr, pt = ref.law(ref.rows(x), scores, warp), tm.law(tm.rows(x), scores, warp)
    assert len(pr) == len(pt)
    keys = pr.keys
    assert np.abs(pr.lookup(keys) - pt.lookup(keys)).max() < 1e-6
    for seed in range(3):
        a = pr.sample(16, SeededRand(np.random.default_rng(seed)))
        b = pt.sample(16, SeededRand(np.random.default_rng(seed)))
        assert (a == b).all()
        a = ref.distinct_keys(pr, 8, SeededRand(np.random.default_rng(seed)))
        b = tm.distinct_keys(pt, 8, SeededRand(np.random.default_rng(seed)))
        assert a == b
    for k in (1, 10, 40):  # the lookup nodes' likeliest pairs
        assert list(pr.top(k)) == list(pt.top(k))
    dead = np.array([scores[0], -np.inf, scores[2], -np.inf])  # rows that are no valid parent hold no pair
    assert list(ref.law(ref.rows(x), dead, warp).top(12)) == list(tm.law(tm.rows(x), dead, warp).top(12))


def test_normalisers_are_the_references_on_every_kind_of_row(fast):
    """One normaliser per row from the rows' softmax (its largest cell gives the shift): the reference's log-probs
    within float32 rounding for far-off, flat, masked, one-cell and Qwen-sized rows; the same where a row with
    no finite cell sends the whole set down the plain exp path; and a law on those exponentials (T = 1) or on the
    softmax of x / T is the reference's law."""
    rng = np.random.default_rng(11)
    x = rng.normal(0, 4, (6, 151936)).astype(np.float32)
    x[1] += 300.0  # far above 0
    x[2] -= 300.0
    x[3] = 0.0  # flat
    x[4, rng.integers(0, 151936, 100_000)] = -np.inf  # masked ids
    x[5] = -np.inf
    x[5, 17] = 2.5  # one cell
    ref, tm = rowmath.NumpyRows(), fast
    dead = np.full((1, 151936), -np.inf, np.float32)
    for rows in (x, np.concatenate([x, dead])):
        a, b = ref.rows(rows), tm.rows(rows)
        for i in range(len(x)):
            fin = np.isfinite(rows[i])
            assert np.abs(a.dense(i)[fin] - b.dense(i)[fin]).max() < 2e-6, i
        scores = np.array([-1.0, -2.0, -0.5, -3.0, -1.5, -4.0] + [-np.inf] * (len(rows) - len(x)))
        for warp in (Warp(), Warp(0.7), Warp(1.6)):
            pr, pt = ref.law(a, scores, warp), tm.law(b, scores, warp)
            keys = pr.keys
            assert len(pr) == len(pt) and np.abs(pr.lookup(keys) - pt.lookup(keys)).max() < 1e-6, warp
    assert tm.rows(dead).lse_all()[0] == -np.inf


def head_rows(rng, kind: str) -> np.ndarray:
    """4 rows x 2,000 cells whose heads stress the cut: ties, a far tail, flat rows, masked cells."""
    if kind == "ties":  # integer logits: many equal cells at every cut
        return rng.integers(-12, 0, (4, 2000)).astype(np.float32)
    if kind == "far":  # 3 likely cells a row, the rest 200 nats below every level
        x = np.full((4, 2000), -200.0, np.float32)
        x[:, :3] = 0.0
        return x
    if kind == "flat":
        return np.zeros((4, 2000), np.float32)
    x = rng.normal(0, 3, (4, 2000)).astype(np.float32)
    x[:, rng.integers(0, 2000, 500)] = -np.inf  # masked ids
    return x


@pytest.mark.parametrize("kind", ["ties", "far", "flat", "masked"])
def test_heads_cut_on_the_device_equal_the_whole_rows(monkeypatch, kind):
    """A top-k warp and the lookup nodes' likeliest pairs read only the cells above a cut (`_head`): the same law,
    bit for bit, and the same keys as reading every cell, with ties at the cut, rows that are no valid parent and
    heads that need every level."""
    rng = np.random.default_rng(7)
    x, tm = head_rows(rng, kind), rowmath.make("torch")
    cases = [(Warp(t, top_k=k), s) for t in (1.0, 0.7) for k in (1, 5, 20, 300)
             for s in (np.array([-1.0, -1.0, -2.5, -0.5]), np.array([-1.0, -np.inf, -2.0, -np.inf]))]

    def run():
        out = []
        for warp, scores in cases:
            law = tm.law(tm.rows(x), scores, warp)
            out.append((law.keys.tolist(), law.probs.tolist()))
            dense = tm.law(tm.rows(x), scores, Warp(warp.temperature))
            out.append([dense.top(k).tolist() for k in (1, 7, 40)])
        return out

    cut = run()
    monkeypatch.setattr(tensors, "_levels", lambda sub, need, every: [every])  # the last level alone: every cell
    assert cut == run()


@pytest.mark.parametrize("kind", ["ties", "far", "flat", "masked", "qwen"])
def test_the_compiled_likeliest_pairs_are_the_cut_heads(kind):
    """The lookup nodes' likeliest pairs on the compiled backend (each row's best cells in one pass that skips
    chunks) are the torch backend's cut heads, key for key and in order: ties (equal worths go to the lower key),
    rows that are no valid parent, temperatures, and more pairs than a row holds chunks' worth of."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    rng = np.random.default_rng(11)
    x = qwen_rows(rng, 4) if kind == "qwen" else head_rows(rng, kind)
    tm, cm = rowmath.make("torch"), rowmath.make("compiled")
    for scores in (np.array([-1.0, -1.0, -2.5, -0.5]), np.array([-1.0, -np.inf, -2.0, -np.inf])):
        for t in (1.0, 0.7):
            want = tm.law(tm.rows(x), scores, Warp(t))
            got = cm.law(cm.rows(x), scores, Warp(t))
            for k in (1, 7, 40, 700):
                assert got.top(k).tolist() == want.top(k).tolist(), (kind, t, k)


def test_a_gpus_head_cut_is_the_hosts(monkeypatch, qwen_pair):
    """On a GPU the head cut runs torch's compare and nonzero where the rows lie; CI has no GPU, so the same code
    runs here on the CPU's tensors: top-k laws, their seeded draws and the likeliest pairs equal the host path's,
    on Qwen-sized rows and on rows with ties, far tails, flat and masked cells."""
    x, _, scores = qwen_pair
    rows = [(x, scores)] + [(head_rows(np.random.default_rng(7), kind), np.array([-1.0, -np.inf, -2.0, -0.5]))
                            for kind in ("ties", "far", "flat", "masked")]
    tm = rowmath.make("torch")

    def run():
        out = []
        for r, s in rows:
            for warp in (Warp(1.0, top_k=20), Warp(0.7, top_k=5), Warp(0.8, top_k=50, top_p=0.95)):
                law = tm.law(tm.rows(r), s, warp)
                out.append((law.keys.tolist(), law.probs.tolist(),
                            law.sample(8, SeededRand(np.random.default_rng(1))).tolist(),
                            tm.distinct_keys(law, 4, SeededRand(np.random.default_rng(2)))))
            out.append([tm.law(tm.rows(r), s, Warp()).top(k).tolist() for k in (1, 10, 40)])
        return out

    host = run()
    taken = []
    where_they_lie = tensors.TorchRows._at_least_where_they_lie
    monkeypatch.setattr(tensors.TorchRows, "_at_least",
                        lambda self, r, c: taken.append(1) or where_they_lie(self, r, c))
    assert run() == host and taken


def test_a_head_holds_every_cell_its_need_reaches():
    """`_head` returns every cell worth at least the need-th best, for every need, on rows whose levels each add
    a few cells (a head one cell short of its need must be lowered)."""
    tm = rowmath.make("torch")
    x = np.stack([-3.0 * np.arange(500), -3.0 * np.arange(500) - 1.0]).astype(np.float32)
    off = np.array([0.0, -0.5])
    worth = lambda r, cells: cells.astype(np.float64) + off[r]  # noqa: E731
    whole = np.sort((x.astype(np.float64) + off[:, None]).ravel())[::-1]
    for need in range(1, 60):
        r, tok, cells = tm._head(tm._tensor(x), worth, lambda level: (level - off).astype(np.float32),
                                 [-8.0, -16.0, -32.0, -64.0, -np.inf], need)
        got = worth(r, cells)
        assert np.count_nonzero(got >= whole[need - 1]) == np.count_nonzero(whole >= whole[need - 1]), need


@pytest.mark.parametrize("without", [False, True], ids=["with", "without"])
def test_float32_backends_verify_as_the_reference_on_qwen_sized_rows(qwen_pair, without, fast):
    """The same drafts and seeds give the same accepted drafts, corrections and fills; alpha within 1e-6."""
    x, y, scores = qwen_pair
    ref, tm = rowmath.NumpyRows(), fast
    pr, pt = ref.law(ref.rows(x), scores, Warp()), tm.law(tm.rows(x), scores, Warp())
    qr, qt = ref.law(ref.rows(y), scores, Warp()), tm.law(tm.rows(y), scores, Warp())
    one = [[0], [1], [2], [3]]
    qor, qot = ref.on_rows(qr, one, [1] * 4), tm.on_rows(qt, one, [1] * 4)
    for n in (8, 32):
        assert np.abs(ref.chain(pr, qor, n).alpha - tm.chain(pt, qot, n).alpha).max() < 1e-6
        lazy = tm.chain(pt, qot, n)
        assert np.array_equal(lazy.alphas(3), tm.chain(pt, qot, n).alpha[:3]) and len(lazy.s) == 4  # grown to 3
        keys, rest = qr.distinct(n, SeededRand(np.random.default_rng(n)))
        if without:
            drafts = [DraftWOR(int(k), float(qor.lookup([k])[0]), float(r), True) for k, r in zip(keys, rest)]
        else:
            drafts = [Draft(int(k), float(qor.lookup([k])[0]), True) for k in keys]
        for seed in range(4):
            if without:
                a = ref.verify_without(pr, qor, drafts, 4, SeededRand(np.random.default_rng(seed)))
                b = tm.verify_without(pt, qot, drafts, 4, SeededRand(np.random.default_rng(seed)))
            else:
                a = ref.verify(ref.chain(pr, qor, n), drafts, 4, SeededRand(np.random.default_rng(seed)))
                b = tm.verify(tm.chain(pt, qot, n), drafts, 4, SeededRand(np.random.default_rng(seed)))
            assert a == b


def test_vectorised_width_law_equals_the_textbook_table():
    rng = np.random.default_rng(0)
    for m in (0, 1, 5, 32):
        alpha = rng.random(m)
        assert np.allclose(acceptance_count_law(alpha), acceptance_count_table(alpha)[-1], atol=1e-14, rtol=0)
    assert choose_width([0.9, 0.8, 0.7, 0.2], 0.9, 1, 4) >= 1


def test_an_unknown_backend_is_a_clear_error_and_auto_runs():
    with pytest.raises(ValueError, match="unknown row-math backend 'gpu'"):
        rowmath.make("gpu")
    assert rowmath.make("auto").name in ("compiled", "torch-cpu", "numpy")


def test_a_cuda_backend_without_cuda_falls_back_to_the_reference_at_once(monkeypatch, caplog):
    """Asked for where torch sees no CUDA device, the backend fails when it is made, so the process runs on the
    reference with one line in the log instead of an answer failing halfway."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        rowmath.make("torch-cuda")
    monkeypatch.setenv("DSBD_CHAT_ROWMATH", "torch-cuda")
    monkeypatch.setattr(rowmath, "_DEFAULT", [])
    with caplog.at_level("WARNING", logger=rowmath.__name__):
        assert rowmath.backend().name == "numpy"
    assert [r.getMessage() for r in caplog.records] == [
        "row math: backend 'torch-cuda' cannot run (torch " + torch.__version__ + " sees no CUDA device); "
        "using the numpy reference"]


def test_a_device_without_measured_prices_times_its_own_cells_once():
    """The forest policy prices the row math per cell: the CPU's measured figures, and on any other device (whose
    costs are not a CPU's) the device's own timing, taken at first use and kept."""
    from app.config import DecodeParams
    from app.decoding.forest_policy import decoder_costs

    cpu = tensors.TorchRows("cpu")
    assert cpu.cell_seconds == tensors.TORCH_CELL_SECONDS
    other = tensors.TorchRows("cpu")
    other._cell_seconds = None  # what a CUDA backend starts from
    timed = other.cell_seconds
    assert all(np.isfinite(v) and v > 0 for v in timed) and other.cell_seconds is timed  # timed once
    params = DecodeParams(mode="dsbd", beams=4, draft_beams=8, gamma=3).validated()
    V = 151_936
    warp, chain = timed
    assert decoder_costs(params, V, rm=other)["verify_cost"](8) == pytest.approx(4 * V * warp + 4 * V * chain * 8
                                                                                  + 8 * V * warp)


def test_rows_whose_parents_hold_no_draft_mass_get_an_empty_law():
    """q mapped onto rows whose parents carry none of q's pairs (a warp cut their support) is an empty law of
    float masses, not an error."""
    q = rowmath.NumpyLaw(Joint(np.array([5, 7], np.int64), np.array([0.25, 0.75]), 10))  # parent 0 only
    out = rowmath.NumpyRows().on_rows(q, [[1], [1]], [1, 1])
    assert len(out.joint.keys) == 0 and out.joint.probs.dtype == np.float64


@pytest.mark.parametrize("without", [False, True], ids=["with", "without"])
@pytest.mark.parametrize("same_cells", [False, True], ids=["apart", "same-cells"])
def test_compiled_verifier_reads_q_on_the_rows_from_the_stored_rows_with_the_reference_law(without, same_cells):
    """Draft rows mapped onto target rows through two parents (two target rows share a content, spec §16.2) are
    never formed as a table by the compiled backend: its verifier's law of outputs is the reference's within
    float32 rounding. Parents whose rows lie in the same cells (q's rows read in place) merge into one row and
    keep the law."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    tm, ref = rowmath.make("compiled"), rowmath.NumpyRows()
    V = 3
    px = np.log(np.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))  # rows 0 and 1: one content
    qx = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.1, 0.6]]))
    if same_cells:
        qx[1] = qx[0]
    ps, qs = np.log([0.3, 0.3, 0.4]), np.log([0.5, 0.2, 0.3])
    parents, counts = [[0, 1], [0, 1], [2]], [2, 2, 1]
    pr, qr = ref.law(ref.rows(px), ps, Warp()), ref.law(ref.rows(qx), qs, Warp())
    pt, qt = tm.law(tm.rows(px), ps, Warp()), tm.law(tm.rows(qx), qs, Warp())
    if same_cells:
        qt.origin = ["a", "a", "b"]  # as TorchLogProbs names rows read in place from the same cells
    q_on_ref, q_on = ref.on_rows(qr, parents, counts), tm.on_rows(qt, parents, counts)
    assert not hasattr(q_on, "_formed") or q_on._formed is None
    if same_cells:
        assert list(np.diff(q_on.ptr)) == [1, 1, 1]  # one row read per target row
    keys = np.arange(3 * V)
    assert np.allclose(q_on.lookup(keys), q_on_ref.lookup(keys), rtol=1e-6, atol=0)
    p, q = pr.joint, q_on_ref.joint
    valid = np.ones(3, bool)
    for W_S, W_L in [(1, 1), (2, 1)] + ([(2, 2)] if without else []):  # with (2, 2): the slow set's enumerations
        if without:
            want = laws_without(p, q, valid, W_S, W_L, lambda d, rand: ref.verify_without(pr, q_on_ref, d, W_L, rand))
            got = laws_without(p, q, valid, W_S, W_L, lambda d, rand: tm.verify_without(pt, q_on, d, W_L, rand))
        else:
            want = laws(p, q, valid, W_S, W_L, lambda d, rand: ref.verify(ref.chain(pr, q_on_ref, W_S), d, W_L, rand))
            got = laws(p, q, valid, W_S, W_L, lambda d, rand: tm.verify(tm.chain(pt, q_on, W_S), d, W_L, rand))
        assert gap(got, want) < 1e-6, (W_S, W_L)
    assert q_on._formed is None  # read from the stored rows throughout
    if not same_cells:  # negative control: rows that differ, merged as if they lay in the same cells
        qt.origin = ["a", "a", "b"]
        assert not np.allclose(tm.on_rows(qt, parents, counts).lookup(keys), q_on_ref.lookup(keys), rtol=1e-3)
def plain_rows(rng, size: int) -> list[np.ndarray]:
    """One-row logits as a pass hands them over: peaked, wide, far off, masked, half masked, one finite cell, flat."""
    rows = [rng.normal(0, 3, size), rng.normal(0, 3, size) * 40, rng.normal(0, 2, size) + 300.0]
    rows[0][rng.integers(0, size, 5)] += 15
    masked = rng.normal(0, 3, size)
    masked[rng.random(size) < 0.3] = -np.inf
    half = rng.normal(0, 3, size)
    half[: size // 2] = -np.inf
    one = np.full(size, -np.inf)
    one[size // 3] = 1.5
    rows += [masked, half, one, np.zeros(size)]
    return [r.astype(np.float32)[None, :] for r in rows]


@pytest.mark.parametrize("size", [49_152, 151_936, 5_000, 4_096, 100])
def test_the_fused_plain_step_is_the_general_paths_step_bit_for_bit(size):
    """The compiled backend's one-row step (`plain_step`, two compiled calls) draws the key `law(...).sample(1)`
    draws and gives the log-prob `at` gives, to the bit, and leaves the generator where the draw left it: every
    temperature, beam score and kind of row; greedy's argmax and log-prob likewise; a truncated warp or an
    enumerating rand are left to the general path."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    rm = rowmath.make("compiled")
    rng = np.random.default_rng(size)
    for i, x in enumerate(plain_rows(rng, size)):
        for warp in (Warp(), Warp(0.7), Warp(1.3), Warp(0.25)):
            for score in (0.0, -3.25, -123.456789):
                seed = int(rng.integers(1 << 30))
                general, fused = SeededRand(np.random.default_rng(seed)), SeededRand(np.random.default_rng(seed))
                lp = rm.rows(x)
                key = int(rm.law(lp, np.array([score]), warp).sample(1, general)[0])
                assert rm.plain_step(x, score, warp, fused) == (key, lp.at(0, key)), (i, warp, score)
                assert general.rng.random() == fused.rng.random()
        lp = rm.rows(x)
        key = lp.argmax(0)
        assert rm.plain_step(x, 0.0, None, None) == (key, lp.at(0, key)), i
    x = plain_rows(rng, size)[0]
    assert rm.plain_step(x, 0.0, Warp(1.0, top_k=20), SeededRand(np.random.default_rng(0))) is None
    assert rm.plain_step(x, 0.0, Warp(1.0, top_p=0.9), SeededRand(np.random.default_rng(0))) is None
    dead = np.full((1, size), -np.inf, np.float32)
    assert rm.plain_step(dead, 0.0, Warp(), SeededRand(np.random.default_rng(0))) is None



def mixed_rows(rng, kinds, n_rows: int, *, invalid: bool):
    """n_rows rows drawn from `kinds` and their scores, one of them an invalid parent (-inf) where asked."""
    x = np.concatenate([kinds[int(i)] for i in rng.integers(0, len(kinds), n_rows)])
    scores = -rng.uniform(0, 30, n_rows)
    if invalid:
        scores[rng.integers(0, n_rows)] = -np.inf
    return x, scores


@pytest.mark.parametrize("size", [49_152, 151_936, 5_000, 100])
def test_the_fused_beam_step_is_the_general_paths_step_bit_for_bit(size):
    """The compiled backend's step over a pass's rows (`beam_step`) draws the keys the general path draws with and
    without replacement, with the log-probs `at` gives, to the bit, and leaves the generator where the draws left
    it: 2 to 6 rows of every kind, invalid parents, temperatures, more draws than rows; a truncated warp, no valid
    parent or too few blocks with mass for the distinct draws are left to the general path."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    rm = rowmath.make("compiled")
    rng = np.random.default_rng(size + 1)
    kinds = plain_rows(rng, size)
    for trial in range(12):
        n_rows = 2 + trial % 5
        x, scores = mixed_rows(rng, kinds, n_rows, invalid=trial % 3 == 0)
        for warp in (Warp(), Warp(0.7), Warp(1.6)):
            for replace, n in ((True, n_rows), (True, 2 * n_rows + 1), (False, n_rows)):
                seed = int(rng.integers(1 << 30))
                general, fused = SeededRand(np.random.default_rng(seed)), SeededRand(np.random.default_rng(seed))
                lp = rm.rows(x)
                p = rm.law(lp, scores, warp)
                keys = p.sample(n, general) if replace else rm.distinct_keys(p, n, general)
                want = [(r, t, lp.at(r, t)) for r, t in (divmod(int(k), size) for k in keys)]
                got = rm.beam_step(x, scores, warp, fused, n, replace)
                if got is None:  # refused: distinct draws beyond the blocks with mass (the general path's case)
                    assert not replace and np.count_nonzero(p.blocks() > 0) < n
                    assert fused.rng.random() == np.random.default_rng(seed).random()
                    continue
                assert got == want, (trial, warp, replace)
                assert general.rng.random() == fused.rng.random()
    x = np.concatenate(kinds[:3])
    scores = np.array([-1.0, -2.0, -3.0])
    rand = SeededRand(np.random.default_rng(0))
    assert rm.beam_step(x, scores, Warp(1.0, top_k=20), rand, 3, True) is None
    assert rm.beam_step(x, scores, Warp(1.0, top_p=0.9), rand, 3, True) is None
    assert rm.beam_step(x, np.full(3, -np.inf), Warp(), rand, 3, True) is None
    one = np.concatenate([kinds[5], kinds[5]])  # one finite cell a row: one block each holds mass
    assert rm.beam_step(one, scores[:2], Warp(), rand, 3, False) is None
    assert rand.rng.random() == np.random.default_rng(0).random()  # no uniform was drawn by the refusals


class _LyingRows:
    """Rows read in place as `backends.unique.Rows` hands them out (row views, `take` copies, `lie`), counting
    copies."""

    def __init__(self, x: np.ndarray) -> None:
        self.x, self.shape, self.dtype, self.copies = x, x.shape, x.dtype, 0
        self._where = [(0, i) for i in range(len(x))]

    def row(self, i: int) -> np.ndarray:
        return self.x[i]

    def block(self):
        return None

    def take(self, idx):
        self.copies += 1
        return self.x[list(idx)]

    def lie(self, idx):
        return self.x, [int(i) for i in idx]


def test_the_compiled_stack_normalises_rows_where_they_lie():
    """DSBD's beams over rows of one pass: the compiled backend normalises them where they lie (no copy of the
    rows) into the normalisers, e and block sums the copying stack gives, bit for bit, so the law and its draws are
    the same; the rows' own results keep the normalisers; a temperature reads the raw cells (copied then, row by
    row)."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    from app.decoding.rowmath.tensors import TorchRows

    rm = rowmath.make("compiled")
    x = qwen_rows(np.random.default_rng(5), 6)
    idx, scores = [4, 1, 3], np.array([-0.5, -1.0, -2.0])
    for warp in (Warp(), Warp(0.7)):
        lying = _LyingRows(x)
        src, plain = rm.rows(lying), rm.rows(x.copy())
        got = rm.stack([src.row(i) for i in idx])
        want = TorchRows.stack(rm, [plain.row(i) for i in idx])
        assert lying.copies == 0 and got.lse_all().tolist() == want.lse_all().tolist()
        assert (got.e.numpy() == want.e.numpy()).all() and (got.eb == want.eb).all()
        assert [src._norm[i] for i in idx] == [plain._norm[i] for i in idx]
        a, b = rm.law(got, scores, warp), rm.law(want, scores, warp)
        rand_a, rand_b = SeededRand(np.random.default_rng(3)), SeededRand(np.random.default_rng(3))
        assert rm.distinct_keys(a, 4, rand_a) == rm.distinct_keys(b, 4, rand_b)
        assert a.top(5).tolist() == b.top(5).tolist()
        assert got.at(2, 7) == want.at(2, 7) and lying.copies == 0


def test_the_fused_step_on_beams_reads_them_where_they_lie():
    """DSBD's plain step over its beams' rows (LogProbRow of one pass): the fused step reads them in the runtime's
    buffer by index, with no copy, and gives the keys, log-probs and normalisers of the same step on the rows
    copied out, with and without replacement, at two temperatures."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    rm = rowmath.make("compiled")
    x = qwen_rows(np.random.default_rng(9), 6)
    idx, scores = [5, 0, 2, 3], np.array([-0.5, -1.0, -2.0, -np.inf])
    for warp in (Warp(), Warp(0.7)):
        for replace, n in ((True, 6), (False, 4)):
            lying = _LyingRows(x)
            src = rm.rows(lying)
            got = rm.beam_step([src.row(i) for i in idx], scores, warp, SeededRand(np.random.default_rng(4)), n,
                               replace)
            want = rm.beam_step(np.ascontiguousarray(x[idx]), scores, warp, SeededRand(np.random.default_rng(4)), n,
                                replace)
            assert got == want and got is not None and lying.copies == 0, (warp, replace)
            plain = rm.rows(x[idx].copy())
            assert [src._norm[i] for i in idx[:3]] == [plain.lse(j) and plain._norm[j] for j in range(3)]


@pytest.mark.parametrize("size", [151_936, 5_000, 100])
def test_the_compiled_draws_from_a_law_are_the_inverse_cdfs_bit_for_bit(size):
    """A dense law's draws on the compiled backend (one kernel call over its stored cells) are the keys the torch
    backend's Python inverse CDF gives for the same uniforms, with and without replacement, and the drawn cells'
    values to the bit: rows of every kind, an invalid parent, temperatures, more draws than rows."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    from app.decoding.rowmath.tensors import TorchRows

    rm = rowmath.make("compiled")
    rng = np.random.default_rng(size + 7)
    kinds = plain_rows(rng, size)
    for trial in range(10):
        n_rows = 1 + trial % 6
        x, scores = mixed_rows(rng, kinds, n_rows, invalid=trial % 3 == 0 and n_rows > 1)
        for warp in (Warp(), Warp(0.7), Warp(1.6)):
            p = rm.law(rm.rows(x), scores, warp)
            for replace, n in ((True, 2 * n_rows + 1), (False, min(n_rows + 2, np.count_nonzero(p.blocks() > 0)))):
                u = rng.random(n)
                keys, values = rm._draws(p, u, replace)
                want_keys, want_values = TorchRows._draws(rm, p, u, replace)
                assert keys.tolist() == want_keys.tolist(), (trial, warp, replace)
                assert values.tolist() == want_values.tolist(), (trial, warp, replace)
                if not replace:
                    assert len(set(keys.tolist())) == n
