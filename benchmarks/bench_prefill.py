"""Chunked prefill over a 3-bit cache vs FP16 FA2, and paged vs contiguous decode, in one run.

    python benchmarks/bench_prefill.py [--quick] [--out benchmarks/results] [--name prefill]

Table 1 (chunked prefill): a chunk of ``q_len`` new queries attends, causally (bottom-right), to a
cache of S tokens that already holds the chunk: B=1, 32 q heads / 8 kv heads, head_dim 128, fp16.

* ``tq3_kernel``: the fused op (``ops.decode``; from 128 query rows a kv head it runs the prefill
  kernel) over the 3-bit turbo cache (default format: codes + one fp16 scale a vector);
* ``tq3_append``: ``flash_attn_with_kvcache(q, cache, k=k_new, v=v_new, causal=True)`` end to end:
  the chunk quantized into the cache (pack kernel) and then attended;
* ``default_kernel``: ``flash_attn_with_kvcache(q, cache, causal=True)`` over the default cache's
  3-bit layer (16 sinks and a 112-token window in 16-bit, keys centered before RoPE:
  ``flash_attn_tq.testing.DEFAULT_OPTS``; ``bench_decode.py --production`` weighs every kind of layer);
* ``tq3o_kernel``: the same over a cache that also stores the offset (``scale_only=False``: fp16
  (scale, offset) a vector, the format asym always uses; the kernel adds the K/V offset terms);
* ``fa2`` / ``fa2_append``: upstream ``flash_attn_with_kvcache`` on the fp16 cache, the same two ways.

Table 2 (paged decode): the decode kernel alone over the same tokens stored contiguously and in
pages of 16-256 tokens (shuffled block table), as a ratio to contiguous.

``triton.testing.do_bench`` medians (CUDA events, warm-up), random data, all paths in one run.
Writes ``<name>.json``, ``<name>.md`` and ``<name>.png`` with the run's stamp (GPU, torch, CUDA,
commit, the command); FA2's columns are missing, with the reason, where it is not installed.
"""

from __future__ import annotations

import argparse
import os

import torch

import flash_attn_tq as fa
from flash_attn_tq import ops
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.testing import (
    bench,
    describe,
    fill_cache,
    fill_default,
    fmt,
    made_by,
    missing_notes,
    stamp,
    upstream_fa2,
    write_results,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

HQ, HK, D = 32, 8, 128


def attended_keys(S: int, q_len: int) -> int:
    """Keys summed over the chunk's queries under bottom-right causal alignment."""
    return sum(S - q_len + i + 1 for i in range(q_len))


def run_prefill(S: int, q_len: int, dtype=torch.float16) -> dict:
    cache, k, v = fill_cache(1, S, HK, D, dtype)
    q = torch.randn(1, q_len, HQ, D, device="cuda", dtype=dtype)
    k_new, v_new = k[:, S - q_len :].clone(), v[:, S - q_len :].clone()
    lens = cache.seqlens
    row = {"S": S, "q_len": q_len}
    row["tq3_kernel"] = bench(lambda: cache.attend(q, lens, None, D**-0.5, True, 0))
    os.environ["FLASH_ATTN_TQ_PREFILL_WGMMA"] = "0"  # the prefill kernel's mma.sync variant (other GPUs')
    try:
        row["tq3_sync_kernel"] = bench(lambda: cache.attend(q, lens, None, D**-0.5, True, 0))
    finally:
        del os.environ["FLASH_ATTN_TQ_PREFILL_WGMMA"]
    cache_o, _, _ = fill_cache(1, S, HK, D, dtype, scale_only=False)
    row["tq3o_kernel"] = bench(lambda: cache_o.attend(q, cache_o.seqlens, None, D**-0.5, True, 0))
    cache_o = None  # (not del: lambdas above name them)
    cache_d = fill_default(1, S, HK, D, dtype)
    row["default_kernel"] = bench(lambda: fa.flash_attn_with_kvcache(q, cache_d, causal=True))
    cache_d = None  # (not del: lambdas above name them)

    def tq3_append():  # re-appends the chunk at S - q_len each call (the cache ends where it was)
        return fa.flash_attn_with_kvcache(q, cache, k=k_new, v=v_new, cache_seqlens=S - q_len, causal=True)

    row["tq3_append"] = bench(tq3_append)
    assert fa.last_path() == "quantized:fused-cuda", fa.last_path()
    f2 = upstream_fa2()
    row["fa2"] = row["fa2_append"] = None
    if f2 is None:
        row["fa2_missing"] = row["fa2_append_missing"] = "upstream flash_attn is not importable"
    else:
        seq = torch.full((1,), S, dtype=torch.int32, device="cuda")
        seq0 = torch.full((1,), S - q_len, dtype=torch.int32, device="cuda")
        row["fa2"] = bench(lambda: f2(q, k, v, cache_seqlens=seq, causal=True))
        row["fa2_append"] = bench(lambda: f2(q, k, v, k=k_new, v=v_new, cache_seqlens=seq0, causal=True))
    flops = 4 * D * HQ * attended_keys(S, q_len)
    row["tq3_TFLOPs"] = flops / row["tq3_kernel"] / 1e6
    if row["fa2"]:
        row["fa2_TFLOPs"] = flops / row["fa2"] / 1e6
        row["speedup"] = row["fa2"] / row["tq3_kernel"]
        row["speedup_offset"] = row["fa2"] / row["tq3o_kernel"]
        row["speedup_default"] = row["fa2"] / row["default_kernel"]
        row["speedup_sync"] = row["fa2"] / row["tq3_sync_kernel"]
        row["speedup_append"] = row["fa2_append"] / row["tq3_append"]
    cache = k = v = None  # (not del: lambdas above name them)
    torch.cuda.empty_cache()
    return row


def run_paged(B: int, S: int, page_sizes, dtype=torch.float16) -> dict:
    """Decode (q_len 1) over the same random tokens, contiguous and paged with shuffled pages."""
    _, k, v = fill_cache(B, S, HK, D, dtype, chunk=S)  # fp16 source tokens
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=dtype)
    row = {"B": B, "S": S}
    for ps in [None, *page_sizes]:
        table = None
        if ps is not None:
            per_seq = S // ps
            table = torch.randperm(B * per_seq, dtype=torch.int32).reshape(B, per_seq)
        cache = QuantizedKVCache(B, S, HK, D, page_size=ps, block_table=table, device="cuda", dtype=dtype)
        cache.append(k, v)
        t = bench(lambda: cache.attend(q, cache.seqlens, None, D**-0.5, False, 0))
        row["contiguous" if ps is None else f"page{ps}"] = t
        cache = None  # (not del: lambdas above name them)
    for ps in page_sizes:
        row[f"page{ps}_overhead_pct"] = 100.0 * (row[f"page{ps}"] / row["contiguous"] - 1.0)
    del k, v
    torch.cuda.empty_cache()
    return row


def write_prefill(prefill_rows, paged_rows, page_sizes, meta, out_dir, name):
    """<name>.json / .md / .png: the chunked-prefill rows and the paged-decode rows of this run."""
    lines = [
        f"# Chunked prefill over the 3-bit cache vs FP16 FA2 ({describe(meta)})",
        "",
        made_by(meta),
        "",
        "B=1, 32 q / 8 kv heads, head_dim 128, fp16, causal (bottom-right): q_len new queries over a cache "
        "of S tokens that holds them. µs are do_bench medians; speedup = FA2 time / ours. 'append' = the "
        "whole flash_attn_with_kvcache call with k/v: the chunk is written into the cache (quantized for "
        "ours) and attended. On Hopper the prefill kernel uses wgmma from 256 query rows a kv head "
        "(q_len 64 here); 'mma.sync' = its other variant (FLASH_ATTN_TQ_PREFILL_WGMMA=0), what other GPUs run. "
        "'default cache' = the default's 3-bit layer (16 sinks and 112 recent tokens in 16-bit, keys centered "
        "before RoPE) through flash_attn_with_kvcache.",
        "",
        "| S | q_len | tq3 µs | FA2 µs | speedup | tq3 TFLOP/s | FA2 TFLOP/s | tq3 append µs | FA2 append µs "
        "| speedup (append) | tq3 (scale, offset) µs | speedup (scale, offset) | tq3 mma.sync µs "
        "| speedup (mma.sync) | default cache µs | speedup (default) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in prefill_rows:
        lines.append(
            f"| {r['S']} | {r['q_len']} | {fmt(r['tq3_kernel'])} | {fmt(r['fa2'])} | "
            f"{fmt(r.get('speedup'), '.2f', 'x')} | {fmt(r['tq3_TFLOPs'], '.0f')} | "
            f"{fmt(r.get('fa2_TFLOPs'), '.0f')} | {fmt(r['tq3_append'])} | {fmt(r['fa2_append'])} | "
            f"{fmt(r.get('speedup_append'), '.2f', 'x')} | {fmt(r['tq3o_kernel'])} | "
            f"{fmt(r.get('speedup_offset'), '.2f', 'x')} | {fmt(r.get('tq3_sync_kernel'))} | "
            f"{fmt(r.get('speedup_sync'), '.2f', 'x')} | {fmt(r.get('default_kernel'))} | "
            f"{fmt(r.get('speedup_default'), '.2f', 'x')} |"
        )
    notes = missing_notes(prefill_rows, {"fa2": "FA2 (and the speedups over it)"})
    lines += ["", *notes] if notes else []
    lines += [
        "",
        "## Decode over a paged cache (3-bit turbo, kernel alone)",
        "",
        "Same tokens, contiguous vs pages of P tokens with a shuffled block table; overhead = paged / contiguous - 1.",
        "",
        "| B | S | contiguous µs | " + " | ".join(f"P={ps} µs (overhead)" for ps in page_sizes) + " |",
        "|---|---|---|" + "---|" * len(page_sizes),
    ]
    for r in paged_rows:
        cells = " | ".join(f"{fmt(r[f'page{ps}'])} ({r[f'page{ps}_overhead_pct']:+.1f}%)" for ps in page_sizes)
        lines.append(f"| {r['B']} | {r['S']} | {fmt(r['contiguous'])} | {cells} |")

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for q_len in sorted({r["q_len"] for r in prefill_rows}):
            rs = [r for r in prefill_rows if r["q_len"] == q_len and r.get("speedup")]
            ax.plot([r["S"] for r in rs], [r["speedup"] for r in rs], marker="o", label=f"q_len {q_len}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.9, color="red", lw=0.8, ls="--", label="0.9x target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length S")
        ax.set_ylabel("FA2 fp16 time / tq3 time")
        ax.set_title(f"Chunked prefill, 3-bit cache vs FP16 FA2 ({meta['gpu']})", fontsize=9)
        ax.legend(fontsize=8)
        return fig

    payload = {"meta": meta, "prefill": prefill_rows, "paged": paged_rows}
    has_speedups = any(r.get("speedup") for r in prefill_rows)
    write_results(out_dir, name, payload, "\n".join(lines), plot if has_speedups else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", default=RESULTS, help="output directory (default benchmarks/results)")
    ap.add_argument("--name", default="prefill")
    ap.add_argument("--paged-only", action="store_true", help="only the paged-decode table")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.extension_available():
        raise SystemExit("bench_prefill needs a CUDA GPU and the built extension")
    meta = stamp()
    torch.manual_seed(0)
    lengths = [8192, 32768] if args.quick else [8192, 16384, 32768, 131072]
    chunks = [512, 2048] if args.quick else [64, 512, 1024, 2048, 4096]
    prefill_rows = []
    for S in [] if args.paged_only else lengths:
        for q_len in chunks:
            r = run_prefill(S, q_len)
            print(r, flush=True)
            prefill_rows.append(r)
    page_sizes = [16, 32, 64, 128, 256]
    paged_rows = []
    for B, S in [(8, 32768)] if args.quick else [(1, 131072), (8, 32768), (32, 8192)]:
        r = run_paged(B, S, page_sizes)
        print(r, flush=True)
        paged_rows.append(r)
    write_prefill(prefill_rows, paged_rows, page_sizes, meta, args.out, args.name)


if __name__ == "__main__":
    main()
