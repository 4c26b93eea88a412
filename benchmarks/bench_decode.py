"""Decode attention benchmark: fused 3-bit kernel vs FP16 paths, side by side in one run.

    python benchmarks/bench_decode.py [--quick] [--out benchmarks/results]

For each shape (batch B, cache length S, q heads, kv heads, head_dim d; q_len 1) it times, with
``triton.testing.do_bench`` medians (CUDA events, warm-up, random data):

* ``tq3_kernel``: the fused decode op alone (it rotates q and the output itself);
* ``tq3_api``: ``flash_attn_tq.flash_attn_with_kvcache(q, cache)`` end to end, eager and as a CUDA graph;
* ``kv16``: the same kernel body over the fp16 cache (its Fp16KV loader policy): our FP16 baseline;
* ``sdpa_flash`` / ``sdpa_cudnn``: PyTorch SDPA on the fp16 cache;
* ``fa2``: upstream ``flash_attn.flash_attn_with_kvcache`` when importable;
* ``--production`` adds the FP8 anchor, FlashInfer's decode over an e4m3 cache, when ``flashinfer``
  is importable (``pip install flashinfer-python``; 0.7.4 measured, its kernels JIT-compiled with
  nvcc at first use).

Speedups are the fastest FP16 path's time over ours (FP16 paths: SDPA flash, SDPA cuDNN, upstream
FA2, our kv16). GB/s counts the bytes the kernel must read
(packed codes + metadata for ours, fp16 K/V for the others). Writes JSON + Markdown (+ PNG) with
the run's stamp (GPU, torch, CUDA, git commit, the command). A second table times
quantize-on-write (the pack kernel, K and V) against a device copy of the same fp16 bytes. A path
this run cannot measure (flashinfer or upstream FA2 not installed) is written as missing, with why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import flash_attn_tq as fa
from flash_attn_tq import dispatch, ops
from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.integrations.options import NO_FP16_WINDOW
from flash_attn_tq.testing import (
    DEFAULT_LAYERS,
    DEFAULT_OPTS,
    MISSING,
    bench,
    bench_graph,
    default_layers,
    describe,
    fill_cache,
    fmt,
    interleaved,
    made_by,
    missing_notes,
    rope_freqs,
    stamp,
    upstream_fa2,
    weighted_default,
    write_results,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

ISSUE_SHAPES = [  # (B, S, Hq, Hk, d)
    (1, 131072, 32, 8, 128),
    (8, 32768, 32, 8, 128),
    (32, 8192, 32, 8, 128),
    (16, 4096, 32, 32, 128),
    (64, 2048, 32, 8, 128),
]


def sweep_shapes(quick: bool, head_dims=(128, 64)):
    lengths = [1024, 4096, 16384, 65536] if quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    out = []
    for d in head_dims:
        for B in (1, 8):
            for S in lengths:
                if B * S <= 8 * 32768 * (2 if d == 64 else 1):
                    out.append((B, S, 32, 8, d))
    return out


def bench_eager(fn, calls=50, reps=15):
    """Median time (µs) a call of ``fn`` issued back to back, eager: events around ``calls`` calls, so
    a call whose host work outlasts its kernels counts its host time (do_bench flushes L2 between
    calls, which hides it)."""
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def flashinfer_fp8_decode(q, k, v, page_size=16):
    """The FP8 anchor: FlashInfer's batch decode over an e4m3 copy of the fp16 cache
    ``k, v [B, S, Hk, d]`` in 16-token pages, for queries ``q [B, 1, Hq, d]``: ``(calls, why)``, a call
    for each of its kernels that plans (the CUDA-core decode kernel, the tensor-core one) and, where
    none does, why (``flashinfer`` not importable: an optional extra of the benchmark, JIT-compiled
    at first use). The cast keeps unit scales: the data is N(0, 1), inside e4m3's range."""
    try:
        import flashinfer
    except Exception as e:
        return [], f"flashinfer is not importable ({type(e).__name__})"
    B, S, Hk, d = k.shape
    Hq, pages = q.shape[2], (S + page_size - 1) // page_size
    kv = torch.zeros(B, pages * page_size, 2, Hk, d, device=k.device, dtype=torch.float8_e4m3fn)
    kv[:, :S, 0], kv[:, :S, 1] = k, v
    kv = kv.view(B, pages, page_size, 2, Hk, d).transpose(2, 3).reshape(B * pages, 2, page_size, Hk, d)
    indptr = torch.arange(0, B * pages + 1, pages, dtype=torch.int32, device=k.device)
    indices = torch.arange(B * pages, dtype=torch.int32, device=k.device)
    last = torch.full((B,), S - (pages - 1) * page_size, dtype=torch.int32, device=k.device)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=k.device)
    q3, out = q[:, 0].contiguous(), torch.empty(B, Hq, d, device=q.device, dtype=q.dtype)
    calls, errors = [], []
    for tensor_cores in (False, True):
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
            )
            wrapper.plan(
                indptr,
                indices,
                last,
                Hq,
                Hk,
                d,
                page_size,
                pos_encoding_mode="NONE",
                q_data_type=q.dtype,
                kv_data_type=torch.float8_e4m3fn,
                o_data_type=q.dtype,
                sm_scale=d**-0.5,
            )
            wrapper.run(q3, kv, out=out)
        except Exception as e:  # a JIT or planning failure leaves that kernel out, and says why
            errors.append(f"tensor_cores={tensor_cores}: {str(e).splitlines()[0][:200]}")
            print(f"flashinfer fp8 decode unavailable at B={B} S={S} d={d}, {errors[-1]}", flush=True)
            continue
        calls.append(lambda w=wrapper: w.run(q3, kv, out=out))
    return calls, None if calls else "flashinfer failed to plan its kernels (" + "; ".join(errors) + ")"


def run_shape(B, S, Hq, Hk, d, dtype=torch.float16):
    cache, k, v = fill_cache(B, S, Hk, d, dtype)
    q = torch.randn(B, 1, Hq, d, device="cuda", dtype=dtype)
    scale = d**-0.5
    lens = cache.seqlens
    row = {"B": B, "S": S, "Hq": Hq, "Hk": Hk, "d": d}
    plan = cache.plan(dispatch.Query.of(q))  # (the op alone: planned once, no per-call checks)
    row["tq3_kernel"] = bench(lambda: cache.attend(q, lens, None, scale, False, plan=plan))
    row["tq3_api"] = bench(lambda: fa.flash_attn_with_kvcache(q, cache))
    assert fa.last_path() == "quantized:fused-cuda", fa.last_path()
    row["tq3_api_graph"] = bench_graph(lambda: fa.flash_attn_with_kvcache(q, cache))  # splits: host-side heuristic
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                row[name] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        except Exception as e:  # backend not available for this shape
            row[name] = None
            row[name + "_missing"] = f"SDPA's backend refused the shape: {str(e).splitlines()[0][:120]}"
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    row["kv16"] = bench(lambda: ops.decode_kv16(q, k, v, seq, None, None, scale, False, 0))
    f2 = upstream_fa2()
    if f2 is not None:
        row["fa2"] = bench(lambda: f2(q, k, v, cache_seqlens=seq))
    else:
        row["fa2"], row["fa2_missing"] = None, "upstream flash_attn is not importable"
    fp16_paths = [row[n] for n in ("sdpa_flash", "sdpa_cudnn", "fa2", "kv16") if row.get(n)]
    best = min(fp16_paths)
    row["fp16_best_us"] = best
    row["speedup_kernel"] = best / row["tq3_kernel"]
    row["speedup_api"] = best / row["tq3_api"]
    row["speedup_api_graph"] = best / row["tq3_api_graph"]
    packed = B * S * Hk * (cache.k_codes.shape[-1] + cache.v_codes.shape[-1] + 8)
    row["tq3_GBps"] = packed / row["tq3_kernel"] / 1e3
    row["fp16_GBps"] = B * S * Hk * d * 2 * 2 / best / 1e3
    cache = k = v = None  # (not del: lambdas above name them)
    torch.cuda.empty_cache()
    return row


PRODUCTION_SHAPES = [  # (B, S, Hq, Hk, d): the issue's table, and short caches
    (1, 4096, 32, 8, 128),
    (8, 32768, 32, 8, 128),
    (64, 2048, 32, 8, 128),
    (1, 131072, 32, 8, 128),
    (8, 32768, 32, 8, 64),
    (1, 1024, 32, 8, 128),
    (8, 1024, 32, 8, 128),
    (32, 8192, 32, 8, 128),
]


def run_production(B, S, Hq, Hk, d, dtype=torch.float16):
    """One row of production.json: the plain 3-bit cache and the default cache (its kinds of layer:
    flash_attn_tq.testing.default_layers),
    flash_attn_with_kvcache replayed as a CUDA graph and eager (plain and the default's layers in
    interleaved rounds), beside cuDNN SDPA on fp16."""
    q = torch.randn(B, 1, Hq, d, device="cuda", dtype=dtype)
    row = {"B": B, "S": S, "Hq": Hq, "Hk": Hk, "d": d}
    plain, k, v = fill_cache(B, S, Hk, d, dtype)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_us"] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    fp8, why = flashinfer_fp8_decode(q, k, v)
    row["fp8_us"] = min((bench(f) for f in fp8), default=None)  # the faster of FlashInfer's two kernels
    if why:
        row["fp8_us_missing"] = why
    k = v = kt = vt = fp8 = None  # (not del: lambdas above name them)
    torch.cuda.empty_cache()
    fns, layers = default_layers(q, S, Hk, dtype)
    fns["plain"] = lambda: fa.flash_attn_with_kvcache(q, plain)
    # the K3V3 layer without a 16-bit window: the recent tokens as a ring of 4-bit codes (NO_FP16_WINDOW)
    ring = fill_cache(B, S, Hk, d, dtype, rope_inv_freq=rope_freqs(d), **dict(DEFAULT_OPTS, **NO_FP16_WINDOW))[0]
    fns["k3_ring"] = lambda: fa.flash_attn_with_kvcache(q, ring)
    row.update({name + "_us": bench_graph(fn) for name, fn in fns.items()})
    eager = interleaved({name: fns[name] for name in ("plain", *layers)}, lambda fn: bench_eager(fn, reps=5))
    row.update({name + "_eager_us": t for name, t in eager.items()})
    row["default_us"], row["default_eager_us"] = (weighted_default(row, layers, sfx) for sfx in ("_us", "_eager_us"))
    row["default_vs_plain"] = row["default_us"] / row["plain_us"]
    row["default_speedup_vs_cudnn"] = row["cudnn_us"] / row["default_us"]
    if row["fp8_us"] is not None:
        row["plain_speedup_vs_fp8"] = row["fp8_us"] / row["plain_us"]
        row["default_speedup_vs_fp8"] = row["fp8_us"] / row["default_us"]
    fns = plain = ring = None
    torch.cuda.empty_cache()
    return row


PRODUCTION_PREFILL = [(S, n) for S in (8192, 16384, 32768) for n in (512, 1024, 2048)]  # (S, q_len)


def run_production_prefill(S, q_len, Hq=32, Hk=8, d=128, dtype=torch.float16):
    """One prefill row of production.json: a chunk of q_len queries over a cache of S tokens that holds
    it (B=1, causal), the plain and the default cache (layers weighted as in run_production) beside
    upstream FA2 over the fp16 cache when it is importable."""
    q = torch.randn(1, q_len, Hq, d, device="cuda", dtype=dtype)
    row = {"S": S, "q_len": q_len}
    plain, k, v = fill_cache(1, S, Hk, d, dtype)
    f2 = upstream_fa2()
    seq = torch.full((1,), S, dtype=torch.int32, device="cuda")
    row["fa2_us"] = bench(lambda: f2(q, k, v, cache_seqlens=seq, causal=True)) if f2 else None
    if f2 is None:
        row["fa2_us_missing"] = "upstream flash_attn is not importable"
    row["plain_us"] = bench(lambda: fa.flash_attn_with_kvcache(q, plain, causal=True))
    plain = k = v = None  # (not del: lambdas above name them)
    torch.cuda.empty_cache()
    fns, layers = default_layers(q, S, Hk, dtype, causal=True)
    row.update({name + "_us": bench(fn) for name, fn in fns.items()})  # (chunks: no one-launch pair)
    row["default_us"] = weighted_default(row, layers, "_us")
    fns = None
    torch.cuda.empty_cache()
    if row["fa2_us"]:
        row["plain_vs_fa2"] = row["fa2_us"] / row["plain_us"]
        row["default_vs_fa2"] = row["fa2_us"] / row["default_us"]
    return row


def write_production(rows, prefill, meta, out_dir):
    """production.json / .md / .png: the decode rows and the prefill rows of this run."""
    lines = [
        f"# The default cache vs the plain 3-bit cache ({describe(meta)})",
        "",
        made_by(meta),
        "",
        "flash_attn_with_kvcache(q, cache), q_len 1, fp16, µs (medians; 'graph': the call replayed as a CUDA "
        "graph; 'eager': 50 calls issued back to back, so host time counts where it exceeds the kernels'; "
        "plain and the default's layers timed in 5 interleaved rounds). "
        "default = TQCache.calibrated's SmolLM2 layout mapped onto the shape: 16 sink + 112 recent "
        f"tokens in 16-bit, keys centered before RoPE, 32/d of {DEFAULT_LAYERS} layers with 4-bit keys, one layer "
        "with a K8V8 kv head beside 3-bit ones (both head groups in one launch); its time is the layers' "
        "weighted mean. "
        "FP8: FlashInfer's batch decode over an e4m3 copy of the cache (16-token pages; the faster of its "
        f"CUDA-core and tensor-core kernels), eager like cuDNN; {MISSING} where this run could not measure it "
        "(the note under the table says why). 'copy-head layer, a "
        "launch a group': the same layer with each head group launched on its own, as before the one-launch "
        "kernel. 'K3V3 layer, 4-bit ring': that layer without a 16-bit window (NO_FP16_WINDOW: the 128 most "
        "recent tokens as 4-bit codes, attended by the decode launch).",
        "",
        "| B | S | Hq/Hk | d | cuDNN | FP8 | plain (graph) | default (graph) | default / plain | cuDNN / default | "
        "FP8 / default | plain eager | default eager | eager default / plain | K3V3 layer | K4V3 layer | "
        "copy-head layer | copy-head layer, a launch a group | K3V3 layer, 4-bit ring |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hk']} | {r['d']} | {fmt(r['cudnn_us'])} | "
            f"{fmt(r.get('fp8_us'))} | "
            f"{fmt(r['plain_us'])} | {fmt(r['default_us'])} | {r['default_vs_plain']:.2f}x | "
            f"{r['default_speedup_vs_cudnn']:.2f}x | {fmt(r.get('default_speedup_vs_fp8'), '.2f', 'x')} | "
            f"{fmt(r['plain_eager_us'])} | {fmt(r['default_eager_us'])} | "
            f"{r['default_eager_us'] / r['plain_eager_us']:.2f}x | {fmt(r['k3_us'])} | {fmt(r['k4_us'])} | "
            f"{fmt(r['mixed_us'])} | {fmt(r.get('mixed_apart_us'))} | {fmt(r.get('k3_ring_us'))} |"
        )
    notes = missing_notes(rows, {"fp8_us": "FP8"})
    if any(r.get("mixed_apart_us") is None for r in rows):
        notes.append(f"{MISSING} under 'a launch a group': the one-launch kernel does not take that shape.")
    lines += ["", *notes] if notes else []
    if prefill:
        lines += [
            "",
            "## Chunked prefill over the default cache",
            "",
            "B=1, 32/8 heads, d 128, fp16: a chunk of q_len queries over a cache of S tokens that holds it, "
            "causal, flash_attn_with_kvcache eager, µs. FA2: upstream 2.8.3 over the fp16 cache; default: the "
            "layers weighted as above (the copy-head layer's K8V8 head runs the decode kernel).",
            "",
            "| S | q_len | FA2 | plain | default | FA2 / plain | FA2 / default | K3V3 layer | K4V3 layer | "
            "copy-head layer |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in prefill:
            lines.append(
                f"| {r['S']} | {r['q_len']} | {fmt(r['fa2_us'])} | {fmt(r['plain_us'])} | {fmt(r['default_us'])} | "
                f"{fmt(r.get('plain_vs_fa2'), '.2f', 'x')} | {fmt(r.get('default_vs_fa2'), '.2f', 'x')} | "
                f"{fmt(r['k3_us'])} | {fmt(r['k4_us'])} | {fmt(r['mixed_us'])} |"
            )
        notes = missing_notes(prefill, {"fa2_us": "FA2"})
        lines += ["", *notes] if notes else []

    def plot(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        names = [f"{r['B']}x{r['S'] // 1024}K d{r['d']}" for r in rows]
        x = range(len(rows))
        series = [
            ("cudnn_us", "cuDNN fp16"),
            ("fp8_us", "FlashInfer fp8"),
            ("plain_us", "plain 3-bit"),
            ("default_us", "default cache"),
        ]
        series = [(k, lab) for k, lab in series if all(r.get(k) for r in rows)]
        w = 0.8 / len(series)
        for i, (key, label) in enumerate(series):
            ax.bar([j + w * (i - (len(series) - 1) / 2) for j in x], [r[key] for r in rows], width=w, label=label)
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.set_ylabel("µs (CUDA graph)")
        ax.set_title(f"decode, default vs plain 3-bit cache, {meta['gpu']}")
        ax.legend()
        return fig

    payload = {"meta": meta, "rows": rows, "prefill": list(prefill)}
    write_results(out_dir, "production", payload, "\n".join(lines), plot if rows else None)
    print("\n".join(lines))


PACK_SHAPES = [  # (B, new tokens, kv heads, d): decode appends, a prefill chunk, a long prompt
    (1, 1, 8, 128),
    (64, 1, 8, 128),
    (1, 2048, 8, 128),
    (8, 4096, 8, 128),
    (1, 32768, 8, 128),
    (8, 4096, 8, 64),
]


def run_pack(B, n, Hk, d, dtype=torch.float16):
    """Quantize-on-write of new K and V: the pack kernel alone (two launches) and cache.append (the
    API: slots, checks, both launches), against a device copy of the same fp16 bytes."""
    k = torch.randn(B, n, Hk, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cache = QuantizedKVCache(B, n, Hk, d, device="cuda", dtype=dtype)
    zero = torch.zeros(B, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    dst = torch.empty_like(k)
    row = {"B": B, "n": n, "Hk": Hk, "d": d, "input_MB": nbytes / 1e6}
    row["pack_us"] = bench(lambda: cache.write_codes(k, v, zero))
    row["append_us"] = bench(lambda: cache.append(k, v, cache_seqlens=zero))
    row["copy_us"] = bench(lambda: (dst.copy_(k), dst.copy_(v)))  # reads + writes nbytes each
    row["pack_GBps"] = nbytes / row["pack_us"] / 1e3
    row["append_GBps"] = nbytes / row["append_us"] / 1e3
    row["copy_read_GBps"] = nbytes / row["copy_us"] / 1e3
    row["pack_vs_copy_read"] = row["copy_us"] / row["pack_us"]
    row["pack_vs_hbm_copy"] = row["pack_GBps"] / 4200.0  # the H200's measured ~4.2 TB/s device copy
    return row


def write_decode(rows, pack_rows, meta, out_dir, name):
    """<name>.json / .md / .png: the decode rows (the issue's shapes and the length sweep) and the
    quantize-on-write rows of this run."""
    lines = [
        f"# Decode attention, fused 3-bit vs FP16 ({describe(meta)})",
        "",
        made_by(meta),
        "",
        "µs are do_bench medians (random data, warm-up); speedup = fastest FP16 path (SDPA flash, SDPA cuDNN, "
        "upstream FA2, our kv16 = this kernel body over the fp16 cache) / ours. 'kernel' is the fused op alone; "
        "'API' is flash_attn_with_kvcache end to end "
        "(argument handling + the kernel), eager and replayed as a CUDA graph as serving engines "
        "run decode. GB/s = bytes that must be read (packed codes + metadata, or fp16 K/V) / time.",
        "",
        "| B | S | Hq/Hk | d | tq3 kernel µs | tq3 API µs (eager) | tq3 API µs (graph) | SDPA flash µs "
        "| SDPA cuDNN µs | "
        "FA2 µs | kv16 µs | speedup (kernel) | speedup (API, graph) | tq3 GB/s | fp16 GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hk']} | {r['d']} | {fmt(r['tq3_kernel'])} | "
            f"{fmt(r['tq3_api'])} | {fmt(r['tq3_api_graph'])} | {fmt(r['sdpa_flash'])} | {fmt(r['sdpa_cudnn'])} | "
            f"{fmt(r['fa2'])} | {fmt(r.get('kv16'))} | {fmt(r['speedup_kernel'], '.2f', 'x')} | "
            f"{fmt(r['speedup_api_graph'], '.2f', 'x')} | {fmt(r['tq3_GBps'], '.0f')} | {fmt(r['fp16_GBps'], '.0f')} |"
        )
    notes = missing_notes(rows, {"sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN", "fa2": "FA2"})
    lines += ["", *notes] if notes else []
    if pack_rows:
        lines += [
            "",
            "## Quantize-on-write (turbo 3-bit, K and V)",
            "",
            "GB/s count the fp16 K+V input; 'copy' is a device copy of the same bytes (read + write) in the "
            "same run; 'of 4.2 TB/s' is the pack kernel's input rate over the H200's measured copy rate.",
            "",
            "| B | new tokens | Hk | d | input MB | pack kernel µs | append API µs | copy µs | pack GB/s | "
            "append GB/s | pack / copy time | of 4.2 TB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pack_rows:
            lines.append(
                f"| {r['B']} | {r['n']} | {r['Hk']} | {r['d']} | {r['input_MB']:.2f} | {fmt(r['pack_us'])} | "
                f"{fmt(r['append_us'])} | {fmt(r['copy_us'])} | {fmt(r['pack_GBps'], '.0f')} | "
                f"{fmt(r['append_GBps'], '.0f')} | {r['pack_vs_copy_read']:.2f} | {100 * r['pack_vs_hbm_copy']:.0f}% |"
            )

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for d in sorted({r["d"] for r in rows}):
            for B in sorted({r["B"] for r in rows}):
                pts = [(r["S"], r["speedup_kernel"]) for r in rows if r["d"] == d and r["B"] == B and r.get("sweep")]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=f"B={B}, d={d}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length S")
        ax.set_ylabel("speedup vs fastest FP16")
        ax.set_title(f"fused 3-bit decode, {meta['gpu']}")
        ax.legend()
        return fig

    payload = {"meta": meta, "rows": rows, "pack": pack_rows}
    write_results(out_dir, name, payload, "\n".join(lines), plot if any(r.get("sweep") for r in rows) else None)
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument("--out", default=RESULTS, help="output directory (default benchmarks/results)")
    ap.add_argument("--name", default="decode", help="output file stem of the decode table")
    ap.add_argument("--head-dims", default="128,64", help="head dims of the length sweep")
    ap.add_argument("--pack-only", action="store_true", help="only the quantize-on-write table")
    ap.add_argument(
        "--production", action="store_true", help="only the default-vs-plain table (production.json / production.md)"
    )
    ap.add_argument(
        "--no-prefill",
        action="store_true",
        help="with --production: the decode rows only (production.md then has no prefill table)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.extension_available():
        sys.exit("bench_decode needs a CUDA GPU and the built extension")
    meta = stamp()
    torch.manual_seed(0)
    if args.production:
        rows, prefill = [], []
        run_production(*PRODUCTION_SHAPES[0])  # warm-up, not kept: the process's first eager calls ran 2x slow
        for shp in PRODUCTION_SHAPES:
            rows.append(run_production(*shp))
            print(rows[-1], flush=True)
        for shp in [] if args.no_prefill else PRODUCTION_PREFILL:
            prefill.append(run_production_prefill(*shp))
            print(prefill[-1], flush=True)
        write_production(rows, prefill, meta, args.out)
        return
    rows = []
    for shp in [] if args.pack_only else ISSUE_SHAPES:
        rows.append(run_shape(*shp))
        print(rows[-1], flush=True)
    for shp in [] if args.pack_only else sweep_shapes(args.quick, tuple(int(x) for x in args.head_dims.split(","))):
        r = run_shape(*shp)
        r["sweep"] = True
        rows.append(r)
        print(r, flush=True)
    pack_rows = []
    for shp in PACK_SHAPES:
        pack_rows.append(run_pack(*shp))
        print(pack_rows[-1], flush=True)
    write_decode(rows, pack_rows, meta, args.out, args.name)


if __name__ == "__main__":
    main()
