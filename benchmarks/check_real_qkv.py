"""Fused kernel vs reference path on real SmolLM2 Q/K/V (from dump_qkv.py), plus generate() speed.

    python benchmarks/check_real_qkv.py QKV.pt [--device cuda] [--bench] [--prompt 8000] [--new 128]

1. For each dumped layer and cache length L, the K/V of tokens [0, L) go into a QuantizedKVCache
   (per config), and the query of token L-1 attends over it through ``flash_attn_with_kvcache``
   (the fused kernel on a GPU; the reference path on CPU). Printed relative errors (Frobenius over
   heads): ``api_vs_ref`` = that output vs the reference computation (dequantize + float32
   attention, :func:`attention_reference`) on the same cache, i.e. the kernel's error on real data;
   ``quant_vs_fp`` = the reference output vs attention over the unquantized fp16 K/V (the
   quantization's own error), ``path`` = which path the API call took.
2. ``--bench`` (needs transformers >= 5): decode tokens/s of ``model.generate`` on a randomly
   initialised model of the dumped config (weights do not matter for speed), fp16 on the GPU, with
   TQCache vs transformers' default DynamicCache (SDPA) after a ``--prompt``-token prompt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flash_attn_tq import QuantizedKVCache, flash_attn_with_kvcache, last_path
from flash_attn_tq.baseline import attention_reference
from flash_attn_tq.testing import describe, stamp
from flash_attn_tq.testing.quality import load_head_sensitivity

HEAD_SENSITIVITY = Path(__file__).resolve().parent / "results" / "head_sensitivity.json"

CONFIGS = {
    "turbo3": dict(),
    "turbo3+kc+w124": dict(key_center=True, fp16_window=124),
    # the TQCache default (its 4 sink tokens aside): 3-bit keys in the first layers, 4-bit in the last
    "default(K3 layers)": dict(key_center=True, scale_only=True, fp16_window=124),
    "default(K4 layers)": dict(k_bits=4, key_center=True, scale_only=True, fp16_window=124),
    # the few heads TQCache.calibrated(model, per_head=True) holds finer: 8-bit keys (and values)
    "K8V3 heads": dict(k_bits=8, key_center=True, scale_only=True, fp16_window=124),
    "K8V8 heads": dict(k_bits=8, v_bits=8, key_center=True, scale_only=True, fp16_window=124),
    "asym3": dict(quantizer="asym"),
    "K4V3+kc": dict(k_bits=4, key_center=True),
    # the TQCache default: keys centered before RoPE (the kernel adds q . R(p) c back)
    "rope(K3 layers)": dict(key_center="rope", scale_only=True, fp16_window=112),
    "rope(K4 layers)": dict(k_bits=4, key_center="rope", scale_only=True, fp16_window=112),
    "rope K8V8 heads": dict(k_bits=8, v_bits=8, key_center="rope", scale_only=True, fp16_window=112),
    "rope, no window": dict(key_center="rope", scale_only=True),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _rope_freqs(data):
    """The dumped model's RoPE frequencies (for the key_center='rope' configs)."""
    from transformers import LlamaConfig

    from flash_attn_tq.integrations.transformers import rope_inv_freq

    return rope_inv_freq(
        LlamaConfig(**{k: v for k, v in data["config"].items() if k in LlamaConfig().to_dict() or k == "head_dim"})
    )


def check_layers(data, device, dtype, lengths):
    print(f"{'layer':>5} {'L':>6} {'config':>16} {'api_vs_ref':>11} {'quant_vs_fp':>11}  path")
    worst = 0.0
    inv_freq = _rope_freqs(data) if any(o.get("key_center") == "rope" for o in CONFIGS.values()) else None
    for layer in sorted(data["k"]):
        q_all = data["q"][layer][0].transpose(0, 1).to(device, dtype)  # [S, Hq, D]
        k_all = data["k"][layer][0].transpose(0, 1).to(device, dtype)  # [S, Hkv, D]
        v_all = data["v"][layer][0].transpose(0, 1).to(device, dtype)
        S, Hkv, D = k_all.shape
        for L in [x for x in lengths if x <= S]:
            q = q_all[L - 1][None, None]  # [1, 1, Hq, D]
            k, v = k_all[None, :L], v_all[None, :L]
            fp, _ = attention_reference(q, k, v, softmax_scale=data["scaling"])
            for name, opts in CONFIGS.items():
                rope = opts.get("key_center") == "rope"  # (the dumped keys sit at positions 0..S-1)
                cache = QuantizedKVCache(
                    1,
                    L,
                    Hkv,
                    D,
                    dtype=dtype if dtype != torch.float32 else torch.float16,
                    device=device,
                    **dict(opts, rope_inv_freq=inv_freq) if rope else opts,
                )
                if cache.key_center:
                    n = min(L, 256)  # a 256-token prompt's statistics
                    cache.calibrate(k[:, :n], positions=torch.arange(n, device=device)[None] if rope else None)
                cache.append(k, v)
                out = flash_attn_with_kvcache(q, cache, softmax_scale=data["scaling"])
                path = last_path()
                kd, vd = cache.dequantize()
                ref, _ = attention_reference(q, kd, vd, softmax_scale=data["scaling"], key_lengths=L)
                e = rel(out, ref)
                worst = max(worst, e)
                print(f"{layer:>5} {L:>6} {name:>16} {e:>11.2e} {rel(ref, fp):>11.2e}  {path}")
    print(f"worst api_vs_ref: {worst:.2e}")
    return worst


def _head_options(config):
    """The per-head widths TQCache.calibrated(model, per_head=True) chose for SmolLM2 (results/
    head_sensitivity.json), else 9 heads with 8-bit keys spread over the layers."""
    from flash_attn_tq.integrations.calibration import allocate_head_bits

    H, L = config.num_key_value_heads, config.num_hidden_layers
    heads = [(i, h) for i in range(L) for h in range(H)]
    saved = load_head_sensitivity(HEAD_SENSITIVITY)
    if saved and (L, H) == (30, 3):
        chosen = allocate_head_bits(saved[1], heads, (32 * len(heads)) // config.head_dim)
    else:
        chosen = {(i, i % H): (8, 3) for i in range(0, L, max(1, L // 9))}
    return {hd: {"k_bits": k, "v_bits": v} for hd, (k, v) in chosen.items() if (k, v) != (3, 3)}


def bench_generate(data, device, dtype, prompt, new, repeats):
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("--bench skipped: transformers is not installed")
        return
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache

    cfg = dict(data["config"])
    cfg = {k: v for k, v in cfg.items() if k in LlamaConfig().to_dict() or k in ("head_dim",)}
    config = LlamaConfig(**cfg)
    config.max_position_embeddings = max(config.max_position_embeddings, prompt + new + 8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(10, config.vocab_size, (1, prompt), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(impl, make_cache, n):
        model.set_attn_implementation(impl)
        best = float("inf")
        for _ in range(repeats):
            cache = make_cache()
            sync()
            t = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    rows = []
    cap = prompt + new
    for name, impl, make in (
        ("DynamicCache (sdpa)", "sdpa", lambda: None),
        ("TQCache (default)", ATTN_IMPLEMENTATION, lambda: TQCache(config, max_cache_len=cap)),
        # per-head widths (TQCache.calibrated(model, per_head=True)): the layers with a finer head hold
        # two caches, two kernel launches; widths as calibrated on SmolLM2 when its measurement is here
        (
            "TQCache (per-head widths)",
            ATTN_IMPLEMENTATION,
            lambda: TQCache(config, max_cache_len=cap, late_k_bits=None, head_options=_head_options(config)),
        ),
    ):
        t1 = timed(impl, make, 1)
        tn = timed(impl, make, new)
        rows.append((name, (new - 1) / max(tn - t1, 1e-9), t1))
    print(
        f"generate: prompt {prompt}, {new} new tokens, {dtype}, {device}, transformers {transformers.__version__}, "
        f"model {config.num_hidden_layers} layers x {config.num_attention_heads}/{config.num_key_value_heads} heads "
        f"x {config.head_dim}"
    )
    for name, tps, t1 in rows:
        print(f"  {name:>24}: {tps:8.1f} decode tokens/s (prefill + 1 token: {t1:.3f} s)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("qkv", help="file written by dump_qkv.py")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--prompt", type=int, default=8000)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # the CPU reference path computes in float32
    meta = stamp()
    print(f"# {describe(meta)}, {meta['date']}: {meta['command']}", flush=True)  # (a log of this output is stamped)
    data = torch.load(args.qkv, map_location="cpu")
    check_layers(data, device, dtype, [int(x) for x in args.lengths.split(",")])
    if args.bench:
        bench_generate(
            data, device, dtype if device.type == "cuda" else torch.float32, args.prompt, args.new, args.repeats
        )


if __name__ == "__main__":
    main()
