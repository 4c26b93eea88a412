"""The caches and attention calls the GPU benchmarks time: random K/V in a QuantizedKVCache, the
default cache's kinds of layer, a serving engine's mixed step over a paged cache, upstream
FlashAttention-2 where it is installed.

Shapes follow flash_attn's conventions: queries ``q [B, q_len, Hq, d]``, keys and values
``k, v [B, S, Hk, d]`` (B sequences of S tokens, Hq query and Hk kv heads of head_dim d).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
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
DEFAULT_OPTS: dict[str, Any] = dict(sink_tokens=16, fp16_window=112, verify_tokens=16, key_center="rope")


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


def upstream_fa2(name: str = "flash_attn_with_kvcache") -> Callable[..., Any] | None:
    """Upstream flash_attn's function ``name`` (the FP16 FlashAttention-2 baseline), None where
    flash_attn is not installed (or fails to load)."""
    try:
        import flash_attn
    except Exception:
        return None
    return getattr(flash_attn, name, None)


@dataclass
class ServingStep:
    """One engine step over a paged cache (:func:`serving_step`): sequence ``b`` holds ``lengths[b]``
    tokens and brings ``new[b]`` tokens (1: it decodes; more: a prefill chunk), each a query and a
    new key/value. ``q [total, Hq, d]``, ``k``/``v [total, Hk, d]``, ``cu_seqlens [n + 1]`` int32 (the
    queries' and the new keys' alike). ``kv16``: the same tokens in a 16-bit paged cache
    ``(k_cache, v_cache [blocks, page, Hk, d], block_table, slots)``, ``slots [total]`` int64 the flat
    slot each new token goes to (vLLM's ``slot_mapping``), where asked for."""

    cache: QuantizedKVCache | None
    lengths: list[int]
    new: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    kv16: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def slot_mapping(block_table: torch.Tensor, page: int, rows: list[int], positions: list[range]) -> torch.Tensor:
    """int64 flat slots (block x page + offset) of ``positions[i]`` of sequence ``rows[i]``."""
    table = block_table.long()
    out = []
    for b, pos in zip(rows, positions):
        p = torch.tensor(pos, device=block_table.device)
        out.append(table[b, p // page] * page + p % page)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=block_table.device)


def serving_step(
    lengths: list[int],
    new: list[int],
    page_size: int | None,
    Hq: int = 32,
    Hk: int = 8,
    d: int = 128,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cuda",
    seed: int = 0,
    kv16_page: int | None = None,
    fill_chunk: int = 2048,
    **cache_options: Any,
) -> ServingStep:
    """A paged quantized cache (``page_size``, blocks in a seeded random order; ``cache_options``: its
    spec) holding ``lengths[b]`` random N(0, 1) tokens a sequence, appended ``fill_chunk`` tokens at a
    time through the pack kernel, and the step's random queries and new K/V (``new[b]`` a sequence).
    ``kv16_page``: the same tokens also in a 16-bit paged cache of that page size; ``page_size=None``:
    that cache alone (``cache`` is None). The tokens depend on ``seed`` only, not on the pages."""
    tables = torch.Generator().manual_seed(seed)
    data = torch.Generator(device=device).manual_seed(seed + 1)
    n, capacity = len(lengths), max(a + b for a, b in zip(lengths, new))

    def table(page):
        per_seq = -(-capacity // page)
        perm = torch.randperm(n * per_seq, generator=tables)
        return perm.reshape(n, per_seq).to(device=device, dtype=torch.int32), per_seq

    def randn(*shape):
        return torch.randn(*shape, generator=data, device=device).to(dtype)

    cache = kv16 = None
    if page_size is not None:
        block_table, per_seq = table(page_size)
        cache = QuantizedKVCache(
            n, per_seq * page_size, Hk, d, page_size=page_size, block_table=block_table, device=device,
            dtype=dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16, **cache_options,
        )  # fmt: skip
    if kv16_page is not None:
        table16, per16 = table(kv16_page)
        k16 = torch.zeros(n * per16, kv16_page, Hk, d, dtype=dtype, device=device)
        kv16 = (k16, torch.zeros_like(k16), table16)
    for s0 in range(0, max(lengths, default=0), fill_chunk):
        groups: dict[int, list[int]] = {}  # sequences that take as many tokens from this chunk
        for b, length in enumerate(lengths):
            if length > s0:
                groups.setdefault(min(fill_chunk, length - s0), []).append(b)
        for m, rows in groups.items():
            k, v = randn(len(rows), m, Hk, d), randn(len(rows), m, Hk, d)
            if cache is not None:
                cache.append(k, v, batch_idx=torch.tensor(rows, dtype=torch.int32, device=device))
            if kv16 is not None:
                slots = slot_mapping(kv16[2], kv16_page, rows, [range(s0, s0 + m)] * len(rows))
                kv16[0].view(-1, Hk, d)[slots] = k.reshape(-1, Hk, d)
                kv16[1].view(-1, Hk, d)[slots] = v.reshape(-1, Hk, d)
    total = sum(new)
    q, k, v = randn(total, Hq, d), randn(total, Hk, d), randn(total, Hk, d)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device=device)
    if kv16 is not None:
        slots = slot_mapping(kv16[2], kv16_page, list(range(n)), [range(a, a + b) for a, b in zip(lengths, new)])
        kv16 = (*kv16, slots)
    return ServingStep(cache, list(lengths), list(new), q, k, v, cu, kv16)
