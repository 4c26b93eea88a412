"""Tensor parallelism: which of the model's kv heads a layer's cache holds, and calibrated options
every rank agrees on.

transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) splits
``k_proj`` / ``v_proj`` column-wise: rank ``r`` of a tensor-parallel group of ``n`` holds kv heads
``[r * H / n, (r + 1) * H / n)`` of every layer, and its attention, so its :class:`TQCache`, sees only
those. A rank's cache quantizes its own heads; per-head options (``head_options``, the calibrated
copy heads) name the model's kv heads, so a layer places them through :func:`first_kv_head`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


def first_kv_head(local: int, total: int | None, tp_rank: int | None = None) -> int:
    """The model's index of the first of the ``local`` kv heads a layer holds (0 without tensor
    parallelism).

    Args:
        local: kv heads the layer's attention sees (its key states' head count).
        total: the model's kv heads (its config's ``num_key_value_heads``; None: unknown, taken as
            ``local``).
        tp_rank: this process's rank in the tensor-parallel group (None: torch.distributed's rank,
            where the group is every process).
    """
    if total is None or local == total:
        return 0
    if local > total or total % local:
        raise ValueError(
            f"TQCache: a layer sees {local} kv heads, which does not split the config's {total} evenly "
            "(tensor parallelism gives each rank an equal run of them)"
        )
    shards = total // local
    if tp_rank is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(
                f"TQCache: a layer sees {local} of the config's {total} kv heads, and torch.distributed is not "
                "initialized: pass tp_rank= (this process's rank in the tensor-parallel group)"
            )
        world = torch.distributed.get_world_size()
        if world != shards:
            raise ValueError(
                f"TQCache: a layer sees {local} of the config's {total} kv heads ({shards} shards) in a world of "
                f"{world} processes: pass tp_rank= (this process's rank in the tensor-parallel group)"
            )
        tp_rank = torch.distributed.get_rank()
    if not 0 <= tp_rank < shards:
        raise ValueError(f"tp_rank: {tp_rank} is not a rank of a tensor-parallel group of {shards}")
    return tp_rank * local


def tp_rank_of(model: Any) -> int | None:
    """``model``'s rank in its tensor-parallel group (transformers' ``tp_plan``), or None where the
    model is not split."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or mesh.size() == 1:
        return None
    return int(mesh.get_local_rank())


def agree(model: Any, value: T) -> T:
    """``value`` as the first rank of ``model``'s tensor-parallel group computed it (every rank of the
    group calls this); ``value`` itself where the model is not split. Calibration measures the same
    logits on every rank, so the ranks compute equal options; this makes the layout one by
    construction, whatever the reductions' rounding."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or mesh.size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, group=mesh.get_group(), group_src=0)
    return box[0]


__all__ = ["first_kv_head", "tp_rank_of", "agree"]
