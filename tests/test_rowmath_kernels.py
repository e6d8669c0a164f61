"""The compiled row kernels (app/decoding/rowmath/kernels.py) against float64 numpy: exp within 2 float32 ulps of
the float64 exp of the same float32 argument, block sums and log-sum-exp within 1e-6, residual cells bit for bit
numpy's float32 formula, no NaN; on Qwen-sized rows and odd sizes, with -inf masks and extreme logits; two Python
threads at once; a reassociated exp (the flag the kernels refuse) fails the tolerance."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed: the compiled row kernels are optional")

from app.decoding.sampling import CDF_BLOCK  # noqa: E402


def _load():
    """kernels.py by its path (a module rowmath.py may stand where the package will), under the name the package
    gives it: numba's cache records the module's name, and a cache written under another name fails to load."""
    name = "app.decoding.rowmath.kernels"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "app" / "decoding" / "rowmath" / "kernels.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


K = _load()
QWEN = 151_936
SIZES = [QWEN, 5_000, 8_192, 1_000]  # many blocks, a short last block, whole blocks only, one short block
TINY = float(np.finfo(np.float32).tiny)


def logits(size: int, seed: int = 0) -> np.ndarray:
    """Rows as the decoders meet them: peaked LLM-like, -inf masked (all, some), huge, tiny, ties, a wide spread."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 2, (8, size)).astype(np.float32)
    x[0, rng.integers(0, size, 8)] += 14
    x[1] = -np.inf
    x[2, rng.random(size) < 0.5] = -np.inf
    x[2, 0] = -np.inf
    x[3] *= np.float32(1e30)
    x[4] *= np.float32(1e-30)
    x[5] = 3.0
    x[6] = rng.uniform(-200, 0, size).astype(np.float32)  # below ln(2^-126) of the max: cells under float32's normals
    x[7] = rng.normal(0, 2, size).astype(np.float32) * 50
    return x


def within_ulps(got: np.ndarray, want: np.ndarray, ulps: float = 2.0) -> np.ndarray:
    """got (float32) within `ulps` float32 ulps of the float64 want; under float32's smallest normal, 0 to it."""
    spacing = np.spacing(want.astype(np.float32)).astype(np.float64)
    normal = want >= TINY
    return np.where(normal, np.abs(got - want) <= ulps * spacing, (got >= 0) & (got <= TINY))


def block_sums64(cells: np.ndarray) -> np.ndarray:
    """Float64 sums of each row's consecutive CDF_BLOCK-cell blocks."""
    return np.add.reduceat(cells.astype(np.float64), np.arange(0, cells.shape[-1], CDF_BLOCK), axis=-1)


def sums_close(got: np.ndarray, want: np.ndarray) -> bool:
    """Block sums within 1e-6, give or take the cells flushed to 0 (each under float32's smallest normal)."""
    return bool(np.all(np.abs(got - want) <= 1e-6 * want + CDF_BLOCK * TINY))


def close(got, want, rtol: float = 1e-6) -> bool:
    return bool(np.all(np.abs(np.asarray(got) - want) <= rtol * np.abs(want)))


def test_available():
    assert K.available() == (True, "")


def test_warm_compiles_every_kernel():
    """A kernel that warm() leaves out is compiled inside the first answer that reaches it (a fresh install's first
    drafted layer waited 0.36 s for one): in a fresh process, warm() alone gives every kernel that Python code calls
    a compiled signature (the kernels' own helpers compile inside their callers)."""
    import ast
    import subprocess

    path = Path(K.__file__)
    tree = ast.parse(path.read_text())
    jitted = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              and any("njit" in ast.unparse(d) for d in f.decorator_list)}
    python = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name not in jitted]
    called = {c.func.id for f in python for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    entries = sorted(called & jitted)
    assert {"_norms", "_pair_blocks", "_pair_pq", "_draw_rows"} <= set(entries)
    code = ("from app.decoding.rowmath import kernels as K\n"
            "assert K.warm()[0]\n"
            f"print(sorted(n for n in {entries!r} if not getattr(K, n).signatures))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=path.parents[3], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("size", SIZES)
def test_norms(size):
    x = logits(size)
    e, eb = np.full(x.shape, np.nan, np.float32), np.full((x.shape[0], K.blocks(size)), np.nan)
    m = K.norms(x, e, eb)
    top = x.max(axis=1).astype(np.float64)
    assert np.array_equal(m, np.where(np.isfinite(top), top, 0.0))
    want = np.exp((x - m.astype(np.float32)[:, None]).astype(np.float64))  # float32 argument, float64 exp
    assert within_ulps(e, want).all()
    assert (e[1] == 0).all() and (e[2][x[2] == -np.inf] == 0).all()
    assert sums_close(eb, block_sums64(want))
    with np.errstate(divide="ignore"):
        lse = m + np.log(eb.sum(axis=1))
        ref = m + np.log(np.exp(x.astype(np.float64) - m[:, None]).sum(axis=1))  # float64 throughout
    assert lse[1] == ref[1] == -np.inf
    finite = np.isfinite(ref)
    assert (np.abs(lse[finite] - ref[finite]) <= 1e-6 * np.maximum(1.0, np.abs(ref[finite]))).all()
    assert not np.isnan(e).any() and not np.isnan(eb).any() and not np.isnan(m).any()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_exp_blocks(size, temperature):
    x = logits(size, seed=1)
    top = x.max(axis=1).astype(np.float64)
    shift = np.where(np.isfinite(top), top, 0.0)
    e, eb = np.full(x.shape, np.nan, np.float32), np.full((x.shape[0], K.blocks(size)), np.nan)
    K.exp_blocks(x, shift, 1.0 / temperature, e, eb)
    arg = (x - shift.astype(np.float32)[:, None]) * np.float32(1.0 / temperature)  # float32, as the kernel rounds it
    want = np.exp(arg.astype(np.float64))
    assert within_ulps(e, want).all()
    assert sums_close(eb, block_sums64(want))
    assert not np.isnan(e).any() and not np.isnan(eb).any()


@pytest.mark.parametrize("size", [QWEN * 3, 4 * CDF_BLOCK, 100])
def test_block_sums(size):
    flat = np.random.default_rng(2).exponential(1.0, size).astype(np.float32)
    out = K.block_sums(flat, np.empty(K.blocks(size)))
    assert close(out, block_sums64(flat), rtol=1e-12)


@pytest.mark.parametrize("size", [QWEN, 5_000, 1_000])
def test_scaled(size):
    e = np.random.default_rng(3).random((3, size), dtype=np.float32)
    scale = np.array([1e-3, 1.0 / 3.0, 0.0])
    out = K.scaled(e, scale, np.empty(e.size, np.float32))
    assert np.array_equal(out, (e * scale.astype(np.float32)[:, None]).ravel())  # float32 products, bit for bit


def laws(size: int, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Normalised float32 laws p, q over the same cells, q a noisy p with zeros where p has mass and the reverse."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 2, size)
    p = np.exp(x - x.max())
    q = np.exp(x + rng.normal(0, 1, size) - x.max())
    p[rng.random(size) < 0.1] = 0.0
    q[rng.random(size) < 0.1] = 0.0
    return (p / p.sum()).astype(np.float32), (q / q.sum()).astype(np.float32)


@pytest.mark.parametrize("size", [4 * QWEN, 5_000, 1_000])
@pytest.mark.parametrize("s", [0.0, 0.5, 1.0, 1.7, 1e3])
def test_residual(size, s):
    p, q = laws(size)
    out = np.full(K.blocks(size), np.nan)
    total = K.residual_blocks(p, q, s, out)
    want = np.maximum(p - np.float32(s) * q, np.float32(0)).astype(np.float64)  # numpy's float32 formula
    cells = [K.residual_cells(p, q, s, lo, min(lo + CDF_BLOCK, size)) for lo in range(0, size, CDF_BLOCK)]
    assert np.array_equal(np.concatenate(cells), want)  # bit for bit
    assert close(out, np.array([c.sum() for c in cells]), rtol=1e-12)
    assert close(total, want.sum(), rtol=1e-12) and close(total, out.sum(), rtol=1e-12)
    assert not np.isnan(out).any()
    if s == 0.0:
        assert close(total, p.sum(dtype=np.float64), rtol=1e-12)


@pytest.mark.parametrize("size", [QWEN, 5_000, 1_000])
@pytest.mark.parametrize("s", [0.0, 0.7, 1e3])
def test_pair_residual_from_the_stored_rows(size, s):
    """The residual read from e rows, a scale per row and q's parents per row (none, one, three, one shared by
    two rows) equals numpy's float32 formula on the formed tables bit for bit, cell by cell and block by block."""
    rng = np.random.default_rng(3)
    ep = rng.random((4, size)).astype(np.float32)
    eq = rng.random((3, size)).astype(np.float32)
    ep[1, : size // 3] = 0.0  # masked cells
    ap = np.array([0.3, 1.7, 2e-6, 0.9])
    qptr, qidx, qc = [0, 0, 1, 4, 5], [2, 0, 1, 2, 2], [0.25, 0.5, 0.125, 0.75, 1.5]
    f32 = np.float32
    p = ep * ap.astype(f32)[:, None]
    q = np.zeros_like(p)
    for r in range(4):
        for k in range(qptr[r], qptr[r + 1]):
            prod = eq[qidx[k]] * f32(qc[k])
            q[r] = prod if k == qptr[r] else q[r] + prod
    want = np.maximum(p - f32(s) * q, f32(0)).astype(np.float64)
    pair = K.Pair(ep, ap, eq, qptr, qidx, qc)
    out = np.full(4 * K.blocks(size), np.nan)
    total = pair.blocks(s, out)
    for r in range(4):
        cells = [pair.cells(s, r, lo, min(lo + CDF_BLOCK, size)) for lo in range(0, size, CDF_BLOCK)]
        assert np.array_equal(np.concatenate(cells), want[r])  # bit for bit
        assert close(out[r * K.blocks(size):(r + 1) * K.blocks(size)], np.array([c.sum() for c in cells]), rtol=1e-12)
        t = size // 2
        assert pair.pq(r, t) == (float(p[r, t]), float(q[r, t]))
    assert close(total, want.sum(), rtol=1e-12)


def test_pair_refuses_parents_that_are_not_rows():
    e = np.ones((2, 10), np.float32)
    with pytest.raises(ValueError, match="CSR"):
        K.Pair(e, [1, 1], e, [0, 1, 2], [0, 5], [1, 1])
    with pytest.raises(ValueError, match="CSR"):
        K.Pair(e, [1, 1], e, [0, 1], [0], [1])


class Cores:
    """A thread governor that says how many threads the next call gets (as other programs' load would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def threads(self) -> int:
        return self.n


def test_one_and_two_threads_agree(monkeypatch):
    """The split over threads changes which core does a block, not the arithmetic: results are bit for bit equal;
    each call runs on the threads the governor gives it."""
    import numba

    x = logits(QWEN)
    runs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        monkeypatch.setattr(K, "_GOVERNOR", [Cores(threads)])
        e, eb = np.empty_like(x), np.empty((x.shape[0], K.blocks(QWEN)))
        m = K.norms(x, e, eb)
        assert numba.get_num_threads() == threads
        runs.append((m, e, eb))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_two_python_threads_at_once():
    """Parallel kernels called from two Python threads at once (bounded) give each caller its own right answer."""
    xs = [logits(QWEN // 4, seed=s) for s in (5, 6)]
    expected = []
    for x in xs:
        e, eb = np.empty_like(x), np.empty((x.shape[0], K.blocks(x.shape[1])))
        expected.append((K.norms(x, e, eb), e, eb))
    bad: list[str] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        x = xs[i]
        e, eb = np.empty_like(x), np.empty_like(expected[i][2])
        flat, sums = np.empty(x.size, np.float32), np.empty(K.blocks(x.size))
        start.wait()
        for _ in range(150):
            m = K.norms(x, e, eb)
            K.scaled(e, np.full(x.shape[0], 0.5), flat)
            K.block_sums(flat, sums)
            if not (np.array_equal(m, expected[i][0]) and np.array_equal(e, expected[i][1])
                    and np.array_equal(eb, expected[i][2])):
                bad.append(f"thread {i}")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and bad == []


def test_outputs_are_checked():
    x = np.zeros((2, 5_000), np.float32)
    with pytest.raises(ValueError, match="eb_out"):
        K.norms(x, np.empty_like(x), np.empty((2, 1)))
    with pytest.raises(ValueError, match="e_out"):
        K.norms(x, np.empty((2, 5_000)), np.empty((2, 2)))  # float64 cells
    e = np.empty((2, 5_000), np.float32)
    K.norms(x[:, ::-1], e, np.empty((2, 2)))  # a strided input is copied, not refused
    assert (e == 1).all()


def test_reassociated_exp_fails():
    """Negative control: the same exp compiled with the sums' flags (reassociation) breaks the rounding trick and
    misses the 2-ulp tolerance by far, so the tolerance and the refusal of those flags both matter."""
    from numba import njit

    loose = njit(fastmath=K._SUMS)(K._exp.py_func)

    @njit
    def apply(f, d, out):
        for i in range(d.size):
            out[i] = f(d[i])

    d = -np.random.default_rng(7).uniform(0, 87, 100_000).astype(np.float32)
    want = np.exp(d.astype(np.float64))
    good, bad = np.empty_like(d), np.empty_like(d)
    apply(K._exp, d, good)
    apply(loose, d, bad)
    assert within_ulps(good, want).all()
    assert not within_ulps(bad, want).all()


def test_the_plain_steps_totals_are_numpys_sums_bit_for_bit():
    """The plain step totals block sums in numpy's pairwise order: equal to the bit to `ndarray.sum` (a row's and a
    row set's) for every count up to 1,000 and a few far beyond, where numpy splits the range, whatever the
    magnitudes; a left-to-right sum (negative control) is not."""
    rng = np.random.default_rng(0)
    for n in list(range(1, 1001)) + [4_097, 9_999, 20_000]:
        for _ in range(3 if n > 200 else 10):
            a = rng.random(n) * 10.0 ** rng.uniform(-8, 8, n)
            assert K.numpy_sum(a) == a.sum(), n
            assert K.numpy_sum(a) == a[None, :].sum(axis=1)[0], n
    assert any(sum(a.tolist()) != a.sum() for a in (rng.random(38) * 10.0 ** rng.uniform(-8, 8, 38)
                                                   for _ in range(100)))


@pytest.mark.parametrize("size", SIZES)
def test_the_one_row_step_is_norms_and_exp_blocks_and_an_inverse_cdf(size):
    """`RowStep.law`: the max, and block sums equal to the bit to `norms`'s and `exp_blocks`'s (one thread or all);
    `draw`: the inverse CDF of the law e * scale over its blocks then its cells (numpy's running sums)."""
    for r, x in enumerate(logits(size, seed=size)):
        if not np.isfinite(x).any():
            continue
        step = K.RowStep(size)
        e, eb = np.empty((1, size), np.float32), np.empty((1, K.blocks(size)))
        m = K.norms(x[None, :], e, eb)
        for inv_t in (1.0, 1 / 0.7, 4.0):
            got_m, s1, s_t, first = step.law(x, inv_t, argmax=True)
            assert got_m == m[0] and (step.eb1 == eb[0]).all() and s1 == eb[0].sum(), r
            assert first == int(np.argmax(x)), r
            et, ebt = np.empty_like(e), np.empty_like(eb)
            K.exp_blocks(x[None, :], m, inv_t, et, ebt)
            assert (step.eb == ebt[0]).all() and s_t == ebt[0].sum(), (r, inv_t)
            if not 0 < s_t < np.inf:
                continue
            scale = 1.0 / s_t
            cells = et[0].astype(np.float64) * scale
            for u in (0.0, 0.3, 0.999999):
                key = step.draw(x, got_m, inv_t, scale, u)
                blocks = ebt[0] * scale
                t = u * blocks.sum()
                b = min(int(np.cumsum(blocks).searchsorted(t, side="right")), blocks.size - 1)
                while b > 0 and blocks[b] <= 0:
                    b -= 1
                lo = b * CDF_BLOCK
                seg = cells[lo:lo + CDF_BLOCK]
                rest = t - (np.cumsum(blocks)[b - 1] if b else 0.0)
                i = int(np.cumsum(seg).searchsorted(rest, side="right"))
                want = lo + (i if i < seg.size else int(np.flatnonzero(seg > 0)[-1]))
                assert key == want and cells[key] > 0, (r, inv_t, u)
