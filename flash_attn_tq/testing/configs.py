"""The quality study's configurations: every cache setting ``benchmarks/eval_quality.py`` measures.

A configuration is a dict of options (None: full precision), :data:`BASE` with some overridden:

* the codes: ``quantizer`` (turbo | asym), ``k_bits`` / ``v_bits``, ``fit``, ``scale_only`` (one
  fp16 scale a vector, no offset), ``qjl`` (a 1-bit sign sketch of the key residual);
* the 16-bit tokens: ``sink_tokens`` (the first ones), ``fp16_window`` (the most recent ones),
  ``recent_window`` / ``recent_bits`` / ``recent_raw`` (an age band of wider codes instead);
* key and value transforms: ``key_center`` (the prompt's mean post-RoPE key), ``rope_center``
  ("exact": the mean pre-RoPE key turned by RoPE, as ``key_center="rope"``; "tile": simulation
  only), ``value_center``, ``key_scale`` / ``key_scale_q`` / ``key_pca`` / ``value_pca`` (the
  simulation's research transforms), ``klt`` (transform coding), ``mean_error``;
* widths that differ by layer or head: ``k4_layers`` / ``v2_layers`` (named layer sets),
  ``k_cal`` (key bits measured a layer on the model), ``k_hcal`` (widths measured a kv head),
  ``copy_heads`` (kv heads at K8V8 where copying needs them most), ``protect`` (layers in 16-bit).

:data:`DEFAULT` is what ``TQCache.calibrated(model)`` builds and :data:`UNCALIBRATED_DEFAULT`
what ``TQCache(config)`` builds (tests/test_transformers_integration.py holds them equal);
:mod:`flash_attn_tq.testing.quality` maps a configuration onto a TQCache and counts its bits.
Pure data: nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

# Every config tried. Options: quantizer, k_bits, v_bits, fit, fp16_window, sink_tokens,
# key_center, key_scale, protect ("boundary" = first and last layer in 16-bit). None = full precision.
BASE = dict(
    quantizer="turbo",
    k_bits=3,
    v_bits=3,
    fit="norm",
    fp16_window=0,
    sink_tokens=0,
    key_center=False,
    key_scale=0.0,
    key_scale_q=False,
    key_pca=False,
    value_pca=False,
    protect=None,
    qjl=False,
    k4_layers=None,
    v2_layers=None,
    scale_only=False,
    klt=None,
    k_cal=None,
    k_cal_tokens=1024,
    k_hcal=None,
    k_hcal_8bit_units=None,
    recent_window=0,
    recent_bits=(4, 4),
    recent_raw=False,
    mean_error=False,
)


def _cfg(**kw: Any) -> dict[str, Any]:
    """:data:`BASE` with ``kw`` overridden."""
    c = dict(BASE)
    c.update(kw)
    return c


def _mix(layers: str, sinks: int, window: int) -> dict[str, Any]:
    """3-bit keys, 4-bit in `layers` (see k4_layers), scale-only metadata, key centering, sinks + window."""
    return _cfg(k4_layers=layers, scale_only=True, key_center=True, sink_tokens=sinks, fp16_window=window)


CONFIGS = {
    "full": None,
    "asym3": _cfg(quantizer="asym"),
    "asym3+w128": _cfg(quantizer="asym", fp16_window=128),
    "turbo3": _cfg(),
    "turbo3+w128": _cfg(fp16_window=128),
    "turbo3+prot": _cfg(protect="boundary"),
    "turbo3+kc": _cfg(key_center=True),
    "turbo3+kc+sink4": _cfg(key_center=True, sink_tokens=4),
    "turbo3+kc+ks.5+sink4": _cfg(key_center=True, key_scale=0.5, sink_tokens=4),
    "turbo3+kc+sink4+search": _cfg(key_center=True, sink_tokens=4, fit="search"),
    "turbo3+kc+sink4+prot": _cfg(key_center=True, sink_tokens=4, protect="boundary"),
    "turbo3+sink4+w124": _cfg(sink_tokens=4, fp16_window=124),
    "turbo3+kc+sink4+w124": _cfg(key_center=True, sink_tokens=4, fp16_window=124),
    "turbo3+kc+sink4+w124+prot": _cfg(key_center=True, sink_tokens=4, fp16_window=124, protect="boundary"),
    "turbo3+kc+pca+sink4": _cfg(key_center=True, key_pca=True, fit="mean", sink_tokens=4),
    "turbo3+kc+pca+vpca+sink4": _cfg(key_center=True, key_pca=True, value_pca=True, fit="mean", sink_tokens=4),
    "turbo3+kc+pca+vpca+sink4+w124": _cfg(
        key_center=True, key_pca=True, value_pca=True, fit="mean", sink_tokens=4, fp16_window=124
    ),
    "turbo3+kc+ks.5+pca+vpca+sink4": _cfg(
        key_center=True, key_scale=0.5, key_pca=True, value_pca=True, fit="mean", sink_tokens=4
    ),
    "turbo3+kc+ks.5+pca+vpca+sink4+w124": _cfg(
        key_center=True, key_scale=0.5, key_pca=True, value_pca=True, fit="mean", sink_tokens=4, fp16_window=124
    ),
    "turbo3+kc+ksq.5+sink4": _cfg(key_center=True, key_scale=0.5, key_scale_q=True, sink_tokens=4),
    "turbo3+kc+ksq.5+pca+vpca+sink4": _cfg(
        key_center=True, key_scale=0.5, key_scale_q=True, key_pca=True, value_pca=True, fit="mean", sink_tokens=4
    ),
    "turbo3+kc+ks.5+sink4+w124": _cfg(key_center=True, key_scale=0.5, sink_tokens=4, fp16_window=124),
    "turbo3+kc+ksq.5+sink4+w124": _cfg(
        key_center=True, key_scale=0.5, key_scale_q=True, sink_tokens=4, fp16_window=124
    ),
    "turbo3+kc+ksq.5+pca+vpca+sink4+w124": _cfg(
        key_center=True,
        key_scale=0.5,
        key_scale_q=True,
        key_pca=True,
        value_pca=True,
        fit="mean",
        sink_tokens=4,
        fp16_window=124,
    ),
    "K4V2+kc+sink4": _cfg(k_bits=4, v_bits=2, key_center=True, sink_tokens=4),
    "K4V2+kc+sink4+w124": _cfg(k_bits=4, v_bits=2, key_center=True, sink_tokens=4, fp16_window=124),
    "K4V3": _cfg(k_bits=4),
    "K4V3+w128": _cfg(k_bits=4, fp16_window=128),
    "K4V3+kc+sink4+w124": _cfg(k_bits=4, key_center=True, sink_tokens=4, fp16_window=124),
    # TurboQuant's inner-product variant for keys: a 2-bit MSE code plus a 1-bit QJL sign sketch of the
    # residual (q . k estimated without bias) and the residual's norm in place of the offset: 3.5 bits at
    # head_dim 64, as K3
    "K2qjl+V3+kc+sink4": _cfg(k_bits=2, qjl=True, key_center=True, sink_tokens=4),
    "K2qjl+V3+kc+sink4+w124": _cfg(k_bits=2, qjl=True, key_center=True, sink_tokens=4, fp16_window=124),
    # mixed key widths inside 3.5 bits: turbo's norm fit needs no offset (it is -mid * scale), so with
    # scale-only metadata (0.25 bit at head_dim 64) half the layers can hold 4-bit keys
    "K3.5mix(first)+V3+kc+sink4+w124": _mix("first_half", 4, 124),
    "K3.5mix(even)+V3+kc+sink4+w124": _mix("even", 4, 124),
    "K3.5mix(last)+V3+kc+sink4+w124": _mix("last_half", 4, 124),
}
CONFIGS.update(
    {  # the 128 fp16 tokens split between sinks and the recent window; 4-bit keys in the middle layers
        "K3.5mix(last)+V3+kc+sink8+w120": _mix("last_half", 8, 120),
        "K3.5mix(last)+V3+kc+sink16+w112": _mix("last_half", 16, 112),
        "K3.5mix(middle)+V3+kc+sink4+w124": _mix("middle", 4, 124),
        "K3.5mix(last)+V3+kc+sink32+w96": _mix("last_half", 32, 96),
        "K3.5mix(last)+V3+kc+sink4": _mix("last_half", 4, 0),
        # 4-bit keys in every layer, paid for by 2-bit values in the first half (scale-only metadata)
        "K4+V2.5mix(first)+kc+sink4+w124": _cfg(
            k_bits=4, v2_layers="first_half", scale_only=True, key_center=True, sink_tokens=4, fp16_window=124
        ),
        "K4+V2.5mix(last)+kc+sink4+w124": _cfg(
            k_bits=4, v2_layers="last_half", scale_only=True, key_center=True, sink_tokens=4, fp16_window=124
        ),
        "K4+V2.5mix(even)+kc+sink4+w124": _cfg(
            k_bits=4, v2_layers="even", scale_only=True, key_center=True, sink_tokens=4, fp16_window=124
        ),
        # the default with query-aware per-channel key scaling (calibrated on the prompt)
        "K3.5mix(last)+V3+kc+ksq.5+sink4+w124": _cfg(
            k4_layers="last_half",
            scale_only=True,
            key_center=True,
            key_scale=0.5,
            key_scale_q=True,
            sink_tokens=4,
            fp16_window=124,
        ),
        # the first quarter of the layers K3V2, the rest K4V3
        "K3.75mix(last3q)+V2.75mix(firstq)+kc+sink4+w124": _cfg(
            k4_layers="last_3q",
            v2_layers="first_quarter",
            scale_only=True,
            key_center=True,
            sink_tokens=4,
            fp16_window=124,
        ),
        "turbo3+kc+pca+vpca+sink16+w112": _cfg(
            key_center=True, key_pca=True, value_pca=True, fit="mean", sink_tokens=16, fp16_window=112
        ),
        "turbo3+kc+pca+vpca+sink32+w96": _cfg(
            key_center=True, key_pca=True, value_pca=True, fit="mean", sink_tokens=32, fp16_window=96
        ),
    }
)
# Transform coding (simulation only, no kernel yet): a per-(sequence, kv head) KLT calibrated on the
# prompt (eigenvectors of the centered keys' covariance; values likewise), then bits per coordinate by
# greedy reverse water-filling on variance x importance (keys: the queries' energy along the
# eigenvector), uniform Gaussian-optimal grids per coordinate scaled by one float16 gain a token.
# "kb"/"vb": average code bits per element. Measured: worse than turbo's random rotation (see the table).
_KLT = {"klt": dict(kb=3.5, vb=3.0), "pairs": dict(kb=3.5, vb=3.0, mode="pairs")}
CONFIGS.update(
    {
        "klt K3.5V3+sink4+w124": _cfg(klt=_KLT["klt"], sink_tokens=4, fp16_window=124),
        "klt K3.5V3+sink4": _cfg(klt=_KLT["klt"], sink_tokens=4),
        "klt K4V2.5+sink4+w124": _cfg(klt=dict(kb=4.0, vb=2.5), sink_tokens=4, fp16_window=124),
        # RoPE-aware: the calibrated KLT above starves directions the keys rotate into after the prompt
        "pairs K3.5V3+sink4+w124": _cfg(klt=_KLT["pairs"], sink_tokens=4, fp16_window=124),
        "pairs K3.5V3+sink4": _cfg(klt=_KLT["pairs"], sink_tokens=4),
        "pairs K4V2.5+sink4+w124": _cfg(klt=dict(kb=4.0, vb=2.5, mode="pairs"), sink_tokens=4, fp16_window=124),
        "pairs K3V3+sink4": _cfg(klt=dict(kb=3.0, vb=3.0, mode="pairs"), sink_tokens=4),
    }
)

# Key bits per layer measured on the model itself (calibrate_key_bits: a synthetic random-token
# sequence with a repeated span; KL from full precision with one layer quantized at a time), within
# the same budget as the 4-bit late layers; "34": 3- and 4-bit keys only, else 2-bit keys in the
# least sensitive layers pay for 4-bit keys in more of the sensitive ones.
_CAL = dict(scale_only=True, key_center=True, sink_tokens=4)
CONFIGS.update(
    {
        "Kcal+V3+kc+sink4+w124": _cfg(k_cal=(2, 3, 4), fp16_window=124, **_CAL),
        "Kcal34+V3+kc+sink4+w124": _cfg(k_cal=(3, 4), fp16_window=124, **_CAL),
        "Kcal+V3+kc+sink4": _cfg(k_cal=(2, 3, 4), **_CAL),
        "Kcal34+V3+kc+sink4": _cfg(k_cal=(3, 4), **_CAL),
        # measured on a 4K-token synthetic sequence (the span repeated from a third of the way in)
        "Kcal34@4K+V3+kc+sink4+w124": _cfg(k_cal=(3, 4), k_cal_tokens=4096, fp16_window=124, **_CAL),
        "Kcal34@4K+V3+kc+sink4": _cfg(k_cal=(3, 4), k_cal_tokens=4096, **_CAL),
        # age-based precision instead of the fp16 window: the last 128 tokens at 4-bit keys and values
        # (TQCache: NO_FP16_WINDOW, a 128-token window of 4-bit codes)
        "Kcal34+V3+kc+sink4+r128@K4V4": _cfg(k_cal=(3, 4), recent_window=128, **_CAL),
        # the same budget spent a kv head at a time (calibrate_head_bits): 4- or 8-bit keys where the
        # synthetic sequence measures a head most sensitive (copying rests on a few heads)
        "KVhcal+kc+sink4+w124": _cfg(k_hcal=((3, 3), (4, 3), (8, 3), (8, 8)), fp16_window=124, **_CAL),
        "KVhcal+kc+sink4": _cfg(k_hcal=((3, 3), (4, 3), (8, 3), (8, 8)), **_CAL),
        "Khcal+V3+kc+sink4+w124": _cfg(k_hcal=((3, 3), (4, 3), (8, 3)), fp16_window=124, **_CAL),
        # 8-bit codes only (no 4-bit keys): the budget in the few heads the copying needs
        "KV8hcal+kc+sink4+w124": _cfg(k_hcal=((3, 3), (8, 3), (8, 8)), fp16_window=124, **_CAL),
        # split: 25 of the 45 units to 8-bit heads, the other 20 to 4-bit keys where the KL gains most
        "KV8hcal25+K4+kc+sink4+w124": _cfg(
            k_hcal=((3, 3), (8, 3), (8, 8)), k_hcal_8bit_units=25, fp16_window=124, **_CAL
        ),
        # the kv head copying needs most (calibrate_copy_heads: copy-span KL, two synthetic sequences) at
        # K8V8 (10 units), the other 35 as 4-bit keys in 11 layers (calibrate_key_bits(spent=10))
        "Kcal34+copy1+kc+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=1, fp16_window=124, **_CAL),
        "Kcal34+copy2+kc+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=2, fp16_window=124, **_CAL),
        # the default without its fp16 window: nothing but the sinks, or the last 128 tokens as 4-bit codes
        # (TQCache.calibrated(model, **NO_FP16_WINDOW))
        "Kcal34+copy1+kc+sink4": _cfg(k_cal=(3, 4), copy_heads=1, **_CAL),
        "Kcal34+copy1+kc+sink4+r128@K4V4": _cfg(k_cal=(3, 4), copy_heads=1, recent_window=128, **_CAL),
    }
)
# RoPE-aware key centering: the keys' constant part taken out before RoPE (R(p) c, c the prompt's mean
# pre-RoPE key) instead of the prompt's mean post-RoPE key, which only matches near the prompt
_RC = dict(_CAL, key_center=False)
CONFIGS.update(
    {
        "turbo3+rc+sink4+w124": _cfg(rope_center="exact", fp16_window=124, **_RC),
        "turbo3+rct+sink4+w124": _cfg(rope_center="tile", fp16_window=124, **_RC),
        "K3.5mix(last)+V3+rc+sink4+w124": _cfg(k4_layers="last_half", rope_center="exact", fp16_window=124, **_RC),
        "Kcal34+copy1+rc+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=1, rope_center="exact", fp16_window=124, **_RC),
        "Kcal34+copy1+rct+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=1, rope_center="tile", fp16_window=124, **_RC),
        "Kcal34+V3+rc+sink4+w124": _cfg(k_cal=(3, 4), rope_center="exact", fp16_window=124, **_RC),
        "Kcal34+copy1+rc+sink4": _cfg(k_cal=(3, 4), copy_heads=1, rope_center="exact", **_RC),
        "Kcal34+copy1+rc+sink4+r128@K4V4": _cfg(
            k_cal=(3, 4), copy_heads=1, rope_center="exact", recent_window=128, **_RC
        ),
        # value centering (the prompt's mean value out before quantizing, added to the output back)
        "Kcal34+copy1+kc+vc+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=1, value_center=True, fp16_window=124, **_CAL),
        "Kcal34+copy1+rc+vc+sink4+w124": _cfg(
            k_cal=(3, 4), copy_heads=1, rope_center="exact", value_center=True, fp16_window=124, **_RC
        ),
        "Kcal34+copy1+rc+vc+sink4+r128@K4V4": _cfg(
            k_cal=(3, 4), copy_heads=1, rope_center="exact", value_center=True, recent_window=128, **_RC
        ),
        "Kcal34+copy2+rc+sink4+w124": _cfg(k_cal=(3, 4), copy_heads=2, rope_center="exact", fp16_window=124, **_RC),
        "Kcal34+copy1+rc+sink16+w112": _cfg(
            k_cal=(3, 4), copy_heads=1, rope_center="exact", fp16_window=112, **dict(_RC, sink_tokens=16)
        ),
    }
)
# The default with the RoPE center kept on its strongest rotate-half pairs only (simulation only): the
# decode kernel's term would be a chain over that many pairs instead of d / 2.
for _pairs in (16, 8):
    CONFIGS[f"Kcal34+copy1+rc{_pairs}p+sink16+w112"] = dict(
        CONFIGS["Kcal34+copy1+rc+sink16+w112"], rope_center_pairs=_pairs
    )
# The rc configs above place their bits as measured with the post-RoPE centering (kc), as
# TQCache.calibrated(model) does; "Kcal34rc" measures them with the configuration's own RoPE
# centering (news top-1 97.0% against 97.3%, copy 1K -1.0 against -1.4)
_RC16 = dict(_RC, sink_tokens=16, rope_center="exact", cal_own_center=True)
# the calibrated default's options with a recent band of codes in place of the fp16 window
_BAND = dict(_RC, sink_tokens=16, k_cal=(3, 4), copy_heads=1, rope_center="exact")
CONFIGS.update(
    {
        "Kcal34+copy1+rc+sink16+r128@K4V4": _cfg(recent_window=128, **_BAND),
        # the recent tokens as 8-bit codes instead of 16-bit (half the bytes of the side the decode
        # kernel reads: at B=64 x 2K a third of the codes')
        "Kcal34+copy1+rc+sink16+r112@K8V8": _cfg(recent_window=112, recent_bits=(8, 8), **_BAND),
        # ... with their keys as they came, as the 16-bit side holds them (simulation only: a side of
        # codes the decode kernel would attend without the RoPE center's term)
        "Kcal34+copy1+rc+sink16+r112raw@K8V8": _cfg(recent_window=112, recent_bits=(8, 8), recent_raw=True, **_BAND),
        # the 4-bit band's keys as they came, not centered (simulation only: what a ring of codes the
        # decode kernel attends without the RoPE center's term would hold)
        "Kcal34+copy1+rc+sink16+r128raw@K4V4": _cfg(recent_window=128, recent_raw=True, **_BAND),
        "Kcal34rc+copy1+rc+sink16+w112": _cfg(k_cal=(3, 4), copy_heads=1, fp16_window=112, **_RC16),
        "Kcal34rc+copy1+rc+sink16": _cfg(k_cal=(3, 4), copy_heads=1, **_RC16),
        "Kcal34rc+copy1+rc+sink16+r128@K4V4": _cfg(k_cal=(3, 4), copy_heads=1, recent_window=128, **_RC16),
        "K3.5mix(last)+V3+rc+sink16+w112": _cfg(
            k4_layers="last_half", fp16_window=112, **{k: v for k, v in _RC16.items() if k != "cal_own_center"}
        ),
    }
)

# Error compensation: each vector's mean quantization error (over its rotated coordinates) added to
# its stored offset (mean_error; simulation only). It needs the offset (scale_only=False: 16 bits a
# vector, what the default spends on 4-bit keys instead), so it is compared at equal bits with the
# same cache without it and with the default. The other compensation measured, a residual sign
# sketch at the same bits, is the K2qjl rows above.
_ME = dict(_RC, sink_tokens=16, rope_center="exact", scale_only=False)
CONFIGS.update(
    {
        "turbo3+rc+sink16+w112": _cfg(fp16_window=112, **_ME),
        "turbo3+rc+sink16+w112+me": _cfg(fp16_window=112, mean_error=True, **_ME),
        "turbo3+rc+sink16": _cfg(**_ME),
        "turbo3+rc+sink16+me": _cfg(mean_error=True, **_ME),
    }
)

DEFAULT = "Kcal34+copy1+rc+sink16+w112"  # = TQCache.calibrated(model) (flash_attn_tq.integrations.transformers)
NO_WINDOW_DEFAULT = "Kcal34+copy1+rc+sink16+r128@K4V4"  # (calibrated(model, **NO_FP16_WINDOW): a 4-bit recent band)
UNCALIBRATED_DEFAULT = "K3.5mix(last)+V3+rc+sink16+w112"  # = TQCache(config): 4-bit keys in the last layers
QUICK = [
    "full",
    "asym3",
    "turbo3",
    "turbo3+w128",
    "turbo3+kc+sink4",
    "turbo3+kc+sink4+w124",
    NO_WINDOW_DEFAULT,
    DEFAULT,
    UNCALIBRATED_DEFAULT,
    "K4V3",
]
# the configs the product path (--path product|both) decodes through TQCache by default (+ "full", its reference)
PRODUCT = [DEFAULT, UNCALIBRATED_DEFAULT, NO_WINDOW_DEFAULT]
LONG = [
    "full",
    "turbo3",
    "turbo3+kc+pca+vpca+sink4",
    "turbo3+kc+sink4+w124",
    "turbo3+kc+pca+vpca+sink4+w124",
    "turbo3+kc+ksq.5+pca+vpca+sink4",
    "turbo3+kc+ksq.5+pca+vpca+sink4+w124",
    "K3.5mix(last)+V3+kc+sink4+w124",
    "K3.5mix(last)+V3+kc+sink16+w112",
    "K3.5mix(last)+V3+kc+sink32+w96",
    "turbo3+kc+pca+vpca+sink32+w96",
    "K4+V2.5mix(first)+kc+sink4+w124",
    "K4+V2.5mix(last)+kc+sink4+w124",
    "K3.5mix(last)+V3+kc+ksq.5+sink4+w124",
    "Kcal34+V3+kc+sink4+w124",
    "Kcal34@4K+V3+kc+sink4+w124",
    "KVhcal+kc+sink4+w124",
    "KV8hcal+kc+sink4+w124",
    "KV8hcal25+K4+kc+sink4+w124",
    "Kcal34+copy1+kc+sink4+w124",
    "Kcal34+copy2+kc+sink4+w124",
    "Kcal34+copy1+kc+sink4",
    "Kcal34+copy1+kc+sink4+r128@K4V4",
    "K4V3+kc+sink4+w124",
    "turbo3+rc+sink4+w124",
    "turbo3+rct+sink4+w124",
    "K3.5mix(last)+V3+rc+sink4+w124",
    "Kcal34+copy1+rc+sink4+w124",
    "Kcal34+copy1+rct+sink4+w124",
    "Kcal34+V3+rc+sink4+w124",
    "Kcal34+copy1+rc+sink4",
    "Kcal34+copy1+rc+sink4+r128@K4V4",
    "Kcal34+copy1+kc+vc+sink4+w124",
    "Kcal34+copy1+rc+vc+sink4+w124",
    "Kcal34+copy1+rc+vc+sink4+r128@K4V4",
    "Kcal34+copy2+rc+sink4+w124",
    "Kcal34+copy1+rc+sink16+w112",
    "Kcal34+copy1+rc+sink16+r128@K4V4",
    "Kcal34rc+copy1+rc+sink16+w112",
    "Kcal34rc+copy1+rc+sink16+r128@K4V4",
    "K3.5mix(last)+V3+rc+sink16+w112",
    "Kcal34+copy1+rc16p+sink16+w112",
    "Kcal34+copy1+rc8p+sink16+w112",
]
