"""A small end-to-end case for compute-sanitizer (memcheck / racecheck) on the device: every kernel
family once (decode and prefill rows, paged caches, the local options, the 16-bit side, the RoPE
center, two head groups in one launch, the 4-bit ring, batch rows past the cache), from the
repository root:

    compute-sanitizer --tool memcheck python -m scripts.sanitize_case
"""

from __future__ import annotations

import argparse

import torch

import flash_attn_tq as fa
from flash_attn_tq import dispatch, ops


def filled(cache, n):
    """``cache`` after an append of ``n`` random fp16 tokens to each row."""
    shape = (cache.batch_size, n, cache.num_kv_heads, cache.head_dim)
    cache.append(
        torch.randn(shape, device="cuda", dtype=torch.float16), torch.randn(shape, device="cuda", dtype=torch.float16)
    )
    return cache


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available() or not ops.extension_available():
        raise SystemExit("sanitize_case needs a CUDA GPU and the built extension")
    for page_size, d, dtype in ((None, 128, torch.float16), (16, 64, torch.bfloat16)):
        cache = fa.QuantizedKVCache(2, 300, 2, d, page_size=page_size, dtype=dtype, device="cuda")
        cache.append(
            torch.randn(2, 257, 2, d, device="cuda", dtype=dtype), torch.randn(2, 257, 2, d, device="cuda", dtype=dtype)
        )
        q = torch.randn(2, 1, 8, d, device="cuda", dtype=dtype)
        for splits in (1, 3):
            out = fa.flash_attn_with_kvcache(
                q,
                cache,
                k=torch.randn(2, 1, 2, d, device="cuda", dtype=dtype),
                v=torch.randn(2, 1, 2, d, device="cuda", dtype=dtype),
                num_splits=splits,
            )
        q4 = torch.randn(2, 4, 8, d, device="cuda", dtype=dtype)
        fa.flash_attn_with_kvcache(q4, cache, causal=True)
        # the kLocal kernels: a window, leftpad and softcap (decode and prefill rows)
        leftpad = torch.tensor([3, 40], dtype=torch.int32, device="cuda")
        fa.flash_attn_with_kvcache(q4, cache, causal=True, window_size=(60, 0), cache_leftpad=leftpad, softcap=20.0)
        fa.flash_attn_with_kvcache(
            torch.randn(2, 50, 8, d, device="cuda", dtype=dtype), cache, window_size=(90, 7), num_splits=3
        )
        # the prefill kernel (>= 128 query rows a kv head): 200 rows, one and three splits
        q50 = torch.randn(2, 50, 8, d, device="cuda", dtype=dtype)
        for splits in (1, 3):
            outp = fa.flash_attn_with_kvcache(q50, cache, causal=True, num_splits=splits)
        # the same kernel body over the fp16 cache (Fp16KV loader), contiguous and paged
        k16 = torch.randn(2, 304, 2, d, device="cuda", dtype=dtype)
        v16 = torch.randn_like(k16)
        lens = torch.tensor([257, 300], dtype=torch.int32, device="cuda")
        for splits in (1, 3):
            out16, _ = ops.decode_kv16(q4, k16, v16, lens, None, None, d**-0.5, True, splits)
            pages = torch.arange(2 * 19, dtype=torch.int32, device="cuda").view(2, 19)
            ops.decode_kv16(
                q, k16.view(38, 16, 2, d), v16.view(38, 16, 2, d), lens, None, pages, d**-0.5, False, splits
            )
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(out16).all() and torch.isfinite(outp).all()
    # the 16-bit side (sinks + window) in the decode launch: plain, RoPE center, paged, chunk rows, the K8V8 head,
    # a side holding verify_tokens - 1 slots past the window (each row's window its own)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    for opts in (
        dict(),
        dict(key_center="rope", rope_inv_freq=inv_freq),
        dict(page_size=32),
        dict(k_bits=8, v_bits=8, key_center="rope", rope_inv_freq=inv_freq),
        dict(verify_tokens=16, key_center="rope", rope_inv_freq=inv_freq),
        dict(verify_tokens=16, page_size=32),
    ):
        side = fa.QuantizedKVCache(2, 400, 2, 64, sink_tokens=16, fp16_window=112, device="cuda", **opts)
        side.append(
            torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16),
            torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16),
        )
        # 70 x 4 rows a kv head: the prefill kernel (RoPE center: its table, capacity past the length) + side
        # launch; 200: rows before the ring's first key, whose side CTAs attend the sinks only
        for rows in (1, 9, 40, 70, 200):
            for splits in (1, 3):
                outs = fa.flash_attn_with_kvcache(
                    torch.randn(2, rows, 8, 64, device="cuda", dtype=torch.float16),
                    side,
                    causal=True,
                    num_splits=splits,
                )
        torch.cuda.synchronize()
        assert torch.isfinite(outs).all(), opts
    # two head groups in one launch (3-bit heads beside a K8V8 copy head): one row tile and two, equal and
    # own split counts (the unused slots filled); over 1024+ keys a code split, the 3-bit group's 64-token tiles
    rope = dict(sink_tokens=16, fp16_window=112, key_center="rope", rope_inv_freq=inv_freq, device="cuda")
    for capacity, n, row_counts in ((400, 300, (1, 5)), (1200, 1100, (1,))):
        narrow = filled(fa.QuantizedKVCache(2, capacity, 2, 64, **rope), n)
        k8 = filled(fa.QuantizedKVCache(2, capacity, 1, 64, k_bits=8, v_bits=8, **rope), n)
        for rows in row_counts:
            qp = torch.randn(2, rows, 12, 64, device="cuda", dtype=torch.float16)
            assert narrow.plan(dispatch.Query.of(qp), pair=(k8, 0)).kernel == "pair"
            for splits in (0, 1, 3):
                outs, _ = narrow.attend(qp, narrow.seqlens, None, 0.125, True, splits, with_lse=False, group2=(k8, 1))
                assert torch.isfinite(outs).all()
    # head_dim 64 over 1024+ keys a code split: 64-token warp tiles (plain, side, RoPE center + side,
    # 64-token pages), the last tile partial
    for opts in (dict(), dict(sink_tokens=16, fp16_window=112), rope, dict(page_size=64)):
        long = filled(fa.QuantizedKVCache(2, 1200, 2, 64, **dict(opts, device="cuda")), 1100)
        outs = fa.flash_attn_with_kvcache(
            torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16), long, num_splits=1
        )
    torch.cuda.synchronize()
    assert torch.isfinite(outs).all()
    # a ring of 4-bit window codes in the decode launch (NO_FP16_WINDOW's layers): K3V3 / K4V3, with and
    # without the RoPE center, one row tile and two, a wrapped ring, d 64 over 1024+ keys (64-token tiles),
    # one kv head (rows of a head adjacent: a lap's tiles start at any slot)
    for d, n, hk, opts in (
        (64, 300, 2, dict()),
        (64, 300, 2, dict(k_bits=4, key_center="rope", rope_inv_freq=inv_freq)),
        (128, 700, 2, dict(key_center="rope", rope_inv_freq=1.0 / 10000.0 ** (torch.arange(0, 128, 2).float() / 128))),
        (64, 1100, 2, dict(key_center="rope", rope_inv_freq=inv_freq)),
        (64, 301, 1, dict()),
    ):
        ring = filled(
            fa.QuantizedKVCache(2, n + 9, hk, d, sink_tokens=16, fp16_window=128, window_bits=4, device="cuda", **opts),
            n,
        )
        for rows in (1, 5):
            qr = torch.randn(2, rows, 4 * hk, d, device="cuda", dtype=torch.float16)
            assert ring.plan(dispatch.Query.of(qr)).kernel == "ring"
            for splits in (0, 1, 3):
                outs = fa.flash_attn_with_kvcache(qr, ring, causal=True, num_splits=splits)
    torch.cuda.synchronize()
    assert torch.isfinite(outs).all()
    # cache_batch_idx past the cache's rows: NaN rows, no read past the cache (decode and prefill rows)
    side = filled(fa.QuantizedKVCache(2, 400, 2, 64, **rope), 300)
    for rows in (1, 70):
        qb = torch.randn(2, rows, 8, 64, device="cuda", dtype=torch.float16)
        outs = fa.flash_attn_with_kvcache(
            qb, side, cache_batch_idx=torch.tensor([1, 9], device="cuda", dtype=torch.int32)
        )
        torch.cuda.synchronize()
        assert torch.isfinite(outs[0]).all() and torch.isnan(outs[1]).all()
    print("sanitize case done:", fa.last_path())


if __name__ == "__main__":
    main()
