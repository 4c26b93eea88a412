"""GPU tests of the decode kernel's RoPE-center term (``key_center='rope'``: the codes hold
``k - R(p) c``, the kernel adds each score's ``q . R(p) c`` back; csrc/flash_attn/src/tq_rope_center.h).

Run on the device: ``python -m pytest tests/test_cuda_rope_center.py -q``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from gpu_cases import DECODE_CASES, DEV, NEEDS_GPU, poison_allocator, shuffled_block_table

import flash_attn_tq as fa
from flash_attn_tq import baseline, ops
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.keys import rope_turn

pytestmark = NEEDS_GPU


def _rope_cache(
    batch,
    seqlens,
    kv_heads,
    d,
    *,
    quantizer="turbo",
    k_bits=3,
    v_bits=3,
    dtype=torch.float16,
    offset=0,
    page_size=None,
    seed=0,
    window=0,
    max_seqlen=None,
):
    """A GPU cache with key_center='rope' filled through the pack kernel with post-RoPE keys whose
    pre-RoPE form has a large constant part per (row, head), as real keys have. The center is
    calibrated on each row's first append: its first half (the rest follows in a second append)."""
    scale_only = quantizer == "turbo-scale"
    gen = torch.Generator(device=DEV).manual_seed(seed)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    max_len = max_seqlen or max(seqlens) + 3
    block_table = shuffled_block_table(batch, max_len, page_size, seed) if page_size is not None else None
    cache = QuantizedKVCache(
        batch,
        max_len,
        kv_heads,
        d,
        k_bits=k_bits,
        v_bits=v_bits,
        quantizer="turbo" if scale_only else quantizer,
        scale_only=scale_only,
        dtype=dtype,
        page_size=page_size,
        block_table=block_table,
        fp16_window=window,
        device=DEV,
        seed=seed,
        key_center="rope",
        rope_inv_freq=inv_freq,
        rope_position_offset=offset,
        calib_min_tokens=1,
    )
    L = max(seqlens)
    raw = torch.randn(batch, 1, kv_heads, d, device=DEV, generator=gen) * 1.5 + torch.randn(
        batch, L, kv_heads, d, device=DEV, generator=gen
    )
    k = rope_turn(raw, torch.arange(L, device=DEV) + offset, inv_freq).to(dtype)
    v = torch.randn(batch, L, kv_heads, d, device=DEV, generator=gen).to(dtype)
    for b, n in enumerate(seqlens):
        idx = torch.tensor([b], dtype=torch.int32, device=DEV)
        half = (n + 1) // 2
        for a, e in ((0, half), (half, n)):
            if e > a:
                cache.append(k[b : b + 1, a:e], v[b : b + 1, a:e], cache_seqlens=a, batch_idx=idx)
    return cache


def _check(q, cache, out, lse, causal, seqlens):
    """The kernel against float32 attention over the dequantized keys (R(p) c added back), within
    twice what rounding q, K and V to 16 bits costs; and far from attention without the term."""
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    kd, vd = cpu.dequantize()
    lens = cache.seqlens.cpu()
    ref, ref_lse = baseline.attention_reference(q.float().cpu(), kd, vd, causal=causal, key_lengths=lens)
    dt = q.dtype
    lp, lp_lse = baseline.attention_reference(q.cpu(), kd.to(dt), vd.to(dt), causal=causal, key_lengths=lens)
    out = out.float().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err, err_lp = (out - ref).abs().max().item(), (lp.float() - ref).abs().max().item()
    bound = 2 * err_lp + torch.finfo(dt).eps * ref.abs().max().item() + 2e-3
    assert err <= bound, (err, err_lp)
    # the term's float16 operands: one float16 rounding of its size, |q . R(p) c| <= |q| |c| (scaled)
    term = q.shape[-1] ** -0.5 * q.float().norm(dim=-1).max().item() * cpu.k_center.norm(dim=-1).max().item()
    lse_err, lse_lp_err = (lse.cpu() - ref_lse).abs().max().item(), (lp_lse - ref_lse).abs().max().item()
    assert lse_err <= 2 * lse_lp_err + 1e-3 + 2**-11 * term, (lse_err, lse_lp_err, term)
    if min(seqlens) > 32:  # the term matters: without it the output is far off
        pos = torch.arange(kd.shape[1]).expand(kd.shape[0], -1)
        bare, _ = baseline.attention_reference(
            q.float().cpu(), cpu.transform_keys(kd, positions=pos).float(), vd, causal=causal, key_lengths=lens
        )
        assert (bare - ref).abs().max().item() > 4 * bound


ROPE_CASES = DECODE_CASES + [
    (2, [300, 1500], 8, 2, 64, True),  # 256 rows a kv head: the prefill kernel (Hopper; else the decode kernel)
    (1, [1333], 12, 4, 111, True),  # 333 rows, an odd chunk over a long cache
    (2, [300, 1100], 16, 2, 1),  # GQA 8: rows fill the n8 tile (decode's unpaired recurrence)
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
@pytest.mark.parametrize("quantizer", ["turbo", "asym", "turbo-scale"])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_center_decode_matches_reference(dtype, d, bits, quantizer, case):
    batch, seqlens, hq, hk, sq = case[:5]
    seed = zlib.crc32(repr(("rope", str(dtype), d, bits, quantizer, seqlens, sq)).encode()) % 10000
    cache = _rope_cache(
        batch, seqlens, hk, d, quantizer=quantizer, k_bits=bits[0], v_bits=bits[1], dtype=dtype, seed=seed
    )
    q = torch.randn(batch, sq, hq, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1)).to(dtype)
    causal = sq > 1
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=causal, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal, seqlens)


@pytest.mark.parametrize("offset", [0, 37, 250_000])
@pytest.mark.parametrize("page_size", [None, 32, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_rope_center_offsets_pages_and_splits(offset, page_size, num_splits):
    """Positions from rope_offset (up to 250K: the angle reduction), shuffled pages, split counts (one
    split: a warp's 130 tiles cross the recurrence's anchors)."""
    seqlens = [1, 600, 16700]
    cache = _rope_cache(3, seqlens, 4, 128, offset=offset, page_size=page_size, seed=offset % 97 + num_splits)
    q = torch.randn(3, 1, 16, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, num_splits=num_splits, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, False, [600])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("v_bits", [3, 8])
def test_rope_center_with_8bit_keys(d, v_bits):
    cache = _rope_cache(2, [129, 1000], 3, d, k_bits=8, v_bits=v_bits, seed=5)
    q = torch.randn(2, 1, 9, d, device=DEV, dtype=torch.float16)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, False, [129, 1000])


@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_rope_center_with_fp16_window(seqlen_q):
    """The window's tokens (stored as k - R(p) c too) get R(p) c back in the window pass."""
    cache = _rope_cache(2, [300, 40], 2, 128, window=64, seed=11)
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=seqlen_q > 1, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, seqlen_q > 1, [300, 40])


def test_rope_center_unsupported_calls_take_the_reference():
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.float16)
    cache = _rope_cache(1, [100], 2, 64, seed=3)
    for kwargs in (dict(window_size=(50, 0)), dict(softcap=20.0)):
        fa.flash_attn_with_kvcache(q, cache, **kwargs)
        assert fa.last_path() == (
            "quantized:reference (window_size / softcap / cache_leftpad with key_center='rope' "
            "is not supported by the fused kernel)"
        )
    paged16 = _rope_cache(1, [100], 2, 64, page_size=16, seed=3)
    out, lse = fa.flash_attn_with_kvcache(q, paged16, return_softmax_lse=True)
    assert "16-token pages" in fa.last_path()
    _check(q, paged16, out, lse, False, [100])


def test_rope_center_op_errors_name_the_argument():
    cache = _rope_cache(1, [40], 2, 64, seed=2)
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.float16)
    codes = ops.Store(ops.CODES, (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta), k_bits=3, v_bits=3)

    def decode(center, inv, window_size=(-1, -1)):
        stores = [codes, ops.Store(ops.CENTER, (center,))]
        return ops.decode(
            q, stores, cache.seqlens, softmax_scale=0.1, causal=False, window_size=window_size, rope_inv_freq=inv
        )

    center, inv = cache.k_center[:1].contiguous(), cache.rope_inv_freq
    with pytest.raises(RuntimeError, match="together"):
        decode(center, None)
    with pytest.raises(RuntimeError, match="rope_center must be"):
        decode(center.half(), inv)
    with pytest.raises(RuntimeError, match="rope_center must be"):
        decode(center[:, :1].contiguous(), inv)
    with pytest.raises(RuntimeError, match="rope_inv_freq must be"):
        decode(center, inv[:16])
    with pytest.raises(RuntimeError, match="rope_center does not combine"):
        decode(center, inv, window_size=(20, 0))
