# ncu stall reasons, pipe use and shared-memory conflicts of the prefill kernel, wgmma and mma.sync
# variants (B=1, 32K cache, 2048-token chunk, 32/8 heads, d 128). Assumes a built extension.
set -uo pipefail
export PYTHONPATH=$PWD
M="--metrics smsp__inst_executed.sum,gpu__time_duration.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
for s in stalled_barrier stalled_dispatch_stall stalled_gmma stalled_long_scoreboard stalled_math_pipe_throttle stalled_mio_throttle stalled_no_instruction stalled_not_selected stalled_selected stalled_short_scoreboard stalled_wait stalled_membar stalled_sleeping stalled_branch_resolving stalled_lg_throttle stalled_tex_throttle stalled_misc; do
  M="$M,smsp__average_warps_issue_${s}_per_issue_active.ratio"
done
for w in ${VARIANTS:-1 0}; do
  echo "=== FLASH_ATTN_TQ_PREFILL_WGMMA=$w"
  FLASH_ATTN_TQ_PREFILL_WGMMA=$w ncu --clock-control none --kernel-name regex:prefill_split --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis $M \
    python3 benchmarks/profile_decode.py --batch 1 --seqlen 32768 --q-len 2048 2>&1 \
    | grep -E "stalled|bank_conflicts|inst_executed|gpu__time|Throughput|Warp Cycles Per Issued|Pipe|Issue Slots|Executed Ipc|prefill_split_kernel<" | head -50
done
