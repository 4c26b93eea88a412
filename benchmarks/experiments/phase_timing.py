"""One call of the prefill kernel built with phase_timing.patch (globaltimer stamps printed by the
heaviest, middle and lightest row blocks of split 0, kv head 0): Q prologue, pipeline start, tile
loop and epilogue in ns. Usage: python3 benchmarks/experiments/phase_timing.py S:q_len,..."""
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from flash_attn_tq import ops  # noqa: E402
from bench_decode import fill_cache  # noqa: E402

for item in sys.argv[1].split(","):
    S, q_len = (int(x) for x in item.split(":"))
    q = torch.randn(1, q_len, 32, 128, device="cuda", dtype=torch.float16)
    cache, _, _ = fill_cache(1, S, 8, 128, torch.float16, scale_only=True)
    for i in range(3):
        if i == 2:
            print(f"--- S={S} q={q_len}", flush=True)
        ops.decode(q, cache, cache.seqlens, None, 128 ** -0.5, True, 0)
        torch.cuda.synchronize()
    del cache
