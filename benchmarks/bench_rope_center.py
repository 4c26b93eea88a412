"""What the RoPE-center term costs the decode kernel: the same packed cache timed with and without it.

    python benchmarks/bench_rope_center.py [--out benchmarks/results]

``key_center='rope'`` caches store ``k - R(p) c``; the decode kernel then adds each score's
``q . R(p) c`` (tq_rope_center.h: one more m16n8k16 chain a 16-token block, D / 8 sincos a lane a
tile). For each shape (batch B, cache length S, q heads, kv heads, head_dim d; q_len 1), with
``triton.testing.do_bench`` medians (CUDA events, warm-up, random data, caches above L2), side by
side in one run: ``rope`` (the fused op with the term), ``plain`` (the same codes without it: what
``key_center=True`` runs) and ``kv16`` (our FP16 decode over the fp16 cache). Writes
``rope_center_decode.json`` / ``.md`` with the run's stamp (GPU, torch, CUDA, commit, the command).
"""

from __future__ import annotations

import argparse
import os

import torch

from flash_attn_tq import ops
from flash_attn_tq.testing import bench, describe, fill_cache, made_by, stamp, write_results

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

SHAPES = [  # (B, S, Hq, Hk, d)
    (1, 131072, 32, 8, 128),
    (8, 32768, 32, 8, 128),
    (32, 8192, 32, 8, 128),
    (64, 2048, 32, 8, 128),
    (1, 4096, 9, 3, 64),
    (16, 32768, 9, 3, 64),
    (64, 8192, 9, 3, 64),  # SmolLM2's heads
]


def run_shape(B, S, Hq, Hk, d, dtype=torch.float16):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    cache, k, v = fill_cache(B, S, Hk, d, dtype, key_center="rope", rope_inv_freq=inv_freq)
    q = torch.randn(B, 1, Hq, d, device="cuda", dtype=dtype)
    scale, lens = d**-0.5, cache.seqlens
    row = {"B": B, "S": S, "Hq": Hq, "Hk": Hk, "d": d}
    stores = cache.stores(B)
    signs = cache.k_quantizer.signs_on(q.device)
    common = dict(softmax_scale=scale, causal=False, rot_signs=signs)
    row["rope_us"] = bench(lambda: ops.decode(q, stores, lens, rope_inv_freq=cache.rope_inv_freq, **common))
    plain = [s for s in stores if s.kind != ops.CENTER]  # the same codes, no term
    row["plain_us"] = bench(lambda: ops.decode(q, plain, lens, **common))
    row["kv16_us"] = bench(lambda: ops.decode_kv16(q, k, v, lens, None, None, scale, False, 0))
    row["rope_over_plain"] = row["rope_us"] / row["plain_us"]
    row["kv16_over_rope"] = row["kv16_us"] / row["rope_us"]
    row["kv16_over_plain"] = row["kv16_us"] / row["plain_us"]
    cache = k = v = None  # (not del: lambdas above name them)
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=RESULTS, help="output directory (default benchmarks/results)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.extension_available():
        raise SystemExit("bench_rope_center needs a CUDA GPU and the built extension")
    meta = stamp()
    rows = []
    for shape in SHAPES:
        rows.append(run_shape(*shape))
        r = rows[-1]
        print(
            f"{shape}: rope {r['rope_us']:.1f} us, plain {r['plain_us']:.1f} us ({r['rope_over_plain']:.3f}x), "
            f"kv16 {r['kv16_us']:.1f} us (FP16 / rope {r['kv16_over_rope']:.2f}x)",
            flush=True,
        )
    lines = [
        f"# Decode with the RoPE-center term ({describe(meta)})",
        "",
        made_by(meta),
        "",
        "Fused 3-bit decode (K3V3, float16 queries), medians of `triton.testing.do_bench`. `rope`: with "
        "`q . R(p) c` added to each score (`key_center='rope'`); `plain`: the same codes without it; "
        "`kv16`: our FP16 decode over the fp16 cache.",
        "",
        "| B | S | Hq/Hk | d | rope µs | plain µs | rope / plain | FP16 / rope | FP16 / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hk']} | {r['d']} | {r['rope_us']:.1f} | {r['plain_us']:.1f} | "
            f"{r['rope_over_plain']:.3f} | {r['kv16_over_rope']:.2f}x | {r['kv16_over_plain']:.2f}x |"
        )
    write_results(args.out, "rope_center_decode", {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
