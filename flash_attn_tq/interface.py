"""The flash_attn 2.8.3 API, dispatching to the fused quantized path or a baseline.

* A :class:`~flash_attn_tq.cache.QuantizedKVCache` passed to :func:`flash_attn_with_kvcache`
  (as ``k_cache``, or as ``kv_cache=``) takes the quantized path: new ``k``/``v`` are quantized
  into the cache, then the fused CUDA kernel attends over the packed codes when it supports the
  call, else the reference (dequantize, then float32 attention).
* Anything else takes the baseline: upstream ``flash_attn`` when it is importable and the
  tensors are CUDA float16/bfloat16; else, for decode-shaped ``flash_attn_with_kvcache`` calls
  on CUDA (no new k/v, rotary, window, softcap, alibi or leftpad), our decode kernel over the
  16-bit cache; else :mod:`flash_attn_tq.baseline` (PyTorch, same semantics).

:func:`last_path` tells which path the last call in this context took.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import math
from typing import Optional, Union

import torch

from . import baseline, cpu, dispatch, ops, reference, varlen, writes
from . import validation as check
from .cache import QuantizedKVCache
from .varlen import VarlenPlan
from .writes import as_seqlens

_LAST_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("flash_attn_tq_last_path", default="none")


def last_path() -> str:
    """The path the last attention call in this context took, e.g. ``"quantized:fused-cuda"``,
    ``"quantized:reference (head_dim 96 ...)"``, ``"baseline:upstream"``, ``"baseline:fused-kv16-cuda"``,
    ``"baseline:torch"``."""
    return _LAST_PATH.get()


def _took(path: str) -> None:
    """Record the path an attention call took (not from inside a ``torch.compile`` trace: a context
    variable would break the graph there)."""
    if not torch.compiler.is_compiling():
        _LAST_PATH.set(path)


@functools.lru_cache(maxsize=None)
def _upstream():
    """Upstream flash_attn's interface module, or None when it is not installed (or when
    ``flash_attn`` is an alias of this package, whose functions would call back here)."""
    try:
        mod = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception:  # ImportError, or a broken/mismatched build
        return None
    # genuine upstream holds its compiled backend, and its functions are not this package's own
    own = getattr(getattr(mod, "flash_attn_func", None), "__module__", "") or ""
    if getattr(mod, "flash_attn_gpu", None) is None or own.split(".")[0] == __name__.split(".")[0]:
        return None
    return mod


def _on_upstream_device(*tensors: torch.Tensor) -> bool:
    """Whether upstream's kernels take these tensors: CUDA float16 / bfloat16."""
    return all(t.is_cuda and t.dtype in (torch.float16, torch.bfloat16) for t in tensors)


def _baseline_impl(name: str, *tensors: torch.Tensor):
    up = _upstream()
    if up is not None and _on_upstream_device(*tensors):
        _took("baseline:upstream")
        return getattr(up, name)
    _took("baseline:torch")
    return getattr(baseline, name)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (batch, seqlen, 3, nheads, headdim). Returns out (batch, seqlen, nheads, headdim)
    [, softmax_lse (batch, nheads, seqlen), S_dmask] as upstream."""
    return _baseline_impl("flash_attn_qkvpacked_func", qkv)(
        qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    return _baseline_impl("flash_attn_kvpacked_func", q, kv)(
        q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    return _baseline_impl("flash_attn_func", q, k, v)(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: (batch + 1,) int32."""
    return _baseline_impl("flash_attn_varlen_qkvpacked_func", qkv)(
        qkv,
        cu_seqlens,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    return _baseline_impl("flash_attn_varlen_kvpacked_func", q, kv)(
        q,
        kv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    kv_cache: Optional[QuantizedKVCache] = None,
    plan: Optional[VarlenPlan] = None,
):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim) (or paged with block_table).

    With ``kv_cache=`` (a :class:`QuantizedKVCache`) the batch is a mixed chunked-prefill / decode
    step over the quantized cache: sequence ``b`` (cache row ``b``) brings ``q[cu_seqlens_q[b]:
    cu_seqlens_q[b+1]]`` and, when ``k``/``v`` are given, new keys/values ``k[cu_seqlens_k[b]:
    cu_seqlens_k[b+1]]`` that are quantized into the cache first (``max_seqlen_k`` is not used).
    Queries attend over the whole sequence in the cache, bottom-right aligned when ``causal``.
    Returns out (total_q, nheads, headdim) [, softmax_lse (nheads, total_q) as upstream's varlen].

    ``plan=`` (:func:`~flash_attn_tq.plan_varlen` of this step's cu_seqlens, made once for all the
    layers): the call reads nothing back from the GPU (cu_seqlens are not read; the pack kernel's
    errors wait for ``plan.check()``), as a serving engine's step needs.
    """
    if plan is not None and kv_cache is None:
        raise ValueError("plan: a VarlenPlan lays out a step over a QuantizedKVCache (kv_cache=)")
    if kv_cache is not None:
        _check_cache_type(kv_cache)
        if dropout_p or block_table is not None or return_attn_probs:
            raise ValueError(
                "kv_cache: dropout_p, block_table (set it on the cache) and return_attn_probs "
                "do not apply to a QuantizedKVCache"
            )
        return _quantized_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            kv_cache,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            plan,
        )
    return _baseline_impl("flash_attn_varlen_func", q, k, v)(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
    )


def flash_attn_with_kvcache(
    q,
    k_cache=None,
    v_cache=None,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    kv_cache: Optional[QuantizedKVCache] = None,
):
    """Upstream's ``flash_attn_with_kvcache``; a :class:`QuantizedKVCache` as ``k_cache`` (with
    ``v_cache=None``) or as ``kv_cache=`` selects the quantized path.

    q: (batch, seqlen_q, nheads, headdim). k, v: (batch, seqlen_new, nheads_k, headdim), quantized
    into the cache at ``cache_seqlens`` (default: the cache's own ``seqlens``), after which the
    cache's ``seqlens`` are advanced. Returns out (batch, seqlen_q, nheads, headdim)
    [, softmax_lse (batch, nheads, seqlen_q) float32].
    """
    if kv_cache is not None or isinstance(k_cache, (QuantizedKVCache, cpu.CpuQuantizedKVCache)):
        _check_cache_type(kv_cache)
        if kv_cache is not None and k_cache is not None and k_cache is not kv_cache:
            raise ValueError("k_cache: pass None (or the same cache) when kv_cache= is given")
        cache = kv_cache if kv_cache is not None else k_cache
        if v_cache is not None and v_cache is not cache:
            raise ValueError(f"v_cache: pass None (or the same cache) when k_cache is a {type(cache).__name__}")
        if isinstance(cache, cpu.CpuQuantizedKVCache):
            check.check_query(q, cache)
            _took("quantized:cpu-int8-keys")
            attend = cpu.flash_attn_with_kvcache
        else:
            attend = _quantized_kvcache
        return attend(
            q,
            cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
            rotary_interleaved,
            alibi_slopes,
            num_splits,
            return_softmax_lse,
        )
    if k_cache is None:
        raise ValueError("k_cache is required (a tensor, or a QuantizedKVCache; or pass kv_cache=)")
    if v_cache is None:
        raise ValueError("v_cache is required unless k_cache is a QuantizedKVCache")
    if _upstream() is None and isinstance(q, torch.Tensor) and q.is_cuda and isinstance(k_cache, torch.Tensor):
        plan = _plan_kv16(
            q, k_cache, v_cache, k, rotary_cos, cache_leftpad, block_table, window_size, softcap, alibi_slopes
        )
        if plan.fused:
            return _kv16_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens,
                cache_batch_idx,
                block_table,
                softmax_scale,
                causal,
                num_splits,
                return_softmax_lse,
            )
    return _baseline_impl("flash_attn_with_kvcache", q, k_cache, v_cache)(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        softmax_scale,
        causal,
        window_size,
        softcap,
        rotary_interleaved,
        alibi_slopes,
        num_splits,
        return_softmax_lse,
    )


def _check_cache_type(kv_cache) -> None:
    if kv_cache is not None and not isinstance(kv_cache, (QuantizedKVCache, cpu.CpuQuantizedKVCache)):
        raise TypeError(f"kv_cache must be a QuantizedKVCache (or None), got {type(kv_cache).__name__}")


def _plan_kv16(q, k_cache, v_cache, k, rotary_cos, cache_leftpad, block_table, window_size, softcap, alibi_slopes):
    """dispatch.plan_kv16 for a flash_attn_with_kvcache call over 16-bit cache tensors (window_size and
    softcap checked first, in every form upstream accepts)."""
    window_size = check.check_options(0.0, window_size, softcap)
    if not (
        isinstance(v_cache, torch.Tensor) and q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    ):
        return dispatch.Plan(None, "shapes")
    if q.shape[-1] != k_cache.shape[-1] or v_cache.dtype != k_cache.dtype:
        return dispatch.Plan(None, "shapes or dtypes")
    aligned = all(
        t.stride(-1) == 1 and not any(st % 8 for st in t.stride()[:3]) and t.data_ptr() % 16 == 0
        for t in (k_cache, v_cache)
    )
    local = window_size[0] >= 0 or window_size[1] >= 0
    flags = dict(local=local, softcap=softcap != 0.0, leftpad=cache_leftpad is not None, alibi=alibi_slopes is not None)
    query = dispatch.Query.of(q, **flags)
    page = k_cache.shape[1] if block_table is not None else None
    appends = k is not None or rotary_cos is not None
    return dispatch.plan_kv16(
        query, k_cache.shape[2], k_cache.dtype, page, aligned, appends, dispatch.Device.of(q.device)
    )


def _kv16_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    cache_batch_idx,
    block_table,
    softmax_scale,
    causal,
    num_splits,
    return_softmax_lse,
):
    """Upstream flash_attn_with_kvcache (no new k/v) on our decode kernel over a 16-bit cache."""
    batch = q.shape[0]
    check.check_batch_args(cache_seqlens, cache_batch_idx, batch)
    if block_table is not None and (
        block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch
    ):
        raise ValueError(
            f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if cache_batch_idx is None and block_table is None and batch > k_cache.shape[0]:
        raise ValueError(f"q batch {batch} exceeds k_cache's batch {k_cache.shape[0]}")
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if cache_seqlens is None:  # upstream: the whole cache
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        if cache_seqlens > capacity:
            raise ValueError(f"cache_seqlens {cache_seqlens} exceeds the cache's capacity")
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        lens = cache_seqlens
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    _took("baseline:fused-kv16-cuda")
    out, lse = ops.decode_kv16(
        q, k_cache, v_cache, lens, cache_batch_idx, block_table, softmax_scale, causal, num_splits
    )
    return (out, lse) if return_softmax_lse else out


# ------------------------------------------------------------------------------- quantized path


def attend_with_plan(
    q: torch.Tensor,
    cache: QuantizedKVCache,
    plan: dispatch.Plan,
    softmax_scale: float,
    causal: bool = True,
    group2: tuple[QuantizedKVCache, int] | None = None,
) -> torch.Tensor:
    """The run of plan/run: causal attention of ``q [batch, seqlen_q, heads, d]`` over rows
    ``0..batch-1`` of ``cache`` as ``plan`` (:meth:`QuantizedKVCache.plan`) says, without the per-call
    argument checks of :func:`flash_attn_with_kvcache` (the caller made ``q`` and planned once, as
    ``TQCache`` does for every layer of every decode step). ``group2``: the plan's ``pair``. Returns
    the output like q."""
    _took(plan.path)
    lens = cache.seqlens[: q.shape[0]]
    if plan.fused:
        return cache.attend(q, lens, None, softmax_scale, causal, with_lse=False, group2=group2, plan=plan)[0]
    out, _ = reference.attention(q, cache, None, lens, softmax_scale, causal, (-1, -1), 0.0, None, None)
    return out


def _quantized_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    cache,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    plan: Optional[VarlenPlan] = None,
):
    """Varlen batch over a QuantizedKVCache as ``plan`` lays it out (:func:`varlen.plan_varlen`, made
    here from the cu_seqlens when not given): append each sequence's new K/V (one append for all the
    sequences with the same number of new tokens), then attend in two launches at most: the decoding
    sequences (one query each), and the others with their queries left-padded to the longest among
    them, so bottom-right causal alignment holds per sequence (the padding rows come first, attend to
    fewer keys and are dropped). With a plan given, nothing is read back from the GPU."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(
            f"q must be (total_q, nheads, headdim), got {tuple(q.shape) if isinstance(q, torch.Tensor) else q}"
        )
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    planned = plan is not None
    if planned:
        if not isinstance(plan, VarlenPlan):
            raise TypeError(f"plan must be a VarlenPlan (flash_attn_tq.plan_varlen), got {type(plan).__name__}")
        if plan.device != q.device:
            raise ValueError(f"plan: made for {plan.device}, but q is on {q.device}")
        plan.check_landed()
    else:
        if cu_seqlens_k is not None and k is None:  # (its form only: no new K/V to lay out)
            varlen.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
        plan = varlen.plan_varlen(cu_seqlens_q, cu_seqlens_k if k is not None else None, max_seqlen_q, q.device)
    batch = plan.batch
    if plan.total_q != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q={q.shape[0]}, got {plan.total_q} query tokens")
    if batch > cache.batch_size:
        raise ValueError(f"{batch} sequences exceed the cache's batch_size {cache.batch_size}")
    # q and the options are checked before the appends below change the cache
    check.check_query(q[None], cache)
    window_size = check.check_options(0.0, window_size, softcap, softmax_scale)
    check.check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    if k is not None:
        if plan.total_k is None:
            raise ValueError(f"cu_seqlens_k must be int32 (batch + 1 = {batch + 1},) with new k/v")
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a (total_k, nheads_k, headdim) tensor, got {type(x).__name__}")
        check.check_new_dtype(k, v, q.dtype)
        if k.dim() != 3 or k.shape != v.shape or plan.total_k != k.shape[0]:
            raise ValueError("k, v must be (total_k, nheads_k, headdim) with cu_seqlens_k ending at total_k")
        flags = plan.errors.buffer(cache.device) if planned else None
        for a in plan.appends:  # e.g. all decoding sequences (n = 1) in one launch (rows distinct, < batch)
            writes.append(cache, k[a.tokens], v[a.tokens], batch_idx=a.rows, error_flags=flags, rows_checked=True)
        if planned:
            plan.note_writes()
    elif planned and plan.appends:
        raise ValueError("k, v: the plan was made with new K/V (cu_seqlens_k), but k and v are None")
    out = q.new_empty(q.shape)  # (every query row belongs to one of the launches below)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for launch in plan.launches:
        n = len(launch.seqs)
        if launch.full:  # no padding: whole rows gathered and scattered
            q_pad = q.index_select(0, launch.token).view(n, launch.width, *q.shape[1:])
        else:
            q_pad = q.new_zeros(n, launch.width, q.shape[1], q.shape[2])
            q_pad[launch.seq, launch.row] = q[launch.token]
        slopes = alibi_slopes
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 2:  # [batch, heads]: these sequences'
            slopes = slopes[launch.sel]
        o, l = _quantized_kvcache(
            q_pad,
            cache,
            k=None,
            v=None,
            rotary_cos=None,
            rotary_sin=None,
            cache_seqlens=None,
            cache_batch_idx=launch.rows,
            cache_leftpad=None,
            block_table=None,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            rotary_interleaved=True,
            alibi_slopes=slopes,
            num_splits=0,
            return_softmax_lse=True,
        )
        if launch.full:
            out.index_copy_(0, launch.token, o.reshape(-1, *o.shape[2:]))
            lse.index_copy_(1, launch.token, l.transpose(0, 1).reshape(l.shape[1], -1))
        else:
            out[launch.token] = o[launch.seq, launch.row]
            lse[:, launch.token] = l[launch.seq, :, launch.row].transpose(0, 1)
    return out, lse


def _quantized_kvcache(
    q,
    cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    return_softmax_lse,
):
    check.check_query(q, cache)
    if block_table is not None and block_table is not cache.block_table:
        raise ValueError("block_table: a QuantizedKVCache carries its own block_table (set it on the cache)")
    batch, seqlen_q = q.shape[:2]
    device = q.device
    # every argument is checked before the append below changes the cache
    cache_seqlens = as_seqlens(cache_seqlens)
    check.check_batch_args(cache_seqlens, cache_batch_idx, batch)
    check.check_new_rows(k, v, batch, q.dtype)
    seqlen_new = 0 if k is None else k.shape[1]
    check.check_cache_rows(cache, cache_seqlens, cache_batch_idx, cache_leftpad, batch, seqlen_new)
    window_size = check.check_options(0.0, window_size, softcap, softmax_scale)
    check.check_alibi(alibi_slopes, batch, q.shape[2], device)
    check.check_rotary(rotary_cos, rotary_sin, k, q.shape[3], device)
    bidx = None if cache_batch_idx is None else cache_batch_idx.to(device)  # (None: rows 0..batch-1, slices)
    if cache_seqlens is None:
        # (rows 0..batch-1: a view, no kernel; an append reads the counts, then advances them in place)
        if bidx is not None:
            start = cache.seqlens[cache.row_index(bidx)]
        else:  # (the whole tensor where the call takes every row: no view made a call)
            start = cache.seqlens if batch == cache.batch_size else cache.seqlens[:batch]
    elif isinstance(cache_seqlens, int):
        start = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        start = cache_seqlens.to(device)
    local = window_size[0] >= 0 or window_size[1] >= 0
    if rotary_cos is not None and start.device.type == "cpu" and batch:  # (no device sync for the bound)
        needed = int(start.max()) + max(seqlen_new, seqlen_q if (causal or local) else 1)
        if needed > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions but position {needed - 1} is needed")
    if rotary_cos is not None:
        kpos = start.long().unsqueeze(1) + torch.arange(seqlen_new, device=device)
        k = baseline.rotary_at(k, rotary_cos, rotary_sin, kpos, rotary_interleaved).to(k.dtype)
        qpos = start.long().unsqueeze(1) + (
            torch.arange(seqlen_q, device=device)
            if (causal or local)
            else torch.zeros(seqlen_q, dtype=torch.long, device=device)
        )
        q = baseline.rotary_at(q, rotary_cos, rotary_sin, qpos, rotary_interleaved).to(q.dtype)
    own = cache_seqlens is None and cache_batch_idx is None  # start is the cache's own counts (a view)
    # the lengths attention sees: the own counts, which the append advances in place, else start + n
    lens = start if own or not seqlen_new else (start + seqlen_new).to(torch.int32)
    if cache_leftpad is not None and cache_leftpad.device.type == "cpu" and batch:  # (no device sync)
        if bool((cache_leftpad > (start + seqlen_new).to(cache_leftpad.device)).any()):
            raise ValueError("cache_leftpad must be in [0, cache_seqlens + seqlen_new]")
    # (the Query built positionally: this runs every call)
    query = dispatch.Query(
        *q.shape[1:], q.dtype, local, softcap != 0.0, cache_leftpad is not None, alibi_slopes is not None
    )
    plan = cache.plan(query)
    if k is not None:
        cache.append(k, v, cache_seqlens=cache_seqlens, batch_idx=bidx)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    _took(plan.path)
    if plan.fused:
        leftpad = None if cache_leftpad is None else cache_leftpad.to(device=device, dtype=torch.int32).contiguous()
        window = window_size if local else (-1, -1)
        out, lse = cache.attend(
            q, lens, bidx, softmax_scale, causal, num_splits, window, leftpad, softcap, return_softmax_lse, plan=plan
        )
    else:
        out, lse = reference.attention(
            q, cache, bidx, lens, softmax_scale, causal, window_size, softcap, alibi_slopes, cache_leftpad
        )
    return (out, lse) if return_softmax_lse else out
