"""Where the prefill kernel's fixed cost goes: ops.decode times over S at fixed q_len (a line in
q_len x (S - q_len / 2): its intercept is the per-call cost that does not scale with the keys), with
the automatic and forced split counts, and the kernels of one call (torch.profiler).
Usage: python3 benchmarks/experiments/prefill_intercept.py"""
import sys

import torch
import triton.testing

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from flash_attn_tq import ops  # noqa: E402
from bench_decode import fill_cache  # noqa: E402

torch.manual_seed(0)
for q_len in (512, 1024):
    q = torch.randn(1, q_len, 32, 128, device="cuda", dtype=torch.float16)
    for S in (q_len + 64, 2048, 4096, 8192, 16384):
        cache, _, _ = fill_cache(1, S, 8, 128, torch.float16, scale_only=True)
        row = []
        for splits in (0, 1, 2, 4):
            t = triton.testing.do_bench(lambda: ops.decode(q, cache, cache.seqlens, None, 128 ** -0.5, True, splits),
                                        warmup=50, rep=200)
            row.append(f"{splits}:{t * 1000:.1f}")
        print(f"q={q_len} S={S}: " + " ".join(row) + " us (splits:time)", flush=True)
        if S == 8192:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    ops.decode(q, cache, cache.seqlens, None, 128 ** -0.5, True, 0)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
        del cache
