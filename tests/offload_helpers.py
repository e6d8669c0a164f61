"""What the offload tests share (tests/test_offload.py on the CPU, tests/test_gpu.py on CUDA, tests/test_rpc.py's
plans): a model geometry with round sizes, a small random llama's shape, a PyTorchModel around a bare
transformer, and one session whose every logit is compared."""

from __future__ import annotations

import numpy as np
import torch

from backends.base import ROOT, AcceptedPath, Forest
from backends.pytorch.model import ModelArgs
from backends.pytorch.runtime import PyTorchModel, model_info
from offload.geometry import ModelGeometry
from offload.plan import MiB

ARGS = ModelArgs(arch="llama", vocab_size=97, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, hidden_dim=96,
                 max_seq_len=256)


def synthetic(n_layers=10, layer=100 * MiB, params=None, name="t", vocab=1000, kv_heads=2, head_dim=64,
              quant="Q8_0") -> ModelGeometry:
    """A model with round sizes: layer_bytes stored, params = bytes (1 B/param) unless given."""
    p = params or layer
    return ModelGeometry(name=name, format="gguf", arch="llama", quant=quant, n_layers=n_layers, dim=512,
                         n_heads=8, n_kv_heads=kv_heads, head_dim=head_dim, hidden_dim=1024, vocab_size=vocab,
                         n_ctx_train=32768, layer_bytes=(layer,) * n_layers, layer_params=(p,) * n_layers,
                         embed_bytes=50 * MiB, embed_params=50 * MiB, head_bytes=50 * MiB, head_params=50 * MiB,
                         tied_embeddings=False)


def wrap(transformer, dtype) -> PyTorchModel:
    """A transformer as a runtime model on the CPU (offload_model moves what it keeps to its device)."""
    dev = torch.device("cpu")
    return PyTorchModel(transformer, info=model_info(transformer, name="r", dtype=dtype, device=dev),
                        device=dev, dtype=dtype)


def session(model: PyTorchModel) -> list[np.ndarray]:
    """Prefill, a forest, a commit that reorders/duplicates rows, another forest: every logit returned."""
    ctx = model.context(rows=3, max_tokens=48)
    ctx.prefill([1, 5, 9, 13, 17, 21, 25])
    a = ctx.evaluate(Forest(suffix=((29,),), tokens=(3, 4, 7, 8), parents=(ROOT, ROOT, 0, 1), rows=(0,) * 4))
    ctx.commit([AcceptedPath(0, (0, 2)), AcceptedPath(0, (1,)), AcceptedPath(0, ())])
    b = ctx.evaluate(Forest(suffix=((11,), (12,), (13,)), tokens=(40, 41), parents=(ROOT, ROOT), rows=(0, 2)))
    return [a.roots, a.nodes, b.roots, b.nodes]
