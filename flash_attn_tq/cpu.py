"""A practical CPU mode: int8 keys, low-bit values, blockwise decode attention in PyTorch.

:class:`CpuQuantizedKVCache` is a per-layer K/V cache for CPU inference. Keys and values are first
turned by the randomized Hadamard rotation of :class:`~flash_attn_tq.quantizers.TurboQuantizer`
(an orthogonal map: ``q . k`` is unchanged once the query is turned the same way, and it spreads
the keys' outlier channels over all coordinates, so one int8 scale per token loses little):

* keys: symmetric int8, ``k_int8 [batch, kv_heads, max_seqlen, head_dim]`` with one float16 scale
  per ``key_group`` channels, ``k_scale [batch, kv_heads, max_seqlen, head_dim // key_group]``
  (default ``key_group = head_dim``: one scale a token; 8.125 bits/element at head_dim 128);
* values: the package's own codes (:mod:`flash_attn_tq.format`, turbo quantizer, uniform grid,
  norm fit, scale-only), ``v_codes [batch, kv_heads, max_seqlen, code_bytes]`` uint8 and
  ``v_scale [batch, kv_heads, max_seqlen]`` float16 (3 bits: 3.125 bits/element at head_dim 128).

Keys 8.125 and values 3.125: 5.625 bits/element on average at head_dim 128 (2.84x smaller than fp16).

Attention (:meth:`CpuQuantizedKVCache.attend`) never materializes the float cache: the scores come from int8 key blocks
of ``block_size`` tokens converted to ``score_dtype`` and multiplied by the turned queries (the
scales applied to the small score block), then one float32 softmax over all the scores, then the
values are decoded from their 16-bit code lanes block by block with masks (no gather)
and multiplied by the probabilities times the value scales; the output is turned back once (the
code order permutation and the inverse rotation act on the ``[queries, head_dim]`` result only).

Use it as a :class:`~flash_attn_tq.cache.QuantizedKVCache`: pass it as ``k_cache`` (or
``kv_cache=``) to :func:`flash_attn_tq.flash_attn_with_kvcache`, with or without new ``k``/``v``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from . import format as fmt
from .quantizers import TurboQuantizer, fwht
from .spec import CacheSpec
from .validation import check_window_size

# what a CacheSpec must say for this cache's format: int8 keys, turbo's uniform norm fit for the values
CPU_FORMAT = dict(
    k_bits=8,
    quantizer="turbo",
    grid="uniform",
    fit="norm",
    scale_only=True,
    sink_tokens=0,
    fp16_window=0,
    window_bits=16,
    key_center=False,
    page_size=None,
    streaming=False,
    health=False,
)


def spec_values(spec: CacheSpec) -> tuple[int, int]:
    """(v_bits, seed) of a :class:`CacheSpec` this cache's format holds; other fields refused by name."""
    if not isinstance(spec, CacheSpec):
        raise TypeError(f"spec must be a CacheSpec, got {type(spec).__name__}")
    for name, want in CPU_FORMAT.items():
        if getattr(spec, name) != want:
            raise ValueError(
                f"spec: the CPU cache holds {name}={want!r} (int8 keys, 16-bit free), got {getattr(spec, name)!r}"
            )
    return spec.v_bits, spec.seed


COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
VALUE_BITS = (2, 3, 4)


class CpuQuantizedKVCache:
    """int8 keys + ``v_bits``-bit values for CPU decode (see the module docstring for the layout).

    Args:
        batch_size, max_seqlen, num_kv_heads: capacity (rows, tokens per row, kv heads).
        spec: a :class:`~flash_attn_tq.CacheSpec` of this format (``k_bits=8``: the int8 keys; turbo's
            uniform norm fit; no side, window or key center): its ``v_bits`` and ``seed``.
        head_dim: a power of two, multiple of 32 (the Hadamard rotation).
        key_group: channels sharing one int8 key scale; divides ``head_dim`` (default: ``head_dim``,
            one scale per token and kv head).
        v_bits: value code width, 2, 3 or 4.
        seed: seed of the rotation's sign vector.
        block_size: tokens per block of the blockwise attention (bounds the temporaries).
        compute_dtype: dtype the value blocks are converted to for their matmul: ``torch.float32``
            (default: exact against float32 attention over the dequantized cache, and as fast as
            bfloat16 in benchmarks/bench_cpu.py) or ``torch.bfloat16`` (half the temporaries).
        score_dtype: the same for the key blocks (default: ``compute_dtype``). bfloat16 scores are
            rounded to 8 significant bits (about 2% relative error in the output on random data).
        device: a CPU device.

    ``seqlens [batch]`` int32 counts the tokens written per row.
    """

    def __init__(
        self,
        batch_size: int,
        max_seqlen: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        spec: Optional[CacheSpec] = None,
        key_group: Optional[int] = None,
        v_bits: int = 3,
        seed: int = 0,
        block_size: int = 256,
        compute_dtype: torch.dtype = torch.float32,
        score_dtype: Optional[torch.dtype] = None,
        device: Union[torch.device, str] = "cpu",
    ):
        if spec is not None:
            v_bits, seed = spec_values(spec)
        for name, val in (
            ("batch_size", batch_size),
            ("max_seqlen", max_seqlen),
            ("num_kv_heads", num_kv_heads),
            ("block_size", block_size),
        ):
            if int(val) <= 0:
                raise ValueError(f"{name} must be positive, got {val}")
        if head_dim <= 0 or head_dim % 32 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two and a multiple of 32, got {head_dim}")
        key_group = head_dim if key_group is None else int(key_group)
        if key_group <= 0 or head_dim % key_group:
            raise ValueError(f"key_group must divide head_dim={head_dim}, got {key_group}")
        if v_bits not in VALUE_BITS:
            raise ValueError(f"v_bits must be one of {VALUE_BITS}, got {v_bits}")
        score_dtype = compute_dtype if score_dtype is None else score_dtype
        for name, dt in (("compute_dtype", compute_dtype), ("score_dtype", score_dtype)):
            if dt not in COMPUTE_DTYPES:
                raise TypeError(f"{name} must be torch.bfloat16 or torch.float32, got {dt}")
        device = torch.device(device)
        if device.type != "cpu":
            raise ValueError(f"device must be a CPU device, got {device}")
        self.batch_size, self.max_seqlen = int(batch_size), int(max_seqlen)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.key_group, self.v_bits, self.seed = key_group, int(v_bits), int(seed)
        self.block_size, self.compute_dtype, self.device = int(block_size), compute_dtype, device
        self.score_dtype = score_dtype
        self.quantizer = TurboQuantizer(head_dim, v_bits, "uniform", seed, "norm")
        B, H, S, D = self.batch_size, self.num_kv_heads, self.max_seqlen, self.head_dim
        self.k_int8 = torch.zeros(B, H, S, D, dtype=torch.int8, device=device)
        self.k_scale = torch.zeros(B, H, S, D // key_group, dtype=torch.float16, device=device)
        self.v_codes = torch.zeros(B, H, S, fmt.code_bytes(D, v_bits), dtype=torch.uint8, device=device)
        self.v_scale = torch.zeros(B, H, S, dtype=torch.float16, device=device)
        self.seqlens = torch.zeros(B, dtype=torch.int32, device=device)
        # output column n (code-sequence order) holds element seq[n]: out[..., order] is element order
        self._order = torch.argsort(fmt.sequence_elements(D))

    # ------------------------------------------------------------------ storage

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's tensors (codes and scales; not the seqlens)."""
        return sum(t.numel() * t.element_size() for t in (self.k_int8, self.k_scale, self.v_codes, self.v_scale))

    def bits_per_element(self) -> float:
        """Average storage per K/V element, scales included: ``(key bits + value bits) / 2``."""
        d = self.head_dim
        k_bits = 8 + 16 / self.key_group
        v_bits = fmt.bits_per_element(d, self.v_bits, meta_bytes=2)
        return (k_bits + v_bits) / 2

    def quantize_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k [..., head_dim]`` -> (int8 ``[..., head_dim]`` of the turned keys, float16 scales
        ``[..., head_dim // key_group]``); a group of zeros gets scale 0."""
        kr = self.quantizer.rotate(k)
        g = kr.unflatten(-1, (-1, self.key_group))
        scale = (g.abs().amax(-1) / 127.0).to(torch.float16)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        codes = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return codes.flatten(-2), scale

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache_seqlens: Union[torch.Tensor, int, None] = None,
        batch_idx: Optional[torch.Tensor] = None,
    ) -> None:
        """Quantize ``k, v [batch, n, kv_heads, head_dim]`` (any float dtype, the same for both) and
        write them at positions ``cache_seqlens + 0 .. n-1`` of rows ``batch_idx`` (int ``[batch]``;
        default ``0 .. batch-1``). ``cache_seqlens`` (int or int ``[batch]``) defaults to
        :attr:`seqlens`; afterwards ``seqlens[rows] = cache_seqlens + n``."""
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
                raise ValueError(
                    f"{name} must be a float tensor (batch, seqlen_new, nheads_k, headdim), got "
                    f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                )
            if x.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must have {self.num_kv_heads} kv heads of head_dim {self.head_dim}, got {tuple(x.shape)}"
                )
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device} but the cache is on {self.device}")
        if v.dtype != k.dtype:  # (upstream's rule: both have q's dtype; without q, each other's)
            raise TypeError(f"v must have the same dtype as k ({k.dtype}), got {v.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        batch, n = k.shape[:2]
        rows = self._rows(batch_idx, batch)
        start = self._starts(cache_seqlens, rows, batch)
        if n == 0:
            return
        if int(start.min()) < 0 or int(start.max()) + n > self.max_seqlen:
            raise ValueError(
                f"cache_seqlens + seqlen_new must lie in [0, max_seqlen={self.max_seqlen}], got {start.tolist()} + {n}"
            )
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise ValueError("k and v must be finite (NaN/Inf cannot be quantized)")
        pos = start.unsqueeze(1) + torch.arange(n, device=self.device)  # [batch, n]
        r = rows.unsqueeze(1)
        kq, ks = self.quantize_keys(k)
        self.k_int8[r, :, pos] = kq
        self.k_scale[r, :, pos] = ks
        codes, meta = self.quantizer.quantize(v)
        self.v_codes[r, :, pos] = fmt.pack_codes(codes, self.v_bits, check=False)
        self.v_scale[r, :, pos] = meta[..., 0]
        self.seqlens[rows] = (start + n).to(torch.int32)

    def _rows(self, batch_idx: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        if batch_idx is None:
            if batch > self.batch_size:
                raise ValueError(f"batch {batch} exceeds the cache's batch_size {self.batch_size}")
            return torch.arange(batch, device=self.device)
        if not isinstance(batch_idx, torch.Tensor) or batch_idx.shape != (batch,) or batch_idx.is_floating_point():
            raise ValueError(
                f"cache_batch_idx must be an int tensor [batch={batch}], got "
                f"{getattr(batch_idx, 'dtype', type(batch_idx).__name__)} "
                f"{tuple(getattr(batch_idx, 'shape', ()))}"
            )
        rows = batch_idx.to(self.device, torch.long)
        if batch and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size):
            raise ValueError(f"cache_batch_idx entries must lie in [0, batch_size={self.batch_size})")
        return rows

    def _starts(self, cache_seqlens: Union[torch.Tensor, int, None], rows: torch.Tensor, batch: int) -> torch.Tensor:
        if cache_seqlens is None:
            return self.seqlens[rows].long()
        if isinstance(cache_seqlens, int):
            return torch.full((batch,), cache_seqlens, dtype=torch.long, device=self.device)
        if (
            not isinstance(cache_seqlens, torch.Tensor)
            or cache_seqlens.shape != (batch,)
            or cache_seqlens.is_floating_point()
        ):
            raise ValueError(
                f"cache_seqlens must be an int or an int tensor [batch={batch}], got "
                f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                f"{tuple(getattr(cache_seqlens, 'shape', ()))}"
            )
        return cache_seqlens.to(self.device, torch.long)

    def dequantize(self, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(k, v) [len(rows), max_seqlen, kv_heads, head_dim]`` in the original domain (for
        tests and the reference: attention itself never builds these)."""
        rows = torch.arange(self.batch_size) if rows is None else rows.long()
        kr = (
            self.k_int8[rows].float().unflatten(-1, (-1, self.key_group)) * self.k_scale[rows].float().unsqueeze(-1)
        ).flatten(-2)
        k = self.quantizer.unrotate(kr)
        codes = fmt.unpack_codes(self.v_codes[rows], self.v_bits, self.head_dim)
        v = self.quantizer.dequantize(codes, self.v_scale[rows].unsqueeze(-1))
        return k.transpose(1, 2), v.transpose(1, 2)

    # ------------------------------------------------------------------ attention

    def _scores(self, qr: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        """float32 ``[b, kv_heads, M, length]`` scores of turned queries ``qr [b, kv_heads, M, D]``
        (float32) against the int8 keys of ``rows``, ``block_size`` tokens at a time."""
        b, H, M, D = qr.shape
        dt, C, ng = self.score_dtype, self.block_size, D // self.key_group
        if ng > 1:  # block-diagonal queries: one matmul gives every group's partial dot product
            eye = torch.eye(ng, dtype=qr.dtype).repeat_interleave(self.key_group, 1)  # [ng, D]
            qm = (qr.unsqueeze(2) * eye.view(1, 1, ng, 1, D)).reshape(b, H, ng * M, D).to(dt)
        else:
            qm = qr.to(dt)
        scores = torch.empty(b, H, M, length, dtype=torch.float32)
        whole = rows.numel() == self.batch_size and bool((rows == torch.arange(self.batch_size)).all())
        keys = self.k_int8 if whole else self.k_int8[rows]
        kscale = self.k_scale if whole else self.k_scale[rows]
        for s0 in range(0, length, C):
            s1 = min(s0 + C, length)
            part = torch.matmul(qm, keys[:, :, s0:s1].to(dt).transpose(-1, -2)).float()  # [b, H, ng*M, c]
            sc = kscale[:, :, s0:s1].float()  # [b, H, c, ng]
            if ng > 1:
                part = (part.view(b, H, ng, M, s1 - s0) * sc.permute(0, 1, 3, 2).unsqueeze(3)).sum(2)
            else:
                part = part.mul_(sc.transpose(-1, -2))
            scores[..., s0:s1] = part
        return scores

    def _values(self, p: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        """float32 ``[b, kv_heads, M, D]``: probabilities ``p [b, kv_heads, M, length]`` times the
        values of ``rows`` in the turned domain, code-sequence order (see :meth:`attend`).

        Per block, each code slot ``j`` of the 16-bit lanes is isolated with one AND against its
        mask (the code times ``2**shift``, exact in bfloat16), converted and multiplied by the
        weights; ``2**-shift`` is applied to the small ``[M, lanes]`` product instead of the codes."""
        b, H, M, _ = p.shape
        D, bits, dt, C = self.head_dim, self.v_bits, self.compute_dtype, self.block_size
        whole = rows.numel() == self.batch_size and bool((rows == torch.arange(self.batch_size)).all())
        codes = self.v_codes if whole else self.v_codes[rows]
        vscale = self.v_scale if whole else self.v_scale[rows]
        mask = (1 << bits) - 1
        per_lane = 5 if bits == 3 else 16 // bits
        w = p * vscale[:, :, :length].float().unsqueeze(2)  # probabilities times scales [b, H, M, length]
        n_lanes = fmt.code_bytes(D, bits) // 2
        acc = torch.zeros(b, H, M, per_lane + (bits == 3), n_lanes, dtype=torch.float32)
        for s0 in range(0, length, C):
            s1 = min(s0 + C, length)
            lanes = codes[:, :, s0:s1].view(torch.int16)  # [b, H, c, lanes]
            wc = w[..., s0:s1].to(dt)
            for j in range(per_lane):
                shift = bits * j
                if shift + bits <= 15:  # the code times 2**shift, non-negative
                    x = torch.bitwise_and(lanes, mask << shift)
                else:  # the slot holding bit 15: shift down first (int16 shifts are arithmetic)
                    x = torch.bitwise_and(lanes >> shift, mask)
                acc[:, :, :, j] += torch.matmul(wc, x.to(dt)).float()
            if bits == 3:  # the spare code's bits: bit 15 of the block's three lanes (-2**15 as int16)
                acc[:, :, :, per_lane] += torch.matmul(wc, torch.bitwise_and(lanes, -0x8000).to(dt)).float()
        factors = [2.0 ** -(bits * j) if bits * j + bits <= 15 else 1.0 for j in range(per_lane)]
        acc[:, :, :, :per_lane] *= torch.tensor(factors).view(per_lane, 1)
        if bits == 3:
            nb = D // 16
            spare = acc[:, :, :, per_lane].view(b, H, M, nb, 3) * torch.tensor([1.0, 2.0, 4.0]) * -(2.0**-15)
            regular = acc[:, :, :, :per_lane].view(b, H, M, per_lane, nb, 3).permute(0, 1, 2, 4, 5, 3)
            seq = torch.cat((regular.reshape(b, H, M, nb, 15), spare.sum(-1, keepdim=True)), -1).view(b, H, M, D)
        else:  # lane i, slot j: code i * per_lane + j
            seq = acc.transpose(-1, -2).reshape(b, H, M, D)
        mid = ((1 << bits) - 1) / 2
        return seq.sub_(w.sum(-1, keepdim=True) * mid)

    def attend(
        self, q: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, softmax_scale: float, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q [b, seqlen_q, nheads, D]`` over the first ``lens [b]`` tokens of cache
        ``rows [b]`` (causal: the queries are the last ``seqlen_q`` positions, bottom-right aligned).
        Returns out float32 ``[b, seqlen_q, nheads, D]`` and lse float32 ``[b, nheads, seqlen_q]``
        (rows without a visible key: output 0, lse +inf)."""
        b, Sq, Hq, D = q.shape
        H = self.num_kv_heads
        G = Hq // H
        length = int(lens.max()) if b else 0
        qr = self.quantizer.rotate(q)  # [b, Sq, Hq, D] float32
        qr = qr.view(b, Sq, H, G, D).permute(0, 2, 3, 1, 4).reshape(b, H, G * Sq, D)
        if length == 0:
            return q.new_zeros(b, Sq, Hq, D, dtype=torch.float32), torch.full((b, Hq, Sq), math.inf)
        s = self._scores(qr, rows, length).mul_(softmax_scale).view(b, H, G, Sq, length)
        pos = torch.arange(length)
        visible = pos.view(1, 1, length) < lens.view(b, 1, 1)  # [b, 1, length]
        if causal:  # query i sees the keys up to position lens - Sq + i
            last = lens.view(b, 1, 1) - Sq + torch.arange(Sq).view(1, Sq, 1)
            visible = visible & (pos.view(1, 1, length) <= last)  # [b, Sq, length]
        s.masked_fill_(~visible.view(b, 1, 1, -1, length), -math.inf)
        lse = torch.logsumexp(s, -1)  # [b, H, G, Sq]
        empty = lse == -math.inf
        p = s.sub_(lse.masked_fill(empty, 0.0).unsqueeze(-1)).exp_().view(b, H, G * Sq, length)
        out = self._values(p, rows, length)[..., self._order]  # element order, turned domain
        out = fwht(out) * self.quantizer.signs_on(out.device)
        out = out.view(b, H, G, Sq, D).permute(0, 3, 1, 2, 4).reshape(b, Sq, Hq, D)
        return out, lse.masked_fill(empty, math.inf).view(b, Hq, Sq)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    cache: CpuQuantizedKVCache,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Union[int, torch.Tensor, None] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Upstream's ``flash_attn_with_kvcache`` over a :class:`CpuQuantizedKVCache` (what
    :func:`flash_attn_tq.flash_attn_with_kvcache` calls for one).

    q: (batch, seqlen_q, nheads, headdim), float16/bfloat16/float32 on the CPU. k, v: (batch,
    seqlen_new, nheads_k, headdim) in q's dtype, or None, quantized into the cache at ``cache_seqlens`` (default:
    the cache's ``seqlens``) of rows ``cache_batch_idx`` first. ``num_splits`` is ignored.
    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype [, softmax_lse (batch, nheads,
    seqlen_q) float32]. Not supported (ValueError naming the argument): cache_leftpad,
    block_table, window_size, softcap, alibi_slopes.
    """
    for name, bad in (
        ("cache_leftpad", cache_leftpad is not None),
        ("block_table", block_table is not None),
        ("window_size", check_window_size(window_size) != (-1, -1)),
        ("softcap", softcap != 0.0),
        ("alibi_slopes", alibi_slopes is not None),
    ):
        if bad:
            raise ValueError(f"{name} is not supported by CpuQuantizedKVCache")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    for name, x in (("k", k), ("v", v)):  # upstream's rule, before the append below changes the cache
        if isinstance(x, torch.Tensor) and x.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    batch, seqlen_q = q.shape[:2]
    rows = cache._rows(cache_batch_idx, batch)
    start = cache._starts(cache_seqlens, rows, batch)
    n = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new k and v to be given")
        from .baseline import rotary_at

        kpos = start.unsqueeze(1) + torch.arange(n)
        k = rotary_at(k, rotary_cos, rotary_sin, kpos, rotary_interleaved).to(k.dtype)
        qpos = start.unsqueeze(1) + (torch.arange(seqlen_q) if causal else torch.zeros(seqlen_q, dtype=torch.long))
        q = rotary_at(q, rotary_cos, rotary_sin, qpos, rotary_interleaved).to(q.dtype)
    if k is not None:
        cache.append(k, v, start, rows)
    lens = start + n
    if batch and int(lens.max()) > cache.max_seqlen:
        raise ValueError(f"cache_seqlens {start.tolist()} exceed the cache's max_seqlen {cache.max_seqlen}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = cache.attend(q, rows, lens, softmax_scale, causal)
    out = out.to(q.dtype)
    return (out, lse) if return_softmax_lse else out


__all__ = ["CpuQuantizedKVCache", "flash_attn_with_kvcache"]
