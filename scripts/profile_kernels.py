"""GPU time of every kernel one call launches (torch.profiler), to see where short calls spend it.

    python -m scripts.profile_kernels

Prints, per case (the plain 3-bit cache, the default cache's K3V3 layer, the fp16 kernel, appends),
each CUDA kernel's mean duration over 20 calls (after warm-up) and their sum, next to the wall time
of the call replayed as a CUDA graph (launch gaps included).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn_tq as fa
from flash_attn_tq import ops
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.testing import bench_graph, fill_default


def kernel_times(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out.setdefault(ev.name, []).append(ev.device_time)
    return {k: sum(v) / reps for k, v in out.items()}


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels needs a CUDA GPU and the built extension")
    dt = torch.float16
    cases = []
    for B, S in ((1, 1024), (8, 1024), (1, 16384), (8, 32768)):
        cache = QuantizedKVCache(B, S, 8, 128, device="cuda", dtype=dt)
        cache.append(
            torch.randn(B, S, 8, 128, device="cuda", dtype=dt), torch.randn(B, S, 8, 128, device="cuda", dtype=dt)
        )
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=dt)
        k16 = torch.randn(B, S, 8, 128, device="cuda", dtype=dt)
        v16 = torch.randn_like(k16)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        cases.append((f"tq3 API B={B} S={S}", lambda q=q, c=cache: fa.flash_attn_with_kvcache(q, c, num_splits=0)))
        layer = fill_default(B, S, 8, 128, dt)
        cases.append((f"default K3V3 layer B={B} S={S}", lambda q=q, c=layer: fa.flash_attn_with_kvcache(q, c)))
        cases.append(
            (
                f"kv16 B={B} S={S}",
                lambda q=q, k=k16, v=v16, n=lens: ops.decode_kv16(q, k, v, n, None, None, 0.088, False, 0),
            )
        )
    for B in (1, 64):
        cache = QuantizedKVCache(B, 64, 8, 128, device="cuda", dtype=dt)
        kn = torch.randn(B, 1, 8, 128, device="cuda", dtype=dt)
        zero = torch.zeros(B, dtype=torch.int32, device="cuda")
        cases.append(
            (f"append 1 token B={B} (graph: no checks)", lambda c=cache, x=kn, z=zero: c.append(x, x, cache_seqlens=z))
        )
    for name, fn in cases:
        times = kernel_times(fn)
        try:
            g = bench_graph(fn, rep_ms=100)
        except Exception as e:  # not capturable
            g = float("nan")
            print("  (graph failed:", str(e).splitlines()[0][:100], ")")
        print(f"{name}: kernels {sum(times.values()):.1f} us, graph replay {g:.1f} us")
        for k, t in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {t:8.2f} us  {k[:110]}")


if __name__ == "__main__":
    main()
