"""A :class:`~flash_attn_tq.cache.QuantizedKVCache` as the fused kernels see it: the K/V stores the
decode op takes, and attention through :func:`flash_attn_tq.ops.decode` as a
:class:`~flash_attn_tq.dispatch.Plan` says. Both are the cache's methods (``cache.stores(...)``,
``cache.attend(...)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import dispatch, ops, reference

if TYPE_CHECKING:
    from .cache import QuantizedKVCache


def stores(
    cache: QuantizedKVCache, batch: int, batch_idx: torch.Tensor | None = None, group: int = 0
) -> list[ops.Store]:
    """The cache as the decode op takes it, for ``batch`` sequences in cache rows ``batch_idx``
    (int32 ``[batch]``; None: 0..batch-1): its codes, its RoPE center's rows and its 16-bit side."""
    s = cache.spec  # (its fields read once: this runs every call)
    codes = (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta)
    out = [ops.Store(ops.CODES, codes, group, s.k_bits, s.v_bits, s.fp16_window)]
    if s.key_center == "rope":  # (float32 rows: a slice or a gather)
        rows = None if batch_idx is None else cache.row_index(batch_idx)
        out.append(ops.Store(ops.CENTER, (cache.keys.rows_of(rows, batch),), group))
    if cache.kv_side is not None:  # (traced: split in the graph, so no two inputs alias what the pack writes)
        side = tuple(cache.kv_side.unbind(0)) if torch.compiler.is_compiling() else _side_pair(cache)
        out.append(ops.Store(ops.SIDE, side, group, a=s.sink_tokens, b=s.side_recent))
    return out


def _side_pair(cache: QuantizedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit side's K and V as two views, made once a side tensor (not a host op a call)."""
    pair = cache.__dict__.get("_side_views")
    if pair is None or pair[0]._base is not cache.kv_side:
        pair = cache.__dict__["_side_views"] = tuple(cache.kv_side.unbind(0))
    return pair


def attend(
    cache: QuantizedKVCache,
    q,
    seqlens,
    batch_idx,
    softmax_scale,
    causal,
    num_splits=0,
    window_size=(-1, -1),
    leftpad=None,
    softcap=0.0,
    with_lse=True,
    group2=None,
    plan=None,
):
    """The fused kernels' attention of ``q [batch, seqlen_q, heads, d]`` over cache rows ``batch_idx``
    holding ``seqlens [batch]`` tokens, as ``plan`` (default: the cache's :meth:`plan`) says. Returns
    (out like q, lse ``[batch, heads, seqlen_q]``; ``with_lse=False`` skips the key centering's lse
    shift).

    ``group2 = (other, head)``: ``other`` holds the layer's kv heads ``[head, head + its kv heads)``
    and this cache the others, in order; ``q`` and the output hold the layer's query heads, and one
    launch attends both (the plan's ``pair`` kernel)."""
    if plan is None:
        flags = dict(local=tuple(window_size) != (-1, -1), softcap=bool(softcap), leftpad=leftpad is not None)
        plan = cache.plan(dispatch.Query.of(q, **flags), None if group2 is None else (group2[0], 0))
    if not plan.fused:
        raise ValueError(f"the fused kernels cannot run this call: {plan.reason}")
    parts = stores(cache, q.shape[0], batch_idx, 0)
    if group2 is not None:
        other, head = group2
        if (other.batch_size, other.max_seqlen) != (cache.batch_size, cache.max_seqlen):
            raise ValueError("group2: both head groups' caches must hold the same rows and capacity")
        parts += [s._replace(b=head) if s.kind == ops.CODES else s for s in stores(other, q.shape[0], batch_idx, 1)]
    if plan.kernel == "ring":  # the recent tokens' codes in the decode launch
        window = (cache.k_window_codes, cache.k_window_meta, cache.v_window_codes, cache.v_window_meta)
        parts.append(ops.Store(ops.WINDOW, window, 0, cache.window_bits, cache.window_bits))
    out, lse = ops.decode(
        q,
        parts,
        seqlens,
        batch_idx,
        softmax_scale=softmax_scale,
        causal=causal,
        num_splits=num_splits,
        kernel=plan.kernel,
        block_table=cache.block_table,
        leftpad=leftpad,
        window_size=window_size,
        softcap=softcap,
        rot_signs=cache.k_quantizer.signs_on(q.device) if cache.spec.quantizer == "turbo" else None,
        rope_inv_freq=cache.keys.inv_freq,
        rope_offset=cache.spec.rope_position_offset,
    )
    if plan.window_pass:  # the ring of window codes' own pass
        out_w, lse_w = reference.window_attention(q, cache, batch_idx, seqlens, softmax_scale, causal)
        out, lse = reference.merge_lse(out, lse, out_w, lse_w)
    if plan.lse_shift and with_lse:
        lse = lse + softmax_scale * cache.query_shift(q, batch_idx)  # the scores lost q . mu (+inf stays +inf)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse
