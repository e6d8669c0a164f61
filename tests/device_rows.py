"""The decoders with a PyTorch model's rows kept where they are computed, against host rows, on a random model:
the answers, the passes' and the decoder's own time each way (tests/test_gpu.py on CUDA,
scripts/measure_device_rows.py on any device, at any Qwen2.5 shape)."""

from __future__ import annotations

import time

import torch

from app.config import DecodeParams
from backends.pytorch.model import ModelArgs, init_random

MODES = {"sample": {}, "beam-sample": {"beams": 4},
         "dsbd": {"beams": 4, "draft_beams": 8, "gamma": 3, "replacement": "without"}}


class Synced:
    """A context whose evaluate waits for the device, so a pass's time includes its kernels (rows kept on the
    device are otherwise returned before they are computed, and their time would count as the decoder's).
    `returned` holds how many rows each pass returned."""

    def __init__(self, ctx) -> None:
        self.inner = ctx
        self.returned: list[int] = []

    def evaluate(self, forest):
        out = self.inner.evaluate(forest)
        if self.inner.device.type == "cuda":
            torch.cuda.synchronize()
        self.returned.append(len(out.roots) + len(out.nodes))
        return out

    def __getattr__(self, name):
        if name in ("inner", "returned"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def qwen_vocab_model(device: torch.device):
    """A 2-layer random model with Qwen's vocabulary (151,936) in float32: rows of the real size, cheap passes."""
    from backends.pytorch.runtime import PyTorchModel, model_info

    args = ModelArgs(arch="qwen2", vocab_size=151936, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                     qkv_bias=True, max_seq_len=1024)
    t = init_random(args, seed=3, dtype=torch.float32).to(device)
    return PyTorchModel(t, info=model_info(t, name="random-qwen-vocab", dtype=torch.float32, device=device),
                        device=device, dtype=torch.float32)


def rows_where_computed(device: torch.device, order: tuple[str, str] = ("device", "host"), *, model=None,
                        modes=tuple(MODES)) -> dict:
    """`modes` of MODES (DSBD: a fixed W_S 8 x gamma 3 forest without replacement, the model drafting for itself)
    on `model` (default qwen_vocab_model) on `device`, with the row math there: the rows kept where they are
    computed (`device_rows`) against host rows, in `order`. Returns per mode and arm the answer's tokens, the
    iterations, the decoder's own ms an iteration (everything outside the passes), each model's pass ms an
    iteration and the most rows one target pass returned."""
    from app.decoding import rowmath, start
    from app.decoding.rowmath import tensors
    from app.decoding.beams import Stopper
    from app.decoding.metrics import Metrics
    from backends.unique import UniquePaths

    model = qwen_vocab_model(device) if model is None else model
    vocab = model.info.vocab_size
    prompt = [(1000 + i) % vocab for i in range(40)]
    saved = rowmath.backend()
    rowmath.use(tensors.TorchRows(device.type))
    out: dict = {}
    try:
        for mode in modes:
            params = DecodeParams(mode=mode, max_new_tokens=40, seed=2, temperature=1.0, **MODES[mode]).validated()
            for where in order:
                roles = ("target", "draft") if mode == "dsbd" else ("target",)
                synced, ctxs = [], []
                for _ in roles:
                    inner = model.context(rows=8, max_tokens=512)
                    inner.device_rows = where == "device"
                    synced.append(Synced(inner))
                    ctxs.append(UniquePaths(synced[-1], views=True))
                metrics = Metrics(mode=mode, prompt_tokens=len(prompt))
                t0 = time.perf_counter()
                *_, last = start(params, target=ctxs[0], draft=ctxs[1] if mode == "dsbd" else None, prompt=prompt,
                                 stopper=Stopper(eos_ids=()), metrics=metrics, vocab=vocab)
                wall = time.perf_counter() - t0
                own = wall - sum(c.pass_s for c in ctxs) - (metrics.t_prefill - metrics.t_start)
                per = 1e3 / max(1, metrics.iterations)
                out.setdefault(mode, {})[where] = {
                    "tokens": list(last.output.tokens), "iterations": metrics.iterations,
                    "decoder_ms_per_iteration": own * per,
                    **{f"{role}_pass_ms_per_iteration": c.pass_s * per for role, c in zip(roles, ctxs)},
                    "most_target_rows": max(synced[0].returned)}
                for c in ctxs:
                    c.close()
    finally:
        rowmath.use(saved)
    return out
