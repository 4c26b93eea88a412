"""Quantization-aware fine-tuning (flash_attn_tq.qat): the fake quantization's forward is the codec's
round trip, its gradient the clipped straight-through estimator, and it trains inside a transformers
model through the registered attention function."""

import pytest
import torch

from flash_attn_tq import TurboQuantizer
from flash_attn_tq.qat import clip_mask, fake_quant, fake_quant_kv

D = 64


def in_range_rotated(shape, seed=0):
    """Rotated vectors whose every coordinate is well inside the 2..4-bit code range."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, D, generator=g) * 2 - 1  # |y| <= sqrt(3) < 2-bit edge (2 x 0.996 step)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("grid", ["uniform", "lloyd_max"])
def test_forward_is_codec_round_trip(bits, grid):
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 7, D) * 3
    x[0, 0, 0] = 0  # a zero vector stays zero
    q = TurboQuantizer(D, bits, grid, seed=5)
    codes, meta = q.quantize(x)
    scale_only = grid == "uniform"  # the default: the cache's scale-only format on the uniform grid
    ref = q.dequantize(codes, meta[..., :1] if scale_only else meta)
    out = fake_quant(x, bits, seed=5, grid=grid)
    assert out.dtype == x.dtype and torch.equal(out, ref)
    assert torch.equal(out[0, 0, 0], torch.zeros(D))
    if scale_only:  # the (scale, offset) pair of scale_only=False caches
        assert torch.equal(fake_quant(x, bits, seed=5, scale_only=False), q.dequantize(codes, meta))
    else:
        with pytest.raises(ValueError):
            fake_quant(x, bits, grid=grid, scale_only=True)
    # the lower-precision input dtype is kept
    xb = x.to(torch.bfloat16)
    cb, mb = q.quantize(xb)
    assert torch.equal(
        fake_quant(xb, bits, seed=5, grid=grid), q.dequantize(cb, mb[..., :1] if scale_only else mb).to(torch.bfloat16)
    )


@pytest.mark.parametrize("grid", ["uniform", "lloyd_max"])
def test_identity_gradient_when_nothing_clipped(grid):
    q = TurboQuantizer(D, 3, grid, seed=0)
    x = q.unrotate(in_range_rotated((4, 5))).requires_grad_(True)
    assert bool(clip_mask(q, q.rotate(x.detach())).all())
    g = torch.randn_like(x)
    fake_quant(x, 3, grid=grid).backward(g)
    torch.testing.assert_close(x.grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clipped_values_get_zero_gradient(bits):
    q = TurboQuantizer(D, bits, "uniform", seed=0)
    r = in_range_rotated((3,), seed=1)
    r[0, 5], r[1, 7], r[1, 9], r[2, 0] = 40.0, -40.0, 40.0, -40.0  # far past the outermost code
    x = q.unrotate(r).requires_grad_(True)
    mask = clip_mask(q, q.rotate(x.detach()))
    expected = torch.ones(3, D, dtype=torch.bool)
    expected[0, 5] = expected[1, 7] = expected[1, 9] = expected[2, 0] = False
    assert torch.equal(mask, expected)
    codes, _ = q.quantize(x.detach())
    assert codes[0, 5] == (1 << bits) - 1 and codes[1, 7] == 0  # the clamp did clip them
    g = torch.randn(3, D)
    fake_quant(x, bits).backward(g)
    gr = q.rotate(x.grad)
    # in the rotated domain: zero on the clipped coordinates, the incoming gradient elsewhere
    assert float(gr[~expected].abs().max()) < 1e-5
    torch.testing.assert_close(gr[expected], q.rotate(g)[expected], rtol=1e-5, atol=1e-5)


def test_clip_mask_matches_the_codec_clamp():
    torch.manual_seed(0)
    for bits in (2, 3, 4):
        q = TurboQuantizer(D, bits)
        x = torch.distributions.StudentT(2.0).sample((64, D))  # heavy tails: some coordinates clip
        mask = clip_mask(q, q.rotate(x))
        codes, _ = q.quantize(x)
        y = q.rotate(x)
        y = y * D**0.5 / y.norm(dim=-1, keepdim=True)
        step = q.levels_unit[1] - q.levels_unit[0]
        raw = torch.floor(y / step + ((1 << bits) - 1) / 2 + 0.5)  # the code before the clamp
        assert torch.equal(mask, raw == codes.float())
        assert (~mask).any() and mask.any()


def test_sink_tokens_stay_full_precision():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 10, D, requires_grad=True), torch.randn(2, 3, 10, D)
    kq, vq = fake_quant_kv(k, v, k_bits=3, v_bits=16, sink_tokens=4)
    assert torch.equal(kq[:, :, :4], k[:, :, :4]) and vq is v
    assert torch.equal(kq[:, :, 4:], fake_quant(k[:, :, 4:].detach(), 3))
    kq.sum().backward()
    assert torch.equal(k.grad[:, :, :4], torch.ones(2, 3, 4, D))


transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=D,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


def test_gradients_flow_through_a_llama_model():
    from flash_attn_tq.qat import register_fake_quant_attention

    model = tiny_llama()
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        loss_fp = model(ids, labels=ids, use_cache=False).loss
    model.set_attn_implementation(register_fake_quant_attention("tq_fake_quant_test16", k_bits=16, v_bits=16))
    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids, use_cache=False).loss, loss_fp)  # 16 bits: plain SDPA
    model.set_attn_implementation(register_fake_quant_attention("tq_fake_quant_test", k_bits=3, v_bits=3))
    model.train()
    loss = model(ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss) and not torch.equal(loss.detach(), loss_fp)
    loss.backward()
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            grad = getattr(layer.self_attn, name).weight.grad
            assert grad is not None and bool(torch.isfinite(grad).all()), (i, name)
            assert float(grad.abs().max()) > 0, (i, name)


@pytest.mark.parametrize("scale_only", [True, False])
def test_forward_matches_the_real_cache(scale_only):
    """The fake-quant forward equals attending over a TQCache with the same codec (no window, no sinks,
    no key centering; every token, the prompt included, over the quantized cache)."""
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache
    from flash_attn_tq.qat import register_fake_quant_attention

    model = tiny_llama(seed=2).eval()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.set_attn_implementation(register_fake_quant_attention(k_bits=3, v_bits=3, scale_only=scale_only))
        fq = model(ids, use_cache=False).logits
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = TQCache(
            model.config,
            fp16_window=0,
            sink_tokens=0,
            key_center=False,
            late_k_bits=None,
            scale_only=scale_only,
            prefill="quantized",
        )
        real = model(ids, past_key_values=cache, use_cache=True).logits
        model.set_attn_implementation("sdpa")
        full = model(ids, use_cache=False).logits
    err = float((fq - real).abs().max())
    assert err < 1e-3, err
    assert float((fq - full).abs().max()) > 10 * err  # (the quantization is visible)
