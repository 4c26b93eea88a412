"""The packed K/V code format, defined once.

Every K or V vector of ``head_dim`` elements is stored as

* ``codes``: ``code_bytes(head_dim, bits)`` bytes of unsigned ``bits``-bit codes (the tensor
  dtype is ``uint8``; the kernels read it as 16-bit lanes and 32-bit words, little-endian);
* ``meta``: two float16 numbers ``(scale, offset)``; the vector's value in the quantizer's domain
  (the Hadamard-rotated space for ``turbo``) is ``scale * level(code) + offset`` where ``level`` is
  the identity for uniform grids and a codebook for Lloyd-Max grids (then ``offset`` is 0).
  *Scale-only* meta (turbo, uniform grid, norm fit, whose offset is always ``-mid * scale`` with
  ``mid = (2**bits - 1) / 2``): the one float16 ``scale``; the value is ``scale * (code - mid)``.

Bits per element at 3 bits: (48 + 4) * 8 / 128 = 3.25 at head_dim 128, (24 + 4) * 8 / 64 = 3.5 at 64;
scale-only: 3.125 and 3.25.

**Code order** (:func:`sequence_elements`, the one permutation the kernels and the reference
share). The codes are laid out as a sequence of 8 *groups*; group ``g`` holds, in order, the
elements ``16 m + g`` and ``16 m + g + 8`` for ``m = 0, 1, ...``: the two rows one thread owns in
each 16-row block of a tensor-core ``m16n8k16`` fragment. So sequence position ``n`` holds element

    g = n // (head_dim / 8),  k = n % (head_dim / 8),  element = 16 * (k // 2) + g + 8 * (k % 2).

**Lanes.** The sequence is packed into 16-bit lanes:

* 8 bits: 2 codes a lane, code ``n`` in lane ``n // 2`` at bit ``8 * (n % 2)`` (byte ``n``);
* 4 bits: 4 codes a lane, code ``n`` in lane ``n // 4`` at bit ``4 * (n % 4)``;
* 2 bits: 8 codes a lane, code ``n`` in lane ``n // 8`` at bit ``2 * (n % 8)``;
* 3 bits: blocks of 16 codes in 3 lanes (6 bytes). Code ``r < 15`` of block ``b`` sits in lane
  ``3 b + r // 5`` at bit ``3 * (r % 5)``; bit ``i`` of code 15 is the spare top bit (bit 15) of
  lane ``3 b + i``.

Lane ``l`` is bytes ``2 l, 2 l + 1``. At head_dim 128 a group is exactly one 3-bit block, so:

* V: a thread merges the same lane of two consecutive tokens into one 32-bit word (one byte
  permute), then one shift + one ``lop3`` (mask, OR the exponent of the fp16/bf16 "magic number")
  yields a register holding the same element of both tokens: half of a ``V^T`` A fragment.
* K: the 32-bit word of lanes ``(2 w, 2 w + 1)`` gives, per shift, two elements of one token: a
  ``K`` A-fragment register (Q is gathered in the same order, so q . k needs no other permutation).

A cache's codes tensor is ``[batch, seqlen, kv_heads, code_bytes]`` (contiguous) or
``[num_blocks, page_size, kv_heads, code_bytes]`` (paged, with ``block_table``); meta is the same
with a last dimension of 2 (float16).
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_BITS = (2, 3, 4, 8)
GROUPS = 8  # thread groups of an MMA fragment: rows g and g + 8 of each 16-row block


def _check(head_dim: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if head_dim % 32 != 0 or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive multiple of 32, got {head_dim}")


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of packed codes per vector (no metadata)."""
    _check(head_dim, bits)
    return head_dim * bits // 8


def bits_per_element(head_dim: int, bits: int, meta_bytes: int = 4) -> float:
    """Storage per element including the metadata: 4 bytes of float16 (scale, offset), or 2 for the
    scale alone (``scale_only``)."""
    return (code_bytes(head_dim, bits) + meta_bytes) * 8 / head_dim


@functools.lru_cache(maxsize=None)
def _sequence_elements(head_dim: int) -> tuple[int, ...]:
    per_group = head_dim // 8
    out = []
    for n in range(head_dim):
        g, k = divmod(n, per_group)
        out.append(16 * (k // 2) + g + 8 * (k % 2))
    return tuple(out)


def sequence_elements(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim]`` int64: the element stored at each position of the code sequence."""
    return torch.tensor(_sequence_elements(head_dim), dtype=torch.long, device=device)


@functools.lru_cache(maxsize=None)
def _lane_positions(head_dim: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For each code-sequence position: its lane and bit (3 bits: the spare code has bit -1)."""
    lanes, shifts = [], []
    for n in range(head_dim):
        if bits == 3:
            b, r = divmod(n, 16)
            lanes.append(3 * b + (r // 5 if r < 15 else 0))
            shifts.append(3 * (r % 5) if r < 15 else -1)
        else:
            per_lane = 16 // bits
            lanes.append(n // per_lane)
            shifts.append(bits * (n % per_lane))
    return tuple(lanes), tuple(shifts)


@functools.lru_cache(maxsize=None)
def _packing_indices(head_dim: int, bits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The index tensors of packing on ``device`` (cached: no host-to-device copy a call, so packing
    and unpacking also run inside CUDA-graph capture once warmed up): sequence elements, each
    regular position's lane and shift, the spare codes' lanes (3 bits)."""
    lane_idx, shift = (torch.tensor(t, device=device) for t in _lane_positions(head_dim, bits))
    regular = shift >= 0
    blocks = head_dim // 16
    spare_lanes = 3 * torch.arange(blocks, device=device)
    return (sequence_elements(head_dim, device), lane_idx, shift, regular.nonzero().squeeze(1), spare_lanes)


def pack_codes(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack integer codes ``[..., head_dim]`` (values in ``[0, 2**bits)``) into ``uint8 [..., code_bytes]``.
    ``check=False`` skips the range check (a host sync), for codes a quantizer just made."""
    head_dim = codes.shape[-1]
    _check(head_dim, bits)
    lead = codes.shape[:-1]
    seq_el, lane_idx, shift, regular, spare_lanes = _packing_indices(head_dim, bits, codes.device)
    c = codes.to(torch.int64).reshape(-1, head_dim)
    if check and c.numel() and (int(c.min()) < 0 or int(c.max()) >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    seq = c[:, seq_el]  # [n, head_dim] in sequence order
    n_lanes = code_bytes(head_dim, bits) // 2
    lanes = torch.zeros(c.shape[0], n_lanes, dtype=torch.int64, device=codes.device)
    lanes.index_add_(1, lane_idx[regular], seq[:, regular] << shift[regular])
    if bits == 3:  # spare codes: bit i -> bit 15 of lane 3b + i
        spare = seq[:, 15::16]  # [n, blocks]
        for i in range(3):
            lanes[:, spare_lanes + i] |= ((spare >> i) & 1) << 15
    out = torch.stack((lanes & 0xFF, lanes >> 8), -1).to(torch.uint8)
    return out.reshape(*lead, code_bytes(head_dim, bits))


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., code_bytes]`` -> ``int64 [..., head_dim]``."""
    _check(head_dim, bits)
    nbytes = code_bytes(head_dim, bits)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(f"packed codes must be uint8 [..., {nbytes}], got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    seq_el, lane_idx, shift, _, spare_lanes = _packing_indices(head_dim, bits, packed.device)
    b = packed.reshape(-1, nbytes // 2, 2).to(torch.int64)
    lanes = b[..., 0] | (b[..., 1] << 8)  # [n, lanes]
    seq = (lanes[:, lane_idx] >> shift.clamp(min=0)) & ((1 << bits) - 1)
    if bits == 3:
        spare = (lanes[:, spare_lanes] >> 15) & 1
        for i in range(1, 3):
            spare |= ((lanes[:, spare_lanes + i] >> 15) & 1) << i
        seq[:, 15::16] = spare
    codes = torch.empty(lanes.shape[0], head_dim, dtype=torch.int64, device=packed.device)
    codes[:, seq_el] = seq
    return codes.reshape(*lead, head_dim)
