"""QuantizedKVCache: a K/V cache stored as packed low-bit codes (see :mod:`flash_attn_tq.format`).

The class is a facade: what it holds is a :class:`~flash_attn_tq.spec.CacheSpec` (the format and
features) and tensors (:mod:`flash_attn_tq.storage`); the key transforms live in
:mod:`flash_attn_tq.keys`, writing in :mod:`flash_attn_tq.writes`, the fused kernels' calls in
:mod:`flash_attn_tq.fused`, the reference math in :mod:`flash_attn_tq.reference`, health in
:mod:`flash_attn_tq.health`, and which kernel runs in :mod:`flash_attn_tq.dispatch`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dispatch, fused, health, reference, state, storage, writes
from .keys import KeyCenter
from .quantizers import AsymQuantizer, TurboQuantizer
from .spec import CacheSpec, is_int


def _spec_field(name: str) -> property:
    return property(lambda self: getattr(self.spec, name), doc=f"The spec's ``{name}`` (:class:`CacheSpec`).")


class QuantizedKVCache:
    """A per-layer K/V cache of ``k_bits``/``v_bits``-bit codes plus float16 metadata a vector.

    ``QuantizedKVCache(batch_size, max_seqlen, num_kv_heads, head_dim, spec=CacheSpec(...))``, or with
    the spec's fields as keyword arguments (``k_bits=4, sink_tokens=16, ...``; given with ``spec`` they
    override it). ``num_blocks`` / ``block_table`` (paged layout, ``page_size`` in the spec):
    :mod:`flash_attn_tq.storage`. ``seqlens [batch]`` int32 counts the tokens written a sequence.

    What the spec's features store: sinks and the 16-bit window (``sink_tokens``, ``fp16_window``) in
    one tensor ``kv_side`` that the fused decode kernel attends in the same launch as the codes (the
    codes are read for positions ``[S, seqlen - R)`` only); ``window_bits`` < 16 keeps the window as a
    ring of codes at that width instead; every token is also quantized when written. For turbo the
    codes live in the Hadamard-rotated space (:meth:`rotate_query`, :meth:`unrotate_output`). Key
    centering (``key_center``): :mod:`flash_attn_tq.keys`. Health counters (``health=True``): each
    append also counts, on the device and without a sync, vectors written, NaN/Inf vectors (stored as
    zeros instead of raising), clipped elements and relative error; :meth:`health` reads them.
    """

    k_bits, v_bits, quantizer, grid = (_spec_field(n) for n in ("k_bits", "v_bits", "quantizer", "grid"))
    fp16_window, window_bits, sink_tokens = (_spec_field(n) for n in ("fp16_window", "window_bits", "sink_tokens"))
    page_size, scale_only, dtype = (_spec_field(n) for n in ("page_size", "scale_only", "dtype"))
    rope_center, side_recent = _spec_field("rope_center"), _spec_field("side_recent")

    def __init__(
        self,
        batch_size: int,
        max_seqlen: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        spec: CacheSpec | None = None,
        num_blocks: int | None = None,
        block_table: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        **options: Any,
    ):
        spec = CacheSpec.of(spec, **options)
        for name, val in (("batch_size", batch_size), ("max_seqlen", max_seqlen), ("num_kv_heads", num_kv_heads)):
            if not is_int(val):
                raise TypeError(f"{name} must be an int, got {val!r}")
            if int(val) <= 0:
                raise ValueError(f"{name} must be positive, got {val}")
        if not is_int(head_dim):
            raise TypeError(f"head_dim must be an int, got {head_dim!r}")
        spec.check_head_dim(int(head_dim))
        self.spec = spec
        self.batch_size, self.max_seqlen = int(batch_size), int(max_seqlen)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        device = torch.device(device)
        self.k_quantizer, self.v_quantizer = self._quantizer(spec.k_bits), self._quantizer(spec.v_bits)
        # a ring of window codes: per-token fits (no running range), the same rotation as the main codes
        self.window_quantizer = self._quantizer(spec.window_bits, running=False) if spec.window_codes else None
        tensors = storage.allocate(
            spec, self.batch_size, self.max_seqlen, self.num_kv_heads, self.head_dim, device, num_blocks, block_table
        )
        self.__dict__.update(tensors)  # k_codes, v_codes, k_meta, v_meta, seqlens, kv_side, ... (storage.TENSORS)
        self.pack_tally = torch.zeros(1, dtype=torch.int32, device=device)  # (the pack kernel's, see ops.pack)
        nan = torch.full((self.batch_size, self.num_kv_heads), float("nan"), device=device)
        self.k_range = nan.clone() if spec.streaming else None  # asym streaming: per-head EMA of max|x|
        self.v_range = nan.clone() if spec.streaming else None
        self.keys = KeyCenter(spec, self.batch_size, self.num_kv_heads, self.head_dim, device)
        counters = len(health.HEALTH_COUNTERS)
        self.health_counters = torch.zeros(counters, dtype=torch.float64, device=device) if spec.health else None
        self._plans: dict = {}  # (query, wgmma switch, pair) -> dispatch.Plan, dtype -> dispatch.WritePlan
        self.overwritten = None  # the recent slots the last append overwrote (writes.keep_overwritten)

    def _quantizer(self, bits: int, running: bool | None = None):
        s = self.spec
        if s.quantizer == "turbo":
            return TurboQuantizer(self.head_dim, bits, s.grid, s.seed, s.fit)
        return AsymQuantizer(bits, s.streaming if running is None else running, s.alpha)

    # ------------------------------------------------------------------ what it holds
    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    @property
    def paged(self) -> bool:
        return self.spec.page_size is not None

    @property
    def key_center(self) -> bool:
        """Keys are centered (``key_center`` True or ``'rope'``)."""
        return bool(self.spec.key_center)

    @property
    def k_center(self) -> torch.Tensor | None:
        """The key center ``[batch, kv_heads, d]`` float32 (``mu``, or ``c`` with ``key_center='rope'``)."""
        return self.keys.center

    @property
    def calibrated(self) -> torch.Tensor | None:
        """``[batch]`` bool: rows whose key center is set."""
        return self.keys.calibrated

    @property
    def rope_inv_freq(self) -> torch.Tensor | None:
        """The RoPE frequencies ``[head_dim / 2]`` float32 on the cache's device (``key_center='rope'``)."""
        return self.keys.inv_freq

    @property
    def k_side(self) -> torch.Tensor | None:
        """The 16-bit keys ``[batch, sink_tokens + side_recent, kv_heads, d]`` (sinks, then the recent
        slots): raw with ``key_center='rope'`` (the kernel adds the center's term to the codes' scores
        only), else as the codes' keys before quantization."""
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
        """Bytes of the cache storage (codes, metadata, the 16-bit side and the window codes)."""
        names = storage.PER_TOKEN + ("kv_side", "k_window_codes", "v_window_codes", "k_window_meta", "v_window_meta")
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in names) if t is not None)

    def bits_per_element(self) -> float:
        """Average bits per stored K/V element (codes + metadata, window excluded)."""
        return self.spec.bits_per_element(self.head_dim)

    def compression_ratio(self) -> float:
        """fp16 bytes of a cache of the same capacity divided by :attr:`nbytes`."""
        slots = self.k_codes.shape[0] * self.k_codes.shape[1]
        return 2 * slots * self.num_kv_heads * self.head_dim * 2 / self.nbytes

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a kernel call takes, the quantizers' device constants created now: what a
        captured CUDA graph may read in place (``TQCache`` marks them static for ``torch.compile``)."""
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

    def row_index(self, batch_idx: torch.Tensor) -> torch.Tensor:
        """``batch_idx [batch]`` as int64 cache rows to gather with, clamped into ``[0, batch_size)``: a GPU
        index is not checked (that would sync), and the kernels turn the output rows of one outside the
        cache to NaN."""
        return batch_idx.to(self.device).long().clamp(0, self.batch_size - 1)

    # ------------------------------------------------------------------ domains
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """Move queries into the codes' domain (the Hadamard rotation for turbo; identity for asym), for
        code working on :meth:`dequantize` ``(rotated=True)`` values (the fused kernel rotates itself)."""
        if self.quantizer == "turbo":
            return (q.float() @ self.k_quantizer.rotation_matrix(q.device)).to(q.dtype)
        return q

    def unrotate_output(self, o: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rotate_query` for attention outputs (V's rotation)."""
        if self.quantizer == "turbo":
            return (o.float() @ self.v_quantizer.rotation_matrix(o.device).T).to(o.dtype)
        return o

    def calibrate(self, k: torch.Tensor, batch_idx=None, force: bool = False, positions=None) -> None:
        """Set the key center of rows ``batch_idx`` from ``k [batch, n, kv_heads, d]`` (rows already
        calibrated are left alone unless ``force``); :meth:`append` calls it on a row's first chunk.
        ``positions [batch, n]``: the keys' cache positions (``key_center='rope'``)."""
        if not self.key_center:
            return
        writes.check_new(self, "k", k, check_values=True)  # (a NaN here would poison every later score of the rows)
        B = k.shape[0]
        rows = torch.arange(B, device=self.device) if batch_idx is None else batch_idx.to(self.device).long()
        if rows.shape != (B,) or (B and (int(rows.min()) < 0 or int(rows.max()) >= self.batch_size)):
            raise ValueError(f"batch_idx must hold {B} indices in [0, {self.batch_size})")
        self.keys.calibrate(k, rows, None if positions is None else positions.to(self.device), force)

    def _rows(self, batch_idx: torch.Tensor | None, batch: int) -> torch.Tensor:
        return torch.arange(batch, device=self.device) if batch_idx is None else batch_idx.to(self.device).long()

    def key_center_at(self, batch_idx: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """What key centering subtracts from keys at ``positions [batch, n]`` (:meth:`KeyCenter.at`)."""
        batch = positions.shape[0] if positions is not None else len(batch_idx)
        return self.keys.at(
            None if batch_idx is None else self.row_index(batch_idx),
            batch,
            None if positions is None else positions.to(self.device),
        )

    def transform_keys(self, k: torch.Tensor, batch_idx=None, positions=None) -> torch.Tensor:
        """Keys ``[batch, n, kv_heads, d]`` of rows ``batch_idx`` as the codes store them (same dtype)."""
        return self.keys.transform(
            k, self._rows(batch_idx, k.shape[0]), None if positions is None else positions.to(self.device)
        )

    def untransform_keys(self, kt: torch.Tensor, batch_idx=None, positions=None) -> torch.Tensor:
        """Inverse of :meth:`transform_keys` (float32)."""
        return self.keys.untransform(
            kt, self._rows(batch_idx, kt.shape[0]), None if positions is None else positions.to(self.device)
        )

    def query_shift(self, q: torch.Tensor, batch_idx: torch.Tensor | None = None) -> torch.Tensor:
        """``q . mu`` ``[batch, heads, seqlen_q]``: what the key centering removes from every score."""
        return self.keys.query_shift(q, None if batch_idx is None else self.row_index(batch_idx))

    # ------------------------------------------------------------------ writing
    def quantize(self, k: torch.Tensor, v: torch.Tensor, batch_idx: torch.Tensor | None = None) -> dict:
        """Reference quantization of ``k, v [batch, n, kv_heads, d]`` (streaming: the running ranges of
        rows ``batch_idx`` are used and updated); returns packed codes and metadata by name."""
        return writes.quantize(self, k, v, self._rows(batch_idx, k.shape[0]))

    def check_new_kv(self, k: torch.Tensor, v: torch.Tensor, check_values: bool = True) -> None:
        writes.check_new_kv(self, k, v, check_values)

    def append(self, k, v, cache_seqlens=None, batch_idx=None, error_flags=None) -> None:
        """Quantize ``k, v [batch, n, kv_heads, d]`` and write them at positions ``cache_seqlens ...``.

        ``cache_seqlens`` (int or int32 ``[batch]``) defaults to :attr:`seqlens`; ``batch_idx``
        (``[batch]``) selects which cache rows the batch entries go to (default ``0..batch-1``).
        Afterwards ``seqlens[batch_idx] = cache_seqlens + n``; positions below a row's length roll it
        back (recent slots that held discarded tokens get their position's value from the codes).

        On the GPU the pack kernel resolves the slots and checks positions, batch indices and values
        itself (and, where :func:`dispatch.write_plan` says so, centers the keys and copies sinks and
        recent tokens in the same launch); the call then reads back one flag word (one sync; none
        inside CUDA-graph capture, where nothing is checked) and raises ValueError for NaN/Inf values
        or a cache overflow. ``error_flags`` (int32 ``[1]`` on the cache's device): the kernel ORs its
        error bits into it and the call does not read it back (:func:`ops.raise_pack_errors` later)."""
        writes.append(self, k, v, cache_seqlens, batch_idx, error_flags)

    def crop(self, lengths: int | torch.Tensor, batch_idx: torch.Tensor | None = None) -> None:
        """Shorten rows ``batch_idx`` (default: all) to ``lengths`` tokens (speculative decoding's
        rollback): later appends overwrite the dropped tokens, and the recent slots the dropped ones
        took get the kept tokens back: as they were where the last append displaced them (an append of
        at most the window's length), else from their codes."""
        writes.crop(self, lengths, batch_idx)

    def write_plan(self, dtype: torch.dtype) -> dispatch.WritePlan:
        """How an append of new K/V of ``dtype`` writes (memoized)."""
        plan = self._plans.get(dtype)
        if plan is None:
            plan = dispatch.write_plan(self.spec, self.head_dim, dtype, dispatch.Device.of(self.device))
            self._remember(dtype, plan)
        return plan

    def _remember(self, key, plan) -> None:
        if not torch.compiler.is_compiling():  # (a traced step plans as it goes: no state it would have to rebuild)
            self._plans[key] = plan

    # ------------------------------------------------------------------ health
    def screen(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return health.screen(self.health_counters, k, v)

    def observe(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        health.observe(self, k, v, rows)

    def health(self) -> dict[str, float | None]:
        """The health counters (``health=True``) as numbers, one host sync; see :func:`health.health_reports`."""
        return health.health_reports([[self]])[0]

    def reset_health(self) -> None:
        """Zero the health counters (``health=True``)."""
        if self.health_counters is None:
            raise RuntimeError("this cache keeps no health counters (QuantizedKVCache(..., health=True))")
        self.health_counters.zero_()

    # ------------------------------------------------------------------ attention (the fused kernels)
    def plan(self, query: dispatch.Query, pair: tuple["QuantizedKVCache", int] | None = None) -> dispatch.Plan:
        """How attention of ``query`` over this cache runs (memoized; ``pair``: see :meth:`attend`)."""
        wgmma_on = dispatch.wgmma_switch_for(query, self.num_kv_heads)
        other = None if pair is None else (pair[0].spec, pair[0].num_kv_heads)
        key = (query, wgmma_on, other)
        plan = self._plans.get(key)
        if plan is None:
            device = dispatch.Device.of(self.device, wgmma_on)
            plan = dispatch.plan(self.spec, self.num_kv_heads, query, device, other)
            self._remember(key, plan)
        return plan

    stores = fused.stores  # (functions of the cache, as methods)
    attend = fused.attend

    # ------------------------------------------------------------------ reading
    def gather(self, batch_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Codes and meta as contiguous ``[batch, max_seqlen, kv_heads, *]`` (copies for paged caches)."""
        return reference.gather(self, self._rows(batch_idx, self.batch_size))

    def dequantize(self, batch_idx=None, rotated: bool = False, use_window: bool = True, window: int | None = None):
        """float32 ``(k, v)`` ``[batch, max_seqlen, kv_heads, d]`` as a one-token decode sees them.
        Positions at or beyond ``seqlens`` are zero; the sinks and the window come from the 16-bit side
        / the window codes (``use_window=False`` shows their codes instead). ``rotated=True`` returns
        turbo values in the rotated domain (keys as the codes hold them: centered). ``window``: the
        recent tokens read from the 16-bit side instead of the window (up to ``side_recent``: what an
        earlier query of a multi-token call sees, :func:`flash_attn_tq.reference.window_blocks`)."""
        rows = self._rows(batch_idx, self.batch_size)
        return reference.dequantize(self, rows, rotated, use_window, window)

    def window_kv(self, rows, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.window_kv(self, rows, rotated)

    # ------------------------------------------------------------------ state (flash_attn_tq.state)
    def copy_into(self, other: "QuantizedKVCache") -> None:
        """Copy every token and all state into ``other``, a contiguous cache of the same spec, rows and
        kv heads with at least this one's capacity (a cache that grows)."""
        state.copy_into(self, other)

    def to(self, device: torch.device | str) -> "QuantizedKVCache":
        """Move every tensor of the cache to ``device`` (in place); returns self."""
        state.move(self, device)
        self._plans.clear()
        self.overwritten = None  # (a crop after a move decodes the recent slots from their codes)
        return self

    def config(self) -> dict[str, Any]:
        """The shape and the spec (:meth:`CacheSpec.options`, dtype as a string)."""
        return state.config(self)

    def state_dict(self) -> dict[str, Any]:
        """The cache's tensors by name and its :meth:`config`: what :meth:`from_state_dict` rebuilds it from."""
        return state.state_dict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` into this cache in place (saved from the same shape and spec, else ValueError)."""
        state.load_state_dict(self, saved)
        self.overwritten = None

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any], device: torch.device | str = "cpu") -> "QuantizedKVCache":
        """A new cache on ``device`` holding a saved :meth:`state_dict` (saves of older versions too)."""
        return state.from_state_dict(cls, saved, device)

    def __repr__(self) -> str:
        s = self.spec
        layout = f"paged(page_size={s.page_size}, num_blocks={self.k_codes.shape[0]})" if self.paged else "contiguous"
        window = "" if self.window_quantizer is None else f" at {s.window_bits} bits"
        return (
            f"QuantizedKVCache({s.quantizer}/{s.grid}, K{s.k_bits}V{s.v_bits}, batch={self.batch_size}, "
            f"max_seqlen={self.max_seqlen}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {layout}, "
            f"fp16_window={s.fp16_window}{window}, sink_tokens={s.sink_tokens}, "
            f"{self.bits_per_element():.3f} bits/element, device={self.device})"
        )
