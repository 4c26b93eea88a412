"""Hugging Face transformers (>= 5) integration: a quantized KV cache for ``generate``.

Usage::

    from flash_attn_tq.integrations.transformers import TQCache  # registers "tq_kvcache"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="tq_kvcache")
    out = model.generate(ids, past_key_values=TQCache.calibrated(model), max_new_tokens=...)

:class:`TQCache` keeps one :class:`~flash_attn_tq.QuantizedKVCache` per decoder layer (one per head
group with per-head widths); the attention function registered as ``"tq_kvcache"`` attends over it
with :func:`flash_attn_tq.flash_attn_with_kvcache` (the fused kernels on a GPU, the reference path on
the CPU). Llama-family models (GQA, RoPE applied before the cache update). What a layer holds by
default (:data:`~flash_attn_tq.integrations.options.DEFAULTS`): 16 sink tokens and the last 112
tokens in 16-bit, every token as 3-bit codes + a float16 scale, 4-bit keys in the last layers, keys
centered before RoPE. :meth:`TQCache.calibrated` measures on the model where wider keys and the 8-bit
copy head go (:mod:`flash_attn_tq.integrations.calibration`).

The prompt (the first forward) attends in full precision over its own keys (``prefill="full"``; its
K/V are quantized into the cache as they are written); later tokens attend over the quantized cache.
``prefill="quantized"`` makes the prompt attend over the quantized cache too. Layers in
``protected_layers`` keep a plain 16-bit cache. Batches must not be padded.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from ..optional_deps import transformers_missing

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # without transformers, or an older one
    raise transformers_missing("flash_attn_tq.integrations.transformers", e) from e

from .. import dispatch
from ..cache import QuantizedKVCache
from ..health import PackErrors, health_reports
from ..interface import attend_with_plan
from ..ops import capturing
from ..spec import CacheSpec, is_int
from .calibration import calibrated_cache
from .options import (
    ATTN_IMPLEMENTATION,
    DEFAULTS,
    NO_FP16_WINDOW,
    head_dim_of,
    late_layers,
    override,
    rope_inv_freq,
    tq_spec,
)
from .parallel import first_kv_head


def _check_no_padding(attention_mask, layer: "TQLayer", query_len: int) -> None:
    """Raise for a padded batch: a masked key among the layer's tokens in the last query row. Checked
    for chunks (a prompt, where padding comes in), not for single decode tokens (a sync a layer)."""
    if query_len == 1 or capturing():
        return
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
        if not bool(attention_mask[:, :, -1, : layer.length].all()):
            raise NotImplementedError("TQCache does not support padded batches (use equal-length prompts)")


def _adjacent(heads: tuple[int, ...]) -> bool:
    """Whether a head group's kv heads are a run of adjacent heads (its tensors: slices of the layer's)."""
    return heads == tuple(range(heads[0], heads[-1] + 1))


class TQLayer(CacheLayerMixin):
    """One decoder layer's cache: QuantizedKVCaches holding its tokens (their first ``sink_tokens``
    and the recent window also in 16-bit, attended by the same kernel launch as the codes).

    The kv heads are held in one QuantizedKVCache, or, with ``head_options`` (per-head bit widths),
    in one a *head group*: the heads that share their options. Heads attend independently (each query
    head reads one kv head), so a group is attended on its own and its query heads' outputs put in
    place: no merging of partial softmaxes.

    With ``max_cache_len`` the capacity is fixed once the prompt has run, and a decode step traced by
    ``torch.compile`` reads no host-side counter (see :attr:`TQCache.is_compileable`)."""

    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        spec: CacheSpec,
        *,
        head_specs: Mapping[int, CacheSpec] | None = None,
        max_cache_len: int | None = None,
        prefill: str = "full",
        pack_errors: PackErrors | None = None,
        checks_pack_errors: bool = True,
        model_kv_heads: int | None = None,
        tp_rank: int | None = None,
    ):
        super().__init__()
        self.pack_errors = pack_errors  # shared with the other layers (None: each append checks its own)
        self.checks_pack_errors = checks_pack_errors  # this layer reads them back (the last quantized one)
        self.spec = spec  # the layer's (its kv heads', but those of head_specs)
        self.head_specs = {int(h): s for h, s in (head_specs or {}).items()}  # by the model's kv head
        self.model_kv_heads = model_kv_heads  # the config's (None: the layer's own count)
        self.tp_rank = tp_rank  # (None: torch.distributed's, where the layer sees a shard of the heads)
        self.first_head = 0  # the model's index of the layer's first kv head (set on the first update)
        self.max_cache_len = max_cache_len
        self.prefill = prefill
        self.groups: list[tuple[int, ...]] = []  # kv heads of each head group (set on the first update)
        self.group_specs: list[CacheSpec] = []  # (the 16-bit dtype: the model's, set with the groups)
        self.caches: list[QuantizedKVCache] = []  # one a group (created on the first token)
        self._runs: list[tuple[int, int]] | None = None  # (set with the groups)
        self._pair: tuple[int, int] | None = None  # two head groups one launch attends (set with the groups)
        self._length: int | None = 0  # tokens seen (None after traced steps: see length)
        self.first_chunk = True  # the last update was the sequence's first (its prompt)
        self.pending = None  # (k, v) of the last update, written by commit() (it needs the queries)

    @property
    def qcache(self) -> QuantizedKVCache | None:
        """The layer's QuantizedKVCache (None before the first quantized token). A layer whose heads
        are held in several head groups has none: see :attr:`caches` and :meth:`dequantize`."""
        if len(self.groups) > 1:
            raise AttributeError("this TQLayer holds its kv heads in several caches (head_options): use .caches")
        return self.caches[0] if self.caches else None

    # -- storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        # 16-bit storage dtype of the window and sinks (a float32 model stores float16)
        self.store_dtype = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else torch.float16
        self.batch_size, self.num_kv_heads, self.head_dim = B, H, D
        total = self.model_kv_heads or H
        bad = [h for h in self.head_specs if not 0 <= h < total]
        if bad:
            raise ValueError(f"head_options: kv head {bad[0]} out of range (the model has {total} kv heads)")
        # under tensor parallelism the layer sees a run of the model's kv heads (parallel.first_kv_head)
        self.first_head = first = first_kv_head(H, self.model_kv_heads, self.tp_rank)
        by_spec: dict[CacheSpec, list[int]] = {}  # heads of one spec share a group, in the order of their first head
        for h in range(H):
            by_spec.setdefault(self.head_specs.get(first + h, self.spec), []).append(h)
        self.groups = [tuple(heads) for heads in by_spec.values()]
        self.group_specs = [spec.replace(dtype=self.store_dtype) for spec in by_spec]
        # per group: its kv heads as an index tensor (None: one group of every head), or, where every
        # group is a run of adjacent heads, the runs' bounds: slices and a concatenation, no gathers
        self._index = [
            None if len(self.groups) == 1 else torch.tensor(heads, device=self.device) for heads in self.groups
        ]
        runs = all(map(_adjacent, self.groups))
        self._runs = [(heads[0], heads[-1] + 1) for heads in self.groups] if runs and len(self.groups) > 1 else None
        self._pair = self._one_launch_pair()
        self.is_initialized = True

    def _one_launch_pair(self) -> tuple[int, int] | None:
        """(a, b): two head groups one kernel launch can attend (group b a run of adjacent kv heads;
        :func:`dispatch.pair_order`), else None."""
        if len(self.groups) != 2:
            return None
        return dispatch.pair_order(tuple(self.group_specs), tuple(_adjacent(heads) for heads in self.groups))

    def _head_index(self, group: int, per_kv_head: int = 1) -> torch.Tensor | None:
        """Head group ``group``'s kv heads, or its query heads (``per_kv_head`` a kv head, in the order
        transformers' GQA repeats them); None when the group holds every head."""
        idx = self._index[group]
        if idx is None or per_kv_head == 1:
            return idx
        return (idx[:, None] * per_kv_head + torch.arange(per_kv_head, device=idx.device)).flatten()

    def _heads(self, x: torch.Tensor, group: int, per_kv_head: int = 1) -> torch.Tensor:
        """``x [B, n, heads, D]`` restricted to head group ``group``'s heads (see _head_index): a view
        where the groups are runs of adjacent heads."""
        if self._runs is not None:
            lo, hi = self._runs[group]
            return x[:, :, lo * per_kv_head : hi * per_kv_head]
        idx = self._head_index(group, per_kv_head)
        return x if idx is None else x.index_select(2, idx.to(x.device))

    @property
    def is_compileable(self) -> bool:
        """A fixed capacity (``max_cache_len``): see :attr:`TQCache.is_compileable`."""
        return self.max_cache_len is not None

    @property
    def length(self) -> int:
        """Tokens in the layer. Steps traced by ``torch.compile`` do not count them on the host (a
        host counter would be a guard, one graph a step): the first read after them syncs once."""
        if self._length is None:
            self._length = int(self.caches[0].seqlens[0])
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n

    def _new_qcache(self, group: int, capacity: int) -> QuantizedKVCache:
        qc = QuantizedKVCache(
            self.batch_size,
            capacity,
            len(self.groups[group]),
            self.head_dim,
            spec=self.group_specs[group],
            device=self.device,
        )
        if self.max_cache_len is not None:  # fixed capacity: tensors a compiled step may use as they are
            for t in qc.static_tensors():  # (a CUDA graph copies any other input every replay)
                torch._dynamo.mark_static_address(t)
        return qc

    def _ensure_capacity(self, needed: int) -> None:
        if not self.caches:
            cap = self.max_cache_len or max(1024, 1 << math.ceil(math.log2(max(needed, 1))))
            self.caches = [self._new_qcache(g, max(cap, needed)) for g in range(len(self.groups))]
            return
        for g, old in enumerate(self.caches):
            if needed <= old.max_seqlen:
                continue
            new = self._new_qcache(g, max(needed, 2 * old.max_seqlen))
            old.copy_into(new)
            self.caches[g] = new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take new ``[B, Hkv, n, D]`` key/value states; returns them (marked for the attention function,
        which writes them into the quantized cache with :meth:`commit`)."""
        if self.pending is not None:
            raise RuntimeError(
                f"TQCache: the attention function did not consume the last update; load the model "
                f"with attn_implementation={ATTN_IMPLEMENTATION!r}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        k = key_states.transpose(1, 2)
        v = value_states.transpose(1, 2)
        if k.dtype == torch.float64:  # (float64 models, e.g. for exact checks: the codec takes float32)
            k, v = k.float(), v.float()
        if torch.compiler.is_compiling():  # a traced step: no host counter read, the capacity as it is
            if not self.caches or self.max_cache_len is None:
                raise RuntimeError(
                    "TQCache: torch.compile traces decode steps over a cache built with max_cache_len, "
                    "after an eager first forward (the prompt), as transformers' generate runs them"
                )
            self.first_chunk, self._length = False, None
        else:
            self._ensure_capacity(self.length + n)
            self.first_chunk, self.length = self.length == 0, self.length + n
        self.pending = (k, v)
        key_states = key_states.view(key_states.shape)
        key_states._tq_layer = self  # read by tq_attention_forward (torch.compile tracks the attribute too)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.caches and self.max_cache_len is not None:  # one mask shape a step, as a compiled step needs
            return self.caches[0].max_seqlen, 0  # (the kernels take the lengths from the cache)
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        if torch.compiler.is_compiling() and self.caches:  # a traced step: the GPU's count (no sync, no guard)
            return self.caches[0].seqlens[0]
        return self.length

    def get_max_length(self) -> int:
        return self.caches[0].max_seqlen if self.caches and self.max_cache_len is not None else -1

    def reset(self) -> None:
        self.caches = []
        self.pending = None
        self.length, self.first_chunk = 0, True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TQCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers' convention; a positive value is
        the length to keep, its older one): assisted generation's rollback of rejected draft tokens.
        Each head group's :meth:`QuantizedKVCache.crop` gives the recent 16-bit slots the dropped
        tokens took back to the tokens they displaced (as they were, after an append of up to the
        window's length; else from those positions' codes)."""
        if self.pending is not None:
            raise RuntimeError("TQCache: crop between an update and its attention call")
        n = self.length
        keep = n + int(tokens_to_remove) if tokens_to_remove <= 0 else min(int(tokens_to_remove), n)
        if keep < 0:
            raise ValueError(f"tokens_to_remove: {-int(tokens_to_remove)} is more than the {n} tokens held")
        if keep == n or not self.caches:
            return
        for qc in self.caches:
            qc.crop(keep)
        self.length = keep

    def offload(self):
        pass

    def prefetch(self):
        pass

    def commit(self) -> None:
        """Quantize the pending K/V into the cache (each head group its heads')."""
        if self.pending is not None:
            k, v = self.pending
            self.pending = None
            flags = self.pack_errors.buffer(k.device) if self.pack_errors is not None and k.is_cuda else None
            for g, qc in enumerate(self.caches):
                qc.append(self._heads(k, g), self._heads(v, g), error_flags=flags)
            if flags is not None and self.checks_pack_errors:
                self.pack_errors.check()

    def dequantize(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds, all kv heads: ``(k, v)`` float32 ``[B, n, Hkv, D]`` for its ``n`` tokens
        (QuantizedKVCache.dequantize of each head group: sinks and window in 16-bit; ``window``: the
        recent tokens read from the 16-bit side instead of the window)."""
        n = int(self.caches[0].seqlens[0])
        k = torch.empty(self.batch_size, n, self.num_kv_heads, self.head_dim, device=self.device)
        v = torch.empty_like(k)
        for heads, qc in zip(self.groups, self.caches):
            kd, vd = qc.dequantize(window=window)
            k[:, :, list(heads)], v[:, :, list(heads)] = kd[:, :n].float(), vd[:, :n].float()
        return k, v

    # -- attention
    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query ``[B, Hq, Sq, D]`` (the last Sq tokens) -> output ``[B, Sq, Hq, D]``: causal attention
        over the layer's caches, a launch a head group, or one launch for two head groups that differ
        in bits only (a 3-bit group beside K8V8 heads). Each cache plans a call shape once
        (:meth:`QuantizedKVCache.plan`); every later step reuses the plan."""
        q = query.transpose(1, 2)
        G = q.shape[2] // self.num_kv_heads
        if self._pair is not None:  # both head groups in one launch where the call and device allow it
            a, b = self._pair
            qa, qb = self.caches[a], self.caches[b]
            group2 = (qb, self.groups[b][0])
            plan = qa.plan(dispatch.Query(*q.shape[1:], qa.dtype), pair=group2)
            if plan.fused:
                return attend_with_plan(q.to(qa.dtype), qa, plan, scaling, group2=group2).to(query.dtype)
        outs = []
        for g, qc in enumerate(self.caches):
            qg = self._heads(q, g, G)
            qq = qg.to(qc.dtype) if qg.is_cuda else (qg.float() if qg.dtype == torch.float64 else qg)
            outs.append(attend_with_plan(qq, qc, qc.plan(dispatch.Query.of(qq)), scaling))
        if len(self.caches) == 1:
            return outs[0].to(query.dtype)
        if self._runs is not None:  # the groups' heads in head order already
            order = sorted(range(len(outs)), key=lambda g: self._runs[g][0])
            return torch.cat([outs[g] for g in order], 2).to(query.dtype)
        out = q.new_empty(*q.shape[:3], outs[0].shape[-1], dtype=outs[0].dtype)  # query heads back in place
        for g in range(len(self.caches)):
            out[:, :, self._head_index(g, G).to(q.device)] = outs[g]
        return out.to(query.dtype)


def _layer_index(name: str, i, num_layers: int | None) -> int:
    """A layer index of ``name`` (protected_layers, layer_options), in range when the layer count is known."""
    if not is_int(i) or i < 0 or (num_layers is not None and i >= num_layers):
        bound = f" (the model has {num_layers} layers)" if num_layers is not None else ""
        raise ValueError(f"{name}: layer indices must be ints >= 0{bound}, got {i!r}")
    return int(i)


class TQCache(Cache):
    """A transformers ``Cache`` whose layers hold 3-bit quantized K/V (see the module docstring).

    Args:
        config: the model config (optional; its layer count and head_dim place ``late_k_bits``, its
            RoPE frequencies the ``key_center="rope"`` default).
        spec: the layers' :class:`~flash_attn_tq.CacheSpec`; without one, :data:`DEFAULTS` with the
            keyword options over them (``scale_only`` off where the options do not allow it).
        max_cache_len: capacity in tokens a layer. Eager forwards grow it (doubling) when exceeded;
            it also makes the cache compileable (:attr:`is_compileable`), and compiled steps keep it
            fixed.
        protected_layers: layer indices kept in a plain 16-bit cache.
        prefill: ``"full"`` (the first forward attends over its own full-precision K/V) or
            ``"quantized"`` (it attends over the quantized cache, as token-by-token decoding would).
        late_k_bits: key bits of the last layers, as many as scale-only metadata pays for (see
            :data:`DEFAULTS`; needs ``config`` for the layer count and head_dim; None: ``k_bits`` in
            every layer).
        layer_options: per-layer overrides of the spec, ``{layer index: {option: value}}``, applied
            after ``late_k_bits``.
        head_options: per-head overrides on top, ``{(layer index, kv head): {option: value}}`` (e.g. 8-bit
            keys for the few heads copying depends on: :meth:`calibrated`); a layer then holds its
            kv heads in one QuantizedKVCache per distinct spec (see :class:`TQLayer`).
        tp_rank: under tensor parallelism (transformers' ``tp_plan``), this process's rank in the group
            that splits the kv heads: each rank's cache holds its own heads, and ``head_options`` name
            the model's (:mod:`~flash_attn_tq.integrations.parallel`). Default: torch.distributed's
            rank where a layer sees fewer kv heads than ``config`` has (the group is every process).
        **options: the spec's fields (k_bits, v_bits, sink_tokens, fp16_window, key_center, ...) over
            ``spec`` or the defaults.
    """

    def __init__(
        self,
        config=None,
        *,
        spec: CacheSpec | None = None,
        max_cache_len: int | None = None,
        protected_layers: Iterable[int] = (),
        prefill: str = "full",
        layer_options: Mapping[int, Mapping] | None = None,
        head_options: Mapping[tuple[int, int], Mapping] | None = None,
        tp_rank: int | None = None,
        **options,
    ):
        super().__init__(layers=[])
        if prefill not in ("full", "quantized"):
            raise ValueError(f"prefill must be 'full' or 'quantized', got {prefill!r}")
        if config is not None and not hasattr(config, "num_hidden_layers"):
            raise TypeError(
                f"config must be the model's config (a transformers PretrainedConfig), got {type(config).__name__}"
            )
        if max_cache_len is not None and (not is_int(max_cache_len) or max_cache_len <= 0):
            raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        if tp_rank is not None and (not is_int(tp_rank) or tp_rank < 0):
            raise ValueError(f"tp_rank must be a rank (an int >= 0) or None, got {tp_rank!r}")
        self.tp_rank = None if tp_rank is None else int(tp_rank)
        self.spec, late_k_bits = tq_spec(config, spec, options)
        self.initial_capacity = max_cache_len
        self.num_layers = getattr(config, "num_hidden_layers", None)
        self.protected_layers = frozenset(
            _layer_index("protected_layers", i, self.num_layers) for i in protected_layers
        )
        self.prefill = prefill
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        head_dim = head_dim_of(config) if config is not None and getattr(config, "num_attention_heads", None) else None
        if head_dim is not None:
            self.spec.check_head_dim(head_dim)
        late = set()
        if self.num_layers is not None and head_dim is not None:
            quantized = [i for i in range(self.num_layers) if i not in self.protected_layers]
            late = late_layers(quantized, head_dim, self.spec.k_bits, late_k_bits, self.spec.scale_only)
        elif "late_k_bits" in options and late_k_bits is not None:
            raise ValueError("late_k_bits needs the model config (layer count and head_dim): TQCache(config, ...)")
        self.layer_options = {i: {"k_bits": int(late_k_bits)} for i in sorted(late)}
        for i, o in (layer_options or {}).items():
            self.layer_options.setdefault(_layer_index("layer_options", i, self.num_layers), {}).update(o)
        self._layer_specs = {i: override(self.spec, o, f"layer_options[{i}]") for i, o in self.layer_options.items()}
        self.head_options, self._head_specs = {}, {}
        for key, o in (head_options or {}).items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"head_options: keys are (layer, kv head) pairs, got {key!r}")
            i, h = _layer_index("head_options", key[0], self.num_layers), int(key[1])
            if i in self.protected_layers:
                raise ValueError(f"head_options[{key}]: layer {i} is protected")
            if self.num_kv_heads is not None and not 0 <= h < self.num_kv_heads:
                raise ValueError(f"head_options[{key}]: kv head {h} out of range ({self.num_kv_heads} kv heads)")
            self.head_options[(i, h)] = dict(o)
            self._head_specs[(i, h)] = override(self.layer_spec(i), o, f"head_options[{key}]")
        self.pack_errors = PackErrors()

    @classmethod
    def calibrated(cls, model, **kwargs) -> "TQCache":
        """A TQCache for ``model`` with its widths measured on the model itself, once per model (keep
        ``cache.layer_options`` / ``cache.head_options`` to reuse them), in the default's bits budget
        (3.5 bits/element at head_dim 64, 3.25 at 128): ``copy_heads`` kv heads at K8V8 where copying
        needs them, then 4-bit keys in the most sensitive layers (``per_head=True``: (K, V) widths a
        kv head). The measurement's keyword arguments (``per_head``, ``bits``, ``widths``,
        ``fine_budget``, ``copy_heads``, ``sensitivity``, ``copy_sensitivity``) and their costs:
        :func:`flash_attn_tq.integrations.calibration.calibrated_cache`; the other ``kwargs`` are
        TQCache arguments (``spec``, options, ``layer_options`` on top)."""
        return calibrated_cache(cls, model, **kwargs)

    @property
    def is_compileable(self) -> bool:
        """True with ``max_cache_len`` and no protected layers: transformers' ``generate`` then runs the
        prompt eagerly and the decode steps through ``torch.compile`` (CUDA graphs), as for its
        StaticCache. A compiled step reads nothing back: a step past the capacity is not written
        and sets a pack error, raised by ``cache.pack_errors.check()`` (or the next eager forward)."""
        return self.initial_capacity is not None and not self.protected_layers

    @property
    def sink_tokens(self) -> int:
        return self.spec.sink_tokens

    def layer_spec(self, idx: int) -> CacheSpec:
        """The spec of layer ``idx``'s kv heads (the TQCache's, with its layer_options)."""
        return self._layer_specs.get(idx, self.spec)

    def head_spec(self, idx: int, head: int) -> CacheSpec:
        """The spec of kv head ``head`` of layer ``idx`` (its layer's, with its head_options)."""
        return self._head_specs.get((idx, head), self.layer_spec(idx))

    def _make_layer(self, idx: int) -> CacheLayerMixin:
        if idx in self.protected_layers:
            from transformers.cache_utils import DynamicLayer

            return DynamicLayer()
        quantized = [i for i in range(self.num_layers or 0) if i not in self.protected_layers]
        checks = not quantized or idx == quantized[-1]  # (layer count unknown: every layer checks)
        heads = {h: spec for (i, h), spec in self._head_specs.items() if i == idx}
        return TQLayer(
            self.layer_spec(idx),
            head_specs=heads,
            max_cache_len=self.initial_capacity,
            prefill=self.prefill,
            pack_errors=self.pack_errors,
            checks_pack_errors=checks,
            model_kv_heads=self.num_kv_heads,
            tp_rank=self.tp_rank,
        )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(self._make_layer(len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def bits_per_element(self, head_dim: int, num_layers: int | None = None, num_kv_heads: int | None = None) -> float:
        """Average stored bits per K/V element over the layers and kv heads (16 for protected layers;
        codes + metadata for the others; the fp16 window and sink tokens are not counted)."""
        L = num_layers or self.num_layers
        if L is None:
            raise ValueError("pass num_layers (or build the TQCache with the model config)")
        H = num_kv_heads or self.num_kv_heads or 1 + max((h for _, h in self.head_options), default=0)
        total = 0.0
        for i in range(L):
            if i in self.protected_layers:
                total += 16.0
                continue
            total += sum(self.head_spec(i, h).bits_per_element(head_dim) for h in range(H)) / H
        return total / L

    def health(self) -> list[dict | None]:
        """Each layer's health counters (``TQCache(..., health=True)``), its head groups summed, with
        one host sync (see :func:`flash_attn_tq.health.health_reports`); None for layers without codes."""
        groups = [getattr(layer, "caches", None) for layer in self.layers]
        reports = iter(health_reports([g for g in groups if g]))
        return [next(reports) if g else None for g in groups]

    def quantized_caches(self) -> list:
        """Each layer's QuantizedKVCache: None for protected or not-yet-used layers, a tuple of them for
        a layer held in several head groups (``head_options``; ``layers[i].groups`` gives their heads)."""
        out = []
        for layer in self.layers:
            caches = getattr(layer, "caches", None)
            out.append(None if not caches else (caches[0] if len(caches) == 1 else tuple(caches)))
        return out


def tq_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """The ``"tq_kvcache"`` attention function (transformers' AttentionInterface signature).

    Over a :class:`TQCache` layer it attends with :func:`flash_attn_with_kvcache` over the quantized
    cache (+ sink tokens); anything else (no cache, protected layers, the full-precision prefill)
    goes to transformers' SDPA attention. Returns ``(out [B, Sq, Hq, D], None)``.
    """
    layer = getattr(key, "_tq_layer", None)
    if layer is not None:
        layer.commit()
    if layer is None or (layer.prefill == "full" and layer.first_chunk):
        if layer is not None:
            _check_no_padding(attention_mask, layer, query.shape[2])
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _check_no_padding(attention_mask, layer, query.shape[2])
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(query, scaling), None


def register() -> None:
    """Register ``"tq_kvcache"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, tq_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()

__all__ = [
    "TQCache",
    "TQLayer",
    "tq_attention_forward",
    "register",
    "rope_inv_freq",
    "ATTN_IMPLEMENTATION",
    "DEFAULTS",
    "NO_FP16_WINDOW",
]
