#!/usr/bin/env bash
# Interleaved A/B of a decode-kernel patch in one device call: build the checkout (A) and the checkout
# with PATCH applied (B), then ROUNDS rounds that time both builds in turn (scripts/time_decode.py,
# a fresh process a build a round, the extension file swapped between them; the order alternates),
# and print each time's median over the rounds with B / A. The checkout is left as it was (A built).
#   bash scripts/ab_interleaved.sh PATCH [ROUNDS=3] [B:S,...]     (JSON per round in $OUT, or /tmp/ab)
# Run from the repository root (python3 -m runs the checkout's modules).
set -uo pipefail
patch=${1:?usage: ab_interleaved.sh PATCH [ROUNDS] [B:S,...]}
rounds=${2:-3}
shapes=${3:-}
OUT=${OUT:-/tmp/ab}
work=$(mktemp -d)
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
       FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16}
t0=$SECONDS
build() {  # $1: A or B -> $work/$1.so
  python3 setup.py -q build_ext --inplace > "$work/build_$1.log" 2>&1 || { tail -30 "$work/build_$1.log"; exit 1; }
  cp "$(ls flash_attn_tq_cuda*.so | head -1)" "$work/$1.so"
  echo "$1 built: $((SECONDS - t0)) s"
}
build A
git apply "$patch" || { echo "the patch does not apply"; exit 1; }
build B
git apply -R "$patch"
so=$(ls flash_attn_tq_cuda*.so | head -1)
for ((r = 1; r <= rounds; r++)); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for v in $order; do
    cp "$work/$v.so" "$so"
    python3 -m scripts.time_decode "$v" "$OUT/ab_${v}_$r.json" $shapes 2>&1 | tail -1
  done
done
cp "$work/A.so" "$so"
python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
runs = {v: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/ab_{v}_*.json"))] for v in "AB"}
print(f"{'B·S':10s} {'':8s} {'A µs':>8s} {'B µs':>8s}  B/A  (medians of {len(runs['A'])} rounds)")
for shape, times in runs["A"][0].items():
    for name in times:
        a, b = (statistics.median(r[shape][name] for r in runs[v]) for v in "AB")
        print(f"{shape:10s} {name:8s} {a:8.1f} {b:8.1f}  {b / a:.3f}")
PY
echo "A/B done: $((SECONDS - t0)) s"
