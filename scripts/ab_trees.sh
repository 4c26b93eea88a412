#!/usr/bin/env bash
# Interleaved A/B of two trees of the project in one device call (a change that touches the Python side
# and the ops, e.g. before and after a refactor): A = the tree in OLD_DIR (`git archive REV | tar x -C
# OLD_DIR`), B = this checkout. Each is built unless it holds a built extension, then ROUNDS rounds
# time both in turn, the order alternating, each in a fresh process of its own tree: the decode
# kernels over the default cache's layers and the plain cache as CUDA graphs (scripts/time_decode.py),
# and the eager call's host cost (scripts/eager_call.py, public API only, run from this checkout
# against either tree). Then, once each, SmolLM2-135M's architecture (random weights) decoded
# through generate paths (benchmarks/bench_generate.py: TQCache eager and compiled, 2K prompt).
# Writes $OUT/ab_trees.json and prints medians with B / A; `python -m scripts.ab_report $OUT --a REV
# --b REV` makes the results files (benchmarks/results/refactor_ab.json / .md) from that folder.
#   bash scripts/ab_trees.sh OLD_DIR [ROUNDS=2] [B:S,...]     (run from the repository root)
set -uo pipefail
old=$(cd "${1:?usage: ab_trees.sh OLD_DIR [ROUNDS] [B:S,...]}" && pwd)
rounds=${2:-2}
shapes=${3:-}
here=$(pwd)
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a}
t0=$SECONDS
if ! ls flash_attn_tq_cuda*.so > /dev/null 2>&1; then
  (MAX_JOBS=8 python3 setup.py -q build_ext --inplace > "$OUT/build_B.log" 2>&1) &
fi
if ! ls "$old"/flash_attn_tq_cuda*.so > /dev/null 2>&1; then
  (cd "$old" && MAX_JOBS=8 python3 setup.py -q build_ext --inplace > "$OUT/build_A.log" 2>&1) &
fi
wait
ls flash_attn_tq_cuda*.so "$old"/flash_attn_tq_cuda*.so > /dev/null || { tail -20 "$OUT"/build_*.log; exit 1; }
echo "builds: $((SECONDS - t0)) s"
run() {  # $1: A or B, $2: round
  if [ "$1" = A ]; then
    (cd "$old" && python3 benchmarks/time_decode.py A "$OUT/decode_A_$2.json" $shapes 2>&1 | tail -1)
    (cd "$old" && PYTHONPATH="$old" python3 "$here/scripts/eager_call.py" A "$OUT/eager_A_$2.json" 2>&1 | tail -1)
  else
    python3 -m scripts.time_decode B "$OUT/decode_B_$2.json" $shapes 2>&1 | tail -1
    PYTHONPATH="$here" python3 scripts/eager_call.py B "$OUT/eager_B_$2.json" 2>&1 | tail -1
  fi
}
for ((r = 1; r <= rounds; r++)); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for v in $order; do run "$v" "$r"; done
done
echo "rounds: $((SECONDS - t0)) s"
gen=(--models smollm2 --random-weights --prompts 2048 --variants tq,tq_compiled --no-profile --new-tokens 48)
(cd "$old" && python3 benchmarks/bench_generate.py "${gen[@]}" --out "$OUT/gen_A" 2>&1 | tail -2)
python3 -m benchmarks.bench_generate "${gen[@]}" --out "$OUT/gen_B" 2>&1 | tail -2
echo "generate: $((SECONDS - t0)) s"
python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
res = {}
for kind in ("decode", "eager"):
    runs = {v: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{kind}_{v}_*.json"))] for v in "AB"}
    if not runs["A"] or not runs["B"]:
        continue
    for shape, times in runs["A"][0].items():
        for name in times:
            a, b = (statistics.median(r[shape][name] for r in runs[v]) for v in "AB")
            res[f"{kind} {shape} {name}"] = dict(A=a, B=b, ratio=b / a)
for v in "AB":
    try:
        rows = json.load(open(f"{out}/gen_{v}/generate.json"))["rows"]
    except (OSError, KeyError, ValueError):
        continue
    for row in rows:
        for key, x in row.items():
            if key.endswith("_tok_s") and isinstance(x, (int, float)):
                res.setdefault(f"generate {row['model']} P={row['prompt']} {key}", {})[v] = x
for r in res.values():
    if "A" in r and "B" in r and "ratio" not in r:
        r["ratio"] = r["B"] / r["A"]
json.dump(res, open(f"{out}/ab_trees.json", "w"), indent=1)
for name, r in res.items():
    print(f"{name:42s} A {r.get('A', float('nan')):9.1f}  B {r.get('B', float('nan')):9.1f}  B/A {r.get('ratio', float('nan')):.3f}")
PY
echo "A/B done: $((SECONDS - t0)) s"
