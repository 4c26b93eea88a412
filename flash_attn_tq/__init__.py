"""flash_attn_tq: FlashAttention-2's API over a 3-bit quantized KV cache.

``import flash_attn_tq as flash_attn`` gives the seven flash_attn 2.8.3 functions with the same
signatures; :func:`flash_attn_with_kvcache` also takes a :class:`QuantizedKVCache` (its format and
features: a :class:`CacheSpec`), which it attends over with the fused CUDA kernels (or the reference
path on CPU). :func:`last_path` says which path the last call took and why. :func:`plan_varlen` lays
out a serving step once for every layer's ``flash_attn_varlen_func(kv_cache=, plan=)``.
"""

from .cache import QuantizedKVCache
from .cpu import CpuQuantizedKVCache
from .format import bits_per_element, code_bytes, pack_codes, unpack_codes
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    last_path,
)
from .quantizers import AsymQuantizer, TurboQuantizer
from .spec import CacheSpec
from .varlen import VarlenPlan, plan_varlen

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "last_path",
    "plan_varlen",
    "VarlenPlan",
    "QuantizedKVCache",
    "CacheSpec",
    "CpuQuantizedKVCache",
    "TurboQuantizer",
    "AsymQuantizer",
    "pack_codes",
    "unpack_codes",
    "code_bytes",
    "bits_per_element",
]
