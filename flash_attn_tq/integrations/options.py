"""TQCache's options: the defaults (and the measurements behind them) and what a model config gives
them (head dim, RoPE frequencies, the layers for wider keys)."""

from __future__ import annotations

from typing import Mapping

import torch

from ..optional_deps import require_transformers
from ..spec import CacheSpec, is_int, scale_only_fits

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
    verify_tokens=16,
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
# verify_tokens=16: 15 more recent slots in 16-bit, so that each query of a speculative verify call
# of up to 16 tokens sees its own window, as a one-token decode at its position does (exact
# speculative decoding; the 16-bit side grows from 128 to 143 slots a sequence and layer).

# The setting without a 16-bit window (TQCache.calibrated(model, **NO_FP16_WINDOW)): the 128 most recent
# tokens as 4-bit keys and values instead (age-based precision; each token is also in the 3-bit cache,
# which attention reads once it is older). On SmolLM2: perplexity +2.75% (news) / +4.04% (GPL-3 text)
# against +7.37% / +7.34% with every token at the default's bits (benchmarks/results/quality.md).
NO_FP16_WINDOW = dict(fp16_window=128, window_bits=4)


# the attention implementation name TQCache's layers run under ("tq_kvcache": a name containing "flash"
# would make transformers look for flash-attn)
ATTN_IMPLEMENTATION = "tq_kvcache"
WIDE = ("late_k_bits", "sink_tokens")  # TQCache-wide options: not a layer's or a head's own


def tq_spec(config, spec: CacheSpec | None, options: Mapping) -> tuple[CacheSpec, int | None]:
    """TQCache's spec and ``late_k_bits``: ``spec`` with ``options`` over it, or :data:`DEFAULTS` with
    ``options`` over them (``scale_only`` off where the options do not allow it; ``key_center="rope"``
    where the config has whole-head RoPE, else the post-RoPE mean); the RoPE frequencies from
    ``config`` where ``key_center="rope"`` needs them."""
    options = dict(options)
    late = options.pop("late_k_bits", DEFAULTS["late_k_bits"])
    if late is not None and (not is_int(late) or not 2 <= int(late) <= 4):
        raise ValueError(f"late_k_bits must be 2, 3, 4 or None, got {late!r}")
    if spec is None:
        opts = {k: v for k, v in DEFAULTS.items() if k != "late_k_bits"}
        opts.update(options)
        if "scale_only" not in options and not scale_only_fits(opts["quantizer"], opts["grid"], opts["fit"]):
            opts["scale_only"] = False
        if "key_center" not in options and opts["key_center"] == "rope" and rope_center_freqs(config) is None:
            opts["key_center"] = True  # the default where the RoPE center cannot apply: the post-RoPE mean
    else:
        opts = options
    key_center = opts.get("key_center", None if spec is None else spec.key_center)
    if key_center == "rope" and opts.get("rope_inv_freq", None if spec is None else spec.rope_inv_freq) is None:
        if config is None:
            raise ValueError("key_center='rope' needs the model config (its RoPE frequencies): TQCache(config, ...)")
        opts["rope_inv_freq"] = rope_inv_freq(config)
    return (CacheSpec(**opts) if spec is None else spec.replace(**opts)), late


def override(spec: CacheSpec, options: Mapping, where: str) -> CacheSpec:
    """``spec`` with a layer's or a head's ``options`` over it; errors name ``where`` (e.g.
    ``layer_options[3]``)."""
    wide = [name for name in WIDE if name in options]
    if wide:
        raise ValueError(f"{where}: {wide[0]} is a TQCache-wide option")
    try:
        return spec.replace(**options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


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
