"""The decoders reading a PyTorch model's logits where it computed them (`device_rows`) against host rows: sample,
beam-sample and a fixed DSBD forest (W_S 8 x gamma 3, without replacement) on a random Qwen-vocabulary model,
with the torch row math on the same device. Per repeat: whether the answers are the same token for token, and the
decoder's own ms an iteration (everything outside the passes) each way, each way first in turn; and the
backend's per-cell prices.

    python scripts/measure_device_rows.py [--device cpu|cuda] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse

import torch

from _common import emit, machine
from app.decoding import rowmath
from app.decoding.rowmath import tensors
from device_rows import rows_where_computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    repeats = []
    for i in range(a.repeats):
        got = rows_where_computed(device, ("device", "host") if i % 2 else ("host", "device"))  # each first in turn
        repeats.append({mode: {"same_answer": by["device"]["tokens"] == by["host"]["tokens"],
                               **{f"{w}_decoder_ms_per_iteration": round(r["decoder_ms_per_iteration"], 2)
                                  for w, r in by.items()},
                               "iterations": by["device"]["iterations"]} for mode, by in got.items()})
    rm = tensors.TorchRows(device.type)
    emit({"device": str(device), "repeats": repeats,
          "cell_seconds": {"prices": list(rm.cell_seconds), "timed_warm": list(rm.time_cells())},
          "machine": machine()}, a.json)


if __name__ == "__main__":
    main()
