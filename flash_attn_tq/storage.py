"""Where a quantized cache's tensors lie: the contiguous and paged layouts, head-major in memory, the
16-bit side and the ring of window codes; and how a token's slot is found.

Contiguous layout: ``k_codes [batch, max_seqlen, kv_heads, code_bytes]`` uint8 and ``k_meta [batch,
max_seqlen, kv_heads, 1 or 2]`` float16 (the same for v). Paged layout (``page_size``): ``[num_blocks,
page_size, kv_heads, *]`` with ``block_table [batch, max_blocks_per_seq]`` int32 mapping each
sequence's pages to blocks (default: sequence ``b`` owns blocks ``b * max_blocks_per_seq ...``). In
memory the four tensors are head-major (views of ``[rows, kv_heads, cols, *]`` storage): a head's
consecutive tokens are adjacent, so the decode kernel reads whole sectors.

The 16-bit side ``kv_side [2, batch, sink_tokens + side_recent + 1, kv_heads, d]`` holds K and V of the
sinks (sink ``p`` in slot ``p``) and of the 16-bit window (token ``p`` in slot ``sinks + p % recent``);
the last slot takes the writes of tokens that are neither. A ring of window codes (``window_bits``
< 16): ``k_window_codes [batch, fp16_window, kv_heads, window code bytes]`` + ``k_window_meta``.
"""

from __future__ import annotations

import math

import torch

from . import format as fmt
from .spec import CacheSpec, is_int

# the tensors a cache owns, as attributes of the same names (None where the spec has no such part)
TENSORS = (
    "k_codes",
    "v_codes",
    "k_meta",
    "v_meta",
    "seqlens",
    "kv_side",
    "k_window_codes",
    "v_window_codes",
    "k_window_meta",
    "v_window_meta",
    "block_table",
)
PER_TOKEN = ("k_codes", "v_codes", "k_meta", "v_meta")  # [rows, cols, kv_heads, *]


def head_major(rows: int, cols: int, heads: int, last: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros shaped ``[rows, cols, heads, last]`` stored as ``[rows, heads, cols, last]``."""
    return torch.zeros(rows, heads, cols, last, dtype=dtype, device=device).permute(0, 2, 1, 3)


def default_block_table(
    spec: CacheSpec, batch_size: int, max_seqlen: int, num_blocks: int | None, block_table: torch.Tensor | None
) -> tuple[torch.Tensor | None, int]:
    """The block table and block count of a cache (None and 0 for a contiguous one), checked."""
    if spec.page_size is None:
        if num_blocks is not None or block_table is not None:
            raise ValueError("num_blocks/block_table need page_size (the paged layout)")
        return None, 0
    if num_blocks is not None and (not is_int(num_blocks) or num_blocks <= 0):
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    page, per_seq = spec.page_size, math.ceil(max_seqlen / spec.page_size)
    if block_table is None:
        nb = num_blocks if num_blocks is not None else batch_size * per_seq
        if nb < batch_size * per_seq:
            raise ValueError(
                f"num_blocks={nb} is fewer than batch_size * ceil(max_seqlen / page_size) = "
                f"{batch_size * per_seq}; pass a block_table to share blocks"
            )
        return torch.arange(batch_size * per_seq, dtype=torch.int32).reshape(batch_size, per_seq), int(nb)
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] != batch_size
    ):
        got = (
            f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor) else block_table
        )
        raise ValueError(f"block_table must be int32 [batch_size={batch_size}, max_blocks_per_seq], got {got}")
    if block_table.shape[1] * page < max_seqlen:
        raise ValueError(
            f"block_table has {block_table.shape[1]} pages of {page} per sequence, fewer than max_seqlen={max_seqlen}"
        )
    nb = num_blocks if num_blocks is not None else int(block_table.max()) + 1 if block_table.numel() else 1
    if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= nb):
        raise ValueError(f"block_table entries must lie in [0, num_blocks={nb})")
    return block_table, int(nb)


def allocate(
    spec: CacheSpec,
    batch_size: int,
    max_seqlen: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    num_blocks: int | None = None,
    block_table: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """The zeroed tensors of a cache (:data:`TENSORS`), by name."""
    table, nb = default_block_table(spec, batch_size, max_seqlen, num_blocks, block_table)
    rows, cols = (batch_size, max_seqlen) if table is None else (nb, spec.page_size)
    H, meta = num_kv_heads, spec.meta_words
    out: dict[str, torch.Tensor | None] = dict(
        k_codes=head_major(rows, cols, H, fmt.code_bytes(head_dim, spec.k_bits), torch.uint8, device),
        v_codes=head_major(rows, cols, H, fmt.code_bytes(head_dim, spec.v_bits), torch.uint8, device),
        k_meta=head_major(rows, cols, H, meta, torch.float16, device),
        v_meta=head_major(rows, cols, H, meta, torch.float16, device),
        seqlens=torch.zeros(batch_size, dtype=torch.int32, device=device),
        block_table=None if table is None else table.to(device),
        kv_side=None,
    )
    if spec.side_slots:  # (+ one slot for the writes of other tokens)
        side = (2, batch_size, spec.side_slots + 1, H, head_dim)
        out["kv_side"] = torch.zeros(side, dtype=spec.dtype, device=device)
    for name in ("k_window_codes", "v_window_codes", "k_window_meta", "v_window_meta"):
        out[name] = None
    if spec.window_codes:
        R, wb = spec.fp16_window, fmt.code_bytes(head_dim, spec.window_bits)
        out["k_window_codes"] = torch.zeros(batch_size, R, H, wb, dtype=torch.uint8, device=device)
        out["v_window_codes"] = torch.zeros_like(out["k_window_codes"])
        out["k_window_meta"] = torch.zeros(batch_size, R, H, meta, dtype=torch.float16, device=device)
        out["v_window_meta"] = torch.zeros_like(out["k_window_meta"])
    return out


def slots(
    block_table: torch.Tensor | None, page_size: int | None, rows: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns of the per-token tensors holding position ``pos`` of sequence ``rows``."""
    if block_table is None:
        return rows, pos
    block = block_table[rows, torch.div(pos, page_size, rounding_mode="floor")].long()
    return block, pos % page_size


def storages_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory behind ``a`` and ``b`` overlaps: views of one storage, or tensors made over
    the same memory another way (e.g. DLPack), whose storages begin at different addresses."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() < sb.data_ptr() + sb.nbytes() and sb.data_ptr() < sa.data_ptr() + sa.nbytes()
