"""The caches and attention calls the GPU benchmarks time: random K/V in a QuantizedKVCache, the
default cache's kinds of layer, upstream FlashAttention-2 where it is installed.

Shapes follow flash_attn's conventions: queries ``q [B, q_len, Hq, d]``, keys and values
``k, v [B, S, Hk, d]`` (B sequences of S tokens, Hq query and Hk kv heads of head_dim d).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .. import dispatch
from ..cache import QuantizedKVCache
from ..interface import flash_attn_with_kvcache, last_path

# The default cache (TQCache.calibrated for SmolLM2) as the benchmarks model it: every layer keeps
# 16 sink + 112 recent tokens in 16-bit and centers its keys before RoPE; 32 / head_dim of the
# layers hold 4-bit keys (what the scale-only metadata pays for), and one layer of the 30 holds its
# most copy-sensitive kv head at K8V8 beside 3-bit heads. A layer's time at a shape is measured for
# each kind of layer and weighted as the model holds them (weighted_default).
DEFAULT_LAYERS = 30
DEFAULT_OPTS: dict[str, Any] = dict(sink_tokens=16, fp16_window=112, key_center="rope")


def fill_cache(
    B: int,
    S: int,
    Hk: int,
    d: int,
    dtype: torch.dtype = torch.float16,
    chunk: int = 8192,
    device: torch.device | str = "cuda",
    **cache_kwargs: Any,
) -> tuple[QuantizedKVCache, torch.Tensor, torch.Tensor]:
    """``(cache, k, v)``: a QuantizedKVCache of capacity S (``cache_kwargs``: its options) holding S
    tokens of N(0, 1) keys and values ``k, v [B, S, Hk, d]`` (returned too: the fp16 paths' cache),
    appended ``chunk`` tokens at a time (a long prompt's prefill chunks)."""
    cache = QuantizedKVCache(B, S, Hk, d, device=device, dtype=dtype, **cache_kwargs)
    k = torch.empty(B, S, Hk, d, device=device, dtype=dtype)
    v = torch.empty_like(k)
    for s0 in range(0, S, chunk):
        kc = torch.randn(B, min(chunk, S - s0), Hk, d, device=device, dtype=dtype)
        vc = torch.randn_like(kc)
        k[:, s0 : s0 + kc.shape[1]] = kc
        v[:, s0 : s0 + kc.shape[1]] = vc
        cache.append(kc, vc)
    return cache, k, v


def rope_freqs(d: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE's inverse frequencies ``[d / 2]`` (float32) at head_dim d (rotate-half pairs)."""
    return 1.0 / theta ** (torch.arange(0, d, 2).float() / d)


def fill_default(
    B: int,
    S: int,
    Hk: int,
    d: int,
    dtype: torch.dtype = torch.float16,
    k_bits: int = 3,
    v_bits: int = 3,
    device: torch.device | str = "cuda",
) -> QuantizedKVCache:
    """A cache of one default layer (:data:`DEFAULT_OPTS`, keys of ``k_bits``, values of ``v_bits``)
    holding S random tokens (see :func:`fill_cache`)."""
    cache, _, _ = fill_cache(
        B, S, Hk, d, dtype, device=device, k_bits=k_bits, v_bits=v_bits, rope_inv_freq=rope_freqs(d), **DEFAULT_OPTS
    )
    return cache


def default_layers(
    q: torch.Tensor, S: int, Hk: int, dtype: torch.dtype, causal: bool = False
) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    """The default cache's kinds of layer over S random tokens, as calls of ``q [B, q_len, Hq, d]``:
    ``({kind: call}, {kind: layers of that kind})``.

    Kinds: ``k3`` / ``k4`` (3- / 4-bit keys: 32 / d of :data:`DEFAULT_LAYERS` layers hold 4-bit
    keys) and ``mixed`` (the copy-head layer: a K8V8 kv head beside 3-bit ones, attended as TQLayer
    attends them, both head groups in one launch where the cache allows it), plus ``mixed_apart`` (a
    launch a head group, not a kind of layer of its own) where the one launch runs. The calls go
    through the fused CUDA path (checked once)."""
    B, _, Hq, d = q.shape
    device = q.device

    def call(cache: QuantizedKVCache) -> Callable[[], torch.Tensor]:
        return lambda: flash_attn_with_kvcache(q, cache, causal=causal)

    n4 = round(DEFAULT_LAYERS * 32 / d)  # 4-bit-key layers
    fns: dict[str, Callable[[], Any]] = {}
    layers = {"k3": DEFAULT_LAYERS - n4 - 1, "k4": n4, "mixed": 1}
    for name, kb in (("k3", 3), ("k4", 4)):
        fns[name] = call(fill_default(B, S, Hk, d, dtype, kb, 3, device=device))
        fns[name]()
        if last_path() != "quantized:fused-cuda":
            raise RuntimeError(f"the default cache's {name} layer took {last_path()}, not the fused CUDA path")
    wide = fill_default(B, S, 1, d, dtype, 8, 8, device=device)
    rest = fill_default(B, S, Hk - 1, d, dtype, device=device)
    G = Hq // Hk
    q_wide, q_rest = q[:, :, :G].contiguous(), q[:, :, G:].contiguous()
    out = torch.empty_like(q)

    def apart() -> None:  # a launch a head group (chunks; decode-sized calls before the one-launch kernel)
        out[:, :, :G] = flash_attn_with_kvcache(q_wide, wide, causal=causal)
        out[:, :, G:] = flash_attn_with_kvcache(q_rest, rest, causal=causal)

    def mixed() -> Any:
        if rest.plan(dispatch.Query.of(q), pair=(wide, 0)).kernel == "pair":
            return rest.attend(q, rest.seqlens[:B], None, d**-0.5, causal, with_lse=False, group2=(wide, 0))
        apart()

    fns["mixed"] = mixed
    if rest.plan(dispatch.Query.of(q), pair=(wide, 0)).kernel == "pair":
        fns["mixed_apart"] = apart
    return fns, layers


def weighted_default(times: Mapping[str, float], layers: Mapping[str, int], suffix: str) -> float:
    """The default cache's time a layer: ``times[kind + suffix]`` of the kinds of layer weighted by
    how many of them the model holds (``layers``, from :func:`default_layers`)."""
    return sum(n * times[kind + suffix] for kind, n in layers.items()) / DEFAULT_LAYERS


def upstream_fa2() -> Callable[..., Any] | None:
    """Upstream ``flash_attn.flash_attn_with_kvcache`` (the FP16 FlashAttention-2 baseline), None
    where flash_attn is not installed (or fails to load)."""
    try:
        from flash_attn import flash_attn_with_kvcache as fa2
    except Exception:
        return None
    return fa2
