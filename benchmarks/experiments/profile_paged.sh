# ncu counters and stall reasons of decode over a contiguous cache and over 16- and 32-token pages.
#   bash benchmarks/experiments/profile_paged.sh [PATCH]   (PATCH applied first, reversed at the end)
set -uo pipefail
export PYTHONPATH=$PWD CUDA_HOME=/usr/local/cuda FLASH_ATTN_TQ_CUDA_ARCHS=90a MAX_JOBS=16
t0=$SECONDS
[ -n "${1:-}" ] && git apply "$1"
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $((SECONDS-t0)) s"
M="--metrics dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum,smsp__inst_executed.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio"
for ps in ${PAGES:-0 16 32}; do
  arg=; [ $ps -gt 0 ] && arg="--page-size $ps"
  echo "=== page $ps"
  ncu --clock-control none --kernel-name regex:decode_split --launch-skip 5 --launch-count 1 --section WarpStateStats --section LaunchStats $M python3 benchmarks/profile_decode.py $arg 2>&1 | grep -E "stalled|dram__|lts__|l1tex__|smsp__|gpu__time|sm__warps|Stall|Registers|Block Size|Grid Size|Waves|Shared Memory Config|Warp Cycles Per Issued" | head -60
done
echo "total $((SECONDS-t0)) s"
[ -n "${1:-}" ] && git apply -R "$1"
true
