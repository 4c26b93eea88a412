"""A serving engine's step on the fused kernels: ``flash_attn_varlen_func(kv_cache=)`` over a paged
cache with a shuffled block table, a quarter of the sequences appending a prefill chunk and the rest
decoding a token, against float32 attention over the codes the step wrote (the reference path on a
CPU copy of the cache after the step)."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_cases import NEEDS_GPU, poison_allocator

import flash_attn_tq as fa
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.testing import DEFAULT_OPTS, rope_freqs, serving_step

pytestmark = NEEDS_GPU


# (16-token pages with keys centered before RoPE take the reference path: dispatch.plan's rule)
@pytest.mark.parametrize(
    "config, page_size", [("plain", 16), ("plain", 64), ("plain", 256), ("default", 32), ("default", 256)]
)
def test_serving_step_matches_float32(config, page_size):
    rng = random.Random(page_size)
    lengths = [rng.randint(100, 3000) for _ in range(12)]
    new = [61 if b % 4 == 1 else 1 for b in range(12)]
    opts = dict(DEFAULT_OPTS, rope_inv_freq=rope_freqs(128)) if config == "default" else {}
    step = serving_step(lengths, new, page_size, Hq=8, Hk=2, d=128, seed=page_size, fill_chunk=512, **opts)
    cu = step.cu_seqlens
    poison_allocator()
    out, lse = fa.flash_attn_varlen_func(
        step.q, step.k, step.v, cu, cu, max(new), None, causal=True, kv_cache=step.cache
    )
    assert fa.last_path() == "quantized:fused-cuda"
    assert step.cache.seqlens.tolist() == [a + b for a, b in zip(lengths, new)]
    cpu = QuantizedKVCache.from_state_dict(
        {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in step.cache.state_dict().items()}, device="cpu"
    )
    ref, ref_lse = fa.flash_attn_varlen_func(
        step.q.cpu().float(), None, None, cu.cpu(), None, max(new), None, causal=True, kv_cache=cpu
    )
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.float().cpu(), ref, atol=4e-3, rtol=0)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-3, rtol=0)


@pytest.mark.parametrize("config", ["plain", "default"])
def test_planned_step_reads_nothing_back(config):
    """With a plan (plan_varlen, made once a step) the step's call makes no device sync (CUDA's sync
    debug mode raises on one), and gives what the unplanned call gives on an identical cache; the pack
    kernel's errors wait in the plan for plan.check()."""
    rng = random.Random(5)
    lengths = [rng.randint(100, 2000) for _ in range(8)]
    new = [37 if b % 4 == 1 else 1 for b in range(8)]
    opts = dict(DEFAULT_OPTS, rope_inv_freq=rope_freqs(128)) if config == "default" else {}
    steps = [
        serving_step(lengths, new, 64, Hq=8, Hk=2, d=128, seed=9, fill_chunk=512, **opts) for _ in range(2)
    ]  # (the same tokens and pages twice)
    cu = steps[0].cu_seqlens
    plan = fa.plan_varlen(cu.cpu(), cu.cpu(), max(new), "cuda")
    planned, plain = steps
    call = lambda s, **kw: fa.flash_attn_varlen_func(  # noqa: E731
        s.q, s.k, s.v, cu, cu, max(new), None, causal=True, kv_cache=s.cache, **kw
    )
    call(planned, plan=plan)  # (first call: lazy initialisation outside the sync check)
    call(plain)
    torch.cuda.synchronize()
    for s in steps:  # a second step over both caches: the same new tokens again, now planned under the check
        s.cache.crop(torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = call(planned, plan=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref, ref_lse = call(plain)
    assert fa.last_path() == "quantized:fused-cuda"
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    assert torch.equal(planned.cache.seqlens, plain.cache.seqlens)
    assert planned.cache.seqlens.tolist() == [a + b for a, b in zip(lengths, new)]
    plan.check()
    # a non-finite value: skipped by the pack kernel, raised by plan.check() (or by the plan's next call)
    planned.cache.crop(torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    bad_k = planned.k.clone()
    bad_k[0, 0, 0] = float("nan")
    fa.flash_attn_varlen_func(planned.q, bad_k, planned.v, cu, cu, max(new), None, causal=True,
                              kv_cache=planned.cache, plan=plan)  # fmt: skip
    with pytest.raises(ValueError, match="NaN|non-finite|Inf"):
        plan.check()
    plan.check()  # (cleared)
