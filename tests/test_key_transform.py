"""Key centering (QuantizedKVCache(key_center=)), the per-vector fits of TurboQuantizer(fit=...) on
the CPU reference path, and the key/value transforms only the evaluation's simulation has
(flash_attn_tq.testing.simulation: key_scale, key_scale_q, key_pca, value_pca)."""

import pytest
import torch

from flash_attn_tq import QuantizedKVCache, TurboQuantizer, flash_attn_with_kvcache
from flash_attn_tq.baseline import attention_reference
from flash_attn_tq.testing.simulation import KeyValueTransform, reflect


def keys_with_offset(B, S, H, d, seed=0):
    """Keys with a large common per-channel offset and uneven channel scales (like RoPE'd keys)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(B, 1, H, d, generator=g) * 4
    spread = torch.rand(1, 1, H, d, generator=g) * 2 + 0.2
    return mu + torch.randn(B, S, H, d, generator=g) * spread


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
def test_centering_is_exact_on_scores(quantizer):
    B, S, H, Hq, d = 2, 40, 2, 4, 64
    k = keys_with_offset(B, S, H, d)
    v = torch.randn(B, S, H, d)
    q = torch.randn(B, 3, Hq, d)
    cache = QuantizedKVCache(B, 64, H, d, quantizer=quantizer, key_center=True)
    cache.append(k, v)
    assert bool(cache.calibrated.all())
    torch.testing.assert_close(cache.untransform_keys(cache.transform_keys(k)), k, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cache.k_center, k.mean(1))
    # q . (k - mu) + q . mu == q . k for the centered keys the quantizer sees
    kt = cache.transform_keys(k)
    group = Hq // H
    s_t = torch.einsum("bqhd,bkhd->bhqk", q, kt.float().repeat_interleave(group, 2))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2))
    shift = cache.query_shift(q)
    torch.testing.assert_close(s_t + shift.unsqueeze(-1), s, rtol=1e-4, atol=1e-3)
    # attention over the centered (quantized) keys == attention over the dequantized keys
    k_hat, v_hat = cache.dequantize()
    k_hat_t = cache.transform_keys(k_hat[:, :S])
    out_t, lse_t = attention_reference(q, k_hat_t, v_hat[:, :S], softmax_scale=d**-0.5)
    out, lse = attention_reference(q, k_hat[:, :S], v_hat[:, :S], softmax_scale=d**-0.5)
    torch.testing.assert_close(out_t, out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse_t + shift * d**-0.5, lse, rtol=1e-4, atol=1e-4)


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
    cache = QuantizedKVCache(B, S + 8, H, d, key_center=True, fp16_window=16)
    q = torch.randn(B, 5, Hq, d)
    out, lse = flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True, return_softmax_lse=True)
    k_hat, v_hat = cache.dequantize()
    ref, ref_lse = attention_reference(q, k_hat, v_hat, causal=True, key_lengths=S)
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_window_holds_centered_keys_and_state_dict():
    B, S, H, d = 2, 50, 1, 64
    k, v = keys_with_offset(B, S, H, d, seed=5), torch.randn(B, S, H, d)
    cache = QuantizedKVCache(B, 64, H, d, key_center=True, fp16_window=8)
    cache.append(k[:, :30], v[:, :30])
    cache.append(k[:, 30:], v[:, 30:])  # calibration stays the first chunk's
    torch.testing.assert_close(cache.k_center, k[:, :30].mean(1))
    k_hat, _ = cache.dequantize()
    torch.testing.assert_close(k_hat[:, S - 8 : S], k[:, S - 8 :].half().float(), rtol=2e-3, atol=2e-2)
    clone = QuantizedKVCache.from_state_dict(cache.state_dict())
    torch.testing.assert_close(clone.dequantize()[0], k_hat)
    assert clone.config() == cache.config()


def test_short_first_chunk_keeps_identity():
    cache = QuantizedKVCache(1, 32, 1, 64, key_center=True, calib_min_tokens=16)
    cache.append(torch.randn(1, 4, 1, 64) + 3, torch.randn(1, 4, 1, 64))
    assert bool(cache.calibrated.all())
    assert float(cache.k_center.abs().max()) == 0.0


def test_research_options_are_not_in_the_product():
    for name in ("key_scale", "key_scale_q", "key_pca", "value_pca"):
        with pytest.raises(TypeError):
            QuantizedKVCache(1, 8, 1, 64, **{name: 1})


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


# ------------------------------------- the simulation's transforms (flash_attn_tq.testing.simulation)


def _cfg(**kw):
    return dict(dict(key_center=True, key_scale=0.0, key_scale_q=False, key_pca=False, value_pca=False), **kw)


@pytest.mark.parametrize(
    "opts",
    [
        dict(key_scale=0.5),
        dict(key_scale=0.5, key_scale_q=True),
        dict(key_pca=True),
        dict(key_center=False, key_scale=0.5, key_pca=True),
    ],
)
def test_simulated_key_transform_is_exact_on_attention(opts):
    """keys() / keys_back() invert each other, and attention over transformed keys with q * s (then
    reflected) equals attention over the keys themselves up to the shared q . mu."""
    B, S, H, Hq, d = 2, 40, 2, 4, 64
    k, v = keys_with_offset(B, S, H, d), torch.randn(B, S, H, d)
    q = torch.randn(B, S, Hq, d) * torch.linspace(0.5, 2, d)
    tf = KeyValueTransform(_cfg(**opts), k, v, q)
    torch.testing.assert_close(tf.keys_back(tf.keys(k)), k, rtol=1e-5, atol=1e-4)
    group = Hq // H
    kt = tf.keys(k).repeat_interleave(group, 2)
    qs = q * tf.div.repeat_interleave(group, 1)[:, None]
    if tf.house is not None:
        qs = reflect(qs, tf.house.repeat_interleave(group, 1)[:, None])
    shift = torch.einsum("bqhd,bhd->bhq", q, tf.shift.repeat_interleave(group, 1))
    s_t = torch.einsum("bqhd,bkhd->bhqk", qs, kt) + shift.unsqueeze(-1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2))
    torch.testing.assert_close(s_t, s, rtol=1e-4, atol=1e-3)


def test_simulated_key_scale_balanced_against_queries():
    B, S, H, Hq, d = 1, 64, 2, 4, 64
    k, v = keys_with_offset(B, S, H, d, seed=8), torch.randn(B, S, H, d)
    q = torch.randn(B, S, Hq, d) * torch.linspace(0.5, 2, d)
    tf = KeyValueTransform(_cfg(key_scale=0.5, key_scale_q=True), k, v, q)
    rk = (k - k.mean(1, keepdim=True)).pow(2).mean(1).sqrt()
    rq = q.reshape(B, S, H, Hq // H, d).pow(2).mean((1, 3)).sqrt()
    s = (rk / rq).sqrt()
    torch.testing.assert_close(tf.div, s / s.pow(2).mean(-1, keepdim=True).sqrt(), rtol=1e-4, atol=1e-5)
    plain = KeyValueTransform(_cfg(key_scale=0.5, key_scale_q=True), k, v)  # no queries: rms(k) ** a
    torch.testing.assert_close(
        plain.div, rk.sqrt() / rk.sqrt().pow(2).mean(-1, keepdim=True).sqrt(), rtol=1e-4, atol=1e-5
    )


def test_simulated_pca_stores_main_directions_exactly():
    """key_pca / value_pca with fit="mean": the main direction reflected onto e_0, whose component the
    offset stores exactly, so the codes' error drops."""
    B, S, H, d = 1, 200, 2, 64
    g = torch.Generator().manual_seed(4)
    main = torch.nn.functional.normalize(torch.randn(H, d, generator=g), dim=-1)
    k = torch.randn(B, S, H, d, generator=g) * 0.3 + torch.randn(B, S, H, 1, generator=g) * 4 * main
    v = torch.randn(B, S, H, d, generator=g) * 0.3 + (2 + torch.randn(B, S, H, 1, generator=g)) * 3 * main
    tf = KeyValueTransform(_cfg(key_pca=True, value_pca=True), k, v)
    pk = reflect(main[None], tf.house)[0]
    assert torch.allclose(pk.abs()[:, 0], torch.ones(H), atol=0.02)
    torch.testing.assert_close(tf.values(tf.values(v)), v, rtol=1e-5, atol=1e-5)  # its own inverse
    err = {}
    for pca in (False, True):
        cache = QuantizedKVCache(B, S, H, d, fit="mean" if pca else "norm")
        kk, vv = (tf.keys(k), tf.values(v)) if pca else (k - k.mean(1, keepdim=True), v)
        cache.append(kk, vv)
        kd, vd = cache.dequantize()
        kd, vd = (tf.keys_back(kd), tf.values(vd)) if pca else (kd + k.mean(1, keepdim=True), vd)
        err[pca] = (rel(kd, k), rel(vd, v))
    assert err[True][0] < 0.6 * err[False][0] and err[True][1] < 0.6 * err[False][1]


def test_query_shift_of_selected_rows():
    """query_shift for cache rows picked by batch_idx (the fused path's GQA views)."""
    B, S, H, Hq, d = 3, 40, 2, 6, 64
    cache = QuantizedKVCache(B, 64, H, d, key_center=True)
    cache.append(keys_with_offset(B, S, H, d, seed=9), torch.randn(B, S, H, d))
    rows = torch.tensor([2, 0], dtype=torch.int32)
    q = torch.randn(2, 3, Hq, d)
    mu = cache.k_center[rows.long()].repeat_interleave(Hq // H, 1)
    torch.testing.assert_close(cache.query_shift(q, rows), torch.einsum("bshd,bhd->bhs", q, mu))
    torch.testing.assert_close(cache.query_shift(q), cache.query_shift(q, torch.tensor([0, 1])))


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
    torch.testing.assert_close(cache.k_center, unturned.mean(1), rtol=1e-4, atol=1e-4)
    pos = torch.arange(S).expand(B, -1)
    torch.testing.assert_close(
        cache.untransform_keys(cache.transform_keys(k, positions=pos), positions=pos), k, rtol=1e-5, atol=1e-4
    )
    # attention over the cache (the reference path) is attention over its dequantized keys, as stored
    q = torch.randn(B, 1, 2 * H, d)
    out, lse = flash_attn_with_kvcache(q, cache, return_softmax_lse=True)
    k_hat, v_hat = cache.dequantize()
    ref_out, ref_lse = attention_reference(
        q, k_hat, v_hat, softmax_scale=d**-0.5, key_lengths=torch.full((B,), S, dtype=torch.int32)
    )
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
    with pytest.raises(ValueError, match="key_center"):
        QuantizedKVCache(1, 8, 1, 64, key_center="pre")
    cache = QuantizedKVCache(1, 8, 1, 64, key_center="rope", rope_inv_freq=inv)
    with pytest.raises(ValueError, match="positions"):
        cache.transform_keys(torch.randn(1, 4, 1, 64))
    with pytest.raises(ValueError, match="no shared shift"):
        cache.query_shift(torch.randn(1, 1, 1, 64))
