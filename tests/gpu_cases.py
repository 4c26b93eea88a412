"""Shared pieces of the GPU tests (test_cuda_*.py): device, decode shape cases, output poisoning."""

from __future__ import annotations

import math

import pytest
import torch

from flash_attn_tq import ops

DEV = "cuda"

# the marks of a GPU test module (pytestmark = NEEDS_GPU): selected by -m gpu, skipped without the extension
NEEDS_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not ops.extension_available(),
        reason="needs a CUDA GPU and the flash_attn_tq_cuda extension",
    ),
]

DECODE_CASES = [
    # batch, seqlens, q heads, kv heads, seqlen_q
    (1, [1], 8, 2, 1),
    (3, [63, 257, 4097], 32, 8, 1),
    (2, [1000, 17], 8, 8, 1),
    (2, [129, 300], 9, 3, 1),
    (2, [70, 33], 16, 1, 1),
    (2, [200, 513], 8, 2, 4),
    (1, [77], 4, 4, 16),
]

# chunked prefill: GQA group * seqlen_q >= kernel_cases.PREFILL_MIN_ROWS query rows a kv head (the prefill kernel)
PREFILL_CASES = [
    # batch, seqlens, q heads, kv heads, seqlen_q, causal
    (2, [700, 1500], 8, 2, 40, True),  # 160 rows: a partial 256-row CTA (five of its eight warps)
    (1, [129], 4, 4, 128, True),  # MHA, first query sees 2 keys, tile edges inside the chunk
    (2, [300, 65], 9, 3, 64, True),  # group of 3, a cache barely longer than the chunk
    (1, [4097], 32, 8, 33, False),  # 132 rows, long cache (splits), non-causal
    # from 256 rows a kv head Hopper runs the wgmma variant (ops' FLASH_ATTN_TQ_PREFILL_WGMMA)
    (1, [1000], 8, 2, 75, True),  # 300 rows: a 256-row CTA and one of 44 rows (warpgroup 1 has none)
    (1, [2500], 16, 2, 131, True),  # 1048 rows: four 256-row CTAs and a partial fifth (3 of 8 warps)
    (2, [1200, 3001], 8, 2, 260, False),  # 1040 rows, two lengths, non-causal
]


def shuffled_block_table(batch: int, max_len: int, page_size: int, seed: int) -> torch.Tensor:
    """int32 ``[batch, ceil(max_len / page_size)]``: every block once, in a seeded random order."""
    per_seq = math.ceil(max_len / page_size)
    perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
    return perm.reshape(batch, per_seq).to(torch.int32)


def poison_allocator(nbytes: int = 1 << 28, value: float = float("nan")) -> None:
    """Fill freed allocator blocks with NaN (or ``value``, where NaN is the expected output) so an
    output element the kernel never writes shows up."""
    junk = torch.full((nbytes // 4,), value, device=DEV)
    del junk
