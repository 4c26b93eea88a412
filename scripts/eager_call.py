"""Host cost of the eager decode call, through the public API only (so it runs against any version
of the package, for an A/B of two trees): ``flash_attn_with_kvcache(q, cache)`` over a plain 3-bit
cache and over TQCache's default layer (16 sink + 112 recent tokens in 16-bit, keys centered before
RoPE), ``CALLS`` calls issued back to back, wall time a call (host time counts where it exceeds the
kernels'), the median of ``REPEATS`` such runs; and the same call replayed as a CUDA graph.

    python scripts/eager_call.py LABEL OUT.json [B:S,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import flash_attn_tq as fa

SHAPES = [(1, 1024), (1, 4096), (8, 1024)]
CALLS, REPEATS = 200, 5


def eager_us(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(runs)


def graph_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("out")
    ap.add_argument("shapes", nargs="?")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 128, 2).float() / 128)
    default = dict(sink_tokens=16, fp16_window=112, key_center="rope", rope_inv_freq=inv_freq)
    res = {}
    for B, S in shapes:
        torch.manual_seed(0)
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(B, S, 8, 128, device="cuda", dtype=torch.float16)
        row = {}
        for name, opts in (("plain", {}), ("default", default)):
            cache = fa.QuantizedKVCache(B, S + 8, 8, 128, device="cuda", calib_min_tokens=1, **opts)
            cache.append(k, k)
            fa.flash_attn_with_kvcache(q, cache)
            assert fa.last_path() == "quantized:fused-cuda", fa.last_path()
            row[f"{name}_eager"] = eager_us(lambda: fa.flash_attn_with_kvcache(q, cache))
            row[f"{name}_graph"] = graph_us(lambda: fa.flash_attn_with_kvcache(q, cache))
        res[f"{B}·{S}"] = row
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(args.label, {s: {k: round(v, 1) for k, v in r.items()} for s, r in res.items()}, flush=True)


if __name__ == "__main__":
    main()
