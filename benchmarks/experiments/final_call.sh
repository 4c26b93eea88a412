#!/usr/bin/env bash
# One device call: build HEAD, check the paged-decode overhead of its paged_slots change (reverse the
# change if 32-256-token pages cost more than 6% over contiguous), GPU tests, then the full chunked
# prefill + paged table beside upstream FA2. Results to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_HOME=/usr/local/cuda FLASH_ATTN_TQ_CUDA_ARCHS=90 MAX_JOBS=16
OUT=${OUT:-/tmp/final}; mkdir -p "$OUT"
t0=$SECONDS
build() { python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }; }
build; echo "build $((SECONDS - t0)) s"
python3 benchmarks/bench_prefill.py --quick --paged-only --out /tmp/pq --name paged > /dev/null 2>&1
grep -E "^\| [0-9]" /tmp/pq/paged.md
if python3 -c "import json,sys; r=json.load(open('/tmp/pq/paged.json'))['paged'][0]; sys.exit(0 if r['page32_overhead_pct'] <= 6 else 1)"; then
  echo "keeping paged_slots"
else
  echo "paged_slots slower: reversed"; git apply -R benchmarks/experiments/paged_slots.patch && build
  GIT_COMMIT="$GIT_COMMIT-paged_slots"
fi
(python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 128 > /tmp/fa2.log 2>&1 &)  # beside the tests
python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
echo "tests $((SECONDS - t0)) s"
for i in $(seq 60); do grep -q "^export" <(tail -1 /tmp/fa2.log) && break; sleep 2; done
eval "$(tail -1 /tmp/fa2.log)" || echo "no FA2"
timeout $((590 - SECONDS + t0)) python3 benchmarks/bench_prefill.py --out "$OUT" --name prefill > "$OUT/bench_prefill.log" 2>&1
grep -E "^\| [0-9]" "$OUT/prefill.md"
echo "total $((SECONDS - t0)) s"
