"""The reference math over a quantized cache, in PyTorch: what the cache holds as float32
(:func:`dequantize`) and attention over it (:func:`attention`), the PyTorch pass over a ring of window
codes the launch does not take (:func:`window_attention`) and the merge of two partial attentions.
The fused kernels are tested against these; calls the kernels do not take run them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import format as fmt
from .baseline import attention_reference
from .storage import PER_TOKEN, slots

if TYPE_CHECKING:  # (annotations only: the cache imports this module)
    from .cache import QuantizedKVCache


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint keys (lse +inf or -inf marks an empty part; rows
    empty in both get lse +inf and output 0). Few ops: decode runs this once a layer and step."""
    la = lse_a.masked_fill(lse_a == math.inf, -math.inf)
    lb = lse_b.masked_fill(lse_b == math.inf, -math.inf)
    lse = torch.logaddexp(la, lb)
    empty = lse == -math.inf
    safe = lse.masked_fill(empty, 0.0)
    wa = torch.exp(la - safe).transpose(1, 2).unsqueeze(-1)  # [b, sq, h, 1]
    wb = torch.exp(lb - safe).transpose(1, 2).unsqueeze(-1)
    out = torch.addcmul(out_a.float() * wa, out_b.float(), wb)
    return out, lse.masked_fill(empty, math.inf)


def dense_attention(q, k, v, scale, visible):
    """float32 attention of q ``[B, Sq, Hq, D]`` over a short 16-bit key set k, v ``[B, S, Hkv, D]``;
    ``visible`` bool, broadcastable to ``[B, Sq, S]``. GQA through a view (no repeated K/V). Returns
    out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]`` (-inf: no key)."""
    B, Sq, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qh = q.reshape(B, Sq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Sq, D).float()
    s = torch.matmul(qh, k.float().permute(0, 2, 3, 1)).mul_(scale).view(B, Hkv, G, Sq, S)
    s.masked_fill_(~visible.view(-1, 1, 1, *visible.shape[-2:]), -math.inf)
    lse = torch.logsumexp(s, -1)  # [B, Hkv, G, Sq]
    p = s.sub_(lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1)).exp_().view(B, Hkv, G * Sq, S)
    out = torch.matmul(p, v.float().transpose(1, 2)).view(B, Hkv, G, Sq, D).permute(0, 3, 1, 2, 4)
    return out.reshape(B, Sq, Hq, D), lse.view(B, Hq, Sq)


def window_attention(q, cache: "QuantizedKVCache", bidx, lens, softmax_scale, causal):
    """Attention of q over the ring of window codes (positions [lens - R, lens), dequantized here) of
    cache rows bidx (None: 0..batch-1). causal: the queries are the last seqlen_q positions,
    bottom-right aligned with the window's newest key. Returns (out, lse) with lse -inf for rows
    without keys."""
    R, Sq = cache.fp16_window, q.shape[1]
    rows = slice(0, q.shape[0]) if bidx is None else cache.row_index(bidx)  # (a slice: no copy of the whole window)
    kw, vw = window_kv(cache, rows)  # ring order: attention does not care, the mask does
    n = lens.long().unsqueeze(1)
    age = (n - 1 - torch.arange(R, device=q.device)) % R  # [B, R]: 0 = the newest token's slot
    if cache.rope_center:  # keys back from k - R(p) c (slots without a token get garbage: masked below)
        ridx = torch.arange(q.shape[0], device=q.device) if bidx is None else rows
        kw = cache.keys.untransform(kw, ridx, n - 1 - age)
    # slots holding a token past the sinks (those are attended from the side)
    visible = ((age < n) & (n - 1 - age >= cache.sink_tokens)).unsqueeze(1)  # [B, 1, R]
    if causal and Sq > 1:  # query i (of Sq, bottom-right aligned) sees tokens at least Sq - 1 - i old
        visible = visible & (age.unsqueeze(1) >= (Sq - 1 - torch.arange(Sq, device=q.device)).view(1, Sq, 1))
    return dense_attention(q, kw, vw, softmax_scale, visible)


def gather(cache: "QuantizedKVCache", rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Codes and meta of cache ``rows`` as contiguous ``[rows, max_seqlen, kv_heads, *]`` (copies)."""
    if not cache.paged:
        return {n: getattr(cache, n)[rows] for n in PER_TOKEN}
    pos = torch.arange(cache.max_seqlen, device=cache.device)
    r, c = slots(
        cache.block_table, cache.page_size, rows.unsqueeze(1).expand(-1, cache.max_seqlen), pos.expand(len(rows), -1)
    )
    return {n: getattr(cache, n)[r, c] for n in PER_TOKEN}


def window_kv(cache: "QuantizedKVCache", rows, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(k, v)`` ``[rows, fp16_window, kv_heads, d]`` of the recent window of cache ``rows``
    (ring order: token ``p`` in slot ``p % fp16_window``), as stored (see
    :attr:`QuantizedKVCache.k_side`); ``rotated=True``: turbo's rotated domain. A ring of window codes
    is dequantized here (its keys in the codes' domain)."""
    out = []
    for win, meta, qz in (
        (cache.k_window, cache.k_window_meta, cache.k_quantizer),
        (cache.v_window, cache.v_window_meta, cache.v_quantizer),
    ):
        if cache.window_quantizer is None:
            x = win[rows].float()
            out.append(qz.rotate(x) if rotated and cache.quantizer == "turbo" else x)
        else:
            wq = cache.window_quantizer
            x = wq.dequantize_rotated(fmt.unpack_codes(win[rows], cache.window_bits, cache.head_dim), meta[rows])
            if not rotated and cache.quantizer == "turbo":  # rotate(x) = x @ M, M orthonormal: one GEMM back
                x = x @ wq.rotation_matrix(x.device).T
            out.append(x)
    return out[0], out[1]


def side_values(cache: "QuantizedKVCache", rows: torch.Tensor, rotated: bool, window: int | None = None):
    """The 16-bit side at every position of ``rows``: (bool ``[b, max_seqlen]`` where a position is
    attended from it: the sinks and the last ``window`` tokens (default: the 16-bit window), its keys
    and values ``[b, max_seqlen, kv_heads, d]`` float32 in :func:`dequantize`'s domain)."""
    S, R, L = cache.sink_tokens, cache.side_recent, cache.max_seqlen
    window = (cache.fp16_window if R else 0) if window is None else window
    pos = torch.arange(L, device=cache.device).unsqueeze(0)
    lens = cache.seqlens[rows].long().unsqueeze(1)
    used = (pos < lens) & ((pos < S) | ((pos >= lens - window) if window else torch.zeros_like(pos, dtype=torch.bool)))
    src = torch.where(pos < S, pos, S + pos % R if R else torch.zeros_like(pos)).expand(len(rows), -1)
    idx = src[:, :, None, None].expand(-1, -1, cache.num_kv_heads, cache.head_dim)
    k, v = (cache.kv_side[i][rows].float().gather(1, idx) for i in (0, 1))
    positions = pos.expand(len(rows), -1)
    if rotated:  # the codes' domain: centered keys, turbo's rotation
        if cache.rope_center:
            k = cache.keys.transform(k, rows, positions)
        if cache.quantizer == "turbo":
            k, v = cache.k_quantizer.rotate(k), cache.v_quantizer.rotate(v)
    elif cache.key_center and not cache.rope_center:
        k = cache.keys.untransform(k, rows, positions)
    return used, k, v


def dequantize(
    cache: "QuantizedKVCache", rows: torch.Tensor, rotated: bool, use_window: bool, window: int | None = None
):
    """float32 ``(k, v)`` ``[rows, max_seqlen, kv_heads, d]`` as attention sees them (see
    :meth:`QuantizedKVCache.dequantize`); ``window``: the recent tokens read from the 16-bit side
    (default: the 16-bit window, as a one-token decode sees them; :func:`window_blocks`)."""
    g = gather(cache, rows)
    out = []
    coded_window = use_window and cache.fp16_window and cache.window_quantizer is not None
    windows = window_kv(cache, rows, rotated=True) if coded_window else (None, None)
    side = side_values(cache, rows, rotated, window) if use_window and cache.kv_side is not None else None
    lens = cache.seqlens[rows].long().unsqueeze(1)
    pos = torch.arange(cache.max_seqlen, device=cache.device).unsqueeze(0)
    for name, qz, bits, w in (
        ("k", cache.k_quantizer, cache.k_bits, windows[0]),
        ("v", cache.v_quantizer, cache.v_bits, windows[1]),
    ):
        x = qz.dequantize_rotated(fmt.unpack_codes(g[f"{name}_codes"], bits, cache.head_dim), g[f"{name}_meta"])
        if w is not None:
            R = cache.fp16_window
            idx = (pos % R).expand(len(rows), -1)[:, :, None, None].expand_as(x)
            in_win = (pos >= lens - R) & (pos < lens)
            x = torch.where(in_win[:, :, None, None], w.gather(1, idx), x)
        if not rotated and cache.quantizer == "turbo":
            x = qz.unrotate(x)
        if name == "k" and cache.key_center and not rotated:
            x = cache.keys.untransform(x, rows, pos.expand(len(rows), -1))
        if side is not None:
            x = torch.where(side[0][:, :, None, None], side[1 if name == "k" else 2], x)
        out.append(x * (pos < lens)[:, :, None, None])
    return out[0], out[1]


def window_blocks(cache: "QuantizedKVCache", seqlen_q: int, causal: bool) -> list[tuple[int, int, int | None]]:
    """The query rows ``[i0, i1)`` of a call that read the same recent tokens from the 16-bit side, and
    how many (None: the 16-bit window). A causal row's keys end ``seqlen_q - 1 - i`` before the
    sequence's; a one-token decode at its length sees its last ``fp16_window`` keys in 16 bits, and
    so does the row where the side still holds them (``side_recent``: ``verify_tokens - 1`` more
    than the window), else the side's oldest on (the kernels' ``window_start``)."""
    R, ring = cache.fp16_window, cache.side_recent
    if not causal or seqlen_q == 1 or ring <= R:
        return [(0, seqlen_q, None)]
    first = max(0, seqlen_q - 1 + R - ring)  # rows before it: the whole side
    blocks = [(0, first, ring)] if first else []
    return blocks + [(i, i + 1, R + seqlen_q - 1 - i) for i in range(first, seqlen_q)]


def attention(
    q, cache: "QuantizedKVCache", bidx, lens, softmax_scale, causal, window_size, softcap, alibi_slopes, leftpad
):
    """The reference path: float32 attention of ``q`` over :func:`dequantize` of cache rows ``bidx``
    (None: 0..batch-1) holding ``lens`` tokens, each block of query rows over the recent tokens it sees
    in 16 bits (:func:`window_blocks`). Rows of ``bidx`` outside the cache give NaN output rows and
    lse, as the kernels write them. Returns (out in q's dtype, lse)."""
    rows = cache.row_index(bidx) if bidx is not None else torch.arange(q.shape[0], device=q.device)
    parts = []
    Sq = q.shape[1]
    blocks = window_blocks(cache, Sq, causal)
    if len(blocks) > 1:  # the codes' view and the side's once, a block's window from them
        codes = dequantize(cache, rows, rotated=False, use_window=True, window=0)
        _, *side = side_values(cache, rows, rotated=False, window=cache.side_recent)
        pos = torch.arange(cache.max_seqlen, device=cache.device).unsqueeze(0)
        n = cache.seqlens[rows].long().unsqueeze(1)
    for i0, i1, window in blocks:
        if len(blocks) == 1:
            k_deq, v_deq = dequantize(cache, rows, rotated=False, use_window=True, window=window)
        else:
            recent = ((pos >= n - window) & (pos >= cache.sink_tokens) & (pos < n))[:, :, None, None]
            k_deq, v_deq = (torch.where(recent, x, c) for x, c in zip(side, codes))
        parts.append(
            attention_reference(  # rows [i0, i1) of Sq: their keys end Sq - i1 before the sequence's
                q[:, i0:i1],
                k_deq,
                v_deq,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                softcap=softcap,
                alibi_slopes=alibi_slopes,
                key_lengths=lens if i1 == Sq else lens - (Sq - i1),
                key_start=leftpad,
            )
        )
    out = torch.cat([o for o, _ in parts], 1) if len(parts) > 1 else parts[0][0]
    lse = torch.cat([l for _, l in parts], 2) if len(parts) > 1 else parts[0][1]
    out = out.to(q.dtype)
    if bidx is not None:
        outside = (bidx < 0) | (bidx >= cache.batch_size)
        out = out.masked_fill(outside.view(-1, 1, 1, 1), math.nan)
        lse = lse.masked_fill(outside.view(-1, 1, 1), math.nan)
    return out, lse
