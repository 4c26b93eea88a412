"""TQCache's options: the defaults (and the measurements behind them) and what a model config gives
them (head dim, RoPE frequencies, the layers for wider keys)."""

from __future__ import annotations

from typing import Mapping

import torch

from ..optional_deps import require_transformers
from ..cache import QuantizedKVCache
from ..spec import scale_only_fits

# The default configuration (chosen by benchmarks/eval_quality.py; see benchmarks/results/quality.md).
DEFAULTS = dict(
    k_bits=3,
    v_bits=3,
    quantizer="turbo",
    grid="uniform",
    fit="norm",
    scale_only=True,
    late_k_bits=4,
    fp16_window=112,
    window_bits=16,
    sink_tokens=16,
    key_center="rope",
)
# Per sequence and layer: 16 sink tokens + the last 112 tokens in 16-bit (attended by the same kernel
# launch as the codes); every other token as 3-bit codes + one float16 scale (turbo's norm fit: the
# offset is -mid * scale, not stored), keys centered before RoPE (key_center="rope": the keys' constant
# part follows them as RoPE turns it, where the post-RoPE mean of the prompt removes next to nothing
# thousands of tokens later, results/key_center_energy.txt). The 16 bits a vector that the
# scale-only metadata saves pay for 4-bit keys (late_k_bits) in 32 / head_dim of the layers (half at
# head_dim 64, a quarter at 128), so the cache stays at 3 + 32 / head_dim bits/element (3.5 at 64,
# 3.25 at 128), what 3-bit codes + (scale, offset) cost. TQCache.calibrated places those layers, and
# 8-bit keys and values for the most copy-sensitive kv head, where the model measures most
# sensitive (measured results: benchmarks/results/quality.md).

# The setting without a 16-bit window (TQCache.calibrated(model, **NO_FP16_WINDOW)): the 128 most recent
# tokens as 4-bit keys and values instead (age-based precision; each token is also in the 3-bit cache,
# which attention reads once it is older). On SmolLM2: perplexity +2.75% (news) / +4.04% (GPL-3 text)
# against +7.37% / +7.34% with every token at the default's bits (benchmarks/results/quality.md).
NO_FP16_WINDOW = dict(fp16_window=128, window_bits=4)


def cache_options(cache_kwargs: Mapping) -> dict:
    """TQCache options: ``cache_kwargs`` over :data:`DEFAULTS`; ``scale_only`` off where the options
    do not allow it (the scale-only format needs turbo's uniform norm fit)."""
    opts = dict(DEFAULTS, **cache_kwargs)
    if "scale_only" not in cache_kwargs and not scale_only_fits(opts["quantizer"], opts["grid"], opts["fit"]):
        opts["scale_only"] = False
    return opts


def validate_overrides(
    opts: Mapping,
    layer_options: Mapping[int, Mapping],
    head_options: Mapping[tuple[int, int], Mapping],
    protected_layers: frozenset,
    num_kv_heads: int | None,
    head_dim: int,
) -> dict:
    """Check TQCache's options, its per-layer and its per-head overrides by building a one-token
    QuantizedKVCache of each (errors name the override); returns the per-head overrides as
    ``{(layer, kv head): options}``."""
    QuantizedKVCache(1, 1, 1, head_dim, **opts)
    for i, o in layer_options.items():
        if "sink_tokens" in o or "late_k_bits" in o:
            bad = "sink_tokens" if "sink_tokens" in o else "late_k_bits"
            raise ValueError(f"layer_options[{i}]: {bad} is a TQCache-wide option")
        try:
            QuantizedKVCache(1, 1, 1, head_dim, **dict(opts, **o))
        except (TypeError, ValueError) as e:
            raise type(e)(f"layer_options[{i}]: {e}") from None
    heads = {}
    for key, o in head_options.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"head_options: keys are (layer, kv head) pairs, got {key!r}")
        i, h = int(key[0]), int(key[1])
        if i in protected_layers:
            raise ValueError(f"head_options[{key}]: layer {i} is protected")
        if "sink_tokens" in o or "late_k_bits" in o:
            raise ValueError(f"head_options[{key}]: sink_tokens / late_k_bits are TQCache-wide options")
        if num_kv_heads is not None and not 0 <= h < num_kv_heads:
            raise ValueError(f"head_options[{key}]: kv head {h} out of range ({num_kv_heads} kv heads)")
        try:
            QuantizedKVCache(1, 1, 1, head_dim, **{**opts, **layer_options.get(i, {}), **o})
        except (TypeError, ValueError) as e:
            raise type(e)(f"head_options[{key}]: {e}") from None
        heads[(i, h)] = dict(o)
    return heads


def rope_center_freqs(config) -> torch.Tensor | None:
    """The config's RoPE frequencies when ``key_center="rope"`` applies (rotate-half RoPE over the
    whole head: ``head_dim / 2`` of them), else None."""
    if config is None:
        return None
    try:
        inv = rope_inv_freq(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return inv if inv.numel() * 2 == head_dim_of(config) and bool(torch.isfinite(inv).all()) else None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config) -> torch.Tensor:
    """The RoPE frequencies ``[head_dim / 2]`` a transformers model config gives its rotary
    embedding (``rope_parameters``: ``"default"`` or one of transformers' scaled kinds), for
    ``key_center="rope"``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind != "default":
        require_transformers(f"rope_inv_freq for rope_type={kind!r}")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0].float()
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("key_center='rope': the config names no rope_theta")
    d = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (float(theta) ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def late_layers(
    quantized: list[int], head_dim: int, k_bits: int, late_k_bits: int | None, scale_only: bool
) -> set[int]:
    """The layers (the last of ``quantized``) whose keys get ``late_k_bits``: as many as the 16 bits a
    vector that scale-only metadata saves pay for (none without it)."""
    if late_k_bits is None or late_k_bits <= k_bits or not scale_only:
        return set()
    n = min(len(quantized), (len(quantized) * 32) // (head_dim * (late_k_bits - k_bits)))
    return set(quantized[len(quantized) - n :])
