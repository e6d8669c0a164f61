"""PyTorch backend: Layout R forest evaluation, commit/compaction, loaders, and agreement with llama.cpp.

Oracle everywhere: the logits of a node (or row root) must equal a from-scratch causal forward over
that node's explicit token sequence (committed row + suffix + ancestors + itself).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from backends.registry import ModelSpec
from backends.base import ROOT, AcceptedPath, BackendError, ContextFull, Forest
from backends.pytorch import load
from backends.pytorch.model import ModelArgs, init_random
from backends.pytorch.runtime import PyTorchModel, model_info
from backends.pytorch.safetensors_loader import hf_config, hf_name
from prefill_history import history_does_not_count
from torch_helpers import F64_TOL, TINY_ARGS, scratch_logits, wrap

GGUF_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny() -> PyTorchModel:
    return wrap(init_random(TINY_ARGS, seed=0))


class Mirror:
    """Drives a context and tracks every row's / node's explicit sequence to check it against scratch."""

    def __init__(self, model: PyTorchModel, ctx, tol: float):
        self.model, self.ctx, self.tol = model, ctx, tol
        self.rows = [list(ctx.tokens(r)) for r in range(ctx.rows)]
        self.suffix = [[] for _ in self.rows]
        self.nodes: list[tuple[int, int, int]] = []  # (token, parent, row)
        self.worst = 0.0

    def seq(self, nid: int) -> list[int]:
        tok, parent, row = self.nodes[nid]
        head = self.rows[row] + self.suffix[row] if parent == ROOT else self.seq(parent)
        return head + [tok]

    def evaluate(self, forest: Forest, check: bool = True):
        out = self.ctx.evaluate(forest)
        for r, s in enumerate(forest.suffix):
            self.suffix[r] += list(s)
        base = len(self.nodes)
        self.nodes += list(zip(forest.tokens, forest.parents, forest.rows))
        want = np.float64 if self.tol < 1e-6 else np.float32  # float64 models ask for float64 logits
        assert out.roots.dtype == want and out.nodes.dtype == want
        assert out.root_rows == tuple(r for r, s in enumerate(forest.suffix) if s)
        assert out.nodes.shape == (len(forest.tokens), self.model.info.vocab_size)
        if check:
            for i, r in enumerate(out.root_rows):
                self._check(out.roots[i], self.rows[r] + self.suffix[r])
            for i in range(len(forest.tokens)):
                self._check(out.nodes[i], self.seq(base + i))
        return out

    def commit(self, paths: list[AcceptedPath]) -> None:
        self.ctx.commit(paths)
        self.rows = [self.rows[p.row] + self.suffix[p.row] + [self.nodes[n][0] for n in p.nodes] for p in paths]
        self.suffix = [[] for _ in paths]
        self.nodes = []
        assert self.ctx.lengths() == [len(r) for r in self.rows]
        assert [self.ctx.tokens(r) for r in range(self.ctx.rows)] == self.rows

    def _check(self, got: np.ndarray, seq: list[int]) -> None:
        err = float(np.abs(got.astype(np.float64) - scratch_logits(self.model, seq)).max())
        self.worst = max(self.worst, err)
        assert err <= self.tol, f"max abs logit error {err:.3g} > {self.tol:g} for sequence {seq}"


def three_rows(model: PyTorchModel, tol: float, *, prompt=(5, 17, 3, 42, 8, 9, 60), max_tokens=64) -> Mirror:
    """A context whose 3 rows hold different prefixes of different lengths (via one tree and a commit)."""
    ctx = model.context(rows=4, max_tokens=max_tokens, logits_dtype=np.float64 if tol < 1e-6 else np.float32)
    ctx.prefill(list(prompt))
    m = Mirror(model, ctx, tol)
    # nodes 0..3: 0 -> 1 -> 2 chain, 3 a sibling of 0
    m.evaluate(Forest(suffix=((11,),), tokens=(20, 21, 22, 23), parents=(ROOT, 0, 1, ROOT), rows=(0, 0, 0, 0)))
    m.commit([AcceptedPath(0, (0, 1)), AcceptedPath(0), AcceptedPath(0, (3,))])
    assert ctx.lengths() == [len(prompt) + 3, len(prompt) + 1, len(prompt) + 2]
    return m


# Layer-by-layer view of one forest over 3 rows: row 0 has duplicate (parent, token) siblings and
# depth 3, row 1 only a suffix (a childless root), row 2 a branching tree of depth 3.
SUFFIX = ((30,), (31, 32), (33,))
LAYERS = [  # (tokens, parents, rows); parents index the pending nodes in evaluation order
    ((40, 40, 41, 50, 51), (ROOT, ROOT, ROOT, ROOT, ROOT), (0, 0, 0, 2, 2)),
    ((42, 43, 42, 52, 53), (0, 0, 2, 3, 4), (0, 0, 0, 2, 2)),
    ((44, 54, 54), (5, 8, 9), (0, 2, 2)),
]


def whole_forest() -> Forest:
    toks, pars, rows = (sum((list(layer[k]) for layer in LAYERS), []) for k in range(3))
    return Forest(suffix=SUFFIX, tokens=tuple(toks), parents=tuple(pars), rows=tuple(rows))


# -- tiny random model (float64) ---------------------------------------------------------------------


def test_forest_in_one_pass_matches_scratch(tiny):
    m = three_rows(tiny, F64_TOL)
    out = m.evaluate(whole_forest())
    assert out.root_rows == (0, 1, 2)
    assert np.abs(out.nodes[0] - out.nodes[1]).max() <= F64_TOL  # duplicate siblings score alike


def test_forest_layer_by_layer_matches_one_pass(tiny):
    one = three_rows(tiny, F64_TOL).ctx.evaluate(whole_forest())
    m = three_rows(tiny, F64_TOL)
    got = []
    for d, (toks, pars, rows) in enumerate(LAYERS):
        out = m.evaluate(Forest(suffix=SUFFIX if d == 0 else (), tokens=toks, parents=pars, rows=rows))
        got.append(out.nodes)
        if d == 0:
            assert np.abs(out.roots - one.roots).max() <= F64_TOL
    assert np.abs(np.concatenate(got) - one.nodes).max() <= F64_TOL


COMMITS = {
    "no_nodes": [AcceptedPath(0), AcceptedPath(1), AcceptedPath(2)],
    "full_path": [AcceptedPath(0, (0, 5, 10)), AcceptedPath(1), AcceptedPath(2, (4, 9, 12))],
    "duplicated": [AcceptedPath(2, (3, 8)), AcceptedPath(2, (4, 9, 12)), AcceptedPath(2, (4,)), AcceptedPath(0, (2,))],
    "dropped": [AcceptedPath(2, (4, 9)), AcceptedPath(0, (0, 6))],
}


@pytest.mark.parametrize("case", sorted(COMMITS))
def test_commit_then_step_matches_recompute(tiny, case):
    m = three_rows(tiny, F64_TOL)
    m.evaluate(whole_forest(), check=False)
    m.commit(COMMITS[case])
    n = m.ctx.rows
    # one more step: a fresh suffix per row plus a small tree on every row
    step = Forest(
        suffix=tuple((60 + r,) for r in range(n)),
        tokens=tuple(70 + r for r in range(n)) + (80,),
        parents=(ROOT,) * n + (0,),
        rows=tuple(range(n)) + (0,),
    )
    m.evaluate(step)
    # second iteration after compaction: commit a path, then score again
    m.commit([AcceptedPath(r, (r,)) for r in range(n)][::-1])
    out = m.evaluate(Forest(suffix=tuple((90,) for _ in range(n)), tokens=(91, 92), parents=(ROOT, 0), rows=(0, 0)))
    assert np.abs(out.nodes[-1] - scratch_logits(tiny, m.seq(len(m.nodes) - 1))).max() <= F64_TOL  # = recomputed


def test_memory_mode_one_row_holds_all_nodes(tiny):
    ctx = tiny.context(rows=1, max_tokens=40, logits_dtype=np.float64)
    ctx.prefill([3, 1, 4, 1, 5, 9, 2, 6])
    m = Mirror(tiny, ctx, F64_TOL)
    # W_S = 3 chains of depth 3 in a single row (9 nodes), breadth-first.
    m.evaluate(Forest(suffix=((5,),), tokens=(10, 11, 10, 12, 13, 14, 15, 16, 17),
                      parents=(ROOT, ROOT, ROOT, 0, 1, 2, 3, 4, 5), rows=(0,) * 9))
    m.commit([AcceptedPath(0, (1, 4, 7))])
    assert ctx.rows == 1 and ctx.lengths() == [12]
    m.evaluate(Forest(suffix=((20,),), tokens=(21,), parents=(ROOT,), rows=(0,)))


def test_prefill_reuses_prefix_and_truncate(tiny):
    m = three_rows(tiny, F64_TOL)
    ctx = m.ctx
    row2 = ctx.tokens(2)
    ctx.prefill(row2 + [7, 7])  # longest common prefix: row 2, moved to row 0
    assert ctx.rows == 1 and ctx.lengths() == [len(row2) + 2]
    m = Mirror(tiny, ctx, F64_TOL)
    m.evaluate(Forest(suffix=((8,),), tokens=(9,), parents=(ROOT,), rows=(0,)))
    ctx.truncate(4)
    assert ctx.lengths() == [4]
    m = Mirror(tiny, ctx, F64_TOL)
    m.evaluate(Forest(suffix=((12, 13),), tokens=(14, 15), parents=(ROOT, ROOT), rows=(0, 0)))


def test_empty_context_and_empty_forest(tiny):
    ctx = tiny.context(rows=2, max_tokens=8, logits_dtype=np.float64)
    assert ctx.rows == 1 and ctx.lengths() == [0] and ctx.kv_bytes() == 0
    m = Mirror(tiny, ctx, F64_TOL)
    out = m.evaluate(Forest())
    assert out.roots.shape == (0, 97) and out.nodes.shape == (0, 97) and out.root_rows == ()
    m.evaluate(Forest(suffix=((1, 2, 3),)))
    assert ctx.kv_bytes() == 3 * tiny.info.kv_bytes_per_token


def test_context_full_and_bad_forests(tiny):
    ctx = tiny.context(rows=2, max_tokens=12)
    with pytest.raises(ContextFull, match="13"):
        ctx.prefill(list(range(13)))
    ctx.prefill(list(range(8)))
    with pytest.raises(ContextFull, match="needs 13 KV slots"):
        ctx.evaluate(Forest(suffix=((1,),), tokens=(2, 3, 4, 5), parents=(ROOT, 0, 1, 2), rows=(0,) * 4))
    ctx.evaluate(Forest(suffix=((1,),), tokens=(2, 3), parents=(ROOT, ROOT), rows=(0, 0)))  # state intact
    with pytest.raises(ContextFull, match="3 rows"):
        ctx.commit([AcceptedPath(0)] * 3)
    with pytest.raises(ValueError, match="not a chain"):
        ctx.commit([AcceptedPath(0, (0, 1))])  # siblings, not a chain
    with pytest.raises(ValueError, match="not an earlier pending node"):
        ctx.evaluate(Forest(tokens=(5,), parents=(7,), rows=(0,)))
    with pytest.raises(ValueError, match="after its tree was started"):
        ctx.evaluate(Forest(suffix=((4,),)))
    with pytest.raises(ValueError, match="returns every node's logits"):
        ctx.evaluate(Forest(tokens=(5, 6), parents=(0, 2), rows=(0, 0), outputs=(False, True)))
    with pytest.raises(ValueError, match="one entry per node"):
        Forest(tokens=(5,), parents=(0,), rows=(0,), outputs=(True, True))
    ctx.commit([AcceptedPath(0, (1,)), AcceptedPath(0, (0,))])
    assert ctx.lengths() == [10, 10]
    ctx.close()
    with pytest.raises(BackendError, match="closed"):
        ctx.evaluate(Forest())


def test_layer_source_is_swappable(tiny):
    """A streamer replaces `layer_source` with any iterable of blocks; logits must not change."""
    seq = [4, 8, 15, 16, 23, 42]
    want = scratch_logits(tiny, seq)
    seen = []

    class Counting:
        def __init__(self, blocks):
            self.blocks = blocks

        def __iter__(self):
            for i, b in enumerate(self.blocks):
                seen.append(i)
                yield b

    t = tiny.transformer
    old = t.layer_source
    t.layer_source = Counting(old)
    try:
        assert np.abs(scratch_logits(tiny, seq) - want).max() == 0
    finally:
        t.layer_source = old
    assert seen == [0, 1]


@pytest.mark.gpu
def test_cuda_forest_matches_cpu_float64(tiny):
    """The same Layout R forest on CUDA (float32) against the float64 CPU oracle."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    gpu = init_random(TINY_ARGS, seed=0).to(device=dev, dtype=torch.float32)
    model = PyTorchModel(gpu, info=model_info(gpu, name="gpu", dtype=torch.float32, device=dev), device=dev,
                         dtype=torch.float32)
    m = three_rows(model, 1e-3)
    out = m.ctx.evaluate(whole_forest())
    ref = three_rows(tiny, F64_TOL)
    want = ref.ctx.evaluate(whole_forest())
    assert np.abs(out.nodes - want.nodes).max() <= 1e-3 and np.abs(out.roots - want.roots).max() <= 1e-3


# -- safetensors folders --------------------------------------------------------------------------------


def write_checkpoint(folder, transformer, *, shards: int = 1, tied: bool = False) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(transformer.args)
    (folder / "config.json").write_text(json.dumps(cfg))
    state = {hf_name(k): v.contiguous() for k, v in transformer.state_dict().items()}
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
        return
    names = sorted(state)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[s::shards]}
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 2])
def test_safetensors_round_trip(tmp_path, shards):
    src = init_random(TINY_ARGS, seed=1, dtype=torch.float32)
    write_checkpoint(tmp_path / "ckpt", src, shards=shards)
    got = load(tmp_path / "ckpt", ModelSpec(source=str(tmp_path / "ckpt"), backend="pytorch"))
    assert got.info.backend == "pytorch" and got.info.n_layers == 2 and got.info.vocab_size == 97
    seq = [1, 5, 9, 13, 17, 21]
    want = scratch_logits(wrap(src, torch.float32), seq)
    ctx = got.context(rows=1, max_tokens=16)
    ctx.prefill(seq[:-1])
    out = ctx.evaluate(Forest(suffix=((seq[-1],),)))
    assert np.abs(out.roots[0] - want).max() <= 1e-5


def test_safetensors_bfloat16_and_qwen2_bias(tmp_path):
    args = ModelArgs(**{**TINY_ARGS.__dict__, "arch": "qwen2", "qkv_bias": True, "tied_embeddings": True})
    src = init_random(args, seed=2, dtype=torch.float32)
    write_checkpoint(tmp_path / "q", src)
    got = load(tmp_path / "q", ModelSpec(source="q", backend="pytorch", dtype="bfloat16"))
    assert got.info.extra["dtype"] == "bfloat16" and got.transformer.output is None
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    want = scratch_logits(wrap(src, torch.float32), seq)
    ctx = got.context(rows=1, max_tokens=16)
    ctx.prefill(seq[:-1])
    out = ctx.evaluate(Forest(suffix=((seq[-1],),)))
    assert out.roots.dtype == np.float32
    assert np.abs(out.roots[0] - want).max() <= 0.1 * np.abs(want).max()  # bf16: ~3 significant digits


def test_safetensors_bad_folders(tmp_path):
    src = init_random(TINY_ARGS, seed=1, dtype=torch.float32)
    spec = ModelSpec(source="x", backend="pytorch")
    write_checkpoint(tmp_path / "sharded", src, shards=2)
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(BackendError, match="model-00002-of-00002.safetensors"):
        load(tmp_path / "sharded", spec)

    from safetensors.torch import save_file

    write_checkpoint(tmp_path / "partial", src)
    state = {hf_name(k): v for k, v in src.state_dict().items() if k != "layers.1.wk.weight"}
    save_file(state, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(BackendError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(tmp_path / "partial", spec)

    write_checkpoint(tmp_path / "arch", src)
    cfg = json.loads((tmp_path / "arch" / "config.json").read_text())
    (tmp_path / "arch" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(BackendError, match="gpt2"):
        load(tmp_path / "arch", spec)
    with pytest.raises(BackendError, match="not found"):
        load(tmp_path / "nothing.gguf", spec)


# -- GGUF files written here (metadata, Q/K permutation, quantisation types) ----------------------------


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama-arch Q/K rows (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, transformer, qtypes: dict[str, str]) -> dict[str, np.ndarray]:
    """A GGUF like llama.cpp's converter writes; returns the dequantised weights it stored (HF layout)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from backends.pytorch.gguf_loader import _gguf_name

    a = transformer.args
    w = gguf.GGUFWriter(str(path), a.arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.max_seq_len)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.hidden_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.norm_eps)
    stored = {}
    if a.rope_factors is not None:  # llama3-style scaling, as llama.cpp stores it
        w.add_tensor("rope_freqs.weight", np.array(a.rope_factors, dtype=np.float32))
    for name, t in transformer.state_dict().items():
        arr = t.float().numpy()
        gname = _gguf_name(name)
        heads = {"wq": a.n_heads, "wk": a.n_kv_heads}.get(name.split(".")[2]) if name.startswith("layers.") else None
        if a.arch == "llama" and heads:
            arr = _llamacpp_permute(arr, heads)
        qt = gguf.GGMLQuantizationType[qtypes.get(name, "F32")]
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, arr)
            back = arr
        else:
            q = quantize(arr, qt)
            w.add_tensor(gname, q, raw_dtype=qt)
            back = dequantize(q, qt).reshape(arr.shape)
        stored[name] = _llamacpp_permute_inverse(back, heads) if a.arch == "llama" and heads else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _llamacpp_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_written_here_matches_source(tmp_path, arch):
    factors = (1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 8.0) if arch == "llama" else None  # head_dim 16
    args = ModelArgs(**{**TINY_ARGS.__dict__, "arch": arch, "qkv_bias": arch == "qwen2", "rope_theta": 500.0,
                        "rope_factors": factors})
    src = init_random(args, seed=3, dtype=torch.float32)
    write_gguf(tmp_path / "m.gguf", src, {})
    got = load(tmp_path / "m.gguf", ModelSpec(source="m.gguf", backend="pytorch"))
    assert got.transformer.args == replace(args, norm_eps=float(np.float32(args.norm_eps)))  # GGUF stores f32
    for name, t in src.state_dict().items():
        assert torch.equal(got.transformer.state_dict()[name], t), name  # permutation undone exactly
    seq = [2, 7, 1, 8, 2, 8, 1, 8]
    ctx = got.context(rows=1, max_tokens=16)
    ctx.prefill(seq[:-1])
    out = ctx.evaluate(Forest(suffix=((seq[-1],),)))
    assert np.abs(out.roots[0] - scratch_logits(wrap(src, torch.float32), seq)).max() <= 1e-5


def test_llama3_rope_factors():
    from backends.pytorch.safetensors_loader import _llama3_factors

    # Llama-3.1 settings: short wavelengths untouched, long ones slowed by `factor`, smooth in between.
    inv = 1.0 / 500000.0 ** (torch.arange(64, dtype=torch.float64) * 2 / 128)
    f = _llama3_factors(inv, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
    wavelen = 2 * np.pi / inv
    assert torch.all(f[wavelen < 8192 / 4] == 1) and torch.all(f[wavelen > 8192] == 8)
    assert torch.all(f[1:] >= f[:-1])


def test_gguf_quant_types(tmp_path):
    src = init_random(TINY_ARGS, seed=4, dtype=torch.float32)
    qtypes = {"layers.0.wq.weight": "Q8_0", "layers.0.wk.weight": "Q4_0", "layers.0.wv.weight": "Q4_1",
              "layers.0.wo.weight": "Q5_0", "layers.0.w_gate.weight": "F16", "layers.0.w_up.weight": "BF16",
              "tok_embeddings.weight": "Q8_0"}
    stored = write_gguf(tmp_path / "q.gguf", src, qtypes)
    got = load(tmp_path / "q.gguf", ModelSpec(source="q.gguf", backend="pytorch"))
    state = got.transformer.state_dict()
    for name in qtypes:
        assert torch.equal(state[name], torch.from_numpy(stored[name])), name
        assert not torch.equal(state[name], src.state_dict()[name]), name  # really quantised


def test_gguf_bad_files(tmp_path):
    import gguf

    spec = ModelSpec(source="x", backend="pytorch")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(BackendError, match="cut.gguf"):
        load(tmp_path / "cut.gguf", spec)
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(BackendError, match="'gpt2' is not supported"):
        load(tmp_path / "gpt2.gguf", spec)


# -- the tiny GGUF (SmolLM2-135M Q4_1), float32 ---------------------------------------------------------


@pytest.fixture(scope="module")
def smol(tiny_gguf_path) -> PyTorchModel:
    return load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), backend="pytorch"))


PROMPT = [1, 504, 3458, 282, 4649, 314, 1345, 30, 378, 3458]  # arbitrary SmolLM2 ids


def test_gguf_info(smol):
    i = smol.info
    assert (i.n_layers, i.vocab_size, i.n_ctx_train) == (30, 49152, 8192)
    assert i.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert smol.transformer.args.tied_embeddings and smol.transformer.args.rope_theta == 100000.0
    pytest.importorskip("llama_cpp", reason="GGUF tokenizers come from llama.cpp (vocab only)")
    ids = smol.tokenizer.encode("Hello world")
    assert ids and smol.tokenizer.decode(ids) == b"Hello world"


def test_gguf_forest_matches_sequential_and_commit(smol):
    ctx = smol.context(rows=3, max_tokens=48)
    ctx.prefill(PROMPT)
    m = Mirror(smol, ctx, GGUF_TOL)
    m.evaluate(Forest(suffix=((282,),), tokens=(4649, 4649, 314, 1345, 30), parents=(ROOT, ROOT, ROOT, 0, 3),
                      rows=(0,) * 5))
    m.commit([AcceptedPath(0, (0, 3)), AcceptedPath(0, (2,))])
    out = m.evaluate(Forest(suffix=((30,), (1345,)), tokens=(378, 379, 314), parents=(ROOT, ROOT, 0), rows=(0, 1, 0)))
    print(f"\nSmolLM2 float32 forest vs sequential: max abs logit diff {m.worst:.2e}")
    assert np.abs(out.nodes[-1] - scratch_logits(smol, m.seq(len(m.nodes) - 1))).max() <= GGUF_TOL  # = sequential


def test_pytorch_matches_llamacpp(smol, tiny_gguf_path):
    llamacpp = pytest.importorskip("backends.llamacpp", reason="llama.cpp backend (llama_cpp) not importable")
    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, "
        "printing shops had spread to more than two hundred cities across Europe.\n"
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    )
    ref = llamacpp.load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), n_threads=2))
    try:
        ids = ref.tokenizer.encode(text)
        n = len(ids)
        # A chain forest scores every position of the text in one pass.
        chain = Forest(suffix=((ids[0],),), tokens=tuple(ids[1:]), parents=(ROOT, *range(n - 2)), rows=(0,) * (n - 1))
        ctx = smol.context(rows=1, max_tokens=n)
        out = ctx.evaluate(chain)
        pt = np.concatenate([out.roots, out.nodes])  # [n, vocab]
        # llama.cpp one token per decode: its batched kernels alone move logits by up to ~1 (Q8 activations).
        ctx = ref.context(rows=1, max_tokens=n)
        cpp = np.stack([ctx.evaluate(Forest(suffix=((t,),))).roots[0] for t in ids])  # [n, vocab]
        ctx.close()
    finally:
        ref.close()
    agree = float((pt.argmax(-1) == cpp.argmax(-1)).mean())
    diff = float(np.abs(pt - cpp).max())
    print(f"\npytorch vs llama.cpp on {n} tokens: top-1 agreement {agree:.1%}, max abs logit diff {diff:.3f}")
    assert n >= 80
    assert agree >= 0.95


def test_a_prompts_logits_do_not_depend_on_what_the_context_answered_before(smol, monkeypatch):
    """A prompt after other prompts and answers gets, bit for bit, the logits a fresh context gives it, and keeps
    what PrefillReuse says of the cache (here in chunks of 8 tokens; the old rule gave 2e-5 apart)."""
    from backends.pytorch.runtime import PyTorchContext

    monkeypatch.setattr(PyTorchContext, "prefill_chunk", 8)

    def answer(ctx, rng):
        ctx.evaluate(Forest(suffix=((5,),), tokens=(9, 10, 11), parents=(ROOT, ROOT, 0), rows=(0, 0, 0)))
        ctx.commit([AcceptedPath(0, (0, 2)), AcceptedPath(0, (1,))])

    def fed(ctx):
        counts, model = [], ctx._model
        ctx._model = lambda tok, **kw: (counts.append(tok.shape[1]), model(tok, **kw))[1]
        return counts

    history_does_not_count(functools.partial(smol.context, rows=4, max_tokens=128), PROMPT * 3, 8, answer, fed)
