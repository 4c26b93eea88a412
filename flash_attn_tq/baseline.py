"""Pure-PyTorch baseline for the flash-attn 2.8.3 public API.

The seven public functions below have the same names, signatures, defaults and
return conventions as ``flash_attn.flash_attn_interface`` in flash-attn 2.8.3.
They run on any device PyTorch supports (CPU or CUDA), compute in float32 and
return results in the dtype of ``q``.  Gradients come from autograd.

Everything funnels into :func:`attention_reference`, which works on dense,
batched tensors with an optional per-batch range of valid keys.

Conventions (matching the upstream kernels unless noted):

* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
* Masks are aligned to the bottom-right corner.  For a query row ``i`` (out of
  ``Sq``) and a sequence with ``Sk`` valid keys, the "diagonal" key is
  ``i + Sk - Sq``.  ``causal`` keeps keys ``j <= diag``; ``window_size=(l, r)``
  keeps ``diag - l <= j <= diag + r``; a negative bound means unbounded.
  ``causal=True`` is ``window_size=(l, 0)``.  (Upstream internally clamps
  windows of at least ``seqlen_k`` to "unbounded"; that only changes the result
  for rows that would have no keys at all, with ``seqlen_q > seqlen_k``.  Here
  a non-negative window is always applied as written.)
* ``softcap > 0`` replaces a score ``s`` (already multiplied by the scale) with
  ``softcap * tanh(s / softcap)``; ALiBi adds ``-slope * |diag - j|``.
  ``softmax_lse`` is the log-sum-exp of those final scores over kept keys.
  Note: under ``causal=True`` the upstream kernel adds ``+slope * j`` instead,
  which gives the same output but a row-dependent shift of ``softmax_lse``
  (by ``slope * diag``).  This module follows the documented formula.
* A query row with no allowed key gets output 0 and ``softmax_lse = +inf``
  (what the upstream kernels write), and contributes no gradient.
* ``dropout_p > 0`` drops attention probabilities at random (torch RNG, so the
  pattern is not the one the CUDA kernel would draw) and rescales the kept ones
  by ``1 / (1 - dropout_p)``.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``, ``S_dmask`` in the
  dtype of ``q``.  With ``dropout_p > 0`` it is what the upstream kernel writes and upstream's
  tests decode: shaped ``(batch, nheads, seqlen_q_rounded, seqlen_k_rounded)``, both lengths
  rounded up to a multiple of 128 (varlen: ``max_seqlen_q`` and ``max_seqlen_k`` rounded, sequence
  ``b`` in rows and columns from 0 of ``S_dmask[b]``), zero past the sequence (upstream leaves
  that padding unwritten).  Its entries are the unnormalized scores ``exp(s - m)``: the key axis
  is cut into blocks, from each sequence's first key, of
  :func:`get_block_size_n` ``(device, headdim, True, causal)`` columns (upstream's
  ``_get_block_size_n``: 128 for ``headdim <= 32``, 64 for ``<= 96``, 32 for ``<= 128`` and 64
  above, past 256 too), and ``m`` is the row's maximum over the entry's block and all later ones (the kernel
  walks the blocks from last to first and writes each against its running maximum), or 0 where
  that maximum is ``-inf``.  Dropped entries are negated, so ``S_dmask >= 0`` is the keep mask
  (masked-out entries, 0 or -0, read as kept) and ``S_dmask.abs() * exp(m - softmax_lse)`` are
  the probabilities before dropout; ``out`` is those probabilities times the keep mask, over
  ``1 - dropout_p``, times ``v``.  Upstream returns an empty tensor when ``dropout_p == 0``; this
  module returns the normalized softmax probabilities instead, shaped
  ``(batch, nheads, seqlen_q, seqlen_k)`` (varlen: ``max_seqlen_q``, ``max_seqlen_k``,
  zero-padded), unrounded.
* Accepted dtypes are float16 and bfloat16 as upstream, and also float32 (the
  baseline only).  q, k, v must share a dtype and a device.  Upstream's limits
  on head size (<= 256, multiple of 8), rotary dim (multiple of 16), paged
  block size (multiple of 256) and softcap-with-dropout are not enforced.
* ``deterministic`` and ``num_splits`` are accepted and ignored.
* Varlen: rows of ``q`` outside ``cu_seqlens_q[0]:cu_seqlens_q[-1]`` get output
  0 and ``softmax_lse = +inf``.
* ``flash_attn_with_kvcache`` writes the new ``k``/``v`` into the cache in place
  (after rotary), then attends over cache positions
  ``[cache_leftpad, cache_seqlens + seqlen_new)``.  An integer
  ``cache_seqlens`` applies to every batch row (upstream builds a tensor of
  size ``k_cache.shape[0]``, which only works when that equals the batch).
"""

from typing import Optional, Union

import torch

from .spec import is_int
from .validation import DTYPES as _DTYPES
from .validation import (
    check_alibi,
    check_block_table,
    check_cu_seqlens,
    check_int32_vector,
    check_options,
    check_qkv,
    check_tensor,
)

__all__ = [
    "attention_reference",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


# --------------------------------------------------------------------------- core


def _per_batch(value, batch, default, device, name):
    """None / int / tensor [batch] -> int64 tensor [batch]."""
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.long)
    return torch.full((batch,), int(value), dtype=torch.long, device=device)


def get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Key-block width of upstream's forward kernel, as upstream's
    ``flash_attn_interface._get_block_size_n(device, head_dim, is_dropout, is_causal)`` gives it
    (the width its tests decode ``S_dmask`` with).  The widths, by head size: 128 up to 32; up to
    64, 128 (64 with dropout); up to 96, 64; up to 128, 64 (32 with dropout; without dropout on
    sm86/sm89, 64 only when causal); up to 256, 64.  Only the no-dropout width at head sizes
    97-128 depends on the GPU: ``device`` is read only then, and a device that is not CUDA counts
    as an sm80/sm90 GPU.  ``head_dim`` above 256 is refused, as upstream."""
    if not is_int(head_dim) or not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be an int in [1, 256], got {head_dim!r}")
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if is_dropout:
            return 32
        if not is_causal and _is_sm8x(device):
            return 32
        return 64
    return 64


def _is_sm8x(device):
    """True on an sm86 / sm89 GPU (sm8x other than the A100's sm80)."""
    device = torch.device("cuda", device) if is_int(device) else torch.device(device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major == 8 and minor > 0


def _kernel_exp_scores(scores, block_n):
    """exp(score - running max), the unnormalized scores the upstream kernel stores.

    scores: [..., Sk] float32 with -inf where masked.  The kernel visits key blocks of
    ``block_n`` columns from the last to the first, so an entry in block j is exponentiated
    against the row maximum over blocks j, j+1, ...; a maximum of -inf counts as 0."""
    seqlen_k = scores.shape[-1]
    if seqlen_k == 0:
        return torch.zeros_like(scores)
    nblocks = -(-seqlen_k // block_n)
    padded = torch.nn.functional.pad(scores, (0, nblocks * block_n - seqlen_k), value=float("-inf"))
    block_max = padded.unflatten(-1, (nblocks, block_n)).amax(dim=-1)
    running = block_max.flip(-1).cummax(dim=-1).values.flip(-1)
    running = running.masked_fill(torch.isneginf(running), 0.0)
    running = running.repeat_interleave(block_n, dim=-1)[..., :seqlen_k]
    return torch.exp(scores - running)


def _attend(
    q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, key_lengths, key_start, dropout_p, want_probs
):
    """Returns (out fp32 [B,Sq,Hq,dv], lse fp32 [B,Hq,Sq], probs or None)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must have shape (batch, seqlen, nheads, headdim)")
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"number of q heads ({nheads}) must be divisible by number of k/v heads ({nheads_k})")
    if softmax_scale is None:
        softmax_scale = headdim**-0.5
    device = q.device
    group = nheads // nheads_k

    # Positions: key j of the buffer is key (j - start) of the effective sequence,
    # whose length is end - start.  The bottom-right diagonal for row i is
    # i + length - seqlen_q (in effective coordinates).
    end = _per_batch(key_lengths, batch, seqlen_k, device, "key_lengths")
    start = _per_batch(key_start, batch, 0, device, "key_start")
    rows = torch.arange(seqlen_q, device=device).view(1, seqlen_q, 1)
    cols = torch.arange(seqlen_k, device=device).view(1, 1, seqlen_k)
    rel = cols - start.view(batch, 1, 1)  # [B, 1, Sk]
    diag = rows + (end - start - seqlen_q).view(batch, 1, 1)  # [B, Sq, 1]
    keep = (rel >= 0) & (cols < end.view(batch, 1, 1))  # [B, 1, Sk]

    # Keys outside [start, end) may hold garbage (even NaN/inf): zero them.
    outside = ~keep.view(batch, seqlen_k, 1, 1)
    qf = q.float()
    kf = k.float().masked_fill(outside, 0.0).repeat_interleave(group, dim=2)
    vf = v.float().masked_fill(outside, 0.0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    if left >= 0:
        keep = keep & (rel >= diag - left)
    if right >= 0:
        keep = keep & (rel <= diag + right)
    keep = keep.expand(batch, seqlen_q, seqlen_k).unsqueeze(1)  # [B, 1, Sq, Sk]

    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(device)
        slopes = slopes.expand(batch, nheads) if slopes.dim() == 1 else slopes
        dist = (diag - rel).abs().to(torch.float32).unsqueeze(1)  # [B, 1, Sq, Sk]
        scores = scores - slopes.reshape(batch, nheads, 1, 1) * dist

    row_ok = keep.any(dim=-1, keepdim=True)  # [B, 1, Sq, 1]
    scores = scores.masked_fill(~keep, float("-inf"))
    s_dmask = None
    if want_probs and dropout_p > 0:
        s_dmask = _kernel_exp_scores(scores.detach(), get_block_size_n(device, min(max(headdim, 1), 256), True, causal))
    # Rows without any key are replaced by zeros so nothing turns into NaN,
    # then zeroed out below.
    scores = torch.where(row_ok, scores, torch.zeros_like(scores))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse) * row_ok
    lse = torch.where(row_ok, lse, torch.full_like(lse, float("inf"))).squeeze(-1)

    if dropout_p > 0:
        kept = torch.rand(probs.shape, device=device) >= dropout_p
        probs = probs * kept / (1.0 - dropout_p)
        if want_probs:
            # Upstream's sign encoding: a dropped entry is stored negated.
            s_dmask = torch.where(kept, s_dmask, -s_dmask)
    elif want_probs:
        s_dmask = probs.detach()
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse, s_dmask


def attention_reference(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    key_lengths=None,
    key_start=None,
    dropout_p=0.0,
):
    """Dense attention in float32; the core of every function in this module.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim);
    v: (batch, seqlen_k, nheads_k, headdim_v); any float dtype, nheads % nheads_k == 0.
    key_lengths: None, int or (batch,) tensor: exclusive END index of the valid keys
        in the k/v buffer (default seqlen_k).
    key_start: None, int or (batch,) tensor: first valid key index (default 0).
    Only keys in [key_start, key_lengths) are attended to; they form a sequence of
    length key_lengths - key_start against which causal / window / ALiBi positions
    are aligned bottom-right (see the module docstring).
    alibi_slopes: (nheads,) or (batch, nheads).

    Returns (out, softmax_lse): out float32 (batch, seqlen_q, nheads, headdim_v);
    softmax_lse float32 (batch, nheads, seqlen_q), +inf for rows with no key
    (whose output is 0).  Differentiable with respect to q, k, v.
    """
    out, lse, _ = _attend(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, key_lengths, key_start, dropout_p, False
    )
    return out, lse


# ------------------------------------------------------------------ dense entries


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs):
    check_qkv(q, k, v, varlen=False)
    window_size = check_options(dropout_p, window_size, softcap, softmax_scale)
    check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    out, lse, probs = _attend(
        q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, None, None, dropout_p, return_attn_probs
    )
    out = out.to(q.dtype)
    if not return_attn_probs:
        return out
    if dropout_p > 0:  # upstream's shape: both lengths rounded up to a multiple of 128, zero-padded
        rows, cols = _round128(probs.shape[2]), _round128(probs.shape[3])
        probs = torch.nn.functional.pad(probs, (0, cols - probs.shape[3], 0, rows - probs.shape[2]))
    return out, lse, probs.to(q.dtype)


def _round128(n):
    return -(-n // 128) * 128


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (batch, seqlen, 3, nheads, headdim).  Returns out (batch, seqlen, nheads,
    headdim), or (out, softmax_lse, S_dmask) if return_attn_probs."""
    check_tensor(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have size 3 in dimension 2, got {qkv.shape[2]}")
    q, k, v = qkv.unbind(dim=2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    check_tensor(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have size 2 in dimension 2, got {kv.shape[2]}")
    k, v = kv.unbind(dim=2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)."""
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


# ----------------------------------------------------------------- varlen entries


def _varlen(
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
    return_attn_probs,
    block_table=None,
):
    paged = block_table is not None
    nheads, _, _ = check_qkv(q, k, v, varlen=True, paged=paged)
    window_size = check_options(dropout_p, window_size, softcap, softmax_scale)
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError("cu_seqlens_q must be a torch.Tensor of dtype int32")
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else None
    qb = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None, q.shape[0], max_seqlen_q, "max_seqlen_q", q.device)
    kb = check_cu_seqlens(
        cu_seqlens_k, "cu_seqlens_k", batch, None if paged else k.shape[0], max_seqlen_k, "max_seqlen_k", q.device
    )
    check_alibi(alibi_slopes, batch, nheads, q.device)
    if paged:
        check_block_table(block_table, batch, k.shape[0], q.device)
        capacity = block_table.shape[1] * k.shape[1]
        for b in range(batch):
            if kb[b + 1] - kb[b] > capacity:
                raise ValueError(f"sequence {b} has {kb[b + 1] - kb[b]} keys but block_table only holds {capacity}")

    total_q, dv = q.shape[0], v.shape[-1]
    pieces = [q.new_zeros(qb[0], nheads, dv, dtype=torch.float32)]
    lse_pieces = [q.new_full((nheads, qb[0]), float("inf"), dtype=torch.float32)]
    probs = None
    if return_attn_probs:
        rows, cols = int(max_seqlen_q), int(max_seqlen_k)
        if dropout_p > 0:  # upstream's shape (see _dense)
            rows, cols = _round128(rows), _round128(cols)
        probs = q.new_zeros(batch, nheads, rows, cols)
    for b in range(batch):
        qs = q[qb[b] : qb[b + 1]].unsqueeze(0)
        if paged:
            n = kb[b + 1] - kb[b]
            blocks = block_table[b].long()
            ks = k[blocks].flatten(0, 1)[:n].unsqueeze(0)
            vs = v[blocks].flatten(0, 1)[:n].unsqueeze(0)
        else:
            ks = k[kb[b] : kb[b + 1]].unsqueeze(0)
            vs = v[kb[b] : kb[b + 1]].unsqueeze(0)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        o, l, p = _attend(
            qs, ks, vs, softmax_scale, causal, window_size, softcap, slopes, None, None, dropout_p, return_attn_probs
        )
        pieces.append(o[0])
        lse_pieces.append(l[0])
        if return_attn_probs:
            probs[b, :, : p.shape[2], : p.shape[3]] = p[0].to(q.dtype)
    pieces.append(q.new_zeros(total_q - qb[-1], nheads, dv, dtype=torch.float32))
    lse_pieces.append(q.new_full((nheads, total_q - qb[-1]), float("inf"), dtype=torch.float32))
    out = torch.cat(pieces, dim=0).to(q.dtype)
    lse = torch.cat(lse_pieces, dim=1)
    return (out, lse, probs) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: (batch + 1,) int32."""
    check_tensor(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have size 3 in dimension 1, got {qkv.shape[1]}")
    q, k, v = qkv.unbind(dim=1)
    return _varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
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
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    check_tensor(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have size 2 in dimension 1, got {kv.shape[1]}")
    k, v = kv.unbind(dim=1)
    return _varlen(
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
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with
    block_table (batch, max_num_blocks_per_seq) int32, paged
    (num_blocks, page_block_size, nheads_k, headdim): sequence b's keys are the
    first cu_seqlens_k[b+1] - cu_seqlens_k[b] rows of its blocks, in order."""
    return _varlen(
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
        return_attn_probs,
        block_table=block_table,
    )


# ---------------------------------------------------------------------- kv cache


def rotary_at(x, cos, sin, positions, interleaved):
    """Rotate the first rotary_dim channels of x (B, S, H, d) at positions (B, S)."""
    rot = cos.shape[1] * 2
    c = cos.float()[positions].unsqueeze(2)  # (B, S, 1, rot/2)
    s = sin.float()[positions].unsqueeze(2)
    x = x.float()
    xr, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        xr = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        xr = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((xr, rest), dim=-1)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q against a KV cache, appending k/v (if given) in place first.

    q: (batch, seqlen_q, nheads, headdim).
    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or paged
        (num_blocks, page_block_size, nheads_k, headdim) with block_table
        (batch, max_num_blocks_per_seq) int32.
    k, v: (batch, seqlen_new, nheads_k, headdim), written at cache positions
        cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 (after rotary on k).
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); need k.  k is rotated at
        its cache positions; q at cache_seqlens + i if causal or local, otherwise
        every q row at position cache_seqlens.
    cache_seqlens: int or (batch,) int32; None means the whole cache is valid.
    cache_batch_idx: (batch,) int32 rows of the cache to use (not with block_table).
    cache_leftpad: (batch,) int32 first valid cache position (not with block_table).
    Returns out (batch, seqlen_q, nheads, headdim), plus softmax_lse
    (batch, nheads, seqlen_q) float32 if return_softmax_lse.  num_splits is ignored.
    """
    check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    cache_shape = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    )
    check_tensor(k_cache, "k_cache", 4, cache_shape)
    check_tensor(v_cache, "v_cache", 4, cache_shape)
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must have dtype float16, bfloat16 or float32, got {q.dtype}")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device})")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache must have the same head dimension as q ({headdim}), got {k_cache.shape[3]}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"number of heads in k_cache ({nheads_k}) must divide number of heads in q ({nheads})")
    window_size = check_options(0.0, window_size, softcap, softmax_scale)
    check_alibi(alibi_slopes, batch, nheads, q.device)
    device = q.device

    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is not supported together with block_table")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad is not supported together with block_table")
        check_block_table(block_table, batch, k_cache.shape[0], device)
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            check_int32_vector(cache_batch_idx, "cache_batch_idx", batch, device)
            if batch and (int(cache_batch_idx.min()) < 0 or int(cache_batch_idx.max()) >= k_cache.shape[0]):
                raise ValueError(f"cache_batch_idx entries must be in [0, {k_cache.shape[0]})")
            rows = cache_batch_idx.long()
        else:
            if k_cache.shape[0] < batch:
                raise ValueError(
                    f"k_cache has {k_cache.shape[0]} rows but q has batch {batch}; "
                    f"pass cache_batch_idx or a larger cache"
                )
            rows = torch.arange(batch, device=device)

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    seqlen_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given when k and v are given")
        for x, name in ((k, "k"), (v, "v")):
            check_tensor(x, name, 4, "(batch, seqlen_new, nheads_k, headdim)")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
            if x.device != device:
                raise ValueError(f"{name} must be on the same device as q ({device})")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != (nheads_k, headdim):
            raise ValueError(
                f"k and v must have shape ({batch}, seqlen_new, {nheads_k}, "
                f"{headdim}), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        seqlen_new = k.shape[1]
        for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
                raise ValueError(f"{name}: an expanded tensor (a stride of 0) cannot take new k / v in place")

    if isinstance(cache_seqlens, torch.Tensor):
        check_int32_vector(cache_seqlens, "cache_seqlens", batch, device)
    elif cache_seqlens is not None and not isinstance(cache_seqlens, int):
        raise TypeError("cache_seqlens must be an int or an int32 tensor")
    seqlens = _per_batch(cache_seqlens, batch, capacity, device, "cache_seqlens")
    if batch and int(seqlens.min()) < 0:
        raise ValueError("cache_seqlens must be non-negative")
    if batch and int(seqlens.max()) + seqlen_new > capacity:
        raise ValueError(
            f"cache overflow: cache_seqlens ({int(seqlens.max())}) + new tokens "
            f"({seqlen_new}) exceeds the cache capacity ({capacity})"
        )
    if cache_leftpad is not None:
        check_int32_vector(cache_leftpad, "cache_leftpad", batch, device)
        if batch and (int(cache_leftpad.min()) < 0 or bool((cache_leftpad.long() > seqlens + seqlen_new).any())):
            raise ValueError("cache_leftpad must be in [0, cache_seqlens + seqlen_new]")

    local = window_size[0] >= 0 or window_size[1] >= 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new k and v to be given")
        check_tensor(rotary_cos, "rotary_cos", 2, "(seqlen_ro, rotary_dim / 2)")
        check_tensor(rotary_sin, "rotary_sin", 2, "(seqlen_ro, rotary_dim / 2)")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError("rotary_sin must have the same shape as rotary_cos")
        if rotary_cos.device != device or rotary_sin.device != device:
            raise ValueError(f"rotary_cos and rotary_sin must be on the same device as q ({device})")
        if 2 * rotary_cos.shape[1] > headdim:
            raise ValueError(f"rotary_cos gives rotary_dim {2 * rotary_cos.shape[1]} > headdim {headdim}")
        q_span = seqlen_q if (causal or local) else 1
        needed = int(seqlens.max()) + max(seqlen_new, q_span) if batch else 0
        if needed > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions but position {needed - 1} is needed")

    # Rotary, then append the new tokens to the cache in place.
    q_used = q
    if k is not None:
        pos_k = seqlens.view(batch, 1) + torch.arange(seqlen_new, device=device)
        k_new = k
        if rotary_cos is not None:
            k_new = rotary_at(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
            q_off = (
                torch.arange(seqlen_q, device=device)
                if (causal or local)
                else torch.zeros(seqlen_q, dtype=torch.long, device=device)
            )
            pos_q = seqlens.view(batch, 1) + q_off
            q_used = rotary_at(q, rotary_cos, rotary_sin, pos_q, rotary_interleaved).to(q.dtype)
        with torch.no_grad():
            if paged:
                blk = torch.gather(block_table.long(), 1, pos_k // page)
                k_cache[blk, pos_k % page] = k_new.to(k_cache.dtype)
                v_cache[blk, pos_k % page] = v.to(v_cache.dtype)
            else:
                r = rows.view(batch, 1).expand(batch, seqlen_new)
                k_cache[r, pos_k] = k_new.to(k_cache.dtype)
                v_cache[r, pos_k] = v.to(v_cache.dtype)

    # Per-batch contiguous view of the (updated) cache.
    if paged:
        keys = k_cache[block_table.long()].flatten(1, 2)
        values = v_cache[block_table.long()].flatten(1, 2)
    else:
        keys, values = k_cache[rows], v_cache[rows]
    out, lse, _ = _attend(
        q_used,
        keys,
        values,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        seqlens + seqlen_new,
        cache_leftpad,
        0.0,
        False,
    )
    out = out.to(q.dtype)
    return (out, lse) if return_softmax_lse else out
