"""CpuQuantizedKVCache: int8 keys + low-bit values, blockwise CPU decode attention."""

import math

import pytest
import torch

import flash_attn_tq as fa
from flash_attn_tq import baseline
from flash_attn_tq.cpu import CpuQuantizedKVCache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_kv(gen, batch, n, heads, d, offset=2.0):
    """Keys with a shared per-channel offset (as RoPE keys carry), values plain normal."""
    k = torch.randn(batch, n, heads, d, generator=gen) + offset * torch.randn(1, 1, heads, d, generator=gen)
    v = torch.randn(batch, n, heads, d, generator=gen)
    return k, v


@pytest.mark.parametrize("v_bits", [2, 3, 4])
@pytest.mark.parametrize("key_group", [None, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_dense_attention_over_dequantized_cache(v_bits, key_group, heads):
    gen = torch.Generator().manual_seed(v_bits * 100 + heads[0] + (key_group or 0))
    hq, hk = heads
    B, S, d = 3, 333, 64 if v_bits == 2 else 128  # odd length, several blocks of 128
    cache = CpuQuantizedKVCache(B, 400, hk, d, key_group=key_group, v_bits=v_bits, block_size=128)
    k, v = make_kv(gen, B, S, hk, d)
    q = torch.randn(B, 1, hq, d, generator=gen)
    out, lse = fa.flash_attn_with_kvcache(q, cache, k=k, v=v, return_softmax_lse=True)
    assert fa.last_path() == "quantized:cpu-int8-keys"
    assert out.shape == q.shape and lse.shape == (B, hq, 1)
    assert cache.seqlens.tolist() == [S] * B
    kd, vd = cache.dequantize()
    ref, ref_lse = baseline.attention_reference(q, kd, vd, key_lengths=cache.seqlens)
    assert rel(out, ref) < 1e-5
    assert torch.allclose(lse, ref_lse, atol=1e-4)
    # against the unquantized K/V: the keys nearly exact, the error is the values' quantization
    full, _ = baseline.attention_reference(q, k, v)
    assert rel(kd[:, :S], k) < 0.01
    assert rel(out, full) < {2: 0.45, 3: 0.25, 4: 0.12}[v_bits]


def test_ragged_rows_batch_idx_and_causal_chunk():
    gen = torch.Generator().manual_seed(7)
    B, hq, hk, d = 4, 8, 2, 128
    cache = CpuQuantizedKVCache(B, 300, hk, d, block_size=64)
    lens = [37, 201, 1, 129]
    for b, n in enumerate(lens):  # each row its own prompt length
        k, v = make_kv(gen, 1, n, hk, d)
        cache.append(k, v, batch_idx=torch.tensor([b], dtype=torch.int32))
    assert cache.seqlens.tolist() == lens
    # a causal chunk of 5 new tokens on rows 3 and 1 (in that order), bottom-right aligned
    rows = torch.tensor([3, 1], dtype=torch.int32)
    k, v = (x.half() for x in make_kv(gen, 2, 5, hk, d))  # new k / v in q's dtype
    q = torch.randn(2, 5, hq, d, generator=gen, dtype=torch.float16)
    out, lse = fa.flash_attn_with_kvcache(
        q, cache, k=k, v=v, cache_batch_idx=rows, causal=True, return_softmax_lse=True
    )
    assert out.dtype == torch.float16
    assert cache.seqlens.tolist() == [37, 206, 1, 134]
    kd, vd = cache.dequantize(rows.long())
    new_lens = cache.seqlens[rows.long()]
    ref, ref_lse = baseline.attention_reference(q.float(), kd, vd, causal=True, key_lengths=new_lens)
    assert rel(out, ref) < 2e-3  # float16 output rounding
    assert torch.allclose(lse, ref_lse, atol=1e-4)
    # a decode step over all rows without new k/v, at explicit lengths
    q1 = torch.randn(B, 1, hq, d, generator=gen)
    at = torch.tensor([10, 200, 1, 0], dtype=torch.int32)
    out1, lse1 = fa.flash_attn_with_kvcache(q1, cache, cache_seqlens=at, return_softmax_lse=True)
    kd, vd = cache.dequantize()
    ref1, ref_lse1 = baseline.attention_reference(q1, kd, vd, key_lengths=at)
    assert rel(out1, ref1) < 1e-5
    assert torch.equal(out1[3], torch.zeros_like(out1[3])) and bool(torch.isinf(lse1[3]).all())
    assert torch.allclose(lse1[:3], ref_lse1[:3], atol=1e-4)


def test_bfloat16_compute_and_kv_cache_keyword():
    gen = torch.Generator().manual_seed(3)
    B, S, hq, hk, d = 2, 257, 4, 1, 128
    k, v = make_kv(gen, B, S, hk, d)
    q = torch.randn(B, 1, hq, d, generator=gen, dtype=torch.bfloat16)
    exact = CpuQuantizedKVCache(B, S, hk, d)
    fast = CpuQuantizedKVCache(B, S, hk, d, compute_dtype=torch.bfloat16)
    exact.append(k, v)
    fast.append(k, v)
    a = fa.flash_attn_with_kvcache(q, kv_cache=exact)
    b = fa.flash_attn_with_kvcache(q, fast, None)
    assert a.dtype == b.dtype == torch.bfloat16
    assert rel(b, a) < 0.05
    assert torch.equal(exact.k_int8, fast.k_int8) and torch.equal(exact.v_codes, fast.v_codes)


def test_rotary_matches_rotating_outside():
    gen = torch.Generator().manual_seed(11)
    B, n, hq, hk, d = 2, 9, 4, 2, 64
    k, v = make_kv(gen, B, n, hk, d)
    q = torch.randn(B, n, hq, d, generator=gen)
    ang = torch.arange(32).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = ang.cos(), ang.sin()
    a = CpuQuantizedKVCache(B, 32, hk, d)
    out = fa.flash_attn_with_kvcache(
        q, a, k=k, v=v, rotary_cos=cos, rotary_sin=sin, causal=True, rotary_interleaved=False
    )
    pos = torch.arange(n).expand(B, n)
    kr = baseline.rotary_at(k, cos, sin, pos, False)
    qr = baseline.rotary_at(q, cos, sin, pos, False)
    b = CpuQuantizedKVCache(B, 32, hk, d)
    ref = fa.flash_attn_with_kvcache(qr, b, k=kr, v=v, causal=True)
    assert rel(out, ref) < 1e-4


def test_storage_and_bits_per_element():
    c = CpuQuantizedKVCache(2, 100, 4, 128)
    assert c.bits_per_element() == pytest.approx((8.125 + 3.125) / 2)
    assert c.nbytes == 2 * 100 * 4 * (128 + 2 + 48 + 2)
    assert CpuQuantizedKVCache(1, 8, 1, 128, key_group=32).bits_per_element() == pytest.approx((8.5 + 3.125) / 2)
    assert fa.CpuQuantizedKVCache is CpuQuantizedKVCache


def test_zero_vectors_and_no_keys():
    c = CpuQuantizedKVCache(1, 16, 1, 64)
    z = torch.zeros(1, 3, 1, 64)
    q = torch.randn(1, 1, 2, 64)
    out = fa.flash_attn_with_kvcache(q, c, k=z, v=z)
    assert torch.equal(out, torch.zeros_like(out))
    out, lse = fa.flash_attn_with_kvcache(q, c, cache_seqlens=0, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isinf(lse).all()) and bool((lse > 0).all())


def test_bad_inputs_name_the_argument():
    c = CpuQuantizedKVCache(2, 16, 2, 64)
    q = torch.randn(2, 1, 4, 64)
    kv = torch.randn(2, 3, 2, 64)
    cases = [
        (dict(batch_size=0), "batch_size"),
        (dict(head_dim=96), "head_dim"),
        (dict(key_group=48), "key_group"),
        (dict(v_bits=8), "v_bits"),
        (dict(block_size=0), "block_size"),
    ]
    for kw, name in cases:
        args = dict(batch_size=1, max_seqlen=8, num_kv_heads=1, head_dim=64)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            CpuQuantizedKVCache(**args)
    with pytest.raises(TypeError, match="compute_dtype"):
        CpuQuantizedKVCache(1, 8, 1, 64, compute_dtype=torch.float16)
    with pytest.raises(TypeError, match="score_dtype"):
        CpuQuantizedKVCache(1, 8, 1, 64, score_dtype=torch.float16)
    calls = [
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "cache_leftpad"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),
        (dict(window_size=(4, 0)), "window_size"),
        (dict(softcap=5.0), "softcap"),
        (dict(alibi_slopes=torch.zeros(4)), "alibi_slopes"),
        (dict(k=kv), "k and v"),
        (dict(k=kv, v=kv, rotary_cos=torch.ones(16, 32)), "rotary_cos"),
        (dict(k=kv[:, :, :1], v=kv[:, :, :1]), "k must have 2 kv heads"),
        (dict(k=kv, v=kv, cache_seqlens=15), "max_seqlen"),
        (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), "cache_seqlens"),
        (dict(cache_batch_idx=torch.tensor([0, 2])), "cache_batch_idx"),
        (dict(cache_batch_idx=torch.zeros(2)), "cache_batch_idx"),
        (dict(k=kv.clone().fill_(math.nan), v=kv), "finite"),
    ]
    for kw, name in calls:
        with pytest.raises(ValueError, match=name):
            fa.flash_attn_with_kvcache(q, c, **kw)
    with pytest.raises(ValueError, match="q heads"):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 3, 64), c)
    with pytest.raises(ValueError, match="head_dim"):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 32), c)
    with pytest.raises(ValueError, match="batch_size"):
        fa.flash_attn_with_kvcache(torch.randn(3, 1, 4, 64), c)
    with pytest.raises(TypeError, match="q must be"):
        fa.flash_attn_with_kvcache(q.double(), c)
    with pytest.raises(ValueError, match="v_cache"):
        fa.flash_attn_with_kvcache(q, c, torch.zeros(1))


def test_cpu_cache_takes_a_spec():
    """The CPU cache takes a CacheSpec of its format (int8 keys, turbo values) and refuses the rest by name."""
    from flash_attn_tq import CacheSpec, CpuQuantizedKVCache

    cache = CpuQuantizedKVCache(1, 16, 1, 64, spec=CacheSpec(k_bits=8, v_bits=4, seed=3))
    assert (cache.v_bits, cache.seed) == (4, 3)
    for bad, name in ((CacheSpec(), "k_bits"), (CacheSpec(k_bits=8, sink_tokens=4), "sink_tokens")):
        with pytest.raises(ValueError, match=name):
            CpuQuantizedKVCache(1, 16, 1, 64, spec=bad)
