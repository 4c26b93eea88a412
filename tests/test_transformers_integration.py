"""flash_attn_tq.integrations.transformers on the CPU: a tiny randomly initialised Llama (GQA, RoPE).

The oracle recomputes every layer's attention in float64 from what the cache holds
(``QuantizedKVCache.dequantize()`` plus the 16-bit sink tokens), so ``generate`` with TQCache must
give the same tokens and (to float32 rounding) the same scores.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)

from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402

from flash_attn_tq import QuantizedKVCache  # noqa: E402
from flash_attn_tq.integrations.calibration import (  # noqa: E402
    FINE_BITS,
    HEAD_WIDTHS,
    allocate_head_bits,
    allocate_key_bits,
    calibrate_copy_heads,
    calibrate_head_bits,
    calibrate_key_bits,
    copy_head_sensitivity,
    head_kl,
    head_sensitivity,
    key_bit_sensitivity,
)
from flash_attn_tq.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    DEFAULTS,
    NO_FP16_WINDOW,
    TQCache,
    TQLayer,
    tq_attention_forward,
)

ORACLE = "tq_oracle_test"


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """float64 attention of query [B, Hq, Sq, D] over the layer's dequantized cache (sinks and window
    in 16-bit: query row i's own last fp16_window keys, where the side's verify_tokens - 1 spare slots
    still hold them)."""
    layer = getattr(key, "_tq_layer", None)
    if layer is not None:
        layer.commit()
    B, Hq, Sq, D = query.shape
    if layer is None or (layer.prefill == "full" and layer.first_chunk):  # plain / protected / prefill
        ks, vs = key.double(), value.double()
        windows = [(ks, vs)] * Sq
    else:
        spec = layer.caches[0].spec
        R, side = spec.fp16_window, spec.side_recent
        held = {}
        for i in range(Sq):  # (row i's keys end Sq - 1 - i before the last row's)
            w = min(R + Sq - 1 - i, side) if side > R else None
            if w not in held:
                held[w] = tuple(x.double().transpose(1, 2) for x in layer.dequantize(window=w))
        windows = [held[min(R + Sq - 1 - i, side) if side > R else None] for i in range(Sq)]
    rows = []
    for i, (ks, vs) in enumerate(windows):
        G = Hq // ks.shape[1]
        ks, vs = ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1)
        s = query[:, :, i : i + 1].double() @ ks.transpose(-1, -2) * (scaling or D**-0.5)
        s = s.masked_fill(torch.arange(ks.shape[2], device=s.device) > ks.shape[2] - Sq + i, -math.inf)
        rows.append(torch.softmax(s, -1) @ vs)
    out = torch.cat(rows, 2)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


AttentionInterface.register(ORACLE, oracle_attention)


def tiny_model(seed=0, layers=3, kv_heads=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64 * kv_heads,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits so greedy choices are not near-ties
        model.lm_head.weight.mul_(8)
    return model


def generate(model, impl, ids, cache, n=24):
    model.set_attn_implementation(impl)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    return out.sequences, torch.stack(out.scores, 1)


CASES = [
    dict(),  # the defaults (window larger than these sequences: every token 16-bit)
    dict(fp16_window=0, sink_tokens=0, key_center=False),
    dict(fp16_window=8, sink_tokens=4, key_center=True),
    dict(fp16_window=8, sink_tokens=2, key_center=True, prefill="quantized"),
    dict(fp16_window=0, sink_tokens=0, quantizer="asym", prefill="quantized"),
    dict(fp16_window=4, sink_tokens=4, key_center=True, fit="mean"),
    dict(fp16_window=16, sink_tokens=0, k_bits=4, v_bits=3, protected_layers=(0,)),
    dict(fp16_window=4, sink_tokens=2, key_center=True, layer_options={1: dict(k_bits=4), 2: dict(k_bits=4)}),
    dict(fp16_window=4, sink_tokens=2, scale_only=False, late_k_bits=None),  # (scale, offset), 3-bit keys everywhere
    dict(fp16_window=8, window_bits=4, sink_tokens=2),  # age-based precision (NO_FP16_WINDOW's form)
    dict(fp16_window=8, window_bits=4, sink_tokens=0, quantizer="asym", prefill="quantized"),
    # per-head bits: a layer's kv heads in two caches (8-bit keys in one head), or three layers' worth
    dict(fp16_window=4, sink_tokens=2, head_options={(0, 1): dict(k_bits=8), (2, 0): dict(k_bits=4, v_bits=4)}),
    dict(fp16_window=0, sink_tokens=3, prefill="quantized", key_center=True, head_options={(1, 0): dict(k_bits=8)}),
    # RoPE-aware key centering (the reference path): sinks and window at their positions, head groups
    dict(fp16_window=8, sink_tokens=4, key_center="rope"),
    dict(fp16_window=4, sink_tokens=2, key_center="rope", prefill="quantized", head_options={(1, 0): dict(k_bits=8)}),
    dict(fp16_window=8, window_bits=4, sink_tokens=0, key_center="rope"),
]


@pytest.mark.parametrize("opts", CASES, ids=[str(i) for i in range(len(CASES))])
def test_generate_matches_attention_over_dequantized_cache(opts):
    model = tiny_model()
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    n_new = 24
    seq, scores = generate(model, ATTN_IMPLEMENTATION, ids, TQCache(model.config, max_cache_len=16, **opts), n_new)
    seq_o, scores_o = generate(model, ORACLE, ids, TQCache(model.config, max_cache_len=16, **opts), n_new)
    assert torch.equal(seq, seq_o)
    torch.testing.assert_close(scores, scores_o, rtol=1e-4, atol=1e-3)
    assert seq.shape == (2, 40 + n_new)
    _, scores_fp = generate(model, "sdpa", ids, None, n_new)
    gap = (scores[:, :4] - scores_fp[:, :4]).abs().max().item()
    if opts:  # quantization is visible (the default window covers these short sequences: exact)
        assert gap > 1e-3
    else:
        assert gap < 1e-3


@pytest.mark.parametrize(
    "heads,groups",
    [({(1, 1): dict(k_bits=8)}, [(0, 2), (1,)]), ({(1, 2): dict(k_bits=8, v_bits=8)}, [(0, 1), (2,)])],
    ids=["apart: gathers", "adjacent: slices"],
)
def test_head_groups_apart_or_adjacent(heads, groups):
    """A layer's head groups are gathered when a group's heads lie apart and sliced when each group is
    a run of adjacent heads; either way the tokens and scores are attention's over the dequantized cache."""
    model = tiny_model(kv_heads=3)
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(2))
    caches = [TQCache(model.config, max_cache_len=16, fp16_window=4, sink_tokens=2, head_options=heads) for _ in "ab"]
    seq, scores = generate(model, ATTN_IMPLEMENTATION, ids, caches[0], 8)
    seq_o, scores_o = generate(model, ORACLE, ids, caches[1], 8)
    assert caches[0].layers[1].groups == groups
    assert torch.equal(seq, seq_o)
    torch.testing.assert_close(scores, scores_o, rtol=1e-4, atol=1e-3)


def test_cache_bookkeeping():
    model = tiny_model(layers=2)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 96, (1, 30))
    cache = TQCache(model.config, max_cache_len=8, fp16_window=4, sink_tokens=3, protected_layers=(1,))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        for t in range(5):
            model(torch.randint(3, 96, (1, 1)), past_key_values=cache)
    assert cache.get_seq_length() == 35
    layer = cache.layers[0]
    assert isinstance(layer, TQLayer) and layer.length == 35
    qc = layer.qcache
    assert isinstance(qc, QuantizedKVCache) and int(qc.seqlens[0]) == 35 and qc.max_seqlen >= 35
    # [B, sinks + window + verify_tokens - 1, kv heads, D]
    assert qc.sink_tokens == 3 and qc.k_side.shape == (1, 3 + 4 + 15, 2, 64)
    assert qc.fp16_window == 4 and qc.k_bits == 3 and qc.key_center
    assert cache.layers[1].get_seq_length() == 35 and not isinstance(cache.layers[1], TQLayer)
    assert cache.quantized_caches()[1] is None
    assert qc.scale_only and qc.k_meta.shape[-1] == 1  # (one quantized layer pays for no 4-bit keys)
    assert cache.bits_per_element(64) == pytest.approx((3.25 + 16) / 2)


def test_layer_options():
    """Per-layer overrides: 4-bit keys in the last layers (the best 3.5-bit mix of the quality study)."""
    model = tiny_model(layers=4)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = TQCache(
        model.config,
        fp16_window=0,
        scale_only=False,
        late_k_bits=None,
        layer_options={i: {"k_bits": 4} for i in (2, 3)},
    )
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 20)), past_key_values=cache)
    assert [qc.k_bits for qc in cache.quantized_caches()] == [3, 3, 4, 4]
    assert all(qc.v_bits == 3 for qc in cache.quantized_caches())
    assert cache.bits_per_element(64) == pytest.approx((3.5 + 4.5) / 4 + 3.5 / 2)  # K 3.5 / 4.5, V 3.5
    # the same mix with scale-only metadata (turbo's norm fit): 3.5 bits/element at head_dim 64
    mixed = TQCache(model.config, fp16_window=0, late_k_bits=None, layer_options={i: {"k_bits": 4} for i in (2, 3)})
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 20)), past_key_values=mixed)
    assert all(qc.scale_only and qc.k_meta.shape[-1] == 1 for qc in mixed.quantized_caches())
    assert mixed.bits_per_element(64) == pytest.approx(3.5)
    # the default: 4-bit keys in as many last layers as scale-only metadata pays for, 3 + 32 / head_dim bits
    default = TQCache(model.config)
    assert [default.layer_spec(i).k_bits for i in range(4)] == [3, 3, 4, 4]
    assert default.bits_per_element(64) == pytest.approx(3.5)
    assert [TQCache(model.config, protected_layers=(0,)).layer_spec(i).k_bits for i in range(4)] == [
        3,
        3,
        3,
        4,
    ]
    assert TQCache(model.config, layer_options={3: {"k_bits": 3}}).layer_spec(3).k_bits == 3
    assert all(
        TQCache(model.config, **o).layer_spec(3).k_bits == 3
        for o in (dict(late_k_bits=None), dict(scale_only=False), dict(quantizer="asym"), dict(fit="mean"))
    )
    model.config.head_dim = 128  # a quarter of the layers at head_dim 128: 3.25 bits/element
    wide = TQCache(model.config)
    assert [wide.layer_spec(i).k_bits for i in range(4)] == [3, 3, 3, 4]
    assert wide.bits_per_element(128) == pytest.approx(3.25)
    with pytest.raises(ValueError, match="late_k_bits"):
        TQCache(None, late_k_bits=4)
    with pytest.raises(ValueError, match="late_k_bits"):
        TQCache(model.config, late_k_bits=5)
    with pytest.raises(ValueError, match="late_k_bits"):
        TQCache(model.config, layer_options={1: {"late_k_bits": 4}})
    with pytest.raises(ValueError, match="k_bits"):
        TQCache(model.config, layer_options={1: {"k_bits": 5}})
    with pytest.raises(ValueError, match="sink_tokens"):
        TQCache(model.config, layer_options={1: {"sink_tokens": 2}})
    for kwargs, name in (
        (dict(max_cache_len=0), "max_cache_len"),
        (dict(max_cache_len=2.5), "max_cache_len"),
        (dict(protected_layers=(99,)), "protected_layers"),
        (dict(protected_layers="ab"), "protected_layers"),
        (dict(layer_options={99: {"k_bits": 4}}), "layer_options"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(sink_tokens="x"), "sink_tokens"),
    ):
        with pytest.raises((TypeError, ValueError), match=name):
            TQCache(model.config, **kwargs)
    with pytest.raises(TypeError, match="config"):  # a dict would silently drop the late 4-bit layers
        TQCache(model.config.to_dict())


def test_defaults_and_errors():
    model = tiny_model(layers=1)
    cache = TQCache(model.config)
    assert cache.sink_tokens == DEFAULTS["sink_tokens"]
    assert cache.spec.fp16_window == DEFAULTS["fp16_window"]
    assert DEFAULTS["fp16_window"] + DEFAULTS["sink_tokens"] <= 128
    with pytest.raises(ValueError):
        TQCache(model.config, prefill="lazy")
    with pytest.raises(ValueError):
        TQCache(model.config, k_bits=5)
    # padded batches are refused rather than silently mis-attended
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 96, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for capacity in (None, 64):  # (with a capacity the mask spans it: only the tokens are checked)
        with pytest.raises(NotImplementedError):
            model(ids, attention_mask=mask, past_key_values=TQCache(model.config, max_cache_len=capacity))
    cache = TQCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3)
    assert cache.get_seq_length() == 14 and cache.get_max_length() == 64


def test_other_attention_implementation_is_refused():
    model = tiny_model(layers=1)
    model.set_attn_implementation("sdpa")
    cache = TQCache(model.config, fp16_window=0, sink_tokens=0)
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 8)), past_key_values=cache)
        with pytest.raises(RuntimeError):
            model(torch.randint(3, 96, (1, 1)), past_key_values=cache)


def test_without_cache_falls_back_to_sdpa():
    model = tiny_model(layers=1)
    ids = torch.randint(3, 96, (1, 20))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, use_cache=False).logits
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, ref)
    assert tq_attention_forward is not None


def test_pack_errors_are_read_back_once_a_forward():
    """The layers share one pack-error word; only the last quantized layer reads it back (one host
    sync a step on the GPU), and a read raises for any bit set and clears it."""
    from flash_attn_tq.health import PackErrors

    model = tiny_model(layers=3)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = TQCache(model.config, protected_layers=(2,))
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 12)), past_key_values=cache)
    layers = cache.layers
    assert [layer.checks_pack_errors for layer in layers[:2]] == [False, True]
    assert layers[0].pack_errors is layers[1].pack_errors is cache.pack_errors
    errors = PackErrors()
    errors.check()  # nothing written yet
    flags = errors.buffer(torch.device("cpu"))
    errors.check()
    flags.fill_(1)  # the NaN / Inf bit
    with pytest.raises(ValueError, match="NaN"):
        errors.check()
    assert int(flags.item()) == 0
    errors.check()
    qc = QuantizedKVCache(1, 8, 2, 64)
    with pytest.raises(ValueError, match="error_flags"):
        qc.append(torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), error_flags=torch.zeros(1, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and the built extension")
def test_pack_errors_surface_in_the_same_forward_on_the_gpu():
    """A NaN key in a middle layer is written by the pack kernel without a sync; the last layer's
    read-back raises it within the same forward call, and the next clean forward runs."""
    from flash_attn_tq import ops

    if not ops.extension_available():
        pytest.skip("the CUDA extension is not built")
    model = tiny_model(layers=3).cuda().half()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = TQCache(model.config, fp16_window=0, sink_tokens=0)
    ids = torch.randint(3, 96, (1, 12), device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache)
        bias = torch.zeros(model.config.num_key_value_heads * 64, device="cuda", dtype=torch.float16)
        bias[5] = float("nan")
        proj = model.model.layers[1].self_attn.k_proj
        hook = proj.register_forward_hook(lambda mod, inp, out: out + bias)
        with pytest.raises(ValueError, match="NaN"):
            model(ids[:, :1], past_key_values=cache)
        hook.remove()
    assert int(cache.pack_errors.flags.item()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and the built extension")
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        NO_FP16_WINDOW,
        dict(head_options={(2, 1): {"k_bits": 8}, (0, 0): {"k_bits": 4}}),
        dict(key_center="rope", head_options={(1, 0): {"k_bits": 4}}),
        dict(key_center="rope", head_options={(1, 1): {"k_bits": 8, "v_bits": 8}}),
        dict(late_k_bits=None, head_options={(1, 0): {"k_bits": 8, "v_bits": 8}}),
    ],
    ids=["default", "no_fp16_window", "head_options", "rope_center", "copy_head_last", "copy_head_first"],
)
def test_fused_decode_matches_the_oracle_on_the_gpu(opts):
    """A float16 model on the GPU: the prompt, a 5-token chunk and single tokens through the fused
    kernel (+ the recent window: 16-bit, or 4-bit codes; per-head bits: the last layer's second head
    at 8-bit keys, attended last) against float64 attention over the same dequantized cache; every
    step's logits agree to float16 rounding (key_center='rope': the kernel adds q . R(p) c, the
    window pass and the sinks get R(p) c back in PyTorch; a K8V8 copy head: both head groups in one
    launch)."""
    from flash_attn_tq import last_path, ops

    if not ops.extension_available():
        pytest.skip("the CUDA extension is not built")
    path = "quantized:fused-cuda"
    model = tiny_model(layers=3).cuda().half()
    opts = dict(opts, fp16_window=min(DEFAULTS["fp16_window"], 16), sink_tokens=2)
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(4)).cuda()
    logits = {}
    for impl in (ATTN_IMPLEMENTATION, ORACLE):
        model.set_attn_implementation(impl)
        cache, steps = TQCache(model.config, max_cache_len=32, **opts), []
        with torch.no_grad():
            for a, b in ((0, 40), (40, 45), (45, 46), (46, 47), (47, 48)):
                steps.append(model(ids[:, a:b], past_key_values=cache).logits[:, -1].float())
                if impl == ATTN_IMPLEMENTATION and a:
                    assert last_path() == path
            if impl == ATTN_IMPLEMENTATION:  # a K8V8 copy head: its layer's two head groups in one launch
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    model(ids[:, 48:49], past_key_values=cache)
                pairs = sum(e.name.count("decode_pair_kernel") for e in prof.events())
                copy_head = any(o.get("v_bits") == 8 for o in opts.get("head_options", {}).values())
                assert (pairs > 0) == copy_head
        logits[impl] = torch.stack(steps)
    got, want = logits[ATTN_IMPLEMENTATION], logits[ORACLE]
    assert (got - want).abs().max() < 2e-2 * want.abs().max()


def test_defaults_are_the_quality_study_default():
    """TQCache.calibrated(model) is the configuration the quality study (benchmarks/eval_quality.py)
    reports as the default, and TQCache(config) (no model to measure) its uncalibrated one: the same
    options, the same bits (flash_attn_tq.testing.quality holds the study's configurations)."""
    from flash_attn_tq.testing import quality

    layers = 30
    config = LlamaConfig(
        num_hidden_layers=layers, head_dim=64, hidden_size=576, num_attention_heads=9, num_key_value_heads=3
    )  # SmolLM2's shape

    class Shape:  # calibrate_key_bits needs only the config when given a sensitivity
        pass

    model = Shape()
    model.config = config
    sensitivity = {(i, b): (1.0 + (i * 7) % 11) / b**2 for i in range(layers) for b in (3, 4)}
    F = FINE_BITS
    copy = {
        (i, h, k, v): 0.01 + (0.5 if (i, h) == (18, 2) else 0.0) * (k < F) + 0.1 * (v < F)
        for i in range(layers)
        for h in range(3)
        for k, v in ((3, F), (F, 3), (F, F))
    }
    cal = TQCache.calibrated(model, sensitivity=sensitivity, copy_sensitivity=copy)
    assert cal.head_options == {(18, 2): {"k_bits": F, "v_bits": F}}  # (calibrated's default: one copy head)
    for name, cache in ((quality.UNCALIBRATED_DEFAULT, TQCache(config)), (quality.DEFAULT, cal)):
        cfg = quality.CONFIGS[name]
        if cfg.get("k_cal"):
            assert tuple(cfg["k_cal"]) == (3, 4) and cfg["copy_heads"] == 1  # calibrated's defaults
            cfg = dict(
                cfg,
                k_layer_bits={i: cal.layer_spec(i).k_bits for i in range(layers)},
                head_bits={f"{i},{h}": [o["k_bits"], o["v_bits"]] for (i, h), o in cal.head_options.items()},
                kv_heads=3,
            )
        assert cache.sink_tokens == cfg["sink_tokens"]
        for i in range(layers):
            opts = cache.layer_spec(i).options()
            assert opts["k_bits"] == quality.key_bits_of(cfg, i, layers), (name, i)
            assert opts["v_bits"] == (2 if i in quality.v2_layers(cfg, layers) else cfg["v_bits"]), i
            want = quality.tq_options(cfg)  # (rope_center="exact" is key_center="rope")
            for o in ("quantizer", "fit", "fp16_window", "key_center", "scale_only"):
                assert opts[o] == want[o], (name, i, o)
        assert cache.bits_per_element(64) == pytest.approx(quality.config_bits(cfg, 64, layers))
    assert TQCache(config).bits_per_element(64) == pytest.approx(3.5)  # the budget at head_dim 64
    # the copy head (10 bits) and 11 layers of 4-bit keys (33): 43 of the 45 bits
    assert cal.bits_per_element(64) == pytest.approx(3.5 - 2 / (2 * 90))
    # the calibrated bits go to the layers with the largest measured gains
    gains = sorted(range(layers), key=lambda i: sensitivity[(i, 4)] - sensitivity[(i, 3)])
    assert {i for i in range(layers) if cal.layer_spec(i).k_bits == 4} == set(gains[:11])


def test_allocate_key_bits_spends_the_budget_where_it_gains_most():
    kl = {
        (0, 2): 5.0,
        (0, 3): 1.0,
        (0, 4): 0.5,  # layer 0: a raise gains 0.5, a lowering costs 4
        (1, 2): 1.1,
        (1, 3): 1.0,
        (1, 4): 0.1,  # layer 1: gains 0.9
        (2, 2): 1.01,
        (2, 3): 1.0,
        (2, 4): 0.99,
    }  # layer 2: gains 0.01, costs 0.01
    assert allocate_key_bits(kl, [0, 1, 2], 1) == {0: 4, 1: 4, 2: 2}  # + a raise paid by lowering layer 2
    assert allocate_key_bits(kl, [0, 1, 2], 0) == {0: 3, 1: 4, 2: 2}
    assert allocate_key_bits(kl, [0, 1, 2], 3) == {0: 4, 1: 4, 2: 4}
    no_two = {k: v for k, v in kl.items() if k[1] != 2}
    assert allocate_key_bits(no_two, [0, 1, 2], 1) == {0: 3, 1: 4, 2: 3}
    # a layer is never raised and lowered at once; a raise that gains nothing is not taken
    assert allocate_key_bits(
        {(0, 2): 1.001, (0, 3): 1.0, (0, 4): 0.1, (1, 2): 1.1, (1, 3): 1.0, (1, 4): 0.9}, [0, 1], 0
    ) == {0: 4, 1: 2}
    assert allocate_key_bits({(0, 3): 1.0, (0, 4): 1.0}, [0], 1) == {0: 3}


def test_calibrated_cache_places_the_key_bits_by_measured_sensitivity():
    model = tiny_model(layers=4)
    with torch.no_grad():  # peaked attention, so key precision matters (random weights attend almost uniformly)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    opts = dict(fp16_window=8, sink_tokens=2, v_bits=4)  # (4-bit values: less of their error in the measure)
    sens = key_bit_sensitivity(model, cache_cls=TQCache, tokens=200, span=32, bits=(2, 3, 4), **opts)
    assert set(sens) == {(i, b) for i in range(4) for b in (2, 3, 4)}
    assert all(math.isfinite(v) and v >= 0 for v in sens.values())
    for i in range(4):  # finer keys move the model less
        assert sens[(i, 2)] > sens[(i, 4)], (i, sens)
    total = [sum(sens[(i, b)] for i in range(4)) for b in (2, 3, 4)]
    assert total[0] > total[1] > total[2], total
    cache = TQCache.calibrated(model, sensitivity=sens, **opts)
    # head_dim 64: the 0.25 bit/element scale-only metadata saves pays for 4-bit keys in half the layers
    four = {i for i in range(4) if cache.layer_spec(i).k_bits == 4}
    gains = sorted(range(4), key=lambda i: sens[(i, 4)] - sens[(i, 3)])
    assert four == set(gains[:2])
    assert cache.bits_per_element(64) == pytest.approx(TQCache(model.config, **opts).bits_per_element(64))
    assert cache.layer_spec(0).fp16_window == 8 and cache.sink_tokens == 2
    # a full measurement (no sensitivity given) restores the model's attention implementation
    model.set_attn_implementation("sdpa")
    again = TQCache.calibrated(
        model, protected_layers=(0,), fp16_window=8, sink_tokens=2, layer_options={3: dict(v_bits=4)}
    )  # (measures 3 layers x 2 widths)
    assert model.config._attn_implementation == "sdpa"
    assert again.protected_layers == {0} and again.layer_spec(3).v_bits == 4
    assert sum(again.layer_spec(i).k_bits == 4 for i in (1, 2, 3)) == 1  # 3 quantized layers: 1 raise
    with pytest.raises(ValueError, match="late_k_bits"):
        TQCache.calibrated(model, sensitivity=sens, late_k_bits=4)
    with pytest.raises(ValueError, match="k_bits"):
        calibrate_key_bits(model, bits=(4,), sensitivity=sens)


def test_head_options():
    """Per-head bits: a layer's kv heads in one cache per set of options, the bits counted per head."""
    model = tiny_model(layers=3)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    heads = {(1, 0): {"k_bits": 8}, (2, 1): {"k_bits": 4}}
    cache = TQCache(model.config, fp16_window=4, sink_tokens=2, late_k_bits=None, head_options=heads)
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 20)), past_key_values=cache)
        model(torch.randint(3, 96, (1, 1)), past_key_values=cache)
    caches = cache.quantized_caches()
    assert isinstance(caches[0], QuantizedKVCache) and caches[0].num_kv_heads == 2
    assert [(c.num_kv_heads, c.k_bits) for c in caches[1]] == [(1, 8), (1, 3)]
    assert cache.layers[1].groups == [(0,), (1,)] and cache.layers[2].groups == [(0,), (1,)]
    assert [c.k_bits for c in caches[2]] == [3, 4]
    with pytest.raises(AttributeError, match="caches"):
        cache.layers[1].qcache
    k, v = cache.layers[1].dequantize()
    assert k.shape == v.shape == (1, 21, 2, 64)  # 21 tokens (the 2 sinks among them)
    # codes + scale: 3.25 bits at 3 bits, 8.25 at 8, 4.25 at 4; a layer's heads averaged
    k_bits = [3.25, (8.25 + 3.25) / 2, (3.25 + 4.25) / 2]
    assert cache.bits_per_element(64) == pytest.approx(sum((kb + 3.25) / 2 for kb in k_bits) / 3)
    for bad, match in (
        ({(0, 2): {"k_bits": 8}}, "out of range"),
        ({(0, 0): {"k_bits": 5}}, "k_bits"),
        ({(0, 0): {"sink_tokens": 1}}, "TQCache-wide"),
        ({0: {"k_bits": 8}}, "pairs"),
    ):
        with pytest.raises(ValueError, match=match):
            TQCache(model.config, head_options=bad)
    with pytest.raises(ValueError, match="protected"):
        TQCache(model.config, protected_layers=(0,), head_options={(0, 0): {"k_bits": 8}})


def test_allocate_head_bits_is_the_best_knapsack():
    """Exact: against brute force over every assignment of widths to 5 heads within the budget."""
    import itertools

    every = ((3, 3), (4, 3), (8, 3), (8, 8))
    assert set(HEAD_WIDTHS) <= set(every)
    F = FINE_BITS
    g = torch.Generator().manual_seed(3)
    heads = [(i, h) for i in range(3) for h in range(2)][:5]
    kl = {}
    for hd in heads:
        floor = 0.01 * float(torch.rand(1, generator=g))
        k3, v3 = (float(x) for x in torch.rand(2, generator=g))
        kl[(*hd, F, F)] = floor
        kl[(*hd, 3, F)], kl[(*hd, 4, F)], kl[(*hd, F, 3)] = (
            floor + k3,
            floor + k3 * float(torch.rand(1, generator=g)),
            floor + v3,
        )
    kl[(1, 0, 3, F)], kl[(1, 0, 4, F)], kl[(1, 0, F, 3)] = 10.0, 9.0, 0.02  # a copying head: 4-bit keys barely help
    assert head_kl(kl, (1, 0), 3, 3) == pytest.approx(10.0 + 0.02 - kl[(1, 0, F, F)])
    for budget in (0, 1, 3, 5, 6, 11, 30):
        best = None
        for choice in itertools.product(every, repeat=len(heads)):
            if sum(k + v - 6 for k, v in choice) <= budget:
                total = sum(head_kl(kl, hd, *w) for hd, w in zip(heads, choice))
                best = total if best is None or total < best else best
        got = allocate_head_bits(kl, heads, budget, every)
        assert sum(k + v - 6 for k, v in got.values()) <= budget
        assert sum(head_kl(kl, hd, *got[hd]) for hd in heads) == pytest.approx(best), budget
    assert allocate_head_bits(kl, heads, 5, every)[(1, 0)] == (8, 3)  # the one sensitive head takes the 8-bit keys
    assert set(allocate_head_bits(kl, heads, 30, widths=((3, 3), (4, 3))).values()) == {(4, 3)}


def test_calibrated_per_head():
    model = tiny_model(layers=3)
    with torch.no_grad():  # peaked attention, so key precision matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    opts = dict(fp16_window=8, sink_tokens=2)
    sens = head_sensitivity(model, cache_cls=TQCache, tokens=200, span=32, **opts)
    F = FINE_BITS
    assert set(sens) == {(i, h) + w for i in range(3) for h in range(2) for w in ((3, F), (4, F), (F, 3), (F, F))}
    for i in range(3):
        for h in range(2):  # finer codes move the model less; the 8-bit floor least
            assert sens[(i, h, 3, F)] > sens[(i, h, 4, F)] > sens[(i, h, F, F)] >= 0, (i, h, sens)
            assert sens[(i, h, F, 3)] > sens[(i, h, F, F)], (i, h, sens)
    heads = sorted({k[:2] for k in sens})
    every = ((3, 3), (4, 3), (8, 3), (8, 8))
    cache = TQCache.calibrated(model, per_head=True, widths=every, sensitivity=sens, **opts)
    assert cache.head_options == {
        hd: {"k_bits": k, "v_bits": v}
        for hd, (k, v) in allocate_head_bits(sens, heads, 3, every).items()
        if (k, v) != (3, 3)
    }
    assert cache.head_options and not cache.layer_options
    # the default widths (8-bit codes) cost 5 bits a head: more than this 6-head model's budget of 3
    assert TQCache.calibrated(model, per_head=True, sensitivity=sens, **opts).head_options == {}
    # the budget: 32 / head_dim bits an element over the 6 heads (3), what scale-only metadata saves
    assert cache.bits_per_element(64) <= 3 + 32 / 64 + 1e-9
    four = calibrate_head_bits(model, widths=((3, 3), (4, 3)), sensitivity=sens, **opts)
    assert len(four) == 3 and all(o == {"k_bits": 4, "v_bits": 3} for o in four.values())
    # a split budget: at most fine_budget bits to the 8-bit widths, the rest to 4-bit keys of other heads
    # (here no 8-bit head fits the 6-head model's 3 bits, so they all go to 4-bit keys)
    assert calibrate_head_bits(model, sensitivity=sens, fine_budget=0, **opts) == four
    assert TQCache.calibrated(model, per_head=True, fine_budget=3, sensitivity=sens, **opts).head_options == four
    with pytest.raises(ValueError, match="widths"):
        calibrate_head_bits(model, widths=((2, 3), (3, 3)), sensitivity=sens)
    with pytest.raises(ValueError, match="widths"):
        TQCache.calibrated(model, per_head=True, bits=(3, 4), sensitivity=sens)
    with pytest.raises(ValueError, match="per_head"):
        TQCache.calibrated(model, fine_budget=25, sensitivity=sens)


def test_calibrated_copy_heads():
    """The heads copying rests on at K8V8, paid for by fewer 4-bit-key layers; within the budget."""
    model = tiny_model(layers=10)  # 20 kv heads at head_dim 64: a budget of 10 bits, one K8V8 head
    with torch.no_grad():  # peaked attention, so precision matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    opts = dict(fp16_window=8, sink_tokens=2)
    F = FINE_BITS
    sens = copy_head_sensitivity(model, cache_cls=TQCache, seeds=(0, 1), tokens=200, **opts)
    assert set(sens) == {(i, h) + w for i in range(10) for h in range(2) for w in ((3, F), (F, 3), (F, F))}
    assert all(math.isfinite(v) and v >= 0 for v in sens.values())
    one = [copy_head_sensitivity(model, cache_cls=TQCache, seeds=(s,), tokens=200, **opts) for s in (0, 1)]
    assert sens == pytest.approx({k: (one[0][k] + one[1][k]) / 2 for k in sens})  # the mean over the seeds
    heads = sorted({k[:2] for k in sens})
    gain = {hd: head_kl(sens, hd, 3, 3) - head_kl(sens, hd, F, F) for hd in heads}
    top = max(heads, key=gain.get)
    assert calibrate_copy_heads(model, sensitivity=sens, **opts) == {top: {"k_bits": F, "v_bits": F}}
    assert calibrate_copy_heads(model, heads=3, sensitivity=sens, **opts) == {top: {"k_bits": F, "v_bits": F}}
    assert calibrate_copy_heads(model, heads=0, sensitivity=sens, **opts) == {}
    layer_sens = {(i, b): (10 - i) * (4 - b) + 0.5 for i in range(10) for b in (3, 4)}  # earlier layers gain more
    cache = TQCache.calibrated(model, copy_heads=1, sensitivity=layer_sens, copy_sensitivity=sens, **opts)
    assert cache.head_options == {top: {"k_bits": F, "v_bits": F}}
    # the K8V8 head (10 bits) takes the whole budget that 4-bit keys in 5 of the 10 layers would have had
    assert all(cache.layer_spec(i).k_bits == 3 for i in range(10))
    assert cache.bits_per_element(64) == pytest.approx(3 + 32 / 64)
    plain = TQCache.calibrated(model, copy_heads=0, sensitivity=layer_sens, **opts)
    assert plain.head_options == {}
    assert {i for i in range(10) if plain.layer_spec(i).k_bits == 4} == set(range(5))
    assert calibrate_key_bits(model, sensitivity=layer_sens, spent=4, **opts) == {i: {"k_bits": 4} for i in range(3)}
    # a small model's budget pays for no 8-bit head: nothing is measured, nothing given
    assert calibrate_copy_heads(tiny_model(layers=2), **opts) == {}
    with pytest.raises(ValueError, match="heads"):
        calibrate_copy_heads(model, heads=-1, sensitivity=sens)
    with pytest.raises(ValueError, match="copy_heads"):
        TQCache.calibrated(model, per_head=True, copy_heads=1, sensitivity=sens)
    with pytest.raises(ValueError, match="seeds"):
        copy_head_sensitivity(model, cache_cls=TQCache, seeds=())


def test_copy_sequence_and_copy_span_kl():
    from flash_attn_tq.integrations.calibration import COPY_SKIP, copy_sequence, copy_span_kl

    cfg = tiny_model(layers=1).config
    ids = copy_sequence(cfg, 90, 16, 0, "cpu")
    assert ids.shape == (1, 106) and torch.equal(ids[0, -16:], ids[0, 30:46])
    text = torch.arange(200, 500)
    for seed, start in ((0, 0), (1, 90), (4, 360 % 211)):  # offsets seed * tokens, wrapping
        got = copy_sequence(cfg, 90, 16, seed, "cpu", text_ids=text)[0]
        assert torch.equal(got[:90], text[start : start + 90]) and torch.equal(got[90:], got[30:46])
    with pytest.raises(ValueError, match="text_ids"):
        copy_sequence(cfg, 400, 16, 0, "cpu", text_ids=text)
    kl = torch.zeros(106)
    kl[106 - 16 + COPY_SKIP - 1 : 105] = 1.0  # the predictions of the repeat's tokens COPY_SKIP..15
    assert copy_span_kl(kl, 16) == 1.0 and kl.mean().item() < 0.1


def test_rope_center_takes_the_model_rope():
    from flash_attn_tq.integrations.transformers import rope_inv_freq

    model = tiny_model(layers=2)
    torch.testing.assert_close(rope_inv_freq(model.config), model.model.rotary_emb.inv_freq.float())
    cache = TQCache(model.config, key_center="rope", sink_tokens=3, fp16_window=4)
    spec = cache.layer_spec(0)
    assert cache.sink_tokens == 3 and spec.rope_position_offset == 0  # cache positions are the model's
    torch.testing.assert_close(torch.tensor(spec.rope_inv_freq), model.model.rotary_emb.inv_freq.float())
    with pytest.raises(ValueError, match="config"):
        TQCache(None, key_center="rope")
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    generate(model, ATTN_IMPLEMENTATION, ids, cache, 2)
    qc = cache.layers[0].qcache
    assert qc.rope_center and bool(qc.calibrated.all())
    from flash_attn_tq import last_path

    assert last_path().startswith("quantized:reference (q is not on a CUDA device")


def test_health_per_layer():
    """TQCache(..., health=True): each quantized layer's counters (head groups summed), kept across the
    cache's growth; None for a protected layer."""
    model = tiny_model(layers=3)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = TQCache(
        model.config,
        max_cache_len=8,
        protected_layers=(1,),
        head_options={(2, 1): {"k_bits": 8, "v_bits": 8}},
        health=True,
    )
    with torch.no_grad():
        model(torch.randint(3, 96, (1, 20)), past_key_values=cache)
        for _ in range(4):
            model(torch.randint(3, 96, (1, 1)), past_key_values=cache)
    reports = cache.health()
    assert reports[1] is None and len(reports) == 3
    for r in (reports[0], reports[2]):
        assert r["vectors"] == 24 * 2 and r["k_nonfinite"] == 0 and 0 < r["k_rel_error"] < 0.5
        assert r["sink_occupancy"] == 1.0 and r["window_occupancy"] == pytest.approx(8 / 112)
    assert reports[2]["k_rel_error"] < reports[0]["k_rel_error"]  # one of layer 2's heads at 8 bits
