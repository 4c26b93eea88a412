"""Key centering / per-channel key scaling (QuantizedKVCache(key_center=, key_scale=)) and the
per-vector fits of TurboQuantizer(fit=...), on the CPU reference path."""
import math

import pytest
import torch

from flash_attn_tq import QuantizedKVCache, TurboQuantizer, flash_attn_with_kvcache
from flash_attn_tq.baseline import attention_reference


def keys_with_offset(B, S, H, d, seed=0):
    """Keys with a large common per-channel offset and uneven channel scales (like RoPE'd keys)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(B, 1, H, d, generator=g) * 4
    spread = torch.rand(1, 1, H, d, generator=g) * 2 + 0.2
    return mu + torch.randn(B, S, H, d, generator=g) * spread


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("quantizer", ["turbo", "asym", "turbo-pca"])
@pytest.mark.parametrize("center,scale", [(True, 0.0), (True, 0.5), (False, 0.5)])
def test_transform_is_exact_on_scores(quantizer, center, scale):
    extra = {}
    if quantizer == "turbo-pca":
        quantizer, extra = "turbo", dict(key_pca=True, fit="mean")
    B, S, H, Hq, d = 2, 40, 2, 4, 64
    k = keys_with_offset(B, S, H, d)
    v = torch.randn(B, S, H, d)
    q = torch.randn(B, 3, Hq, d)
    cache = QuantizedKVCache(B, 64, H, d, quantizer=quantizer, key_center=center, key_scale=scale, **extra)
    cache.append(k, v)
    assert bool(cache.calibrated.all())
    torch.testing.assert_close(cache.untransform_keys(cache.transform_keys(k)), k, rtol=1e-5, atol=1e-4)
    if center:
        torch.testing.assert_close(cache.k_shift, k.mean(1))
    # q' . k' + q . mu == q . k for the transformed keys the quantizer sees
    kt = cache.transform_keys(k)
    qt = cache.transform_query(q)
    group = Hq // H
    s_t = torch.einsum("bqhd,bkhd->bhqk", qt, kt.float().repeat_interleave(group, 2))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2))
    shift = cache.query_shift(q) if center else torch.zeros(B, Hq, 3)
    torch.testing.assert_close(s_t + shift.unsqueeze(-1), s, rtol=1e-4, atol=1e-3)
    # attention over the transformed (quantized) keys with q' == attention over the dequantized keys with q
    k_hat, v_hat = cache.dequantize()
    k_hat_t = cache.transform_keys(k_hat[:, :S])
    out_t, lse_t = attention_reference(qt, k_hat_t, v_hat[:, :S], softmax_scale=d ** -0.5)
    out, lse = attention_reference(q, k_hat[:, :S], v_hat[:, :S], softmax_scale=d ** -0.5)
    torch.testing.assert_close(out_t, out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse_t + shift * d ** -0.5, lse, rtol=1e-4, atol=1e-4)


def test_centering_reduces_key_error_and_api_matches_reference():
    B, S, H, Hq, d = 1, 256, 2, 6, 128
    k = keys_with_offset(B, S, H, d, seed=3)
    v = torch.randn(B, S, H, d)
    err = {}
    for center in (False, True):
        cache = QuantizedKVCache(B, S, H, d, key_center=center)
        cache.append(k, v)
        k_hat, _ = cache.dequantize()
        err[center] = rel(k_hat, k)
    assert err[True] < 0.5 * err[False]
    # flash_attn_with_kvcache (new k/v given, causal) == float attention over the dequantized cache
    cache = QuantizedKVCache(B, S + 8, H, d, key_center=True, key_scale=0.5, fp16_window=16)
    q = torch.randn(B, 5, Hq, d)
    out, lse = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True, return_softmax_lse=True)
    k_hat, v_hat = cache.dequantize()
    ref, ref_lse = attention_reference(q, k_hat, v_hat, causal=True, key_lengths=S)
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_window_holds_transformed_keys_and_state_dict():
    B, S, H, d = 2, 50, 1, 64
    k, v = keys_with_offset(B, S, H, d, seed=5), torch.randn(B, S, H, d)
    cache = QuantizedKVCache(B, 64, H, d, key_center=True, key_scale=0.5, fp16_window=8)
    cache.append(k[:, :30], v[:, :30])
    cache.append(k[:, 30:], v[:, 30:])  # calibration stays the first chunk's
    torch.testing.assert_close(cache.k_shift, k[:, :30].mean(1))
    k_hat, _ = cache.dequantize()
    torch.testing.assert_close(k_hat[:, S - 8:S], k[:, S - 8:].half().float(), rtol=2e-3, atol=2e-2)
    clone = QuantizedKVCache.from_state_dict(cache.state_dict())
    torch.testing.assert_close(clone.dequantize()[0], k_hat)
    assert clone.config() == cache.config()


def test_key_pca_stores_main_direction_exactly():
    B, S, H, d = 1, 200, 2, 64
    g = torch.Generator().manual_seed(4)
    main = torch.nn.functional.normalize(torch.randn(H, d, generator=g), dim=-1)
    k = torch.randn(B, S, H, d, generator=g) * 0.3 + torch.randn(B, S, H, 1, generator=g) * 4 * main
    v = torch.randn(B, S, H, d, generator=g)
    err = {}
    for pca in (False, True):
        cache = QuantizedKVCache(B, S, H, d, key_center=True, key_pca=pca, fit="mean" if pca else "norm")
        cache.append(k, v)
        err[pca] = rel(cache.dequantize()[0], k)
        if pca:  # P maps the main direction to +-e_0
            pv = cache._householder(main[None, None], torch.zeros(1, dtype=torch.long))[0, 0]
            assert torch.allclose(pv.abs()[:, 0], torch.ones(H), atol=0.02)
    assert err[True] < 0.6 * err[False]  # (0.097 vs 0.187 here)
    with pytest.raises(ValueError):
        QuantizedKVCache(1, 8, 1, 64, key_pca=True)  # needs fit="mean"


def test_value_pca():
    B, S, H, Hq, d = 1, 160, 2, 4, 64
    g = torch.Generator().manual_seed(6)
    main = torch.nn.functional.normalize(torch.randn(H, d, generator=g), dim=-1)
    k = keys_with_offset(B, S, H, d, seed=6)
    v = torch.randn(B, S, H, d, generator=g) * 0.3 + (2 + torch.randn(B, S, H, 1, generator=g)) * 3 * main
    err = {}
    for pca in (False, True):
        cache = QuantizedKVCache(B, S + 4, H, d, value_pca=pca, fit="mean" if pca else "norm", fp16_window=8)
        cache.append(k, v)
        err[pca] = rel(cache.dequantize(use_window=False)[1][:, :S], v)
    assert err[True] < 0.6 * err[False]
    # what the fused path does: attend over the stored (reflected) values, reflect the output back
    q = torch.randn(B, 2, Hq, d, generator=g)
    k_hat, v_hat = cache.dequantize()
    out, _ = attention_reference(q, k_hat[:, :S], v_hat[:, :S])
    v_stored = cache._reflect(v_hat[:, :S], cache.v_house[:, None])
    out_t, _ = attention_reference(q, k_hat[:, :S], v_stored)
    torch.testing.assert_close(cache.untransform_output(out_t), out, rtol=1e-4, atol=1e-4)
    got = flash_attn_with_kvcache(q, cache)
    torch.testing.assert_close(got.float(), out, rtol=1e-4, atol=1e-4)
    clone = QuantizedKVCache.from_state_dict(cache.state_dict())
    torch.testing.assert_close(clone.dequantize()[1], v_hat)


def test_short_first_chunk_keeps_identity():
    cache = QuantizedKVCache(1, 32, 1, 64, key_center=True, key_scale=0.5, calib_min_tokens=16)
    cache.append(torch.randn(1, 4, 1, 64) + 3, torch.randn(1, 4, 1, 64))
    assert bool(cache.calibrated.all())
    assert float(cache.k_shift.abs().max()) == 0.0 and float((cache.k_div - 1).abs().max()) == 0.0
    with pytest.raises(ValueError):
        QuantizedKVCache(1, 8, 1, 64, key_scale=-1.0)


def test_fits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=g) * torch.linspace(0.2, 3, 64)
    stats = {}
    for fit in ("norm", "ls", "unbiased", "search", "mean"):
        qz = TurboQuantizer(64, 3, fit=fit, seed=1)
        codes, meta = qz.quantize(x)
        assert codes.min() >= 0 and codes.max() <= 7 and meta.dtype == torch.float16
        xh = qz.dequantize(codes, meta)
        mse = ((xh - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        gain = ((xh * x).sum(-1) / x.pow(2).sum(-1)).mean().item()
        stats[fit] = (mse, gain)
    assert stats["ls"][0] < stats["norm"][0] and stats["search"][0] < stats["norm"][0]
    assert abs(stats["unbiased"][1] - 1) < 2e-3 and stats["ls"][1] < stats["norm"][1] < 1
    with pytest.raises(ValueError):
        TurboQuantizer(64, 3, fit="mse")
    with pytest.raises(ValueError):
        TurboQuantizer(64, 3, grid="lloyd_max", fit="ls")
    with pytest.raises(ValueError):
        QuantizedKVCache(1, 8, 1, 64, quantizer="asym", fit="ls")
    cache = QuantizedKVCache(1, 16, 1, 64, fit="search")
    k = torch.randn(1, 16, 1, 64)
    cache.append(k, k)
    assert rel(cache.dequantize()[0], k) < 0.25


def test_key_scale_balanced_against_queries():
    B, S, H, Hq, d = 1, 64, 2, 4, 64
    k = keys_with_offset(B, S, H, d, seed=8)
    v = torch.randn(B, S, H, d)
    q = torch.randn(B, S, Hq, d) * torch.linspace(0.5, 2, d)
    cache = QuantizedKVCache(B, S, H, d, key_center=True, key_scale=0.5, key_scale_q=True)
    out = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True)  # the first call calibrates with q
    rk = (k - k.mean(1, keepdim=True)).pow(2).mean(1).sqrt()
    rq = q.reshape(B, S, H, Hq // H, d).pow(2).mean((1, 3)).sqrt()
    s = (rk / rq).sqrt()
    s = s / s.pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(cache.k_div, s, rtol=1e-4, atol=1e-5)
    k_hat, v_hat = cache.dequantize()
    ref, _ = attention_reference(q, k_hat, v_hat, causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-4)
    plain = QuantizedKVCache(B, S, H, d, key_center=True, key_scale=0.5, key_scale_q=True)
    plain.append(k, v)  # no queries: falls back to rms(k) ** a
    torch.testing.assert_close(plain.k_div, rk.sqrt() / rk.sqrt().pow(2).mean(-1, keepdim=True).sqrt(), rtol=1e-4, atol=1e-5)


def test_transforms_of_selected_rows():
    """transform_query / query_shift / untransform_output for cache rows picked by batch_idx (the
    fused path's GQA views) against the per-q-head formulas."""
    B, S, H, Hq, d = 3, 40, 2, 6, 64
    cache = QuantizedKVCache(B, 64, H, d, key_center=True, key_scale=0.5, key_pca=True, value_pca=True, fit="mean")
    cache.append(keys_with_offset(B, S, H, d, seed=9), torch.randn(B, S, H, d))
    assert bool(cache.calibrated.all())
    rows = torch.tensor([2, 0], dtype=torch.int32)
    q, o = torch.randn(2, 3, Hq, d), torch.randn(2, 3, Hq, d)
    group = Hq // H

    def per_q_head(table):
        return table[rows.long()].repeat_interleave(group, 1)  # [2, Hq, d]

    div, w, wv = per_q_head(cache.k_div)[:, None], per_q_head(cache.k_house)[:, None], per_q_head(cache.v_house)[:, None]
    qt = q * div
    torch.testing.assert_close(cache.transform_query(q, rows), qt - 2 * (qt * w).sum(-1, keepdim=True) * w)
    torch.testing.assert_close(cache.query_shift(q, rows), torch.einsum("bshd,bhd->bhs", q, per_q_head(cache.k_shift)))
    torch.testing.assert_close(cache.untransform_output(o, rows), o - 2 * (o * wv).sum(-1, keepdim=True) * wv)
    first_rows = torch.tensor([0, 1])  # the default: rows 0..batch-1
    torch.testing.assert_close(cache.transform_query(q), cache.transform_query(q, first_rows))
    torch.testing.assert_close(cache.query_shift(q), cache.query_shift(q, first_rows))
    torch.testing.assert_close(cache.untransform_output(o), cache.untransform_output(o, first_rows))


# ---------------------------------------------------------------- key_center="rope"

def rope(x, pos, inv_freq):
    """Rotate-half RoPE (transformers' Llama) of x [B, S, H, d] at positions pos [S]."""
    ang = pos.double()[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    half = x.shape[-1] // 2
    return (x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin).float()


def roped_keys(B, S, H, d, seed=0, theta=10000.0):
    """Post-RoPE keys whose pre-RoPE form has a large constant part (what real keys have)."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    raw = torch.randn(B, 1, H, d, generator=g) * 4 + torch.randn(B, S, H, d, generator=g)
    return rope(raw, torch.arange(S), inv), inv


def test_rope_center_is_the_mean_pre_rope_key_and_exact():
    B, S, H, d, first = 2, 600, 2, 64, 48
    k, inv = roped_keys(B, S, H, d)
    v = torch.randn(B, S, H, d)
    cache = QuantizedKVCache(B, S, H, d, key_center="rope", rope_inv_freq=inv, fp16_window=8)
    cache.append(k[:, :first], v[:, :first])
    cache.append(k[:, first:], v[:, first:])
    unturned = rope(k[:, :first], -torch.arange(first).float(), inv)  # R(-p) k: the pre-RoPE keys
    torch.testing.assert_close(cache.k_shift, unturned.mean(1), rtol=1e-4, atol=1e-4)
    pos = torch.arange(S).expand(B, -1)
    torch.testing.assert_close(cache.untransform_keys(cache.transform_keys(k, positions=pos), positions=pos), k,
                               rtol=1e-5, atol=1e-4)
    # attention over the cache (the reference path) is attention over its dequantized keys, as stored
    q = torch.randn(B, 1, 2 * H, d)
    out, lse = flash_attn_with_kvcache(q, cache, return_softmax_lse=True)
    k_hat, v_hat = cache.dequantize()
    ref_out, ref_lse = attention_reference(q, k_hat, v_hat, softmax_scale=d ** -0.5,
                                           key_lengths=torch.full((B,), S, dtype=torch.int32))
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    state = cache.state_dict()
    back = QuantizedKVCache.from_state_dict(state)
    assert back.rope_center and back.config() == cache.config()
    torch.testing.assert_close(back.dequantize()[0], k_hat)


def test_rope_center_codes_far_keys_better_than_the_post_rope_mean():
    """The post-RoPE mean of the first chunk stops matching as RoPE turns the keys' constant part;
    R(p) c follows it: far from the first chunk the 3-bit keys come out several times closer."""
    B, S, H, d, first = 1, 4096, 2, 64, 256
    k, inv = roped_keys(B, S, H, d, seed=1)
    v = torch.randn(B, S, H, d)
    err = {}
    for center in (True, "rope"):
        extra = dict(rope_inv_freq=inv) if center == "rope" else {}
        cache = QuantizedKVCache(B, S, H, d, key_center=center, **extra)
        cache.append(k[:, :first], v[:, :first])
        cache.append(k[:, first:], v[:, first:])
        k_hat = cache.dequantize()[0]
        err[center] = rel(k_hat[:, 3000:], k[:, 3000:])
    assert err["rope"] < 0.5 * err[True], err


def test_rope_center_errors():
    inv = torch.ones(32)
    with pytest.raises(ValueError, match="rope_inv_freq"):
        QuantizedKVCache(1, 8, 1, 64, key_center="rope")
    with pytest.raises(ValueError, match="rope_inv_freq"):
        QuantizedKVCache(1, 8, 1, 64, key_center="rope", rope_inv_freq=torch.ones(16))
    with pytest.raises(ValueError, match="rope_inv_freq"):
        QuantizedKVCache(1, 8, 1, 64, key_center="rope", rope_inv_freq=torch.full((32,), float("nan")))
    with pytest.raises(ValueError, match="rope_inv_freq"):
        QuantizedKVCache(1, 8, 1, 64, key_center=True, rope_inv_freq=inv)
    with pytest.raises(ValueError, match="key_scale nor key_pca"):
        QuantizedKVCache(1, 8, 1, 64, key_center="rope", rope_inv_freq=inv, key_scale=0.5)
    with pytest.raises(ValueError, match="key_center"):
        QuantizedKVCache(1, 8, 1, 64, key_center="pre")
    cache = QuantizedKVCache(1, 8, 1, 64, key_center="rope", rope_inv_freq=inv)
    with pytest.raises(ValueError, match="positions"):
        cache.transform_keys(torch.randn(1, 4, 1, 64))
    with pytest.raises(ValueError, match="no shared shift"):
        cache.query_shift(torch.randn(1, 1, 1, 64))
