"""The packed K/V code format, defined once.

Every K or V vector of ``head_dim`` elements is stored as

* ``codes``: ``code_bytes(head_dim, bits)`` bytes of unsigned ``bits``-bit codes, packed into
  little-endian 32-bit words (the tensor dtype is ``uint8``; the kernels read it as words);
* ``meta``: two float16 numbers ``(scale, offset)``; the vector's value in the quantizer's domain
  (the Hadamard-rotated space for ``turbo``) is ``scale * level(code) + offset`` where ``level`` is
  the identity for uniform grids and a codebook for Lloyd-Max grids (then ``offset`` is 0).

Bits per element at 3 bits: (48 + 4) * 8 / 128 = 3.25 at head_dim 128, (24 + 4) * 8 / 64 = 3.5 at 64.

**Pairs.** Codes are handled two at a time: the low and high 16-bit halves ("lanes") of a word
hold the two codes of one *pair*, at the same bit offset, so one shift, one ``lop3`` (mask and OR
with 0x6400) turns a word into an fp16x2 register holding ``1024 + code`` for both elements (the
fp16 "magic number" trick). Pair slot ``s`` (0 <= s < head_dim/2) holds the elements

    lo = 16 * (s % M) + s // M,   hi = lo + 8,      with M = head_dim // 16,

that is, thread-group ``g = s // M`` of a tensor-core fragment gets rows ``g`` and ``g + 8`` of
each 16-row block: exactly the two rows one thread owns in an ``m16n8k16`` A fragment, so the
decode kernel unpacks straight into MMA registers. :func:`pair_elements` is that permutation;
change it there (and in ``csrc/flash_attn/src/tq_format.h``) and both sides follow.

**Words.**

* 4 bits: 4 pairs a word; slot s in word s // 4 at bit 4*(s % 4) (lo) and 16 + 4*(s % 4) (hi).
* 2 bits: 8 pairs a word; slot s in word s // 8 at bit 2*(s % 8) and 16 + 2*(s % 8).
* 3 bits: blocks of 16 slots (32 elements) in 3 words (12 bytes). Slot r < 15 of block b sits in
  word 3b + r // 5 at bit 3*(r % 5) (lo) and 16 + 3*(r % 5) (hi); slot 15 uses the spare top bit
  of each 16-bit lane: bit i of its lo code is bit 15 of word 3b + i, bit i of its hi code is bit
  31 of word 3b + i. So 15 of 16 pairs unpack with one shift + one lop3.

A cache's codes tensor is ``[batch, seqlen, kv_heads, code_bytes]`` (contiguous) or
``[num_blocks, page_size, kv_heads, code_bytes]`` (paged, with ``block_table``); meta is the same
with a last dimension of 2 (float16).
"""
from __future__ import annotations

import functools

import torch

SUPPORTED_BITS = (2, 3, 4)
PAIR_GROUPS = 8  # thread groups of an MMA fragment: rows g and g + 8 of each 16-row block


def _check(head_dim: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if head_dim % 32 != 0 or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive multiple of 32, got {head_dim}")


def code_bytes(head_dim: int, bits: int) -> int:
    """Bytes of packed codes per vector (no metadata)."""
    _check(head_dim, bits)
    return head_dim * bits // 8


def bits_per_element(head_dim: int, bits: int) -> float:
    """Storage per element including the 4 bytes of float16 (scale, offset) metadata."""
    return (code_bytes(head_dim, bits) + 4) * 8 / head_dim


@functools.lru_cache(maxsize=None)
def _pair_elements(head_dim: int) -> tuple[tuple[int, int], ...]:
    m_blocks = head_dim // 16
    pairs = []
    for s in range(head_dim // 2):
        lo = 16 * (s % m_blocks) + s // m_blocks
        pairs.append((lo, lo + 8))
    return tuple(pairs)


def pair_elements(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim/2, 2]`` int64: the (lo, hi) element indices held by each pair slot."""
    return torch.tensor(_pair_elements(head_dim), dtype=torch.long, device=device)


def _pairs_per_word(bits: int) -> int:
    return {2: 8, 4: 4}[bits]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., head_dim]`` (values in ``[0, 2**bits)``) into ``uint8 [..., code_bytes]``."""
    head_dim = codes.shape[-1]
    _check(head_dim, bits)
    lead = codes.shape[:-1]
    perm = pair_elements(head_dim, codes.device)
    c = codes.to(torch.int64).reshape(-1, head_dim)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    lo = c[:, perm[:, 0]]  # [n, pairs]
    hi = c[:, perm[:, 1]]
    n, pairs = lo.shape
    if bits == 3:
        blocks = pairs // 16
        lo = lo.reshape(n, blocks, 16)
        hi = hi.reshape(n, blocks, 16)
        reg_lo = lo[:, :, :15].reshape(n, blocks, 3, 5)
        reg_hi = hi[:, :, :15].reshape(n, blocks, 3, 5)
        shifts = 3 * torch.arange(5, device=codes.device, dtype=torch.int64)
        words = ((reg_lo << shifts) | (reg_hi << (shifts + 16))).sum(-1)  # [n, blocks, 3]
        i = torch.arange(3, device=codes.device, dtype=torch.int64)
        spare_lo = (lo[:, :, 15:16] >> i) & 1
        spare_hi = (hi[:, :, 15:16] >> i) & 1
        words = words | (spare_lo << 15) | (spare_hi << 31)
        words = words.reshape(n, blocks * 3)
    else:
        ppw = _pairs_per_word(bits)
        reg_lo = lo.reshape(n, pairs // ppw, ppw)
        reg_hi = hi.reshape(n, pairs // ppw, ppw)
        shifts = bits * torch.arange(ppw, device=codes.device, dtype=torch.int64)
        words = ((reg_lo << shifts) | (reg_hi << (shifts + 16))).sum(-1)
    # little-endian bytes of each 32-bit word
    byte_shifts = 8 * torch.arange(4, device=codes.device, dtype=torch.int64)
    out = ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)
    return out.reshape(*lead, code_bytes(head_dim, bits))


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., code_bytes]`` -> ``int64 [..., head_dim]``."""
    _check(head_dim, bits)
    nbytes = code_bytes(head_dim, bits)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(f"packed codes must be uint8 [..., {nbytes}], got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    b = packed.reshape(-1, nbytes // 4, 4).to(torch.int64)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [n, words]
    n = words.shape[0]
    mask = (1 << bits) - 1
    if bits == 3:
        blocks = words.shape[1] // 3
        w = words.reshape(n, blocks, 3)
        shifts = 3 * torch.arange(5, device=packed.device, dtype=torch.int64)
        reg_lo = (w.unsqueeze(-1) >> shifts) & mask  # [n, blocks, 3, 5]
        reg_hi = (w.unsqueeze(-1) >> (shifts + 16)) & mask
        i = torch.arange(3, device=packed.device, dtype=torch.int64)
        spare_lo = (((w >> 15) & 1) << i).sum(-1, keepdim=True)  # [n, blocks, 1]
        spare_hi = (((w >> 31) & 1) << i).sum(-1, keepdim=True)
        lo = torch.cat([reg_lo.reshape(n, blocks, 15), spare_lo], -1).reshape(n, head_dim // 2)
        hi = torch.cat([reg_hi.reshape(n, blocks, 15), spare_hi], -1).reshape(n, head_dim // 2)
    else:
        ppw = _pairs_per_word(bits)
        shifts = bits * torch.arange(ppw, device=packed.device, dtype=torch.int64)
        lo = ((words.unsqueeze(-1) >> shifts) & mask).reshape(n, head_dim // 2)
        hi = ((words.unsqueeze(-1) >> (shifts + 16)) & mask).reshape(n, head_dim // 2)
    perm = pair_elements(head_dim, packed.device)
    codes = torch.empty(n, head_dim, dtype=torch.int64, device=packed.device)
    codes[:, perm[:, 0]] = lo
    codes[:, perm[:, 1]] = hi
    return codes.reshape(*lead, head_dim)
