#!/usr/bin/env bash
# The GPU tests in N pytest processes side by side on one GPU (the suite is mostly host-bound: its
# float32 references run on the CPU), each test id in one shard, dealt round-robin.
#   bash scripts/gpu_tests.sh OUT [N=4]   -> OUT/gpu_tests.log (a stamp line: GPU, torch, CUDA, commit,
#   this command; the shards' logs; then the totals). Run from the repository root.
#   GPU_TESTS_TIMEOUT=seconds stops each shard there (its log then ends without pytest's summary)
set -uo pipefail
out=$1
shards=${2:-4}
dir=$(mktemp -d)
python3 -m pytest tests -m gpu --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' > "$dir/ids"
awk -v n="$shards" -v d="$dir" '{ print > (d "/shard" (NR - 1) % n) }' "$dir/ids"
# each shard its share of the cores for torch's CPU threads (the float32 references): torch's
# default, every core in every process, oversubscribes them
threads=$(( $(nproc) / shards )); threads=$(( threads > 0 ? threads : 1 ))
for ((i = 0; i < shards; i++)); do
  [ -s "$dir/shard$i" ] || continue
  mapfile -t ids < "$dir/shard$i"
  OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads timeout "${GPU_TESTS_TIMEOUT:-0}" python3 -m pytest -q -rs -p no:cacheprovider --durations=5 "${ids[@]}" > "$dir/log$i" 2>&1 &
done
wait
{
  python3 -m flash_attn_tq.testing bash scripts/gpu_tests.sh "$out" "$shards"
  for ((i = 0; i < shards; i++)); do [ -f "$dir/log$i" ] && { echo "=== shard $i"; cat "$dir/log$i"; }; done
  echo "=== all shards ($(wc -l < "$dir/ids") tests collected)"
  grep -hE "^(FAILED|ERROR) " "$dir"/log* || true
  for f in "$dir"/log*; do tail -n 1 "$f" | grep -qE " in [0-9.]+s" || echo "${f##*/}: ended without pytest's summary (crashed or killed)"; done
  # the shards' summary lines ("N passed, M skipped ... in Ts"), counted together
  tail -qn 1 "$dir"/log* | grep -oE "[0-9]+ (passed|failed|skipped|xfailed|xpassed|errors?|deselected)" |
    awk '{ n[$2] += $1 } END { for (k in n) printf "%d %s  ", n[k], k; print "" }'
} > "$out/gpu_tests.log"
sed -n '/=== all shards/,$p' "$out/gpu_tests.log"
rm -rf "$dir"
