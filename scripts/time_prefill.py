"""Prefill kernel times (ops.decode, 3-bit turbo cache, with and without scale-only metadata) for a
few chunk shapes: a quick A/B helper. Usage: python3 benchmarks/time_prefill.py LABEL [S:q_len,...]"""

import sys

import torch

from flash_attn_tq import ops
from flash_attn_tq.testing import bench, fill_cache

torch.manual_seed(0)
res = []
shapes = [(8192, 64), (32768, 64), (8192, 512), (32768, 2048)]
if len(sys.argv) > 2:
    shapes = [tuple(int(x) for x in item.split(":")) for item in sys.argv[2].split(",")]
for S, q_len in shapes:
    q = torch.randn(1, q_len, 32, 128, device="cuda", dtype=torch.float16)
    times = []
    for scale_only in (False, True):
        cache, _, _ = fill_cache(1, S, 8, 128, torch.float16, scale_only=scale_only)
        t = bench(lambda: ops.decode(q, cache.seqlens, None, 128**-0.5, True, 0, **cache.kernel_args(1)), warmup_ms=50)
        times.append(f"{t:.1f}")
        cache = None  # (not del: lambdas above name them)
    res.append(f"S={S} q={q_len}: {'/'.join(times)} us")
print(sys.argv[1], "(plain/scale-only)", "; ".join(res), flush=True)
