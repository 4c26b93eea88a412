"""Health counters (``QuantizedKVCache(..., health=True)``, ``TQCache.health()``): injected outliers,
NaN/Inf and occupancy are counted; on the CPU (reference writes) and, marked gpu, through the
quantize-on-write kernel and inside a CUDA graph."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attn_tq as fa
from flash_attn_tq import ops
from flash_attn_tq.health import HEALTH_COUNTERS, health_reports
from flash_attn_tq.quantizers import TurboQuantizer

GPU = torch.cuda.is_available() and ops.extension_available()
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] if GPU else ["cpu"]


def _spikes(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """``[n, d]`` vectors whose rotated form (the turbo codes' domain) is one large coordinate over
    small noise: the outliers a rotation cannot spread, which the grid's outermost codes clip."""
    g = torch.Generator().manual_seed(seed)
    y = 0.01 * torch.randn(n, d, generator=g)
    y[torch.arange(n), torch.randint(0, d, (n,), generator=g)] = 10.0
    return TurboQuantizer(d, 3).unrotate(y)


@pytest.mark.parametrize("device", DEVICES)
def test_counts_outliers_nonfinite_and_error(device):
    B, H, d, n = 2, 2, 64, 40
    cache = fa.QuantizedKVCache(B, 128, H, d, health=True, device=device)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(B, n, H, d, generator=g), torch.randn(B, n, H, d, generator=g)
    cache.append(k.to(device), v.to(device))
    base = cache.health()
    assert base["vectors"] == B * n * H and base["k_nonfinite"] == base["v_nonfinite"] == 0
    # Gaussian data: what the N(0, 1) grid clips (its range ends ~2.34 sigma out: ~1.9%) and a 3-bit error
    assert 0.005 < base["k_clipped"] < 0.04 and 0.1 < base["k_rel_error"] < 0.3
    # the reference error of what was written
    kd, _ = cache.dequantize()
    ref = ((kd[:, :n].float().cpu() - k).norm(dim=-1) / k.norm(dim=-1)).mean().item()
    assert math.isclose(base["k_rel_error"], ref, rel_tol=0.02), (base["k_rel_error"], ref)

    k2, v2 = torch.randn(B, 4, H, d, generator=g), torch.randn(B, 4, H, d, generator=g)
    k2[0, :, 1] = _spikes(4, d)  # 4 spiky key vectors: one clipped element each, a large error
    k2[1, 2, 0, 5] = float("nan")
    v2[0, 1, 1] = float("inf")
    cache.append(k2.to(device), v2.to(device))  # (no error: counted, stored as zeros)
    h = cache.health()
    assert h["vectors"] == B * (n + 4) * H
    assert h["k_nonfinite"] == 1 and h["v_nonfinite"] == 1
    clipped = h["k_clipped"] * h["vectors"] * d - base["k_clipped"] * base["vectors"] * d
    assert clipped >= 4, clipped
    assert h["k_rel_error"] > base["k_rel_error"]
    kd, vd = cache.dequantize()
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert kd[1, n + 2, 0].abs().max() == 0 and vd[0, n + 1, 1].abs().max() == 0
    cache.reset_health()
    assert cache.health()["vectors"] == 0


def test_streaming_range_clips_a_sudden_outlier():
    """The asym quantizer's streaming range (an EMA of max|x|) clips a token far above it."""
    cache = fa.QuantizedKVCache(1, 64, 1, 32, quantizer="asym", streaming=True, alpha=0.1, health=True)
    cache.append(torch.randn(1, 16, 1, 32), torch.randn(1, 16, 1, 32))
    assert cache.health()["k_clipped"] == 0.0
    k = torch.randn(1, 1, 1, 32)
    k[..., 3] = 100.0
    cache.append(k, torch.randn(1, 1, 1, 32))
    assert cache.health()["k_clipped"] * 17 * 32 >= 1


def test_occupancy_and_reports():
    a = fa.QuantizedKVCache(2, 256, 2, 64, sink_tokens=4, fp16_window=16, health=True)
    b = fa.QuantizedKVCache(2, 256, 1, 64, k_bits=8, v_bits=8, sink_tokens=4, fp16_window=16, health=True)
    for c in (a, b):
        c.append(torch.randn(1, 10, c.num_kv_heads, 64), torch.randn(1, 10, c.num_kv_heads, 64))
    h = a.health()
    assert h["sink_occupancy"] == pytest.approx(0.5) and h["window_occupancy"] == pytest.approx(6 / 16 / 2)
    both = health_reports([[a, b]])[0]  # a layer's two head groups, summed
    assert both["vectors"] == a.health()["vectors"] + b.health()["vectors"]
    assert both["k_rel_error"] < h["k_rel_error"]  # the 8-bit group pulls the mean down
    with pytest.raises(RuntimeError, match="health=True"):
        fa.QuantizedKVCache(1, 8, 1, 64).health()
    # the counters travel with the cache
    again = fa.QuantizedKVCache.from_state_dict(a.state_dict())
    assert again.health() == h
    assert len(a.health_counters) == len(HEALTH_COUNTERS)


def test_off_by_default_and_nonfinite_still_raises():
    cache = fa.QuantizedKVCache(1, 8, 1, 64)
    assert cache.health_counters is None
    k = torch.randn(1, 1, 1, 64)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.append(k, torch.randn(1, 1, 1, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
def test_health_inside_a_cuda_graph():
    """The counters update inside a captured append (the quantize-on-write kernel's float16 input; no
    host sync) and count each replay."""
    cache = fa.QuantizedKVCache(1, 512, 2, 128, health=True, device="cuda")
    kv = torch.randn(2, 1, 65, 2, 128, device="cuda", dtype=torch.float16)
    cache.append(kv[0, :, :64], kv[1, :, :64])
    k, v = kv[0, :, 64:], kv[1, :, 64:]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cache.append(k, v, error_flags=torch.zeros(1, dtype=torch.int32, device="cuda"))  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    flags = torch.zeros(1, dtype=torch.int32, device="cuda")
    with torch.cuda.graph(graph):
        cache.append(k, v, cache_seqlens=cache.seqlens.clone(), error_flags=flags)
    before = cache.health()["vectors"]
    for _ in range(3):
        graph.replay()
    assert cache.health()["vectors"] == before + 3 * 2
