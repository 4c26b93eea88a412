"""Which kernel runs: the one place that decides, as pure functions of a cache's spec, the call and
the device (CPU-testable; ``tests/test_dispatch.py`` covers every row of the support matrix).

* :func:`plan` -- attention over a quantized cache: a fused launch (``decode``, ``prefill``,
  ``prefill-wgmma``, ``pair``, ``ring``) or the reference path, and why.
* :func:`write_plan` -- an append: the quantize-on-write kernel, and what its launch also does (the
  16-bit side's copy, the RoPE center, the ring of window codes), or the PyTorch writes.
* :func:`plan_kv16` -- attention over a float16/bfloat16 cache: our decode kernel over the 16-bit
  cache, or the baseline.

The case tables come from :mod:`flash_attn_tq.kernel_cases` (generated with the C++ case table); the
C++ side keeps only memory-safety checks and pure launch heuristics (the number of splits).
Plans are small frozen values: a cache memoizes them per call shape, so a decode step plans once
and every later step of every layer reuses the plan (FlashInfer's plan/run).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch

from .kernel_cases import (
    FUSED_DECODE_BITS,
    FUSED_HEAD_DIMS,
    FUSED_PAIR_BITS,
    FUSED_RING_BITS,
    FUSED_RING_WINDOW_BITS,
    PACK_QUANTIZERS,
    PREFILL_BITS,
    PREFILL_MIN_ROWS,
    WGMMA_MIN_ROWS,
)
from .spec import CacheSpec

KERNELS = ("decode", "prefill", "prefill-wgmma", "pair", "ring", "kv16")
# query rows a kv head the decode kernel over a float16/bfloat16 cache takes (more: the baseline)
MAX_KV16_ROWS = 256
HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Device:
    """What a device offers the kernels: ``kind`` (``"cuda"``, ``"cpu"``, ...), whether the compiled
    extension is importable, and for CUDA devices whether the prefill kernel's shared memory fits a
    CTA and whether its Hopper (wgmma) variant can run (sm_90, an sm_90a build, not switched off by
    ``FLASH_ATTN_TQ_PREFILL_WGMMA=0``)."""

    kind: str
    extension: bool = False
    prefill_smem: bool = False
    wgmma: bool = False

    @classmethod
    def of(cls, device: torch.device | str, wgmma_on: bool | None = None) -> "Device":
        """The facts of ``device`` (read once a device) with the wgmma switch ``wgmma_on`` (None: as
        :func:`wgmma_switch` reads it now)."""
        device = torch.device(device)
        if wgmma_on is None:
            wgmma_on = wgmma_switch()
        key = (device.type, device.index, wgmma_on)
        found = _DEVICES.get(key)
        if found is None:
            found = read_device(device, wgmma_on)
            if not torch.compiler.is_compiling():
                _DEVICES[key] = found
        return found


def wgmma_switch() -> bool:
    """False when ``FLASH_ATTN_TQ_PREFILL_WGMMA=0`` switches the prefill kernel's wgmma variant off
    (read at every plan lookup: a benchmark may switch it between two calls)."""
    return os.environ.get("FLASH_ATTN_TQ_PREFILL_WGMMA", "1")[:1] != "0"


def wgmma_switch_for(query: "Query", kv_heads: int) -> bool:
    """:func:`wgmma_switch` where it can matter: a call of fewer than :data:`PREFILL_MIN_ROWS` query
    rows a kv head runs the decode kernel whatever the switch says (True then, without reading the
    environment: a missing variable costs microseconds a call)."""
    return rows_per_kv_head(query, kv_heads) < PREFILL_MIN_ROWS or wgmma_switch()


_DEVICES: dict[tuple, Device] = {}  # (a dict, not lru_cache: torch.compile reads it as a constant)


def read_device(device: torch.device, wgmma_on: bool) -> Device:
    """The facts of ``device`` as the driver and the extension report them (read once a device)."""
    from . import ops

    if device.type != "cuda":
        return Device(device.type, extension=ops.extension_available())
    if not ops.extension_available():
        return Device("cuda")
    index = device.index if device.index is not None else torch.cuda.current_device()
    sm90a, smem_budget = ops.build_info()
    props = torch.cuda.get_device_properties(index)
    hopper = (props.major, props.minor) == (9, 0)
    return Device(
        "cuda",
        extension=True,
        prefill_smem=getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block) >= smem_budget,
        wgmma=bool(sm90a) and hopper and wgmma_on,
    )


class Query(NamedTuple):
    """The facts of an attention call that decide the kernel: ``q [batch, seqlen_q, q_heads,
    head_dim]`` of ``dtype`` and the options in use (``local``: a ``window_size``). (A tuple: built and
    hashed every call, as a plan's memo key.)"""

    seqlen_q: int
    q_heads: int
    head_dim: int
    dtype: torch.dtype
    local: bool = False
    softcap: bool = False
    leftpad: bool = False
    alibi: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, **flags: bool) -> "Query":
        return cls(q.shape[1], q.shape[2], q.shape[3], q.dtype, **flags)

    @property
    def extras(self) -> bool:
        """window_size, softcap or cache_leftpad: the kernels' compile-time variant."""
        return self.local or self.softcap or self.leftpad


@dataclasses.dataclass(frozen=True)
class Plan:
    """How an attention call runs. ``kernel``: one of :data:`KERNELS`, None for the reference path
    (``reason`` says why). ``window_pass``: a ring of window codes the launch does not take is
    attended by a PyTorch pass merged after it. ``lse_shift``: the lse gets ``q . mu`` back (post-RoPE
    key centering)."""

    kernel: str | None
    reason: str | None = None
    window_pass: bool = False
    lse_shift: bool = False

    @property
    def fused(self) -> bool:
        return self.kernel is not None

    @property
    def path(self) -> str:
        """What :func:`flash_attn_tq.last_path` reports."""
        if self.kernel == "kv16":
            return "baseline:fused-kv16-cuda"
        return "quantized:fused-cuda" if self.fused else f"quantized:reference ({self.reason})"


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """How an append writes. ``kernel``: the quantize-on-write kernel writes the codes (else PyTorch,
    ``reason`` says why); in the same launch it also copies sinks and recent tokens into the 16-bit
    side (``side``), centers keys by ``R(p) c`` (``rope``) and writes the ring of window codes
    (``ring``)."""

    kernel: bool
    side: bool = False
    rope: bool = False
    ring: bool = False
    reason: str | None = None


def fused_reason(spec: CacheSpec, head_dim: int, dtype: torch.dtype, device: Device) -> str | None:
    """None if the fused kernels take a cache of ``spec`` at all (before the call's options), else why not."""
    if device.kind != "cuda":
        return "q is not on a CUDA device"
    if not device.extension:
        return "the CUDA extension flash_attn_tq_cuda is not built"
    if dtype not in HALF:
        return f"q dtype {dtype} (the kernel takes float16/bfloat16)"
    if head_dim not in FUSED_HEAD_DIMS:
        return f"head_dim {head_dim} (kernels: {FUSED_HEAD_DIMS})"
    if (spec.k_bits, spec.v_bits) not in FUSED_DECODE_BITS:
        return f"K{spec.k_bits}V{spec.v_bits} (kernels: {FUSED_DECODE_BITS})"
    if spec.grid != "uniform":
        return "the Lloyd-Max grid (the kernel folds the uniform grid's affine levels)"
    page = spec.page_size
    if page is not None and page & (page - 1):
        return f"page_size {page} (the kernels take pages of a power of two tokens)"
    if spec.rope_center and page is not None and page < 32:
        return f"key_center='rope' with {page}-token pages (its kernel takes 32 or more)"
    return None


def _options_reason(spec: CacheSpec, query: Query) -> str | None:
    """None if the fused kernels take the call's options over a cache of ``spec``, else why not."""
    if query.alibi:
        what = "alibi_slopes"
    elif (spec.fp16_window or spec.sink_tokens) and query.extras:
        what = "window_size / softcap / cache_leftpad with an fp16 window or sink tokens"
    elif spec.rope_center and query.extras:
        what = "window_size / softcap / cache_leftpad with key_center='rope'"
    elif query.softcap and spec.key_center:
        what = "softcap with key centering (the kernel's scores lack q . mu)"
    else:
        return None
    return f"{what} is not supported by the fused kernel"


def rows_per_kv_head(query: Query, kv_heads: int) -> int:
    """Query rows a kv head attends: the GQA group times ``seqlen_q`` (the kernels' M)."""
    return query.q_heads // kv_heads * query.seqlen_q


def ring_reason(spec: CacheSpec, kv_heads: int, query: Query) -> str | None:
    """None if the decode launch itself attends a cache's ring of window codes, else why the ring
    keeps a pass of its own."""
    if not spec.window_codes:
        return "no ring of window codes"
    if spec.window_bits != FUSED_RING_WINDOW_BITS or (spec.k_bits, spec.v_bits) not in FUSED_RING_BITS:
        return (
            f"no ring kernel for {spec.window_bits}-bit window codes beside K{spec.k_bits}V{spec.v_bits} "
            f"({FUSED_RING_WINDOW_BITS}-bit beside {FUSED_RING_BITS})"
        )
    if not spec.scale_only or spec.page_size is not None or not spec.side_slots:
        return "the ring's kernel takes contiguous caches with scale-only metadata and sink tokens"
    if rows_per_kv_head(query, kv_heads) >= PREFILL_MIN_ROWS:
        return "prefill-sized chunks attend the ring in a pass of their own"
    return None


def pair_reason(
    spec: CacheSpec, kv_heads: int, other: CacheSpec, other_kv_heads: int, query: Query, device: Device
) -> str | None:
    """None if one launch attends ``query`` over two head groups of a layer (this one's kv heads and
    ``other``'s, the same options but the bits), else why not (then a launch a group)."""
    reason = fused_reason(spec, query.head_dim, query.dtype, device) or fused_reason(
        other, query.head_dim, query.dtype, device
    )
    if reason is not None:
        return reason
    if ((spec.k_bits, spec.v_bits), (other.k_bits, other.v_bits)) not in FUSED_PAIR_BITS:
        return f"no one-launch kernel for K{spec.k_bits}V{spec.v_bits} beside K{other.k_bits}V{other.v_bits}"
    for field in dataclasses.fields(spec):  # (no new spec: its validation does not trace)
        if field.name not in ("k_bits", "v_bits") and getattr(spec, field.name) != getattr(other, field.name):
            return f"the head groups' caches differ in {field.name}"
    if not spec.scale_only or spec.page_size is not None or not spec.side_slots or spec.window_bits != 16:
        return "one launch takes contiguous caches with scale-only metadata and a 16-bit side"
    if spec.key_center and not spec.rope_center:
        return "post-RoPE key centering (its lse shift is a head group's own)"
    heads = kv_heads + other_kv_heads
    if query.q_heads % heads or query.q_heads // heads * query.seqlen_q >= PREFILL_MIN_ROWS:
        return "one launch takes decode-sized calls (fewer query rows a kv head than the prefill kernel's)"
    return _options_reason(spec, query)


def pair_order(specs: tuple[CacheSpec, CacheSpec], runs: tuple[bool, bool]) -> tuple[int, int] | None:
    """Which of a layer's two head groups one launch can attend as (group a, group b): b's kv heads a
    run of adjacent heads (``runs``), the two specs the same but the bits, a one-launch kernel for
    their widths; None where none can (each call's own facts: :func:`pair_reason`)."""
    for a, b in ((0, 1), (1, 0)):
        bits = ((specs[a].k_bits, specs[a].v_bits), (specs[b].k_bits, specs[b].v_bits))
        same = specs[b].replace(k_bits=specs[a].k_bits, v_bits=specs[a].v_bits) == specs[a]
        if runs[b] and same and bits in FUSED_PAIR_BITS:
            return a, b
    return None


def plan(
    spec: CacheSpec,
    kv_heads: int,
    query: Query,
    device: Device,
    pair: tuple[CacheSpec, int] | None = None,
) -> Plan:
    """How attention of ``query`` over a cache of ``spec`` with ``kv_heads`` kv heads runs on ``device``.
    ``pair = (other spec, its kv heads)``: a second head group of the layer the same launch should
    attend (:func:`pair_reason`); where it cannot, the plan is the reference's with that reason and the
    caller plans each group alone."""
    reason = fused_reason(spec, query.head_dim, query.dtype, device) or _options_reason(spec, query)
    if reason is not None:
        return Plan(None, reason)
    lse_shift = spec.key_center is True
    if pair is not None:
        reason = pair_reason(spec, kv_heads, pair[0], pair[1], query, device)
        return Plan(None, reason) if reason is not None else Plan("pair")
    if spec.window_codes:
        if ring_reason(spec, kv_heads, query) is None:
            return Plan("ring", lse_shift=lse_shift)
        return Plan(_codes_kernel(spec, kv_heads, query, device), window_pass=True, lse_shift=lse_shift)
    return Plan(_codes_kernel(spec, kv_heads, query, device), lse_shift=lse_shift)


def _codes_kernel(spec: CacheSpec, kv_heads: int, query: Query, device: Device) -> str:
    """decode, prefill or prefill-wgmma for a cache's codes: the prefill kernel (256-row CTAs over
    tiles expanded once into shared memory) from :data:`PREFILL_MIN_ROWS` query rows a kv head where
    the case table has one and its shared memory fits; its Hopper variant from :data:`WGMMA_MIN_ROWS`
    (the RoPE center's term: that variant only, else the decode kernel, which takes any row count)."""
    rows = rows_per_kv_head(query, kv_heads)
    if rows < PREFILL_MIN_ROWS or (spec.k_bits, spec.v_bits) not in PREFILL_BITS or not device.prefill_smem:
        return "decode"
    wgmma = device.wgmma and rows >= WGMMA_MIN_ROWS
    if spec.rope_center and not wgmma:
        return "decode"
    return "prefill-wgmma" if wgmma else "prefill"


def pack_reason(spec: CacheSpec, head_dim: int, dtype: torch.dtype, device: Device) -> str | None:
    """None if the quantize-on-write kernel writes new K/V of ``dtype`` into a cache of ``spec``, else why not."""
    if device.kind != "cuda" or not device.extension:
        return "not a CUDA tensor, or the extension is not built"
    if dtype not in HALF or head_dim not in FUSED_HEAD_DIMS:
        return "the kernel takes float16/bfloat16 at head_dim 64/128"
    if spec.streaming or (spec.quantizer, spec.grid, spec.fit) not in PACK_QUANTIZERS:
        streaming = " (streaming)" if spec.streaming else ""
        return f"no kernel for {spec.quantizer}/{spec.grid}/fit={spec.fit}{streaming}"
    if spec.page_size is not None and spec.page_size & (spec.page_size - 1):
        return f"page_size {spec.page_size} (the kernel takes pages of a power of two tokens)"
    return None


def write_plan(spec: CacheSpec, head_dim: int, dtype: torch.dtype, device: Device) -> WritePlan:
    """How an append of new K/V of ``dtype`` into a cache of ``spec`` writes."""
    reason = pack_reason(spec, head_dim, dtype, device)
    if reason is not None:
        return WritePlan(False, reason=reason)
    ring = (
        spec.window_codes
        and spec.window_bits == FUSED_RING_WINDOW_BITS
        and (spec.quantizer, spec.grid, spec.fit) == ("turbo", "uniform", "norm")
        and spec.page_size is None
    )
    # (health counters read the centered keys in PyTorch; a ring the kernel does not write, too)
    rope = spec.rope_center and not spec.health and (not spec.window_codes or ring)
    side = bool(spec.side_slots) and spec.dtype == dtype and (rope or not spec.rope_center)
    return WritePlan(True, side=side, rope=rope, ring=ring)


def plan_kv16(
    query: Query,
    kv_heads: int,
    kv_dtype: torch.dtype,
    page_size: int | None,
    aligned: bool,
    appends: bool,
    device: Device,
) -> Plan:
    """Attention over a float16/bfloat16 cache: our decode kernel (``kv16``) for decode-shaped calls
    (no new k / v, no rotary, window, softcap, alibi or leftpad), else the baseline (``reason``).
    ``aligned``: the cache rows are contiguous and 16-byte aligned."""
    if device.kind != "cuda":
        reason = "tensors are not on a CUDA device"
    elif not device.extension:
        reason = "the CUDA extension flash_attn_tq_cuda is not built"
    elif query.dtype not in HALF or kv_dtype != query.dtype:
        reason = "q, k_cache and v_cache must share a float16/bfloat16 dtype"
    elif query.head_dim not in FUSED_HEAD_DIMS:
        reason = f"head_dim {query.head_dim} (kernels: {FUSED_HEAD_DIMS})"
    elif not kv_heads or query.q_heads % kv_heads or rows_per_kv_head(query, kv_heads) > MAX_KV16_ROWS:
        reason = f"more than {MAX_KV16_ROWS} query rows per kv head"
    elif not aligned:
        reason = "cache rows must be contiguous and 16-byte aligned"
    elif page_size is not None and page_size & (page_size - 1):
        reason = "page size must be a power of two"
    elif appends or query.extras or query.alibi:
        reason = "new k / v, rotary, window_size, softcap, alibi or cache_leftpad"
    else:
        return Plan("kv16")
    return Plan(None, reason)


def support_matrix() -> list[dict[str, str]]:
    """The fused cases, one row a (K, V) width, for the README's support matrix (generated from the
    case table, so the two cannot drift)."""
    rows = []
    for kb, vb in FUSED_DECODE_BITS:
        pairs = [f"K{b[0]}V{b[1]}" for a, b in FUSED_PAIR_BITS if a == (kb, vb)]
        rows.append(
            {
                "K/V bits": f"K{kb}V{vb}",
                "head_dim": " / ".join(map(str, FUSED_HEAD_DIMS)),
                "decode": "yes",
                "prefill kernel": f"from {PREFILL_MIN_ROWS} rows a kv head"
                if (kb, vb) in PREFILL_BITS
                else "decode kernel",
                "one launch beside": ", ".join(pairs) or "–",
                "window codes in the launch": f"{FUSED_RING_WINDOW_BITS}-bit" if (kb, vb) in FUSED_RING_BITS else "–",
            }
        )
    return rows
