"""One decode shape (with --q-len > 1 a causal prefill chunk; with --pack, quantize-on-write) for Nsight Compute:
    ncu --clock-control none --kernel-name regex:decode_split --launch-skip 5 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats python -m scripts.profile_decode
    ncu --clock-control none --kernel-name regex:prefill_split --launch-skip 5 --launch-count 1 --set full \
        python -m scripts.profile_decode --batch 1 --q-len 2048
"""

import argparse

import torch

from flash_attn_tq.cache import QuantizedKVCache

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--seqlen", type=int, default=32768)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--q-heads", type=int, default=32)
ap.add_argument("--head-dim", type=int, default=128)
ap.add_argument("--q-len", type=int, default=1, help="queries a sequence (the last q-len tokens, causal)")
ap.add_argument("--page-size", type=int, default=None, help="paged cache, pages of this many tokens (shuffled)")
ap.add_argument("--pack", action="store_true", help="also run the pack kernel on a 32K-token prompt")
args = ap.parse_args()
B, S, Hk, d = args.batch, args.seqlen, args.kv_heads, args.head_dim
table = None
if args.page_size:  # a shuffled block table, as an engine's allocator leaves it
    table = torch.randperm(B * (S // args.page_size), dtype=torch.int32).reshape(B, -1)
cache = QuantizedKVCache(B, S, Hk, d, page_size=args.page_size, block_table=table, device="cuda")
for s0 in range(0, S, 8192):
    n = min(8192, S - s0)
    cache.append(
        torch.randn(B, n, Hk, d, device="cuda", dtype=torch.float16),
        torch.randn(B, n, Hk, d, device="cuda", dtype=torch.float16),
    )
q = torch.randn(B, args.q_len, args.q_heads, d, device="cuda", dtype=torch.float16)
for _ in range(10):
    cache.attend(q, cache.seqlens, None, d**-0.5, args.q_len > 1, 0)
torch.cuda.synchronize()
print("done")
if args.pack:  # quantize-on-write of a 32K-token prompt (ncu --kernel-name regex:pack_kv)
    x = torch.randn(1, 32768, Hk, d, device="cuda", dtype=torch.float16)
    big = QuantizedKVCache(1, 32768, Hk, d, device="cuda")
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(10):
        big.write_codes(x, x, zero)
    torch.cuda.synchronize()
    print("pack done")
