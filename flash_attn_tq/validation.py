"""Argument checks of the public functions, in one place: each raises a clear Python error that
names the argument, before anything changes a cache (the upstream-semantics functions of
:mod:`flash_attn_tq.baseline` and the quantized path of :mod:`flash_attn_tq.interface` share them)."""

from __future__ import annotations

import collections.abc
import math
import numbers
import sys

import torch

from .spec import is_int

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(x, name, ndim, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {what}, got {tuple(x.shape)}")


def check_qkv(q, k, v, varlen, paged=False):
    """Checks q, k, v; returns (nheads, nheads_k, headdim)."""
    q_shape = "(total_q, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
    if paged:
        k_shape = "(num_blocks, page_block_size, nheads_k, headdim)"
    elif varlen:
        k_shape = "(total_k, nheads_k, headdim)"
    else:
        k_shape = "(batch, seqlen_k, nheads_k, headdim)"
    check_tensor(q, "q", 3 if varlen else 4, q_shape)
    check_tensor(k, "k", 4 if (paged or not varlen) else 3, k_shape)
    check_tensor(v, "v", k.dim(), k_shape)
    if q.dtype not in DTYPES:
        raise TypeError(f"q must have dtype float16, bfloat16 or float32, got {q.dtype}")
    for x, name in ((k, "k"), (v, "v")):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have the same batch size as q ({q.shape[0]}), got {k.shape[0]}")
    nheads, headdim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    if k.shape[-1] != headdim:
        raise ValueError(f"k must have the same head dimension as q ({headdim}), got {k.shape[-1]}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"number of heads in k/v ({nheads_k}) must divide number of heads in q ({nheads})")
    return nheads, nheads_k, headdim


def is_real(x) -> bool:
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


_WINDOW_ERROR = "window_size must be a pair of ints (left, right), -1 for unbounded"


def _is_array(x) -> bool:
    """A torch tensor or a numpy array (an object can only be the latter once numpy is imported)."""
    np = sys.modules.get("numpy")
    return isinstance(x, torch.Tensor) or (np is not None and isinstance(x, np.ndarray))


def _window_bound(x):
    """One bound of window_size as an int, or None when it is not an integer: an int, a numpy
    integer, or a 0-d integer tensor / numpy array (bools and floats are refused)."""
    if is_int(x):
        return int(x)
    if _is_array(x) and x.ndim == 0:
        return _window_bound(x.tolist())  # (a Python int, float, bool or complex)
    return None


def check_window_size(window_size):
    """window_size in any form upstream takes: a tuple or list of two integers, a 1-D tensor of
    two integers (any integer dtype and device; reading a CUDA tensor's values syncs the device),
    a numpy array or other sequence of two integers.  Returns a plain ``(int, int)``."""
    if type(window_size) is tuple and len(window_size) == 2:  # (the common case, cheaply)
        left, right = window_size
        if type(left) is int and type(right) is int:
            return window_size
    items = None
    if _is_array(window_size):
        if tuple(window_size.shape) == (2,):
            items = window_size.tolist()
    elif isinstance(window_size, collections.abc.Sequence) and not isinstance(window_size, (str, bytes, bytearray)):
        items = window_size
    pair = [_window_bound(b) for b in items] if items is not None and len(items) == 2 else [None]
    if None in pair:
        raise ValueError(f"{_WINDOW_ERROR}, got {window_size!r}")
    return (pair[0], pair[1])


def check_options(dropout_p, window_size, softcap, softmax_scale=None):
    """dropout_p, window_size, softcap and softmax_scale as the attention functions take them;
    returns window_size as a plain pair of ints (see :func:`check_window_size` for its forms)."""
    if not is_real(dropout_p) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    window_size = check_window_size(window_size)
    if not is_real(softcap) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    if softmax_scale is not None and (not is_real(softmax_scale) or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number (None: 1 / sqrt(headdim)), got {softmax_scale!r}")
    return window_size


def check_alibi(alibi_slopes, batch, nheads, device):
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError("alibi_slopes must be a torch.Tensor")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on the same device as q ({device})")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {tuple(alibi_slopes.shape)}"
        )
    if not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError("alibi_slopes must be finite")


def check_int32_vector(x, name, length, device):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {x.device}")
    if x.dim() != 1 or (length is not None and x.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def check_block_table(block_table, batch, num_blocks, device):
    if not isinstance(block_table, torch.Tensor):
        raise TypeError("block_table must be a torch.Tensor of dtype int32")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on the same device as q ({device})")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must have shape ({batch}, max_num_blocks_per_seq), got {tuple(block_table.shape)}"
        )
    if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= num_blocks):
        raise ValueError(f"block_table entries must be in [0, {num_blocks})")


def check_cu_seqlens(cu, name, batch, total, max_seqlen, max_name, device):
    check_int32_vector(cu, name, batch + 1 if batch is not None else None, device)
    if not is_int(max_seqlen):
        raise TypeError(f"{max_name} must be an int, got {max_seqlen!r}")
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must have at least 2 entries (batch_size + 1)")
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] < 0 or min(lengths) < 0:
        raise ValueError(f"{name} must be non-negative and non-decreasing, got {bounds}")
    if total is not None and bounds[-1] > total:
        raise ValueError(f"{name}[-1] ({bounds[-1]}) exceeds the number of tokens ({total})")
    if max(lengths) > int(max_seqlen):
        raise ValueError(
            f"{max_name} ({int(max_seqlen)}) is smaller than the longest sequence in {name} ({max(lengths)})"
        )
    return bounds


# ------------------------------------------------------------ calls over a quantized cache


def check_batch_args(cache_seqlens, cache_batch_idx, batch: int) -> None:
    """cache_seqlens (int, None or int32 [batch]) and cache_batch_idx (None or int32 [batch])."""
    bad_lens = isinstance(cache_seqlens, torch.Tensor) and (
        cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,)
    )
    if bad_lens:
        raise ValueError(
            f"cache_seqlens must be an int or int32 [batch={batch}], got {cache_seqlens.dtype} "
            f"{tuple(cache_seqlens.shape)}"
        )
    if cache_batch_idx is not None and (cache_batch_idx.dtype != torch.int32 or cache_batch_idx.shape != (batch,)):
        raise ValueError(
            f"cache_batch_idx must be int32 [batch={batch}], got {cache_batch_idx.dtype} {tuple(cache_batch_idx.shape)}"
        )


def check_cache_rows(cache, cache_seqlens, cache_batch_idx, cache_leftpad, batch: int, seqlen_new: int) -> None:
    """The values of the per-row arguments against a QuantizedKVCache, where reading them costs no
    device sync: ints always, index tensors when they live on the CPU. (On a GPU the kernels clamp
    lengths to the capacity and the pack kernel flags bad rows and overflows.)"""
    on_host = lambda x: isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() > 0  # noqa: E731
    if isinstance(cache_seqlens, int) or on_host(cache_seqlens):
        low, high = (cache_seqlens,) * 2 if isinstance(cache_seqlens, int) else cache_seqlens.aminmax()
        if low < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {int(low)}")
        if high + seqlen_new > cache.max_seqlen:
            raise ValueError(
                f"cache overflow: cache_seqlens ({int(high)}) + {seqlen_new} new tokens exceeds "
                f"max_seqlen={cache.max_seqlen}"
            )
    if on_host(cache_batch_idx):
        if int(cache_batch_idx.min()) < 0 or int(cache_batch_idx.max()) >= cache.batch_size:
            raise ValueError(f"cache_batch_idx entries must be in [0, {cache.batch_size}) (the cache's batch_size)")
        if seqlen_new and cache_batch_idx.unique().numel() != batch:
            raise ValueError("cache_batch_idx must not repeat a row when new k / v are written")
    if cache_leftpad is not None:
        check_int32_vector(cache_leftpad, "cache_leftpad", batch, cache.device)
        if on_host(cache_leftpad) and int(cache_leftpad.min()) < 0:
            raise ValueError("cache_leftpad must be >= 0")


def check_new_rows(k, v, batch: int, dtype: torch.dtype) -> None:
    """New k / v for a QuantizedKVCache call: tensors of q's batch and dtype (the cache checks the rest)."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    for name, x in (("k", k), ("v", v)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != batch):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be (batch={batch}, seqlen_new, nheads_k, headdim) like q's batch, got {got}")
    check_new_dtype(k, v, dtype)


def check_new_dtype(k, v, q_dtype: torch.dtype) -> None:
    """Upstream's rule for new keys and values: q's dtype (checked before they reach the cache)."""
    for name, x in (("k", k), ("v", v)):
        if x is not None and x.dtype != q_dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q_dtype}), got {x.dtype}")


def check_rotary(rotary_cos, rotary_sin, k, head_dim: int, device) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need the new k and v to be given")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.device != device:
            raise ValueError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2) on {device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError("rotary_sin must have the same shape as rotary_cos")
    if 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos gives rotary_dim {2 * rotary_cos.shape[1]} > headdim {head_dim}")


def check_query(q, cache) -> None:
    """q against a QuantizedKVCache or CpuQuantizedKVCache: rank, dtype, device, head_dim, heads, batch."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(
            f"q must be a 4-D tensor (batch, seqlen_q, nheads, headdim), got "
            f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16 or bfloat16 (float32 on the reference path), got {q.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the {type(cache).__name__} is on {cache.device}")
    if q.shape[3] != cache.head_dim:
        raise ValueError(f"q head_dim {q.shape[3]} does not match the cache's head_dim {cache.head_dim}")
    if q.shape[2] % cache.num_kv_heads:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of the cache's kv heads ({cache.num_kv_heads})")
    if q.shape[0] > cache.batch_size:
        raise ValueError(f"q batch {q.shape[0]} exceeds the cache's batch_size {cache.batch_size}")
