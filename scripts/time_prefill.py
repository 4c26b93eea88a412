"""Prefill kernel times (ops.decode, 3-bit turbo cache, with and without scale-only metadata) for a
few chunk shapes: a quick A/B helper (scripts/ab_stack.sh). Prints one line: LABEL and the times.

    python -m scripts.time_prefill LABEL [S:q_len,...]
"""

from __future__ import annotations

import argparse

import torch

from flash_attn_tq.testing import bench, fill_cache

SHAPES = [(8192, 64), (32768, 64), (8192, 512), (32768, 2048)]  # (S, q_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", help="the build's name in the printed line")
    ap.add_argument("shapes", nargs="?", help="S:q_len,... (default: 8K and 32K tokens, chunks of 64 to 2048)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    res = []
    for S, q_len in shapes:
        q = torch.randn(1, q_len, 32, 128, device="cuda", dtype=torch.float16)
        times = []
        for scale_only in (False, True):
            cache, _, _ = fill_cache(1, S, 8, 128, torch.float16, scale_only=scale_only)
            t = bench(lambda: cache.attend(q, cache.seqlens, None, 128**-0.5, True, 0), warmup_ms=50)
            times.append(f"{t:.1f}")
            cache = None  # (not del: the lambda names it)
        res.append(f"S={S} q={q_len}: {'/'.join(times)} us")
    print(args.label, "(plain/scale-only)", "; ".join(res), flush=True)


if __name__ == "__main__":
    main()
