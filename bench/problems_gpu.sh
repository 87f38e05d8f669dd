#!/usr/bin/env bash
# Figure: the problem judge on one GPU (docs/problems.md, issue 33's W = 1 table): every PKB problem
# judging itself in one run until a deadline; and the twice-work check of the judge's fidelity.
# Usage on the device machine (repository root, a PKB checkout in $COMMWEAVE_PKB, $OUT where results come back):
#   COMMWEAVE_COMMIT=<sha> bash bench/problems_gpu.sh run [SECONDS] [N ...]   # problems N... (default all), until SECONDS (540)
#   COMMWEAVE_COMMIT=<sha> bash bench/problems_gpu.sh twice N [N ...]         # PKB #N against itself and against twice its work
# `run` judges them in one `problems run` (one pool), stopped at the deadline (it starts nothing
# with under 25 s left); `problems run` rewrites its JSON after every problem, so a stopped run
# keeps what it judged. Its JSON (bench/results format: unpack it there) and log go into one
# archive, $OUT/problems-gpu-<mode>.tgz, rebuilt every 30 s and at the end; summary.txt says which
# problems were not judged (their numbers, to pass to the next call). DEVICE=cpu runs
# the same on CPU ranks (a dry run), PROBLEM_OPTIONS adds options to every judge (e.g. "--iters 10"). `twice` writes, per problem, a
# solution that calls the reference twice a call; it should read ~0.5x where the GPU's work
# dominates a call (a reference that writes its arguments in place reads wrong_result instead).
set -u
MODE="${1:?usage: problems_gpu.sh run [SECONDS] [N ...] | twice N [N ...]}"; shift
: "${COMMWEAVE_PKB:?set COMMWEAVE_PKB to a ParallelKernelBench checkout}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export COMMWEAVE_COMMIT="${COMMWEAVE_COMMIT:-unknown}"
RETURN="${OUT:-/tmp/out}"; mkdir -p "$RETURN"
DEVICE="${DEVICE:-cuda}"; read -r -a OPTIONS <<< "${PROBLEM_OPTIONS:-}"
STAGE=$(mktemp -d /tmp/problems-gpu-XXXXXX); trap 'rm -rf "$STAGE"' EXIT; touch "$STAGE/summary.txt"
START=$(date +%s)

archive() {
  tar -czf "$RETURN/problems-gpu-$MODE.tgz" -C "$STAGE" . && cp "$STAGE/summary.txt" "$RETURN/"
}

reference() {  # the reference file of PKB problem number $1
  local found=("$COMMWEAVE_PKB"/reference/"$1"_*.py)
  [ -f "${found[0]}" ] || { echo "no problem $1 in $COMMWEAVE_PKB/reference" >&2; exit 2; }
  echo "${found[0]}"
}

case "$MODE" in
  run)
    DEADLINE=$(( START + ${1:-540} )); [ $# -gt 0 ] && shift
    if [ $# -eq 0 ]; then
      set -- $(ls "$COMMWEAVE_PKB"/reference | sed -n 's/^\([0-9]\+\)_.*\.py$/\1/p' | sort -n)
    fi
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 25 ]; then
      echo "not started (${left} s left): $*" | tee -a "$STAGE/summary.txt"
    else
      ( trap 'kill $nap 2>/dev/null; exit 0' TERM; while :; do sleep 30 & nap=$!; wait $nap; archive; done ) \
        > /dev/null 2>&1 & archiver=$!
      timeout "$left" python -m commweave problems run pkb --gpus 1 --device "$DEVICE" --only "$(echo "$@" | tr ' ' ',')" \
        "${OPTIONS[@]}" --out "$STAGE/problems.html" --out-dir "$STAGE" > "$STAGE/problems.log" 2>&1
      echo "[problems $*] rc=$? $(( $(date +%s) - START ))s" | tee -a "$STAGE/summary.txt"
      kill "$archiver" 2>/dev/null; wait "$archiver" 2>/dev/null
      python - "$STAGE" "$@" <<'PY' | tee -a "$STAGE/summary.txt"
import glob, json, sys
tables = sorted(glob.glob(f"{sys.argv[1]}/problems-*.json"))
pending = json.load(open(tables[-1])).get("not_judged_yet", []) if tables else sys.argv[2:]
if pending:
    print("not judged (deadline):", " ".join(name.split("_")[0] for name in pending))
PY
    fi ;;
  twice)
    [ $# -gt 0 ] || { echo "twice: name at least one problem number" >&2; exit 2; }
    for n in "$@"; do
      ref=$(reference "$n") || exit 2; twice="$STAGE/$(basename "$ref")"
      printf '%s\n\n_once = solution\n\n\ndef solution(*args, **kwargs):\n    _once(*args, **kwargs)\n    return _once(*args, **kwargs)\n' \
        "$(cat "$ref")" > "$twice"
      for sol in "$ref" "$twice"; do
        what=$([ "$sol" = "$ref" ] && echo itself || echo twice)
        began=$(date +%s)
        timeout 180 python -m commweave judge "$ref" "$sol" --gpus 1 --device "$DEVICE" "${OPTIONS[@]}" --json \
          > "$STAGE/judge-$n-$what.json" 2> "$STAGE/judge-$n-$what.err"
        echo "[#$n $what] rc=$? $(( $(date +%s) - began ))s $(tail -1 "$STAGE/judge-$n-$what.json")" | tee -a "$STAGE/summary.txt"
        archive
      done
    done ;;
  *) echo "mode must be run or twice, not $MODE" >&2; exit 2 ;;
esac
archive
echo "==== summary ($RETURN/problems-gpu-$MODE.tgz)"
cat "$STAGE/summary.txt"
grep -h '^[0-9]*_.*: ' "$STAGE"/problems.log 2>/dev/null || true
