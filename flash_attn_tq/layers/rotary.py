"""Rotary position embeddings with the interface of ``flash_attn.layers.rotary`` (2.8.3).

Plain PyTorch (no Triton kernel), on any device.  Each function is an autograd Function
whose backward applies the inverse rotation to the incoming gradient, as upstream's.

Conventions (those of the upstream kernel):

* ``cos`` and ``sin`` are tables ``(seqlen_ro, rotary_dim / 2)``; row ``p`` holds the
  angles for position ``p``.  Only the first ``rotary_dim`` channels of the head dimension
  are rotated (``rotary_dim <= headdim``); the rest pass through unchanged.
* Pairs: with ``interleaved=False`` (GPT-NeoX style, "rotate half") channel ``i`` is paired
  with ``i + rotary_dim / 2``; with ``interleaved=True`` (GPT-J style) channel ``2i`` with
  ``2i + 1``.  Pair ``i`` at position ``p`` becomes
  ``(x0 * cos[p, i] - x1 * sin[p, i], x0 * sin[p, i] + x1 * cos[p, i])``.
* Token ``s`` of sequence ``b`` is at position ``s + seqlen_offsets[b]`` (an int offset
  applies to every sequence); with ``cu_seqlens`` the tokens of sequence ``b`` are rows
  ``cu_seqlens[b]:cu_seqlens[b + 1]`` and ``s`` counts from the sequence's first row.
* A position at or past ``seqlen_ro`` (possible with per-sequence offsets) is left
  unrotated, as the kernel does, and so is a negative one; with an int offset, ``seqlen_offsets + seqlen`` must not
  exceed ``seqlen_ro``, as upstream asserts.  Rows outside ``cu_seqlens[0]:cu_seqlens[-1]``
  are left unchanged.
* The rotation is computed in float32 (float64 for float64 input) and stored in the input's
  dtype.  ``cos`` / ``sin`` get no gradient, as upstream.
* The functions ending in ``_`` and ``inplace=True`` write into their input and return it.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "rotate_half",
    "apply_rotary_emb_torch",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_kv_",
    "RotaryEmbedding",
]


def rotate_half(x, interleaved=False):
    """The pairwise quarter turn ``(x0, x1) -> (-x1, x0)`` over the last dimension.

    interleaved=False pairs the first half with the second half; interleaved=True pairs
    even with odd channels."""
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x1, x0), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """Reference rotary embedding by broadcasting, without offsets.

    x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen, rotary_dim / 2) or
    (batch, seqlen, rotary_dim / 2).  Returns x with its first rotary_dim channels rotated
    (in x's dtype, computed in the promoted dtype of x and cos)."""
    rotary_dim = cos.shape[-1] * 2
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({x.shape[-1]})")
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)
        sin = sin.repeat_interleave(2, dim=-1)
    else:
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    xr = x[..., :rotary_dim]
    rotated = xr * cos + rotate_half(xr, interleaved) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


# ------------------------------------------------------------------------ core


def _check_tables(cos, sin, headdim):
    if not isinstance(cos, Tensor) or not isinstance(sin, Tensor):
        raise TypeError("cos and sin must be tensors")
    if cos.dim() != 2:
        raise ValueError(f"cos must have shape (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({headdim})")
    return rotary_dim


def _offsets(seqlen_offsets, batch, device):
    """int -> int; tensor -> (batch,) int64 on device."""
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seqlen_offsets must be int32 or int64, got {seqlen_offsets.dtype}")
        if tuple(seqlen_offsets.shape) != (batch,):
            raise ValueError(f"seqlen_offsets must have shape ({batch},), got {tuple(seqlen_offsets.shape)}")
        return seqlen_offsets.to(device=device, dtype=torch.long)
    return int(seqlen_offsets)


def _positions(x, seqlen_ro, seqlen_offsets, cu_seqlens, max_seqlen):
    """Position of every token of x, shaped like x without its last two dimensions.

    Returns (positions int64, rotate bool): tokens with rotate False stay as they are."""
    device = x.device
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"x must have shape (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
        batch, seqlen = x.shape[0], x.shape[1]
        offsets = _offsets(seqlen_offsets, batch, device)
        steps = torch.arange(seqlen, device=device)
        if isinstance(offsets, int):
            if offsets + seqlen > seqlen_ro:
                raise ValueError(
                    f"seqlen_offsets + seqlen ({offsets} + {seqlen}) exceeds the {seqlen_ro} positions of cos/sin"
                )
            pos = (steps + offsets).unsqueeze(0).expand(batch, seqlen)
        else:
            pos = steps.unsqueeze(0) + offsets.unsqueeze(1)
        if seqlen > seqlen_ro:
            raise ValueError(f"seqlen ({seqlen}) exceeds the {seqlen_ro} positions of cos/sin")
        return pos, (pos >= 0) & (pos < seqlen_ro)

    if x.dim() != 3:
        raise ValueError(f"with cu_seqlens, x must have shape (total_seqlen, nheads, headdim), got {tuple(x.shape)}")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor of batch + 1 running totals")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    batch = cu.shape[0] - 1
    if max_seqlen is not None and int(max_seqlen) > seqlen_ro:
        raise ValueError(f"max_seqlen ({int(max_seqlen)}) exceeds the {seqlen_ro} positions of cos/sin")
    offsets = _offsets(seqlen_offsets, batch, device)
    if isinstance(offsets, int) and max_seqlen is not None and offsets + int(max_seqlen) > seqlen_ro:
        raise ValueError(
            f"seqlen_offsets + max_seqlen ({offsets} + {int(max_seqlen)}) exceeds the {seqlen_ro} positions of cos/sin"
        )
    rows = torch.arange(x.shape[0], device=device)
    if batch == 0:
        return rows, torch.zeros_like(rows, dtype=torch.bool)
    # sequence of each row: the number of sequence ends at or before it
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=batch - 1)
    pos = rows - cu[seq] + (offsets if isinstance(offsets, int) else offsets[seq])
    inside = (rows >= cu[0]) & (rows < cu[-1])
    return pos, inside & (pos >= 0) & (pos < seqlen_ro)


def _rotated(x, cos, sin, pos, rotate, interleaved, conjugate):
    """The first rotary_dim channels of x, rotated (backwards if conjugate), in x's dtype."""
    half = cos.shape[1]
    compute = torch.promote_types(x.dtype, torch.float32)
    if cos.shape[0] > 0:
        idx = pos.clamp(0, cos.shape[0] - 1)
        c = cos.detach().to(device=x.device, dtype=compute)[idx]
        s = sin.detach().to(device=x.device, dtype=compute)[idx]
        keep = rotate.unsqueeze(-1)
        c = torch.where(keep, c, torch.ones_like(c))
        s = torch.where(keep, s, torch.zeros_like(s))
    else:  # no positions at all: nothing is rotated
        c = x.new_ones((*pos.shape, half), dtype=compute)
        s = x.new_zeros((*pos.shape, half), dtype=compute)
    if conjugate:
        s = -s
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)  # broadcast over heads
    xr = x[..., : 2 * half].to(compute)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.to(x.dtype)


def _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen, inplace, conjugate=False):
    """Rotary embedding of x (into x itself if inplace); conjugate turns the other way."""
    rotary_dim = _check_tables(cos, sin, x.shape[-1])
    pos, rotate = _positions(x, cos.shape[0], seqlen_offsets, cu_seqlens, max_seqlen)
    rotated = _rotated(x, cos, sin, pos, rotate, interleaved, conjugate)
    if inplace:
        x[..., :rotary_dim].copy_(rotated)
        return x
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _save(ctx, seqlen_offsets, *tensors):
    """Keeps the tables (and a tensor seqlen_offsets) for backward."""
    if isinstance(seqlen_offsets, Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _saved(ctx):
    saved = ctx.saved_tensors
    if ctx.seqlen_offsets is None:
        return saved[:-1], saved[-1]
    return saved, ctx.seqlen_offsets


# The rotations run inside autograd Functions, like upstream's kernels: the in-place variants
# may then be applied to leaf tensors that require grad, and backward is the inverse rotation
# of the incoming gradient (cos / sin get none).


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
        out = _rotate(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen, inplace)
        _save(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        return out

    @staticmethod
    def backward(ctx, grad):
        (cos, sin, cu_seqlens), seqlen_offsets = _saved(ctx)
        dx = _rotate(
            grad, cos, sin, ctx.interleaved, seqlen_offsets, cu_seqlens, ctx.max_seqlen, inplace=False, conjugate=True
        )
        return dx, None, None, None, None, None, None, None


class _ApplyRotaryEmbQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q):
        q, k = _split_qk(qkv, num_heads_q)
        _rotate(q, cos, sin, interleaved, seqlen_offsets, None, None, inplace=True)
        _rotate(k, cos_k, sin_k, interleaved, seqlen_offsets, None, None, inplace=True)
        _save(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        return qkv

    @staticmethod
    def backward(ctx, grad):
        (cos, sin, cos_k, sin_k), seqlen_offsets = _saved(ctx)
        dqkv = grad.clone()
        dq, dk = _split_qk(dqkv, ctx.num_heads_q)
        _rotate(dq, cos, sin, ctx.interleaved, seqlen_offsets, None, None, inplace=True, conjugate=True)
        _rotate(dk, cos_k, sin_k, ctx.interleaved, seqlen_offsets, None, None, inplace=True, conjugate=True)
        return dqkv, None, None, None, None, None, None, None


class _ApplyRotaryEmbKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved, seqlen_offsets):
        _rotate(kv[:, :, 0], cos, sin, interleaved, seqlen_offsets, None, None, inplace=True)
        _save(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        return kv

    @staticmethod
    def backward(ctx, grad):
        (cos, sin), seqlen_offsets = _saved(ctx)
        dkv = grad.clone()
        _rotate(dkv[:, :, 0], cos, sin, ctx.interleaved, seqlen_offsets, None, None, inplace=True, conjugate=True)
        return dkv, None, None, None, None


# ------------------------------------------------------------------- public API


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
):
    """Rotary embedding of the first rotary_dim channels of x.

    x: (batch_size, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with
        cu_seqlens.
    cos, sin: (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim.
    interleaved: rotate channel pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2)
        (GPT-NeoX).
    inplace: write the result into x (the returned tensor then shares x's memory).
    seqlen_offsets: int or (batch_size,) int32/int64 tensor; each sequence starts at this
        position (typically the number of tokens already in a KV cache).
    cu_seqlens: (batch + 1,) running totals of the sequence lengths in x, or None.
    max_seqlen: the longest sequence (upstream requires it with cu_seqlens; here it is only
        checked against seqlen_ro).
    Returns a tensor shaped like x, in x's dtype.
    """
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


# The older name, kept by upstream for compatibility.
apply_rotary_emb_func = apply_rotary_emb


def _split_qk(qkv, num_heads_q):
    """Views of the q and k heads of a packed qkv tensor."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4:
        raise ValueError(
            f"qkv must have 5 dimensions (batch, seqlen, 3, nheads, headdim) or 4 "
            f"(batch, seqlen, num_heads_q + 2 * num_heads_k, headdim), got "
            f"{tuple(qkv.shape)}"
        )
    if num_heads_q is None:
        raise ValueError(
            "num_heads_q is needed for qkv of shape (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)"
        )
    rest = qkv.shape[2] - num_heads_q
    if num_heads_q <= 0 or rest <= 0 or rest % 2:
        raise ValueError(f"qkv has {qkv.shape[2]} heads, which is not num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    num_heads_k = rest // 2
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]


def apply_rotary_emb_qkv_(
    qkv,
    cos,
    sin,
    cos_k=None,
    sin_k=None,
    interleaved=False,
    seqlen_offsets: Union[int, Tensor] = 0,
    num_heads_q: Optional[int] = None,
):
    """In-place rotary embedding of the q and k parts of a packed qkv tensor; returns qkv.

    qkv: (batch_size, seqlen, 3, nheads, headdim), or
        (batch_size, seqlen, num_heads_q + 2 * num_heads_k, headdim) (MQA / GQA; heads are
        q, then k, then v) with num_heads_q given.
    cos, sin: (seqlen_ro, rotary_dim / 2), for q, and for k unless cos_k / sin_k are given
        (XPos uses different tables for k).
    seqlen_offsets: int or (batch_size,) tensor, as in :func:`apply_rotary_emb`.
    v is left untouched.
    """
    if (cos_k is None) != (sin_k is None):
        raise ValueError("cos_k and sin_k must be given together")
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    return _ApplyRotaryEmbQKV.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


def apply_rotary_emb_kv_(
    kv,
    cos,
    sin,
    interleaved=False,
    seqlen_offsets: Union[int, Tensor] = 0,
):
    """In-place rotary embedding of the k part of kv (batch_size, seqlen, 2, nheads, headdim);
    returns kv.  cos, sin: (seqlen_ro, rotary_dim / 2); v is left untouched."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")
    return _ApplyRotaryEmbKV.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer, Su et al., https://arxiv.org/abs/2104.09864),
    optionally with XPos decay (Sun et al., https://arxiv.org/abs/2212.10554).

    dim: rotary_dim, the number of leading channels of each head that are rotated.
    base: the frequency base; pair i turns by ``position * base ** (-2i / dim)``.
    interleaved: GPT-J channel pairs (2i, 2i + 1) instead of GPT-NeoX (i, i + dim / 2).
    scale_base: None, or the XPos scale base (e.g. 512): q is additionally multiplied by
        ``zeta ** ((p - L // 2) / scale_base)`` and k divided by it, with
        ``zeta_i = (2i + 0.4 * dim) / (1.4 * dim)`` and ``L`` the length of the cached
        tables, so q.k decays with the distance between their positions.
    device: where the buffers are created.
    pos_idx_in_fp32: build the position index (and the frequencies) in float32 even if the
        module was cast to a lower precision (the only behaviour of flash-attn 2.8.3, the
        default here); False builds it in the dtype of ``inv_freq``, as older flash-attn
        releases could.

    The cos / sin tables are cached and rebuilt when a longer sequence, another device or
    dtype, or (in training mode) an inference-mode cache is met.
    """

    def __init__(
        self,
        dim: int,
        base=10000.0,
        interleaved=False,
        scale_base=None,
        device=None,
        pos_idx_in_fp32=True,
    ):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even number, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = None
        if scale_base is not None:
            even = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
            scale = (even + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base**exponents)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        dtype = torch.float32 if dtype is None else dtype
        cached = self._cos_cached
        if (
            cached is not None
            and seqlen <= self._seq_len_cached
            and (device is None or cached.device == torch.device(device))
            and cached.dtype == dtype
            and not (self.training and cached.is_inference())
        ):
            return
        self._seq_len_cached = seqlen
        if self.pos_idx_in_fp32:
            positions = torch.arange(seqlen, device=device, dtype=torch.float32)
            # the frequencies must be float32 too, even if the module was cast to 16 bits
            inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        else:
            positions = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq
        # an outer product rather than einsum, which autocast would run in 16 bits
        angles = torch.outer(positions, inv_freq.to(device=positions.device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            self._cos_k_cached = self._sin_k_cached = None
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2) / self.scale_base
        scale = (self.scale.unsqueeze(0) ** power.unsqueeze(1)).to(positions.device)
        self._cos_cached = (cos * scale).to(dtype)
        self._sin_cached = (sin * scale).to(dtype)
        self._cos_k_cached = (cos / scale).to(dtype)
        self._sin_k_cached = (sin / scale).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Optional[Tensor] = None,
        seqlen_offset: Union[int, Tensor] = 0,
        max_seqlen: Optional[int] = None,
        num_heads_q: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Applies the embedding in place and returns the rotated tensor(s).

        qkv: (batch, seqlen, 3, nheads, headdim) or
            (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q if kv is
            None; otherwise q alone, (batch, seqlen, nheads, headdim).
        kv: None or (batch, seqlen, 2, nheads_k, headdim).
        seqlen_offset: int or (batch,) tensor: position of each sequence's first token.  With
            a tensor, pass max_seqlen so that the tables cover every position.
        max_seqlen: build the tables up to this length (otherwise seqlen + seqlen_offset).
        Returns qkv, or (q, kv) when kv is given.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("a tensor seqlen_offset needs max_seqlen (or an existing cache)")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv,
                self._cos_cached,
                self._sin_cached,
                cos_k if xpos else None,
                sin_k if xpos else None,
                interleaved=self.interleaved,
                seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )
        q = apply_rotary_emb(
            qkv,
            self._cos_cached,
            self._sin_cached,
            interleaved=self.interleaved,
            inplace=True,
            seqlen_offsets=seqlen_offset,
        )
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv

    def extra_repr(self):
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, scale_base={self.scale_base}"
