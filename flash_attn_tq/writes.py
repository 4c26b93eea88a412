"""Writing into a quantized cache: :func:`append` (quantize-on-write, on the GPU by the pack kernel or
by PyTorch where :func:`flash_attn_tq.dispatch.write_plan` says so), the 16-bit side's copies, the
ring of window codes, and what a rollback (an append or :func:`crop` below a row's length) restores
in the recent-token slots."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import format as fmt
from . import ops
from .kernel_cases import PACK_QUANTIZERS
from .spec import is_int
from .storage import slots, storages_overlap

if TYPE_CHECKING:  # (annotations only: the cache imports this module)
    from .cache import QuantizedKVCache

NEW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def as_seqlens(cache_seqlens):
    """``cache_seqlens`` as a cache call takes it: None, an int (numpy integers too) or a tensor."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    if is_int(cache_seqlens):
        return int(cache_seqlens)
    raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got {type(cache_seqlens).__name__}")


def check_new(cache: "QuantizedKVCache", name: str, x, check_values: bool) -> None:
    """One of the new ``k`` / ``v``: type, shape, dtype, device and (``check_values``: one read) values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor")
    if x.dim() != 4 or x.shape[2] != cache.num_kv_heads or x.shape[3] != cache.head_dim:
        raise ValueError(
            f"{name} must be [batch, seqlen_new, kv_heads={cache.num_kv_heads}, "
            f"head_dim={cache.head_dim}], got {tuple(x.shape)}"
        )
    if x.dtype not in NEW_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device} but the cache is on {cache.device}")
    if check_values and not ops.capturing() and x.numel():
        peak = float(x.detach().abs().amax())  # (NaN propagates: one read for both checks)
        if not math.isfinite(peak):
            raise ValueError(f"{name} contains NaN or Inf: a quantized cache cannot store them")
        if peak > torch.finfo(torch.float16).max:  # (the codes' scales are float16)
            raise ValueError(
                f"{name} holds values beyond float16's range (|x| up to {peak:.3g}): the cache's "
                "float16 scales cannot store them"
            )


def check_new_kv(cache: "QuantizedKVCache", k, v, check_values: bool = True) -> None:
    """New ``k`` and ``v``: each as :func:`check_new`, of one dtype and shape, then (one read each) values."""
    for name, x in (("k", k), ("v", v)):
        check_new(cache, name, x, check_values=False)
    if v.dtype != k.dtype:  # (upstream's rule: both have q's dtype; without q, each other's)
        raise TypeError(f"v must have the same dtype as k ({k.dtype}), got {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if check_values:
        for name, x in (("k", k), ("v", v)):
            check_new(cache, name, x, check_values=True)


def quantize(
    cache: "QuantizedKVCache", k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Reference quantization of ``k, v [batch, n, kv_heads, d]`` of cache ``rows`` (streaming mode:
    their running ranges are used and updated)."""
    out = {}
    for name, x, qz, rng in (("k", k, cache.k_quantizer, cache.k_range), ("v", v, cache.v_quantizer, cache.v_range)):
        if cache.spec.streaming:
            codes, meta, new_range = qz.quantize(x, rng[rows])
            rng[rows] = new_range.to(rng.dtype)
        else:
            codes, meta = qz.quantize(x)
        bits = cache.k_bits if name == "k" else cache.v_bits
        out[f"{name}_codes"] = fmt.pack_codes(codes, bits, check=False)  # (a quantizer's codes: in range)
        out[f"{name}_meta"] = meta[..., :1] if cache.scale_only else meta  # (the offset is -mid * scale)
    return out


def write_side(
    cache: "QuantizedKVCache", k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
) -> None:
    """Copy the chunk's sinks and its last ``side_recent`` tokens (``[B, n, kv_heads, d]`` at cache
    positions ``pos [B, n]`` of ``rows``) into the 16-bit side, one scatter and no sync: sink ``p`` to
    slot ``p``, window token ``p`` to slot ``S + p % R``; the chunk's first tokens that turn out not to
    be sinks go to the spare last slot."""
    n, S, R = k.shape[1], cache.sink_tokens, cache.side_recent
    m, j0 = min(n, S), max(0, n - R)  # the first m tokens may be sinks, tokens from j0 are the window's
    if j0 <= m:  # one run: the whole chunk, window tokens from j0
        cols, kv, ring_from = pos, torch.stack([k, v]), j0
    else:  # two runs
        cols = torch.cat([pos[:, :m], pos[:, j0:]], 1)
        kv = torch.stack([torch.cat([k[:, :m], k[:, j0:]], 1), torch.cat([v[:, :m], v[:, j0:]], 1)])
        ring_from = m
    spare = cache.kv_side.shape[2] - 1
    slot = S + cols % R if R else torch.full_like(cols, spare)
    if R and ring_from:
        slot = torch.where(torch.arange(cols.shape[1], device=cols.device) >= ring_from, slot, spare)
    slot = torch.where(cols < S, cols, slot) if S else slot
    cache.kv_side[:, rows.unsqueeze(1).expand_as(cols), slot] = kv.to(cache.dtype)


def write_window_codes(
    cache: "QuantizedKVCache", k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
) -> None:
    """The chunk's last ``fp16_window`` tokens (keys in the codes' domain) into the ring of window codes."""
    R, n = cache.fp16_window, k.shape[1]
    j0 = max(0, n - R)  # only the last R tokens of this chunk matter (a slice: no sync)
    r2 = rows.unsqueeze(1).expand(k.shape[0], n - j0)
    slot = pos[:, j0:] % R
    for name, x in (("k", k), ("v", v)):
        codes, meta = cache.window_quantizer.quantize(x[:, j0:].float())
        getattr(cache, f"{name}_window_codes")[r2, slot] = fmt.pack_codes(codes, cache.window_bits, check=False)
        getattr(cache, f"{name}_window_meta")[r2, slot] = meta[..., : cache.spec.meta_words]


def restore_recent(
    cache: "QuantizedKVCache", rows: torch.Tensor, old_len: torch.Tensor, start: torch.Tensor, n: int
) -> None:
    """After a rollback (``n`` tokens written at ``start`` below a row's old length ``old_len``), the
    recent-token slots of positions ``[start + n - R, start)`` were overwritten by later, discarded
    tokens wherever such a position is older than ``old_len - R``: those slots get the position's value
    back from its codes (the codes hold every token). No sync: rows without a rollback write their
    slots' own values back."""
    for R, side in ((cache.side_recent, True), (cache.fp16_window if cache.window_quantizer else 0, False)):
        if R <= n:
            continue
        p = start.long().unsqueeze(1) + (n - R) + torch.arange(R - n, device=cache.device)  # [B, R - n]
        stale = (p >= cache.sink_tokens) & (p >= 0) & (p < old_len.long().unsqueeze(1) - R)
        p = p.clamp(min=0)
        r2 = rows.unsqueeze(1).expand_as(p)
        sr, sc = slots(cache.block_table, cache.page_size, r2, p.clamp(max=cache.max_seqlen - 1))
        k, v = [
            qz.unrotate(
                qz.dequantize_rotated(
                    fmt.unpack_codes(getattr(cache, f"{x}_codes")[sr, sc], bits, cache.head_dim),
                    getattr(cache, f"{x}_meta")[sr, sc],
                )
            )
            if cache.quantizer == "turbo"
            else qz.dequantize(
                fmt.unpack_codes(getattr(cache, f"{x}_codes")[sr, sc], bits, cache.head_dim),
                getattr(cache, f"{x}_meta")[sr, sc],
            )
            for x, qz, bits in (("k", cache.k_quantizer, cache.k_bits), ("v", cache.v_quantizer, cache.v_bits))
        ]
        keep = stale[..., None, None]
        if side:  # the side holds raw keys with the RoPE center, else the codes' (centered) keys
            if cache.rope_center:
                k = cache.keys.untransform(k, rows, p)
            slot = cache.sink_tokens + p % R
            for i, x in ((0, k), (1, v)):
                old = cache.kv_side[i, r2, slot]
                cache.kv_side[i, r2, slot] = torch.where(keep, x.to(cache.dtype), old)
        else:
            slot = p % R
            for name, x in (("k", k), ("v", v)):
                codes, meta = cache.window_quantizer.quantize(x)
                wc, wm = getattr(cache, f"{name}_window_codes"), getattr(cache, f"{name}_window_meta")
                wc[r2, slot] = torch.where(keep, fmt.pack_codes(codes, cache.window_bits, check=False), wc[r2, slot])
                wm[r2, slot] = torch.where(keep, meta[..., : cache.spec.meta_words], wm[r2, slot])


def _rings(cache: "QuantizedKVCache") -> list[tuple[int, int, list[torch.Tensor]]]:
    """The recent-token rings: (slots R, first slot, tensors ``[rows, slots, ...]``): the 16-bit
    side's (position ``p`` in slot ``sink_tokens + p % R``) and the window codes' (``p % R``)."""
    out = []
    if cache.kv_side is not None and cache.side_recent:
        out.append((cache.side_recent, cache.sink_tokens, [cache.kv_side[0], cache.kv_side[1]]))
    if cache.window_quantizer is not None:
        names = ("k_window_codes", "v_window_codes", "k_window_meta", "v_window_meta")
        out.append((cache.fp16_window, 0, [getattr(cache, name) for name in names]))
    return out


def keep_overwritten(cache: "QuantizedKVCache", rows: torch.Tensor | None, start: torch.Tensor, n: int) -> None:
    """Before an append of ``n`` > 1 tokens at ``start [B]`` of ``rows [B]`` (None: 0..B-1): what the
    recent slots it writes hold, kept until the next append or crop. A crop straight after it
    (assisted generation rejecting drafts) gives the kept tokens the dropped ones displaced back exactly
    (:func:`restore_overwritten`), where :func:`restore_recent` can only decode them from their codes.
    Not kept for single tokens (decode steps never crop), for chunks longer than a ring (the tokens
    they displace are older than any crop of them keeps in it), or in a traced step."""
    cache.overwritten = None
    if n < 2 or ops.capturing():  # (a decode step: nothing made, no launch)
        return
    if rows is None:
        rows = torch.arange(start.shape[0], device=cache.device)
    saved = []
    for ring, (R, first, tensors) in enumerate(_rings(cache)):
        if n > R:
            continue
        p = start.long().unsqueeze(1) + torch.arange(n, device=cache.device)  # [B, n] positions written
        r2, slot = rows.unsqueeze(1).expand_as(p), first + p % R
        saved.append((ring, p, r2, slot, [t[r2, slot].clone() for t in tensors]))
    cache.overwritten = saved or None


def restore_overwritten(cache: "QuantizedKVCache") -> None:
    """After a crop (the rows' new lengths in ``seqlens``): each slot that the last append wrote for a
    dropped position gets back what it held before, where that was a position the rows keep."""
    saved, cache.overwritten = cache.overwritten, None
    if saved is None:
        return
    rings = _rings(cache)
    for ring, p, r2, slot, values in saved:
        R, _, tensors = rings[ring]
        new = cache.seqlens[r2[:, 0]].long().unsqueeze(1)
        before = p - R  # the position the slot held before the append (chunks up to R tokens)
        back = (p >= new) & (before >= new - R) & (before < new) & (before >= cache.sink_tokens)
        for t, old in zip(tensors, values):
            mask = back.view(*back.shape, *([1] * (old.dim() - 2)))
            t[r2, slot] = torch.where(mask, old, t[r2, slot])


def pack_stores(cache: "QuantizedKVCache", side: bool, ring: bool) -> list[ops.Store]:
    """The stores one pack launch writes: the codes, and the 16-bit side / the ring of window codes."""
    stores = [
        ops.Store(ops.CODES, (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta), 0, cache.k_bits, cache.v_bits)
    ]
    if side:
        stores.append(
            ops.Store(ops.SIDE, (cache.kv_side[0], cache.kv_side[1]), a=cache.sink_tokens, b=cache.side_recent)
        )
    if ring:
        window = (cache.k_window_codes, cache.k_window_meta, cache.v_window_codes, cache.v_window_meta)
        stores.append(ops.Store(ops.WINDOW, window, 0, cache.window_bits, cache.window_bits))
    return stores


def append(
    cache: "QuantizedKVCache", k, v, cache_seqlens=None, batch_idx=None, error_flags=None, *, rows_checked=False
) -> None:
    """:meth:`QuantizedKVCache.append`. ``rows_checked``: ``batch_idx`` is known to hold distinct rows
    of the cache (a varlen plan's), so it is not read back to check."""
    plan = cache.write_plan(k.dtype) if isinstance(k, torch.Tensor) else None
    fused = plan is not None and plan.kernel
    check_new_kv(cache, k, v, check_values=not fused and cache.health_counters is None)
    if cache.health_counters is not None:
        k, v = cache.screen(k, v)
    if error_flags is not None and (
        not isinstance(error_flags, torch.Tensor)
        or error_flags.dtype != torch.int32
        or error_flags.numel() != 1
        or error_flags.device.type != cache.device.type
    ):
        raise ValueError(f"error_flags must be an int32 [1] tensor on the cache's device ({cache.device})")
    for name, x in (("cache_seqlens", cache_seqlens), ("batch_idx", batch_idx)):
        if isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            raise TypeError(f"{name} must hold integers (int32), got {x.dtype}")
    cache_seqlens = as_seqlens(cache_seqlens)
    B, n = k.shape[:2]
    checking = B > 0 and not ops.capturing()
    rows = None  # the rows as an int64 tensor (batch_idx None: 0..B-1, made where a step needs it)
    if batch_idx is None:
        if B > cache.batch_size:
            raise ValueError(f"batch {B} exceeds the cache's batch_size {cache.batch_size}")
    else:
        rows = batch_idx.to(cache.device).long()
        if rows.shape != (B,):
            raise ValueError(f"batch_idx must be 1-D, {B} indices in [0, {cache.batch_size}), got {tuple(rows.shape)}")
        # (the kernel checks them too, but calibration and the key/value transforms index rows first)
        host_check = (not fused or cache.key_center) and not rows_checked
        if checking and host_check and (int(rows.min()) < 0 or int(rows.max()) >= cache.batch_size):
            raise ValueError(f"batch_idx must hold {B} indices in [0, {cache.batch_size})")
        if checking and host_check and n and rows.unique().numel() != B:
            raise ValueError("batch_idx must not repeat a row (each row takes one sequence's tokens)")
        if fused:  # the kernel flags bad indices; gathers below must not fault on them
            rows = rows.clamp(0, cache.batch_size - 1)
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0 or cache_seqlens + n > cache.max_seqlen:
            raise ValueError(f"cache overflow: cache_seqlens + {n} new tokens exceeds max_seqlen={cache.max_seqlen}")
        start = torch.full((B,), cache_seqlens, dtype=torch.int32, device=cache.device)
    else:
        if cache_seqlens is None:
            start = cache.seqlens[:B] if batch_idx is None else cache.seqlens[rows]  # (a view: updated last)
        else:
            start = cache_seqlens.to(cache.device, torch.int32)
        if start.shape != (B,):
            raise ValueError(f"cache_seqlens must be an int or a [batch={B}] tensor, got {tuple(start.shape)}")
        if checking and not fused and (int(start.min()) < 0 or int(start.max()) + n > cache.max_seqlen):
            raise ValueError(f"cache overflow: cache_seqlens + {n} new tokens exceeds max_seqlen={cache.max_seqlen}")
    if cache_seqlens is not None and B and (cache.side_recent or cache.window_quantizer is not None):
        # a rollback (start below a row's length) leaves recent slots holding discarded tokens
        rows = torch.arange(B, device=cache.device) if rows is None else rows
        old = cache.seqlens[rows]
        if ops.capturing() or bool((start < old).any()):
            restore_recent(cache, rows, old, start, n)
    keep_overwritten(cache, rows, start, n)
    if n == 0:
        return
    _write(cache, k, v, start, rows, batch_idx, cache_seqlens, error_flags, plan if fused else None, checking)


def _write(cache, k, v, start, rows, batch_idx, cache_seqlens, error_flags, plan, checking) -> None:
    """The writes of a checked append: key transform, codes, side, window codes, lengths."""
    B, n = k.shape[:2]
    fused = plan is not None
    side_k = k  # (the 16-bit side holds raw keys with the RoPE center)
    kernel_side, kernel_rope, kernel_ring = (plan.side, plan.rope, plan.ring) if fused else (False, False, False)
    keys = cache.keys
    calibrating = keys.enabled and not keys.done and not ops.capturing()  # (no GPU sync once done)
    needs_pos = (
        not fused
        or (cache.kv_side is not None and not kernel_side)
        or (cache.window_quantizer is not None and not kernel_ring)
        or (cache.rope_center and (calibrating or not kernel_rope))
    )
    pos = start.long().unsqueeze(1) + torch.arange(n, device=cache.device) if needs_pos else None  # [B, n]
    # rows as a tensor where a PyTorch step indexes with them (a decode step on the kernels needs none)
    if rows is None and (needs_pos or calibrating or cache.health_counters is not None):
        rows = torch.arange(B, device=cache.device)
    if keys.enabled:
        if calibrating:
            skip = min(n, max(0, cache.sink_tokens - int(start.min()))) if cache.sink_tokens else 0  # not the sinks
            cache.calibrate(k[:, skip:], rows, positions=pos[:, skip:] if cache.rope_center else None)
            keys.done = bool(keys.calibrated.all())
        if not kernel_rope:
            k = keys.transform(k, rows, pos if cache.rope_center else None)
    if not cache.rope_center:
        side_k = k
    if cache.health_counters is not None:
        cache.observe(k, v, rows)
    # the kernel also advances seqlens, unless start is a caller's tensor whose memory may overlap
    # them (a row could be read after another row moved)
    advance = fused and (
        not isinstance(cache_seqlens, torch.Tensor)
        or (not torch.compiler.is_compiling() and not storages_overlap(start, cache.seqlens))
    )
    if fused:  # quantize-on-write kernel: slots, range and value checks on the GPU
        flags = torch.zeros(1, dtype=torch.int32, device=cache.device) if error_flags is None else error_flags
        turbo = cache.quantizer == "turbo"
        lloyd = turbo and cache.grid == "lloyd_max"
        kq, vq = cache.k_quantizer, cache.v_quantizer
        ops.pack(
            k,
            v,
            pack_stores(cache, kernel_side, kernel_ring),
            start=start.contiguous(),
            batch_idx=None if batch_idx is None else batch_idx.to(cache.device, torch.int32).contiguous(),
            block_table=cache.block_table,
            quant=PACK_QUANTIZERS[(cache.quantizer, cache.grid, cache.spec.fit)],
            capacity=cache.max_seqlen,
            signs=(kq.signs_on(k.device), vq.signs_on(v.device)) if turbo else (None, None),
            levels=(kq.codebook(k.device), vq.codebook(v.device)) if lloyd else (None, None),
            rope_center=keys.center if kernel_rope else None,
            rope_inv_freq=keys.inv_freq if kernel_rope else None,
            rope_offset=cache.spec.rope_position_offset,
            error_flags=flags,
            lengths=cache.seqlens if advance else None,
            tally=cache.pack_tally if advance else None,
        )
        if checking and error_flags is None:
            ops.raise_pack_errors(int(flags.item()))
    else:
        slot_rows, slot_cols = slots(cache.block_table, cache.page_size, rows.unsqueeze(1).expand(B, n), pos)
        packed = quantize(cache, k, v, rows)
        for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
            getattr(cache, name)[slot_rows, slot_cols] = packed[name]
    if cache.kv_side is not None and not kernel_side:
        write_side(cache, side_k, v, rows, pos)
    if cache.window_quantizer is not None and not kernel_ring:
        write_window_codes(cache, k, v, rows, pos)
    if advance:
        return
    if batch_idx is not None:
        cache.seqlens[rows] = start + n
    elif cache_seqlens is None:  # start is seqlens[:B] itself: one in-place add
        cache.seqlens[:B] += n
    else:
        cache.seqlens[:B] = start + n


def crop(cache: "QuantizedKVCache", lengths, batch_idx=None) -> None:
    """:meth:`QuantizedKVCache.crop`."""
    rows = torch.arange(cache.batch_size, device=cache.device) if batch_idx is None else cache.row_index(batch_idx)
    if is_int(lengths):
        new = torch.full((len(rows),), int(lengths), dtype=torch.int32, device=cache.device)
    elif isinstance(lengths, torch.Tensor) and not lengths.dtype.is_floating_point and lengths.shape == (len(rows),):
        new = lengths.to(cache.device, torch.int32)
    else:
        raise ValueError(f"lengths must be an int or an integer tensor [{len(rows)}]")
    old = cache.seqlens[rows]
    if not ops.capturing() and len(rows) and (int(new.min()) < 0 or bool((new > old).any())):
        raise ValueError("lengths: crop only shortens rows (0 <= lengths <= seqlens)")
    restore_recent(cache, rows, old, new, 0)
    cache.seqlens[rows] = new
    restore_overwritten(cache)
