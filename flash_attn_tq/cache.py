"""QuantizedKVCache: a K/V cache stored as packed low-bit codes (see :mod:`flash_attn_tq.format`)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from . import format as fmt
from . import ops
from .baseline import is_int
from .quantizers import AsymQuantizer, TurboQuantizer

QUANTIZERS = ("turbo", "asym")


def scale_only_fits(quantizer: str, grid: str, fit: str) -> bool:
    """Whether the scale alone describes a vector: turbo's uniform grid with the norm fit, whose offset
    is always ``-mid * scale`` (``scale_only``'s default)."""
    return quantizer == "turbo" and grid == "uniform" and fit == "norm"


def capturing() -> bool:
    """True while a CUDA graph is being captured or ``torch.compile`` traces: value checks that read
    the GPU back are skipped then (a traced step must not sync; its pack errors are read later)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PackErrors:
    """The pack kernel's error bits of a TQCache's layers, read back once a forward pass (one host
    sync a step instead of one a layer), e.g. by the last quantized layer of a TQCache."""

    def __init__(self):
        self.flags: torch.Tensor | None = None

    def buffer(self, device: torch.device) -> torch.Tensor:
        if self.flags is None or self.flags.device != device:
            self.flags = torch.zeros(1, dtype=torch.int32, device=device)
            torch._dynamo.mark_static_address(self.flags)  # (a compiled step's CUDA graph writes it in place)
        return self.flags

    def check(self) -> None:
        """Raise ValueError for any error bit set since the last check (and clear them)."""
        if self.flags is None or capturing():
            return
        bits = int(self.flags.item())
        if bits:
            self.flags.zero_()
            ops.raise_pack_errors(bits)


# the health counters a cache keeps (QuantizedKVCache(..., health=True)), in this order
HEALTH_COUNTERS = (
    "vectors",  # K vectors appended (as many V)
    "k_nonfinite",  # K vectors holding NaN/Inf, stored as zeros
    "v_nonfinite",
    "k_clipped",  # K elements outside the grid's range (clipped to the outermost code)
    "v_clipped",
    "k_rel_error_sum",  # sum over the K vectors of |k - k_hat| / |k|
    "v_rel_error_sum",
)


def health_reports(groups: Sequence[Sequence["QuantizedKVCache"]]) -> list[dict[str, float | None]]:
    """One report per group of caches (e.g. a layer's head groups), their counters summed; one host
    sync for all. A report: ``vectors`` appended, ``k_nonfinite`` / ``v_nonfinite`` vectors (stored as
    zeros), ``k_clipped`` / ``v_clipped`` (the fraction of elements clipped), ``k_rel_error`` /
    ``v_rel_error`` (mean relative quantization error a vector), ``sink_occupancy`` /
    ``window_occupancy`` (the mean fraction of the sink slots and of the 16-bit window filled over the
    batch; None without them)."""
    rows, shapes = [], []
    for caches in groups:
        for qc in caches:
            if qc.health_counters is None:
                raise RuntimeError("this cache keeps no health counters (QuantizedKVCache(..., health=True))")
            n = qc.seqlens.double()
            S, R = qc.sink_tokens, qc.fp16_window
            sinks = (n.clamp(max=S) / S).mean() if S else n.new_zeros(())
            window = ((n - S).clamp(min=0, max=R) / R).mean() if R else n.new_zeros(())
            rows.append(torch.cat([qc.health_counters, torch.stack([sinks, window]).to(qc.health_counters.device)]))
        shapes.append(caches)
    values = torch.stack([r.to(rows[0].device) for r in rows]).tolist() if rows else []
    reports, i = [], 0
    for caches in shapes:
        vals = values[i : i + len(caches)]
        i += len(caches)
        tot = {name: sum(v[j] for v in vals) for j, name in enumerate(HEALTH_COUNTERS)}
        per_h = [qc.num_kv_heads for qc in caches]
        occupancy = [sum(v[len(HEALTH_COUNTERS) + j] * h for v, h in zip(vals, per_h)) / sum(per_h) for j in (0, 1)]
        vectors, elements = tot["vectors"], tot["vectors"] * caches[0].head_dim
        reports.append(
            dict(
                vectors=int(vectors),
                k_nonfinite=int(tot["k_nonfinite"]),
                v_nonfinite=int(tot["v_nonfinite"]),
                k_clipped=tot["k_clipped"] / elements if elements else 0.0,
                v_clipped=tot["v_clipped"] / elements if elements else 0.0,
                k_rel_error=tot["k_rel_error_sum"] / vectors if vectors else 0.0,
                v_rel_error=tot["v_rel_error_sum"] / vectors if vectors else 0.0,
                sink_occupancy=occupancy[0] if caches[0].sink_tokens else None,
                window_occupancy=occupancy[1] if caches[0].fp16_window else None,
            )
        )
    return reports


def rope_turn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [batch, n, heads, d]`` turned by RoPE to ``positions [batch, n]`` (or ``[n]``) with
    frequencies ``inv_freq [d / 2]``, rotate-half pairs ``(i, i + d/2)`` as transformers' Llama
    (``inverse``: turned back), float32. The angles are float32 products; their cosines and sines are
    taken in float64 and rounded once, as the pack kernel takes them (exact for any angle, so both
    agree to the bit)."""
    ang = (positions.float()[..., None] * inv_freq.to(x.device).float()).double()  # [(batch,) n, d/2]
    cos, sin = ang.cos().float()[..., None, :], ang.sin().float()[..., None, :]
    sin = -sin if inverse else sin
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _storages_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory behind ``a`` and ``b`` overlaps: views of one storage, or tensors made over
    the same memory another way (e.g. DLPack), whose storages begin at different addresses."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() < sb.data_ptr() + sb.nbytes() and sb.data_ptr() < sa.data_ptr() + sa.nbytes()


def _head_major(rows: int, cols: int, heads: int, last: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros shaped ``[rows, cols, heads, last]`` stored as ``[rows, heads, cols, last]``."""
    return torch.zeros(rows, heads, cols, last, dtype=dtype, device=device).permute(0, 2, 1, 3)


# ---------------------------------------------------------------------- attention helpers (PyTorch)


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
    """float32 attention of q ``[B, Sq, Hq, D]`` over a short 16-bit key set k, v ``[B, S, Hkv, D]``
    (the fp16 window, sink tokens); ``visible`` bool, broadcastable to ``[B, Sq, S]``. GQA through a
    view (no repeated K/V). Returns out ``[B, Sq, Hq, D]``, lse ``[B, Hq, Sq]`` (-inf: no key)."""
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
    """Attention of q over a recent window of ``cache.window_bits`` codes (positions [lens - R, lens),
    dequantized here) of cache rows bidx (None: 0..batch-1). causal: the queries are the last
    seqlen_q positions, bottom-right aligned with the window's newest key. Returns (out, lse) with
    lse -inf for rows without keys."""
    R, Sq = cache.fp16_window, q.shape[1]
    rows = slice(0, q.shape[0]) if bidx is None else cache.row_index(bidx)  # (a slice: no copy of the whole window)
    kw, vw = cache.window_kv(rows)  # ring order: attention does not care, the mask does
    n = lens.long().unsqueeze(1)
    age = (n - 1 - torch.arange(R, device=q.device)) % R  # [B, R]: 0 = the newest token's slot
    if cache.rope_center:  # keys back from k - R(p) c (slots without a token get garbage: masked below)
        ridx = torch.arange(q.shape[0], device=q.device) if bidx is None else rows
        kw = cache.untransform_keys(kw, ridx, positions=n - 1 - age)
    # slots holding a token past the sinks (those are attended from the side)
    visible = ((age < n) & (n - 1 - age >= cache.sink_tokens)).unsqueeze(1)  # [B, 1, R]
    if causal and Sq > 1:  # query i (of Sq, bottom-right aligned) sees tokens at least Sq - 1 - i old
        visible = visible & (age.unsqueeze(1) >= (Sq - 1 - torch.arange(Sq, device=q.device)).view(1, Sq, 1))
    return dense_attention(q, kw, vw, softmax_scale, visible)


def as_seqlens(cache_seqlens):
    """``cache_seqlens`` as a cache call takes it: None, an int (numpy integers too) or a tensor."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    if is_int(cache_seqlens):
        return int(cache_seqlens)
    raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got {type(cache_seqlens).__name__}")


class QuantizedKVCache:
    """A per-layer K/V cache holding ``k_bits``/``v_bits``-bit codes plus float16 (scale, offset).

    Contiguous layout (default): ``k_codes [batch, max_seqlen, kv_heads, code_bytes]`` uint8 and ``k_meta [batch,
    max_seqlen, kv_heads, 2]`` float16 (scale, offset) (same for v). ``scale_only`` (default: on where the offset is
    always ``-mid * scale``, i.e. turbo with the uniform grid and ``fit="norm"``) stores ``[..., 1]``, the scale
    alone: the same values, 16 bits a vector less (3-bit codes: 3.25 bits/element at head_dim 64, 3.125 at 128), and
    a faster prefill kernel. Paged layout (``page_size`` given): ``k_codes [num_blocks, page_size, kv_heads,
    code_bytes]`` with ``block_table [batch, max_blocks_per_seq]`` int32 mapping each sequence's pages to blocks
    (default: sequence ``b`` owns blocks ``b * max_blocks_per_seq ...``). In memory the four tensors are head-major
    (views of ``[rows, kv_heads, cols, *]`` storage): a head's consecutive tokens are adjacent, so the decode kernel
    reads whole sectors (1.1-1.2x faster than token-major on the H200, where 48-byte code rows of neighbouring heads
    shared sectors).

    Bit widths: 2, 3 or 4, and 8 (one code a byte: the near-exact keys :class:`TQCache` gives the few
    heads copying rests on; uniform grid only; fused decode kernels K8V3 / K8V8).

    ``seqlens [batch]`` int32 counts the tokens written per sequence. With ``fp16_window = R > 0``
    the most recent ``R`` tokens of each sequence are also kept unquantized (``k_window [batch, R,
    kv_heads, head_dim]`` in ``dtype``, token ``p`` in slot ``p % R``) and attention reads them in
    full precision; every token is still quantized when written. ``sink_tokens = S`` keeps the first
    ``S`` tokens of each sequence unquantized too (attention sinks: the tokens most heads put much
    weight on). Sinks and the 16-bit window share one tensor, ``kv_side [2, batch, S + R + 1,
    kv_heads, head_dim]`` (K and V; sink ``p`` in slot ``p``, window token ``p`` in slot
    ``S + p % R``; the last slot takes the writes of tokens that are neither), which the fused
    decode kernel attends in the same launch as the codes (its side pass), so the codes are read
    for positions ``[S, seqlen - R)`` only. ``window_bits`` (2, 3, 4 or 8; default 16:
    the window in ``dtype``) stores the window as codes at that width instead (age-based precision:
    the recent tokens at 4 bits, the older ones at ``k_bits``/``v_bits``), ``k_window [batch, R,
    kv_heads, window code bytes]`` uint8 + ``k_window_meta [batch, R, kv_heads, *]`` float16, with the
    main codes' quantizer; attention dequantizes those ``R`` tokens when it reads them.

    For ``quantizer="turbo"`` codes live in the Hadamard-rotated space; :meth:`rotate_query` and
    :meth:`unrotate_output` move queries and attention outputs in and out of it.

    **Key centering** (``key_center=True``): keys are stored as ``k - mu``, ``mu`` the per-(sequence,
    kv head) mean key of the first chunk a sequence appends (its prompt; :meth:`calibrate`, then fixed;
    a first chunk shorter than ``calib_min_tokens`` leaves ``mu = 0``). ``q . (k - mu) = q . k - q . mu``,
    a shift shared by every key of a query, so the softmax (and the output) is unchanged while the
    quantizer sees keys without their common offset (RoPE keys carry a large one); the returned
    ``softmax_lse`` adds ``q . mu`` back. Storage: one float32 ``[batch, kv_heads, head_dim]`` tensor.

    ``key_center='rope'`` (with ``rope_inv_freq``, the model's ``head_dim / 2`` RoPE frequencies,
    rotate-half pairs as transformers' Llama): keys are stored as ``k - R(p) c``, ``c`` the first
    chunk's mean key turned back by RoPE (``R(-p) k``) and ``R(p)`` RoPE at the key's cache position
    ``p`` plus ``rope_position_offset``. RoPE turns a key's constant part with its position, so a
    post-RoPE mean only matches near the prompt; this center matches at every position (SmolLM2, 3K
    tokens from the prompt: 2-7x less key energy to code). Each score then lacks a different
    ``q . R(p) c``, which the fused kernels add back (csrc/flash_attn/src/tq_rope_center.h: the decode
    kernel per score; the prefill kernel's Hopper variant, from 256 query rows a kv head, into the
    expanded keys; window_size / softcap / cache_leftpad and pages of fewer than 32 tokens take the
    reference path); the sinks and the 16-bit window hold the keys as they came (no term).

    **Health counters** (``health=True``): each append also counts, on the device and without a host
    sync, the vectors written, those holding NaN/Inf (stored as zeros instead of raising), the
    elements the codes clipped (outside the grid's range) and the sum of each vector's relative
    quantization error ``|x - x_hat| / |x|`` (the codec run again in PyTorch on the appended
    vectors: a few more kernels an append, for monitoring). :meth:`health` reads them with one sync.
    """

    def __init__(
        self,
        batch_size: int,
        max_seqlen: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        k_bits: int = 3,
        v_bits: int = 3,
        quantizer: str = "turbo",
        grid: str = "uniform",
        fp16_window: int = 0,
        window_bits: int = 16,
        sink_tokens: int = 0,
        page_size: int | None = None,
        num_blocks: int | None = None,
        block_table: torch.Tensor | None = None,
        streaming: bool = False,
        alpha: float = 0.95,
        seed: int = 0,
        fit: str = "norm",
        key_center: bool | str = False,
        rope_inv_freq: torch.Tensor | Sequence[float] | None = None,
        rope_position_offset: int = 0,
        calib_min_tokens: int = 16,
        scale_only: bool | None = None,
        health: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ):
        if quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
        counts = dict(batch_size=batch_size, max_seqlen=max_seqlen, num_kv_heads=num_kv_heads, head_dim=head_dim)
        counts.update(k_bits=k_bits, v_bits=v_bits, fp16_window=fp16_window, window_bits=window_bits)
        counts.update(sink_tokens=sink_tokens, seed=seed, rope_position_offset=rope_position_offset)
        counts.update(calib_min_tokens=calib_min_tokens)
        counts.update({} if page_size is None else dict(page_size=page_size))
        counts.update({} if num_blocks is None else dict(num_blocks=num_blocks))
        for name, val in counts.items():
            if not is_int(val):
                raise TypeError(f"{name} must be an int, got {val!r}")
        for name, val in (("batch_size", batch_size), ("max_seqlen", max_seqlen), ("num_kv_heads", num_kv_heads)):
            if int(val) <= 0:
                raise ValueError(f"{name} must be positive, got {val}")
        if head_dim % 32 or (quantizer == "turbo" and head_dim & (head_dim - 1)):
            raise ValueError(f"head_dim must be a multiple of 32 (a power of two for turbo), got {head_dim}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        if fp16_window < 0:
            raise ValueError(f"fp16_window must be >= 0, got {fp16_window}")
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        if calib_min_tokens < 0:
            raise ValueError(f"calib_min_tokens must be >= 0, got {calib_min_tokens}")
        if scale_only is not None and not isinstance(scale_only, bool):
            raise TypeError(f"scale_only must be True, False or None (the quantizer's choice), got {scale_only!r}")
        for name, val in (("k_bits", k_bits), ("v_bits", v_bits)):
            if val not in fmt.SUPPORTED_BITS:
                raise ValueError(f"{name} must be one of {fmt.SUPPORTED_BITS}, got {val}")
        if window_bits not in (*fmt.SUPPORTED_BITS, 16):
            raise ValueError(f"window_bits must be one of {fmt.SUPPORTED_BITS} or 16, got {window_bits}")
        if window_bits != 16 and not fp16_window:
            raise ValueError(f"window_bits={window_bits} sets the width of the recent window: give fp16_window > 0 too")
        self.batch_size, self.max_seqlen = int(batch_size), int(max_seqlen)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.k_bits, self.v_bits, self.quantizer, self.grid = k_bits, v_bits, quantizer, grid
        self.fp16_window, self.seed, self.dtype = int(fp16_window), seed, dtype
        self.window_bits = int(window_bits)
        self.sink_tokens = int(sink_tokens)
        self.streaming, self.alpha, self.fit = streaming, alpha, fit
        if key_center not in (False, True, "rope"):
            raise ValueError(f"key_center must be True, False or 'rope', got {key_center!r}")
        self.rope_center = key_center == "rope"
        self.rope_inv_freq, self.rope_position_offset = None, int(rope_position_offset)
        if self.rope_center:
            if rope_inv_freq is None:
                raise ValueError("key_center='rope' needs rope_inv_freq (the model's RoPE frequencies, head_dim / 2)")
            inv = torch.as_tensor(rope_inv_freq, dtype=torch.float32)
            if inv.dim() != 1 or inv.numel() != head_dim // 2 or not bool(torch.isfinite(inv).all()):
                raise ValueError(
                    f"rope_inv_freq must hold head_dim / 2 = {head_dim // 2} finite values (1-D), got shape "
                    f"{tuple(inv.shape)} ({int(torch.isfinite(inv).sum())} finite)"
                )
            self.rope_inv_freq = inv.to(device)
        elif rope_inv_freq is not None:
            raise ValueError("rope_inv_freq is only used with key_center='rope'")
        self.key_center, self.calib_min_tokens = bool(key_center), int(calib_min_tokens)
        norm_fit = scale_only_fits(quantizer, grid, fit)
        self.scale_only = norm_fit if scale_only is None else bool(scale_only)
        if self.scale_only and not norm_fit:
            raise ValueError(
                "scale_only needs quantizer='turbo', grid='uniform' and fit='norm' (whose offset is "
                "-mid * scale, so only the scale is stored)"
            )
        if quantizer == "turbo" and streaming:
            raise ValueError("streaming applies to quantizer='asym' only")
        if quantizer != "turbo" and grid != "uniform":
            raise ValueError("quantizer='asym' uses the uniform grid only")
        if grid != "uniform" and 8 in (k_bits, v_bits, window_bits):
            raise ValueError("8-bit codes use the uniform grid (grid='uniform')")
        if quantizer != "turbo" and fit != "norm":
            raise ValueError("fit applies to quantizer='turbo' only")

        def make_quantizer(bits: int, streams: bool):
            if quantizer == "turbo":
                return TurboQuantizer(head_dim, bits, grid, seed, fit)
            return AsymQuantizer(bits, streams, alpha)

        self.k_quantizer, self.v_quantizer = make_quantizer(k_bits, streaming), make_quantizer(v_bits, streaming)
        # a quantized recent window: per-token fits (no streaming range), the same rotation as the main codes
        self.window_quantizer = make_quantizer(self.window_bits, False) if self.window_bits < 16 else None
        device = torch.device(device)
        H = self.num_kv_heads
        kb, vb = fmt.code_bytes(head_dim, k_bits), fmt.code_bytes(head_dim, v_bits)
        self.page_size = page_size
        if page_size is None:
            if num_blocks is not None or block_table is not None:
                raise ValueError("num_blocks/block_table need page_size (the paged layout)")
            rows, cols = self.batch_size, self.max_seqlen
            self.block_table = None
        else:
            if page_size <= 0:
                raise ValueError(f"page_size must be positive, got {page_size}")
            per_seq = math.ceil(self.max_seqlen / page_size)
            if block_table is None:
                nb = num_blocks if num_blocks is not None else self.batch_size * per_seq
                if nb < self.batch_size * per_seq:
                    raise ValueError(
                        f"num_blocks={nb} is fewer than batch_size * ceil(max_seqlen / page_size) = "
                        f"{self.batch_size * per_seq}; pass a block_table to share blocks"
                    )
                block_table = torch.arange(self.batch_size * per_seq, dtype=torch.int32).reshape(
                    self.batch_size, per_seq
                )
            else:
                if (
                    block_table.dtype != torch.int32
                    or block_table.dim() != 2
                    or block_table.shape[0] != self.batch_size
                ):
                    raise ValueError(
                        f"block_table must be int32 [batch_size={self.batch_size}, max_blocks_per_seq], "
                        f"got {block_table.dtype} {tuple(block_table.shape)}"
                    )
                if block_table.shape[1] * page_size < self.max_seqlen:
                    raise ValueError(
                        f"block_table has {block_table.shape[1]} pages of {page_size} per sequence, "
                        f"fewer than max_seqlen={self.max_seqlen}"
                    )
                nb = num_blocks if num_blocks is not None else int(block_table.max()) + 1
            if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= nb):
                raise ValueError(f"block_table entries must lie in [0, num_blocks={nb})")
            self.block_table = block_table.to(device)
            rows, cols = nb, page_size
        self.k_codes = _head_major(rows, cols, H, kb, torch.uint8, device)
        self.v_codes = _head_major(rows, cols, H, vb, torch.uint8, device)
        meta_words = 1 if self.scale_only else 2
        self.k_meta = _head_major(rows, cols, H, meta_words, torch.float16, device)
        self.v_meta = _head_major(rows, cols, H, meta_words, torch.float16, device)
        self.seqlens = torch.zeros(self.batch_size, dtype=torch.int32, device=device)
        self._pack_tally = torch.zeros(1, dtype=torch.int32, device=device)  # (the pack kernel's, see write_codes)
        R = self.fp16_window
        # the 16-bit side: sinks + the 16-bit window (+ one slot for the writes of other tokens)
        self.side_ring = R if self.window_quantizer is None else 0
        side = self.sink_tokens + self.side_ring
        self.kv_side = (
            torch.zeros(2, self.batch_size, side + 1, H, head_dim, dtype=dtype, device=device) if side else None
        )
        self.k_window_codes = self.v_window_codes = self.k_window_meta = self.v_window_meta = None
        if R and self.window_quantizer is not None:
            wb = fmt.code_bytes(head_dim, self.window_bits)
            self.k_window_codes = torch.zeros(self.batch_size, R, H, wb, dtype=torch.uint8, device=device)
            self.v_window_codes = torch.zeros_like(self.k_window_codes)
            self.k_window_meta = torch.zeros(self.batch_size, R, H, meta_words, dtype=torch.float16, device=device)
            self.v_window_meta = torch.zeros_like(self.k_window_meta)
        nan = torch.full((self.batch_size, H), float("nan"), device=device)
        self.k_range = nan.clone() if streaming else None  # asym streaming: per-head EMA of max|x|
        self.v_range = nan.clone() if streaming else None
        if self.key_center:
            self.k_shift = torch.zeros(self.batch_size, H, head_dim, device=device)
            self.calibrated = torch.zeros(self.batch_size, dtype=torch.bool, device=device)
        else:
            self.k_shift = self.calibrated = None
        self._calibration_done = False
        # health counters (float64 [len(HEALTH_COUNTERS)] on the device; None: not kept)
        self.health_counters = torch.zeros(len(HEALTH_COUNTERS), dtype=torch.float64, device=device) if health else None

    # ------------------------------------------------------------------ properties
    @property
    def kv_side(self) -> torch.Tensor | None:
        """Sinks and the 16-bit window: ``[2 (k, v), batch, sink_tokens + side_ring + 1, kv_heads, d]``
        (the last slot takes the writes of other tokens); None without either."""
        return self._kv_side

    @kv_side.setter
    def kv_side(self, side: torch.Tensor | None) -> None:
        self._kv_side = side
        self._side_pair = None if side is None else side.unbind(0)  # (views, made here: not a host op a call)

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def k_side(self) -> torch.Tensor | None:
        """The 16-bit keys ``[batch, sink_tokens + side_ring, kv_heads, d]`` (sinks, then the window's
        ring): raw with ``key_center='rope'`` (the kernel adds the center's term to the codes' scores
        only), else as the codes' keys before quantization (``(k - mu) / s``)."""
        return None if self.kv_side is None else self.kv_side[0, :, :-1]

    @property
    def v_side(self) -> torch.Tensor | None:
        """The 16-bit values, as :attr:`k_side`."""
        return None if self.kv_side is None else self.kv_side[1, :, :-1]

    @property
    def k_window(self) -> torch.Tensor | None:
        """The recent window's keys: ``[batch, R, kv_heads, d]`` 16-bit (a view of :attr:`kv_side`), or
        ``window_bits`` codes ``[batch, R, kv_heads, bytes]``; None without a window."""
        if self.window_quantizer is not None:
            return self.k_window_codes
        return None if not self.fp16_window else self.kv_side[0, :, self.sink_tokens : -1]

    @property
    def v_window(self) -> torch.Tensor | None:
        if self.window_quantizer is not None:
            return self.v_window_codes
        return None if not self.fp16_window else self.kv_side[1, :, self.sink_tokens : -1]

    @property
    def nbytes(self) -> int:
        """Bytes of the cache storage (codes, metadata and the recent window)."""
        tensors = [
            self.k_codes,
            self.v_codes,
            self.k_meta,
            self.v_meta,
            self.kv_side,
            self.k_window_codes,
            self.v_window_codes,
            self.k_window_meta,
            self.v_window_meta,
        ]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache a kernel call takes, its quantizers' device constants created now:
        what a captured CUDA graph may read in place (``TQCache`` marks them static for
        ``torch.compile``, which would otherwise copy the unmarked ones in at every replay)."""
        if self.quantizer == "turbo":
            for qz in (self.k_quantizer, self.v_quantizer):
                qz.signs_on(self.device)
                qz.codebook(self.device)
        out = []
        for owner in [self] + [o for o in vars(self).values() if hasattr(o, "__dict__")]:
            for value in vars(owner).values():
                items = value.values() if isinstance(value, dict) else (value,)  # (the quantizers' device copies)
                out += [t for t in items if isinstance(t, torch.Tensor)]
        return out

    def bits_per_element(self) -> float:
        """Average bits per stored K/V element (codes + metadata, window excluded)."""
        mb = 2 if self.scale_only else 4
        return (
            fmt.bits_per_element(self.head_dim, self.k_bits, mb) + fmt.bits_per_element(self.head_dim, self.v_bits, mb)
        ) / 2

    def compression_ratio(self) -> float:
        """fp16 bytes of a cache of the same capacity divided by :attr:`nbytes`."""
        slots = self.k_codes.shape[0] * self.k_codes.shape[1]
        return 2 * slots * self.num_kv_heads * self.head_dim * 2 / self.nbytes

    # ------------------------------------------------------------------ domain changes
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """Move queries into the codes' domain (Hadamard rotation for turbo; identity for asym).

        One float32 GEMM with the cached rotation matrix. The fused kernel rotates by itself; this is
        for code working on :meth:`dequantize` ``(rotated=True)`` values."""
        if self.quantizer == "turbo":
            return (q.float() @ self.k_quantizer.rotation_matrix(q.device)).to(q.dtype)
        return q

    def unrotate_output(self, o: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rotate_query` for attention outputs (V's rotation)."""
        if self.quantizer == "turbo":
            return (o.float() @ self.v_quantizer.rotation_matrix(o.device).T).to(o.dtype)
        return o

    # ------------------------------------------------------------------ key transform
    def calibrate(
        self,
        k: torch.Tensor,
        batch_idx: torch.Tensor | None = None,
        force: bool = False,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Set the key center of rows ``batch_idx`` from ``k [batch, n, kv_heads, d]`` (rows already
        calibrated are left alone unless ``force``). Called by :meth:`append` on a row's first chunk.
        ``positions [batch, n]``: the keys' cache positions (``key_center='rope'``: the center is the
        mean of the keys turned back by RoPE)."""
        if not self.key_center:
            return
        self._check_new("k", k, check_values=True)  # (a NaN here would poison every later score of the rows)
        B, n = k.shape[:2]
        bidx = torch.arange(B, device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
        if bidx.shape != (B,) or (B and (int(bidx.min()) < 0 or int(bidx.max()) >= self.batch_size)):
            raise ValueError(f"batch_idx must hold {B} indices in [0, {self.batch_size})")
        todo = torch.ones(B, dtype=torch.bool, device=self.device) if force else ~self.calibrated[bidx]
        if not bool(todo.any()):
            return
        shift = torch.zeros(B, self.num_kv_heads, self.head_dim, device=self.device)
        if n >= self.calib_min_tokens:
            kf = k.float()
            if self.rope_center:
                shift = self._rope_turn(kf, self._positions(positions, k), inverse=True).mean(1)
            else:
                shift = kf.mean(1)
        rows = bidx[todo]
        self.k_shift[rows] = shift[todo]
        self.calibrated[rows] = True

    def _positions(self, positions: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        if positions is None or tuple(positions.shape) != tuple(k.shape[:2]):
            raise ValueError(
                f"positions: key_center='rope' centers keys by position, so it needs their cache "
                f"positions [batch, n] = {tuple(k.shape[:2])}"
            )
        return positions.to(self.device)

    def _rope_turn(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x [batch, n, kv_heads, d]`` turned by RoPE (rotate-half pairs ``(i, i + d/2)``, as
        transformers' Llama) to ``positions [batch, n]`` plus ``rope_position_offset`` (float32)."""
        return rope_turn(x, positions.float() + self.rope_position_offset, self.rope_inv_freq, inverse)

    def key_center_at(self, batch_idx: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """What key centering subtracts from keys at ``positions [batch, n]`` of rows ``batch_idx``:
        ``mu`` (``[batch, 1, kv_heads, d]``), or for ``key_center='rope'`` ``R(p) c``
        (``[batch, n, kv_heads, d]``), float32."""
        B = positions.shape[0] if positions is not None else len(batch_idx)
        c = self._per_row(self.k_shift, batch_idx, B)[:, None]
        if not self.rope_center:
            return c
        return self._rope_turn(c.expand(B, positions.shape[1], *c.shape[2:]), positions.to(self.device))

    def transform_keys(
        self, k: torch.Tensor, batch_idx: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Keys ``[batch, n, kv_heads, d]`` of rows ``batch_idx`` as the codes store them (same dtype):
        ``k - mu``, or for ``key_center='rope'`` ``k - R(p) c`` at cache ``positions [batch, n]``."""
        if not self.key_center:
            return k
        bidx = torch.arange(k.shape[0], device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
        positions = self._positions(positions, k) if self.rope_center else positions
        return (k.float() - self.key_center_at(bidx, positions)).to(k.dtype)

    def untransform_keys(
        self, kt: torch.Tensor, batch_idx: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inverse of :meth:`transform_keys` (float32)."""
        if not self.key_center:
            return kt.float()
        bidx = torch.arange(kt.shape[0], device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
        positions = self._positions(positions, kt) if self.rope_center else positions
        return kt.float() + self.key_center_at(bidx, positions)

    def query_shift(self, q: torch.Tensor, batch_idx: torch.Tensor | None = None) -> torch.Tensor:
        """``q . mu`` ``[batch, heads, seqlen_q]``: what the key centering removes from every score."""
        if self.rope_center:
            raise ValueError("key_center='rope' removes a different q . R(p) c from each score: no shared shift")
        B, Sq, H, D = q.shape
        mu = self._per_row(self.k_shift, batch_idx, B)  # [b, kv_heads, d]
        return torch.einsum("bshgd,bhd->bhgs", q.float().reshape(B, Sq, self.num_kv_heads, -1, D), mu).reshape(B, H, Sq)

    def _per_row(self, table: torch.Tensor, batch_idx: torch.Tensor | None, batch: int) -> torch.Tensor:
        """Rows ``batch_idx`` of a per-sequence table (rows 0..batch-1 by default: the table itself or a
        slice, no gather)."""
        if batch_idx is None:
            return table if batch == table.shape[0] else table[:batch]  # (a slice is a host op a call)
        return table[self.row_index(batch_idx)]

    def row_index(self, batch_idx: torch.Tensor) -> torch.Tensor:
        """``batch_idx [batch]`` as int64 cache rows to gather with, clamped into ``[0, batch_size)``: a GPU
        index is not checked (that would sync), and the kernels turn the output rows of one outside the
        cache to NaN."""
        return batch_idx.to(self.device).long().clamp(0, self.batch_size - 1)

    # ------------------------------------------------------------------ writing
    def _slots(self, batch_idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and columns of ``k_codes`` holding token ``pos`` of sequence ``batch_idx``."""
        if not self.paged:
            return batch_idx, pos
        block = self.block_table[batch_idx, torch.div(pos, self.page_size, rounding_mode="floor")].long()
        return block, pos % self.page_size

    def quantize(
        self, k: torch.Tensor, v: torch.Tensor, batch_idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Reference quantization of ``k, v [batch, n, kv_heads, d]`` (no state change in non-streaming mode).

        In streaming mode the per-(sequence, head) ranges of cache rows ``batch_idx`` (default
        ``0..batch-1``) are used and updated.
        """
        out = {}
        if self.streaming:
            bidx = (
                torch.arange(k.shape[0], device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
            )
        for name, x, qz, rng in (("k", k, self.k_quantizer, "k_range"), ("v", v, self.v_quantizer, "v_range")):
            if self.streaming:
                ranges = getattr(self, rng)
                codes, meta, new_range = qz.quantize(x, ranges[bidx])
                ranges[bidx] = new_range.to(ranges.dtype)
            else:
                codes, meta = qz.quantize(x)
            bits = self.k_bits if name == "k" else self.v_bits
            out[f"{name}_codes"] = fmt.pack_codes(codes, bits, check=False)  # (a quantizer's codes: in range)
            out[f"{name}_meta"] = meta[..., :1] if self.scale_only else meta  # (the offset is -mid * scale)
        return out

    def check_new_kv(self, k: torch.Tensor, v: torch.Tensor, check_values: bool = True) -> None:
        for name, x in (("k", k), ("v", v)):
            self._check_new(name, x, check_values=False)
        if v.dtype != k.dtype:  # (upstream's rule: both have q's dtype; without q, each other's)
            raise TypeError(f"v must have the same dtype as k ({k.dtype}), got {v.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if check_values:
            for name, x in (("k", k), ("v", v)):
                self._check_values(name, x)

    def _check_new(self, name: str, x: torch.Tensor, check_values: bool) -> None:
        """One of the new ``k`` / ``v``: type, shape, dtype, device and (``check_values``: one read) values."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor")
        if x.dim() != 4 or x.shape[2] != self.num_kv_heads or x.shape[3] != self.head_dim:
            raise ValueError(
                f"{name} must be [batch, seqlen_new, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}], got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the cache is on {self.device}")
        if check_values:
            self._check_values(name, x)

    def _check_values(self, name: str, x: torch.Tensor) -> None:
        """New ``k`` / ``v`` values (one read; none inside CUDA-graph capture): finite, within float16."""
        if not capturing() and x.numel():
            peak = float(x.detach().abs().amax())  # (NaN propagates: one read for both checks)
            if not math.isfinite(peak):
                raise ValueError(f"{name} contains NaN or Inf: a quantized cache cannot store them")
            if peak > torch.finfo(torch.float16).max:  # (the codes' scales are float16)
                raise ValueError(
                    f"{name} holds values beyond float16's range (|x| up to {peak:.3g}): the cache's "
                    "float16 scales cannot store them"
                )

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache_seqlens: torch.Tensor | int | None = None,
        batch_idx: torch.Tensor | None = None,
        error_flags: torch.Tensor | None = None,
    ) -> None:
        """Quantize ``k, v [batch, n, kv_heads, d]`` and write them at positions ``cache_seqlens ...``.

        ``cache_seqlens`` (int or int32 ``[batch]``) defaults to :attr:`seqlens`; ``batch_idx``
        (``[batch]``) selects which cache rows the batch entries go to (default ``0..batch-1``).
        Afterwards ``seqlens[batch_idx] = cache_seqlens + n``.

        On the GPU the pack kernel resolves the slots and checks positions, batch indices and values
        itself, and (key_center='rope', a 16-bit side in the new keys' dtype) centers the keys and
        copies sinks and recent tokens into :attr:`kv_side` in the same launch; the call then reads
        back one flag word (one sync; none inside CUDA-graph capture,
        where nothing is checked) and raises ValueError for NaN/Inf values or a cache overflow.
        ``error_flags`` (int32 ``[1]`` on the cache's device): the kernel ORs its error bits into it
        and the call does not read it back; the caller checks later, e.g. once for all the layers
        of a forward pass (:func:`flash_attn_tq.ops.raise_pack_errors`), saving a sync a call.
        """
        fused = isinstance(k, torch.Tensor) and self.pack_reason(k) is None
        self.check_new_kv(k, v, check_values=not fused and self.health_counters is None)
        if self.health_counters is not None:
            k, v = self._screen(k, v)
        if error_flags is not None and (
            not isinstance(error_flags, torch.Tensor)
            or error_flags.dtype != torch.int32
            or error_flags.numel() != 1
            or error_flags.device.type != self.device.type
        ):
            raise ValueError(f"error_flags must be an int32 [1] tensor on the cache's device ({self.device})")
        for name, x in (("cache_seqlens", cache_seqlens), ("batch_idx", batch_idx)):
            if isinstance(x, torch.Tensor) and (
                x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool
            ):
                raise TypeError(f"{name} must hold integers (int32), got {x.dtype}")
        cache_seqlens = as_seqlens(cache_seqlens)
        B, n = k.shape[:2]
        checking = B > 0 and not capturing()
        bidx = None  # the rows as a tensor (with batch_idx None: 0..B-1, made where a step needs it)

        def rows() -> torch.Tensor:
            nonlocal bidx
            if bidx is None:
                bidx = torch.arange(B, device=self.device)
            return bidx

        if batch_idx is None:
            if B > self.batch_size:
                raise ValueError(f"batch {B} exceeds the cache's batch_size {self.batch_size}")
        else:
            bidx = batch_idx.to(self.device).long()
            if bidx.shape != (B,):
                raise ValueError(
                    f"batch_idx must be 1-D, {B} indices in [0, {self.batch_size}), got {tuple(bidx.shape)}"
                )
            # (the kernel checks them too, but calibration and the key/value transforms index rows first)
            host_check = not fused or self.key_center
            if checking and host_check and (int(bidx.min()) < 0 or int(bidx.max()) >= self.batch_size):
                raise ValueError(f"batch_idx must hold {B} indices in [0, {self.batch_size})")
            if checking and host_check and n and bidx.unique().numel() != B:
                raise ValueError("batch_idx must not repeat a row (each row takes one sequence's tokens)")
            if fused:  # the kernel flags bad indices; gathers below must not fault on them
                bidx = bidx.clamp(0, self.batch_size - 1)
        if isinstance(cache_seqlens, int):
            if cache_seqlens < 0 or cache_seqlens + n > self.max_seqlen:
                raise ValueError(f"cache overflow: cache_seqlens + {n} new tokens exceeds max_seqlen={self.max_seqlen}")
            start = torch.full((B,), cache_seqlens, dtype=torch.int32, device=self.device)
        else:
            if cache_seqlens is None:
                start = self.seqlens[:B] if batch_idx is None else self.seqlens[bidx]  # (a view: updated last)
            else:
                start = cache_seqlens.to(self.device, torch.int32)
            if start.shape != (B,):
                raise ValueError(f"cache_seqlens must be an int or a [batch={B}] tensor, got {tuple(start.shape)}")
            if checking and not fused and (int(start.min()) < 0 or int(start.max()) + n > self.max_seqlen):
                raise ValueError(f"cache overflow: cache_seqlens + {n} new tokens exceeds max_seqlen={self.max_seqlen}")
        if n == 0:
            return
        k_raw = k
        # What the pack kernel does besides the codes: the ring of window codes (4-bit, turbo's uniform
        # grid, contiguous caches), the RoPE center's k - R(p) c (where no PyTorch step needs the centered
        # keys) and the 16-bit side's copy (raw keys with the RoPE center)
        coded_window = self.window_quantizer is not None and bool(self.fp16_window)
        kernel_ring = (
            fused
            and coded_window
            and self.window_bits == ops.FUSED_RING_WINDOW_BITS
            and (self.quantizer, self.grid, self.fit) == ("turbo", "uniform", "norm")
            and not self.paged
        )
        kernel_rope = fused and self.rope_center and self.health_counters is None and (not coded_window or kernel_ring)
        kernel_side = (
            fused
            and self.kv_side is not None
            and self.kv_side.dtype == k.dtype
            and (kernel_rope or not self.rope_center)
        )
        calibrating = self.key_center and not self._calibration_done and not capturing()  # (no GPU sync once done)
        needs_pos = (
            not fused
            or (self.kv_side is not None and not kernel_side)
            or (coded_window and not kernel_ring)
            or (self.rope_center and (calibrating or not kernel_rope))
        )
        pos = start.long().unsqueeze(1) + torch.arange(n, device=self.device) if needs_pos else None  # [B, n]
        if self.key_center:
            if calibrating:
                skip = min(n, max(0, self.sink_tokens - int(start.min()))) if self.sink_tokens else 0  # not the sinks
                self.calibrate(k[:, skip:], rows(), positions=pos[:, skip:] if self.rope_center else None)
                self._calibration_done = bool(self.calibrated.all())
            if not kernel_rope:
                k = self.transform_keys(k, rows(), positions=pos if self.rope_center else None)
        if self.health_counters is not None:
            self._observe(k, v, rows())
        # the kernel also advances seqlens, unless start is a caller's tensor whose memory may overlap
        # them (a row could be read after another row moved)
        advance = fused and (
            not isinstance(cache_seqlens, torch.Tensor)
            or (not torch.compiler.is_compiling() and not _storages_overlap(start, self.seqlens))
        )
        if fused:  # quantize-on-write kernel: slots, range and value checks on the GPU
            flags = torch.zeros(1, dtype=torch.int32, device=self.device) if error_flags is None else error_flags
            raw_idx = None if batch_idx is None else batch_idx.to(self.device, torch.int32).contiguous()
            self.write_codes(
                k,
                v,
                start.contiguous(),
                raw_idx,
                flags,
                side=kernel_side,
                rope_center=kernel_rope,
                advance=advance,
                ring=kernel_ring,
            )
            if checking and error_flags is None:
                ops.raise_pack_errors(int(flags.item()))
        if not fused:
            slot_rows, slot_cols = self._slots(rows().unsqueeze(1).expand(B, n), pos)
            packed = self.quantize(k, v, rows())
            for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
                getattr(self, name)[slot_rows, slot_cols] = packed[name]
        if self.kv_side is not None and not kernel_side:
            self._write_side(k_raw if self.rope_center else k, v, rows(), pos)
        if coded_window and not kernel_ring:
            R = self.fp16_window
            j0 = max(0, n - R)  # only the last R tokens of this chunk matter (a slice: no sync)
            b2 = rows().unsqueeze(1).expand(B, n - j0)
            slots = pos[:, j0:] % R
            for name, x in (("k", k), ("v", v)):
                codes, meta = self.window_quantizer.quantize(x[:, j0:].float())
                getattr(self, f"{name}_window_codes")[b2, slots] = fmt.pack_codes(codes, self.window_bits, check=False)
                getattr(self, f"{name}_window_meta")[b2, slots] = meta[..., : self.k_window_meta.shape[-1]]
        if advance:
            return
        if batch_idx is not None:
            self.seqlens[bidx] = start + n
        elif cache_seqlens is None:  # start is seqlens[:B] itself: one in-place add
            self.seqlens[:B] += n
        else:
            self.seqlens[:B] = start + n

    # ------------------------------------------------------------------ health counters
    def _screen(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` with vectors holding NaN/Inf set to zero, counted (health counters on)."""
        c = self.health_counters
        c[0] += k.shape[0] * k.shape[1] * k.shape[2]
        out = []
        for i, x in enumerate((k, v)):
            bad = ~torch.isfinite(x).all(-1, keepdim=True)
            c[1 + i] += bad.sum()
            out.append(x.masked_fill(bad, 0))
        return out[0], out[1]

    def _observe(self, k: torch.Tensor, v: torch.Tensor, bidx: torch.Tensor) -> None:
        """Count clipped elements and sum relative errors of ``k`` (codes domain), ``v`` as written."""
        c = self.health_counters
        for i, (x, qz, rng) in enumerate(((k, self.k_quantizer, self.k_range), (v, self.v_quantizer, self.v_range))):
            if self.streaming:  # (the ranges as the write will use them; their update is the write's)
                codes, meta, _ = qz.quantize(x, rng[bidx])
            else:
                codes, meta = qz.quantize(x)
            xr = qz.rotate(x) if self.quantizer == "turbo" else x.float()
            err = qz.dequantize_rotated(codes, meta) - xr
            norm = xr.norm(dim=-1)
            c[3 + i] += qz.clipped(xr, codes, meta).sum()
            c[5 + i] += torch.where(norm > 0, err.norm(dim=-1) / norm.clamp(min=1e-30), 0.0).sum()

    def health(self) -> dict[str, float | None]:
        """The health counters (``health=True``) as numbers, one host sync; see :func:`health_reports`."""
        return health_reports([[self]])[0]

    def reset_health(self) -> None:
        """Zero the health counters (``health=True``)."""
        if self.health_counters is None:
            raise RuntimeError("this cache keeps no health counters (QuantizedKVCache(..., health=True))")
        self.health_counters.zero_()

    def _write_side(self, k: torch.Tensor, v: torch.Tensor, bidx: torch.Tensor, pos: torch.Tensor) -> None:
        """Copy the chunk's sinks and its last ``side_ring`` tokens (``[B, n, kv_heads, d]`` at cache
        positions ``pos [B, n]`` of rows ``bidx``) into :attr:`kv_side`, one scatter and no sync: sink
        ``p`` to slot ``p``, window token ``p`` to slot ``S + p % R``; the chunk's first tokens that
        turn out not to be sinks go to the spare last slot."""
        n, S, R = k.shape[1], self.sink_tokens, self.side_ring
        m, j0 = min(n, S), max(0, n - R)  # the first m tokens may be sinks, tokens from j0 are the window's
        if j0 <= m:  # one run: the whole chunk, window tokens from j0
            cols, kv, ring_from = pos, torch.stack([k, v]), j0
        else:  # two runs
            cols = torch.cat([pos[:, :m], pos[:, j0:]], 1)
            kv = torch.stack([torch.cat([k[:, :m], k[:, j0:]], 1), torch.cat([v[:, :m], v[:, j0:]], 1)])
            ring_from = m
        spare = self.kv_side.shape[2] - 1
        slots = S + cols % R if R else torch.full_like(cols, spare)
        if R and ring_from:
            slots = torch.where(torch.arange(cols.shape[1], device=cols.device) >= ring_from, slots, spare)
        slots = torch.where(cols < S, cols, slots) if S else slots
        self.kv_side[:, bidx.unsqueeze(1).expand_as(cols), slots] = kv.to(self.dtype)

    def pack_reason(self, x: torch.Tensor) -> str | None:
        """None if the quantize-on-write kernel can write ``x`` into this cache, else why not."""
        return ops.pack_reason(x, self.head_dim, self.quantizer, self.grid, self.fit, self.streaming)

    def write_codes(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        start: torch.Tensor,
        batch_idx: torch.Tensor | None = None,
        error_flags: torch.Tensor | None = None,
        side: bool = False,
        rope_center: bool = False,
        advance: bool = False,
        ring: bool = False,
    ) -> None:
        """The quantize-on-write kernel: ``k, v [batch, n, kv_heads, d]`` into positions ``start[i] + j``
        (int32 ``[batch]``) of cache rows ``batch_idx`` (int32, None: 0..batch-1); keys already in the
        codes' domain (transformed), or raw with ``rope_center`` (the kernel subtracts ``R(p) c``).
        ``side``: the kernel also copies sinks and the chunk's recent tokens into :attr:`kv_side` (k and
        v as given, k's dtype the side's). ``advance``: the launch ends by setting ``seqlens[row] =
        start[i] + n`` unless it met an error (``start`` may be a view of ``seqlens``, but no other
        tensor sharing its memory: rows may be read after another row's update). ``ring``: the chunk's
        last ``fp16_window`` tokens also into the window codes (``window_bits``), from the same
        vectors as the codes. Error bits go to ``error_flags`` (int32 [1]; see
        :data:`flash_attn_tq.ops.PACK_ERRORS`)."""
        quant = ops.QUANT_IDS[(self.quantizer, self.grid, self.fit)]
        extras = {}
        if rope_center:
            extras.update(
                rope_center=self.k_shift, rope_inv_freq=self.rope_inv_freq, rope_offset=self.rope_position_offset
            )
        if ring:
            extras.update(
                ring=dict(
                    k_codes=self.k_window_codes,
                    k_meta=self.k_window_meta,
                    v_codes=self.v_window_codes,
                    v_meta=self.v_window_meta,
                ),
                ring_bits=self.window_bits,
            )
        turbo, lloyd = self.quantizer == "turbo", self.quantizer == "turbo" and self.grid == "lloyd_max"
        kq, vq = self.k_quantizer, self.v_quantizer
        ops.pack(  # K and V in one launch
            k,
            self.k_codes,
            self.k_meta,
            start,
            batch_idx,
            self.block_table,
            error_flags,
            self.max_seqlen,
            self.k_bits,
            quant,
            kq.signs_on(k.device) if turbo else None,
            kq.codebook(k.device) if lloyd else None,
            side=self.kv_side[0] if side else None,
            side_sinks=self.sink_tokens,
            side_ring=self.side_ring,
            v=v,
            v_codes=self.v_codes,
            v_meta=self.v_meta,
            v_bits=self.v_bits,
            v_signs=vq.signs_on(v.device) if turbo else None,
            v_levels=vq.codebook(v.device) if lloyd else None,
            v_side=self.kv_side[1] if side else None,
            lengths=self.seqlens if advance else None,
            tally=self._pack_tally if advance else None,
            **extras,
        )

    # ------------------------------------------------------------------ attention (the fused kernels)
    def fused_reason(self, q: torch.Tensor) -> str | None:
        """None if the fused kernels can attend ``q`` over this cache, else the reason they cannot."""
        return ops.fused_decode_reason(
            q, self.head_dim, self.k_bits, self.v_bits, self.grid, self.rope_center, self.page_size
        )

    # options two head groups attended by one launch must share (their bits and kv heads may differ)
    _PAIR_SHARED = (
        "batch_size",
        "max_seqlen",
        "head_dim",
        "quantizer",
        "grid",
        "fit",
        "seed",
        "scale_only",
        "fp16_window",
        "window_bits",
        "sink_tokens",
        "key_center",
        "rope_center",
        "rope_position_offset",
        "dtype",
    )

    def pair_reason(self, other: "QuantizedKVCache", q: torch.Tensor) -> str | None:
        """None if one launch can attend ``q`` over this cache's kv heads and ``other``'s, a second head
        group of the same layer built with the same options but its bits (:meth:`attend`'s ``group2``;
        the launch takes this cache's RoPE frequencies), else the reason it cannot."""
        reason = self.fused_reason(q) or other.fused_reason(q)
        if reason is not None:
            return reason
        if ((self.k_bits, self.v_bits), (other.k_bits, other.v_bits)) not in ops.FUSED_PAIR_BITS:
            return f"no one-launch kernel for K{self.k_bits}V{self.v_bits} beside K{other.k_bits}V{other.v_bits}"
        diff = [name for name in self._PAIR_SHARED if getattr(self, name) != getattr(other, name)]
        if diff:
            return f"the head groups' caches differ in {diff[0]}"
        if not self.scale_only or self.paged or self.kv_side is None or self.window_bits != 16:
            return "one launch takes contiguous caches with scale-only metadata and a 16-bit side"
        if self.key_center and not self.rope_center:
            return "post-RoPE key centering (its lse shift is a head group's own)"
        heads = self.num_kv_heads + other.num_kv_heads
        if q.dim() != 4 or q.shape[2] % heads or q.shape[2] // heads * q.shape[1] >= ops.PREFILL_MIN_ROWS:
            return "one launch takes decode-sized calls (fewer query rows a kv head than the prefill kernel's)"
        return None

    def ring_reason(self, q: torch.Tensor) -> str | None:
        """None if the decode launch itself can attend ``q`` over this cache's ring of window codes
        (``window_bits``), else why the ring keeps a pass of its own."""
        if self.window_quantizer is None or not self.fp16_window:
            return "no ring of window codes"
        if self.window_bits != ops.FUSED_RING_WINDOW_BITS or (self.k_bits, self.v_bits) not in ops.FUSED_RING_BITS:
            return (
                f"no ring kernel for {self.window_bits}-bit window codes beside K{self.k_bits}V{self.v_bits} "
                f"({ops.FUSED_RING_WINDOW_BITS}-bit beside {ops.FUSED_RING_BITS})"
            )
        if not self.scale_only or self.paged or self.kv_side is None:
            return "the ring's kernel takes contiguous caches with scale-only metadata and sink tokens"
        if q.dim() != 4 or q.shape[2] // self.num_kv_heads * q.shape[1] >= ops.PREFILL_MIN_ROWS:
            return "prefill-sized chunks attend the ring in a pass of their own"
        return None

    def kernel_args(self, batch: int, batch_idx: torch.Tensor | None = None) -> dict[str, Any]:
        """The cache's tensors and options as :func:`flash_attn_tq.ops.decode` takes them, for a batch of
        ``batch`` sequences, cache rows ``batch_idx`` (int32 ``[batch]``; None: 0..batch-1)."""
        args: dict[str, Any] = dict(
            k_codes=self.k_codes,
            k_meta=self.k_meta,
            v_codes=self.v_codes,
            v_meta=self.v_meta,
            k_bits=self.k_bits,
            v_bits=self.v_bits,
            block_table=self.block_table,
            codes_tail=self.fp16_window,
        )
        if self.quantizer == "turbo":
            args["rot_signs"] = self.k_quantizer.signs_on(self.device)
        if self.rope_center:  # the kernel adds each score's q . R(p) c back
            args.update(
                rope_center=self._per_row(self.k_shift, batch_idx, batch),  # (float32 rows: a slice or a gather)
                rope_inv_freq=self.rope_inv_freq,
                rope_offset=self.rope_position_offset,
            )
        if self.kv_side is not None:  # sinks and the 16-bit window, in the same launch
            # (eager: the views made with kv_side; traced: split in the graph, so that no two inputs of a
            # compiled step alias the tensor its pack kernel writes)
            side_k, side_v = self.kv_side.unbind(0) if torch.compiler.is_compiling() else self._side_pair
            args.update(side_k=side_k, side_v=side_v, side_sinks=self.sink_tokens, side_ring=self.side_ring)
        return args

    def attend(
        self,
        q: torch.Tensor,
        seqlens: torch.Tensor,
        batch_idx: torch.Tensor | None,
        softmax_scale: float,
        causal: bool,
        num_splits: int = 0,
        window_size: tuple[int, int] = (-1, -1),
        leftpad: torch.Tensor | None = None,
        softcap: float = 0.0,
        with_lse: bool = True,
        group2: tuple["QuantizedKVCache", int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernels' attention of ``q [batch, seqlen_q, heads, d]`` over cache rows ``batch_idx``
        holding ``seqlens [batch]`` tokens: the decode kernel over the codes and the 16-bit side, a
        window of codes' own pass. Returns (out like q, lse ``[batch, heads, seqlen_q]``;
        ``with_lse=False`` skips the key centering's lse shift).

        ``group2 = (other, head)``: ``other`` holds the layer's kv heads ``[head, head + its kv heads)``
        and this cache the others, in order; ``q`` and the output hold the layer's query heads, and
        one launch attends both (where :meth:`pair_reason` allows it)."""
        extra = {}
        if group2 is not None:
            other, head = group2
            extra = dict(group2=other.kernel_args(q.shape[0], batch_idx), group2_head=head)
        fused_ring = group2 is None and tuple(window_size) == (-1, -1) and leftpad is None and not softcap
        fused_ring = fused_ring and self.ring_reason(q) is None
        if fused_ring:  # the recent tokens' codes in the decode launch
            extra["ring"] = dict(
                k_codes=self.k_window_codes,
                k_meta=self.k_window_meta,
                v_codes=self.v_window_codes,
                v_meta=self.v_window_meta,
            )
        out, lse = ops.decode(
            q,
            seqlens,
            batch_idx,
            softmax_scale,
            causal,
            num_splits,
            window_size,
            leftpad,
            softcap,
            **self.kernel_args(q.shape[0], batch_idx),
            **extra,
        )
        if self.fp16_window and self.window_quantizer is not None and not fused_ring:  # the ring's own pass
            out_w, lse_w = window_attention(q, self, batch_idx, seqlens, softmax_scale, causal)
            out, lse = merge_lse(out, lse, out_w, lse_w)
        if self.key_center and not self.rope_center and with_lse:
            lse = lse + softmax_scale * self.query_shift(q, batch_idx)  # the scores lost q . mu (+inf stays +inf)
        return (out if out.dtype == q.dtype else out.to(q.dtype)), lse

    # ------------------------------------------------------------------ reading
    def gather(self, batch_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Codes and meta as contiguous ``[batch, max_seqlen, kv_heads, *]`` (copies for paged caches)."""
        bidx = torch.arange(self.batch_size, device=self.device) if batch_idx is None else batch_idx.long()
        if not self.paged:
            return {n: getattr(self, n)[bidx] for n in ("k_codes", "v_codes", "k_meta", "v_meta")}
        pos = torch.arange(self.max_seqlen, device=self.device)
        rows, cols = self._slots(bidx.unsqueeze(1).expand(-1, self.max_seqlen), pos.expand(bidx.numel(), -1))
        return {n: getattr(self, n)[rows, cols] for n in ("k_codes", "v_codes", "k_meta", "v_meta")}

    def dequantize(
        self, batch_idx: torch.Tensor | None = None, rotated: bool = False, use_window: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(k, v)`` ``[batch, max_seqlen, kv_heads, d]`` as attention sees them.

        Positions at or beyond ``seqlens`` are zero. With an fp16 window the last ``fp16_window``
        tokens come from the window, and the sinks from theirs (``use_window=False`` shows their
        quantized values instead).
        ``rotated=True`` returns turbo values in the rotated domain (with key centering: of the
        centered keys; otherwise keys are returned in their original domain).
        """
        bidx = (
            torch.arange(self.batch_size, device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
        )
        g = self.gather(bidx)
        d = self.head_dim
        out = []
        coded_window = use_window and self.fp16_window and self.window_quantizer is not None
        windows = self.window_kv(bidx, rotated=True) if coded_window else (None, None)
        side = self._side_values(bidx, rotated) if use_window and self.kv_side is not None else None
        for name, qz, bits, w in (
            ("k", self.k_quantizer, self.k_bits, windows[0]),
            ("v", self.v_quantizer, self.v_bits, windows[1]),
        ):
            codes = fmt.unpack_codes(g[f"{name}_codes"], bits, d)
            x = qz.dequantize_rotated(codes, g[f"{name}_meta"])
            lens = self.seqlens[bidx].long().unsqueeze(1)
            pos = torch.arange(self.max_seqlen, device=self.device).unsqueeze(0)
            if w is not None:
                R = self.fp16_window
                idx = (pos % R).expand(len(bidx), -1)[:, :, None, None].expand_as(x)
                in_win = (pos >= lens - R) & (pos < lens)
                x = torch.where(in_win[:, :, None, None], w.gather(1, idx), x)
            if not rotated and self.quantizer == "turbo":
                x = qz.unrotate(x)
            if name == "k" and self.key_center and not rotated:
                x = self.untransform_keys(x, bidx, positions=pos.expand(len(bidx), -1))
            if side is not None:
                x = torch.where(side[0][:, :, None, None], side[1 if name == "k" else 2], x)
            out.append(x * (pos < lens)[:, :, None, None])
        return out[0], out[1]

    def _side_values(self, bidx: torch.Tensor, rotated: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 16-bit side at every position of rows ``bidx``: (bool ``[b, max_seqlen]`` where a
        position is attended from it, its keys and values ``[b, max_seqlen, kv_heads, d]`` float32 in
        :meth:`dequantize`'s domain)."""
        S, R, L = self.sink_tokens, self.side_ring, self.max_seqlen
        pos = torch.arange(L, device=self.device).unsqueeze(0)
        lens = self.seqlens[bidx].long().unsqueeze(1)
        used = (pos < lens) & ((pos < S) | ((pos >= lens - R) if R else torch.zeros_like(pos, dtype=torch.bool)))
        src = torch.where(pos < S, pos, S + pos % R if R else torch.zeros_like(pos)).expand(len(bidx), -1)
        idx = src[:, :, None, None].expand(-1, -1, self.num_kv_heads, self.head_dim)
        k, v = (self.kv_side[i][bidx].float().gather(1, idx) for i in (0, 1))
        positions = pos.expand(len(bidx), -1)
        if rotated:  # the codes' domain: centered keys, turbo's rotation
            if self.rope_center:
                k = self.transform_keys(k, bidx, positions=positions)
            if self.quantizer == "turbo":
                k, v = self.k_quantizer.rotate(k), self.v_quantizer.rotate(v)
        elif self.key_center and not self.rope_center:
            k = self.untransform_keys(k, bidx, positions=positions)
        return used, k, v

    def window_kv(self, rows: torch.Tensor | slice, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(k, v)`` ``[rows, fp16_window, kv_heads, d]`` of the recent window of cache ``rows``
        (ring order: token ``p`` in slot ``p % fp16_window``), as stored (see :attr:`k_side`);
        ``rotated=True``: turbo's rotated domain. A quantized window (``window_bits``) is dequantized
        here (its keys in the codes' domain)."""
        out = []
        for win, meta, qz in (
            (self.k_window, self.k_window_meta, self.k_quantizer),
            (self.v_window, self.v_window_meta, self.v_quantizer),
        ):
            if self.window_quantizer is None:
                x = win[rows].float()
                out.append(qz.rotate(x) if rotated and self.quantizer == "turbo" else x)
            else:
                wq = self.window_quantizer
                x = wq.dequantize_rotated(fmt.unpack_codes(win[rows], self.window_bits, self.head_dim), meta[rows])
                if not rotated and self.quantizer == "turbo":  # rotate(x) = x @ M, M orthonormal: one GEMM back
                    x = x @ wq.rotation_matrix(x.device).T
                out.append(x)
        return out[0], out[1]

    # ------------------------------------------------------------------ movement / serialization
    _TENSORS = (
        "k_codes",
        "v_codes",
        "k_meta",
        "v_meta",
        "seqlens",
        "kv_side",
        "k_window_codes",
        "v_window_codes",
        "k_window_meta",
        "v_window_meta",
        "block_table",
        "k_range",
        "v_range",
        "k_shift",
        "calibrated",
        "rope_inv_freq",
        "health_counters",
    )

    def to(self, device: torch.device | str) -> "QuantizedKVCache":
        """Move every tensor of the cache to ``device`` (in place); returns self."""
        for name in self._TENSORS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        self._pack_tally = self._pack_tally.to(device)
        return self

    def config(self) -> dict[str, Any]:
        return dict(
            batch_size=self.batch_size,
            max_seqlen=self.max_seqlen,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            k_bits=self.k_bits,
            v_bits=self.v_bits,
            quantizer=self.quantizer,
            grid=self.grid,
            fp16_window=self.fp16_window,
            window_bits=self.window_bits,
            sink_tokens=self.sink_tokens,
            page_size=self.page_size,
            num_blocks=self.k_codes.shape[0] if self.paged else None,
            streaming=self.streaming,
            alpha=self.alpha,
            seed=self.seed,
            fit=self.fit,
            key_center="rope" if self.rope_center else self.key_center,
            rope_inv_freq=None if self.rope_inv_freq is None else self.rope_inv_freq.tolist(),
            rope_position_offset=self.rope_position_offset,
            calib_min_tokens=self.calib_min_tokens,
            scale_only=self.scale_only,
            health=self.health_counters is not None,
            dtype=str(self.dtype).replace("torch.", ""),
        )

    def state_dict(self) -> dict[str, Any]:
        sd = {name: getattr(self, name) for name in self._TENSORS if getattr(self, name) is not None}
        sd["config"] = self.config()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.config()
        theirs = dict(state["config"])
        for key, default in (
            ("fit", "norm"),
            ("key_center", False),
            ("rope_inv_freq", None),
            ("rope_position_offset", 0),
            ("calib_min_tokens", 16),
            ("scale_only", False),
            ("window_bits", 16),
            ("sink_tokens", 0),
            ("health", False),
        ):
            theirs.setdefault(key, default)  # saved before the option existed
        for key, off in (("key_scale", 0.0), ("key_scale_q", False), ("key_pca", False), ("value_pca", False)):
            if theirs.get(key, off) == off:  # options a cache no longer has, saved switched off
                theirs.pop(key, None)
        if mine != theirs:
            diff = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
            raise ValueError(f"state_dict was saved from a cache with another configuration: {diff}")
        for name in self._TENSORS:
            if name in state:
                getattr(self, name).copy_(state[name])
        if "kv_side" not in state and "k_window" in state and self.window_quantizer is None:  # saved without sinks
            self.k_window.copy_(state["k_window"])
            self.v_window.copy_(state["v_window"])
        self._calibration_done = False  # re-read from `calibrated` on the next append

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device | str = "cpu") -> "QuantizedKVCache":
        cfg = dict(state["config"])
        cfg["dtype"] = getattr(torch, cfg["dtype"])
        bt = state.get("block_table")
        cache = cls(**cfg, block_table=bt.cpu() if bt is not None else None, device=device)
        cache.load_state_dict(state)
        return cache

    def __repr__(self) -> str:
        layout = (
            f"paged(page_size={self.page_size}, num_blocks={self.k_codes.shape[0]})" if self.paged else "contiguous"
        )
        return (
            f"QuantizedKVCache({self.quantizer}/{self.grid}, K{self.k_bits}V{self.v_bits}, batch={self.batch_size}, "
            f"max_seqlen={self.max_seqlen}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {layout}, "
            f"fp16_window={self.fp16_window}{'' if self.window_quantizer is None else f' at {self.window_bits} bits'}, "
            f"sink_tokens={self.sink_tokens}, "
            f"{self.bits_per_element():.3f} bits/element, device={self.device})"
        )
