"""The CUDA kernels (``torch.ops.flash_attn_tq.*``) and when they can be used.

The extension ``flash_attn_tq_cuda`` registers three ops:

* ``decode_kvcache(q, k_codes, k_meta, v_codes, v_meta, seqlens_k, cache_batch_idx, block_table,
  rot_signs, k_bits, v_bits, softmax_scale, is_causal, num_splits, ..., rope_center, rope_inv_freq,
  rope_offset, side_k, side_v, side_sinks, side_ring, codes_tail, g2_*, ring_*) -> (out, softmax_lse)``:
  split-KV attention of ``q [batch, seqlen_q, heads, d]`` over packed K/V and, in the same launch, a
  16-bit side (sink tokens and a recent-token ring), a second head group of other widths (``g2_*``:
  TQCache's 8-bit copy heads beside the 3-bit ones) or a ring of 4-bit window codes (``ring_*``:
  the recent tokens of a cache with ``window_bits``): the decode kernel, or from
  :data:`PREFILL_MIN_ROWS` query rows a kv head the prefill kernel (its side: one more launch, the
  chunk's rows as the MMA's M; with ``rope_center`` only its Hopper variant, from 256 rows, which
  adds ``R(p) c`` to the expanded keys through a per-call table). :func:`decode` takes its tensors.
* ``decode_kv16(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale,
  is_causal, num_splits) -> (out, softmax_lse)``: the same kernel body over a float16/bfloat16
  cache (its Fp16KV loader policy): our FP16 decode baseline.
* ``pack_kv(x, slot_mapping, start, batch_idx, block_table, codes, meta, error_flags, capacity, bits,
  quant, signs, levels, step, ..., v, v_codes, v_meta, v_bits, ...)``: quantize-on-write into slots
  given by a vLLM-style ``slot_mapping`` or resolved in the kernel from (start, batch_idx,
  block_table), with range checks; with ``v``, the values of the same tokens in the same launch.

Fake (meta) implementations are registered here so both trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

# which (head_dim, k_bits, v_bits) cases have fused kernels: generated with the C++ case table
from .kernel_cases import (  # noqa: F401
    FUSED_DECODE_BITS,
    FUSED_HEAD_DIMS,
    FUSED_PAIR_BITS,
    FUSED_RING_BITS,
    FUSED_RING_WINDOW_BITS,
    PREFILL_MIN_ROWS,
)
from .quantizers import uniform_step

# Rows a kv head decode_kv16 (the fp16 cache, decode kernel only) takes; more take the reference path.
MAX_KV16_ROWS = 256
QUANT_IDS = {
    ("turbo", "uniform", "norm"): 0,
    ("turbo", "lloyd_max", "norm"): 1,
    ("asym", "uniform", "norm"): 2,
    ("turbo", "uniform", "mean"): 3,
}  # (quantizer, grid, fit) -> the pack kernel's Quant


_LOADED: dict[str, bool] = {}  # extension_available's answer (a dict: torch.compile reads it as a constant)


def extension_available() -> bool:
    """True when the compiled kernels are importable (they still need a CUDA device to run)."""
    if "extension" not in _LOADED:
        _LOADED["extension"] = _load_extension()
    return _LOADED["extension"]


def _load_extension() -> bool:
    try:
        import flash_attn_tq_cuda  # noqa: F401  (registers torch.ops.flash_attn_tq.*)
    except (ImportError, OSError):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("flash_attn_tq::decode_kvcache")
    def _decode_fake(
        q,
        k_codes,
        k_meta,
        v_codes,
        v_meta,
        seqlens_k,
        cache_batch_idx,
        block_table,
        rot_signs,
        k_bits,
        v_bits,
        softmax_scale,
        is_causal,
        num_splits,
        window_left=-1,
        window_right=-1,
        cache_leftpad=None,
        softcap=0.0,
        rope_center=None,
        rope_inv_freq=None,
        rope_offset=0,
        side_k=None,
        side_v=None,
        side_sinks=0,
        side_ring=0,
        codes_tail=0,
        g2_k_codes=None,
        g2_k_meta=None,
        g2_v_codes=None,
        g2_v_meta=None,
        g2_k_bits=0,
        g2_v_bits=0,
        g2_rope_center=None,
        g2_side_k=None,
        g2_side_v=None,
        g2_head=0,
        ring_k_codes=None,
        ring_k_meta=None,
        ring_v_codes=None,
        ring_v_meta=None,
    ):
        b, sq, h, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_tq::decode_kv16")
    def _decode_kv16_fake(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, is_causal, num_splits
    ):
        b, sq, h, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_tq::pack_kv")
    def _pack_fake(
        x,
        slot_mapping,
        start,
        batch_idx,
        block_table,
        codes,
        meta,
        error_flags,
        capacity,
        bits,
        quant,
        signs,
        levels,
        step,
        side=None,
        side_sinks=0,
        side_ring=0,
        rope_center=None,
        rope_inv_freq=None,
        rope_offset=0,
        v=None,
        v_codes=None,
        v_meta=None,
        v_bits=0,
        v_step=1.0,
        v_signs=None,
        v_levels=None,
        v_side=None,
        lengths=None,
        tally=None,
        ring_codes=None,
        ring_meta=None,
        v_ring_codes=None,
        v_ring_meta=None,
        ring_bits=0,
        ring_step=1.0,
    ):
        return None


def fused_decode_reason(
    q: torch.Tensor,
    head_dim: int,
    k_bits: int,
    v_bits: int,
    grid: str = "uniform",
    rope_center: bool = False,
    page_size: int | None = None,
) -> str | None:
    """None if the fused decode kernel can serve ``q`` over a cache of these codes (``page_size``:
    None for a contiguous cache), else the reason it cannot."""
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if not extension_available():
        return "the CUDA extension flash_attn_tq_cuda is not built"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {q.dtype} (the kernel takes float16/bfloat16)"
    if head_dim not in FUSED_HEAD_DIMS:
        return f"head_dim {head_dim} (kernels: {FUSED_HEAD_DIMS})"
    if (k_bits, v_bits) not in FUSED_DECODE_BITS:
        return f"K{k_bits}V{v_bits} (kernels: {FUSED_DECODE_BITS})"
    if grid != "uniform":
        return "the Lloyd-Max grid (the kernel folds the uniform grid's affine levels)"
    if rope_center and page_size is not None and page_size < 32:
        return f"key_center='rope' with {page_size}-token pages (its kernel takes 32 or more)"
    return None


def _aligned_rows(q: torch.Tensor) -> torch.Tensor:
    """q as the kernels read it: contiguous rows at (head_dim / 16)-byte alignment (else a copy)."""
    vec = q.shape[-1] // 32
    misaligned = not torch.compiler.is_compiling() and q.data_ptr() % (2 * vec)  # (the op checks it too)
    if q.stride(-1) != 1 or misaligned or any(st % vec for st in q.stride()[:3]):
        return q.clone(memory_format=torch.contiguous_format)
    return q


def decode(
    q: torch.Tensor,
    seqlens_k: torch.Tensor,
    batch_idx: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    window_size: tuple[int, int] = (-1, -1),
    leftpad: torch.Tensor | None = None,
    softcap: float = 0.0,
    *,
    k_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_codes: torch.Tensor,
    v_meta: torch.Tensor,
    k_bits: int,
    v_bits: int,
    block_table: torch.Tensor | None = None,
    rot_signs: torch.Tensor | None = None,
    rope_center: torch.Tensor | None = None,
    rope_inv_freq: torch.Tensor | None = None,
    rope_offset: int = 0,
    side_k: torch.Tensor | None = None,
    side_v: torch.Tensor | None = None,
    side_sinks: int = 0,
    side_ring: int = 0,
    codes_tail: int = 0,
    group2: Mapping[str, Any] | None = None,
    group2_head: int = 0,
    ring: Mapping[str, torch.Tensor] | None = None,
):
    """Fused attention of ``q [batch, seqlen_q, heads, d]`` over packed K/V (``k_codes [rows, cols,
    kv_heads, bytes]`` uint8, ``k_meta [rows, cols, kv_heads, 1 or 2]`` float16, the same for v; rows
    are sequences, or pages with ``block_table``) and, in the same launch, a 16-bit side
    (``side_k``/``side_v [rows, side_sinks + side_ring, kv_heads, d]``: sink tokens and a recent-token
    ring; the codes are read up to ``seqlens_k - codes_tail``). ``QuantizedKVCache.kernel_args`` gives
    the keyword arguments for a cache.

    ``seqlens_k [batch]`` int32: keys ``[leftpad[b], seqlens_k[b])`` are attended (``leftpad``: int32
    ``[batch]`` or None), within ``window_size`` (upstream's local attention, bottom-right aligned;
    -1: unbounded), scores soft-capped at ``softcap`` (0: off). ``rot_signs [d]``: turbo's rotation
    (the kernel rotates q in and the output back); ``rope_center [batch, kv_heads, d]`` float32 and
    ``rope_inv_freq [d / 2]``: each score gets ``q . R(p + rope_offset) c`` back (key_center='rope').
    Returns (out like q, lse ``[batch, heads, seqlen_q]`` float32).

    ``group2``: a second head group of the layer in the same launch (:data:`FUSED_PAIR_BITS`; both with
    scale-only metadata and a 16-bit side, contiguous, decode-sized calls), as ``kernel_args`` of its
    cache gives it: its codes, metadata, RoPE center and side (the other arguments are the first
    group's). Its kv heads are the layer's ``[group2_head, group2_head + its kv heads)``, the first
    group's the others in order; ``q`` and the output hold the layer's query heads.

    ``ring``: the recent tokens as a ring of window codes in the same launch (:data:`FUSED_RING_BITS`,
    :data:`FUSED_RING_WINDOW_BITS`; scale-only metadata, a contiguous cache whose side holds the sinks
    alone, decode-sized calls), ``{"k_codes", "k_meta", "v_codes", "v_meta"}`` ``[rows, R, kv_heads,
    *]`` with token ``p`` in slot ``p % R`` and ``codes_tail = R``.
    """
    g2, rg = group2 or {}, ring or {}
    return torch.ops.flash_attn_tq.decode_kvcache(
        _aligned_rows(q),
        k_codes,
        k_meta,
        v_codes,
        v_meta,
        seqlens_k,
        batch_idx,
        block_table,
        rot_signs,
        k_bits,
        v_bits,
        float(softmax_scale),
        bool(causal),
        int(num_splits),
        int(window_size[0]),
        int(window_size[1]),
        leftpad,
        float(softcap),
        rope_center,
        rope_inv_freq,
        int(rope_offset),
        side_k,
        side_v,
        int(side_sinks),
        int(side_ring),
        int(codes_tail),
        g2.get("k_codes"),
        g2.get("k_meta"),
        g2.get("v_codes"),
        g2.get("v_meta"),
        int(g2.get("k_bits", 0)),
        int(g2.get("v_bits", 0)),
        g2.get("rope_center"),
        g2.get("side_k"),
        g2.get("side_v"),
        int(group2_head),
        rg.get("k_codes"),
        rg.get("k_meta"),
        rg.get("v_codes"),
        rg.get("v_meta"),
    )


def kv16_decode_unsupported(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None
) -> str | None:
    """None if ``decode_kv16`` can serve q over the float16/bfloat16 cache tensors, else why not."""
    if not (q.is_cuda and k_cache.is_cuda and v_cache.is_cuda):
        return "tensors are not on a CUDA device"
    if not extension_available():
        return "the CUDA extension flash_attn_tq_cuda is not built"
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return "q, k_cache and v_cache must share a float16/bfloat16 dtype"
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or q.shape[-1] != k_cache.shape[-1]:
        return "shapes"
    if q.shape[-1] not in FUSED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (kernels: {FUSED_HEAD_DIMS})"
    hk = k_cache.shape[2]
    if hk == 0 or q.shape[2] % hk or (q.shape[2] // hk) * q.shape[1] > MAX_KV16_ROWS:
        return f"more than {MAX_KV16_ROWS} query rows per kv head"
    for t in (k_cache, v_cache):
        if t.stride(-1) != 1 or any(st % 8 for st in t.stride()[:3]) or t.data_ptr() % 16:
            return "cache rows must be contiguous and 16-byte aligned"
    if block_table is not None and k_cache.shape[1] & (k_cache.shape[1] - 1):
        return "page size must be a power of two"
    return None


def decode_kv16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
):
    """The decode kernel over a float16/bfloat16 cache ``[rows, cols, kv_heads, d]`` (rows = batch,
    or pages with ``block_table``). Returns (out like q, lse ``[batch, heads, seqlen_q]``)."""
    q = _aligned_rows(q)
    return torch.ops.flash_attn_tq.decode_kv16(
        q,
        k_cache,
        v_cache,
        seqlens_k,
        cache_batch_idx,
        block_table,
        float(softmax_scale),
        bool(causal),
        int(num_splits),
    )


def pack_reason(x: torch.Tensor, head_dim: int, quantizer: str, grid: str, fit: str, streaming: bool) -> str | None:
    """None if the quantize-on-write kernel can write ``x`` into a cache of these options, else why not."""
    if not (x.is_cuda and extension_available()):
        return "not a CUDA tensor, or the extension is not built"
    if x.dtype not in (torch.float16, torch.bfloat16) or head_dim not in FUSED_HEAD_DIMS:
        return "the kernel takes float16/bfloat16 at head_dim 64/128"
    if streaming or (quantizer, grid, fit) not in QUANT_IDS:
        return f"no kernel for {quantizer}/{grid}/fit={fit}{' (streaming)' if streaming else ''}"
    return None


PACK_ERRORS = {
    1: "contains NaN or Inf, or values beyond float16's range: a quantized cache cannot store them",
    2: "cache overflow: a new token's position is outside [0, max_seqlen)",
    4: "batch_idx holds an index outside [0, batch_size)",
    8: "block_table maps a new token to a page outside the cache",
}


def pack(
    x: torch.Tensor,
    codes: torch.Tensor,
    meta: torch.Tensor,
    start: torch.Tensor,
    batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    error_flags: torch.Tensor | None,
    capacity: int,
    bits: int,
    quant: int,
    signs: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
    *,
    side: torch.Tensor | None = None,
    side_sinks: int = 0,
    side_ring: int = 0,
    rope_center: torch.Tensor | None = None,
    rope_inv_freq: torch.Tensor | None = None,
    rope_offset: int = 0,
    v: torch.Tensor | None = None,
    v_codes: torch.Tensor | None = None,
    v_meta: torch.Tensor | None = None,
    v_bits: int = 0,
    v_signs: torch.Tensor | None = None,
    v_levels: torch.Tensor | None = None,
    v_side: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    tally: torch.Tensor | None = None,
    ring: Mapping[str, torch.Tensor] | None = None,
    ring_bits: int = 0,
) -> None:
    """Quantize ``x [batch, n, kv_heads, d]`` on the GPU into positions ``start[i] + j`` of cache rows
    ``batch_idx[i]`` (int32 ``[batch]``; None: row i) of ``codes``/``meta`` (paged through
    ``block_table``). The kernel resolves the slots, skips tokens it cannot place or store and ORs
    :data:`PACK_ERRORS` bits into ``error_flags`` (int32 [1]). ``quant``: a :data:`QUANT_IDS` value.

    In the same launch: ``side [batch rows, side_sinks + side_ring + 1, kv_heads, d]`` (x's dtype)
    receives x as given for sinks (position ``p < side_sinks`` to slot ``p``) and the chunk's last
    ``side_ring`` tokens (slot ``side_sinks + p % side_ring``); with ``rope_center [batch rows,
    kv_heads, d]`` and ``rope_inv_freq [d / 2]`` (float32) the codes hold ``x - R(p + rope_offset) c``
    (rounded to x's dtype), as :meth:`QuantizedKVCache.transform_keys` computes it. With ``v`` (x's
    shape and dtype: the values of the same tokens, x the keys), ``v_codes``/``v_meta``/``v_side``
    receive them as ``codes``/``meta``/``side`` receive x (no RoPE center): one launch for both. With
    ``lengths`` (int32 ``[rows]``, e.g. the cache's seqlens; ``start`` may overlap them only where
    ``start[i]`` is ``lengths[batch_idx[i]]`` itself, as for the cache's own counts) and
    ``tally`` (int32 ``[1]``, zero between calls, one per ``lengths``) the launch ends by setting
    ``lengths[batch_idx[i]] = start[i] + n``, unless it met an error (then no length moves). With
    ``ring`` (``{"k_codes", "k_meta", "v_codes", "v_meta"}`` ``[batch rows, R, kv_heads, *]``, a
    contiguous cache, turbo's uniform grid) the chunk's last ``R`` tokens also go to slot ``p % R``
    as ``ring_bits``-wide codes (:data:`FUSED_RING_WINDOW_BITS`; the window codes of
    ``QuantizedKVCache``'s ``window_bits``)."""
    rg = ring or {}
    x3 = _pack_rows(x)
    v3 = None if v is None else _pack_rows(v)
    torch.ops.flash_attn_tq.pack_kv(
        x3,
        None,
        start,
        batch_idx,
        block_table,
        codes,
        meta,
        error_flags,
        capacity,
        bits,
        quant,
        signs,
        levels,
        float(uniform_step(bits)),
        side,
        side_sinks,
        side_ring,
        rope_center,
        rope_inv_freq,
        rope_offset,
        v3,
        v_codes,
        v_meta,
        v_bits,
        float(uniform_step(v_bits)) if v is not None else 1.0,
        v_signs,
        v_levels,
        v_side,
        lengths,
        tally,
        rg.get("k_codes"),
        rg.get("k_meta"),
        rg.get("v_codes"),
        rg.get("v_meta"),
        int(ring_bits),
        float(uniform_step(ring_bits)) if ring else 1.0,
    )


def _pack_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [batch, n, kv_heads, d]`` as the pack kernel's ``[tokens, kv_heads, d]`` rows (16-byte aligned)."""
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    misaligned = not torch.compiler.is_compiling() and x3.data_ptr() % 16  # (the op checks it too)
    if x3.stride(-1) != 1 or x3.stride(0) % 8 or x3.stride(1) % 8 or misaligned:
        x3 = x3.clone(memory_format=torch.contiguous_format)  # the kernel loads 16-byte aligned rows
    return x3


def raise_pack_errors(flags: int, names: str = "k/v") -> None:
    """Raise the ValueError for the error bits a pack call set (no-op for 0)."""
    for bit, msg in PACK_ERRORS.items():
        if flags & bit:
            raise ValueError(f"{names}: {msg}" if bit == 1 else msg)
