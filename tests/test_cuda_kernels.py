"""GPU tests of the fused kernels (skipped without a GPU and the built extension).

Run on the device: ``python -m pytest tests/test_cuda_kernels.py -q``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from gpu_cases import DECODE_CASES, DEV, NEEDS_GPU, PREFILL_CASES, poison_allocator, shuffled_block_table

import flash_attn_tq as fa
from flash_attn_tq import baseline, dispatch, kernel_cases, ops
from flash_attn_tq import format as fmt
from flash_attn_tq.cache import QuantizedKVCache

pytestmark = NEEDS_GPU


def _make_cache(
    batch,
    seqlens,
    kv_heads,
    d,
    *,
    quantizer="turbo",
    k_bits=3,
    v_bits=3,
    dtype=torch.float16,
    page_size=None,
    window=0,
    window_bits=16,
    seed=0,
    max_seqlen=None,
    shuffle_blocks=False,
):
    """A GPU cache filled through the pack kernel with random K/V; returns (cache, k_full, v_full).
    quantizer "turbo-scale": turbo with scale-only metadata."""
    scale_only = quantizer == "turbo-scale"
    quantizer = "turbo" if scale_only else quantizer
    gen = torch.Generator(device=DEV).manual_seed(seed)
    max_len = max_seqlen or max(seqlens) + 3
    shuffled = page_size is not None and shuffle_blocks
    block_table = shuffled_block_table(batch, max_len, page_size, seed) if shuffled else None
    cache = QuantizedKVCache(
        batch,
        max_len,
        kv_heads,
        d,
        k_bits=k_bits,
        v_bits=v_bits,
        quantizer=quantizer,
        page_size=page_size,
        block_table=block_table,
        fp16_window=window,
        window_bits=window_bits,
        dtype=dtype,
        device=DEV,
        seed=seed,
        scale_only=scale_only,
    )
    L = max(seqlens)
    k = (torch.randn(batch, L, kv_heads, d, device=DEV, generator=gen) * 1.5 + 0.3).to(dtype)
    v = torch.randn(batch, L, kv_heads, d, device=DEV, generator=gen).to(dtype)
    for b, n in enumerate(seqlens):
        idx = torch.tensor([b], dtype=torch.int32, device=DEV)
        if n:
            cache.append(k[b : b + 1, :n], v[b : b + 1, :n], cache_seqlens=0, batch_idx=idx)
    return cache, k, v


def _reference(q, cache, seqlens_total, causal, softmax_scale=None, window_size=(-1, -1), **extra):
    """float32 attention over the dequantized cache (the quantized reference path, on a CPU copy)."""
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    kd, vd = cpu.dequantize()
    out, lse = baseline.attention_reference(
        q.float().cpu(),
        kd,
        vd,
        softmax_scale=softmax_scale,
        causal=causal,
        key_lengths=seqlens_total.cpu(),
        window_size=window_size,
        **extra,
    )
    # what a 16-bit kernel computes: the codes' domain (rotated for turbo), inputs and output rounded
    # to q's dtype. The fused kernel may err at most about twice as much as this does.
    dt = q.dtype
    kr, vr = cpu.dequantize(rotated=True)
    out_lp, lse_lp = baseline.attention_reference(
        cpu.rotate_query(q.cpu()),
        kr.to(dt),
        vr.to(dt),
        softmax_scale=softmax_scale,
        causal=causal,
        key_lengths=seqlens_total.cpu(),
        window_size=window_size,
        **extra,
    )
    return out, lse, cpu.unrotate_output(out_lp.to(dt)).to(dt).float(), lse_lp


def _check_against_reference(q, cache, out, lse, causal, window_size=(-1, -1), **extra):
    """extra: softcap= / key_start= (cache_leftpad) for the references."""
    ref, ref_lse, ref_lp, ref_lse_lp = _reference(q, cache, cache.seqlens, causal, window_size=window_size, **extra)
    out = out.float().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err, err_lp = (out - ref).abs().max().item(), (ref_lp - ref).abs().max().item()
    # beyond 16-bit math: one rounding of each token's V scale times its probability (a common
    # relative error of the token's values, which dominates with a single key), 2^-8 in bf16
    assert err <= 2 * err_lp + torch.finfo(q.dtype).eps * ref.abs().max().item() + 2e-3, (err, err_lp)
    lse_err, lse_lp_err = (lse.cpu() - ref_lse).abs().max().item(), (ref_lse_lp - ref_lse).abs().max().item()
    assert lse_err <= 2 * lse_lp_err + 1e-3, (lse_err, lse_lp_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
@pytest.mark.parametrize("quantizer", ["turbo", "asym", "turbo-scale"])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(dtype, d, bits, quantizer, case):
    batch, seqlens, hq, hk, sq = case
    seed = zlib.crc32(repr((str(dtype), d, bits, quantizer, seqlens, sq)).encode()) % 10000  # stable across runs
    cache, _, _ = _make_cache(
        batch, seqlens, hk, d, quantizer=quantizer, k_bits=bits[0], v_bits=bits[1], dtype=dtype, seed=seed
    )
    q = torch.randn(batch, sq, hq, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1)).to(dtype)
    causal = sq > 1
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=causal, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
@pytest.mark.parametrize("quantizer", ["turbo", "asym", "turbo-scale"])
@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("wgmma", ["1", "0"], ids=["wgmma", "mma_sync"])
def test_prefill_matches_reference(dtype, d, bits, quantizer, case, wgmma, monkeypatch):
    """The prefill kernel (>= kernel_cases.PREFILL_MIN_ROWS query rows a kv head) against float32 attention over
    the dequantized cache, through flash_attn_with_kvcache; both of its variants on Hopper (wgmma, and
    the mma.sync one other GPUs run; FLASH_ATTN_TQ_PREFILL_WGMMA=0 picks it there)."""
    monkeypatch.setenv("FLASH_ATTN_TQ_PREFILL_WGMMA", wgmma)
    batch, seqlens, hq, hk, sq, causal = case
    assert (hq // hk) * sq >= kernel_cases.PREFILL_MIN_ROWS
    seed = zlib.crc32(repr(("prefill", str(dtype), d, bits, quantizer, seqlens, sq)).encode()) % 10000
    cache, _, _ = _make_cache(
        batch, seqlens, hk, d, quantizer=quantizer, k_bits=bits[0], v_bits=bits[1], dtype=dtype, seed=seed
    )
    q = torch.randn(batch, sq, hq, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1)).to(dtype)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=causal, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [(8, 3), (8, 8)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("quantizer", ["turbo", "asym", "turbo-scale"])
@pytest.mark.parametrize("case", DECODE_CASES + [c[:5] for c in PREFILL_CASES[:2] + PREFILL_CASES[-1:]])
def test_decode_8bit_matches_reference(dtype, bits, d, quantizer, case):
    """K8V3 and K8V8 (the few heads TQCache holds near exact) through their fused decode kernel, float16
    and bfloat16 (whose 8-bit codes reach the fragments through float32), decode and prefill-sized
    chunks (the decode kernel serves every row count for them)."""
    batch, seqlens, hq, hk, sq = case
    seed = zlib.crc32(repr(("k8", str(dtype), bits, d, quantizer, seqlens, sq)).encode()) % 10000
    cache, _, _ = _make_cache(
        batch, seqlens, hk, d, quantizer=quantizer, k_bits=bits[0], v_bits=bits[1], dtype=dtype, seed=seed
    )
    q = torch.randn(batch, sq, hq, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1)).to(dtype)
    causal = sq > 1
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=causal, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, causal)


@pytest.mark.parametrize("seqlen_q", [1, 64, 300])
@pytest.mark.parametrize("page_size", [None, 256])
def test_long_cache(seqlen_q, page_size):
    """A 128K-token cache (odd length), decode and 256- and 1200-row prefill chunks (on Hopper the
    latter run the wgmma variant), contiguous and paged."""
    cache, _, _ = _make_cache(1, [131071], 2, 128, page_size=page_size, shuffle_blocks=True, seed=31, max_seqlen=131072)
    q = torch.randn(1, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, True)


@pytest.mark.parametrize("window,causal", [((100, 0), True), ((37, -1), False), ((50, 20), False), ((0, 0), True)])
@pytest.mark.parametrize("seqlen_q", [1, 4, 64, 300])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_local_window_on_the_fused_kernels(window, causal, seqlen_q, num_splits):
    """window_size (local attention) in the decode kernel (1 and 4 queries) and the prefill kernel
    (64 / 300 queries x 4 heads a kv head = 256 / 1200 rows: the mma.sync / wgmma variant on Hopper),
    against float32 attention with the same window."""
    cache, _, _ = _make_cache(2, [700, 1500], 2, 128, seed=23)
    q = torch.randn(
        2,
        seqlen_q,
        8,
        128,
        device=DEV,
        dtype=torch.float16,
        generator=torch.Generator(device=DEV).manual_seed(seqlen_q),
    )
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(
        q, cache, causal=causal, window_size=window, num_splits=num_splits, return_softmax_lse=True
    )
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, causal, window_size=window)


@pytest.mark.parametrize("extra", ["leftpad", "softcap", "both"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 64, 300])
def test_leftpad_and_softcap_on_the_fused_kernels(extra, seqlen_q):
    """cache_leftpad (keys before it are padding) and softcap in the decode and prefill kernels."""
    cache, _, _ = _make_cache(2, [700, 1500], 2, 128, seed=29)
    q = torch.randn(
        2,
        seqlen_q,
        8,
        128,
        device=DEV,
        dtype=torch.float16,
        generator=torch.Generator(device=DEV).manual_seed(seqlen_q + 5),
    )
    leftpad = torch.tensor([3, 611], dtype=torch.int32, device=DEV) if extra != "softcap" else None
    softcap = 4.0 if extra != "leftpad" else 0.0
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(
        q, cache, causal=True, cache_leftpad=leftpad, softcap=softcap, return_softmax_lse=True
    )
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(
        q, cache, out, lse, True, softcap=softcap, key_start=None if leftpad is None else leftpad.cpu()
    )


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("seqlen_q", [70, 300])
def test_prefill_paged_equals_contiguous(num_splits, page_size, seqlen_q):
    """Paged (shuffled pages) and contiguous caches holding the same codes give bit-identical prefill
    outputs for the same splits (280 / 1200 rows a kv head: both prefill variants on Hopper), and
    match the reference."""
    seqlens = [1000, 3000]
    paged, _, _ = _make_cache(2, seqlens, 2, 128, page_size=page_size, shuffle_blocks=True, seed=5, max_seqlen=3072)
    contiguous, _, _ = _make_cache(2, seqlens, 2, 128, seed=5, max_seqlen=3072)
    assert torch.equal(paged.dequantize()[0].cpu(), contiguous.dequantize()[0].cpu())
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out_p, lse_p = fa.flash_attn_with_kvcache(q, paged, causal=True, num_splits=num_splits, return_softmax_lse=True)
    out_c, lse_c = fa.flash_attn_with_kvcache(
        q, contiguous, causal=True, num_splits=num_splits, return_softmax_lse=True
    )
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    _check_against_reference(q, contiguous, out_c, lse_c, True)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [None, 16, 32, 256])
@pytest.mark.parametrize("quantizer", ["turbo", "turbo-scale"])
def test_decode_paged_and_splits(num_splits, page_size, quantizer):
    seqlens = [1, 600, 4097]
    cache, _, _ = _make_cache(
        3, seqlens, 4, 128, page_size=page_size, shuffle_blocks=True, seed=num_splits + 7, quantizer=quantizer
    )
    q = torch.randn(3, 1, 16, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out = fa.flash_attn_with_kvcache(q, cache, num_splits=num_splits)
    assert fa.last_path() == "quantized:fused-cuda"
    ref, _, ref_lp, _ = _reference(q, cache, cache.seqlens, False)
    err, err_lp = (out.float().cpu() - ref).abs().max().item(), (ref_lp - ref).abs().max().item()
    assert err <= 2 * err_lp + 2e-3, (err, err_lp)


@pytest.mark.parametrize("num_splits", [2, 5, 33, 70])
@pytest.mark.parametrize("batch,seqlen_q", [(3, 1), (16, 4)])
def test_split_combine(num_splits, batch, seqlen_q):
    """Both combine kernels (a CTA a row below 2048 rows; a warp a row from 2048 rows and at most 32
    splits) against the reference: more splits than one load batch of a warp, and sequences shorter
    than the split count (splits without keys, log-sum-exp -inf)."""
    seqlens = [4500 if i == 1 else (37 * i + 1) % 600 + (i % 3) * 40 for i in range(batch)]
    cache, _, _ = _make_cache(batch, seqlens, 8, 128, seed=num_splits + batch)
    q = torch.randn(batch, seqlen_q, 32, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, num_splits=num_splits, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check_against_reference(q, cache, out, lse, False)


@pytest.mark.parametrize("page_size", [16, 32, 256])
@pytest.mark.parametrize("window", [(-1, -1), (5000, 0)])
def test_decode_paged_equals_contiguous_long(page_size, window):
    """One split over 20K tokens: each warp walks ~150 tiles, so the paged kernel's block-table
    look-ahead (32 tiles a chunk) turns over several times; paged == contiguous bit for bit."""
    seqlens = [20001, 12345]
    paged, _, _ = _make_cache(2, seqlens, 2, 128, page_size=page_size, shuffle_blocks=True, seed=41, max_seqlen=20480)
    contiguous, _, _ = _make_cache(2, seqlens, 2, 128, seed=41, max_seqlen=20480)
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out_p, lse_p = fa.flash_attn_with_kvcache(q, paged, num_splits=1, window_size=window, return_softmax_lse=True)
    out_c, lse_c = fa.flash_attn_with_kvcache(q, contiguous, num_splits=1, window_size=window, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    _check_against_reference(q, contiguous, out_c, lse_c, False, window_size=window)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("seqlen_q", [1, 70])
def test_paged_token_major_layout(page_size, seqlen_q):
    """The kernels copy a head-major paged pool a page run at a time as contiguous regions; a
    token-major pool ([blocks, page, heads, bytes] contiguous: a head's tokens are not adjacent)
    takes the per-token copies: both give the same bits, decode and prefill."""
    seqlens = [700, 1500]
    cache, _, _ = _make_cache(
        2, seqlens, 2, 128, page_size=page_size, shuffle_blocks=True, seed=13, quantizer="turbo-scale", max_seqlen=1536
    )
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    signs = cache.k_quantizer.signs_on(q.device)
    tensors = (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta)
    assert cache.k_codes.stride(0) == cache.k_codes.stride(2) * 2  # head-major: [blocks, heads, page, bytes]
    plan = cache.plan(dispatch.Query.of(q))
    assert plan.fused, plan.reason
    outs = []
    for codes in (tensors, tuple(t.contiguous() for t in tensors)):
        poison_allocator()
        store = ops.Store(ops.CODES, codes, k_bits=3, v_bits=3)
        outs.append(
            ops.decode(
                q,
                [store],
                cache.seqlens,
                softmax_scale=128**-0.5,
                causal=True,
                kernel=plan.kernel,
                block_table=cache.block_table,
                rot_signs=signs,
            )
        )
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    _check_against_reference(q, cache, outs[0][0], outs[0][1], True)


def test_decode_cache_batch_idx_and_append():
    cache, _, _ = _make_cache(4, [50, 90, 10, 300], 2, 64, seed=3, max_seqlen=400)
    q = torch.randn(2, 1, 6, 64, device=DEV, dtype=torch.float16)
    k_new = torch.randn(2, 1, 2, 64, device=DEV, dtype=torch.float16)
    v_new = torch.randn(2, 1, 2, 64, device=DEV, dtype=torch.float16)
    bidx = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    out = fa.flash_attn_with_kvcache(q, cache, k=k_new, v=v_new, cache_batch_idx=bidx)
    assert fa.last_path() == "quantized:fused-cuda"
    assert cache.seqlens.tolist() == [50, 91, 10, 301]
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    kd, vd = cpu.dequantize(bidx.long().cpu())
    ref, _ = baseline.attention_reference(q.float().cpu(), kd, vd, key_lengths=cache.seqlens[bidx.long()].cpu())
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-3, rtol=0)


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("window_bits", [16, 4])
def test_decode_with_fp16_window_matches_reference(seqlen_q, window_bits):
    """The kernel over the quantized tokens merged with the recent window (16-bit or 4-bit codes; causal
    for several queries: a query must not see the window's newer tokens)."""
    cache, _, _ = _make_cache(2, [300, 40], 2, 128, window=64, window_bits=window_bits, seed=11)
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    out = fa.flash_attn_with_kvcache(q, cache, causal=seqlen_q > 1)
    assert fa.last_path() == "quantized:fused-cuda"
    ref, _, _, _ = _reference(q, cache, cache.seqlens, seqlen_q > 1)
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-3, rtol=0)


@pytest.mark.parametrize(
    "quantizer,grid", [("turbo", "uniform"), ("turbo", "lloyd_max"), ("asym", "uniform"), ("turbo-scale", "uniform")]
)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_kernel_matches_reference_codes(quantizer, grid, bits, d, dtype):
    if bits == 8 and grid == "lloyd_max":
        pytest.skip("8-bit codes use the uniform grid (QuantizedKVCache refuses Lloyd-Max)")
    n, h = 999, 3
    gen = torch.Generator(device=DEV).manual_seed(bits * 1000 + d)
    x = (torch.randn(1, n, h, d, device=DEV, generator=gen) * 2 - 0.5).to(dtype)
    scale_only = quantizer == "turbo-scale"
    cache = QuantizedKVCache(
        1,
        n,
        h,
        d,
        k_bits=bits,
        v_bits=bits,
        quantizer=quantizer.removesuffix("-scale"),
        grid=grid,
        device=DEV,
        scale_only=scale_only,
    )
    assert cache.k_meta.shape[-1] == (1 if scale_only else 2)
    for t in (cache.k_codes, cache.v_codes):
        t.fill_(0xAB)  # poison: every written byte must be overwritten
    for t in (cache.k_meta, cache.v_meta):
        t.fill_(float("nan"))
    cache.append(x, x)  # the pack kernel (K and V in one launch, each with its own rotation)
    ref = cache.quantize(x, x)  # the PyTorch reference, same data, same device
    for name in ("k", "v"):
        got_codes = fmt.unpack_codes(getattr(cache, f"{name}_codes")[0, :n], bits, d)
        ref_codes = fmt.unpack_codes(ref[f"{name}_codes"][0], bits, d)
        diff = got_codes != ref_codes
        # only values within float rounding of a bin edge may differ (reduction order of the norm), by one code
        assert ((got_codes - ref_codes).abs() <= 1).all()
        frac = diff.float().mean().item()
        assert frac <= (0 if quantizer == "asym" else 2e-3), frac
        print(f"\n{name}: {quantizer}/{grid} {bits}b d={d} {dtype}: {int(diff.sum())} of {diff.numel()} codes differ")
        got_meta, ref_meta = getattr(cache, f"{name}_meta")[0, :n].float(), ref[f"{name}_meta"][0].float()
        torch.testing.assert_close(got_meta, ref_meta, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_kernel_asym_vectors_not_straddling_zero(bits, d, dtype):
    """asym vectors entirely above or below 0, and constant ones: the pack kernel's grid starts at
    the vector's minimum (offset = min), with the same codes and metadata as the reference, bit for
    bit, and the fused decode over them agrees with the reference path."""
    n, h = 301, 4
    gen = torch.Generator(device=DEV).manual_seed(7 * bits + d)
    x = torch.rand(1, n, h, d, device=DEV, generator=gen)
    x[:, :, 0] += 5.0  # all in [5, 6]
    x[:, :, 1] = -9.0 + x[:, :, 1]  # all in [-9, -8]
    x[:, :, 2] = 10.0  # constant
    x[:, :, 3] = x[:, :, 3] * 40 + 0.25  # wide, positive
    x = x.to(dtype)
    cache = QuantizedKVCache(1, n, h, d, k_bits=bits, v_bits=bits, quantizer="asym", device=DEV)
    assert cache.write_plan(x.dtype).kernel
    for t in (cache.k_codes, cache.v_codes):
        t.fill_(0xAB)
    for t in (cache.k_meta, cache.v_meta):
        t.fill_(float("nan"))
    cache.append(x, x)
    ref = cache.quantize(x, x)
    for name in ("k", "v"):
        got_codes = fmt.unpack_codes(getattr(cache, f"{name}_codes")[0, :n], bits, d)
        ref_codes = fmt.unpack_codes(ref[f"{name}_codes"][0], bits, d)
        assert torch.equal(got_codes, ref_codes)
        got_meta = getattr(cache, f"{name}_meta")[0, :n]
        assert torch.equal(got_meta, ref[f"{name}_meta"][0])
        torch.testing.assert_close(got_meta[..., 1].float(), x[0].float().amin(-1).half().float(), rtol=0, atol=0)
    kd, vd = cache.dequantize()
    step = cache.k_meta[0, :n, :, :1].float().cpu()
    err = (kd[0, :n].cpu() - x[0].float().cpu()).abs()
    assert (err <= step / 2 * 1.002 + 1e-6).all(), err.amax()
    assert torch.equal(kd[0, :n, 2].cpu(), x[0, :, 2].float().cpu())  # constant vectors: exact
    q = torch.randn(1, 1, 2 * h, d, device=DEV, dtype=dtype)
    out, lse = fa.flash_attn_with_kvcache(q, cache, return_softmax_lse=True)
    fused = (bits, bits) in kernel_cases.FUSED_DECODE_BITS
    assert fa.last_path() == "quantized:fused-cuda" if fused else fa.last_path().startswith("quantized:reference")
    _check_against_reference(q, cache, out, lse, causal=False)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_pack_kernel_lloyd_max_tie_goes_up(bits, d):
    """A coordinate exactly on a Lloyd-Max bin edge (here 0, the middle edge) takes the upper level
    in the pack kernel as in the reference (the floor(v + 0.5) rule of the uniform grid)."""
    cache = QuantizedKVCache(1, 8, 1, d, k_bits=bits, v_bits=bits, grid="lloyd_max", device=DEV, seed=5)
    rows = []
    for qz in (cache.k_quantizer, cache.v_quantizer):
        x = torch.zeros(d)
        x[0], x[1] = qz.signs[0], qz.signs[1]  # rotated: (2, 0, 2, 0, ...) / sqrt(d), zeros exactly
        rows.append(x.view(1, 1, 1, d).to(DEV, torch.float16))
    k, v = rows
    assert cache.write_plan(k.dtype).kernel
    cache.append(k, v)
    ref = cache.quantize(k, v)
    for name in ("k", "v"):
        got = fmt.unpack_codes(getattr(cache, f"{name}_codes")[0, :1], bits, d)
        exp = fmt.unpack_codes(ref[f"{name}_codes"][0], bits, d)
        assert torch.equal(got, exp)
        assert got[0, 0, 1::2].tolist() == [(1 << bits) // 2] * (d // 2)


def test_cuda_graph_capture_and_replay():
    cache, _, _ = _make_cache(2, [500, 700], 2, 128, seed=5, max_seqlen=1024)
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.float16)
    k_new = torch.randn(2, 1, 2, 128, device=DEV, dtype=torch.float16)
    v_new = torch.randn(2, 1, 2, 128, device=DEV, dtype=torch.float16)
    seqlens = cache.seqlens.clone()
    out_static = torch.empty_like(q)

    def step():
        out_static.copy_(fa.flash_attn_with_kvcache(q, cache, k=k_new, v=v_new, cache_seqlens=seqlens, num_splits=4))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (also loads kernels)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        seqlens += 1
        graph.replay()
        torch.cuda.synchronize()
        eager = fa.flash_attn_with_kvcache(q, cache, k=k_new, v=v_new, cache_seqlens=seqlens, num_splits=4)
        torch.testing.assert_close(out_static, eager, atol=0, rtol=0)


def test_torch_compile_traces_the_op():
    cache, _, _ = _make_cache(2, [300, 301], 2, 64, seed=9)
    q = torch.randn(2, 1, 4, 64, device=DEV, dtype=torch.bfloat16)

    def f(qq):
        return cache.attend(qq, cache.seqlens, None, 0.125, False, 2, plan=dispatch.Plan("decode"))[0]

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(q), f(q))


def test_unsupported_calls_fall_back_to_the_reference():
    cache, _, _ = _make_cache(1, [40], 2, 128, seed=2)
    q = torch.randn(1, 1, 4, 128, device=DEV, dtype=torch.float16)
    fa.flash_attn_with_kvcache(q, cache, softcap=30.0)
    assert fa.last_path() == "quantized:fused-cuda"
    centered = QuantizedKVCache(1, 64, 2, 128, key_center=True, device=DEV)
    centered.append(
        torch.randn(1, 8, 2, 128, device=DEV, dtype=torch.float16),
        torch.randn(1, 8, 2, 128, device=DEV, dtype=torch.float16),
    )
    fa.flash_attn_with_kvcache(q, centered, softcap=30.0)
    assert fa.last_path().startswith("quantized:reference (softcap with key centering")
    lloyd = QuantizedKVCache(1, 64, 2, 128, grid="lloyd_max", device=DEV)
    lloyd.append(
        torch.randn(1, 8, 2, 128, device=DEV, dtype=torch.float16),
        torch.randn(1, 8, 2, 128, device=DEV, dtype=torch.float16),
    )
    fa.flash_attn_with_kvcache(q, lloyd)
    assert "Lloyd-Max" in fa.last_path()


def test_kernel_errors_name_the_argument():
    cache, _, _ = _make_cache(1, [40], 2, 128, seed=2)
    q = torch.randn(1, 1, 4, 128, device=DEV, dtype=torch.float16)

    def decode(q, v_codes=cache.v_codes, seqlens=cache.seqlens):
        store = ops.Store(ops.CODES, (cache.k_codes, cache.k_meta, v_codes, cache.v_meta), k_bits=3, v_bits=3)
        return ops.decode(q, [store], seqlens, softmax_scale=0.1, causal=False)

    with pytest.raises(RuntimeError, match="seqlens_k"):
        decode(q, seqlens=cache.seqlens.long())
    with pytest.raises(RuntimeError, match="head_dim"):
        decode(q[..., :96].contiguous())
    # V rows of 48 bytes are copied 16 bytes at a time: codes 8 bytes past an alignment are refused
    shifted = torch.zeros(cache.v_codes.numel() + 8, device=DEV, dtype=torch.uint8)[8:].view(cache.v_codes.shape)
    with pytest.raises(RuntimeError, match="k_codes/v_codes rows must be aligned"):
        decode(q, v_codes=shifted)
    with pytest.raises(ValueError, match="NaN"):
        bad = torch.full((1, 1, 2, 128), float("nan"), device=DEV, dtype=torch.float16)
        fa.flash_attn_with_kvcache(q, cache, k=bad, v=bad)
    with pytest.raises(ValueError, match="overflow"):
        big = torch.randn(1, 100, 2, 128, device=DEV, dtype=torch.float16)
        fa.flash_attn_with_kvcache(q, cache, k=big, v=big)


@pytest.mark.parametrize("page_size", [None, 32])
def test_append_checks_run_in_the_pack_kernel(page_size):
    """Bad appends raise ValueError naming the problem (never a device fault) and leave seqlens alone;
    the kernel skips the bad tokens (the call's valid rows may have been written, past seqlens)."""
    cache, _, _ = _make_cache(3, [10, 20, 30], 2, 64, seed=4, max_seqlen=64, page_size=page_size)
    before = {name: getattr(cache, name).clone() for name in ("k_codes", "k_meta", "seqlens")}
    x = torch.randn(2, 4, 2, 64, device=DEV, dtype=torch.float16)
    bad = x.clone()
    bad[1, 2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.append(bad, x, batch_idx=torch.tensor([0, 1], device=DEV, dtype=torch.int32))
    with pytest.raises(ValueError, match="batch_idx"):
        cache.append(x, x, batch_idx=torch.tensor([0, 7], device=DEV, dtype=torch.int32))
    with pytest.raises(ValueError, match="overflow"):
        cache.append(x, x, cache_seqlens=torch.tensor([10, 61], device=DEV, dtype=torch.int32))
    with pytest.raises(ValueError, match="overflow"):
        cache.append(x, x, cache_seqlens=-1)
    assert torch.equal(cache.seqlens, before["seqlens"])
    # positions below seqlens were never touched by the failed calls
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    g_now = cpu.gather()
    cache.k_codes.copy_(before["k_codes"])
    cache.k_meta.copy_(before["k_meta"])
    cpu0 = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    g_then = cpu0.gather()
    for b, n in enumerate([10, 20, 30]):
        assert torch.equal(g_now["k_codes"][b, :n], g_then["k_codes"][b, :n])
    # and a good call still works after the failed ones
    cache.append(x, x, batch_idx=torch.tensor([2, 0], device=DEV, dtype=torch.int32))
    assert cache.seqlens.tolist() == [14, 20, 34]
    ref = cache.quantize(x, x)
    got = fmt.unpack_codes(cpu_gather_row(cache, 2, 30, 34), 3, 64)
    exp = fmt.unpack_codes(ref["k_codes"][0], 3, 64)
    assert ((got - exp).abs() <= 1).all() and (got != exp).float().mean() < 2e-3


def cpu_gather_row(cache, row, lo, hi):
    g = cache.gather(torch.tensor([row], device=DEV))
    return g["k_codes"][0, lo:hi]


@pytest.mark.parametrize(
    "quantizer, k_bits, v_bits",
    [("turbo-scale", 3, 3), ("turbo", 4, 4), ("asym", 3, 3)],  # K and V in one launch, or a launch each
)
@pytest.mark.parametrize("page_size", [None, 16])
def test_append_advances_seqlens_in_the_pack_launch(quantizer, k_bits, v_bits, page_size):
    """The pack launch itself advances seqlens (no kernel of its own after it), once every CTA has
    read the start positions: over many CTAs, call after call (the count the last CTA keeps is back
    at zero), through each way an append names its rows; a caller's start tensor that shares seqlens'
    memory takes the PyTorch update; an append that fails moves nothing."""
    B, h, d = 4, 2, 64
    cache, _, _ = _make_cache(
        B,
        [5, 9, 0, 3],
        h,
        d,
        quantizer=quantizer,
        k_bits=k_bits,
        v_bits=v_bits,
        page_size=page_size,
        max_seqlen=1200,
        seed=7,
    )
    gen = torch.Generator(device=DEV).manual_seed(8)
    expect = [5, 9, 0, 3]

    def kv(b, n):
        return torch.randn(b, n, h, d, device=DEV, generator=gen, dtype=torch.float16)

    flags, x = torch.zeros(1, dtype=torch.int32, device=DEV), kv(B, 1)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cache.append(x, x, error_flags=flags)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == (1 if quantizer == "turbo-scale" else 2), kernels
    assert all("pack" in n for n in kernels), kernels
    assert flags.item() == 0
    expect = [n + 1 for n in expect]
    assert cache.seqlens.tolist() == expect
    for _ in range(3):  # 1200 vectors a call: tens of CTAs
        x = kv(B, 300 // 2)
        cache.append(x, x)
        expect = [n + 150 for n in expect]
        assert cache.seqlens.tolist() == expect
    x = kv(2, 7)
    cache.append(x, x, batch_idx=torch.tensor([3, 1], device=DEV, dtype=torch.int32))
    expect[3] += 7
    expect[1] += 7
    assert cache.seqlens.tolist() == expect
    cache.append(x, x, cache_seqlens=20)  # rows 0, 1 at position 20
    expect[:2] = [27, 27]
    assert cache.seqlens.tolist() == expect
    own = torch.tensor([expect[0], expect[1]], device=DEV, dtype=torch.int32)
    cache.append(x, x, cache_seqlens=own, batch_idx=torch.tensor([1, 0], device=DEV, dtype=torch.int32))
    expect[0], expect[1] = own[1].item() + 7, own[0].item() + 7
    assert cache.seqlens.tolist() == expect
    shared = cache.seqlens[1:3]  # start rows 1, 2 written to rows 2, 3: read before any row moves
    want = [expect[0], expect[1], expect[1] + 7, expect[2] + 7]
    cache.append(x, x, cache_seqlens=shared, batch_idx=torch.tensor([2, 3], device=DEV, dtype=torch.int32))
    assert cache.seqlens.tolist() == want
    expect = want
    with pytest.raises(ValueError, match="overflow"):
        cache.append(kv(B, 2000), kv(B, 2000))
    bad = kv(B, 1)
    bad[2, 0, 1, 3] = float("nan")
    for k_new, v_new in ((bad, bad), (bad, kv(B, 1)), (kv(B, 1), bad)):  # (K alone: a launch each, the first)
        with pytest.raises(ValueError, match="NaN"):
            cache.append(k_new, v_new)
        assert cache.seqlens.tolist() == expect
    over = torch.from_dlpack(cache.seqlens[1:3])  # seqlens' memory through a storage of its own
    want = [expect[0], expect[1], expect[1] + 7, expect[2] + 7]
    cache.append(x, x, cache_seqlens=over, batch_idx=torch.tensor([2, 3], device=DEV, dtype=torch.int32))
    assert cache.seqlens.tolist() == want
    expect = want
    x = kv(B, 1)
    cache.append(x, x)  # and the count still works after the failed calls
    assert cache.seqlens.tolist() == [n + 1 for n in expect]


@pytest.mark.parametrize("quantizer", ["turbo", "turbo-scale", "asym"])
def test_pack_kernel_refuses_scales_beyond_float16(quantizer):
    """bfloat16 keys or values beyond float16's range would need scales that the float16 metadata
    cannot hold: the pack kernel refuses them as it refuses NaN (ValueError naming the problem,
    seqlens unchanged), and accepts large vectors it can store."""
    cache, _, _ = _make_cache(2, [10, 20], 2, 128, quantizer=quantizer, dtype=torch.bfloat16, seed=3, max_seqlen=64)
    x = torch.randn(2, 3, 2, 128, device=DEV, dtype=torch.bfloat16)
    huge = x.clone()
    huge[1, 1, 0] *= 1e6
    for k_new, v_new in ((huge, x), (x, huge)):
        with pytest.raises(ValueError, match="float16"):
            cache.append(k_new, v_new)
        assert cache.seqlens.tolist() == [10, 20]
    cache.append(x * 1000, x * 1000)
    assert cache.seqlens.tolist() == [13, 23]
    assert torch.isfinite(cache.k_meta.float()).all() and torch.isfinite(cache.v_meta.float()).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_kernel_fit_mean_matches_reference(bits, d, dtype):
    """fit="mean" (the TQCache default's grid fit) in the pack kernel vs the PyTorch quantizer."""
    n, h = 777, 2
    gen = torch.Generator(device=DEV).manual_seed(31 * bits + d)
    x = (torch.randn(1, n, h, d, device=DEV, generator=gen) + 0.7).to(dtype)  # a nonzero mean to fit
    cache = QuantizedKVCache(1, n, h, d, k_bits=bits, v_bits=bits, fit="mean", device=DEV)
    assert cache.write_plan(x.dtype).kernel
    cache.k_codes.fill_(0xCD)
    cache.k_meta.fill_(float("nan"))
    cache.append(x, x)
    ref = cache.quantize(x, x)
    got = fmt.unpack_codes(cache.k_codes[0, :n], bits, d)
    exp = fmt.unpack_codes(ref["k_codes"][0], bits, d)
    assert ((got - exp).abs() <= 1).all()
    frac = (got != exp).float().mean().item()
    assert frac <= 2e-3, frac
    torch.testing.assert_close(cache.k_meta[0, :n].float(), ref["k_meta"][0].float(), rtol=2e-3, atol=2e-3)
    # and attention over it through the fused kernel matches the reference path
    q = torch.randn(1, 1, 2 * h, d, device=DEV, dtype=dtype)
    out = fa.flash_attn_with_kvcache(q, cache)
    fused = (bits, bits) in kernel_cases.FUSED_DECODE_BITS
    assert fa.last_path() == "quantized:fused-cuda" if fused else fa.last_path().startswith("quantized:reference")
    ref_out, _, ref_lp, _ = _reference(q, cache, cache.seqlens, False)
    err, err_lp = (out.float().cpu() - ref_out).abs().max().item(), (ref_lp - ref_out).abs().max().item()
    assert err <= 2 * err_lp + torch.finfo(dtype).eps * ref_out.abs().max().item() + 2e-3, (err, err_lp)


def test_varlen_mixed_batch_on_the_fused_kernel():
    """Chunked prefill (60 queries x 4 heads a kv head = 240 rows, 15 CTAs along grid.z) next to
    decode in one flash_attn_varlen_func(kv_cache=) call, against the CPU reference on a copy."""
    cache, _, _ = _make_cache(3, [500, 40, 1000], 2, 128, seed=21, max_seqlen=1400)
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device="cpu"
    )
    n_q, n_kv = [1, 60, 7], [1, 60, 0]
    q = torch.randn(sum(n_q), 8, 128, device=DEV, dtype=torch.float16)
    k = torch.randn(sum(n_kv), 2, 128, device=DEV, dtype=torch.float16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 1, 61, 68], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 1, 61, 61], dtype=torch.int32, device=DEV)
    poison_allocator()
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 60, None, causal=True, kv_cache=cache)
    assert fa.last_path() == "quantized:fused-cuda"
    ref, ref_lse = fa.flash_attn_varlen_func(
        q.cpu().float(), k.cpu().float(), v.cpu().float(), cu_q.cpu(), cu_k.cpu(), 60, None, causal=True, kv_cache=cpu
    )
    assert cache.seqlens.tolist() == cpu.seqlens.tolist() == [501, 100, 1000]
    torch.testing.assert_close(out.float().cpu(), ref, atol=4e-3, rtol=0)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_many_query_rows(dtype):
    """1028 query rows a kv head (5 prefill CTAs of 256 rows along grid.z, the last with 4), causal,
    against float32 attention over the dequantized cache."""
    cache, _, _ = _make_cache(2, [700, 1500], 2, 128, dtype=dtype, seed=17)
    q = torch.randn(2, 257, 8, 128, device=DEV, dtype=dtype)
    poison_allocator()
    assert cache.plan(dispatch.Query.of(q)).kernel.startswith("prefill")
    out, lse = cache.attend(q, cache.seqlens, None, 128**-0.5, True)
    _check_against_reference(q, cache, out, lse, True)
