#!/usr/bin/env bash
# A/B/C... in one device call: the checkout as it is (A), then each patch applied on top of the ones
# before it. Every stage is built and timed with scripts/time_prefill.py; the first
# and last stage also run benchmarks/bench_prefill.py --quick (FA2 beside it when .fa2 is carried),
# and the last stage runs the GPU tests ($OUT/tests_last.log).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/ab_stack.sh P1.patch [P2.patch ...]
# Run from the repository root (python3 -m runs the checkout's modules).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: ab_stack.sh PATCH..."; exit 2; }
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT" /tmp/ab_work
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
       FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} GIT_COMMIT=${GIT_COMMIT:-unknown}
t0=$SECONDS
build() { python3 setup.py -q build_ext --inplace > "/tmp/ab_work/build_$1.log" 2>&1 || { tail -30 "/tmp/ab_work/build_$1.log"; exit 1; }; }
table() { python3 -m benchmarks.bench_prefill --quick --out /tmp/ab_work --name "prefill_$1" > /dev/null 2>&1; cp "/tmp/ab_work/prefill_$1.md" "$OUT/"; }
if [ -f .fa2/flash_attn-2.8.3.post2.tar.gz ]; then
  python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 128 > /tmp/ab_work/fa2.log 2>&1 \
    && eval "$(tail -1 /tmp/ab_work/fa2.log)" || echo "upstream FA2 not built"
fi
build A && python3 -m scripts.time_prefill A && table A
echo "A: $((SECONDS - t0)) s"
applied=()
n=0
for p in "$@"; do
  n=$((n + 1))
  git apply "$p" || { echo "$p does not apply on top of ${applied[*]:-the checkout}"; break; }
  applied+=("$p")
  build "P$n" && python3 -m scripts.time_prefill "+$(basename "$p" .patch)"
  echo "stage $n: $((SECONDS - t0)) s"
done
GIT_COMMIT="$GIT_COMMIT+stack$n" table last
python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf > "$OUT/tests_last.log" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/tests_last.log" | tail -15
for ((i=${#applied[@]}-1; i>=0; i--)); do git apply -R "${applied[$i]}"; done
echo "done: $((SECONDS - t0)) s"
for f in A last; do echo "== prefill_$f"; grep -E "^\| [0-9]" "$OUT/prefill_$f.md" | head -12; done
