"""Quantization-aware fine-tuning: a differentiable fake quantization of K/V with the cache's codec.

Usage (transformers)::

    from flash_attn_tq.qat import register_fake_quant_attention
    name = register_fake_quant_attention(k_bits=3, v_bits=3)   # "tq_fake_quant"
    model.set_attn_implementation(name)          # train as usual (use_cache=False)
    ...
    model.set_attn_implementation("tq_kvcache")  # then decode over the real cache (TQCache)

:func:`fake_quant`, :func:`fake_quant_kv` and :func:`clip_mask` need torch only; the attention
functions (:func:`make_fake_quant_attention`, :func:`register_fake_quant_attention`) need
transformers >= 5 (``pip install "flash_attn_tq[transformers]"``; without it they raise an
ImportError saying so).

:func:`fake_quant` runs the cache's own codec (:class:`~flash_attn_tq.TurboQuantizer`: its
``quantize`` then ``dequantize``), so the forward value is exactly what the cache gives back for
that vector. Its gradient is a straight-through estimator taken in the rotated domain, where the
codec is a per-coordinate grid:

* the codec is ``f(x) = R^T Q(R x)``, ``R`` the randomized Hadamard rotation (orthogonal) and ``Q``
  rounding each coordinate of ``y = R x * sqrt(d) / |x|`` to the grid (then the norm-corrected scale);
* the estimator replaces ``dQ/dr_i`` by 1 for a coordinate inside the code range and by 0 for one the
  grid clipped (it rounds past the outermost code: moving it a little does not change its code), and
  treats the per-vector scale as a constant; by the chain rule the gradient is
  ``R^T diag(mask) R g``, i.e. :meth:`TurboQuantizer.rotate` the incoming gradient, zero the clipped
  coordinates, :meth:`TurboQuantizer.unrotate` back;
* with nothing clipped that is ``R^T R g = g``: the identity. The mask lives in the rotated domain:
  a clipped rotated coordinate removes one direction (a row of ``R``) from the gradient of the whole
  vector, not one of its original coordinates.

Clipped means, on the uniform grid, that the code before the clamp (``floor(y / step + (n-1)/2 +
0.5)``, the quantizer's own arithmetic) falls outside ``[0, n-1]``; on the Lloyd-Max grid, that
``y`` lies beyond the outermost level by more than half the gap to its neighbour.

:func:`register_fake_quant_attention` registers a transformers attention function that fake-quantizes
the key states (after RoPE, as the cache stores them) and the value states, then runs transformers'
SDPA attention. Its options mirror :class:`~flash_attn_tq.integrations.transformers.TQCache`'s where
they apply to training: ``k_bits``, ``v_bits``, ``grid``, ``seed``, ``scale_only``, ``sink_tokens`` (the first tokens
of each sequence stay in full precision), ``protected_layers`` and ``layer_options`` (per-layer
``k_bits`` / ``v_bits``). No 16-bit recent window (``fp16_window=0``) and no key centering: the cache
to decode with afterwards is ``TQCache(config, fp16_window=0, sink_tokens=..., key_center=False,
late_k_bits=None)`` (or with ``late_k_bits`` given here as ``layer_options``).
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

import torch

from .optional_deps import require_transformers
from .quantizers import TurboQuantizer, round_half_up

FAKE_QUANT_ATTENTION = "tq_fake_quant"


@functools.lru_cache(maxsize=None)
def _quantizer(head_dim: int, bits: int, grid: str, seed: int) -> TurboQuantizer:
    return TurboQuantizer(head_dim, bits, grid, seed)


def clip_mask(quantizer: TurboQuantizer, r: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., d]``: True where the rotated coordinate ``r`` (``quantizer.rotate(x)``) is inside
    the code range, False where the grid clipped it (see the module docstring)."""
    d = quantizer.head_dim
    norm = r.norm(dim=-1, keepdim=True)
    y = r * torch.where(norm > 0, d**0.5 / norm, torch.zeros_like(norm))  # as TurboQuantizer.quantize
    n = 1 << quantizer.bits
    if quantizer.grid == "uniform":
        step = quantizer.levels_unit[1] - quantizer.levels_unit[0]
        raw = round_half_up(y * (1.0 / step) + (n - 1) / 2)
        return (raw >= 0) & (raw <= n - 1)
    lv = quantizer.levels_unit
    lo, hi = lv[0] - (lv[1] - lv[0]) / 2, lv[-1] + (lv[-1] - lv[-2]) / 2
    return (y >= lo) & (y <= hi)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quantizer: TurboQuantizer, scale_only: bool):
        codes, meta = quantizer.quantize(x)
        if scale_only:  # the stored format keeps the scale alone: offset = -mid * scale, not rounded to float16
            meta = meta[..., :1]
        ctx.quantizer = quantizer
        ctx.save_for_backward(clip_mask(quantizer, quantizer.rotate(x)))
        return quantizer.dequantize(codes, meta).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        q = ctx.quantizer
        return q.unrotate(q.rotate(grad) * mask).to(grad.dtype), None, None


def fake_quant(
    x: torch.Tensor,
    bits: int = 3,
    quantizer: str = "turbo",
    seed: int = 0,
    grid: str = "uniform",
    scale_only: bool | None = None,
) -> torch.Tensor:
    """Fake-quantize K or V vectors ``x [..., head_dim]`` with the cache's codec.

    Forward: ``q.dequantize(codes, meta)`` of ``codes, meta = q.quantize(x)``,
    ``q = TurboQuantizer(head_dim, bits, grid, seed)``, in ``x``'s dtype: the cache's round trip of
    each vector. ``scale_only`` (default: True on the uniform grid, as QuantizedKVCache's default)
    dequantizes from the scale alone (``meta[..., :1]``: offset ``-mid * scale`` exactly, what the
    scale-only cache stores); False: from the float16 (scale, offset) pair (``scale_only=False``
    caches, the Lloyd-Max grid). The float16 rounding of that offset moves SmolLM2's large keys
    enough to matter (logits differ by several units), so match the cache you will decode with.
    Backward: the straight-through estimator of the module docstring (identity, except the rotated
    directions the grid clipped get zero gradient).
    Only ``quantizer="turbo"`` with its default fit (``"norm"``, what the cache uses) is supported.
    """
    if quantizer != "turbo":
        raise NotImplementedError(f"fake_quant supports quantizer='turbo' only, got {quantizer!r}")
    if scale_only is None:
        scale_only = grid == "uniform"
    if scale_only and grid != "uniform":
        raise ValueError("scale_only needs the uniform grid")
    return _FakeQuant.apply(x, _quantizer(int(x.shape[-1]), int(bits), grid, int(seed)), bool(scale_only))


def fake_quant_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    k_bits: int = 3,
    v_bits: int = 3,
    grid: str = "uniform",
    seed: int = 0,
    sink_tokens: int = 0,
    scale_only: bool | None = None,
    seq_dim: int = -2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantize ``key``/``value`` (``[B, Hkv, S, D]`` by default: ``seq_dim=-2``), keeping the first
    ``sink_tokens`` positions in full precision (bits 16 or more: that tensor untouched)."""

    def one(x, bits):
        if bits >= 16:
            return x
        s = min(int(sink_tokens), x.shape[seq_dim])
        if s == 0:
            return fake_quant(x, bits, seed=seed, grid=grid, scale_only=scale_only)
        head, tail = x.split([s, x.shape[seq_dim] - s], dim=seq_dim)
        return torch.cat([head, fake_quant(tail, bits, seed=seed, grid=grid, scale_only=scale_only)], dim=seq_dim)

    return one(key, k_bits), one(value, v_bits)


def make_fake_quant_attention(
    *,
    k_bits: int = 3,
    v_bits: int = 3,
    quantizer: str = "turbo",
    grid: str = "uniform",
    seed: int = 0,
    sink_tokens: int = 0,
    fp16_window: int = 0,
    scale_only: bool | None = None,
    protected_layers: Iterable[int] = (),
    layer_options: Mapping[int, Mapping] | None = None,
):
    """The attention function (transformers' AttentionInterface signature) that
    :func:`register_fake_quant_attention` registers; see the module docstring for the options."""
    require_transformers("flash_attn_tq.qat.make_fake_quant_attention")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if quantizer != "turbo":
        raise NotImplementedError(f"fake-quant attention supports quantizer='turbo' only, got {quantizer!r}")
    if fp16_window:
        raise NotImplementedError("fake-quant attention has no 16-bit recent window (fp16_window=0)")
    protected = {int(i) for i in protected_layers}
    per_layer = {int(i): dict(o) for i, o in (layer_options or {}).items()}
    for i, o in per_layer.items():
        extra = set(o) - {"k_bits", "v_bits"}
        if extra:
            raise ValueError(
                f"layer_options[{i}]: only k_bits / v_bits apply to fake quantization, got {sorted(extra)}"
            )
    # validate bits / grid once
    for b in {k_bits, v_bits, *(v for o in per_layer.values() for v in o.values())}:
        if b < 16:
            TurboQuantizer(32, int(b), grid, seed)

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs,
    ):
        idx = getattr(module, "layer_idx", None)
        if idx not in protected:
            o = per_layer.get(idx, {})
            key, value = fake_quant_kv(
                key,
                value,
                k_bits=o.get("k_bits", k_bits),
                v_bits=o.get("v_bits", v_bits),
                grid=grid,
                seed=seed,
                sink_tokens=sink_tokens,
                scale_only=scale_only,
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    return attention


def register_fake_quant_attention(name: str = FAKE_QUANT_ATTENTION, **options) -> str:
    """Register a fake-quant attention function (and SDPA's mask) with transformers under ``name``
    (re-registering a name replaces its options); returns ``name`` for
    ``model.set_attn_implementation(name)`` or ``from_pretrained(..., attn_implementation=name)``.
    ``options``: those of :func:`make_fake_quant_attention` (``k_bits=3, v_bits=3, grid="uniform",
    seed=0, scale_only=None, sink_tokens=0, protected_layers=(), layer_options=None``)."""
    require_transformers("flash_attn_tq.qat.register_fake_quant_attention")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, make_fake_quant_attention(**options))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


__all__ = [
    "fake_quant",
    "fake_quant_kv",
    "clip_mask",
    "make_fake_quant_attention",
    "register_fake_quant_attention",
    "FAKE_QUANT_ATTENTION",
]
