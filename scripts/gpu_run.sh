#!/usr/bin/env bash
# Everything a GPU machine measures for this project, in one call of under 9 minutes, from a checkout with torch
# (a CUDA build), numpy and pytest; no model files (the models are built on the device from Qwen2.5's shapes with
# random bfloat16 weights: a pass's cost depends on the shape, not the weights):
#   1. scripts/gpu_check.sh: the row math on CUDA against the reference (equivalence; ms per operation and per
#      iteration at 1, 4, 24, 64 and 260 rows; the rows' copy to the host) and the tests marked `gpu`;
#   2. the PyTorch runtime's passes of the 0.5B, 1.5B and 7B shapes at 1, 4, 16, 32 and 64 tokens, written as cost
#      profiles named after the device (e.g. h200-qwen2.5-7b-bf16.json; scripts/gpu_profile.py);
#   3. beam sampling and a DSBD iteration (W 4, W_S 8 x gamma 3) on the 7B shape with the row math on the device,
#      its rows kept there against host rows: the passes' ms, the decoder's own ms (the row math and the host's
#      bookkeeping) and the ms to copy a target pass's rows to the host (scripts/measure_device_rows.py).
# Usage: scripts/gpu_run.sh [--tiny] OUT_DIR
#   OUT_DIR gets gpu_run.log and the JSON, each file written as its step finishes: gpu_check.json,
#   gpu_check-rowmath.json, gpu_check-rowmath-large.json, DEVICE-qwen2.5-{1.5b,7b}-bf16.json, dsbd-iteration.json.
#   --tiny  tiny shapes (2 layers, hidden 64, vocabulary 512): a dry run; without CUDA it runs steps 2 and 3 on
#           the CPU and skips step 1 (without CUDA and without --tiny, nothing runs: exit 2)
#   PYTHON=python3   the interpreter that has torch
# Every step runs under its own time limit (together under 8 minutes); a step that fails or times out keeps what
# it wrote, the others still run, and the exit status is then 1.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-$(command -v python3 || command -v python)}"
tiny=0
if [ "${1:-}" = "--tiny" ]; then tiny=1; shift; fi
if [ $# != 1 ]; then echo "usage: scripts/gpu_run.sh [--tiny] OUT_DIR" >&2; exit 64; fi
out="$(mkdir -p "$1" && cd "$1" && pwd)" || exit 64
# seconds each step may take: gpu_check.sh's row math check (its CPU side took 23 s on 2 cores), its row math at
# large row counts and its GPU tests; the profiles; the DSBD iteration (seconds of GPU work, models built on it)
check_limits="100 45 150"
profile_s=90
iteration_s=70

step() {  # step NAME SECONDS COMMAND...: run it under its time limit, note a failure and go on
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "gpu_run: $name (at most $limit s)"
  timeout -k 10 "$limit" "$@"
  rc=$?
  if [ $rc = 124 ] || [ $rc = 137 ]; then echo "gpu_run: $name timed out after $limit s"; fi
  [ $rc = 0 ] || failed+=("$name")
  summary+=("$name: exit $rc, $((SECONDS - t0)) s")
}

run_all() {
  failed=() summary=()
  export PYTHONUNBUFFERED=1
  local device=cuda shapes=(--target 1.5b 7b --draft 0.5b) iteration=7b quick=()
  "$py" - <<'EOF'
import sys, torch
print(f"gpu_run: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"))
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
  case $? in
    0) ;;
    3) echo "gpu_run: no CUDA device found (torch.cuda.is_available() is false): scripts/gpu_check.sh is skipped"
       if [ $tiny = 0 ]; then echo "gpu_run: nothing measured (--tiny runs the other steps on the CPU)"; return 2; fi
       device=cpu ;;
    *) echo "gpu_run: cannot import torch with $py"; return 2 ;;
  esac
  if [ $tiny = 1 ]; then shapes=(--target test --draft test) iteration=test quick=(--repeats 1); fi
  if [ $device = cuda ]; then
    DSBD_GPU_CHECK_LIMITS="$check_limits" step "gpu_check.sh" "$(( ${check_limits// /+} + 20 ))" \
      bash scripts/gpu_check.sh "$out/gpu_check.json"
  fi
  step "cost profiles" "$profile_s" "$py" scripts/gpu_profile.py "${shapes[@]}" --device $device \
    --dtype bfloat16 --ns 1 4 16 32 64 "${quick[@]}" --out-dir "$out"
  step "DSBD iteration" "$iteration_s" "$py" scripts/measure_device_rows.py --device $device --shape $iteration \
    --dtype bfloat16 --modes beam-sample dsbd "${quick[@]}" --json "$out/dsbd-iteration.json"
  printf 'gpu_run: %s\n' "${summary[@]}" "$SECONDS s in all" "files in $out:"
  ls -l "$out"
  if [ ${#failed[@]} != 0 ]; then echo "gpu_run: failed: ${failed[*]}"; return 1; fi
  echo "gpu_run: every step finished"
}

run_all 2>&1 | tee "$out/gpu_run.log"
exit "${PIPESTATUS[0]}"
