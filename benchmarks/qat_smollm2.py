"""Quantization-aware fine-tuning of SmolLM2-135M-Instruct for the 3-bit KV cache, on the CPU.

    python benchmarks/qat_smollm2.py [--steps 100] [--seq 128] [--batch 2] [--lr 1e-5] [--train qkv]

Fine-tunes the model (float32, from its GGUF: flash_attn_tq.testing.assets) with its keys
and values fake-quantized to 3 bits by :mod:`flash_attn_tq.qat` (the cache's codec, straight-through
gradient), next-token loss on random windows of the training text (default: the GPL-3 text), only
the attention projections trained (``--train``: ``qkv`` = q_proj/k_proj/v_proj, ``qkvo`` adds
o_proj, ``all``). Before and after, on held-out texts (not used for training): perplexity

* ``full``: full-precision attention (SDPA; the control: how much the fine-tuning itself moved the
  model on these texts);
* ``cache3``: the real 3-bit cache, ``TQCache(model.config, fp16_window=0, sink_tokens=0,
  key_center=False, late_k_bits=None, prefill="quantized")``: every key and value as 3-bit codes +
  a float16 scale, no 16-bit window, no sinks, and every token (the prompt too) attends over the
  quantized cache, through the reference path (``attn_implementation="tq_kvcache"``): what a
  token-by-token decode with that cache computes; the configuration the fine-tuning simulates;
* ``fake3``: the fake-quant forward itself (a cross-check: equal to ``cache3`` up to rounding);
* ``cache_default_nowindow`` (off with ``--no-default-cache``): TQCache's defaults without the window and
  sinks (``fp16_window=0, sink_tokens=0``: key centering before RoPE and 4-bit keys in the last
  layers kept), which the fine-tuning did not simulate.

Writes qat.json / qat.md under --out (default benchmarks/results), stamped with the command.
``--with-control`` also runs the control in the same process: the same fine-tuning (same batches,
from the same weights) without fake quantization, its "after" column beside the others.
``--attn sdpa`` runs the control alone.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache
from flash_attn_tq.qat import register_fake_quant_attention
from flash_attn_tq.testing import made_by, stamp, write_json, write_text
from flash_attn_tq.testing.assets import default_data_dir, ensure_model, load_smollm2

RESULTS = Path(__file__).resolve().parent / "results"
LICENSES = Path("/usr/share/common-licenses")
TRAINABLE = {"qkv": ("q_proj", "k_proj", "v_proj"), "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj")}


def tokens(tok, path: Path) -> torch.Tensor:
    return torch.tensor(tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"], dtype=torch.long)


def windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    n = min(count, len(ids) // length)
    if n == 0:
        raise ValueError(f"text too short for one window of {length} tokens ({len(ids)} tokens)")
    return ids[: n * length].view(n, length)


@torch.no_grad()
def perplexity(model, wins: torch.Tensor, mode: str, fq_name: str) -> float:
    """exp(mean next-token NLL) over the windows ``[n, L]``, each window on its own (one forward)."""
    nll, count = 0.0, 0
    for w in wins:
        ids = w[None]
        if mode == "full":
            model.set_attn_implementation("sdpa")
            logits = model(ids, use_cache=False).logits
        elif mode == "fake3":
            model.set_attn_implementation(fq_name)
            logits = model(ids, use_cache=False).logits
        else:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            opts = dict(fp16_window=0, sink_tokens=0, prefill="quantized")
            if mode == "cache3":
                opts.update(key_center=False, late_k_bits=None)
            logits = model(ids, past_key_values=TQCache(model.config, **opts), use_cache=True).logits
        nll += F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def evaluate(model, held_out: dict, modes, fq_name: str) -> dict:
    model.eval()
    return {name: {m: perplexity(model, wins, m, fq_name) for m in modes} for name, wins in held_out.items()}


def train(model, ids: torch.Tensor, args, fq_name: str, attn: str) -> list[float]:
    """``args.steps`` AdamW steps on random windows of ``ids`` (the batches drawn from ``args.seed``),
    attention ``attn``: "fake3" (3-bit fake-quantized K/V) or "sdpa" (the control); the losses."""
    model.set_attn_implementation(fq_name if attn == "fake3" else "sdpa")
    for p in model.parameters():
        p.requires_grad_(args.train == "all")
    if args.train != "all":
        for layer in model.model.layers:
            for name in TRAINABLE[args.train]:
                getattr(layer.self_attn, name).weight.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    model.train()
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(ids) - args.seq - 1, (args.batch,), generator=g)
        batch = torch.stack([ids[s : s + args.seq] for s in starts.tolist()])
        loss = model(batch, labels=batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    return losses


def markdown(res: dict) -> str:
    a = res["args"]
    ctl = res.get("control")
    m = res["meta"]
    lines = [
        "# Quantization-aware fine-tuning: SmolLM2-135M-Instruct, 3-bit K/V",
        "",
        f"{m['cpu']}, torch {m['torch']}, transformers {m['transformers']}, commit {m['commit']}. {made_by(m)}",
        "",
        f"Fine-tuned {a['steps']} steps (batch {a['batch']} x {a['seq']} tokens of `{Path(a['train_text']).name}`, "
        f"AdamW lr {a['lr']}, trained: {a['train']}, {res['trainable_params'] / 1e6:.2f}M parameters) with "
        f"keys and values fake-quantized to 3 bits (`flash_attn_tq.qat`, the cache's codec, clipped "
        f"straight-through gradient); training took {res['train_seconds']:.0f} s, loss "
        f"{res['loss_first10']:.3f} (first 10 steps) -> {res['loss_last10']:.3f} (last 10).",
        "",
        f"Perplexity on held-out texts ({a['eval_windows']} windows of {a['eval_len']} tokens at most, each on "
        "its own). `cache3`: the real 3-bit cache, `TQCache(config, fp16_window=0, sink_tokens=0, "
        'key_center=False, late_k_bits=None, prefill="quantized")` (every token attends over 3-bit codes, '
        "reference path); `fake3`: the fake-quant forward (cross-check); `full`: full-precision attention; "
        "`cache_default_nowindow`: TQCache's defaults without window and sinks (key centering before RoPE, 4-bit "
        "keys in the last layers; not what the fine-tuning simulated). `fake3` and `cache3` compute the same "
        "codec (equal logits on the first tokens, tests/test_qat.py); float-rounding differences flip a code at "
        "a rounding boundary now and then, which 30 layers of 3-bit K/V amplify, so their gap is the noise "
        "floor of these short measurements."
        + (
            f" Control (`--with-control`, the same run): the same fine-tuning (same batches) without fake "
            f"quantization ({ctl['train_seconds']:.0f} s, loss {ctl['loss_first10']:.3f} -> {ctl['loss_last10']:.3f}), "
            "to separate adapting to the license-text domain from adapting to the 3-bit K/V."
            if ctl
            else ""
        ),
        "",
        "| text | mode | before | after | change |" + (" after, control | control change |" if ctl else ""),
        "|---|---|---:|---:|---:|" + ("---:|---:|" if ctl else ""),
    ]
    for text, before in res["before"].items():
        after = res["after"][text]
        for mode in before:
            b, c = before[mode], after[mode]
            row = f"| {text} | {mode} | {b:.3f} | {c:.3f} | {100 * (c / b - 1):+.2f}% |"
            if ctl:
                k = ctl["after"][text][mode]
                row += f" {k:.3f} | {100 * (k / b - 1):+.2f}% |"
            lines.append(row)
        for mode in ("cache3", "fake3") + (("cache_default_nowindow",) if "cache_default_nowindow" in before else ()):
            gap = lambda r: f"{100 * (r[mode] / r['full'] - 1):+.2f}%"  # noqa: E731
            row = f"| {text} | {mode} vs full | {gap(before)} | {gap(after)} | |"
            if ctl:
                row += f" {gap(ctl['after'][text])} | |"
            lines.append(row)
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--train", choices=("qkv", "qkvo", "all"), default="qkv")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attn",
        choices=("fake3", "sdpa"),
        default="fake3",
        help="sdpa: the control, the same fine-tuning without fake quantization",
    )
    ap.add_argument("--skip-before", action="store_true", help="no evaluation before training")
    ap.add_argument("--train-text", default=str(LICENSES / "GPL-3"))
    ap.add_argument("--eval-texts", default=f"{LICENSES / 'Apache-2.0'},{LICENSES / 'MPL-2.0'}")
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=3)
    ap.add_argument(
        "--no-default-cache", dest="default_cache", action="store_false", help="skip the defaults-without-window row"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--with-control",
        action="store_true",
        help="also the control in this run: the same fine-tuning from the same weights without fake quantization",
    )
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="SmolLM2 assets ($TQ_EVAL_DATA)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    import transformers

    meta = stamp(threads=torch.get_num_threads(), transformers=transformers.__version__)
    directory = ensure_model(args.data)
    tok, model = load_smollm2(directory)
    fq_name = register_fake_quant_attention(k_bits=3, v_bits=3, sink_tokens=0)
    train_ids = tokens(tok, Path(args.train_text))
    held_out = {}
    for p in args.eval_texts.split(","):
        ids = tokens(tok, Path(p))
        held_out[Path(p).name] = windows(ids, min(args.eval_len, len(ids)), args.eval_windows)
    modes = ["full", "cache3", "fake3"] + (["cache_default_nowindow"] if args.default_cache else [])

    t0 = time.time()
    before = {} if args.skip_before else evaluate(model, held_out, modes, fq_name)
    print("before", json.dumps(before), f"({time.time() - t0:.0f} s)", flush=True)
    t0 = time.time()
    losses = train(model, train_ids, args, fq_name, args.attn)
    train_seconds = time.time() - t0
    after = evaluate(model, held_out, modes, fq_name)
    print("after ", json.dumps(after), flush=True)

    res = dict(
        meta=meta,
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        eval_cache="TQCache(config, fp16_window=0, sink_tokens=0, key_center=False, late_k_bits=None, "
        "prefill='quantized')",
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        train_tokens=len(train_ids),
        held_out_tokens={k: int(v.numel()) for k, v in held_out.items()},
        train_seconds=train_seconds,
        losses=losses,
        loss_first10=sum(losses[:10]) / len(losses[:10]),
        loss_last10=sum(losses[-10:]) / len(losses[-10:]),
        before=before,
        after=after,
    )
    if args.with_control and args.attn != "sdpa":  # the same steps from the same weights, plain attention
        model = None
        _, control = load_smollm2(directory)
        t0 = time.time()
        c_losses = train(control, train_ids, args, fq_name, "sdpa")
        res["control"] = dict(
            train_seconds=time.time() - t0,
            losses=c_losses,
            loss_first10=sum(c_losses[:10]) / len(c_losses[:10]),
            loss_last10=sum(c_losses[-10:]) / len(c_losses[-10:]),
            after=evaluate(control, held_out, modes, fq_name),
        )
        print("control after", json.dumps(res["control"]["after"]), flush=True)
    write_json(args.out / "qat.json", res)
    if before:
        write_text(args.out / "qat.md", markdown(res))
        print(markdown(res))


if __name__ == "__main__":
    main()
