"""The prefill kernel's wgmma variant against its mma.sync variant (same build, switched by
FLASH_ATTN_TQ_PREFILL_WGMMA per call) on random caches: max |diff| of out and lse per case, and
where a wrong output is (rows, columns), to tell a layout error from a rounding one."""
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from flash_attn_tq import ops  # noqa: E402
from bench_decode import fill_cache  # noqa: E402


def run(q, cache, causal, wgmma, **kw):
    os.environ["FLASH_ATTN_TQ_PREFILL_WGMMA"] = "1" if wgmma else "0"
    return ops.decode(q, cache, cache.seqlens, None, q.shape[-1] ** -0.5, causal, 0, **kw)


torch.manual_seed(0)
worst = 0.0
for d in (128, 64):
    for dtype in (torch.float16, torch.bfloat16):
        for kw in ({"scale_only": True}, {"scale_only": False}, {"quantizer": "asym"}, {"k_bits": 4, "scale_only": True}):
            for S, q_len, causal in ((1000, 96, True), (4096, 517, True), (333, 200, False)):
                try:
                    cache, _, _ = fill_cache(2, S, 2, d, dtype, **kw)
                except Exception as e:  # noqa: BLE001
                    print("skip", d, dtype, kw, e)
                    continue
                q = torch.randn(2, q_len, 8, d, device="cuda", dtype=dtype)
                o0, l0 = run(q, cache, causal, False)
                o1, l1 = run(q, cache, causal, True)
                err = (o1.float() - o0.float()).abs()
                lerr = (l1 - l0).abs().max().item()
                m = err.max().item()
                worst = max(worst, m)
                tag = "OK " if m < 2e-2 and lerr < 1e-2 else "BAD"
                print(f"{tag} d={d} {str(dtype)[6:]} {kw} S={S} q={q_len} causal={causal}: out {m:.2e} lse {lerr:.2e}")
                if tag == "BAD":
                    bad = err > 2e-2
                    print("   bad rows (q pos) ", bad.any(-1).any(-1).any(0).nonzero().flatten()[:20].tolist())
                    print("   bad heads        ", bad.any(-1).any(1).any(0).nonzero().flatten().tolist())
                    print("   bad cols         ", bad.any(0).any(0).any(0).nonzero().flatten()[:40].tolist())
                    print("   ref/new sample   ", o0[0, -1, 0, :8].tolist(), o1[0, -1, 0, :8].tolist())
print("worst", worst)
