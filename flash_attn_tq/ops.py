"""The CUDA kernels (``torch.ops.flash_attn_tq.*``): one flattener, one fake and one C++ unpacker a op.

The extension ``flash_attn_tq_cuda`` registers three ops:

* ``decode_kvcache(q, seqlens_k, cache_batch_idx, block_table, cache_leftpad, stores, layout,
  rot_signs, rope_inv_freq, rope_offset, kernel, softmax_scale, is_causal, num_splits, window_left,
  window_right, softcap) -> (out, softmax_lse)``: attention of ``q [batch, seqlen_q, heads, d]`` over a
  cache described as a list of K/V *stores* (:class:`Store`): packed codes of one or two head groups,
  their RoPE centers, a 16-bit side (sink tokens and recent slots), a ring of window codes, or a
  float16/bfloat16 cache. ``kernel`` (:data:`KERNEL_IDS`) is what :func:`flash_attn_tq.dispatch.plan`
  chose; the op checks that the stores and the device can run it.
* ``pack_kv(k, v, slot_mapping, start, batch_idx, block_table, stores, layout, steps, k_signs,
  v_signs, k_levels, v_levels, rope_center, rope_inv_freq, rope_offset, error_flags, lengths, tally,
  capacity, quant)``: quantize-on-write into the stores it is given (codes, the 16-bit side, the ring
  of window codes), in slots given by a vLLM-style ``slot_mapping`` or resolved in the kernel from
  (``start``, ``batch_idx``, ``block_table``), with range checks.
* ``build_info() -> [sm_90a code built, the prefill kernel's shared-memory budget in bytes]``.

A new kind of store is a new :class:`Store` kind here and in the C++ unpacker, not new arguments.
Fake (meta) implementations are registered here so the ops trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .quantizers import uniform_step

# Store kinds (csrc/flash_attn/flash_api_tq.cpp, StoreKind) and how many tensors each brings (a pack
# without v: the K half of each)
CODES, SIDE, WINDOW, CENTER, KV16 = range(5)
STORE_TENSORS = {CODES: 4, SIDE: 2, WINDOW: 4, CENTER: 1, KV16: 2}
KERNEL_IDS = {"decode": 0, "prefill": 1, "prefill-wgmma": 2, "pair": 0, "ring": 0, "kv16": 0}
LAYOUT_INTS = 6  # (kind, group, k_bits, v_bits, a, b) a store

PACK_ERRORS = {
    1: "contains NaN or Inf, or values beyond float16's range: a quantized cache cannot store them",
    2: "cache overflow: a new token's position is outside [0, max_seqlen)",
    4: "batch_idx holds an index outside [0, batch_size)",
    8: "block_table maps a new token to a page outside the cache",
}


class Store(NamedTuple):
    """One K/V store of a kernel call. ``group``: the layer's head group it belongs to (0, or 1 for a
    second group of other widths in the same launch).

    * ``CODES``: ``tensors = (k_codes, k_meta, v_codes, v_meta)``, ``[rows, cols, kv_heads, bytes]``
      uint8 and ``[rows, cols, kv_heads, 1 or 2]`` float16 (rows: sequences, or pages with a
      block table); ``a``: the codes end ``a`` tokens before a sequence's last key (those are read
      from a side or a ring); ``b``: group 1's first kv head among the layer's.
    * ``SIDE``: ``(k, v)`` ``[rows, >= a + b, kv_heads, d]`` in q's dtype: ``a`` sink tokens, then
      ``b`` recent-token slots (token ``p`` in slot ``a + p % b``).
    * ``WINDOW``: ``(k_codes, k_meta, v_codes, v_meta)`` ``[rows, R, kv_heads, *]``: a ring of
      ``k_bits``-wide window codes, token ``p`` in slot ``p % R``.
    * ``CENTER``: ``(center,)`` ``[batch, kv_heads, d]`` float32: the group's RoPE center ``c``.
    * ``KV16``: ``(k_cache, v_cache)`` ``[rows, cols, kv_heads, d]`` float16/bfloat16.
    """

    kind: int
    tensors: tuple[torch.Tensor, ...]
    group: int = 0
    k_bits: int = 0
    v_bits: int = 0
    a: int = 0
    b: int = 0


_LOADED: dict[str, object] = {}  # (a dict: torch.compile reads it as a constant)


def extension_available() -> bool:
    """True when the compiled kernels are importable (they still need a CUDA device to run)."""
    if "extension" not in _LOADED:
        _LOADED["extension"] = _load_extension()
    return bool(_LOADED["extension"])


def _load_extension() -> bool:
    try:
        import flash_attn_tq_cuda  # noqa: F401  (registers torch.ops.flash_attn_tq.*)
    except (ImportError, OSError):
        return False
    register_fakes()
    return True


def build_info() -> tuple[bool, int]:
    """(the extension holds sm_90a code, the prefill kernel's shared-memory budget in bytes)."""
    if "build" not in _LOADED:
        sm90a, budget = torch.ops.flash_attn_tq.build_info()
        _LOADED["build"] = (bool(sm90a), int(budget))
    return _LOADED["build"]


def capturing() -> bool:
    """True while a CUDA graph is being captured or ``torch.compile`` traces: value checks that read
    the GPU back are skipped then (a traced step must not sync; its pack errors are read later)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def register_fakes() -> None:
    """The ops' fake implementations (shapes only), for ``torch.compile``."""

    @torch.library.register_fake("flash_attn_tq::decode_kvcache")
    def _decode_fake(q, seqlens_k, cache_batch_idx, block_table, cache_leftpad, stores, layout, *options):
        b, sq, h, _ = q.shape
        return torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32)

    @torch.library.register_fake("flash_attn_tq::pack_kv")
    def _pack_fake(k, v, slot_mapping, start, batch_idx, block_table, stores, layout, steps, *options):
        return None


def _flatten(stores: Sequence[Store]) -> tuple[list[torch.Tensor], list[int]]:
    """The stores as the ops take them: their tensors in order, and ``LAYOUT_INTS`` ints a store."""
    tensors, layout = [], []
    for s in stores:
        tensors.extend(s.tensors)
        layout.extend((s.kind, s.group, s.k_bits, s.v_bits, s.a, s.b))
    return tensors, layout


def unflatten(tensors: Sequence[torch.Tensor], layout: Sequence[int], with_v: bool = True) -> list[Store]:
    """The stores an op call was given (the inverse of the flattening; ``with_v=False``: a pack without v)."""
    stores, at = [], 0
    for i in range(0, len(layout), LAYOUT_INTS):
        kind, group, k_bits, v_bits, a, b = layout[i : i + LAYOUT_INTS]
        n = STORE_TENSORS[kind] if with_v else STORE_TENSORS[kind] // 2
        stores.append(Store(kind, tuple(tensors[at : at + n]), group, k_bits, v_bits, a, b))
        at += n
    if at != len(tensors):
        raise ValueError(f"stores: {len(tensors)} tensors for a layout of {at}")
    return stores


def aligned_rows(q: torch.Tensor) -> torch.Tensor:
    """q as the kernels read it: contiguous rows at (head_dim / 16)-byte alignment (else a copy)."""
    vec = q.shape[-1] // 32
    misaligned = not torch.compiler.is_compiling() and q.data_ptr() % (2 * vec)  # (the op checks it too)
    if q.stride(-1) != 1 or misaligned or any(st % vec for st in q.stride()[:3]):
        return q.clone(memory_format=torch.contiguous_format)
    return q


def decode(
    q: torch.Tensor,
    stores: Sequence[Store],
    seqlens_k: torch.Tensor,
    batch_idx: torch.Tensor | None = None,
    *,
    softmax_scale: float,
    causal: bool,
    num_splits: int = 0,
    kernel: str = "decode",
    block_table: torch.Tensor | None = None,
    leftpad: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rot_signs: torch.Tensor | None = None,
    rope_inv_freq: torch.Tensor | None = None,
    rope_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of ``q [batch, seqlen_q, heads, d]`` over ``stores``. ``seqlens_k [batch]``
    int32: keys ``[leftpad[b], seqlens_k[b])`` are attended (``leftpad``: int32 ``[batch]`` or None),
    within ``window_size`` (upstream's local attention, bottom-right aligned; -1: unbounded), scores
    soft-capped at ``softcap`` (0: off); rows ``batch_idx [batch]`` int32 of the cache (None:
    0..batch-1), through ``block_table`` when paged. ``rot_signs [d]``: turbo's rotation (the kernel
    rotates q in and the output back); ``rope_inv_freq [d / 2]``: with ``CENTER`` stores each score gets
    ``q . R(p + rope_offset) c`` back. ``kernel``: the plan's choice (:data:`KERNEL_IDS`).
    Returns (out like q, lse ``[batch, heads, seqlen_q]`` float32)."""
    tensors, layout = _flatten(stores)
    return torch.ops.flash_attn_tq.decode_kvcache(
        aligned_rows(q),
        seqlens_k,
        batch_idx,
        block_table,
        leftpad,
        tensors,
        layout,
        rot_signs,
        rope_inv_freq,
        int(rope_offset),
        KERNEL_IDS[kernel],
        float(softmax_scale),
        bool(causal),
        int(num_splits),
        int(window_size[0]),
        int(window_size[1]),
        float(softcap),
    )


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel over a float16/bfloat16 cache ``[rows, cols, kv_heads, d]`` (rows = batch,
    or pages with ``block_table``). Returns (out like q, lse ``[batch, heads, seqlen_q]``)."""
    store = Store(KV16, (k_cache, v_cache))
    return decode(
        q,
        (store,),
        seqlens_k,
        cache_batch_idx,
        softmax_scale=softmax_scale,
        causal=causal,
        num_splits=num_splits,
        block_table=block_table,
    )


def pack(
    k: torch.Tensor,
    v: torch.Tensor | None,
    stores: Sequence[Store],
    *,
    start: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    quant: int,
    capacity: int,
    signs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    levels: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    rope_center: torch.Tensor | None = None,
    rope_inv_freq: torch.Tensor | None = None,
    rope_offset: int = 0,
    error_flags: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    tally: torch.Tensor | None = None,
) -> None:
    """Quantize ``k`` (and ``v``, the values of the same tokens) ``[batch, n, kv_heads, d]`` on the GPU
    into ``stores``: ``CODES`` (the codes and metadata: ``(k_codes, k_meta)`` and with ``v``
    ``(v_codes, v_meta)``), optionally ``SIDE`` (``(k_side,)`` / ``(k_side, v_side)``, ``[batch rows,
    a + b + 1, kv_heads, d]``: sinks ``p < a`` to slot ``p``, the chunk's last ``b`` tokens to slot
    ``a + p % b``) and ``WINDOW`` (a ring of window codes: the chunk's last ``R`` tokens to slot
    ``p % R``, ``k_bits`` wide). Slots: ``slot_mapping [tokens]`` int64 (vLLM's), or positions
    ``start[i] + j`` (int32 ``[batch]``) of cache rows ``batch_idx[i]`` (int32; None: row i), paged
    through ``block_table``. The kernel resolves the slots, skips tokens it cannot place or store
    and ORs :data:`PACK_ERRORS` bits into ``error_flags`` (int32 [1]). ``quant``: the kernel's
    quantizer id (:data:`flash_attn_tq.kernel_cases.PACK_QUANTIZERS`); ``signs``/``levels``: K's and V's
    rotation signs and Lloyd-Max levels. With ``rope_center [batch rows, kv_heads, d]`` and
    ``rope_inv_freq [d / 2]`` (float32) the codes hold ``k - R(p + rope_offset) c``. With ``lengths``
    (int32 ``[rows]``, the cache's seqlens; ``start`` may be a view of them) and ``tally`` (int32
    ``[1]``, zero between calls) the launch ends by setting ``lengths[row] = start[i] + n``, unless it
    met an error."""
    tensors, layout = _flatten(stores)
    steps = [float(uniform_step(bits)) if bits else 1.0 for s in stores for bits in (s.k_bits, s.v_bits)]
    torch.ops.flash_attn_tq.pack_kv(
        _pack_rows(k),
        None if v is None else _pack_rows(v),
        slot_mapping,
        start,
        batch_idx,
        block_table,
        tensors,
        layout,
        steps,
        signs[0],
        signs[1],
        levels[0],
        levels[1],
        rope_center,
        rope_inv_freq,
        int(rope_offset),
        error_flags,
        lengths,
        tally,
        int(capacity),
        int(quant),
    )


def _pack_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [batch, n, kv_heads, d]`` (or ``[tokens, kv_heads, d]``) as the pack kernel's ``[tokens,
    kv_heads, d]`` rows (16-byte aligned)."""
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
