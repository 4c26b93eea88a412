"""CPU mode benchmark: decode time and SmolLM2 quality of CpuQuantizedKVCache (int8 keys, 3-bit values).

Timing: one decode call (one query token per sequence, no new k/v) at B=4, S=4096, 32 query / 8 kv
heads, head_dim 128, median of ``--repeats`` calls after a warm-up, against PyTorch SDPA
(``scaled_dot_product_attention``, ``enable_gqa=True``) over float16 and float32 K/V and against the
reference path of the 3-bit :class:`QuantizedKVCache` (dequantize everything, float32 attention).

Quality: SmolLM2-135M-Instruct (the Q4_1 GGUF from ``--data``, flash_attn_tq.testing.assets, float32),
teacher forcing over windows of ``--window`` tokens of two texts. Every attention layer writes its
K/V through the cache and attends causally over it (each token, its own included, is read back from
the cache). Against the full-precision model: top-1 agreement and mean KL(full || config) of the
next-token distributions, and perplexity.

Writes cpu.json and cpu.md under ``--out`` (default benchmarks/results), stamped with the CPU model,
torch version, commit, threads, the machine's load and the command.

    python benchmarks/bench_cpu.py [--threads 1,2] [--repeats 9] [--no-quality] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flash_attn_tq as fa
from flash_attn_tq.cpu import CpuQuantizedKVCache
from flash_attn_tq.testing import host_ms, interleaved, made_by, stamp, write_results
from flash_attn_tq.testing.assets import default_data_dir, load_smollm2, model_dir

RESULTS = Path(__file__).resolve().parent / "results"
TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
ATTN_NAME = "tq_cpu_bench"


def interleaved_ms(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """Median ms per call of each function, timed round-robin (one call of each per round), so a
    change of the machine's load during the run hits every row alike."""
    return interleaved(fns, host_ms, rounds=repeats, warmup=warmup)


# ------------------------------------------------------------------------------------ timing


def timing(batch: int, seqlen: int, hq: int, hk: int, d: int, repeats: int, ref_repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, seqlen, hk, d, generator=gen) + torch.randn(1, 1, hk, d, generator=gen)
    v = torch.randn(batch, seqlen, hk, d, generator=gen)
    q = torch.randn(batch, 1, hq, d, generator=gen)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    full = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    fns, info = {}, {}
    for dt, bits in ((torch.float16, 16.0), (torch.float32, 32.0)):
        a, b, c = qt.to(dt), kt.to(dt), vt.to(dt)
        name = f"SDPA {str(dt).replace('torch.', '')} K/V"
        fns[name] = lambda a=a, b=b, c=c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True)
        info[name] = (bits, "")
    for name, kw in (
        ("CpuQuantizedKVCache int8 K (per token) + 3-bit V", {}),
        ("same, bfloat16 compute", dict(compute_dtype=torch.bfloat16)),
        ("same, int8 K scale per 32 channels", dict(key_group=32)),
    ):
        cache = CpuQuantizedKVCache(batch, seqlen, hk, d, **kw)
        cache.append(k, v)
        fns[name] = lambda cache=cache: fa.flash_attn_with_kvcache(q, cache)
        out = fa.flash_attn_with_kvcache(q, cache)
        err = ((out - full).norm() / full.norm()).item()
        info[name] = (cache.bits_per_element(), f"rel. error vs fp32 attention on unquantized K/V {err:.3f}")
    ms = interleaved_ms(fns, repeats)
    # the reference path (seconds a call at this size): timed on its own, fewer repeats
    ref = fa.QuantizedKVCache(batch, seqlen, hk, d, dtype=torch.float16)
    ref.append(k.half(), v.half())
    name = "QuantizedKVCache 3-bit K/V, reference path"
    ms.update(interleaved_ms({name: lambda: fa.flash_attn_with_kvcache(q.half(), ref)}, ref_repeats))
    out = fa.flash_attn_with_kvcache(q.half(), ref).float()
    err = ((out - full).norm() / full.norm()).item()
    info[name] = (fa.bits_per_element(d, 3, 2), f"rel. error vs fp32 attention on unquantized K/V {err:.3f}")
    rows = []
    for name, (bits, note) in info.items():
        rows.append(dict(name=name, ms=round(ms[name], 3), bits_per_element=bits, note=note))
        print(f"  {name:50s} {ms[name]:9.2f} ms  {bits:6.3f} bits/el  {note}", flush=True)
    return rows


# ----------------------------------------------------------------------------------- quality


class Attn:
    """The attention function the quality run installs: ``mode`` picks what each layer does."""

    mode = "full"
    key_err: dict = {}

    @staticmethod
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """transformers' AttentionInterface signature: query [B, Hq, S, D], key/value [B, Hkv, S, D];
        returns (out [B, S, Hq, D], None). Causal, no padding."""
        B, hq, S, d = query.shape
        hk = key.shape[1]
        if scaling is None:
            scaling = d**-0.5
        mode = Attn.mode
        if mode in ("full", "fp16"):
            k, v = (key, value) if mode == "full" else (key.half().float(), value.half().float())
            out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if mode.startswith("cpu"):
            v_bits = int(mode[-1])
            cache = CpuQuantizedKVCache(B, S, hk, d, v_bits=v_bits)
            for group in (None, 32):  # key quantization error on the model's own keys
                kq, ks = (
                    cache.quantize_keys(k)
                    if group is None
                    else CpuQuantizedKVCache(1, 1, hk, d, key_group=32).quantize_keys(k)
                )
                g = d if group is None else 32
                kr = (kq.float().unflatten(-1, (-1, g)) * ks.float().unsqueeze(-1)).flatten(-2)
                err = ((cache.quantizer.unrotate(kr) - k.float()).norm() / k.float().norm()).item()
                Attn.key_err.setdefault(group or "token", []).append(err)
        else:  # "k3v3": the 3-bit QuantizedKVCache (reference path on the CPU)
            cache = fa.QuantizedKVCache(B, S, hk, d, dtype=torch.float16)
        out = fa.flash_attn_with_kvcache(q, cache, k=k, v=v, causal=True, softmax_scale=scaling)
        return out.float(), None


def quality(gguf_dir: Path, window: int, windows_per_text: int) -> dict:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    tok, model = load_smollm2(gguf_dir)
    AttentionInterface.register(ATTN_NAME, Attn.forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    model.set_attn_implementation(ATTN_NAME)
    windows = []
    for path in TEXTS:
        ids = tok(Path(path).read_text(), return_tensors="pt").input_ids[0]
        for w in range(windows_per_text):
            chunk = ids[w * window : (w + 1) * window]
            if chunk.numel() == window:
                windows.append((Path(path).name, chunk.unsqueeze(0)))
    modes = {
        "full": "full precision (fp32 K/V)",
        "fp16": "fp16 K/V (SDPA)",
        "cpu3": "CpuQuantizedKVCache int8 K + 3-bit V",
        "cpu4": "CpuQuantizedKVCache int8 K + 4-bit V",
        "k3v3": "QuantizedKVCache 3-bit K + 3-bit V (reference path)",
    }
    logits = {}
    result = dict(window=window, windows=[f"{n}[{i}]" for i, (n, _) in enumerate(windows)], configs={})
    with torch.no_grad():
        for mode, label in modes.items():
            Attn.mode = mode
            t0 = time.perf_counter()
            logits[mode] = [model(ids).logits[0, :-1].float() for _, ids in windows]
            secs = time.perf_counter() - t0
            ref = logits["full"]
            top1, kl, nll = [], [], []
            for (_, ids), lp, lr in zip(windows, logits[mode], ref):
                target = ids[0, 1:]
                top1.append((lp.argmax(-1) == lr.argmax(-1)).float().mean().item())
                kl.append(
                    F.kl_div(lp.log_softmax(-1), lr.log_softmax(-1), log_target=True, reduction="batchmean").item()
                )
                nll.append(F.cross_entropy(lp, target).item())
            row = dict(
                label=label,
                top1_agreement=round(statistics.mean(top1), 4),
                kl_mean=round(statistics.mean(kl), 5),
                ppl=round(math.exp(statistics.mean(nll)), 3),
                seconds=round(secs, 1),
            )
            result["configs"][mode] = row
            print(
                f"  {label:52s} top-1 {row['top1_agreement']:.4f}  KL {row['kl_mean']:.5f}  PPL {row['ppl']:.3f}"
                f"  ({secs:.0f} s)",
                flush=True,
            )
    result["key_rel_error"] = {
        ("per token" if g == "token" else "per 32 channels"): round(statistics.mean(v), 5)
        for g, v in Attn.key_err.items()
    }
    print(f"  int8 key relative error on SmolLM2 keys (rotated): {result['key_rel_error']}")
    return result


def markdown(res: dict) -> str:
    s = res["meta"]
    shape = res["shape"]
    lines = [
        "# CPU mode: CpuQuantizedKVCache (int8 keys, 3-bit values)",
        "",
        f"{s['cpu']} ({s['cpus']} CPUs; load average {s['load_avg']:.2f} at the start: the machine may be shared), "
        f"torch {s['torch']}, commit {s['commit']}, {s['date']}. {made_by(s)}",
        "",
        f"## Decode time (B={shape['batch']}, S={shape['seqlen']}, heads {shape['heads_q']}/{shape['heads_kv']}, "
        f"d={shape['head_dim']}, one query token, median of {res['repeats']} round-robin calls)",
        "",
    ]
    for n, rows in res["timing"].items():
        lines += [f"{n} thread(s):", "", "| path | ms / call | bits / element | note |", "|---|---:|---:|---|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['ms']:.2f} | {r['bits_per_element']:.3f} | {r['note']} |")
        lines.append("")
    q = res.get("quality")
    if q:
        lines += [
            f"## SmolLM2-135M-Instruct quality ({len(q['windows'])} windows of {q['window']} tokens: "
            f"{', '.join(q['windows'])}; every token attends through the cache)",
            "",
            "| K/V | top-1 agreement | KL(full ‖ config) | PPL |",
            "|---|---:|---:|---:|",
        ]
        for r in q["configs"].values():
            lines.append(f"| {r['label']} | {r['top1_agreement']:.4f} | {r['kl_mean']:.5f} | {r['ppl']:.3f} |")
        lines += [
            "",
            "int8 key relative error on the model's keys (after the Hadamard rotation): "
            + ", ".join(f"{k} {v:.5f}" for k, v in q["key_rel_error"].items()),
        ]
    else:
        lines.append(f"No quality table: {res.get('quality_missing', 'not asked for')}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads",
        default="0",
        help="comma-separated torch thread counts to time with (0: torch's default); the quality run uses the last",
    )
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--ref-repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows-per-text", type=int, default=2)
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="where the SmolLM2 GGUF is ($TQ_EVAL_DATA)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    threads = [int(t) or torch.get_num_threads() for t in args.threads.split(",")]
    meta = stamp(cpus=os.cpu_count(), threads=threads, load_avg=os.getloadavg()[0])
    print(
        f"{meta['cpu']} | {meta['cpus']} CPUs, load {meta['load_avg']:.2f} | torch {meta['torch']} | "
        f"commit {meta['commit']}"
    )
    shape = dict(batch=args.batch, seqlen=args.seqlen, heads_q=32, heads_kv=8, head_dim=128)
    res = dict(meta=meta, shape=shape, repeats=args.repeats, timing={})
    for n in threads:
        torch.set_num_threads(n)
        print(f"decode time, {n} thread(s)")
        res["timing"][str(n)] = timing(args.batch, args.seqlen, 32, 8, 128, args.repeats, args.ref_repeats)
    gguf_dir = model_dir(args.data)
    if args.no_quality:
        res["quality_missing"] = "--no-quality"
    elif not gguf_dir.exists():
        res["quality_missing"] = f"the SmolLM2 GGUF is not under {gguf_dir}"
    else:
        print("quality (SmolLM2)")
        res["quality"] = quality(gguf_dir, args.window, args.windows_per_text)
    write_results(args.out, "cpu", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
