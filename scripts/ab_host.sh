#!/usr/bin/env bash
# Interleaved A/B of the eager call's host cost (scripts/host_cost.py) for two trees, on this machine
# (no GPU needed): A = the tree in OLD_DIR (`git archive REV | tar x -C OLD_DIR`), B = this checkout,
# ROUNDS rounds, the order alternating, each run a fresh process importing its own tree. Prints each
# run and the best of each tree.
#   bash scripts/ab_host.sh OLD_DIR [ROUNDS=4] [OUT_DIR=/tmp/ab_host]     (run from the repository root)
set -euo pipefail
old=$(cd "${1:?usage: ab_host.sh OLD_DIR [ROUNDS] [OUT_DIR]}" && pwd)
rounds=${2:-4}
out=${3:-/tmp/ab_host}
here=$(pwd)
mkdir -p "$out"
for ((r = 1; r <= rounds; r++)); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for v in $order; do
    tree=$here; [ "$v" = A ] && tree=$old
    (cd /tmp && PYTHONPATH="$tree" python3 "$here/scripts/host_cost.py" "$v" "$out/host_${v}_$r.json")
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("host_*_*.json"))]
best = {}
for r in runs:
    for name, us in r["us_per_call"].items():
        best.setdefault(name, {}).setdefault(r["label"], []).append(us)
for name, by in best.items():
    a, b = min(by["A"]), min(by["B"])
    print(f"{name:8s} A {a:6.1f} us   B {b:6.1f} us   B - A {b - a:+5.1f} us")
PY
