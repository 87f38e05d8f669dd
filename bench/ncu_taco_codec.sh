#!/usr/bin/env bash
# Figure: the ncu counters of taco/NOTES.md (bench/logs/ncu-taco-codec-*): what bounds TACO's codec kernels; ncu of each kernel launched once (bench/taco_codec.py --once; it
# prints the launch order) at one size for each tuning given, with the counters taco/NOTES.md's
# analysis uses: instructions, issue slots, eligible warps, shared-memory wavefronts and bank
# conflicts, global load sectors, L1 and DRAM throughput, and why warps stall between instructions.
# Clocks are left alone (--clock-control none), as the device's METHOD.md asks.
# Usage (on the GPU machine): bash bench/ncu_taco_codec.sh MIB TUNING [TUNING ...]
set -u
mib=$1; shift
stalls=""
for r in long_scoreboard short_scoreboard mio_throttle lg_throttle wait math_pipe_throttle not_selected \
         barrier membar branch_resolving no_instruction dispatch_stall selected; do
  stalls+="smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio,"
done
metrics="gpu__time_duration.sum,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,${stalls%,}"
run=(python3 bench/taco_codec.py --once --sizes "$mib" --tunings "$@")
ncu --clock-control none --profile-from-start off --kernel-name regex:taco_ --metrics "$metrics" "${run[@]}" \
  || { echo "[ncu with the metric list failed: sections instead]";
       ncu --clock-control none --profile-from-start off --kernel-name regex:taco_ --section SpeedOfLight \
           --section SchedulerStats --section WarpStateStats "${run[@]}"; }
