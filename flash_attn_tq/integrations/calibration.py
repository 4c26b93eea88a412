"""Where a model needs its cache's finer codes: per-layer key widths, per-head widths and the copy
heads, measured on the model itself (the KL of its predictions with one layer or head quantized at a
time, over a synthetic sequence with a repeated span), and the exact allocations of a bit budget.
:meth:`flash_attn_tq.integrations.transformers.TQCache.calibrated` is the entry point; the functions that
measure take the cache class they measure through (``cache_cls=TQCache``)."""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

import torch

from ..spec import CacheSpec
from .options import ATTN_IMPLEMENTATION, DEFAULTS, head_dim_of, late_layers, tq_spec
from .parallel import agree, tp_rank_of


def _measuring(cache_cls, what: str):
    """The cache class a measurement runs its forwards through (TQCache: the caller's, so this module
    does not depend on the one that defines it)."""
    if cache_cls is None:
        raise ValueError(f"{what}: pass cache_cls=TQCache (the cache the measurement runs through) or a sensitivity")
    return cache_cls


def allocate_key_bits(
    kl: Mapping[tuple[int, int], float], layers: Iterable[int], extra: int, base: int = 3
) -> dict[int, int]:
    """Key bits a layer that minimise the summed sensitivity ``kl[(layer, bits)]`` (bits in base - 1,
    base, base + 1 where measured) with at most ``extra`` more bits than ``base`` in total over the
    layers: the ``extra`` best raises are free, and each further raise is paid for by a lowering while
    its gain exceeds the lowering's loss."""
    layers = list(layers)
    gain = {i: kl[(i, base)] - kl[(i, base + 1)] for i in layers if (i, base + 1) in kl}
    loss = {i: kl[(i, base - 1)] - kl[(i, base)] for i in layers if (i, base - 1) in kl}
    ups = sorted((i for i in gain if gain[i] > 0), key=lambda i: -gain[i])
    downs = sorted(loss, key=lambda i: loss[i])
    raised = ups[:extra]
    lowered: list[int] = []
    rest = [i for i in downs if i not in raised]
    for i in ups[extra:]:  # a further raise, paid for by the cheapest lowering left
        cheapest = next((j for j in rest if j != i), None)
        if cheapest is None or gain[i] <= loss[cheapest]:
            break
        raised.append(i)
        lowered.append(cheapest)
        rest = [j for j in rest if j not in (i, cheapest)]
    bits = {i: base for i in layers}
    bits.update({i: base + 1 for i in raised})
    bits.update({i: base - 1 for i in lowered})
    return bits


def copy_sequence(
    config, tokens: int, span: int, seed: int, device, text_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``[1, tokens + span]`` token ids: ``tokens`` random ids (or, with ``text_ids``, ``tokens`` of
    them from offset ``seed * tokens``, wrapping), then the ``span`` of them that starts a third of the
    way in, repeated (copying: what key precision decides; no text needed)."""
    if text_ids is None:
        g = torch.Generator().manual_seed(seed)
        body = torch.randint(0, config.vocab_size, (tokens,), generator=g)
    else:
        text_ids = text_ids.reshape(-1).cpu()
        if text_ids.numel() < tokens:
            raise ValueError(f"text_ids holds {text_ids.numel()} tokens; the sequence needs {tokens}")
        start = (seed * tokens) % (text_ids.numel() - tokens + 1)
        body = text_ids[start : start + tokens]
    return torch.cat([body, body[tokens // 3 : tokens // 3 + span]])[None].to(device)


COPY_SKIP = 8  # the repeat's first tokens are not yet predictable (the copy-retrieval metric skips them too)


def copy_span_kl(kl: torch.Tensor, span: int = 64) -> float:
    """Mean of a per-position KL ``[tokens + span]`` over the predictions of the repeated span's
    tokens ``COPY_SKIP..span-1`` (the last ``span - COPY_SKIP`` predictions made inside the sequence)."""
    return kl[-span + COPY_SKIP - 1 : -1].mean().item()


OBJECTIVES = {"sequence": lambda kl, span: kl.mean().item(), "copy": copy_span_kl}


@torch.no_grad()
def _layer_alone(cls, cfg, spec, layer: int, **options):
    """A cache of ``cls`` that quantizes only ``layer`` (the others protected, the prompt quantized):
    the sensitivity sweeps' candidate."""
    others = [j for j in range(cfg.num_hidden_layers) if j != layer]
    return cls(cfg, spec=spec, protected_layers=others, prefill="quantized", late_k_bits=None, **options)


def _kl_from_full(model, ids: torch.Tensor, caches: Iterable, reduce=lambda kl: kl.mean().item()) -> list:
    """``reduce`` of the per-position KL divergence ``[tokens]`` of the next-token distributions over
    ``ids`` from full precision (default: the mean), one a ``TQCache`` of ``caches`` (a fresh one a
    forward)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)
        out = []
        for cache in caches:
            lp = torch.log_softmax(model(ids, past_key_values=cache).logits[0].float(), -1)
            out.append(reduce((ref.exp() * (ref - lp)).sum(-1)))
        return out
    finally:
        model.set_attn_implementation(previous)


def key_bit_sensitivity(
    model,
    *,
    tokens: int = 1024,
    span: int = 64,
    seed: int = 0,
    bits: Iterable[int] = (2, 3, 4),
    protected_layers: Iterable[int] = (),
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[tuple[int, int], float]:
    """How much quantizing one layer's keys moves the model: ``{(layer, key bits): KL}``.

    A synthetic sequence (``tokens`` random token ids, a ``span``-token stretch of them repeated at
    the end: the copying that key precision decides; no text needed) runs once in full precision and
    then once per layer and key width with only that layer quantized through :class:`TQCache`
    (``cache_kwargs``, ``prefill="quantized"``: the sequence attends over its quantized cache in one
    forward, so the fp16 window holds only its last ``fp16_window`` tokens and most queries see
    quantized keys where decoding would show them their recent tokens in 16-bit: a harsher measure
    than decoding). The value is the mean KL divergence of the next-token distributions from full
    precision. Costs ``len(bits) x layers`` forwards of the sequence.
    """
    cfg = model.config
    cls = _measuring(cache_cls, "key_bit_sensitivity")
    protected = frozenset(int(i) for i in protected_layers)
    runs = [
        (i, b) for i in range(cfg.num_hidden_layers) if i not in protected for b in sorted(set(int(b) for b in bits))
    ]

    def caches():
        for i, b in runs:
            yield _layer_alone(cls, cfg, spec, i, **dict(cache_kwargs, k_bits=b))

    ids = copy_sequence(cfg, tokens, span, seed, next(model.parameters()).device)
    return dict(zip(runs, _kl_from_full(model, ids, caches())))


FINE_BITS = 8  # the codes of the heads a sensitivity measurement holds near full precision (error ~1e-4 of 3-bit)
# (K bits, V bits) a head may get from calibrate_head_bits (fused kernels: K8V3 / K8V8 on float16 models):
# 8-bit codes for the few heads copying rests on, keys and values (SmolLM2's copying needs both). With
# (4, 3) allowed too, the whole-sequence KL spends the budget as 4-bit keys over 36 of 90 heads instead.
HEAD_WIDTHS = ((3, 3), (8, 3), (8, 8))


def head_sensitivity(
    model,
    *,
    tokens: int = 1024,
    span: int = 64,
    seed: int = 0,
    key_bits: Iterable[int] = (3, 4),
    value_bits: Iterable[int] = (3,),
    protected_layers: Iterable[int] = (),
    objective="sequence",
    text_ids: torch.Tensor | None = None,
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[tuple[int, int, int, int], float]:
    """:func:`key_bit_sensitivity` a kv head at a time, keys and values: ``{(layer, kv head, K bits,
    V bits): KL}``.

    One layer is quantized a forward, every K/V of it at :data:`FINE_BITS` (near full precision) but
    one head's keys at ``key_bits`` (its values fine) or its values at ``value_bits`` (its keys fine);
    ``(FINE_BITS, FINE_BITS)`` is the layer's floor, shared by its heads. Costs ``((len(key_bits) +
    len(value_bits)) x kv heads + 1) x layers`` forwards of the synthetic sequence.

    ``objective``: what a forward's per-position KL is reduced to: ``"sequence"`` (its mean),
    ``"copy"`` (its mean over the repeated span's predictions, :func:`copy_span_kl`: the copying
    alone), or a callable ``(kl [tokens + span], span) -> value``. ``text_ids``: real text in place of
    the random ids (a sample of the traffic; see :func:`copy_sequence`)."""
    cfg = model.config
    cls = _measuring(cache_cls, "head_sensitivity")
    H = cfg.num_key_value_heads
    protected = frozenset(int(i) for i in protected_layers)
    F = FINE_BITS
    widths = [(int(b), F) for b in sorted(set(key_bits)) if b != F] + [
        (F, int(b)) for b in sorted(set(value_bits)) if b != F
    ]
    runs = []
    for i in range(cfg.num_hidden_layers):
        if i not in protected:
            runs += [(i, h, kb, vb) for h in range(H) for kb, vb in widths] + [(i, -1, F, F)]

    def caches():
        for i, h, kb, vb in runs:
            heads = {(i, g): dict(k_bits=kb, v_bits=vb) if g == h else dict(k_bits=F, v_bits=F) for g in range(H)}
            yield _layer_alone(cls, cfg, spec, i, head_options=heads, **cache_kwargs)

    ids = copy_sequence(cfg, tokens, span, seed, next(model.parameters()).device, text_ids)
    reduce = OBJECTIVES[objective] if isinstance(objective, str) else objective
    out = {}
    for (i, h, kb, vb), v in zip(runs, _kl_from_full(model, ids, caches(), lambda kl: reduce(kl, span))):
        out.update({(i, h, kb, vb): v} if h >= 0 else {(i, g, kb, vb): v for g in range(H)})
    return out


def head_kl(kl: Mapping[tuple[int, int, int, int], float], head: tuple[int, int], k_bits: int, v_bits: int) -> float:
    """The sensitivity of ``head`` at (k_bits, v_bits) from :func:`head_sensitivity`'s one-sided
    measurements, the key and value parts taken as additive: KL(k, F) + KL(F, v) - KL(F, F)."""
    F = FINE_BITS
    return kl[(*head, k_bits, F)] + kl[(*head, F, v_bits)] - kl[(*head, F, F)]


def allocate_head_bits(
    kl: Mapping[tuple[int, int, int, int], float],
    heads: Iterable[tuple[int, int]],
    budget: int,
    widths: Iterable[tuple[int, int]] = HEAD_WIDTHS,
    base: tuple[int, int] = (3, 3),
) -> dict[tuple[int, int], tuple[int, int]]:
    """(K bits, V bits) a (layer, kv head), among ``widths`` (those :func:`head_kl` can estimate), that
    minimise the summed sensitivity with at most ``budget`` more bits than ``base`` in total (a head
    at (k, v) costs k + v - sum(base)): an exact knapsack over the heads."""
    heads = list(heads)
    budget = max(int(budget), 0)
    base = tuple(base)
    best = [0.0] * (budget + 1)  # best[c]: the largest total gain at cost <= c over the heads so far
    picks = []
    for hd in heads:
        options = []
        for w in widths:
            try:
                options.append((tuple(w), w[0] + w[1] - sum(base), head_kl(kl, hd, *base) - head_kl(kl, hd, *w)))
            except KeyError:  # not measured
                continue
        choice = [base] * (budget + 1)
        new = list(best)
        for c in range(budget + 1):
            for w, cost, gain in options:
                if 0 < cost <= c and best[c - cost] + gain > new[c]:
                    new[c], choice[c] = best[c - cost] + gain, w
        best = new
        picks.append(choice)
    out, c = {}, budget
    for hd, choice in zip(reversed(heads), reversed(picks)):
        out[hd] = choice[c]
        c -= sum(choice[c]) - sum(base)
    return {hd: out[hd] for hd in heads}


def calibrate_key_bits(
    model,
    *,
    bits: Iterable[int] = (3, 4),
    protected_layers: Iterable[int] = (),
    sensitivity: Mapping[tuple[int, int], float] | None = None,
    spent: int = 0,
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[int, dict]:
    """Per-layer key bits for :class:`TQCache`, measured on the model itself.

    The extra key bits TQCache's default spends on the last layers (``late_k_bits``: as many as the
    scale-only metadata saves) go where :func:`key_bit_sensitivity` finds the model most sensitive
    instead (:func:`allocate_key_bits`; with ``k_bits - 1`` among ``bits``, lowering insensitive
    layers pays for more raises, but K2V3 has no fused kernel and measured no better on SmolLM2).
    ``sensitivity``: reuse an earlier :func:`key_bit_sensitivity` measurement. ``spent``: bits of the
    budget (a bit of one kv head's keys or values a unit, as :func:`calibrate_head_bits` counts)
    already given elsewhere (:func:`calibrate_copy_heads`): that many fewer 4-bit-key layers, rounded
    up to whole layers.

    Returns ``layer_options`` for ``TQCache(config, late_k_bits=None, layer_options=...)``: ``{layer:
    {"k_bits": b}}`` for the layers whose bits differ from ``k_bits``. On SmolLM2 the synthetic
    sequence ranks the layers as real text does (13 of the top 15 shared with a license text).
    """
    cfg = model.config
    head_dim = head_dim_of(cfg)
    opts, _ = tq_spec(cfg, spec, cache_kwargs)
    base = opts.k_bits
    choices = set(int(b) for b in bits) & {base - 1, base, base + 1}
    if base not in choices:
        raise ValueError(f"bits must include k_bits ({base})")
    protected = frozenset(int(i) for i in protected_layers)
    layers = [i for i in range(cfg.num_hidden_layers) if i not in protected]
    if sensitivity is None:
        sensitivity = key_bit_sensitivity(
            model, bits=choices, protected_layers=protected, cache_cls=cache_cls, spec=spec, **cache_kwargs
        )
    kl = {k: v for k, v in sensitivity.items() if k[1] in choices}
    extra = len(late_layers(layers, head_dim, base, base + 1, opts.scale_only))
    extra = max(0, extra - -(-int(spent) // cfg.num_key_value_heads))
    chosen = allocate_key_bits(kl, layers, extra, base)
    return {i: {"k_bits": b} for i, b in chosen.items() if b != base}


def calibrate_head_bits(
    model,
    *,
    widths: Iterable[tuple[int, int]] = HEAD_WIDTHS,
    protected_layers: Iterable[int] = (),
    sensitivity: Mapping[tuple[int, int, int, int], float] | None = None,
    fine_budget: int | None = None,
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[tuple[int, int], dict]:
    """Per-(layer, kv head) key and value bits for :class:`TQCache`, measured on the model itself: the
    :func:`calibrate_key_bits` budget (the bits scale-only metadata saves: 32 / head_dim an element)
    spent a head at a time (:func:`head_sensitivity`, :func:`allocate_head_bits`). Copying rests on a
    few heads (SmolLM2: 3 of 90 carry most of it), which 8-bit codes make near exact at 5 bits above 3;
    with (4, 3) among ``widths`` the knapsack weighs 4-bit keys (~3/4 of the error removed for 1 bit) too.

    ``fine_budget``: split the budget: at most that many bits to ``widths``, the rest to 4-bit keys
    (k_bits + 1) in other heads. On SmolLM2, 25 of 45 gives the best copy measured in budget (-1.6 /
    -3.8 points at 1K / 4K) at 96.9% top-1.

    Returns ``head_options`` for ``TQCache(config, late_k_bits=None, head_options=...)``: ``{(layer, kv
    head): {"k_bits": k, "v_bits": v}}`` for the heads whose widths differ from (k_bits, v_bits)."""
    cfg = model.config
    head_dim = head_dim_of(cfg)
    opts, _ = tq_spec(cfg, spec, cache_kwargs)
    base = (opts.k_bits, opts.v_bits)
    widths = [tuple(int(b) for b in w) for w in widths]
    if base not in widths or any(k < base[0] or v < base[1] for k, v in widths):
        raise ValueError(f"widths must include (k_bits, v_bits) = {base} and none below it")
    protected = frozenset(int(i) for i in protected_layers)
    heads = [(i, h) for i in range(cfg.num_hidden_layers) if i not in protected for h in range(cfg.num_key_value_heads)]
    split = (base, (base[0] + 1, base[1]))  # the 4-bit keys of a split budget
    if sensitivity is None:
        key_bits = {k for k, _ in widths} | ({split[1][0]} if fine_budget is not None else set())
        sensitivity = head_sensitivity(
            model,
            key_bits=key_bits,
            value_bits={v for _, v in widths},
            protected_layers=protected,
            cache_cls=cache_cls,
            spec=spec,
            **cache_kwargs,
        )
    budget = (32 * len(heads)) // head_dim if opts.scale_only else 0
    if fine_budget is None:
        chosen = allocate_head_bits(sensitivity, heads, budget, widths, base)
    else:
        fine = {
            hd: w
            for hd, w in allocate_head_bits(sensitivity, heads, min(fine_budget, budget), widths, base).items()
            if w != base
        }
        spent = sum(k + v - sum(base) for k, v in fine.values())
        rest = [hd for hd in heads if hd not in fine]
        chosen = {**allocate_head_bits(sensitivity, rest, budget - spent, split, base), **fine}
    return {hd: {"k_bits": k, "v_bits": v} for hd, (k, v) in chosen.items() if (k, v) != base}


# kv heads TQCache.calibrated gives 8-bit keys and values (calibrate_copy_heads), paid for by fewer 4-bit-key
# layers. SmolLM2 (news, three copy seeds): copy -1.6 / -4.4 points at 1K / 4K against -2.2 / -7.9 without,
# top-1 97.0% (97.4%), perplexity +0.12% (+0.10%); GPL-3 text: copy -3.4 / -3.2 against -5.0 / -5.2.
COPY_HEADS = 1
COPY_SEEDS = (0, 1)  # synthetic sequences copy_head_sensitivity averages (SmolLM2: 1 seed in 6 ranks others first)


def copy_head_sensitivity(
    model,
    *,
    seeds: Iterable[int] = COPY_SEEDS,
    tokens: int = 1024,
    protected_layers: Iterable[int] = (),
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[tuple[int, int, int, int], float]:
    """:func:`head_sensitivity` of the copying alone (``objective="copy"``: the KL over the repeated
    span's predictions) at the cache's (k_bits, v_bits), averaged over synthetic sequences ``seeds``:
    ``(2 x kv heads + 1) x layers`` forwards a seed."""
    opts, _ = tq_spec(model.config, spec, cache_kwargs)
    runs = [
        head_sensitivity(
            model,
            tokens=tokens,
            seed=s,
            key_bits=(opts.k_bits,),
            value_bits=(opts.v_bits,),
            protected_layers=protected_layers,
            objective="copy",
            cache_cls=cache_cls,
            spec=spec,
            **cache_kwargs,
        )
        for s in seeds
    ]
    if not runs:
        raise ValueError("seeds: at least one synthetic sequence")
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def calibrate_copy_heads(
    model,
    *,
    heads: int = 1,
    protected_layers: Iterable[int] = (),
    sensitivity: Mapping[tuple[int, int, int, int], float] | None = None,
    cache_cls=None,
    spec: CacheSpec | None = None,
    **cache_kwargs,
) -> dict[tuple[int, int], dict]:
    """The ``heads`` kv heads that copying from far back rests on most, with 8-bit keys and values.

    Long-range copying (induction) runs through a few heads (SmolLM2: layer 18's kv head 2 first,
    then layer 16's head 0), and it needs their values as well as their keys. The ranking is the gain
    of a head at :data:`FINE_BITS` keys and values over the cache's widths in
    :func:`copy_head_sensitivity` (``sensitivity``: reuse one). Each such head costs ``2 x FINE_BITS -
    k_bits - v_bits`` bits of the budget (10 units at K3V3): pass that as ``spent`` to
    :func:`calibrate_key_bits`, as :meth:`TQCache.calibrated` does. At most as many heads as the budget
    (:func:`calibrate_head_bits`'s: 32 / head_dim bits an element) pays for: none on small models.

    Returns ``head_options`` for ``TQCache``: ``{(layer, kv head): {"k_bits": 8, "v_bits": 8}}``."""
    cfg = model.config
    heads = int(heads)
    if heads < 0:
        raise ValueError(f"heads must be >= 0, got {heads}")
    if heads == 0:
        return {}
    opts, _ = tq_spec(cfg, spec, cache_kwargs)
    base, F = (opts.k_bits, opts.v_bits), FINE_BITS
    protected = frozenset(int(i) for i in protected_layers)
    candidates = [
        (i, h) for i in range(cfg.num_hidden_layers) if i not in protected for h in range(cfg.num_key_value_heads)
    ]
    head_dim = head_dim_of(cfg)
    budget = (32 * len(candidates)) // head_dim if opts.scale_only else 0
    heads = min(heads, budget // (2 * F - sum(base)))
    if heads == 0:
        return {}
    if sensitivity is None:
        sensitivity = copy_head_sensitivity(
            model, protected_layers=protected, cache_cls=cache_cls, spec=spec, **cache_kwargs
        )
    gain = {hd: head_kl(sensitivity, hd, *base) - head_kl(sensitivity, hd, F, F) for hd in candidates}
    top = sorted(candidates, key=lambda hd: -gain[hd])[:heads]
    return {hd: {"k_bits": F, "v_bits": F} for hd in sorted(top)}


def calibrated_cache(
    cls,
    model,
    *,
    per_head: bool = False,
    bits: Iterable[int] | None = None,
    widths: Iterable[tuple[int, int]] | None = None,
    fine_budget: int | None = None,
    copy_heads: int | None = None,
    sensitivity: Mapping[tuple, float] | None = None,
    copy_sensitivity: Mapping[tuple, float] | None = None,
    **kwargs,
):
    """What :meth:`TQCache.calibrated` builds (``cls``: the cache class): its widths measured on ``model``.

    * ``per_head=False``: ``copy_heads`` (default :data:`COPY_HEADS`) kv heads at 8-bit keys and
      values where copying needs them (:func:`calibrate_copy_heads`, ``copy_sensitivity``: reuse a
      :func:`copy_head_sensitivity`; ``(2 x kv heads + 1) x layers`` forwards a seed), then the rest
      of the budget as a key width a layer, :func:`calibrate_key_bits` (``bits`` default (3, 4);
      ``len(bits) x layers`` forwards of a 1K-token synthetic sequence);
    * ``per_head=True``: (K, V) widths a kv head, :func:`calibrate_head_bits` (``widths`` default
      :data:`HEAD_WIDTHS`; ``(2 x kv heads + 1) x layers`` forwards; ``fine_budget``: that many
      bits to them, the rest to 4-bit keys). On SmolLM2 ``fine_budget=25`` has the best copy
      measured in budget but 96.9% top-1 (``benchmarks/results/quality.md``).

    ``kwargs``: TQCache options, used for the measurement too (``key_center="rope"``, the default,
    is measured with ``key_center=True``: on SmolLM2 that placement measured 97.3% top-1 against
    97.0% with its own, copy 1K -1.4 / -1.0 points); ``layer_options`` are applied on top of the
    calibrated bits.

    Under tensor parallelism (transformers' ``tp_plan``) every rank of the group calls this: each
    measures through caches of its own kv heads, and the first rank's options are the group's
    (:func:`~flash_attn_tq.integrations.parallel.agree`), so every rank holds the same layout.
    ``tp_rank`` (default: the model's) is passed to the caches."""
    if "late_k_bits" in kwargs:
        raise ValueError("late_k_bits: the calibrated cache places its key bits itself")
    tp_rank = kwargs.pop("tp_rank", None)
    tp_rank = tp_rank_of(model) if tp_rank is None else tp_rank
    if tp_rank is not None:  # every cache, measured or returned, places the rank's kv heads
        cls = functools.partial(cls, tp_rank=tp_rank)
    tq_only = {k: kwargs.pop(k) for k in ("max_cache_len", "prefill", "layer_options") if k in kwargs}
    protected = tuple(kwargs.pop("protected_layers", ()))
    spec = kwargs.pop("spec", None)
    measure = dict(cache_cls=cls, spec=spec, **kwargs)  # the options the bits are measured with
    key_center = kwargs.get("key_center", DEFAULTS["key_center"] if spec is None else spec.key_center)
    if key_center == "rope":
        if "key_center" in kwargs or spec is None:
            measure["key_center"] = True
        else:
            measure["spec"] = spec.replace(key_center=True)
    layer_options, head_options = {}, None
    if per_head:
        if bits is not None:
            raise ValueError("bits: per_head=True takes (K bits, V bits) pairs as widths=")
        if copy_heads is not None or copy_sensitivity is not None:
            raise ValueError("copy_heads / copy_sensitivity: per-layer calibration options (per_head=False)")
        head_options = calibrate_head_bits(
            model,
            widths=widths or HEAD_WIDTHS,
            protected_layers=protected,
            sensitivity=sensitivity,
            fine_budget=fine_budget,
            **measure,
        )
    else:
        if widths is not None or fine_budget is not None:
            raise ValueError("widths / fine_budget: per-head calibration options (per_head=True)")
        head_options = calibrate_copy_heads(
            model,
            heads=COPY_HEADS if copy_heads is None else copy_heads,
            protected_layers=protected,
            sensitivity=copy_sensitivity,
            **measure,
        )
        opts, _ = tq_spec(model.config, spec, kwargs)
        spent = sum(o["k_bits"] - opts.k_bits + o["v_bits"] - opts.v_bits for o in head_options.values())
        layer_options = {
            i: dict(o)
            for i, o in calibrate_key_bits(
                model, bits=bits or (3, 4), protected_layers=protected, sensitivity=sensitivity, spent=spent, **measure
            ).items()
        }
    layer_options, head_options = agree(model, (layer_options, head_options))
    for i, o in (tq_only.pop("layer_options", None) or {}).items():
        layer_options.setdefault(int(i), {}).update(o)
    return cls(
        model.config,
        spec=spec,
        protected_layers=protected,
        late_k_bits=None,
        layer_options=layer_options,
        head_options=head_options,
        **tq_only,
        **kwargs,
    )
