"""Decode times of one build, for an interleaved A/B (scripts/ab_interleaved.sh): the plain 3-bit
cache and the default cache's kinds of layer (``flash_attn_tq.testing.default_layers``: K3V3, K4V3
and the copy-head layer), each call replayed as a CUDA graph, fp16, heads 32/8, d 128, one query.

    python -m scripts.time_decode LABEL OUT.json [B:S,...]

OUT.json: ``{"B·S": {"plain": µs, "k3": µs, "k4": µs, "mixed": µs, "default": µs}}`` with "default"
the layer kinds weighted as the model holds them (as production.json's default_us)."""

from __future__ import annotations

import argparse
import json

import torch

import flash_attn_tq as fa
from flash_attn_tq.testing import bench_graph, default_layers, fill_cache, weighted_default

SHAPES = [(1, 1024), (1, 4096), (8, 1024), (64, 2048), (8, 32768)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", help="the build's name in the printed line")
    ap.add_argument("out", help="the JSON file of the times")
    ap.add_argument("shapes", nargs="?", help="B:S,... (default: 1K to 32K tokens, B 1 to 64)")
    args = ap.parse_args()
    label, out = args.label, args.out
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    res = {}
    for B, S in shapes:
        torch.manual_seed(0)
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.float16)
        fns, layers = default_layers(q, S, 8, torch.float16)
        fns.pop("mixed_apart", None)
        plain, _, _ = fill_cache(B, S, 8, 128, torch.float16)
        fns["plain"] = lambda: fa.flash_attn_with_kvcache(q, plain)
        times = {name: bench_graph(fn) for name, fn in fns.items()}
        times["default"] = weighted_default({k + "_us": t for k, t in times.items()}, layers, "_us")
        res[f"{B}·{S}"] = times
        fns = plain = None  # (not del: the lambdas name them)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(label, {shape: round(t["default"], 1) for shape, t in res.items()}, flush=True)


if __name__ == "__main__":
    main()
