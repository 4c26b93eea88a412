"""Host cost of ``flash_attn_with_kvcache``'s fused decode call, on any machine (no GPU needed): the
Python path from the public call to the decode op, with the op replaced by a CPU kernel that does
nothing and the device facts saying "CUDA with the extension". Over a plain 3-bit cache and over
TQCache's default layer (16 sink + 112 recent tokens in 16-bit, keys centered before RoPE); the
best of ``REPEATS`` runs of ``CALLS`` calls, in µs a call. Runs against the tree first on the import
path (``scripts/ab_host.sh`` runs two trees in turn).

    python scripts/host_cost.py LABEL OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

import flash_attn_tq as fa
from flash_attn_tq import ops

CALLS, REPEATS = 500, 15
B, S, KV_HEADS, Q_HEADS, D = 1, 1024, 8, 32, 128


def define_ops(tree: Path) -> torch.library.Library:
    """The tree's op schemas (read from its C++ API) with CPU kernels that return zeros."""
    src = (tree / "csrc" / "flash_attn" / "flash_api_tq.cpp").read_text()
    lib = torch.library.Library("flash_attn_tq", "DEF")
    for call in re.findall(r'm\.def\(((?:\s*"[^"]*")+)\s*(?:,[^)]*)?\)', src):
        lib.define("".join(re.findall(r'"([^"]*)"', call)))
    outs = {}

    def decode(q, *args):
        if q.shape not in outs:  # (allocated once: the op's own cost is not what is measured)
            outs[q.shape] = torch.zeros_like(q), q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        return outs[q.shape]

    lib.impl("decode_kvcache", decode, "CPU")
    return lib


def claim_fused_device() -> None:
    """Make the CPU look like a CUDA device with the extension built, to the tree's dispatch."""
    try:
        from flash_attn_tq import dispatch
    except ImportError:  # (trees from before the dispatch module: the fused-path check lived in ops)
        ops.fused_decode_reason = lambda *args, **kwargs: None
    else:
        ops.extension_available = lambda: True
        dispatch.read_device = lambda device, wgmma_on: dispatch.Device("cuda", extension=True, prefill_smem=True)
        dispatch._DEVICES.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("out")
    args = ap.parse_args()
    tree = Path(fa.__file__).resolve().parents[1]
    lib = define_ops(tree)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    configs = {"plain": {}, "default": dict(sink_tokens=16, fp16_window=112, key_center="rope", rope_inv_freq=inv_freq)}
    torch.manual_seed(0)
    caches = {}
    for name, opts in configs.items():  # (filled on the CPU's own path, before the device claim)
        caches[name] = fa.QuantizedKVCache(B, S + 8, KV_HEADS, D, calib_min_tokens=1, **opts)
        k = torch.randn(B, S, KV_HEADS, D).half()
        caches[name].append(k, k)
    claim_fused_device()
    q = torch.randn(B, 1, Q_HEADS, D).half()
    res = {}
    for name, cache in caches.items():
        fa.flash_attn_with_kvcache(q, cache)
        assert fa.last_path() == "quantized:fused-cuda", fa.last_path()
        for _ in range(200):
            fa.flash_attn_with_kvcache(q, cache)
        runs = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fa.flash_attn_with_kvcache(q, cache)
            runs.append((time.perf_counter() - t0) / CALLS * 1e6)
        res[name] = min(runs)
    lib._destroy()
    stamp = {"tree": str(tree), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "us_per_call": res, "stamp": stamp}, f, indent=1)
    print(args.label, {k: round(v, 1) for k, v in res.items()}, flush=True)


if __name__ == "__main__":
    main()
