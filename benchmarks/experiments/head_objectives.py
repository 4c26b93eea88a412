"""Which measurement should place the per-head widths? Run on the GPU, where a config takes seconds.

  python3 benchmarks/experiments/head_objectives.py measure [--out DIR] [--cal-text FILE]
  python3 benchmarks/experiments/head_objectives.py eval --sensitivity JSON [--out DIR] [--text FILE]

measure: ``head_sensitivity`` of SmolLM2 (one head's keys at 3 / 4 bits or its values at 3, the rest of
  its layer at 8, one layer at a time) on copy sequences: a 64-token span repeated at the end of
  random token ids ("syn", the product's calibration) or of a calibration text ("cal", default the
  GPL-3 licence: not the news text the eval runs on). Each forward reduced two ways: the mean KL from
  full precision over the whole sequence ("seq") and over the repeated span's predictions ("copy").
  1024-token sequences (several seeds: ids, or text offsets) and 4096. Written after each seed to
  ``head_objectives.json`` as ``{"seq|syn|1k|0": {"layer,head,K,V": KL}, ...}``.
eval: allocations in the 45-unit budget by objective ("copy4k@syn" = the mean over the seeds; "a+b":
  both, each normalised) and width set, split budgets (8-bit heads by one objective, the rest by
  another), hybrids with per-layer 4-bit keys (``calibrate_key_bits``' measure), a few over-budget
  probes; then ``eval_quality`` metrics of each on ``--text`` (default the news text).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import eval_quality as E  # noqa: E402
from flash_attn_tq.integrations.transformers import (  # noqa: E402
    DEFAULTS, allocate_head_bits, allocate_key_bits, copy_span_kl, head_kl, head_sensitivity, key_bit_sensitivity)

RUNS = [("syn", "1k", 1024, s) for s in range(6)] + [("syn", "4k", 4096, s) for s in range(2)] + \
       [("cal", "1k", 1024, s) for s in range(4)] + [("cal", "4k", 4096, s) for s in range(2)]
W8 = ((3, 3), (8, 3), (8, 8))
K4 = ((3, 3), (4, 3))
BUDGET = 45  # SmolLM2: 32 / head_dim bits an element over 90 kv heads (calibrate_head_bits)
OPTS = {k: v for k, v in DEFAULTS.items() if k not in ("late_k_bits", "k_bits")}


def model_and_tokenizer(device):
    model_dir, _ = E.ensure_assets(Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata")))
    tok, model = E.load_model(model_dir)
    return tok, model.to(device)


def measure(args) -> None:
    tok, model = model_and_tokenizer(args.device)
    cal = tok(Path(args.cal_text).read_text(errors="replace"), return_tensors="pt").input_ids[0]
    path = Path(args.out) / "head_objectives.json"
    data = json.loads(path.read_text()) if path.exists() else dict(options=OPTS, cal_text=Path(args.cal_text).name,
                                                                     kl={})
    both = lambda kl, span: (kl.mean().item(), copy_span_kl(kl, span))  # noqa: E731
    for src, length, tokens, seed in RUNS:
        key = f"{src}|{length}|{seed}"
        if f"seq|{key}" in data["kl"]:
            continue
        t0 = time.time()
        res = head_sensitivity(model, tokens=tokens, seed=seed, key_bits=(3, 4), value_bits=(3,), objective=both,
                               text_ids=cal if src == "cal" else None,
                               protected_layers=range(2, 30) if args.smoke else (), **OPTS)
        for j, name in enumerate(("seq", "copy")):
            data["kl"][f"{name}|{key}"] = {",".join(map(str, k)): v[j] for k, v in sorted(res.items())}
        path.write_text(json.dumps(data))
        print(f"{key}: {time.time() - t0:.0f} s", flush=True)


def load(path: Path) -> dict:
    """{"seq1k@syn" | "copy4k@cal" | ...: {(layer, head, K, V): KL averaged over the seeds}}."""
    raw = json.loads(path.read_text())["kl"]
    groups: dict = {}
    for name, d in raw.items():
        what, src, length, _ = name.split("|")
        groups.setdefault(f"{what}{length}@{src}", []).append(d)
    return {n: {tuple(int(x) for x in k.split(",")): sum(d[k] for d in ds) / len(ds) for k in ds[0]}
            for n, ds in groups.items()}


def normalised(kl: dict) -> dict:
    """`kl` scaled so the heads' summed 3-bit sensitivity (over the 8-bit floor) is 1: objectives add."""
    heads = {k[:2] for k in kl}
    total = sum(head_kl(kl, hd, 3, 3) - head_kl(kl, hd, 8, 8) for hd in heads)
    return {k: v / total for k, v in kl.items()}


def objective(sens: dict, name: str) -> dict:
    """"copy1k+copy4k@syn": the normalised sum of copy1k@syn and copy4k@syn."""
    terms, src = name.split("@")
    parts = [normalised(sens[f"{t}@{src}"]) for t in terms.split("+")]
    return {k: sum(p[k] for p in parts) for k in parts[0]}


def split(sens, heads, fine_obj, fine, rest_obj, budget=BUDGET):
    """8-bit widths (W8) for up to `fine` units by one objective, 4-bit keys for the rest by another."""
    chosen = {hd: w for hd, w in allocate_head_bits(objective(sens, fine_obj), heads, fine, W8).items() if w != (3, 3)}
    spent = sum(k + v - 6 for k, v in chosen.values())
    rest = [hd for hd in heads if hd not in chosen]
    chosen.update(allocate_head_bits(objective(sens, rest_obj), rest, budget - spent, K4))
    return chosen


def evaluate(args) -> int:
    sens = load(Path(args.sensitivity))
    heads = sorted({k[:2] for k in sens["seq1k@syn"]})
    allocs: dict[str, tuple[dict, dict | None]] = {}  # name -> (head widths, per-layer key bits or None)
    for src in ("syn", "cal"):
        for obj in ("seq1k", "copy4k", "copy1k+copy4k", "seq1k+copy4k", "seq1k+seq4k+copy1k+copy4k"):
            allocs[f"h[{obj}@{src} / 8+K4]"] = (allocate_head_bits(objective(sens, f"{obj}@{src}"), heads, BUDGET,
                                                                 W8 + ((4, 3),)), None)
        for fine in (15, 25):
            allocs[f"h[copy4k@{src}:{fine} / seq1k@{src}:K4]"] = (split(sens, heads, f"copy4k@{src}", fine,
                                                                      f"seq1k@{src}"), None)
            allocs[f"h[copy1k+copy4k@{src}:{fine} / seq1k+seq4k@{src}:K4]"] = (
                split(sens, heads, f"copy1k+copy4k@{src}", fine, f"seq1k+seq4k@{src}"), None)
    # hybrids: 8-bit heads by the copy objective, the rest of the budget as per-layer 4-bit keys
    tok, model = model_and_tokenizer(args.device)
    L = model.config.num_hidden_layers
    layer_kl = key_bit_sensitivity(model, bits=(3, 4), tokens=128 if args.smoke else 1024, **OPTS)
    del model
    for src in ("syn", "cal"):
        for fine in (10, 15, 20):
            fine_heads = {hd: w for hd, w in allocate_head_bits(objective(sens, f"copy1k+copy4k@{src}"), heads, fine,
                                                                W8).items() if w != (3, 3)}
            spent = sum(k + v - 6 for k, v in fine_heads.values())
            layers = allocate_key_bits(layer_kl, range(L), (BUDGET - spent) // 3)
            allocs[f"hyb[copy1k+copy4k@{src}:{fine} / layers K4]"] = (fine_heads, layers)
    # over the budget: the default's 4-bit-key layers plus the top copy heads at K8V8 (what would it take?)
    default_layers = allocate_key_bits(layer_kl, range(L), 15)
    gain = {hd: head_kl(sens["copy4k@syn"], hd, 3, 3) - head_kl(sens["copy4k@syn"], hd, 8, 8) for hd in heads}
    top = sorted(heads, key=lambda hd: -gain[hd])
    for n in (2, 3, 5):
        allocs[f"over: Kcal34 + top{n} copy4k@syn K8V8"] = ({hd: (8, 8) for hd in top[:n]}, default_layers)
    names = []
    for name, (chosen, layers) in allocs.items():
        if args.only and name not in args.only.split(","):
            continue
        hb = {f"{i},{h}": list(w) for (i, h), w in sorted(chosen.items()) if tuple(w) != (3, 3)}
        cfg = E._cfg(head_bits=hb, kv_heads=3, fp16_window=124, **E._CAL)
        if layers is not None:
            cfg["k_layer_bits"] = {i: b for i, b in layers.items() if b != 3}
        E.CONFIGS[name] = cfg
        E.LONG.append(name)
        names.append(name)
        print(name, "->", hb, cfg.get("k_layer_bits"), flush=True)
    base = ["full", E.DEFAULT, "KV8hcal25+K4+kc+sink4+w124"]
    argv = ["--device", args.device, "--configs", ",".join(base + names), "--seeds", str(args.seeds),
            "--long-seeds", str(args.long_seeds), "--out", args.out, "--tag", args.tag]
    argv += ["--windows", "1", "--no-long"] if args.smoke else []
    return E.main(argv + ([args.text] if args.text else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("measure", "eval"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cal-text", default="/usr/share/common-licenses/GPL-3", help="calibration text (measure)")
    p.add_argument("--text", default=None, help="eval text (default: the news text)")
    p.add_argument("--sensitivity", default=None, help="a head_objectives.json (eval)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--long-seeds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated allocation names to evaluate (default: all)")
    p.add_argument("--tag", default="quality_objectives")
    p.add_argument("--smoke", action="store_true", help="tiny sequences and windows: checks the pipeline (CPU)")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.smoke:
        RUNS[:] = [(s, n, t // 8, d) for s, n, t, d in RUNS if d < 2]  # (and only layers 0 and 1 measured)
    if args.mode == "measure":
        measure(args)
        return 0
    if args.smoke:
        args.seeds, args.long_seeds = 1, 0
    return evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
