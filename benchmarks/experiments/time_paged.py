"""Paged vs contiguous decode (bench_prefill.run_paged) at B=1x128K, 8x32K, 32x8K for pages of 16 and
32 tokens: a quick A/B helper. Usage: python3 benchmarks/experiments/time_paged.py LABEL"""
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_prefill import run_paged  # noqa: E402

res = []
for B, S in [(1, 131072), (8, 32768), (32, 8192)]:
    r = run_paged(B, S, [16, 32])
    res.append(f"B={B} S={S}: {r['contiguous']:.1f} us, 16: {r['page16_overhead_pct']:+.1f}%, "
               f"32: {r['page32_overhead_pct']:+.1f}%")
print(sys.argv[1], "; ".join(res), flush=True)
