#!/usr/bin/env bash
# Session 12's quality runs on the device (after gpu_quality.sh stage): RoPE-aware key centring against
# the product's post-RoPE centring, strict and prefilled copy; the news text in two calls, then GPL-3.
#   bash benchmarks/experiments/gpu_quality.sh run bash benchmarks/experiments/gpu_quality_run.sh news1|news2|gpl
# Session 13 (the RoPE centre in the decode kernel, the new default): ... gpu_quality_run.sh s13 | s13b | s13real
set -eo pipefail
T=/tmp/qdata/gensim/gensim/test/test_data/lee_background.cor
R=benchmarks/results
N1="full,Kcal34+copy1+kc+sink4+w124,Kcal34+copy1+rc+sink4+w124,Kcal34+copy1+rct+sink4+w124,Kcal34+V3+kc+sink4+w124"
N1="$N1,Kcal34+V3+rc+sink4+w124,K3.5mix(last)+V3+kc+sink4+w124,K3.5mix(last)+V3+rc+sink4+w124,K4V3+kc+sink4+w124"
N2="turbo3+kc+sink4+w124,turbo3+rc+sink4+w124,turbo3+rct+sink4+w124,Kcal34+copy1+kc+sink4,Kcal34+copy1+rc+sink4"
N2="$N2,Kcal34+copy1+kc+sink4+r128@K4V4,Kcal34+copy1+rc+sink4+r128@K4V4"
G="full,Kcal34+copy1+kc+sink4+w124,Kcal34+copy1+rc+sink4+w124,Kcal34+copy1+kc+sink4+r128@K4V4"
G="$G,Kcal34+copy1+rc+sink4+r128@K4V4,K3.5mix(last)+V3+kc+sink4+w124,K3.5mix(last)+V3+rc+sink4+w124"
N3="Kcal34+copy1+kc+vc+sink4+w124,Kcal34+copy1+rc+vc+sink4+w124,Kcal34+copy1+rc+vc+sink4+r128@K4V4"
N3="$N3,Kcal34+copy2+rc+sink4+w124,Kcal34+copy1+rc+sink16+w112"
G3="Kcal34+copy1+rc+vc+sink4+w124,Kcal34+copy1+kc+vc+sink4+w124,Kcal34+copy1+rc+vc+sink4+r128@K4V4"
S13="full,Kcal34rc+copy1+rc+sink16+w112,Kcal34rc+copy1+rc+sink16,Kcal34rc+copy1+rc+sink16+r128@K4V4"
S13="$S13,K3.5mix(last)+V3+rc+sink16+w112"
case "$1" in
s13)   timeout 300 python3 benchmarks/eval_quality.py "$T" --data /tmp/qdata --configs "$S13" --seeds 3 --long-seeds 3 \
         --out "$OUT" --tag quality_s13
       timeout 240 python3 benchmarks/eval_quality.py .qdata/GPL-3 --data /tmp/qdata --seeds 3 --long-seeds 3 \
         --configs "$S13" --out "$OUT" --tag quality_s13_gpl3 ;;
s13b)  # the 4K metrics of the own-centre placement; the no-window default (kc placement); then s13real
       B="full,Kcal34rc+copy1+rc+sink16+w112,Kcal34+copy1+rc+sink16+r128@K4V4"
       timeout 200 python3 benchmarks/eval_quality.py "$T" --data /tmp/qdata --configs "$B" --seeds 3 --long-seeds 3 \
         --merge $R/quality_s13.json --out "$OUT" --tag quality_s13
       timeout 170 python3 benchmarks/eval_quality.py .qdata/GPL-3 --data /tmp/qdata --seeds 3 --long-seeds 3 \
         --configs "$B" --merge $R/quality_s13_gpl3.json --out "$OUT" --tag quality_s13_gpl3
       bash "$0" s13real ;;
s13real)  # the fused kernel on real SmolLM2 Q/K/V (dumped on the device's CPU), then generate() speed
       timeout 60 python3 benchmarks/dump_qkv.py "$T" --data /tmp/qdata --out /tmp/qkv.pt | tail -1
       timeout 120 python3 benchmarks/check_real_qkv.py /tmp/qkv.pt --bench --prompt 4000 --new 64 \
         > "$OUT/real_qkv.log" 2>&1; tail -12 "$OUT/real_qkv.log" ;;
gpl4)  python3 benchmarks/eval_quality.py .qdata/GPL-3 --data /tmp/qdata --seeds 3 --long-seeds 3 \
         --configs "Kcal34+copy1+rc+sink16+w112,Kcal34+copy2+rc+sink4+w124" \
         --merge $R/quality_ropecenter_gpl3.json --out "$OUT" --tag quality_ropecenter_gpl3 ;;
news3) python3 benchmarks/eval_quality.py "$T" --data /tmp/qdata --configs "$N3" --seeds 3 --long-seeds 3 \
         --merge $R/quality_ropecenter.json --out "$OUT" --tag quality_ropecenter
       python3 benchmarks/eval_quality.py .qdata/GPL-3 --data /tmp/qdata --seeds 3 --long-seeds 3 --configs "$G3" \
         --merge $R/quality_ropecenter_gpl3.json --out "$OUT" --tag quality_ropecenter_gpl3 ;;
news1) python3 benchmarks/eval_quality.py "$T" --data /tmp/qdata --configs "$N1" --seeds 3 --long-seeds 3 \
         --out "$OUT" --tag quality_ropecenter ;;
news2) python3 benchmarks/eval_quality.py "$T" --data /tmp/qdata --configs "$N2" --seeds 3 --long-seeds 3 \
         --merge $R/quality_ropecenter.json --out "$OUT" --tag quality_ropecenter ;;
gpl)   python3 benchmarks/eval_quality.py .qdata/GPL-3 --data /tmp/qdata --seeds 3 --long-seeds 3 --configs "$G" \
         --out "$OUT" --tag quality_ropecenter_gpl3 ;;
esac
