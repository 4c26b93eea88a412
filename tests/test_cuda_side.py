"""GPU tests of the decode kernel's 16-bit side: the sink tokens and the fp16 window of a
``QuantizedKVCache`` attended by the same launch as its codes (one more split, merged by the combine
kernel; csrc/flash_attn/src/tq_decode_kernel.h), against float32 attention over what the cache holds.

Run on the device: ``python -m pytest tests/test_cuda_side.py -q``.
"""

from __future__ import annotations

import re

import pytest
import torch
from gpu_cases import DEV, NEEDS_GPU, poison_allocator, shuffled_block_table

import flash_attn_tq as fa
from flash_attn_tq import baseline, dispatch, reference
from flash_attn_tq import format as fmt
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.keys import rope_turn

pytestmark = NEEDS_GPU


def _cache(
    batch,
    seqlens,
    kv_heads,
    d,
    *,
    sinks,
    window,
    center=False,
    dtype=torch.float16,
    page_size=None,
    k_bits=3,
    v_bits=3,
    window_bits=16,
    seed=0,
    capacity=None,
    scale_only=None,
    verify_tokens=1,
):
    """A GPU cache filled as a model fills it: a prompt (each row's first 3/4), then token by token,
    so the window's ring wraps; keys with a large constant part before RoPE (as real keys have).
    ``capacity``: tokens a row holds (default: the longest row + 5)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    max_len = capacity or max(seqlens) + 5
    bt = shuffled_block_table(batch, max_len, page_size, seed) if page_size is not None else None
    opts = dict(key_center=center, calib_min_tokens=1)
    if center == "rope":
        opts["rope_inv_freq"] = inv_freq
    cache = QuantizedKVCache(
        batch,
        max_len,
        kv_heads,
        d,
        k_bits=k_bits,
        v_bits=v_bits,
        fp16_window=window,
        window_bits=window_bits,
        verify_tokens=verify_tokens,
        sink_tokens=sinks,
        page_size=page_size,
        block_table=bt,
        dtype=dtype,
        device=DEV,
        seed=seed,
        scale_only=scale_only,
        **opts,
    )
    L = max(seqlens)
    raw = torch.randn(batch, 1, kv_heads, d, device=DEV, generator=gen) * 1.5 + torch.randn(
        batch, L, kv_heads, d, device=DEV, generator=gen
    )
    k = rope_turn(raw, torch.arange(L, device=DEV), inv_freq).to(dtype)
    v = torch.randn(batch, L, kv_heads, d, device=DEV, generator=gen).to(dtype)
    for b, n in enumerate(seqlens):
        idx = torch.tensor([b], dtype=torch.int32, device=DEV)
        prompt = (3 * n) // 4
        if prompt:
            cache.append(k[b : b + 1, :prompt], v[b : b + 1, :prompt], cache_seqlens=0, batch_idx=idx)
        for t in range(prompt, n):
            cache.append(k[b : b + 1, t : t + 1], v[b : b + 1, t : t + 1], batch_idx=idx)
    return cache


def _references(q, cache, rows, causal):
    """float32 attention over cache.dequantize() (sinks and window in 16-bit; each block of a
    multi-token call's rows over the recent tokens it sees in 16 bits, reference.window_blocks), and
    the same with q, K and V rounded to 16 bits where the kernel rounds them: q after turbo's rotation,
    in the codes' domain (key_center=True: the lse gets the shared q . mu back, as the interface adds
    it); with the RoPE center (whose term the kernel adds in float16) before it. Returns (ref, ref_lse,
    lp, lp_lse), the lse's rows along the last dim."""
    scale, dt, Sq = q.shape[-1] ** -0.5, q.dtype, q.shape[1]
    parts = []
    for i0, i1, window in reference.window_blocks(cache, Sq, causal):
        qb, lens = q[:, i0:i1], cache.seqlens[rows] - (Sq - i1)
        kd, vd = cache.dequantize(rows, window=window)
        ref = baseline.attention_reference(qb.float(), kd, vd, causal=causal, key_lengths=lens)
        if cache.rope_center:
            lp = baseline.attention_reference(qb, kd.to(dt), vd.to(dt), causal=causal, key_lengths=lens)
        else:
            kr, vr = cache.dequantize(rows, rotated=True, window=window)
            lp_out, lp_lse = baseline.attention_reference(
                cache.rotate_query(qb.float()).to(dt), kr.to(dt), vr.to(dt), causal=causal, key_lengths=lens
            )
            if cache.key_center:
                lp_lse = lp_lse + scale * cache.query_shift(qb, rows)
            lp = (cache.unrotate_output(lp_out.float()), lp_lse)
        parts.append((*ref, *lp))
    return [torch.cat([p[j] for p in parts], 1 if j % 2 == 0 else 2) for j in range(4)]


def _check(q, cache, out, lse, causal, rows=None):
    """out/lse against float32 attention over what the cache holds (_references), within four times
    what rounding q, K and V to 16 bits costs, plus the RoPE center term's own rounding."""
    rows = torch.arange(q.shape[0], device=DEV) if rows is None else rows.long()
    scale = q.shape[-1] ** -0.5
    ref, ref_lse, lp, lp_lse = _references(q, cache, rows, causal)
    dt = q.dtype
    term = 0.0
    if cache.rope_center:
        term = 2**-11 * scale * q.float().norm(dim=-1).max().item() * cache.k_center.norm(dim=-1).max().item()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err, err_lp = (out.float() - ref).abs().max().item(), (lp.float() - ref).abs().max().item()
    bound = 4 * err_lp + torch.finfo(dt).eps * ref.abs().max().item() + 2e-3 + term
    assert err <= bound, (err, err_lp)
    lse_err, lse_lp = (lse - ref_lse).abs().max().item(), (lp_lse - ref_lse).abs().max().item()
    assert lse_err <= 4 * lse_lp + 1e-3 + term, (lse_err, lse_lp)


SIDE_CASES = [
    # batch, seqlens, q heads, kv heads, sinks, window
    (1, [1], 8, 2, 16, 112),  # one token: a sink, nothing in the codes
    (2, [100, 128], 8, 2, 16, 112),  # below and at sinks + window: the codes hold nothing
    (2, [129, 1000], 32, 8, 16, 112),  # just past, and far past
    (3, [64, 65, 3000], 9, 3, 0, 64),  # window only, ring at, past and wrapped many times
    (2, [700, 17], 16, 1, 5, 0),  # sinks only (odd count: the codes start mid-tile)
    (2, [513, 260], 8, 8, 16, 128),  # MHA, a window of a whole number of tiles
]


@pytest.mark.parametrize("batch,seqlens,hq,hk,sinks,window", SIDE_CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, True, "rope"])
def test_side_decode(batch, seqlens, hq, hk, sinks, window, d, dtype, center):
    cache = _cache(batch, seqlens, hk, d, sinks=sinks, window=window, center=center, dtype=dtype)
    q = torch.randn(batch, 1, hq, d, device=DEV, dtype=dtype)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


def _wide_tiles_case(seqlen_q, num_splits, page_size=None, **opts):
    """head_dim 64 over 1024+ keys a code split: the 64-token warp tiles (tq_decode_launch.h's
    wide_tiles) run, seen by the profiler, and match float32 attention over the cache; lengths whose
    last tile is partial."""
    cache = _cache(2, [1100, 3001], 2, 64, capacity=3030, page_size=page_size, **opts)
    dtype = opts.get("dtype", torch.float16)
    q = torch.randn(2, seqlen_q, 8, 64, device=DEV, dtype=dtype)
    poison_allocator()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True, num_splits=num_splits)
    assert fa.last_path() == "quantized:fused-cuda"
    wide = re.compile(r"PackedKV<\d+, \d+, 64, [^<>]*, 64>")
    assert any(wide.search(e.name) for e in prof.events()), sorted({e.name for e in prof.events()})
    _check(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("sinks,window", [(0, 0), (16, 112)])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
@pytest.mark.parametrize("scale_only", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, "rope"])
@pytest.mark.parametrize("seqlen_q,num_splits", [(1, 1), (2, 2)])
def test_decode_wide_tiles(sinks, window, bits, scale_only, dtype, center, seqlen_q, num_splits):
    """64-token tiles, contiguous caches: with and without a side and the RoPE center, both metadata
    layouts, 3- and 4-bit keys."""
    _wide_tiles_case(
        seqlen_q, num_splits, sinks=sinks, window=window, center=center, dtype=dtype, k_bits=bits[0],
        v_bits=bits[1], scale_only=scale_only,
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("sinks,window", [(0, 0), (16, 112)])
@pytest.mark.parametrize("center", [False, "rope"])
def test_decode_wide_tiles_paged(page_size, sinks, window, center):
    """64-token tiles over pages of a tile or more (a shuffled block table)."""
    _wide_tiles_case(1, 2, page_size=page_size, sinks=sinks, window=window, center=center, scale_only=True)


@pytest.mark.parametrize("seqlen_q", [3, 16, 100, 300])
@pytest.mark.parametrize("center", [False, "rope"])
def test_side_chunk(seqlen_q, center):
    """Chunked prefill over a cache with sinks and a window: query rows see the side by position
    (chunks longer than the window too: their own keys are in the codes and the ring already)."""
    seqlens = [seqlen_q + 40, seqlen_q + 900]
    cache = _cache(2, seqlens, 2, 128, sinks=16, window=112, center=center)
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("seqlen_q", [2, 9, 16, 40, 300])
@pytest.mark.parametrize("center", [False, "rope"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_verify_rows_see_their_own_window(seqlen_q, center, page_size):
    """A side holding verify_tokens - 1 slots past the window (TQCache's default): each row of a causal
    multi-token call reads its own last 112 keys from the side, as a one-token decode at its length
    does (the kernel's own one-token calls), where the side still holds them; earlier rows of a
    longer call read the side's oldest on (float32 over reference.window_blocks' windows). Decode
    rows (the decode kernel's spec path) and chunks (the prefill kernel and the side's rows). Each
    row's query points at its key 110 back, in its own window but older than the call's last row's
    window: a row that read it as codes would be off by the codes' error."""
    seqlens = [seqlen_q + 300, seqlen_q + 1000]
    opts = dict(sinks=16, window=112, center=center, page_size=page_size)
    cache = _cache(2, seqlens, 2, 128, verify_tokens=16, **opts)
    n, ring = cache.seqlens.long(), cache.side_recent
    q = 0.3 * torch.randn(2, seqlen_q, 8, 128, device=DEV)
    for i in range(seqlen_q):
        slot = 16 + (n - (seqlen_q - 1 - i) - 110) % ring
        q[:, i] += 0.25 * cache.k_side[torch.arange(2, device=DEV), slot].float().repeat_interleave(4, dim=1)
    q = q.half()
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)
    for i in range(max(0, seqlen_q - 16), seqlen_q):
        lens = (cache.seqlens - (seqlen_q - 1 - i)).to(torch.int32)
        one = fa.flash_attn_with_kvcache(q[:, i : i + 1], cache, cache_seqlens=lens)
        torch.testing.assert_close(out[:, i], one[:, 0], rtol=0, atol=4e-3)
    if (
        seqlen_q >= 9
    ):  # a side of the window alone: the last row alike, those 3 or more before it read that key as codes
        narrow = _cache(2, seqlens, 2, 128, **opts)
        diff = (fa.flash_attn_with_kvcache(q, narrow, causal=True) - out).abs().amax(dim=(0, 2, 3))
        assert diff[-1] < 4e-3 < diff[max(0, seqlen_q - 16) : seqlen_q - 3].min()


PREFILL_SIDES = [(16, 112), (0, 64), (5, 0)]  # (sinks, window): the default's, a window alone, odd sinks alone


@pytest.mark.parametrize("seqlen_q", [77, 300])
@pytest.mark.parametrize("sinks,window", PREFILL_SIDES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, True, "rope"])
def test_side_prefill_kernel(seqlen_q, sinks, window, d, dtype, center):
    """Chunks of 256+ query rows a kv head: the prefill kernel over the codes between the sinks and the
    ring (with the RoPE center: its table added into the expanded keys), the side as one more launch."""
    seqlens = [seqlen_q + 10, seqlen_q + 1500]
    cache = _cache(2, seqlens, 2, d, sinks=sinks, window=window, center=center, dtype=dtype, seed=seqlen_q)
    q = torch.randn(2, seqlen_q, 8, d, device=DEV, dtype=dtype)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_side_prefill_capacity_and_merge(num_splits):
    """A chunk over a cache whose capacity is 4x its longest row (the RoPE table is written for each
    row's keys only), with rows before the ring (their side CTAs read the sinks alone) and after it;
    the side merged by the prefill kernel (one code split) or by the combine kernel (three)."""
    cache = _cache(2, [700, 450], 2, 128, sinks=16, window=112, center="rope", capacity=2800)
    q = torch.randn(2, 300, 8, 128, device=DEV, dtype=torch.float16)
    poison_allocator()
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("page_size", [32, 256])
@pytest.mark.parametrize("center", [False, "rope"])
def test_side_paged(page_size, center):
    cache = _cache(2, [300, 1111], 2, 64, sinks=16, window=112, center=center, page_size=page_size)
    q = torch.randn(2, 1, 8, 64, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


SPLIT_CASES = [(1, None, 1), (1, None, 3), (1, None, 17), (130, 32, 0), (130, 256, 1), (130, None, 3)]


@pytest.mark.parametrize("seqlen_q,page_size,num_splits", SPLIT_CASES)
def test_side_splits_pages_and_batch_idx(seqlen_q, page_size, num_splits):
    """Forced code splits (the side is one more), pages and cache rows picked by cache_batch_idx, with
    the RoPE center: the decode kernel (one query) and the prefill kernel (130 x 4 rows a kv head)."""
    cache = _cache(4, [50, 2000, 130, 700], 2, 128, sinks=16, window=112, center="rope", page_size=page_size)
    rows = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    q = torch.randn(2, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(
        q, cache, cache_batch_idx=rows, causal=True, num_splits=num_splits, return_softmax_lse=True
    )
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True, rows=rows)


@pytest.mark.parametrize("page_size", [16, 32])
def test_side_paged_batch_idx(page_size):
    """A paged cache with cache_batch_idx: block-table rows and side rows of the picked sequences."""
    cache = _cache(3, [300, 40, 900], 2, 128, sinks=16, window=112, page_size=page_size)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, cache_batch_idx=rows, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True, rows=rows)


@pytest.mark.parametrize(
    "seqlen_q,num_splits,alibi",
    [(1, 0, False), (1, 1, False), (1, 3, False), (130, 0, False), (1, 0, True)],  # decode, prefill, reference
)
@pytest.mark.parametrize("page_size", [None, 32])
def test_cache_batch_idx_past_the_rows_gives_nan_rows(seqlen_q, num_splits, alibi, page_size):
    """A cache_batch_idx entry outside the cache's rows (a GPU tensor, not checked: that would sync)
    gives NaN output rows and lse, never a read past the cache; the other entries come out as with
    valid indices."""
    cache = _cache(3, [300, 40, 900], 2, 128, sinks=16, window=112, center="rope", page_size=page_size)
    q = torch.randn(3, seqlen_q, 8, 128, device=DEV, dtype=torch.float16)
    extra = dict(alibi_slopes=torch.full((8,), 0.01, device=DEV)) if alibi else {}

    def call(rows):
        idx = torch.tensor(rows, dtype=torch.int32, device=DEV)
        return fa.flash_attn_with_kvcache(
            q, cache, cache_batch_idx=idx, causal=True, num_splits=num_splits, return_softmax_lse=True, **extra
        )

    good, good_lse = call([2, 0, 1])
    poison_allocator(value=7.0)  # (finite: the NaN rows must be written)
    out, lse = call([2, 3, -1])
    path = fa.last_path()
    assert path.startswith("quantized:reference") if alibi else path == "quantized:fused-cuda", path
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    assert torch.equal(out[0], good[0]) and torch.equal(lse[0], good_lse[0])


def test_side_with_window_codes():
    """window_bits=4 (the no-16-bit-window setting): the sinks in the kernel's side pass, the 4-bit
    window in its own pass, the codes up to the window."""
    cache = _cache(2, [90, 600], 2, 64, sinks=16, window=64, window_bits=4, center="rope")
    q = torch.randn(2, 5, 8, 64, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


RING_CASES = [
    # batch, seqlens (below, at and past sinks + ring: the ring wraps), kv heads, GQA group, seqlen_q,
    # code splits (0: the heuristic's)
    (3, [40, 80, 600], 2, 4, 1, 0),
    (2, [17, 1500], 1, 3, 1, 0),  # SmolLM2's group; a row that holds the sinks alone
    (2, [90, 700], 2, 4, 5, 0),  # causal chunk of 5: rows see different ring slots
    (1, [3000], 2, 8, 3, 0),  # 24 rows a kv head: two row tiles a CTA
    (2, [1100, 1500], 2, 4, 1, 1),  # one code split of 1024+ keys: 64-token code tiles at head_dim 64
]


@pytest.mark.parametrize("batch,seqlens,hk,group,seqlen_q,splits", RING_CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
@pytest.mark.parametrize("center", [False, "rope"])
def test_ring_of_window_codes_in_the_launch(
    batch, seqlens, hk, group, seqlen_q, splits, d, dtype, bits, center, monkeypatch
):
    """window_bits=4 (NO_FP16_WINDOW's form): the ring of 4-bit window codes attended by the decode
    launch itself (no pass of its own), beside the codes and the sinks' side, against float32 over
    the dequantized cache."""
    monkeypatch.setattr("flash_attn_tq.reference.window_attention", lambda *a: pytest.fail("the ring's own pass ran"))
    cache = _cache(
        batch,
        seqlens,
        hk,
        d,
        sinks=16,
        window=64,
        window_bits=4,
        center=center,
        dtype=dtype,
        k_bits=bits[0],
        v_bits=bits[1],
        seed=len(seqlens) + d,
    )
    q = torch.randn(batch, seqlen_q, hk * group, d, device=DEV, dtype=dtype)
    assert cache.plan(dispatch.Query.of(q)).kernel == "ring"
    poison_allocator()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, num_splits=splits, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("decode_ring_kernel" in k for k in kernels), sorted(set(kernels))
    if splits == 1 and d == 64:  # (wide_tiles in tq_decode_launch.h)
        wide = re.compile(r"decode_ring_kernel<.*PackedKV<\d+, \d+, 64, [^<>]*, 64>")
        assert any(wide.search(k) for k in kernels), sorted(set(kernels))
    _check(q, cache, out, lse, causal=True)
    rows = torch.tensor([batch - 1], dtype=torch.int32, device=DEV)  # a picked row (cache_batch_idx)
    out, lse = fa.flash_attn_with_kvcache(
        q[:1], cache, cache_batch_idx=rows, causal=True, num_splits=splits, return_softmax_lse=True
    )
    _check(q[:1], cache, out, lse, causal=True, rows=rows)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, "rope"])
@pytest.mark.parametrize("scale_only", [True, False])
def test_pack_writes_the_ring_of_window_codes(d, dtype, center, scale_only, monkeypatch):
    """The pack launch's ring of 4-bit window codes (a prompt longer than the ring, then tokens one by
    one, so it wraps) against the PyTorch writes of the same appends: codes equal but within float
    rounding of a bin edge, scales within float16 rounding; the poisoned ring is overwritten."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    opts = dict(sink_tokens=16, fp16_window=64, window_bits=4, key_center=center, calib_min_tokens=1)
    if center == "rope":
        opts["rope_inv_freq"] = inv
    caches = [QuantizedKVCache(2, 400, 2, d, dtype=dtype, device=DEV, scale_only=scale_only, **opts) for _ in range(2)]
    for c in caches:
        c.k_window_codes.fill_(0xAB)
        c.v_window_codes.fill_(0xAB)
    gen = torch.Generator(device=DEV).manual_seed(d)
    chunks = [torch.randn(2, n, 2, d, device=DEV, generator=gen).to(dtype) * 2 for n in (150, 1, 1, 3, 1)]
    for c, kernel in zip(caches, (True, False)):
        with monkeypatch.context() as m:
            if not kernel:
                m.setattr(
                    QuantizedKVCache, "write_plan", lambda self, dtype: dispatch.WritePlan(False, reason="PyTorch")
                )
            for x in chunks:
                c.append(x, x.flip(-1))
    got, ref = caches
    assert torch.equal(got.seqlens, ref.seqlens)
    for name in ("k", "v"):
        a = fmt.unpack_codes(getattr(got, f"{name}_window_codes"), 4, d).int()
        b = fmt.unpack_codes(getattr(ref, f"{name}_window_codes"), 4, d).int()
        assert ((a - b).abs() <= 1).all() and (a != b).float().mean().item() <= 2e-3, name
        torch.testing.assert_close(
            getattr(got, f"{name}_window_meta").float(),
            getattr(ref, f"{name}_window_meta").float(),
            rtol=2e-3,
            atol=1e-4,
        )
    # a decode token's append is the pack launch alone (codes, ring, side copy, RoPE center, lengths)
    x = chunks[-1]
    flags = torch.zeros(1, dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got.append(x, x, error_flags=flags)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and all("pack" in k for k in kernels), kernels
    assert flags.item() == 0 and torch.equal(got.seqlens, ref.seqlens + 1)


def test_side_8bit_head():
    """The calibrated default's copy head (K8V8, float16) with sinks, window and the RoPE center."""
    cache = _cache(2, [200, 1500], 1, 64, sinks=16, window=112, center="rope", k_bits=8, v_bits=8)
    q = torch.randn(2, 1, 3, 64, device=DEV, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    assert fa.last_path() == "quantized:fused-cuda"
    _check(q, cache, out, lse, causal=True)


PAIR_CASES = [
    # batch, seqlens, kv heads of the first group, of the second, where the second sits, GQA group, seqlen_q
    (2, [100, 1500], 2, 1, 2, 3, 1),  # SmolLM2's layout: the copy head last, one row below sinks + window
    (3, [129, 4000, 17], 7, 1, 0, 4, 1),  # the copy head first, 8 kv heads
    (1, [3000], 6, 2, 3, 4, 1),  # two heads in the middle
    (2, [700, 260], 3, 1, 1, 4, 5),  # 20 query rows a kv head: two row tiles a CTA
]


def _pair(batch, seqlens, hk1, hk2, d, dtype, center, bits):
    """Two head groups of one layer: ``bits`` for the first, K8V8 for the second, every other option shared."""
    make = dict(sinks=16, window=112, center=center, dtype=dtype, capacity=max(seqlens) + 9)
    a = _cache(batch, seqlens, hk1, d, k_bits=bits[0], v_bits=bits[1], seed=0, **make)
    b = _cache(batch, seqlens, hk2, d, k_bits=8, v_bits=8, seed=0, **make)
    return a, b


def _layer_heads(hk1, hk2, at, group):
    """The layer's query heads of each group (the second's kv heads [at, at + hk2), the first's the rest)."""
    kv = list(range(hk1 + hk2))
    second = kv[at : at + hk2]
    first = [h for h in kv if h not in second]
    q_heads = lambda hs: [h * group + j for h in hs for j in range(group)]  # noqa: E731
    return torch.tensor(q_heads(first), device=DEV), torch.tensor(q_heads(second), device=DEV)


@pytest.mark.parametrize("batch,seqlens,hk1,hk2,at,group,seqlen_q", PAIR_CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("center", [False, "rope"])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
def test_side_two_head_groups_one_launch(batch, seqlens, hk1, hk2, at, group, seqlen_q, d, dtype, center, bits):
    """Two head groups of other widths (3-bit heads, a K8V8 copy head) attended by one launch: each
    group's query heads get what a launch over its own cache gives with the same splits (bit for
    bit: the same tiles, 64-token ones at head_dim 64 over long splits), and float32 attention over
    what the cache holds."""
    a, b = _pair(batch, seqlens, hk1, hk2, d, dtype, center, bits)
    q = torch.randn(batch, seqlen_q, (hk1 + hk2) * group, d, device=DEV, dtype=dtype)
    assert _pair_reason(a, b, q) is None
    heads_a, heads_b = _layer_heads(hk1, hk2, at, group)
    lens, scale = a.seqlens[:batch], d**-0.5
    for splits in (0, 1, 5):
        poison_allocator()
        out, lse = a.attend(q, lens, None, scale, True, num_splits=splits, with_lse=False, group2=(b, at))
        for cache, heads in ((a, heads_a), (b, heads_b)):
            qg = q[:, :, heads]
            if splits:
                one, one_lse = cache.attend(qg, lens, None, scale, True, num_splits=splits)
                assert torch.equal(out[:, :, heads], one) and torch.equal(lse[:, heads], one_lse)
            else:
                _check(qg, cache, out[:, :, heads], lse[:, heads], causal=True)


@pytest.mark.parametrize("center", [False, "rope"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [(3, 3), (4, 3)])
def test_side_two_head_groups_wide_tiles(center, dtype, bits):
    """head_dim 64 over 1024+ keys a code split: the one launch takes the 3/4-bit group's 64-token
    tiles (seen by the profiler), both groups against float32 attention over their caches."""
    _check_pair_on_wide_tiles(_pair(2, [1100, 3001], 2, 1, 64, dtype, center, bits), 2, 1, 4, num_splits=2)


def _check_pair_on_wide_tiles(pair, hk_a, hk_b, group, num_splits):
    """One launch of the pair (caches a, b: hk_a + hk_b kv heads, b's from kv head 1, head_dim 64) runs
    the 3/4-bit group on 64-token tiles (seen by the profiler); both groups against float32 attention
    over their caches."""
    a, b = pair
    batch = a.batch_size
    q = torch.randn(batch, 1, (hk_a + hk_b) * group, 64, device=DEV, dtype=a.dtype)
    heads_a, heads_b = _layer_heads(hk_a, hk_b, 1, group)
    poison_allocator()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = a.attend(q, a.seqlens[:batch], None, 64**-0.5, True, num_splits=num_splits, group2=(b, 1))
    wide = re.compile(r"decode_pair_kernel<.*PackedKV<\d+, \d+, 64, [^<>]*, 64>")
    assert any(wide.search(e.name) for e in prof.events()), sorted({e.name for e in prof.events()})
    for cache, heads in ((a, heads_a), (b, heads_b)):
        _check(q[:, :, heads], cache, out[:, :, heads], lse[:, heads], causal=True)


def test_side_two_head_groups_wide_tiles_own_splits():
    """The split heuristic's own counts at a serving shape (8 x 16K, 7 + 1 kv heads, d 64): the 3-bit
    group on 64-token tiles with fewer splits than the copy head's (whose extra slots it empties),
    both against float32 attention."""
    lens = [16000, 9001, 16000, 12000, 15999, 16000, 14500, 16000]
    _check_pair_on_wide_tiles(_pair(8, lens, 7, 1, 64, torch.float16, "rope", (3, 3)), 7, 1, 3, num_splits=0)


def _pair_reason(a, b, q):
    """Why one launch cannot attend q over head groups a and b (None: it can)."""
    return a.plan(dispatch.Query.of(q), pair=(b, 0)).reason


def test_side_two_head_groups_reasons():
    """What one launch for two head groups does not take, said by the plan (those calls run a launch a group)."""
    a, b = _pair(2, [300, 40], 2, 1, 64, torch.float16, "rope", (3, 3))
    q = torch.randn(2, 1, 9, 64, device=DEV, dtype=torch.float16)
    assert _pair_reason(a, b, q) is None and a.plan(dispatch.Query.of(q), pair=(b, 0)).kernel == "pair"
    assert "K8V8 beside K3V3" in _pair_reason(b, a, q)
    assert "decode-sized" in _pair_reason(a, b, torch.randn(2, 50, 9, 64, device=DEV, dtype=torch.float16))
    c = _cache(2, [300, 40], 1, 64, sinks=8, window=112, center="rope", k_bits=8, v_bits=8, capacity=309)
    assert "differ in sink_tokens" in _pair_reason(a, c, q)
    no_side = dict(sinks=0, window=0, capacity=309)
    plain = [_cache(2, [300, 40], h, 64, k_bits=kb, v_bits=kb, **no_side) for h, kb in ((2, 3), (1, 8))]
    assert "16-bit side" in _pair_reason(plain[0], plain[1], q)


def test_side_cuda_graph():
    """The decode call (codes, side and combine) captured once and replayed after appends."""
    cache = _cache(2, [500, 300], 2, 128, sinks=16, window=112, center="rope")
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.float16)
    fa.flash_attn_with_kvcache(q, cache, causal=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.flash_attn_with_kvcache(q, cache, causal=True)
    for _ in range(3):
        k = torch.randn(2, 1, 2, 128, device=DEV, dtype=torch.float16)
        cache.append(k, torch.randn_like(k))
        graph.replay()
        want, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        _check(q, cache, out, lse, causal=True)


def test_side_rejects_local_options():
    cache = _cache(1, [300], 2, 64, sinks=16, window=112)
    q = torch.randn(1, 1, 8, 64, device=DEV, dtype=torch.float16)
    fa.flash_attn_with_kvcache(q, cache, causal=True, window_size=(100, 0))
    assert fa.last_path().startswith("quantized:reference (window_size / softcap / cache_leftpad")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("k_bits", [3, 4, 8])
def test_append_books_in_the_pack_kernel(d, dtype, page_size, k_bits):
    """The pack kernel's copy of sinks and recent tokens into kv_side and its k - R(p) c against the
    same steps in PyTorch: the side holds the keys as given, bit for bit; the codes are those of the
    keys centered by transform_keys (both round float64 cosines and sines once; one vector of the
    1740 may differ, should a double-precision sine differ in its last bit across the two). A prompt
    (calibrates the center), a chunk longer than the window, then single tokens, rows in a shuffled
    order, positions offset."""
    gen = torch.Generator(device=DEV).manual_seed(d + k_bits)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    B, H, S, R, L = 3, 2, 16, 112, 290
    bt = shuffled_block_table(B, L, page_size, 1) if page_size is not None else None
    common = dict(k_bits=k_bits, dtype=dtype, device=DEV, page_size=page_size, block_table=bt, seed=3)
    cache = QuantizedKVCache(
        B, L, H, d, sink_tokens=S, fp16_window=R, key_center="rope", rope_inv_freq=inv_freq,
        rope_position_offset=7, calib_min_tokens=1, **common,
    )  # fmt: skip
    plain = QuantizedKVCache(B, L, H, d, **common)  # the codes of keys centered in PyTorch
    raw = torch.randn(B, 1, H, d, device=DEV, generator=gen) * 2 + torch.randn(B, L, H, d, device=DEV, generator=gen)
    k = rope_turn(raw, torch.arange(L, device=DEV) + 7, inv_freq).to(dtype)
    v = torch.randn(B, L, H, d, device=DEV, generator=gen).to(dtype)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    for lo, hi in [(0, 150), (150, 280)] + [(t, t + 1) for t in range(280, L)]:
        cache.append(k[:, lo:hi], v[:, lo:hi], batch_idx=rows)
        pos = torch.arange(lo, hi, device=DEV).expand(B, -1)
        plain.append(cache.transform_keys(k[:, lo:hi], rows, positions=pos), v[:, lo:hi], batch_idx=rows)
    assert torch.equal(cache.seqlens, torch.full((B,), L, dtype=torch.int32, device=DEV))
    got, want = cache.gather(rows), plain.gather(rows)
    assert torch.equal(got["v_codes"], want["v_codes"]) and torch.equal(got["v_meta"], want["v_meta"])
    diff = (got["k_codes"] != want["k_codes"]).any(-1) | (got["k_meta"] != want["k_meta"]).any(-1)
    assert diff.sum().item() <= 1, diff.sum().item()
    recent = torch.arange(L - R, L, device=DEV)
    for name, x in (("k", k), ("v", v)):
        side = getattr(cache, f"{name}_side")[rows.long()]  # [B, S + R, H, d]
        assert torch.equal(side[:, :S], x[:, :S]), name
        assert torch.equal(side[:, S + recent % R], x[:, recent]), name
