"""Self-check and quick benchmark: ``python -m flash_attn_tq.selfcheck``.

Checks the codec (round trip, bits per element, quantizer error against the published Gaussian
figures), the quantized attention path against float32 attention over the dequantized cache, and
times decode. Uses the fused CUDA kernels when a GPU and the built extension are present, the
PyTorch reference path otherwise. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import flash_attn_tq as fa
from flash_attn_tq import baseline, ops
from flash_attn_tq.keys import rope_turn
from flash_attn_tq.quantizers import grid_mse


def _check(name: str, ok: bool, detail: str) -> bool:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    return ok


CUDA_REPS = 50  # timed calls a measurement on the GPU without triton


def decode_timer(cuda: bool, reps: int):
    """``(time_us, label)``: ``time_us(fn)`` times ``fn`` in microseconds and ``label`` says what that
    number is. On the GPU: the median of triton's ``do_bench`` (triton ships with CUDA builds of torch
    on Linux; ``pip install "flash_attn_tq[bench]"`` otherwise), or without triton the median of
    CUDA-event-timed calls. On the CPU: the mean of ``reps`` calls after one warm-up call."""
    if cuda:
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return (lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3), "GPU median, do_bench"

        def events_us(fn) -> float:
            for _ in range(3):
                fn()
            times = []
            for _ in range(CUDA_REPS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            return sorted(times)[len(times) // 2]

        return events_us, f"GPU median of {CUDA_REPS} calls, CUDA events (triton not installed)"

    def mean_us(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6

    return mean_us, f"CPU mean of {reps} calls after one warm-up"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    fused = dev.type == "cuda" and ops.extension_available()
    print(
        f"flash_attn_tq {fa.__version__} | torch {torch.__version__} | device {dev}"
        f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''} | "
        f"fused kernels: {'yes' if fused else 'no (reference path)'}"
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    ok = True

    print("codec")
    codes = torch.randint(0, 8, (64, 128), generator=gen, device=dev)
    ok &= _check(
        "3-bit pack/unpack round trip",
        torch.equal(fa.unpack_codes(fa.pack_codes(codes, 3), 3, 128), codes),
        f"{fa.code_bytes(128, 3)} B/vector, {fa.bits_per_element(128, 3, 2)} bits/element at head_dim 128 "
        f"(turbo's scale-only default; {fa.bits_per_element(128, 3)} with (scale, offset))",
    )
    x = torch.randn(4096, 128, generator=gen, device=dev)
    for grid, published in (("uniform", 0.0375), ("lloyd_max", 0.0345)):
        qz = fa.TurboQuantizer(128, 3, grid)
        rel = (((qz.dequantize(*qz.quantize(x)) - x) ** 2).sum() / (x**2).sum()).item()
        ok &= _check(
            f"turbo 3-bit {grid} relative MSE",
            abs(rel - published) < 0.004,
            f"{rel:.4f} (N(0,1) grid MSE {grid_mse(3, grid):.4f}, published {published})",
        )

    print("attention over a 3-bit cache")
    B, S, hq, hk, d = (4, 4099, 32, 8, 128) if fused else (2, 515, 8, 2, 128)
    cache = fa.QuantizedKVCache(B, S + 1, hk, d, device=dev)
    k = torch.randn(B, S, hk, d, generator=gen, device=dev, dtype=torch.float16)
    v = torch.randn(B, S, hk, d, generator=gen, device=dev, dtype=torch.float16)
    cache.append(k, v)
    q = torch.randn(B, 1, hq, d, generator=gen, device=dev, dtype=torch.float16)
    out = fa.flash_attn_with_kvcache(q, cache)
    path = fa.last_path()
    kd, vd = cache.dequantize()
    ref, _ = baseline.attention_reference(q.float(), kd, vd, key_lengths=cache.seqlens)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ok &= _check(f"{path} vs float32 over the dequantized cache", err < 2e-3, f"relative error {err:.2e}")
    # a chunk of new queries (chunked prefill, causal, bottom-right): on the GPU 64 queries x 4 heads a
    # kv head = 256 rows, the prefill kernel
    n_chunk = 64 if fused else 16
    qc = torch.randn(B, n_chunk, hq, d, generator=gen, device=dev, dtype=torch.float16)
    outc = fa.flash_attn_with_kvcache(qc, cache, causal=True)
    refc, _ = baseline.attention_reference(qc.float(), kd, vd, causal=True, key_lengths=cache.seqlens)
    errc = ((outc.float() - refc).norm() / refc.norm()).item()
    ok &= _check(
        f"chunked prefill ({n_chunk} queries, causal), {fa.last_path()}", errc < 2e-3, f"relative error {errc:.2e}"
    )
    # keys centered before RoPE (TQCache's default): the kernel adds each score's q . R(p) c back
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=dev).float() / d)
    raw = torch.randn(B, 1, hk, d, generator=gen, device=dev) + torch.randn(B, S, hk, d, generator=gen, device=dev)
    k_rope = rope_turn(raw, torch.arange(S, device=dev), inv_freq).half()
    centered = fa.QuantizedKVCache(B, S + 1, hk, d, device=dev, key_center="rope", rope_inv_freq=inv_freq)
    centered.append(k_rope, v)
    outr = fa.flash_attn_with_kvcache(q, centered)
    krd, vrd = centered.dequantize()
    refr, _ = baseline.attention_reference(q.float(), krd, vrd, key_lengths=centered.seqlens)
    errr = ((outr.float() - refr).norm() / refr.norm()).item()
    ok &= _check(f"key_center='rope' cache, {fa.last_path()}", errr < 5e-3, f"relative error {errr:.2e}")
    full, _ = baseline.attention_reference(q.float(), k.float(), v.float())
    qerr = ((out.float() - full).norm() / full.norm()).item()
    print(
        f"  [info] vs full-precision K/V (quantization error): relative {qerr:.3f}; "
        f"cache {cache.nbytes / 2**20:.1f} MiB, {cache.compression_ratio():.2f}x smaller than fp16"
    )

    time_us, how = decode_timer(dev.type == "cuda", reps=3)
    print(f"decode timing ({how})")
    t_ours = time_us(lambda: fa.flash_attn_with_kvcache(q, cache))
    if dev.type == "cuda":  # the fp16 reference point: PyTorch SDPA (cuDNN/flash) over the fp16 cache
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        t_fp16 = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        base = "SDPA on the fp16 cache"
    else:
        t_fp16 = time_us(lambda: fa.flash_attn_func(q, k, v))
        base = f"fp16 baseline, {fa.last_path()}"
    print(
        f"  3-bit cache ({path}): {t_ours:.1f} us | {base}: {t_fp16:.1f} us | fp16/ours {t_fp16 / t_ours:.2f}x "
        f"(B={B}, S={S}, heads {hq}/{hk}, d={d}; eager calls: launch overhead included)"
    )
    if dev.type != "cuda":
        print("  (the CPU reference path is for correctness, not speed)")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
