"""A tiny random PyTorch transformer for the torch backend tests (tests/test_pytorch.py, tests/test_unique_paths.py):
its shape, the wrapper that serves it, and the from-scratch oracle its forests are checked against."""

from __future__ import annotations

import numpy as np
import torch

from backends.pytorch.model import KVCache, ModelArgs
from backends.pytorch.runtime import PyTorchModel, model_info


TINY_ARGS = ModelArgs(
    arch="llama", vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
    rope_theta=10000.0, max_seq_len=512,
)
F64_TOL = 1e-9


def wrap(transformer, dtype=torch.float64) -> PyTorchModel:
    dev = torch.device("cpu")
    info = model_info(transformer, name="random", dtype=dtype, device=dev)
    return PyTorchModel(transformer, info=info, device=dev, dtype=dtype)


@torch.inference_mode()
def scratch_logits(model: PyTorchModel, seq: list[int]) -> np.ndarray:
    """Plain causal forward over `seq` in a fresh cache -> logits of its last token, [vocab]."""
    t = model.transformer
    n = len(seq)
    pos = torch.arange(n)[None]  # [1, n]
    kv = KVCache(t.args, rows=1, slots=n, dtype=model.dtype, device=model.device)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]  # [1, n, n]
    last = (torch.tensor([0]), torch.tensor([n - 1]))
    out = t(torch.tensor([seq], device=model.device), positions=pos.to(model.device), slots=pos.to(model.device),
            mask=mask.to(model.device), kv=kv, select=tuple(i.to(model.device) for i in last))  # [1, vocab]
    return out[0].double().cpu().numpy()
