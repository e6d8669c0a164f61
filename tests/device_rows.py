"""The decoders with a PyTorch model's rows kept where they are computed, against host rows, on a random
Qwen-vocabulary model: the answers and the decoder's own time each way (tests/test_gpu.py on CUDA,
scripts/measure_device_rows.py on any device)."""

from __future__ import annotations

import time

import torch

from app.config import DecodeParams
from backends.pytorch.model import ModelArgs, init_random


class _Synced:
    """A context whose evaluate waits for the device, so a pass's time includes its kernels (rows kept on the
    device are otherwise returned before they are computed, and their time would count as the decoder's)."""

    def __init__(self, ctx) -> None:
        self.inner = ctx

    def evaluate(self, forest):
        out = self.inner.evaluate(forest)
        if self.inner.device.type == "cuda":
            torch.cuda.synchronize()
        return out

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def rows_where_computed(device: torch.device, order: tuple[str, str] = ("device", "host")) -> dict:
    """sample, beam-sample and DSBD (a fixed W_S 8 x gamma 3 forest without replacement, the model drafting for
    itself) on a random Qwen-vocabulary model on `device`, with the row math there: the rows kept where they are
    computed (`device_rows`) against host rows, in `order`. Returns per mode the answers and the decoder's own ms
    an iteration (everything outside the passes) both ways."""
    from app.decoding import rowmath, start
    from app.decoding.rowmath import tensors
    from app.decoding.beams import Stopper
    from app.decoding.metrics import Metrics
    from backends.pytorch.runtime import PyTorchModel, model_info
    from backends.unique import UniquePaths

    args = ModelArgs(arch="qwen2", vocab_size=151936, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                     qkv_bias=True, max_seq_len=1024)
    t = init_random(args, seed=3, dtype=torch.float32).to(device)
    model = PyTorchModel(t, info=model_info(t, name="random-qwen-vocab", dtype=torch.float32, device=device),
                         device=device, dtype=torch.float32)
    prompt = list(range(1000, 1040))
    modes = {"sample": {}, "beam-sample": {"beams": 4},
             "dsbd": {"beams": 4, "draft_beams": 8, "gamma": 3, "replacement": "without"}}
    saved = rowmath.backend()
    rowmath.use(tensors.TorchRows(device.type))
    out: dict = {}
    try:
        for mode, kw in modes.items():
            params = DecodeParams(mode=mode, max_new_tokens=40, seed=2, temperature=1.0, **kw).validated()
            for where in order:
                ctxs = []
                for _ in ("target", "draft") if mode == "dsbd" else ("target",):
                    inner = model.context(rows=8, max_tokens=512)
                    inner.device_rows = where == "device"
                    ctxs.append(UniquePaths(_Synced(inner), views=True))
                metrics = Metrics(mode=mode, prompt_tokens=len(prompt))
                t0 = time.perf_counter()
                *_, last = start(params, target=ctxs[0], draft=ctxs[1] if mode == "dsbd" else None, prompt=prompt,
                                 stopper=Stopper(eos_ids=()), metrics=metrics, vocab=args.vocab_size)
                wall = time.perf_counter() - t0
                own = wall - sum(c.pass_s for c in ctxs) - (metrics.t_prefill - metrics.t_start)
                out.setdefault(mode, {})[where] = {
                    "tokens": list(last.output.tokens), "iterations": metrics.iterations,
                    "decoder_ms_per_iteration": 1e3 * own / max(1, metrics.iterations),
                    "pass_ms_per_iteration": 1e3 * sum(c.pass_s for c in ctxs) / max(1, metrics.iterations)}
    finally:
        rowmath.use(saved)
    return out
