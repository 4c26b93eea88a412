"""A quantized cache's state: its tensors by name (``state_dict``), its configuration, loading a saved
state (older saves too), moving it and copying it into a larger cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .storage import PER_TOKEN, TENSORS

if TYPE_CHECKING:  # (annotations only: the cache imports this module)
    from .cache import QuantizedKVCache

STATE = TENSORS + ("k_range", "v_range", "health_counters")  # the cache's own tensors
KEY_STATE = (("k_center", "center"), ("calibrated", "calibrated"), ("rope_inv_freq", "inv_freq"))  # its key center's

# options a saved config may lack (saved before they existed), and ones a cache no longer has
SAVED_DEFAULTS = dict(
    fit="norm",
    key_center=False,
    rope_inv_freq=None,
    rope_position_offset=0,
    calib_min_tokens=16,
    scale_only=False,
    window_bits=16,
    verify_tokens=1,
    sink_tokens=0,
    health=False,
    page_size=None,
    num_blocks=None,
)
DROPPED = {"key_scale": 0.0, "key_scale_q": False, "key_pca": False, "value_pca": False}


def config(cache: "QuantizedKVCache") -> dict[str, Any]:
    """The shape and the spec (:meth:`CacheSpec.options`, dtype as a string)."""
    shape = dict(
        batch_size=cache.batch_size,
        max_seqlen=cache.max_seqlen,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        num_blocks=cache.k_codes.shape[0] if cache.paged else None,
    )
    options = cache.spec.options()
    options["dtype"] = str(cache.dtype).replace("torch.", "")
    return {**shape, **options}


def saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config in today's form (older saves: missing options at their old defaults, options
    that no longer exist dropped where they were switched off)."""
    cfg = {**SAVED_DEFAULTS, **saved}
    for key, off in DROPPED.items():
        if cfg.get(key, off) == off:
            cfg.pop(key, None)
    if cfg.get("rope_inv_freq") is not None:
        cfg["rope_inv_freq"] = [float(x) for x in cfg["rope_inv_freq"]]
    return cfg


def state_dict(cache: "QuantizedKVCache") -> dict[str, Any]:
    sd = {name: getattr(cache, name) for name in STATE if getattr(cache, name) is not None}
    sd.update({name: getattr(cache.keys, a) for name, a in KEY_STATE if getattr(cache.keys, a) is not None})
    sd["config"] = config(cache)
    return sd


def load_state_dict(cache: "QuantizedKVCache", state: dict[str, Any]) -> None:
    mine, theirs = config(cache), saved_config(state["config"])
    if mine != theirs:
        diff = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
        raise ValueError(f"state_dict was saved from a cache with another configuration: {diff}")
    state = dict(state)
    if "k_shift" in state:  # (the key center's earlier name)
        state.setdefault("k_center", state.pop("k_shift"))
    for name in STATE:
        if name in state:
            getattr(cache, name).copy_(state[name])
    for name, attr in KEY_STATE:
        if name in state:
            getattr(cache.keys, attr).copy_(state[name])
    if "kv_side" not in state and "k_window" in state and cache.window_quantizer is None:  # saved without sinks
        cache.k_window.copy_(state["k_window"])
        cache.v_window.copy_(state["v_window"])
    cache.keys.done = False  # re-read from `calibrated` on the next append


def from_state_dict(cls, state: dict[str, Any], device: torch.device | str) -> "QuantizedKVCache":
    cfg = saved_config(state["config"])
    cfg["dtype"] = getattr(torch, cfg["dtype"])
    bt = state.get("block_table")
    shape = [cfg.pop(n) for n in ("batch_size", "max_seqlen", "num_kv_heads", "head_dim")]
    cache = cls(*shape, **cfg, block_table=bt.cpu() if bt is not None else None, device=device)
    load_state_dict(cache, state)
    return cache


def move(cache: "QuantizedKVCache", device: torch.device | str) -> None:
    """Every tensor of the cache to ``device``, in place."""
    for name in STATE + ("pack_tally",):
        t = getattr(cache, name)
        if t is not None:
            setattr(cache, name, t.to(device))
    cache.keys.to(device)


def copy_into(cache: "QuantizedKVCache", other: "QuantizedKVCache") -> None:
    """:meth:`QuantizedKVCache.copy_into`."""
    if other.spec != cache.spec or (other.batch_size, other.num_kv_heads) != (cache.batch_size, cache.num_kv_heads):
        raise ValueError("copy_into: the other cache must have the same spec, rows and kv heads")
    if cache.paged or other.max_seqlen < cache.max_seqlen:
        raise ValueError("copy_into: contiguous caches, into one of at least this capacity")
    for name in STATE:
        mine = getattr(cache, name)
        if mine is not None:
            theirs = getattr(other, name)
            (theirs[:, : cache.max_seqlen] if name in PER_TOKEN else theirs).copy_(mine)
    for _, attr in KEY_STATE:
        if getattr(cache.keys, attr) is not None:
            getattr(other.keys, attr).copy_(getattr(cache.keys, attr))
    other.keys.done = cache.keys.done
