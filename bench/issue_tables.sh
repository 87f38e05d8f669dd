#!/usr/bin/env bash
# Figure: the 4-GPU tables of docs/results.md (the open issues' "done when" tables) on W GPUs, in device calls of under 10 minutes each.
# Usage on the device machine (repository root; $OUT is where results come back):
#   COMMWEAVE_COMMIT=<sha> bash bench/issue_tables.sh 4 comm      # TACO, MoE (~7 min)
#   COMMWEAVE_COMMIT=<sha> bash bench/issue_tables.sh 4 compute   # attention, KV transfer, GEMM (~9 min)
#   COMMWEAVE_COMMIT=<sha> bash bench/issue_tables.sh 4 lossy     # TACO in CUDA graphs; FP8 options: GEMM gather, MoE dispatch (~5 min)
# Each step has its own time limit (rc 124: it ran out) and log; summary.txt lists them. The device
# tool returns at most 8 files, so every log, JSON and plot goes into one archive,
# $OUT/issue-tables-<part>-<W>gpu.tgz (unpack it here: JSON and plots to bench/results, logs to bench/logs), with
# summary.txt beside it.
set -u
W="${1:?usage: issue_tables.sh GPUS comm|compute|lossy}"
PART="${2:?usage: issue_tables.sh GPUS comm|compute|lossy}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export COMMWEAVE_COMMIT="${COMMWEAVE_COMMIT:-unknown}"
RETURN="${OUT:-/tmp/out}"; mkdir -p "$RETURN"
OUT="/tmp/issue-tables-$PART-${W}gpu"; rm -rf "$OUT"; mkdir -p "$OUT"  # staged, archived after each step

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "[$name] rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  grep -v "Warning\|warnings.warn" "$OUT/$name.log" | tail -20
  archive  # after every step: what ran is back even if the call is stopped at its time limit
}

archive() {
  tar -czf "$RETURN/issue-tables-$PART-${W}gpu.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$RETURN/"
}

case "$PART" in
  comm)
    # correct before timed: the collectives against the reference over NCCL, bit for bit
    step taco-tests 120 python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_taco_device.py -k over_nccl
    step taco-bandwidth 90 python bench/taco_bandwidth.py --gpus "$W" --mibs 1 2 4 8 16 32 64 128 256 \
      --codecs cuda cuda-fused --out-dir "$OUT"
    step taco-train 120 python bench/taco_train.py --gpus "$W" --backend device --out-dir "$OUT"
    # step time where the GPU, not the host, bounds a step (eager, the default model's step is host-bound)
    step taco-train-graph 120 python bench/taco_train.py --gpus "$W" --backend device --graph --out-dir "$OUT"
    step moe 120 python -m commweave.cli bench moe --gpus "$W" --out-dir "$OUT" ;;
  lossy)
    step taco-graph-tests 150 python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_taco_device.py \
      -k "captured or tp_layers"
    step moe-fp8-tests 120 python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_moe.py -k fp8
    step moe-lossy 120 python bench/sweep.py moe-lossy --gpus "$W" --shapes dsv3-T128 dsv3-T4096 \
      --grid compression=none,fp8_e4m3
    step gemm-lossy 60 python bench/sweep.py gemm-allgather-lossy --gpus "$W" \
      --shapes 16384x4096x8192 8192x8192x8192 --grid compression=none,fp8_e4m3 --grid chunks=1,4
    cp bench/results/sweep-moe-lossy-"$W"gpu-*.json bench/results/sweep-gemm-allgather-lossy-"$W"gpu-*.json "$OUT"/ 2>/dev/null ;;
  compute)
    step attention 200 python -m commweave.cli bench attention-cp --gpus "$W" \
      --shapes s32768-q32kv8-d128-full,s32768-q32kv8-d128-causal,s131072-q32kv8-d128-full \
      --candidate src/commweave/workloads/attention_cp/programs/seed_pull.py --out-dir "$OUT"
    step kv-transfer 150 python -m commweave.cli bench kv-transfer --gpus "$W" --shapes S128,S512,S2048,S16384,S2048-P13 \
      --out-dir "$OUT"
    step gemm 180 python -m commweave.cli bench gemm-allgather --gpus "$W" --out-dir "$OUT" ;;
  *) echo "part must be comm, compute or lossy, not $PART" >&2; exit 2 ;;
esac
archive
echo "==== summary ($(tar -tzf "$RETURN/issue-tables-$PART-${W}gpu.tgz" | grep -c -v '/$') files in $RETURN/issue-tables-$PART-${W}gpu.tgz)"
cat "$OUT/summary.txt"
