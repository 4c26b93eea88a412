"""What a cache can report about itself: its health counters (``health=True``) and the pack kernel's
error bits gathered over a forward pass (:class:`PackErrors`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from . import ops

if TYPE_CHECKING:  # (annotations only: the cache imports this module)
    from .cache import QuantizedKVCache

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
        if self.flags is None or ops.capturing():
            return
        bits = int(self.flags.item())
        if bits:
            self.flags.zero_()
            ops.raise_pack_errors(bits)


def screen(counters: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v`` with vectors holding NaN/Inf set to zero, counted into ``counters`` (no sync)."""
    counters[0] += k.shape[0] * k.shape[1] * k.shape[2]
    out = []
    for i, x in enumerate((k, v)):
        bad = ~torch.isfinite(x).all(-1, keepdim=True)
        counters[1 + i] += bad.sum()
        out.append(x.masked_fill(bad, 0))
    return out[0], out[1]


def observe(cache: "QuantizedKVCache", k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Count clipped elements and sum relative errors of ``k`` (codes domain) and ``v`` as the cache
    writes them (the codec run again in PyTorch: a few more kernels an append)."""
    c = cache.health_counters
    pairs = ((k, cache.k_quantizer, cache.k_range), (v, cache.v_quantizer, cache.v_range))
    for i, (x, qz, ranges) in enumerate(pairs):
        if cache.spec.streaming:  # (the ranges as the write will use them; their update is the write's)
            codes, meta, _ = qz.quantize(x, ranges[rows])
        else:
            codes, meta = qz.quantize(x)
        xr = qz.rotate(x) if cache.spec.quantizer == "turbo" else x.float()
        err = qz.dequantize_rotated(codes, meta) - xr
        norm = xr.norm(dim=-1)
        c[3 + i] += qz.clipped(xr, codes, meta).sum()
        c[5 + i] += torch.where(norm > 0, err.norm(dim=-1) / norm.clamp(min=1e-30), 0.0).sum()


def health_reports(groups: Sequence[Sequence["QuantizedKVCache"]]) -> list[dict[str, float | None]]:
    """One report per group of caches (e.g. a layer's head groups), their counters summed; one host
    sync for all. A report: ``vectors`` appended, ``k_nonfinite`` / ``v_nonfinite`` vectors (stored as
    zeros), ``k_clipped`` / ``v_clipped`` (the fraction of elements clipped), ``k_rel_error`` /
    ``v_rel_error`` (mean relative quantization error a vector), ``sink_occupancy`` /
    ``window_occupancy`` (the mean fraction of the sink slots and of the 16-bit window filled over the
    batch; None without them)."""
    rows = []
    for caches in groups:
        for qc in caches:
            if qc.health_counters is None:
                raise RuntimeError("this cache keeps no health counters (QuantizedKVCache(..., health=True))")
            n = qc.seqlens.double()
            S, R = qc.sink_tokens, qc.fp16_window
            sinks = (n.clamp(max=S) / S).mean() if S else n.new_zeros(())
            window = ((n - S).clamp(min=0, max=R) / R).mean() if R else n.new_zeros(())
            rows.append(torch.cat([qc.health_counters, torch.stack([sinks, window]).to(qc.health_counters.device)]))
    values = torch.stack([r.to(rows[0].device) for r in rows]).tolist() if rows else []
    reports, i = [], 0
    for caches in groups:
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
