"""Measure cost profiles on this machine: seconds of one forward pass scoring n tokens (n = 1..128) for
target-shaped models and a draft-shaped one with generated weights, through the project's PyTorch runtime and the
same timing method the app uses (app.engine.timing.measure_costs), the rows kept on the device (a pass's own
time: scripts/measure_device_rows.py times the rows' copy to the host). Writes profile JSON that
`--cost-profile PATH.json` (or a copy in assets/cost_profiles/) reads: one file, or one a target into a folder,
named after the device, the shape and the dtype (e.g. h200-qwen2.5-7b-bf16.json).

    python scripts/gpu_profile.py --target 1.5b --out assets/cost_profiles/h200-1.5b.json
    python scripts/gpu_profile.py --target 1.5b 7b --device cuda --dtype bfloat16 --out-dir results/

Shapes are Qwen2.5's (0.5b is the draft). Weights are random: a pass's cost depends on the shapes, not on the
values. Needs torch (CUDA build for a GPU) and numpy only; no model files. The draft is timed once, first, and
each target's profile is written as soon as it is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (the repository on sys.path)

SHAPES = {  # Qwen2.5 configs (config.json of the Hugging Face repos)
    "0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864, vocab_size=151936),
    "1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, hidden_dim=8960, vocab_size=151936),
    "7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, hidden_dim=18944, vocab_size=152064),
    "test": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=512),
}
NS = (1, 2, 4, 8, 16, 32, 64, 128)


def random_model(shape: str, *, device: str, dtype: str):
    """A PyTorchModel of that shape with random weights, built on the device directly."""
    import torch

    from backends.pytorch.model import ModelArgs, Transformer
    from backends.pytorch.runtime import PyTorchModel, model_info

    args = ModelArgs(arch="qwen2", qkv_bias=True, max_seq_len=4096, **SHAPES[shape])
    dt, dev = getattr(torch, dtype), torch.device(device)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dt)
        with dev:
            t = Transformer(args)
    finally:
        torch.set_default_dtype(before)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in t.named_parameters():
            std = 1.0 if "embeddings" in name else 1 / math.sqrt(p.shape[-1])
            p.normal_(1.0 if "norm" in name else 0.0, std, generator=g)
    t = t.requires_grad_(False).eval()
    return PyTorchModel(t, info=model_info(t, name=f"qwen2.5-{shape}-shaped", dtype=dt, device=dev), device=dev,
                        dtype=dt)


class _RowsKept:
    """The model, its contexts keeping their rows on the device and waiting for its kernels: a pass's time is
    its kernels', the rows' copy to the host left out."""

    def __init__(self, model) -> None:
        self.model, self.info = model, model.info

    def context(self, **kw):
        from device_rows import Synced

        ctx = self.model.context(**kw)
        ctx.device_rows = True
        return Synced(ctx)


def measure(shape: str, *, device: str, dtype: str, ns=NS, context: int = 512, repeats: int = 5) -> dict:
    from app.engine.timing import measure_costs

    model = random_model(shape, device=device, dtype=dtype)
    try:
        return measure_costs(_RowsKept(model), ns, context=context, repeats=repeats)
    finally:
        model.close()


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine()


def file_name(device: str, shape: str, dtype: str) -> str:
    """A profile's file name: the device (`h200` for an NVIDIA H200, `cpu` for the host), shape and dtype."""
    where = "cpu"
    if device.startswith("cuda"):
        where = re.sub(r"[^a-z0-9.]+", "-", device_name(device).lower().removeprefix("nvidia")).strip("-")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    return f"{where}-qwen2.5-{shape}-{short}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs="+", choices=[s for s in SHAPES if s != "0.5b"], default=["1.5b"])
    ap.add_argument("--draft", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--ns", type=int, nargs="+", default=list(NS), help="the token counts timed")
    ap.add_argument("--context", type=int, default=512, help="cached tokens before each timed pass")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default=None, help="with --out: the profile's name (default: the file's stem)")
    where_to = ap.add_mutually_exclusive_group(required=True)
    where_to.add_argument("--out", help="the profile file (one target)")
    where_to.add_argument("--out-dir", help="a folder for one profile a target, named after device, shape, dtype")
    a = ap.parse_args(argv)
    if a.out_dir and a.name or a.out and len(a.target) > 1:
        ap.error("--out takes one target and --name; --out-dir takes several, named after the device")
    import torch

    t0 = time.time()
    timed = {}

    def curve(shape: str) -> dict:
        if shape not in timed:
            timed[shape] = measure(shape, device=a.device, dtype=a.dtype, ns=a.ns, context=a.context,
                                   repeats=a.repeats)
        return timed[shape]

    curve(a.draft)
    where = device_name(a.device)
    for target in a.target:
        out = Path(a.out) if a.out else Path(a.out_dir) / file_name(a.device, target, a.dtype)
        profile = {
            "name": a.name or out.stem,
            "machine": "gpu" if a.device.startswith("cuda") else "cpu",
            "vram_gb": round(torch.cuda.get_device_properties(a.device).total_memory / 2 ** 30, 1)
            if a.device.startswith("cuda") else None,
            "description": f"{where}; target Qwen2.5-{target}-shaped, draft Qwen2.5-{a.draft}-shaped ({a.dtype}, "
                           "dsbd-chat's PyTorch runtime, generated weights)",
            "target": {str(n): s for n, s in curve(target).items()},
            "draft": {str(n): s for n, s in curve(a.draft).items()},
            "source": f"measured by scripts/gpu_profile.py on {where}: the min of {a.repeats} passes after "
                      f"{a.context} cached tokens, per n",
            "derivation": "measured directly (app.engine.timing.measure_costs), the rows kept on the device: "
                          "the pass alone, without the rows' copy to the host",
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(profile, indent=1) + "\n")
        print(json.dumps({"out": str(out), "seconds": round(time.time() - t0, 1),
                          "target_ms": {n: round(s * 1e3, 3) for n, s in curve(target).items()},
                          "draft_ms": {n: round(s * 1e3, 3) for n, s in curve(a.draft).items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
