#!/usr/bin/env bash
# Figure: none (the harness the figures' runs go through). One GPU-machine cycle: environment the brief requires, then each step given on the command line
# ("tests [PYTEST ARGS]", "bench WORKLOAD GPUS [ARGS]", "py SCRIPT [ARGS]", "sh SCRIPT [ARGS]",
# "cw COMMAND [ARGS]"), each
# logged under $OUT; the tree is pip-installed first (editable, no dependencies) for its entry points.
# Usage on the device: bash bench/gpu_session.sh 'tests -m gpu' 'bench moe 4'
# More than 8 files under $OUT (what the device tool returns at most) are archived into $OUT/gpu-session.tgz.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export COMMWEAVE_COMMIT="${COMMWEAVE_COMMIT:-unknown}"
STEP_TIMEOUT="${STEP_TIMEOUT:-540}"  # seconds per step; rc 124 means it ran out
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
summary="$OUT/summary.txt"
# workloads are found through the installed package's entry points: install the tree (no network there)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || echo "[install] failed: see install.log (workloads will not be registered)" | tee -a "$summary"
for step in "$@"; do
  read -r kind rest <<<"$step"
  log="$OUT/$(echo "$step" | tr -c 'A-Za-z0-9-' '_' | cut -c1-60).log"
  start=$(date +%s)
  case "$kind" in
    cw)    timeout "$STEP_TIMEOUT" python3 -m commweave $rest >"$log" 2>&1 ;;
    tests) timeout "$STEP_TIMEOUT" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $rest >"$log" 2>&1 ;;
    bench) read -r wl gpus args <<<"$rest"
           timeout "$STEP_TIMEOUT" python3 -m commweave.cli bench "$wl" --gpus "$gpus" --out-dir "$OUT" $args >"$log" 2>&1 ;;
    py)    timeout "$STEP_TIMEOUT" python3 $rest >"$log" 2>&1 ;;
    sh)    timeout "$STEP_TIMEOUT" bash $rest >"$log" 2>&1 ;;
    *)     echo "unknown step kind: $kind" >"$log"; false ;;
  esac
  rc=$?
  echo "[$step] rc=$rc $(( $(date +%s) - start ))s" | tee -a "$summary"
  tail -25 "$log"
done
# the device tool returns at most 8 files: past that, everything in $OUT goes into one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/gpu-session.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -not -name summary.txt -delete \
    && mv /tmp/gpu-session.tgz "$OUT/" && echo "results archived: $OUT/gpu-session.tgz"
fi
