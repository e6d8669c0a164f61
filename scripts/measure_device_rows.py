"""The decoders reading a PyTorch model's logits where it computed them (`device_rows`) against host rows: sample,
beam-sample and a fixed DSBD forest (W_S 8 x gamma 3, without replacement, the model drafting for itself) on a
random model, with the torch row math on the same device. Per repeat: whether the answers are the same token for
token, the decoder's own ms an iteration (everything outside the passes: the row math and the host's
bookkeeping) and each model's pass ms an iteration, each way, each way first in turn; the backend's per-cell
prices; on a GPU, the ms to copy one target pass's rows to the host (what host rows cost beside the pass).

    python scripts/measure_device_rows.py [--device cpu|cuda] [--repeats 3] [--json F]
    python scripts/measure_device_rows.py --device cuda --shape 7b --dtype bfloat16 --modes beam-sample dsbd

Without --shape: a 2-layer model with Qwen's vocabulary (real rows, cheap passes); with it, a Qwen2.5-shaped
model with generated weights (scripts/gpu_profile.py's). The JSON is written after each repeat.
"""

from __future__ import annotations

import argparse

import torch

from _common import emit, machine
from app.decoding.rowmath import tensors
from device_rows import MODES, rows_where_computed
from gpu_profile import SHAPES, random_model
from measure_rowmath import to_host_ms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=list(SHAPES), help="a Qwen2.5 shape with generated weights")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                    help="the --shape model's weights")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    model = random_model(a.shape, device=a.device, dtype=a.dtype) if a.shape else None
    out = {"device": str(device), "model": model.info.name if model else "random-qwen-vocab",
           "dtype": a.dtype if model else "float32", "modes": {m: MODES[m] for m in a.modes}, "machine": machine(),
           "repeats": []}
    rows = 0
    for i in range(a.repeats):
        got = rows_where_computed(device, ("device", "host") if i % 2 else ("host", "device"),  # each first in turn
                                  model=model, modes=a.modes)
        out["repeats"].append({mode: {"same_answer": by["device"]["tokens"] == by["host"]["tokens"],
                                      **{f"{w}_{k}": round(v, 3) for w in ("device", "host") for k, v in by[w].items()
                                         if k.endswith("_ms_per_iteration")},
                                      "iterations": by["device"]["iterations"]} for mode, by in got.items()})
        rows = max(rows, *(by["device"]["most_target_rows"] for by in got.values()))
        emit(out, a.json, show=False)
    rm = tensors.TorchRows(device.type)
    if rm.off_host:
        vocab = model.info.vocab_size if model else 151936
        moved = to_host_ms(rm, torch.zeros((rows, vocab), device=device), a.repeats)
        out["rows_to_host_ms"] = {"rows": rows, "vocab": vocab, **{k: round(v, 3) for k, v in moved.items()}}
    out["cell_seconds"] = {"prices": list(rm.cell_seconds), "timed_warm": list(rm.time_cells())}
    emit(out, a.json)


if __name__ == "__main__":
    main()
