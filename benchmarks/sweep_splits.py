"""Decode time against num_splits (the data behind choose_num_splits in flash_api_tq.cpp).

    python benchmarks/sweep_splits.py [--out benchmarks/results] [--kinds tq3,kv16,k3] [--shapes B:S,...]

For each shape, the fused op replayed as a CUDA graph (kernel + combine, no host overhead) at fixed
num_splits, and the heuristic's pick (0): ``tq3`` the plain 3-bit cache, ``kv16`` the same kernel over
the fp16 cache, ``k3`` the default cache's K3V3 layer (16 sink + 112 recent tokens in 16-bit, keys
centered before RoPE; its num_splits counts the code splits, the side's split comes on top); beside
them cuDNN's SDPA over the fp16 cache, replayed the same way. Writes splits.json / splits.md (or
``--name``) with the run's stamp (GPU, torch, CUDA, commit, the command).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_tq as fa
from flash_attn_tq import ops
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.testing import bench_graph, describe, fill_default, made_by, stamp, write_results

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = [(1, 1024), (1, 4096), (1, 16384), (1, 65536), (1, 131072), (8, 1024), (8, 4096), (8, 32768), (32, 8192)]
SPLITS = [0, 1, 2, 4, 8, 16, 32, 48, 66, 96, 128]


def graph_us(fn):
    return bench_graph(fn, rep_ms=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=RESULTS, help="output directory (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and splits, 3-bit only")
    ap.add_argument("--name", default="splits")
    ap.add_argument("--kinds", default="tq3,kv16", help="of tq3, kv16, k3 (the default cache's K3V3 layer)")
    ap.add_argument("--shapes", help="B:S,... (default: the sweep's nine shapes)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.extension_available():
        raise SystemExit("sweep_splits needs a CUDA GPU and the built extension")
    meta = stamp()
    global SPLITS
    shapes, kinds = SHAPES, tuple(args.kinds.split(","))
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split(":")) for sh in args.shapes.split(",")]
    if args.quick:
        shapes, kinds = [(1, 1024), (1, 16384), (1, 131072), (8, 4096), (8, 32768), (32, 8192)], ("tq3",)
        SPLITS = [0, 2, 8, 16, 32]
    rows = []
    for B, S in shapes:
        cache = QuantizedKVCache(B, S, 8, 128, device="cuda")
        k = torch.randn(B, S, 8, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        cache.append(k, v)
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.float16)
        lens = cache.seqlens
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_us = graph_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        default = fill_default(B, S, 8, 128) if "k3" in kinds else None
        for kind in kinds:
            times = {}
            for sp in SPLITS:
                if sp > S // 32:
                    continue
                if kind == "tq3":
                    fn = lambda sp=sp: cache.attend(q, lens, None, 0.088, False, sp)  # noqa: E731
                elif kind == "k3":
                    fn = lambda sp=sp: fa.flash_attn_with_kvcache(q, default, num_splits=sp)  # noqa: E731
                else:
                    fn = lambda sp=sp: ops.decode_kv16(q, k, v, lens, None, None, 0.088, False, sp)  # noqa: E731
                times[sp] = graph_us(fn)
            best = min((t, sp) for sp, t in times.items() if sp)
            row = {
                "B": B,
                "S": S,
                "kind": kind,
                "us": times,
                "best_splits": best[1],
                "best_us": best[0],
                "heuristic_us": times[0],
                "cudnn_us": cudnn_us,
            }
            rows.append(row)
            print(row, flush=True)
        cache = k = v = qt = kt = vt = default = None  # (not del: lambdas above name them)
        torch.cuda.empty_cache()
    lines = [
        "| B | S | kernel | " + " | ".join(f"{s or 'auto'}" for s in SPLITS) + " | best | cuDNN | cuDNN / best |",
        "|" + "---|" * (len(SPLITS) + 6),
    ]
    for r in rows:
        cells = [f"{r['us'][s]:.1f}" if s in r["us"] else "–" for s in SPLITS]
        lines.append(
            f"| {r['B']} | {r['S']} | {r['kind']} | "
            + " | ".join(cells)
            + f" | {r['best_splits']} | {r['cudnn_us']:.1f} | {r['cudnn_us'] / r['best_us']:.2f}x |"
        )
    head = [
        f"# Decode time against num_splits ({describe(meta)})",
        "",
        made_by(meta),
        "",
        "Decode µs (CUDA graph, kernel + combine) against num_splits; H=32/8, d=128, fp16; 'auto' is "
        "choose_num_splits in csrc/flash_attn/flash_api_tq.cpp; – where a split count exceeds S / 32. "
        "tq3: the plain 3-bit cache; kv16: the same kernel over the fp16 cache; k3: the default cache's "
        "K3V3 layer (its code splits; the 16-bit side is one split more). cuDNN: SDPA over the fp16 "
        "cache, replayed as a CUDA graph.",
        "",
    ]
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, "\n".join(head + lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
