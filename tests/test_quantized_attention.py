"""flash_attn_tq.flash_attn_with_kvcache over a QuantizedKVCache (CPU reference path).

Expected outputs come from an independent float64 attention written below (explicit loops over
batch and heads, GQA mapping h -> h // (Hq / Hkv), bottom-right causal mask) over the values the
cache holds (``cache.dequantize()``), and, for the quality checks, over the un-quantized inputs.
"""

import math

import numpy as np
import pytest
import torch

import flash_attn_tq
from flash_attn_tq import QuantizedKVCache, flash_attn_with_kvcache, last_path

INF = float("inf")


# ----------------------------------------------------------------------------- independent reference


def ref_attention(q, k, v, lens, causal=False, scale=None):
    """float64 attention. q [B, Sq, Hq, d]; k, v [B, S, Hkv, d]; lens: keys [0, lens[b]) per row.
    Returns out [B, Sq, Hq, d] and lse [B, Hq, Sq] (+inf, out 0 for rows without keys)."""
    q, k, v = q.double(), k.double(), v.double()
    B, Sq, Hq, d = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), INF, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        for h in range(Hq):
            kh, vh = k[b, :L, h // group], v[b, :L, h // group]
            for i in range(Sq):
                last = L - 1 if not causal else i + L - Sq  # bottom-right aligned diagonal
                n = min(L, last + 1)
                if n <= 0:
                    continue
                s = (kh[:n] @ q[b, i, h]) * scale
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p / p.sum()) @ vh[:n]
                lse[b, h, i] = m + torch.log(p.sum())
    return out, lse


def ref_attention_ext(q, k, v, ends, starts, causal, window, softcap, scale=None):
    """float64 attention with upstream's extras, written independently of ref_attention: keys
    [starts[b], ends[b]) (cache_leftpad) form a sequence against which the causal diagonal and the
    local window (left, right; -1 = unbounded) align bottom-right; softcap: s -> c * tanh(s / c)."""
    q, k, v = q.double(), k.double(), v.double()
    B, Sq, Hq, d = q.shape
    group = Hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), INF, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for b in range(B):
        lo, hi = int(starts[b]), int(ends[b])
        n = hi - lo
        for h in range(Hq):
            for i in range(Sq):
                pos = i + n - Sq  # the query's position among the n keys
                keep = [j for j in range(n) if (right < 0 or j <= pos + right) and (left < 0 or j >= pos - left)]
                if not keep:
                    continue
                idx = torch.tensor(keep) + lo
                s = (k[b, idx, h // group] @ q[b, i, h]) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p / p.sum()) @ v[b, idx, h // group]
                lse[b, h, i] = m + torch.log(p.sum())
    return out, lse


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rotary_ref(x, cos, sin, pos, interleaved):
    """Rotate the first 2 * cos.shape[1] channels of x [B, S, H, d] at positions pos [B, S] (float64)."""
    x = x.double().clone()
    half = cos.shape[1]
    c = cos.double()[pos]  # [B, S, half]
    s = sin.double()[pos]
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        ci, si = c[..., i].unsqueeze(-1), s[..., i].unsqueeze(-1)
        out[..., a] = x[..., a] * ci - x[..., b] * si
        out[..., b] = x[..., a] * si + x[..., b] * ci
    return out


def fill_rows(cache, lengths, gen, dtype=torch.float16):
    """Write lengths[b] random tokens into row b (one append per row)."""
    H, d = cache.num_kv_heads, cache.head_dim
    for b, n in enumerate(lengths):
        if n:
            k = torch.randn(1, n, H, d, generator=gen).to(dtype)
            v = torch.randn(1, n, H, d, generator=gen).to(dtype)
            cache.append(k, v, batch_idx=torch.tensor([b]))


# ----------------------------------------------------------------------------- main comparison

HEADS = {"mha": (3, 3), "gqa": (6, 2), "mqa": (4, 1)}
CASES = [
    # quantizer, (kb, vb), d, heads, L
    ("turbo", (3, 3), 128, "gqa", 129),
    ("turbo", (3, 3), 64, "mha", 7),
    ("turbo", (3, 3), 64, "mqa", 63),
    ("turbo", (3, 3), 128, "mha", 1),
    ("turbo", (4, 3), 128, "mqa", 7),
    ("turbo", (4, 3), 64, "gqa", 63),
    ("turbo", (4, 3), 64, "mha", 129),
    ("turbo", (4, 3), 128, "gqa", 1),
    ("asym", (3, 3), 64, "gqa", 7),
    ("asym", (3, 3), 128, "mqa", 129),
    ("asym", (3, 3), 64, "mha", 63),
    ("asym", (3, 3), 128, "gqa", 1),
    ("asym", (4, 3), 128, "mha", 63),
    ("asym", (4, 3), 64, "mqa", 129),
    ("asym", (4, 3), 64, "gqa", 7),
    ("asym", (4, 3), 128, "mqa", 1),
]


@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True), (3, False)])
@pytest.mark.parametrize("quantizer,bits,d,heads,L", CASES)
def test_matches_float64_reference(quantizer, bits, d, heads, L, seqlen_q, causal):
    Hq, Hkv = HEADS[heads]
    B = 3
    seqlen_q = min(seqlen_q, L)
    gen = torch.Generator().manual_seed(L * 1000 + d + Hq * 10 + seqlen_q + 7 * causal)
    cache = QuantizedKVCache(B, L + 5, Hkv, d, k_bits=bits[0], v_bits=bits[1], quantizer=quantizer)
    ctx = [L - seqlen_q, (L - seqlen_q) // 2, max(0, L - seqlen_q - 3)]  # per-sequence lengths
    fill_rows(cache, ctx, gen)
    q = torch.randn(B, seqlen_q, Hq, d, generator=gen) * 1.5
    k = torch.randn(B, seqlen_q, Hkv, d, generator=gen).half().float()  # float16 values, in q's dtype
    v = torch.randn(B, seqlen_q, Hkv, d, generator=gen).half().float()
    out, lse = flash_attn_with_kvcache(
        q, cache, k=k, v=v, cache_seqlens=torch.tensor(ctx, dtype=torch.int32), causal=causal, return_softmax_lse=True
    )
    assert last_path().startswith("quantized:reference")
    lens = [c + seqlen_q for c in ctx]
    assert cache.seqlens.tolist() == lens
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (B, Hq, seqlen_q) and lse.dtype == torch.float32
    kd, vd = cache.dequantize()
    exp_out, exp_lse = ref_attention(q, kd, vd, lens, causal)
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-5, atol=1e-5)
    # the new tokens really were quantized into the cache at cache_seqlens
    for b in range(B):
        rel = (kd[b, ctx[b] : lens[b]] - k[b].float()).norm() / k[b].float().norm()
        assert 0.001 < rel < 0.25


@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
def test_fp16_query_and_custom_scale(quantizer):
    gen = torch.Generator().manual_seed(3)
    cache = QuantizedKVCache(2, 40, 2, 64, quantizer=quantizer, k_bits=4)
    fill_rows(cache, [31, 17], gen)
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    out = flash_attn_with_kvcache(q, cache, softmax_scale=0.3)
    assert out.dtype == torch.float16
    kd, vd = cache.dequantize()
    exp, _ = ref_attention(q, kd, vd, [31, 17], scale=0.3)
    torch.testing.assert_close(out.double(), exp, rtol=2e-3, atol=2e-3)
    default = flash_attn_with_kvcache(q, cache)
    assert (default.float() - out.float()).abs().max() > 1e-2  # the scale really was used
    # bfloat16 query
    out_bf = flash_attn_with_kvcache(q.bfloat16(), kv_cache=cache, softmax_scale=0.3)
    assert out_bf.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf.double(), exp, rtol=1e-2, atol=1e-2)


def test_rows_without_keys_give_zero_and_inf_lse():
    gen = torch.Generator().manual_seed(4)
    cache = QuantizedKVCache(2, 16, 1, 64, quantizer="asym")
    fill_rows(cache, [3, 6], gen)
    q = torch.randn(2, 5, 2, 64, generator=gen)
    out, lse = flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    kd, vd = cache.dequantize()
    exp_out, exp_lse = ref_attention(q, kd, vd, [3, 6], causal=True)
    # row 0 has 3 keys for 5 query rows: rows 0 and 1 see nothing
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.isinf(lse[0, :, :2]).all() and (lse[0, :, :2] > 0).all()
    assert torch.isfinite(lse[0, :, 2:]).all() and torch.isfinite(lse[1]).all()
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-5, atol=1e-5)


def test_empty_cache_row_no_new_tokens():
    cache = QuantizedKVCache(2, 16, 1, 64)
    fill_rows(cache, [0, 4], torch.Generator().manual_seed(0))
    q = torch.randn(2, 1, 1, 64)
    out, lse = flash_attn_with_kvcache(q, cache, return_softmax_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0


# ----------------------------------------------------------------------------- batch idx / paged


@pytest.mark.parametrize("layout", ["contiguous", "paged16-shuffled", "paged32", "paged64", "paged128", "paged256"])
@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
def test_cache_batch_idx_and_paged(layout, quantizer):
    gen = torch.Generator().manual_seed(len(layout) + 13 * (quantizer == "asym"))
    CB, S, Hkv, d = 5, 70, 2, 64
    kw = dict(quantizer=quantizer, k_bits=4, v_bits=3)
    if layout == "contiguous":
        cache = QuantizedKVCache(CB, S, Hkv, d, **kw)
    elif layout.startswith("paged") and not layout.endswith("shuffled"):  # paged32 ... paged256
        cache = QuantizedKVCache(CB, S, Hkv, d, page_size=int(layout[5:]), **kw)
    else:
        per = math.ceil(S / 16)
        bt = torch.randperm(CB * per + 4, generator=gen)[: CB * per].reshape(CB, per).int()
        cache = QuantizedKVCache(CB, S, Hkv, d, page_size=16, block_table=bt, **kw)
    ctx = [11, 0, 47, 5, 29]
    fill_rows(cache, ctx, gen)
    bidx = torch.tensor([4, 0, 2], dtype=torch.int32)
    q = torch.randn(3, 2, 6, d, generator=gen)
    k = torch.randn(3, 2, Hkv, d, generator=gen)
    v = torch.randn(3, 2, Hkv, d, generator=gen)
    out, lse = flash_attn_with_kvcache(q, cache, k=k, v=v, cache_batch_idx=bidx, causal=True, return_softmax_lse=True)
    assert cache.seqlens.tolist() == [13, 0, 49, 5, 31]  # default cache_seqlens = the cache's own
    kd, vd = cache.dequantize(bidx)
    exp_out, exp_lse = ref_attention(q, kd, vd, [31, 13, 49], causal=True)
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-5, atol=1e-5)
    # the rows that were not selected are untouched
    kd_all, _ = cache.dequantize()
    assert torch.equal(kd_all[1, :1], torch.zeros_like(kd_all[1, :1]))
    # a paged cache gives the same answer as a contiguous one with the same data
    if layout != "contiguous":
        ref_cache = QuantizedKVCache(CB, S, Hkv, d, **kw)
        g2 = torch.Generator().manual_seed(len(layout) + 13 * (quantizer == "asym"))
        if layout == "paged16-shuffled":
            torch.randperm(CB * math.ceil(S / 16) + 4, generator=g2)
        fill_rows(ref_cache, ctx, g2)
        out2 = flash_attn_with_kvcache(q, ref_cache, k=k, v=v, cache_batch_idx=bidx, causal=True)
        assert torch.equal(out, out2)


def test_block_table_same_object_is_accepted():
    cache = QuantizedKVCache(2, 32, 1, 64, page_size=16)
    fill_rows(cache, [5, 9], torch.Generator().manual_seed(1))
    q = torch.randn(2, 1, 2, 64)
    a = flash_attn_with_kvcache(q, cache, block_table=cache.block_table)
    b = flash_attn_with_kvcache(q, cache)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- fp16 window


@pytest.mark.parametrize("quantizer,window_bits", [("turbo", 16), ("asym", 16), ("turbo", 4), ("asym", 4)])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (4, True)])
def test_fp16_window(quantizer, window_bits, seqlen_q, causal):
    R = 8
    gen = torch.Generator().manual_seed(seqlen_q * 3 + causal)
    cache = QuantizedKVCache(3, 60, 2, 128, quantizer=quantizer, fp16_window=R, window_bits=window_bits)
    ctx = [40, 2, 11]
    fill_rows(cache, ctx, gen)
    q = torch.randn(3, seqlen_q, 4, 128, generator=gen)
    k = torch.randn(3, seqlen_q, 2, 128, generator=gen).half().float()  # float16 values, in q's dtype
    v = torch.randn(3, seqlen_q, 2, 128, generator=gen).half().float()
    out, lse = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=causal, return_softmax_lse=True)
    lens = [c + seqlen_q for c in ctx]
    kd, vd = cache.dequantize()
    exp_out, exp_lse = ref_attention(q, kd, vd, lens, causal)
    torch.testing.assert_close(out.double(), exp_out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(lse.double(), exp_lse, rtol=1e-5, atol=1e-5)
    # the window tokens are attended in full precision (their exact values) or as window_bits codes
    if window_bits == 16:
        torch.testing.assert_close(kd[:, ctx[0] : lens[0]][0], k[0].float(), rtol=0, atol=3e-5)
    else:
        codes, meta = cache.window_quantizer.quantize(k[0].float())
        kw = cache.window_quantizer.dequantize(codes, meta[..., : cache.k_meta.shape[-1]])
        torch.testing.assert_close(kd[0, ctx[0] : lens[0]], kw, rtol=0, atol=3e-5)
        assert (kw - k[0].float()).abs().max() > 1e-3
    # without the window the answer differs
    kq, vq = cache.dequantize(use_window=False)
    no_win, _ = ref_attention(q, kq, vq, lens, causal)
    assert (no_win - exp_out).abs().max() > 1e-3


@pytest.mark.parametrize("verify_tokens", [1, 4, 16])
def test_verify_rows_see_their_own_window(verify_tokens):
    """A side holding verify_tokens - 1 slots past the window: row i of a causal 6-token call sees the
    sinks and its own last R keys (where the side still holds them) in 16 bits and every older key
    as codes, as a one-token decode at its length would; verify_tokens=1: the call's last R keys."""
    R, S, Sq = 8, 2, 6
    gen = torch.Generator().manual_seed(verify_tokens)
    cache = QuantizedKVCache(2, 80, 2, 64, fp16_window=R, sink_tokens=S, verify_tokens=verify_tokens)
    assert cache.side_recent == R + verify_tokens - 1
    fill_rows(cache, [40, 57], gen)
    q = torch.randn(2, Sq, 4, 64, generator=gen)
    k = torch.randn(2, Sq, 2, 64, generator=gen).half().float()
    v = torch.randn(2, Sq, 2, 64, generator=gen).half().float()
    out = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True)
    n = cache.seqlens.long()
    codes = cache.dequantize(use_window=False)
    sinks = cache.dequantize(window=0)  # (the sinks from the side, every other key from the codes)
    side = cache.dequantize(window=cache.side_recent)
    pos = torch.arange(80)[None, :, None, None]
    for i in range(Sq):
        end = (n - (Sq - 1 - i))[:, None, None, None]
        start = torch.maximum(end - R, n[:, None, None, None] - cache.side_recent)
        recent = (pos >= start) & (pos < end)
        kv = [torch.where(recent, x, torch.where(pos < S, s, c)) for x, s, c in zip(side, sinks, codes)]
        want, _ = ref_attention(q[:, i : i + 1], *kv, end.flatten())
        torch.testing.assert_close(out[:, i : i + 1].double(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (5, True), (5, False)])
@pytest.mark.parametrize("batch_idx", [None, [2, 0]])
@pytest.mark.parametrize("window_bits", [16, 4])
def test_window_part_of_the_fused_path(seqlen_q, causal, batch_idx, window_bits):
    """The window attention the fused GPU path merges with the kernel's output (cache.window_attention),
    against float64 attention over the window's tokens: causal queries must not see newer window keys,
    rows shorter than the window only their own tokens."""
    from flash_attn_tq.reference import window_attention

    R = 8
    gen = torch.Generator().manual_seed(seqlen_q + 2 * causal)
    cache = QuantizedKVCache(3, 60, 2, 64, fp16_window=R, window_bits=window_bits)
    fill_rows(cache, [40, 3, 11], gen)
    bidx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32)
    rows = [0, 1] if batch_idx is None else batch_idx
    q = torch.randn(len(rows), seqlen_q, 4, 64, generator=gen)
    lens = cache.seqlens[rows]
    out, lse = window_attention(q, cache, bidx, lens, 0.125, causal)
    lse = lse.masked_fill(lse == -INF, INF)  # (internal parts mark a row without keys -inf, the API +inf)
    kd, vd = cache.dequantize(torch.tensor(rows))  # window tokens as stored (exact, or window_bits codes)
    for i, (row, n) in enumerate(zip(rows, lens.tolist())):
        lo = max(0, n - R)
        kw, vw = kd[i : i + 1, lo:n], vd[i : i + 1, lo:n]
        exp_out, exp_lse = ref_attention(q[i : i + 1], kw, vw, [n - lo], causal, scale=0.125)
        torch.testing.assert_close(out[i : i + 1].double(), exp_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[i : i + 1].double(), exp_lse, rtol=1e-5, atol=1e-6)


def test_fp16_window_covering_everything_is_full_precision():
    R = 16
    gen = torch.Generator().manual_seed(5)
    cache = QuantizedKVCache(2, 40, 1, 64, fp16_window=R)
    k = torch.randn(2, 13, 1, 64, generator=gen).half().float()  # float16 values, in q's dtype
    v = torch.randn(2, 13, 1, 64, generator=gen).half().float()
    q = torch.randn(2, 13, 3, 64, generator=gen)
    out = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True)
    exp, _ = ref_attention(q, k, v, [13, 13], causal=True)
    torch.testing.assert_close(out.double(), exp, rtol=1e-4, atol=3e-5)


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("quantizer,rot_dim", [("turbo", 64), ("asym", 32)])
def test_rotary_equals_prerotated(interleaved, causal, quantizer, rot_dim):
    gen = torch.Generator().manual_seed(2 * interleaved + causal + rot_dim)
    B, Sq, Hq, Hkv, d = 2, 3, 4, 2, 64
    ctx = [9, 4]
    caches = [QuantizedKVCache(B, 32, Hkv, d, quantizer=quantizer, k_bits=4) for _ in range(2)]
    st = gen.get_state()
    fill_rows(caches[0], ctx, gen)
    gen.set_state(st)
    fill_rows(caches[1], ctx, gen)
    seqlen_ro = 40
    angles = torch.rand(seqlen_ro, rot_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().float(), angles.sin().float()
    q = torch.randn(B, Sq, Hq, d, generator=gen)
    k = torch.randn(B, Sq, Hkv, d, generator=gen)
    v = torch.randn(B, Sq, Hkv, d, generator=gen)
    start = torch.tensor(ctx, dtype=torch.int32)
    out_a, lse_a = flash_attn_with_kvcache(
        q,
        caches[0],
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=start,
        causal=causal,
        rotary_interleaved=interleaved,
        return_softmax_lse=True,
    )
    kpos = start.long()[:, None] + torch.arange(Sq)
    qpos = kpos if causal else start.long()[:, None].expand(B, Sq)
    q_r = rotary_ref(q, cos, sin, qpos, interleaved).float()
    k_r = rotary_ref(k, cos, sin, kpos, interleaved).float()
    assert torch.equal(q_r[..., rot_dim:], q[..., rot_dim:])  # channels beyond rotary_dim untouched
    out_b, lse_b = flash_attn_with_kvcache(
        q_r, caches[1], k=k_r, v=v, cache_seqlens=start, causal=causal, return_softmax_lse=True
    )
    torch.testing.assert_close(out_a, out_b, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse_a, lse_b, rtol=1e-4, atol=1e-4)
    ka, _ = caches[0].dequantize()
    kb, _ = caches[1].dequantize()
    close = torch.isclose(ka, kb, rtol=1e-4, atol=1e-5)
    assert close.float().mean() > 0.999  # codes may differ only at exact-tie roundoff
    # and rotary really did something
    out_plain = flash_attn_with_kvcache(
        q, QuantizedKVCache(B, 32, Hkv, d, quantizer=quantizer, k_bits=4), k=k, v=v, causal=causal
    )
    assert not torch.allclose(out_plain[0, :, :], out_a[0, :, :], atol=1e-3)


@pytest.mark.parametrize("window", [(-1, -1), (8, 0), (16, 4), (0, 0)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("leftpad", [False, True])
def test_local_window_softcap_leftpad(window, causal, softcap, leftpad):
    """Upstream's window_size / softcap / cache_leftpad semantics over a quantized cache, against an
    independent float64 implementation over the values the cache holds."""
    gen = torch.Generator().manual_seed(
        seed := 1000 + 17 * window[0] + 5 * window[1] + int(causal) * 3 + int(softcap) + int(leftpad) * 7
    )
    cache = QuantizedKVCache(3, 80, 2, 64, seed=seed)
    lengths = [70, 33, 80]
    fill_rows(cache, lengths, gen)
    q = torch.randn(3, 5, 4, 64, generator=gen).to(torch.float16)
    starts = torch.tensor([3, 0, 11], dtype=torch.int32) if leftpad else torch.zeros(3, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        cache,
        causal=causal,
        window_size=window,
        softcap=softcap,
        cache_leftpad=starts if leftpad else None,
        return_softmax_lse=True,
    )
    kd, vd = cache.dequantize()
    ref, ref_lse = ref_attention_ext(q, kd, vd, cache.seqlens, starts, causal, window, softcap)
    assert rel_err(out, ref) < 2e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3


def test_rotary_needs_k():
    cache = QuantizedKVCache(1, 8, 1, 64)
    cos = torch.ones(8, 16)
    with pytest.raises(ValueError, match="rotary"):
        flash_attn_with_kvcache(torch.randn(1, 1, 1, 64), cache, rotary_cos=cos, rotary_sin=cos)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin"):
        flash_attn_with_kvcache(torch.randn(1, 1, 1, 64), cache, rotary_cos=cos)


# ----------------------------------------------------------------------------- paths


def test_last_path():
    cache = QuantizedKVCache(1, 8, 1, 64)
    q = torch.randn(1, 1, 2, 64)
    flash_attn_with_kvcache(q, cache, k=torch.randn(1, 1, 1, 64), v=torch.randn(1, 1, 1, 64))
    assert last_path().startswith("quantized:reference")
    kc, vc = torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64)
    flash_attn_with_kvcache(q, kc, vc, k=torch.randn(1, 1, 1, 64), v=torch.randn(1, 1, 1, 64), cache_seqlens=0)
    assert last_path() == "baseline:torch"
    flash_attn_with_kvcache(q, kv_cache=cache)
    assert last_path().startswith("quantized:reference")
    assert flash_attn_tq.last_path is last_path


def test_plain_cache_baseline_matches_reference():
    """The same API with a plain float tensor cache still attends over the raw values."""
    gen = torch.Generator().manual_seed(9)
    kc = torch.zeros(2, 20, 2, 64)
    vc = torch.zeros(2, 20, 2, 64)
    k = torch.randn(2, 7, 2, 64, generator=gen)
    v = torch.randn(2, 7, 2, 64, generator=gen)
    q = torch.randn(2, 7, 4, 64, generator=gen)
    out = flash_attn_with_kvcache(
        q, kc, vc, k=k, v=v, cache_seqlens=torch.tensor([3, 0], dtype=torch.int32), causal=True
    )
    assert torch.equal(kc[0, 3:10], k[0]) and torch.equal(kc[1, :7], k[1])
    exp, _ = ref_attention(q, kc, vc, [10, 7], causal=True)
    torch.testing.assert_close(out.double(), exp, rtol=1e-4, atol=2e-5)


# ----------------------------------------------------------------------------- errors


def test_errors():
    cache = QuantizedKVCache(2, 8, 2, 64)
    q = torch.randn(2, 1, 4, 64)
    kv = torch.randn(2, 1, 2, 64)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_with_kvcache(torch.randn(2, 1, 4, 128), cache)
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_with_kvcache(torch.randn(2, 1, 3, 64), cache)
    with pytest.raises(ValueError, match="v_cache"):
        flash_attn_with_kvcache(q, cache, torch.zeros(2, 8, 2, 64))
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, cache, block_table=torch.zeros(2, 1, dtype=torch.int32))
    paged = QuantizedKVCache(2, 32, 2, 64, page_size=16)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, paged, block_table=paged.block_table.clone())
    with pytest.raises(ValueError, match="together"):
        flash_attn_with_kvcache(q, cache, k=kv)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, cache, k=kv, v=kv, cache_seqlens=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, cache, cache_batch_idx=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch"):
        flash_attn_with_kvcache(torch.randn(3, 1, 4, 64), cache)
    with pytest.raises(ValueError, match="4-D"):
        flash_attn_with_kvcache(torch.randn(2, 4, 64), cache)
    with pytest.raises(TypeError, match="q must be"):
        flash_attn_with_kvcache(q.double(), cache)
    with pytest.raises(ValueError, match="v_cache is required"):
        flash_attn_with_kvcache(q, torch.zeros(2, 8, 2, 64))
    with pytest.raises(ValueError, match="k_cache is required"):
        flash_attn_with_kvcache(q)
    assert cache.seqlens.tolist() == [0, 0]
    # overflow through the append of the API call
    flash_attn_with_kvcache(q, cache, k=torch.randn(2, 7, 2, 64), v=torch.randn(2, 7, 2, 64))
    with pytest.raises(ValueError, match="overflow"):
        flash_attn_with_kvcache(q, cache, k=torch.randn(2, 2, 2, 64), v=torch.randn(2, 2, 2, 64))
    assert cache.seqlens.tolist() == [7, 7]
    with pytest.raises(ValueError, match="overflow"):
        flash_attn_with_kvcache(q, cache, k=kv, v=kv, cache_seqlens=8)
    with pytest.raises(ValueError, match="NaN"):
        flash_attn_with_kvcache(q, cache, k=kv * float("nan"), v=kv)


def _filled_cache(**options):
    cache = QuantizedKVCache(2, 16, 2, 64, **options)
    cache.append(torch.randn(2, 5, 2, 64), torch.randn(2, 5, 2, 64))
    return cache


I32 = dict(dtype=torch.int32)


def _new_kv(batch, rotary=None):
    """New k / v of ``batch`` rows for a 2 x 64 cache (and rotary tables of ``rotary`` = (positions, pairs))."""
    kv = dict(k=torch.randn(batch, 1, 2, 64), v=torch.randn(batch, 1, 2, 64))
    return kv if rotary is None else dict(kv, rotary_cos=torch.ones(*rotary), rotary_sin=torch.ones(*rotary))


BAD_KVCACHE_CALLS = {  # keyword arguments of flash_attn_with_kvcache(q, cache, ...): (error, what it names)
    "k batch below q's": (_new_kv(1), ValueError, "k must be"),
    "k batch above q's": (_new_kv(3), ValueError, "k must be"),
    "cache_seqlens beyond the capacity": (dict(cache_seqlens=100), ValueError, "overflow"),
    "negative cache_seqlens": (dict(cache_seqlens=torch.tensor([-3, 2], **I32)), ValueError, "cache_seqlens"),
    "float cache_seqlens": (dict(cache_seqlens=3.0), TypeError, "cache_seqlens"),
    "negative cache_batch_idx": (dict(cache_batch_idx=torch.tensor([-1, 0], **I32)), ValueError, "cache_batch_idx"),
    "cache_batch_idx past the rows": (dict(cache_batch_idx=torch.tensor([0, 5], **I32)), ValueError, "cache_batch_idx"),
    "repeated cache_batch_idx with new k": (
        dict(_new_kv(2), cache_batch_idx=torch.tensor([0, 0], **I32)),
        ValueError,
        "cache_batch_idx",
    ),
    "int64 cache_leftpad": (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_leftpad"),
    "cache_leftpad of another batch": (dict(cache_leftpad=torch.zeros(3, **I32)), ValueError, "cache_leftpad"),
    "cache_leftpad past the keys": (dict(cache_leftpad=torch.tensor([9, 0], **I32)), ValueError, "cache_leftpad"),
    "negative softcap": (dict(softcap=-1.0), ValueError, "softcap"),
    "NaN softcap": (dict(softcap=float("nan")), ValueError, "softcap"),
    "infinite softmax_scale": (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    "window_size of three": (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
    "window_size None": (dict(window_size=None), ValueError, "window_size"),
    "alibi_slopes of the wrong shape": (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    "alibi_slopes with NaN": (dict(alibi_slopes=torch.full((4,), float("nan"))), ValueError, "alibi_slopes"),
    "rotary_cos wider than the head": (_new_kv(2, rotary=(32, 40)), ValueError, "rotary"),
    "rotary_cos too short": (_new_kv(2, rotary=(4, 32)), ValueError, "rotary_cos has 4 positions"),
    "k_cache beside kv_cache": (dict(k_cache=torch.zeros(2, 16, 2, 64), kv_cache="self"), ValueError, "k_cache"),
    # upstream's rule: new k and v have q's dtype (q is float32 here)
    "k of another dtype than q": (
        dict(k=torch.randn(2, 1, 2, 64).half(), v=torch.randn(2, 1, 2, 64)),
        TypeError,
        r"k must have the same dtype as q \(torch.float32\), got torch.float16",
    ),
    "v of another dtype than q": (
        dict(k=torch.randn(2, 1, 2, 64), v=torch.randn(2, 1, 2, 64).bfloat16()),
        TypeError,
        r"v must have the same dtype as q \(torch.float32\), got torch.bfloat16",
    ),
    "k and v of another dtype than q, through kv_cache=": (
        dict(k=torch.randn(2, 1, 2, 64).half(), v=torch.randn(2, 1, 2, 64).half(), kv_cache="self"),
        TypeError,
        "k must have the same dtype as q",
    ),
}


@pytest.mark.parametrize("case", list(BAD_KVCACHE_CALLS))
def test_bad_arguments_name_themselves_and_leave_the_cache(case):
    """Each bad argument raises an error that names it, before the cache changes."""
    kwargs, error, name = BAD_KVCACHE_CALLS[case]
    cache = _filled_cache()
    kwargs = {key: cache if val == "self" else val for key, val in kwargs.items()}
    before = {key: getattr(cache, key).clone() for key in ("seqlens", "k_codes", "v_codes", "k_meta")}
    q = torch.randn(2, 1, 4, 64)
    with pytest.raises(error, match=name):
        if "kv_cache" in kwargs:
            flash_attn_with_kvcache(q, **kwargs)
        else:
            flash_attn_with_kvcache(q, cache, **kwargs)
    assert all(torch.equal(getattr(cache, key), val) for key, val in before.items())


def test_argument_types_beyond_the_call():
    """kv_cache of another type, numpy integers as lengths, and the cache's own entry points."""
    cache = _filled_cache(key_center=True)
    q = torch.randn(2, 1, 4, 64)
    with pytest.raises(TypeError, match="kv_cache"):
        flash_attn_with_kvcache(q, kv_cache=torch.zeros(2, 16, 2, 64))
    out = flash_attn_with_kvcache(q, cache, cache_seqlens=np.int64(5))  # a numpy integer is an int
    assert torch.allclose(out, flash_attn_with_kvcache(q, cache, cache_seqlens=5))
    with pytest.raises(TypeError, match="batch_idx"):
        cache.append(torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64), batch_idx=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="batch_idx"):
        cache.append(torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64), batch_idx=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="float16's range"):
        cache.append(torch.full((2, 1, 2, 64), 1.5e5), torch.randn(2, 1, 2, 64))
    fresh = QuantizedKVCache(2, 16, 2, 64, key_center=True)
    with pytest.raises(ValueError, match="NaN"):  # a NaN center would poison every later score
        fresh.calibrate(torch.full((2, 20, 2, 64), float("nan")))
    with pytest.raises(ValueError, match="batch_idx"):
        fresh.calibrate(torch.randn(1, 20, 2, 64), batch_idx=torch.tensor([7]))
    assert cache.seqlens.tolist() == [5, 5] and not fresh.calibrated.any()
    for name, val in (
        ("batch_size", 1.5),
        ("k_bits", 3.0),
        ("head_dim", 64.0),
        ("page_size", "16"),
        ("sink_tokens", 2.7),
    ):
        with pytest.raises(TypeError, match=name):  # (not truncated silently)
            QuantizedKVCache(**dict(dict(batch_size=2, max_seqlen=16, num_kv_heads=2, head_dim=64), **{name: val}))
    for kwargs, error, name in (
        (dict(scale_only="yes"), TypeError, "scale_only"),
        (dict(calib_min_tokens=-1), ValueError, "calib_min_tokens"),
        (dict(key_center="rope", rope_inv_freq=torch.ones(2, 16)), ValueError, "rope_inv_freq"),  # (not flattened)
    ):
        with pytest.raises(error, match=name):
            QuantizedKVCache(2, 16, 2, 64, **kwargs)


def test_varlen_bad_arguments_leave_the_cache():
    cache = _filled_cache()
    cu = torch.tensor([0, 1, 2], **I32)
    kv = torch.randn(2, 2, 64)
    varlen = flash_attn_tq.flash_attn_varlen_func
    for kwargs, error, name in (
        (dict(cu_seqlens_k=torch.tensor([0, 2, 1], **I32)), ValueError, "cu_seqlens_k"),
        (dict(q=torch.randn(2, 4, 32)), ValueError, "head_dim"),
        (dict(q=torch.randn(2, 4, 64).double()), TypeError, "q must be"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
        (dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q"),
        (dict(max_seqlen_q=None), TypeError, "max_seqlen_q"),
        (dict(k=kv.half(), v=kv.half()), TypeError, "k must have the same dtype as q"),
        (dict(v=kv.bfloat16()), TypeError, "v must have the same dtype as q"),
        (dict(q=torch.randn(2, 4, 64).half()), TypeError, "k must have the same dtype as q"),
    ):
        call = dict(q=torch.randn(2, 4, 64), k=kv, v=kv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1)
        call.update(kwargs)
        with pytest.raises(error, match=name):
            varlen(
                call.pop("q"),
                call.pop("k"),
                call.pop("v"),
                call.pop("cu_seqlens_q"),
                call.pop("cu_seqlens_k"),
                call.pop("max_seqlen_q"),
                None,
                kv_cache=cache,
                **call,
            )
        assert cache.seqlens.tolist() == [5, 5]


def test_new_kv_dtypes_follow_upstreams_rule():
    """Upstream refuses k / v whose dtype is not q's (and k's and v's apart): so do QuantizedKVCache.append
    (k and v alike), the CPU cache and the baseline paths, each with a TypeError naming the argument,
    before anything is written. Matching dtypes go through."""
    from flash_attn_tq.cpu import CpuQuantizedKVCache

    cache = _filled_cache()
    before = {key: getattr(cache, key).clone() for key in ("seqlens", "k_codes", "v_codes", "k_meta", "v_meta")}
    k16, v16 = torch.randn(2, 3, 2, 64).half(), torch.randn(2, 3, 2, 64).half()
    with pytest.raises(TypeError, match=r"v must have the same dtype as k \(torch.float16\), got torch.bfloat16"):
        cache.append(k16, v16.bfloat16())
    with pytest.raises(TypeError, match="v must have the same dtype as k"):
        cache.append(k16.float(), v16)
    assert all(torch.equal(getattr(cache, key), val) for key, val in before.items())
    q16 = torch.randn(2, 1, 4, 64).half()
    out = flash_attn_with_kvcache(q16, cache, k=k16, v=v16)  # all float16: fine
    assert out.dtype == torch.float16 and cache.seqlens.tolist() == [8, 8]

    cpu_cache = CpuQuantizedKVCache(2, 16, 2, 64)
    with pytest.raises(TypeError, match="v must have the same dtype as k"):
        cpu_cache.append(k16, v16.float())
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        flash_attn_with_kvcache(q16.float(), cpu_cache, k=k16, v=v16)
    with pytest.raises(TypeError, match="v must have the same dtype as q"):
        flash_attn_with_kvcache(q16, cpu_cache, k=k16, v=v16.bfloat16())
    assert cpu_cache.seqlens.tolist() == [0, 0]
    flash_attn_with_kvcache(q16, cpu_cache, k=k16, v=v16)
    assert cpu_cache.seqlens.tolist() == [3, 3]

    # the baseline (tensor) paths
    q, k, v = torch.randn(2, 3, 4, 64), torch.randn(2, 3, 2, 64), torch.randn(2, 3, 2, 64)
    with pytest.raises(TypeError, match="v must have the same dtype as q"):
        flash_attn_tq.flash_attn_func(q, k, v.half())
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        flash_attn_tq.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1).half(), v.flatten(0, 1), cu, cu, 3, 3)
    k_cache, v_cache = torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)
    for kwargs, name in (
        (dict(k_cache=k_cache.half()), "k_cache"),
        (dict(v_cache=v_cache.bfloat16()), "v_cache"),
        (dict(k=k.half(), v=v, cache_seqlens=0), "k"),
        (dict(k=k, v=v.half(), cache_seqlens=0), "v"),
    ):
        call = dict(dict(k_cache=k_cache, v_cache=v_cache), **kwargs)
        with pytest.raises(TypeError, match=f"{name} must have the same dtype as q"):
            flash_attn_with_kvcache(q[:, :1], call.pop("k_cache"), call.pop("v_cache"), **call)
        assert not k_cache.any() and not v_cache.any()


# ----------------------------------------------------------------------------- quality


def quality_case(seed, B=2, L=301, Hq=8, Hkv=2, d=128, Sq=1):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, L, Hkv, d, generator=gen).half()
    v = torch.randn(B, L, Hkv, d, generator=gen).half()
    q = torch.randn(B, Sq, Hq, d, generator=gen)
    exact, _ = ref_attention(q, k, v, [L] * B)
    errs = {}
    for quantizer in ("turbo", "asym"):
        for bits in ((3, 3), (4, 3), (2, 2)):
            cache = QuantizedKVCache(B, L, Hkv, d, quantizer=quantizer, k_bits=bits[0], v_bits=bits[1])
            cache.append(k, v)
            out = flash_attn_with_kvcache(q, cache)
            errs[(quantizer, bits)] = rel_err(out, exact)
    return errs


@pytest.mark.parametrize("seed", [0, 1])
def test_quality_vs_full_precision(seed):
    errs = quality_case(seed)
    for quantizer in ("turbo", "asym"):
        assert errs[(quantizer, (3, 3))] < 0.35, errs
        assert errs[(quantizer, (4, 3))] < errs[(quantizer, (3, 3))], errs
        assert errs[(quantizer, (2, 2))] > errs[(quantizer, (3, 3))], errs
    assert errs[("turbo", (3, 3))] < errs[("asym", (3, 3))]  # the rotation helps on Gaussian data
    assert errs[("turbo", (3, 3))] > 0.01  # quantization does change the answer


def test_quality_peaked_attention():
    """Keys that some queries match strongly: the quantized cache must still pick the right keys."""
    gen = torch.Generator().manual_seed(11)
    B, L, H, d = 1, 200, 1, 128
    k = torch.randn(B, L, H, d, generator=gen).half()
    v = torch.randn(B, L, H, d, generator=gen).half()
    idx = torch.tensor([17, 150, 3])
    q = torch.zeros(1, 3, 1, d)  # 3 query rows, one per target key
    for i, j in enumerate(idx.tolist()):
        q[0, i, 0] = k[0, j, 0].float() * 0.5
    exact, _ = ref_attention(q, k, v, [L])
    cache = QuantizedKVCache(B, L, H, d)
    cache.append(k, v)
    out = flash_attn_with_kvcache(q, cache)
    assert rel_err(out, exact) < 0.25
    # the output is close to the targeted value vectors
    for i, j in enumerate(idx.tolist()):
        cos = torch.nn.functional.cosine_similarity(out[0, i, 0].double(), v[0, j, 0].double(), dim=0)
        assert cos > 0.8


def _stand_in_kernel(monkeypatch, cache):
    """Let the fused branch run on the CPU: dispatch plans fused launches (the cpu_as_gpu fixture) and
    ops.decode becomes _cpu_stand_in_for_the_kernel over ``cache`` (checking it gets the cache's own
    tensors)."""
    from flash_attn_tq import ops

    def decode(
        q,
        stores,
        seqlens_k,
        batch_idx=None,
        *,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        leftpad=None,
        softcap=0.0,
        **options,
    ):
        codes = stores[0]
        assert codes.kind == ops.CODES and codes.tensors[0] is cache.k_codes and codes.a == cache.fp16_window
        return _cpu_stand_in_for_the_kernel(
            q, cache, seqlens_k, batch_idx, softmax_scale, causal, window_size, leftpad, softcap
        )

    monkeypatch.setattr(ops, "decode", decode)


def _cpu_stand_in_for_the_kernel(
    q, cache, seqlens_k, batch_idx, softmax_scale, causal, window_size=(-1, -1), leftpad=None, softcap=0.0
):
    """What ops.decode computes, on the CPU: q (in the key transform's domain) over keys [0, seqlens_k)
    of the codes and the 16-bit side (sinks, a 16-bit window) in one pass (rotated domain for turbo:
    q rotated in, the output rotated back)."""
    assert cache.window_quantizer is None  # (a window of codes has its own pass: not emulated here)
    rows = torch.arange(q.shape[0]) if batch_idx is None else batch_idx.long()
    kr, vr = cache.dequantize(rows, rotated=True)
    out, lse = flash_attn_tq.baseline.attention_reference(
        cache.rotate_query(q.float()),
        kr,
        vr,
        softmax_scale=softmax_scale,
        causal=causal,
        key_lengths=seqlens_k,
        window_size=window_size,
        key_start=leftpad,
        softcap=softcap,
    )
    return cache.unrotate_output(out).to(q.dtype), lse


@pytest.mark.parametrize("seqlen_q", [1, 4, 30])
@pytest.mark.parametrize("options", ["sinks", "sinks-window", "tqcache-default"])
def test_sinks_are_kept_in_16_bit(monkeypatch, cpu_as_gpu_later, seqlen_q, options):
    """sink_tokens: the first tokens of each sequence attended in 16-bit (raw), the rest from the
    codes (and the window): the reference path equals float32 attention over exactly that, and the
    fused branch's Python side (stand-in kernel) equals the reference path."""
    kw = {
        "sinks": dict(sink_tokens=4),
        "sinks-window": dict(sink_tokens=4, fp16_window=8),
        "tqcache-default": dict(sink_tokens=4, fp16_window=8, key_center=True, fit="mean"),
    }[options]
    gen = torch.Generator().manual_seed(seqlen_q + 7 * len(options))
    cache = QuantizedKVCache(2, 80, 2, 64, **kw)
    k = torch.randn(2, 50, 2, 64, generator=gen) + 1.5
    k[:, :4] = k[:, :4] * 3  # loud sinks: their share matters
    v = torch.randn(2, 50, 2, 64, generator=gen)
    cache.append(k.half(), v.half())
    kd, vd = cache.dequantize()
    # the sinks as written (16-bit; stored in the key transform's domain where there is one)
    assert rel_err(kd[:, :4], k[:, :4]) < 1e-3 and rel_err(vd[:, :4], v[:, :4]) < 1e-3
    assert rel_err(kd[:, 4:42], k[:, 4:42]) > 0.01  # the codes' keys: quantized
    q = torch.randn(2, seqlen_q, 4, 64, generator=gen).half()
    expected, expected_lse = flash_attn_tq.baseline.attention_reference(
        q.float(), kd, vd, softmax_scale=0.125, causal=True, key_lengths=cache.seqlens
    )
    out, lse = flash_attn_with_kvcache(q.float(), cache, causal=True, softmax_scale=0.125, return_softmax_lse=True)
    assert last_path().startswith("quantized:reference")
    assert rel_err(out.float(), expected) < 1e-5
    cpu_as_gpu_later()
    _stand_in_kernel(monkeypatch, cache)
    fused, fused_lse = flash_attn_with_kvcache(q, cache, causal=True, softmax_scale=0.125, return_softmax_lse=True)
    assert last_path() == "quantized:fused-cuda"
    assert rel_err(fused.float(), expected) < 2e-3
    with pytest.raises(ValueError, match="sink_tokens must be"):
        QuantizedKVCache(1, 8, 1, 64, sink_tokens=-1)


def test_side_slots_after_many_appends():
    """kv_side after a prompt and single-token appends: sink p in slot p, window token p in slot
    S + p % R, nothing else written over them (the spare slot takes the rest)."""
    cache = QuantizedKVCache(2, 64, 1, 64, sink_tokens=3, fp16_window=5)
    x = torch.arange(2 * 40, dtype=torch.float32).reshape(2, 40, 1, 1).expand(2, 40, 1, 64).contiguous()
    cache.append(x[:, :2], x[:, :2])  # a prompt shorter than the sinks
    cache.append(x[:, 2:30], x[:, 2:30])
    for t in range(30, 40):
        cache.append(x[:, t : t + 1], x[:, t : t + 1])
    for b in range(2):
        for p in range(3):
            assert cache.k_side[b, p, 0, 0].item() == x[b, p, 0, 0].item()
        for p in range(35, 40):
            assert cache.k_side[b, 3 + p % 5, 0, 0].item() == x[b, p, 0, 0].item()


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("options", ["plain", "window", "tqcache-default", "local", "leftpad-softcap"])
@pytest.mark.parametrize("batch_idx", [None, [2, 0]])
def test_fused_branch_python_side_matches_reference_path(monkeypatch, cpu_as_gpu_later, seqlen_q, options, batch_idx):
    """The GPU path's Python side (window part, log-sum-exp merge, key/value transforms, lse shift)
    run on the CPU with a stand-in for the kernel, against the reference path on the same cache."""
    kw = {
        "plain": {},
        "window": dict(fp16_window=8),
        "local": {},
        "leftpad-softcap": {},
        "tqcache-default": dict(fp16_window=8, key_center=True, fit="mean"),
    }[options]
    local = (20, 0) if options == "local" else (-1, -1)  # window_size
    extra = (
        dict(cache_leftpad=torch.tensor([5, 12], dtype=torch.int32), softcap=2.5)
        if options == "leftpad-softcap"
        else {}
    )
    gen = torch.Generator().manual_seed(seqlen_q + 11 * len(options))
    cache = QuantizedKVCache(3, 80, 2, 64, **kw)
    cache.append(
        (torch.randn(3, 50, 2, 64, generator=gen) + 1.5).half(), torch.randn(3, 50, 2, 64, generator=gen).half()
    )
    bidx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32)
    q = torch.randn(2, seqlen_q, 4, 64, generator=gen).half()
    expected, expected_lse = flash_attn_with_kvcache(
        q.float(), cache, cache_batch_idx=bidx, causal=True, window_size=local, return_softmax_lse=True, **extra
    )
    assert last_path().startswith("quantized:reference")
    cpu_as_gpu_later()
    _stand_in_kernel(monkeypatch, cache)
    out, lse = flash_attn_with_kvcache(
        q, cache, cache_batch_idx=bidx, causal=True, window_size=local, return_softmax_lse=True, **extra
    )
    assert last_path() == "quantized:fused-cuda"
    assert rel_err(out.float(), expected) < 2e-3
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=2e-3)
