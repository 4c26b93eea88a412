"""A fast 16-bit decode for transformers models: the fp16 anchor the 3-bit cache is measured against.

transformers' ``StaticCache`` with SDPA attends over the whole static capacity through a mask, several
times slower than a decode kernel reading only the filled tokens. Here the same static 16-bit buffers
(transformers' ``StaticLayer``, updated in place as there) are read by a decode kernel with the
layer's length on the GPU, so a step can be compiled or captured as one CUDA graph:

* ``backend="kv16"``: this project's decode kernel over a 16-bit cache (``flash_attn_tq.ops.decode_kv16``);
* ``backend="fa2"``: upstream FlashAttention-2's ``flash_attn_with_kvcache``, where it is installed.

Usage::

    from flash_attn_tq.testing.fp16_decode import ATTN_IMPLEMENTATION, FastStaticCache
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = FastStaticCache(model.config, max_cache_len=4096, backend="kv16")
    model(input_ids=prompt, past_key_values=cache)    # the prompt: causal SDPA over its own tokens

A prompt (the first chunk) runs PyTorch's causal SDPA over its own keys; a later chunk of several
tokens, and any call on the CPU, transformers' masked SDPA over the buffer.
"""

from __future__ import annotations

import torch

from ..ops import decode_kv16, extension_available
from ..optional_deps import transformers_missing
from .workloads import upstream_fa2

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, StaticLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # without transformers, or an older one
    raise transformers_missing("flash_attn_tq.testing.fp16_decode", e) from e

ATTN_IMPLEMENTATION = "fp16_kvcache"
BACKENDS = ("kv16", "fa2")


class FastStaticLayer(StaticLayer):
    """transformers' ``StaticLayer`` (buffers ``[B, Hkv, capacity, D]``, its length a GPU counter) whose
    returned keys carry the layer for :func:`fp16_attention_forward`."""

    def __init__(self, max_cache_len: int, backend: str):
        super().__init__(max_cache_len)
        self.backend = backend

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        keys = keys.view(keys.shape)
        keys._fp16_layer = self  # (torch.compile tracks the attribute, as TQCache's)
        return keys, values


class FastStaticCache(Cache):
    """A static 16-bit cache for ``attn_implementation="fp16_kvcache"``.

    Args:
        config: the model's config (its layer count).
        max_cache_len: tokens a sequence may hold (the prompt and every decoded token).
        backend: ``"kv16"`` (this project's kernel) or ``"fa2"`` (upstream FlashAttention-2).
    """

    def __init__(self, config, max_cache_len: int, backend: str = "kv16"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "fa2" and upstream_fa2() is None:
            raise RuntimeError("backend='fa2': upstream flash_attn (2.x, with its CUDA build) is not importable")
        if backend == "kv16" and torch.cuda.is_available():
            extension_available()  # (importing the extension registers the op; on the CPU: SDPA)
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[FastStaticLayer(max_cache_len, backend) for _ in range(layers)])


def fp16_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ``"fp16_kvcache"`` attention function (transformers' AttentionInterface signature):
    ``query [B, Hq, Sq, D]``, ``key``/``value`` a :class:`FastStaticLayer`'s buffers. Returns
    ``(out [B, Sq, Hq, D], None)``."""
    layer = getattr(key, "_fp16_layer", None)
    q_len = query.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer is None or not query.is_cuda:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if q_len > 1:
        if int(layer.cumulative_length) != q_len:  # a later chunk: the mask says what it sees
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key[:, :, :q_len], value[:, :, :q_len], is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    q = query.transpose(1, 2)  # [B, 1, Hq, D]
    k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, capacity, Hkv, D] (strided views)
    lens = layer.cumulative_length.to(torch.int32).expand(q.shape[0]).contiguous()
    if layer.backend == "fa2":
        return fa2_decode(q, k, v, lens, scaling), None
    return decode_kv16(q, k, v, lens, None, None, scaling, True, 0)[0], None


@torch.library.custom_op("flash_attn_tq_testing::fa2_decode", mutates_args=())
def fa2_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Upstream's ``flash_attn_with_kvcache`` decode as one operator (a compiled step holds it
    without a graph break): ``q [B, 1, Hq, D]`` over ``k``/``v [B, capacity, Hkv, D]``, ``lens [B]``."""
    return upstream_fa2()(q, k, v, cache_seqlens=lens, softmax_scale=scale, causal=True)


@fa2_decode.register_fake
def _(q, k, v, lens, scale):
    return q.new_empty(q.shape)


AttentionInterface.register(ATTN_IMPLEMENTATION, fp16_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "FastStaticCache",
    "FastStaticLayer",
    "fa2_decode",
    "fp16_attention_forward",
]
