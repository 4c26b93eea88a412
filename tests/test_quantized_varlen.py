"""flash_attn_varlen_func(..., kv_cache=QuantizedKVCache): a mixed batch (some sequences decode a
token, others prefill a chunk, some only query) in one call equals one flash_attn_with_kvcache call
per sequence on an identical cache (the reference path on CPU; the fused kernel on a GPU)."""

from __future__ import annotations

import pytest
import torch

import flash_attn_tq as fa
from flash_attn_tq import QuantizedKVCache


def _clone(cache: QuantizedKVCache) -> QuantizedKVCache:
    return QuantizedKVCache.from_state_dict(
        {k: (v.clone() if torch.is_tensor(v) else v) for k, v in cache.state_dict().items()}, device=cache.device
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("window", [(-1, -1), (20, 0)])
def test_mixed_batch_equals_per_sequence_calls(causal, page_size, window):
    torch.manual_seed(7)
    hk, hq, d = 2, 6, 64
    prefix = [30, 0, 55, 12, 9]  # tokens already in each sequence
    new_kv = [1, 37, 0, 5, 1]  # decode 1 / prefill a 37-token chunk / query only / a 5-token chunk / decode
    n_q = [1, 37, 3, 5, 1]  # (the two decoding sequences share one append)
    cache = QuantizedKVCache(5, 128, hk, d, page_size=page_size)
    for b, n in enumerate(prefix):
        if n:
            cache.append(torch.randn(1, n, hk, d), torch.randn(1, n, hk, d), batch_idx=torch.tensor([b]))
    ref_cache = _clone(cache)
    q = torch.randn(sum(n_q), hq, d)
    k = torch.randn(sum(new_kv), hk, d)
    v = torch.randn(sum(new_kv), hk, d)
    cu_q = torch.tensor([0] + list(torch.tensor(n_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(new_kv).cumsum(0)), dtype=torch.int32)
    out, lse = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(n_q), None, causal=causal, window_size=window, kv_cache=cache
    )
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    assert cache.seqlens.tolist() == [p + n for p, n in zip(prefix, new_kv)]
    for b in range(len(prefix)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        kb = k[ks].unsqueeze(0) if new_kv[b] else None
        vb = v[ks].unsqueeze(0) if new_kv[b] else None
        o_ref, lse_ref = fa.flash_attn_with_kvcache(
            q[qs].unsqueeze(0),
            ref_cache,
            k=kb,
            v=vb,
            cache_batch_idx=torch.tensor([b], dtype=torch.int32),
            causal=causal,
            window_size=window,
            return_softmax_lse=True,
        )
        torch.testing.assert_close(out[qs], o_ref[0], atol=1e-5, rtol=1e-5)
        finite = torch.isfinite(lse_ref[0])
        torch.testing.assert_close(lse[:, qs][finite], lse_ref[0][finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.seqlens, ref_cache.seqlens)
    for name in ("k_codes", "v_codes", "k_meta", "v_meta"):  # the cache holds the same codes either way
        assert torch.equal(getattr(cache, name), getattr(ref_cache, name))


def test_varlen_without_new_kv_and_errors():
    cache = QuantizedKVCache(2, 64, 1, 64)
    cache.append(torch.randn(2, 10, 1, 64), torch.randn(2, 10, 1, 64))
    q = torch.randn(5, 2, 64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, None, None, cu, None, 3, None, causal=True, kv_cache=cache)
    assert out[0].shape == q.shape and torch.isfinite(out[0]).all()
    assert cache.seqlens.tolist() == [10, 10]
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa.flash_attn_varlen_func(q, None, None, cu.long(), None, 3, None, kv_cache=cache)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa.flash_attn_varlen_func(q, None, None, cu, None, 2, None, kv_cache=cache)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        fa.flash_attn_varlen_func(q, torch.randn(3, 1, 64), torch.randn(3, 1, 64), cu, None, 3, None, kv_cache=cache)
    with pytest.raises(ValueError, match="dropout_p"):
        fa.flash_attn_varlen_func(q, None, None, cu, None, 3, None, dropout_p=0.1, kv_cache=cache)


def test_mixed_batch_with_per_sequence_alibi_slopes():
    """Per-sequence ALiBi slopes ``[batch, heads]`` follow each sequence into its launch (the decoding
    sequences and the chunks attend in separate launches)."""
    torch.manual_seed(3)
    hk, hq, d = 1, 2, 64
    cache = QuantizedKVCache(3, 64, hk, d)
    cache.append(torch.randn(3, 20, hk, d), torch.randn(3, 20, hk, d))
    ref_cache = _clone(cache)
    n_q = [4, 1, 2]
    q = torch.randn(sum(n_q), hq, d)
    cu_q = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    slopes = torch.rand(3, hq) * 0.5
    out, _ = fa.flash_attn_varlen_func(
        q, None, None, cu_q, None, 4, None, causal=True, alibi_slopes=slopes, kv_cache=cache
    )
    for b in range(3):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        o_ref = fa.flash_attn_with_kvcache(
            q[qs].unsqueeze(0),
            ref_cache,
            cache_batch_idx=torch.tensor([b], dtype=torch.int32),
            causal=True,
            alibi_slopes=slopes[b : b + 1],
        )
        torch.testing.assert_close(out[qs], o_ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [None, 8])
def test_mixed_batch_with_equal_chunks(page_size):
    """Chunks of one length (each a whole row of its launch, no padding) beside decode tokens equal one
    call a sequence, outputs and lse."""
    torch.manual_seed(5)
    hk, hq, d = 2, 4, 64
    prefix, new = [17, 40, 3, 25], [6, 1, 6, 1]
    cache = QuantizedKVCache(4, 64, hk, d, page_size=page_size)
    for b, n in enumerate(prefix):
        cache.append(torch.randn(1, n, hk, d), torch.randn(1, n, hk, d), batch_idx=torch.tensor([b]))
    ref_cache = _clone(cache)
    q, k, v = torch.randn(sum(new), hq, d), torch.randn(sum(new), hk, d), torch.randn(sum(new), hk, d)
    cu = torch.tensor([0, 6, 7, 13, 14], dtype=torch.int32)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu, cu, 6, None, causal=True, kv_cache=cache)
    for b in range(4):
        s = slice(int(cu[b]), int(cu[b + 1]))
        o_ref, lse_ref = fa.flash_attn_with_kvcache(
            q[s][None], ref_cache, k=k[s][None], v=v[s][None], cache_batch_idx=torch.tensor([b], dtype=torch.int32),
            causal=True, return_softmax_lse=True,
        )  # fmt: skip
        torch.testing.assert_close(out[s], o_ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, s], lse_ref[0], atol=1e-5, rtol=1e-5)


def test_planned_step_equals_unplanned_over_layers():
    """A plan made once (plan_varlen) and passed to every layer's call gives each layer what an
    unplanned call gives: outputs, lse, codes and lengths."""
    torch.manual_seed(11)
    hk, hq, d = 2, 4, 64
    prefix, new_kv, n_q = [20, 0, 33, 7], [1, 9, 0, 9], [1, 9, 2, 9]
    layers = []
    for _ in range(2):
        cache = QuantizedKVCache(4, 96, hk, d, page_size=16)
        for b, n in enumerate(prefix):
            if n:
                cache.append(torch.randn(1, n, hk, d), torch.randn(1, n, hk, d), batch_idx=torch.tensor([b]))
        layers.append((cache, _clone(cache)))
    cu_q = torch.tensor([0] + list(torch.tensor(n_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(new_kv).cumsum(0)), dtype=torch.int32)
    plan = fa.plan_varlen(cu_q, cu_k, max(n_q), "cpu")
    assert plan.batch == 4 and plan.total_q == sum(n_q) and plan.total_k == sum(new_kv)
    assert sorted(a.n for a in plan.appends) == [1, 9] and len(plan.launches) == 2
    for cache, ref_cache in layers:
        q, k, v = torch.randn(sum(n_q), hq, d), torch.randn(sum(new_kv), hk, d), torch.randn(sum(new_kv), hk, d)
        out, lse = fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(n_q), None, causal=True, kv_cache=cache, plan=plan
        )
        ref, ref_lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(n_q), None, causal=True, kv_cache=ref_cache)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
        assert torch.equal(cache.seqlens, ref_cache.seqlens)
        for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
            assert torch.equal(getattr(cache, name), getattr(ref_cache, name))
    plan.check()  # (nothing flagged)


def test_plan_errors():
    cache = QuantizedKVCache(2, 64, 1, 64)
    cache.append(torch.randn(2, 10, 1, 64), torch.randn(2, 10, 1, 64))
    q = torch.randn(5, 2, 64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    plan = fa.plan_varlen(cu, None, 3, "cpu")
    with pytest.raises(ValueError, match="kv_cache"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, plan=plan)
    with pytest.raises(TypeError, match="plan"):
        fa.flash_attn_varlen_func(q, None, None, cu, None, 3, None, kv_cache=cache, plan=object())
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # the plan's tokens against q's
        fa.flash_attn_varlen_func(q[:4], None, None, cu, None, 3, None, kv_cache=cache, plan=plan)
    k = torch.randn(5, 1, 64)
    with pytest.raises(ValueError, match="cu_seqlens_k"):  # new K/V, a plan made without them
        fa.flash_attn_varlen_func(q, k, k, cu, cu, 3, None, kv_cache=cache, plan=plan)
    with_kv = fa.plan_varlen(cu, cu, 3, "cpu")
    with pytest.raises(ValueError, match="k, v"):  # a plan with new K/V, none given
        fa.flash_attn_varlen_func(q, None, None, cu, cu, 3, None, kv_cache=cache, plan=with_kv)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa.plan_varlen(cu, None, 2, "cpu")
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        fa.plan_varlen(cu, cu[:2], 3, "cpu")
    assert cache.seqlens.tolist() == [10, 10]  # no call above wrote anything
