#!/usr/bin/env bash
# A/B an experiment patch on the device in one call: build and benchmark the checkout as it is (A),
# apply the patch, rebuild, run the GPU tests and benchmark again (B). Each run times the FP16 paths
# beside ours, so compare the speedup columns (ratios), not absolute times across calls.
#   bash scripts/ab_patch.sh PATCH [decode|prefill|both|paged]     (tables go to $OUT, or /tmp/ab)
# paged: the decode table and bench_prefill.py's paged-decode table only (no FA2 build).
# Example: GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/ab_patch.sh my_change.patch prefill
# Run from the repository root (python3 -m runs the checkout's modules).
set -uo pipefail
patch=${1:?usage: ab_patch.sh PATCH [decode|prefill|both|paged]}
what=${2:-both}
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT" /tmp/ab_work
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
       FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16}

build() { python3 setup.py -q build_ext --inplace > "/tmp/ab_work/build_$1.log" 2>&1 || { tail -30 "/tmp/ab_work/build_$1.log"; exit 1; }; }
bench() {  # $1: A or B; only the Markdown tables come back (the JSON/PNG stay in /tmp/ab_work)
  if [ "$what" != prefill ]; then
    python3 -m benchmarks.bench_decode --quick --head-dims 128 --out /tmp/ab_work --name "decode_$1" > /dev/null 2>&1
    cp "/tmp/ab_work/decode_$1.md" "$OUT/"
  fi
  if [ "$what" != decode ]; then
    local only=; [ "$what" = paged ] && only=--paged-only
    python3 -m benchmarks.bench_prefill --quick $only --out /tmp/ab_work --name "prefill_$1" > /dev/null 2>&1
    cp "/tmp/ab_work/prefill_$1.md" "$OUT/"
  fi
}

t0=$SECONDS
if [ "$what" != decode ] && [ "$what" != paged ] && [ -f .fa2/flash_attn-2.8.3.post2.tar.gz ]; then  # FA2 beside the prefill rows (~100 s)
  python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 128 > /tmp/ab_work/fa2.log 2>&1 \
    && eval "$(tail -1 /tmp/ab_work/fa2.log)" || echo "upstream FA2 not built: prefill rows without it (compare tq3 µs, same call)"
fi
# the device's .git may be stale: the tables are stamped with GIT_COMMIT (pass the checkout's commit) and "+patch"
export GIT_COMMIT=${GIT_COMMIT:-unknown}
build A && bench A
echo "A built and benchmarked: $((SECONDS - t0)) s"
git apply "$patch" || { echo "the patch does not apply"; exit 1; }
GIT_COMMIT="$GIT_COMMIT+$(basename "$patch" .patch)"
build B
python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf > "$OUT/tests_B.log" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/tests_B.log" | tail -15
bench B
git apply -R "$patch"
echo "A/B done: $((SECONDS - t0)) s"
for f in "$OUT"/*_A.md; do
  b=${f%_A.md}_B.md
  [ -f "$b" ] || continue
  echo "== $(basename "$f" _A.md): A then B (speedup columns)"
  grep -E "^\| [0-9]" "$f" | head -12
  echo "--"
  grep -E "^\| [0-9]" "$b" | head -12
done
