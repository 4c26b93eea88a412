"""GPU tests of the decode kernel over a float16/bfloat16 cache (its Fp16KV loader policy, the same
kernel body as the 3-bit path): our FP16 baseline, also reached through flash_attn_with_kvcache
when upstream flash_attn is not installed.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from gpu_cases import DECODE_CASES, DEV, NEEDS_GPU, poison_allocator

import flash_attn_tq as fa
from flash_attn_tq import baseline, interface, ops

pytestmark = NEEDS_GPU


def _kv(batch, capacity, hk, d, dtype, seed, seqlens=None):
    """Random K/V caches [batch, capacity, hk, d]; slots at or past seqlens[b] hold NaN (never read)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k = (torch.randn(batch, capacity, hk, d, device=DEV, generator=gen) * 1.5 + 0.3).to(dtype)
    v = torch.randn(batch, capacity, hk, d, device=DEV, generator=gen).to(dtype)
    if seqlens is not None:
        for b, n in enumerate(seqlens):
            k[b, n:] = float("nan")
            v[b, n:] = float("nan")
    return k, v


def _references(q, k, v, lens, causal):
    """float32 attention, and the same with 16-bit probabilities and output (what a 16-bit kernel
    computes); the kernel may err at most about twice as much as the second does."""
    kw = k.float().cpu().nan_to_num(0.0)
    vw = v.float().cpu().nan_to_num(0.0)
    out, lse = baseline.attention_reference(q.float().cpu(), kw, vw, causal=causal, key_lengths=lens.cpu())
    # 16-bit version: P = exp(s - lse) rounded to q's dtype
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float().cpu(), kw.repeat_interleave(g, 2)) / math.sqrt(d)
    pos = torch.arange(k.shape[1])
    keep = pos[None, None, None, :] < lens.cpu()[:, None, None, None]
    if causal:
        qi = torch.arange(sq)[None, None, :, None]
        keep = keep & (pos[None, None, None, :] <= lens.cpu()[:, None, None, None] - sq + qi)
    s = s.masked_fill(~keep, -math.inf)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0).to(q.dtype).float()
    out_lp = torch.einsum("bhqk,bkhd->bqhd", p, vw.repeat_interleave(g, 2)).to(q.dtype).float()
    return out, lse, out_lp


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_kv16_decode_matches_reference(dtype, d, case):
    batch, seqlens, hq, hk, sq = case
    seed = zlib.crc32(repr((str(dtype), d, seqlens, sq)).encode()) % 10000  # stable across runs
    k, v = _kv(batch, max(seqlens) + 5, hk, d, dtype, seed, seqlens)
    q = torch.randn(batch, sq, hq, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed + 1)).to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    causal = sq > 1
    poison_allocator()
    out, lse = ops.decode_kv16(q, k, v, lens, None, None, d**-0.5, causal, 0)
    ref, ref_lse, ref_lp = _references(q, k, v, lens, causal)
    out = out.float().cpu()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err, err_lp = (out - ref).abs().max().item(), (ref_lp - ref).abs().max().item()
    assert err <= 2 * err_lp + 1e-3, (err, err_lp)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_kv16_paged_equals_contiguous(num_splits, page_size):
    seqlens = [1, 600, 4097]
    batch, hk, d = 3, 4, 128
    per_seq = math.ceil(4100 / page_size)
    k, v = _kv(batch, per_seq * page_size, hk, d, torch.float16, num_splits + page_size, seqlens)
    perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(page_size))
    block_table = perm.reshape(batch, per_seq).to(torch.int32).to(DEV)
    k_pages = torch.empty(batch * per_seq, page_size, hk, d, device=DEV, dtype=k.dtype)
    v_pages = torch.empty_like(k_pages)
    k_pages[block_table.long().flatten()] = k.reshape(batch * per_seq, page_size, hk, d)
    v_pages[block_table.long().flatten()] = v.reshape(batch * per_seq, page_size, hk, d)
    q = torch.randn(batch, 1, 16, d, device=DEV, dtype=torch.float16)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEV)
    poison_allocator()
    out_c, lse_c = ops.decode_kv16(q, k, v, lens, None, None, d**-0.5, False, num_splits)
    out_p, lse_p = ops.decode_kv16(q, k_pages, v_pages, lens, None, block_table, d**-0.5, False, num_splits)
    if num_splits:  # same splits, same tiles: the same arithmetic
        assert torch.equal(out_c, out_p) and torch.equal(lse_c, lse_p)
    ref, _, ref_lp = _references(q, k, v, lens, False)
    err, err_lp = (out_p.float().cpu() - ref).abs().max().item(), (ref_lp - ref).abs().max().item()
    assert err <= 2 * err_lp + 1e-3, (err, err_lp)


def test_kv16_through_flash_attn_with_kvcache(monkeypatch):
    """Without upstream flash_attn, decode-shaped calls on CUDA take our kernel, with upstream's
    semantics for cache_seqlens (int, tensor, None = whole cache) and cache_batch_idx."""
    monkeypatch.setattr(interface, "_upstream", lambda: None)
    k, v = _kv(4, 300, 2, 64, torch.bfloat16, 5)
    q = torch.randn(2, 1, 6, 64, device=DEV, dtype=torch.bfloat16)
    bidx = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    for seqlens in (None, 123, torch.tensor([7, 290], dtype=torch.int32, device=DEV)):
        out, lse = fa.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqlens, cache_batch_idx=bidx, return_softmax_lse=True
        )
        assert fa.last_path() == "baseline:fused-kv16-cuda"
        ref_out, ref_lse = baseline.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqlens, cache_batch_idx=bidx, return_softmax_lse=True
        )
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=0)
    # an index past the cache's rows (not checked on the GPU: that would sync) gives a NaN row, the
    # other rows as before
    out, lse = fa.flash_attn_with_kvcache(
        q,
        k,
        v,
        cache_seqlens=123,
        cache_batch_idx=torch.tensor([3, 4], dtype=torch.int32, device=DEV),
        return_softmax_lse=True,
    )
    good, good_lse = fa.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=123, cache_batch_idx=bidx, return_softmax_lse=True
    )
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[0], good[0]) and torch.equal(lse[0], good_lse[0])
    # what the kernel cannot do goes to the PyTorch baseline
    fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=10, cache_batch_idx=bidx, softcap=20.0)
    assert fa.last_path() == "baseline:torch"
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=301, cache_batch_idx=bidx)


def test_kv16_lengths_past_the_cache_are_clamped():
    k, v = _kv(2, 96, 2, 128, torch.float16, 8)
    q = torch.randn(2, 1, 4, 128, device=DEV, dtype=torch.float16)
    over = torch.tensor([96, 5000], dtype=torch.int32, device=DEV)
    full = torch.tensor([96, 96], dtype=torch.int32, device=DEV)
    out_over, _ = ops.decode_kv16(q, k, v, over, None, None, 0.1, False, 1)
    out_full, _ = ops.decode_kv16(q, k, v, full, None, None, 0.1, False, 1)
    assert torch.equal(out_over, out_full)


def test_kv16_errors_name_the_argument():
    k, v = _kv(1, 64, 2, 128, torch.float16, 1)
    q = torch.randn(1, 1, 4, 128, device=DEV, dtype=torch.float16)
    lens = torch.tensor([64], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="k_cache/v_cache must have q's dtype"):
        ops.decode_kv16(q, k.bfloat16(), v.bfloat16(), lens, None, None, 0.1, False, 0)
    q64 = q[..., :64].contiguous()
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.decode_kv16(q64, k[..., 1:65], v[..., 1:65], lens, None, None, 0.1, False, 0)
    fa.flash_attn_with_kvcache(q64, k[..., 1:65], v[..., 1:65], cache_seqlens=lens)  # not our kernel's: the baseline
    assert fa.last_path() != "baseline:fused-kv16-cuda"
    with pytest.raises(RuntimeError, match="seqlens_k"):
        ops.decode_kv16(q, k, v, lens.long(), None, None, 0.1, False, 0)


def test_kv16_traces_under_torch_compile_and_captures_in_a_graph():
    k, v = _kv(2, 512, 2, 64, torch.float16, 3)
    q = torch.randn(2, 1, 8, 64, device=DEV, dtype=torch.float16)
    lens = torch.tensor([300, 511], dtype=torch.int32, device=DEV)

    def f(qq):
        return ops.decode_kv16(qq, k, v, lens, None, None, 0.125, False, 2)[0]

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q), f(q))
    out_static = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out_static.copy_(f(q))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static.copy_(f(q))
    q.normal_()
    lens += 1
    graph.replay()
    torch.testing.assert_close(out_static, f(q), atol=0, rtol=0)
