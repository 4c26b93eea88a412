"""A small end-to-end case for compute-sanitizer (memcheck / racecheck) on the device:

    compute-sanitizer --tool memcheck python benchmarks/sanitize_case.py
"""
import torch

import flash_attn_tq as fa

for page_size, d, dtype in ((None, 128, torch.float16), (16, 64, torch.bfloat16)):
    cache = fa.QuantizedKVCache(2, 300, 2, d, page_size=page_size, dtype=dtype, device="cuda")
    cache.append(torch.randn(2, 257, 2, d, device="cuda", dtype=dtype), torch.randn(2, 257, 2, d, device="cuda", dtype=dtype))
    q = torch.randn(2, 1, 8, d, device="cuda", dtype=dtype)
    for splits in (1, 3):
        out = fa.flash_attn_with_kvcache(q, cache, k=torch.randn(2, 1, 2, d, device="cuda", dtype=dtype),
                                         v=torch.randn(2, 1, 2, d, device="cuda", dtype=dtype), num_splits=splits)
    q4 = torch.randn(2, 4, 8, d, device="cuda", dtype=dtype)
    fa.flash_attn_with_kvcache(q4, cache, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
print("sanitize case done:", fa.last_path())
