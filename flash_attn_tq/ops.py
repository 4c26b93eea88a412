"""The CUDA kernels (``torch.ops.flash_attn_tq.*``) and when they can be used.

The extension ``flash_attn_tq_cuda`` registers three ops:

* ``decode_kvcache(q, k_codes, k_meta, v_codes, v_meta, seqlens_k, cache_batch_idx, block_table,
  rot_signs, k_bits, v_bits, softmax_scale, is_causal, num_splits, ..., rope_centre, rope_inv_freq,
  rope_offset, side_k, side_v, side_sinks, side_ring, codes_tail) -> (out, softmax_lse)``: split-KV
  attention of ``q [batch, seqlen_q, heads, d]`` over packed K/V and, in the same launch, a 16-bit
  side (sink tokens and a recent-token ring): the decode kernel, or from :data:`PREFILL_MIN_ROWS`
  query rows a kv head the prefill kernel (not with ``rope_centre``, whose ``q . R(p) c`` the decode
  kernel adds, nor with a side or ``codes_tail``).
* ``decode_kv16(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale,
  is_causal, num_splits) -> (out, softmax_lse)``: the same kernel body over a float16/bfloat16
  cache (its Fp16KV loader policy): our FP16 decode baseline.
* ``pack_kv(x, slot_mapping, start, batch_idx, block_table, codes, meta, error_flags, capacity, bits,
  quant, signs, levels, step)``: quantize-on-write into slots given by a vLLM-style ``slot_mapping``
  or resolved in the kernel from (start, batch_idx, block_table), with range checks.

Fake (meta) implementations are registered here so both trace under ``torch.compile``.
"""
from __future__ import annotations

import functools

import torch

from .quantizers import uniform_step

FUSED_HEAD_DIMS = (64, 128)
FUSED_DECODE_BITS = ((3, 3), (4, 3), (8, 3), (8, 8))  # (k_bits, v_bits) with a fused decode kernel
# (k_bits, v_bits) whose fused kernel takes float16 queries only (an 8-bit code in the magic number
# needs float16's mantissa) and runs the decode kernel for every row count (no prefill kernel)
FP16_ONLY_BITS = ((8, 3), (8, 8))
# Query rows a kv head (GQA group size * seqlen_q) from which decode_kvcache runs its prefill kernel
# (256-row CTAs, each packed tile expanded once into shared memory) instead of the decode kernel
# (16-row CTAs, each expanding every tile itself); mirrors kPrefillMinRows in flash_api_tq.cpp.
PREFILL_MIN_ROWS = 128
# Rows a kv head decode_kv16 (the fp16 cache, decode kernel only) takes; more take the reference path.
MAX_KV16_ROWS = 256
QUANT_IDS = {("turbo", "uniform", "norm"): 0, ("turbo", "lloyd_max", "norm"): 1, ("asym", "uniform", "norm"): 2,
             ("turbo", "uniform", "mean"): 3}  # (quantizer, grid, fit) -> the pack kernel's Quant


@functools.lru_cache(maxsize=None)
def extension_available() -> bool:
    """True when the compiled kernels are importable (they still need a CUDA device to run)."""
    try:
        import flash_attn_tq_cuda  # noqa: F401  (registers torch.ops.flash_attn_tq.*)
    except (ImportError, OSError):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("flash_attn_tq::decode_kvcache")
    def _decode_fake(q, k_codes, k_meta, v_codes, v_meta, seqlens_k, cache_batch_idx, block_table, rot_signs,
                     k_bits, v_bits, softmax_scale, is_causal, num_splits, window_left=-1, window_right=-1,
                     cache_leftpad=None, softcap=0.0, rope_centre=None, rope_inv_freq=None, rope_offset=0,
                     side_k=None, side_v=None, side_sinks=0, side_ring=0, codes_tail=0):
        b, sq, h, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_tq::decode_kv16")
    def _decode_kv16_fake(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, is_causal,
                          num_splits):
        b, sq, h, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_tq::pack_kv")
    def _pack_fake(x, slot_mapping, start, batch_idx, block_table, codes, meta, error_flags, capacity, bits, quant,
                   signs, levels, step):
        return None


def fused_decode_supported(cache, q: torch.Tensor) -> str | None:
    """None if the fused decode kernel can serve ``q`` over ``cache``, else the reason it cannot."""
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if not extension_available():
        return "the CUDA extension flash_attn_tq_cuda is not built"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {q.dtype} (the kernel takes float16/bfloat16)"
    if cache.head_dim not in FUSED_HEAD_DIMS:
        return f"head_dim {cache.head_dim} (kernels: {FUSED_HEAD_DIMS})"
    if (cache.k_bits, cache.v_bits) not in FUSED_DECODE_BITS:
        return f"K{cache.k_bits}V{cache.v_bits} (kernels: {FUSED_DECODE_BITS})"
    if (cache.k_bits, cache.v_bits) in FP16_ONLY_BITS and q.dtype != torch.float16:
        return f"K{cache.k_bits}V{cache.v_bits} with {q.dtype} queries (its kernel takes float16)"
    if cache.grid != "uniform":
        return "the Lloyd-Max grid (the kernel folds the uniform grid's affine levels)"
    if getattr(cache, "rope_center", False) and cache.paged and cache.page_size < 32:
        return f"key_center='rope' with {cache.page_size}-token pages (its kernel takes 32 or more)"
    return None


def _aligned_rows(q: torch.Tensor) -> torch.Tensor:
    """q as the kernels read it: contiguous rows at (head_dim / 16)-byte alignment (else a copy)."""
    vec = q.shape[-1] // 32
    misaligned = not torch.compiler.is_compiling() and q.data_ptr() % (2 * vec)  # (the op checks it too)
    if q.stride(-1) != 1 or misaligned or any(st % vec for st in q.stride()[:3]):
        return q.clone(memory_format=torch.contiguous_format)
    return q


def decode(q: torch.Tensor, cache, seqlens_k: torch.Tensor, batch_idx: torch.Tensor | None,
           softmax_scale: float, causal: bool, num_splits: int, window_size: tuple[int, int] = (-1, -1),
           leftpad: torch.Tensor | None = None, softcap: float = 0.0):
    """Fused attention of ``q [batch, seqlen_q, heads, d]`` over ``cache``'s tokens: its codes and,
    in the same launch, its 16-bit side (sinks and the 16-bit window; a window of ``window_bits``
    codes is left to the caller: the codes are read up to ``seqlens_k - fp16_window`` either way).

    ``seqlens_k [batch]`` int32: keys ``[leftpad[b], seqlens_k[b])`` are attended (``leftpad``: int32
    ``[batch]`` or None), within ``window_size`` (upstream's local attention, bottom-right aligned;
    -1: unbounded), scores soft-capped at ``softcap`` (0: off). For turbo caches the kernel
    rotates q into the codes' domain and the output back. Returns (out, lse ``[batch, heads, seqlen_q]``).
    """
    signs = cache.k_quantizer.signs_on(q.device) if cache.quantizer == "turbo" else None
    q = _aligned_rows(q)
    centre = inv_freq = None
    if getattr(cache, "rope_center", False):  # the kernel adds each score's q . R(p) c back
        centre = cache._per_row(cache.k_shift, batch_idx, q.shape[0]).float().contiguous()
        inv_freq = cache.rope_inv_freq
    side = cache.kv_side
    return torch.ops.flash_attn_tq.decode_kvcache(
        q, cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta, seqlens_k,
        batch_idx, cache.block_table, signs, cache.k_bits, cache.v_bits, float(softmax_scale), bool(causal),
        int(num_splits), int(window_size[0]), int(window_size[1]), leftpad, float(softcap),
        centre, inv_freq, int(cache.rope_position_offset) if centre is not None else 0,
        None if side is None else side[0], None if side is None else side[1], cache.sink_tokens,
        cache.side_ring, cache.fp16_window)


def kv16_decode_unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor | None) -> str | None:
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


def decode_kv16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None, softmax_scale: float,
                causal: bool, num_splits: int):
    """The decode kernel over a float16/bfloat16 cache ``[rows, cols, kv_heads, d]`` (rows = batch,
    or pages with ``block_table``). Returns (out like q, lse ``[batch, heads, seqlen_q]``)."""
    q = _aligned_rows(q)
    return torch.ops.flash_attn_tq.decode_kv16(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table,
                                               float(softmax_scale), bool(causal), int(num_splits))


def pack_supported(cache, x: torch.Tensor) -> bool:
    return (x.is_cuda and extension_available() and x.dtype in (torch.float16, torch.bfloat16)
            and cache.head_dim in FUSED_HEAD_DIMS and not cache.streaming
            and (cache.quantizer, cache.grid, getattr(cache, "fit", "norm")) in QUANT_IDS)


PACK_ERRORS = {1: "contains NaN or Inf: a quantized cache cannot store them",
               2: "cache overflow: a new token's position is outside [0, max_seqlen)",
               4: "batch_idx holds an index outside [0, batch_size)",
               8: "block_table maps a new token to a page outside the cache"}


def pack_into(cache, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, batch_idx: torch.Tensor | None,
              error_flags: torch.Tensor | None = None) -> None:
    """Quantize ``k, v [batch, n, kv_heads, d]`` on the GPU into positions ``start[i] + j`` of cache
    rows ``batch_idx[i]`` (int32 ``[batch]``; None: row i). The kernel resolves paged slots, skips
    tokens it cannot place or store and ORs :data:`PACK_ERRORS` bits into ``error_flags`` (int32 [1])."""
    quant = QUANT_IDS[(cache.quantizer, cache.grid, getattr(cache, "fit", "norm"))]
    for x, codes, meta, qz, bits in ((k, cache.k_codes, cache.k_meta, cache.k_quantizer, cache.k_bits),
                                     (v, cache.v_codes, cache.v_meta, cache.v_quantizer, cache.v_bits)):
        signs = levels = None
        if cache.quantizer == "turbo":
            signs = qz.signs_on(x.device)
            levels = qz.codebook(x.device) if cache.grid == "lloyd_max" else None
        x3 = x.reshape(-1, cache.num_kv_heads, cache.head_dim)
        misaligned = not torch.compiler.is_compiling() and x3.data_ptr() % 16  # (the op checks it too)
        if x3.stride(-1) != 1 or x3.stride(0) % 8 or x3.stride(1) % 8 or misaligned:
            x3 = x3.clone(memory_format=torch.contiguous_format)  # the kernel loads 16-byte aligned rows
        torch.ops.flash_attn_tq.pack_kv(x3, None, start, batch_idx, cache.block_table, codes, meta, error_flags,
                                        cache.max_seqlen, bits, quant, signs, levels, float(uniform_step(bits)))


def raise_pack_errors(flags: int, names: str = "k/v") -> None:
    """Raise the ValueError for the error bits a pack call set (no-op for 0)."""
    for bit, msg in PACK_ERRORS.items():
        if flags & bit:
            raise ValueError(f"{names}: {msg}" if bit == 1 else msg)
