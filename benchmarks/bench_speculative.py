"""Speculative decoding over TQCache, against greedy decoding and against speculative fp16.

    python -m benchmarks.bench_speculative [--prompts 1024,4096] [--new-tokens 256] [--drafts 8]
        [--repeats 3] [--quick] [--data DIR] [--out DIR]

SmolLM2-135M-Instruct (real weights, float16 on a GPU; ``flash_attn_tq.testing.assets`` finds them,
``--data``) reads a passage of the news text and is asked to repeat it: a task where prompt-lookup
drafts (the continuation of the last n-gram's latest earlier occurrence) are often right, as in
editing, retrieval-augmented answers and code. Each cache (``dynamic``: transformers' DynamicCache in
the model's dtype under SDPA; ``tq``: the default TQCache) decodes the same prompt greedily, one token a step, and
speculatively: up to ``--drafts`` drafts verified a step in one multi-token forward, the rejected
ones cropped (``flash_attn_tq.testing.speculative``, the loop a serving engine runs).

Tokens/s: the generated tokens over the decode's wall time (the prompt's forward, timed alone, taken
off; the loop reads each step's tokens back, as an engine's acceptance does), the median of
``--repeats`` runs after one warm-up. Acceptance: accepted over drafted tokens. ``exact``: the
speculative run's tokens equal the greedy run's over the same cache (each query of a verify call
attends as a one-token decode would). ``--quick``: a tiny random Llama on the CPU, a repeating
random prompt. Writes ``speculative.json`` / ``speculative.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from flash_attn_tq.integrations.transformers import TQCache, register
from flash_attn_tq.testing import describe, fmt, made_by, markdown_table, speculative, stamp, write_results
from flash_attn_tq.testing.assets import (
    TINY_LLAMA,
    default_data_dir,
    ensure_assets,
    load_smollm2,
    random_llama,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CACHES = ("dynamic", "tq")
ASK = "\n\nRepeat the text above word for word.\n\n"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_cache(kind: str, model):
    """An empty cache of ``kind`` for ``model`` (its attention implementation set to match)."""
    from transformers import DynamicCache

    if kind == "tq":
        model.set_attn_implementation("tq_kvcache")
        return TQCache(model.config)
    model.set_attn_implementation("sdpa")
    return DynamicCache(config=model.config)


def timed(
    model, ids: torch.Tensor, kind: str, new_tokens: int, drafts: int
) -> tuple[speculative.SpeculativeRun, float]:
    """One run over a fresh cache: (the run, the decode's seconds: the whole loop less the prompt's
    forward, timed alone over another fresh cache)."""
    device = ids.device
    with torch.no_grad():
        cache = make_cache(kind, model)
        _sync(device)
        t0 = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        _sync(device)
        prompt_s = time.perf_counter() - t0
        cache = make_cache(kind, model)
        t0 = time.perf_counter()
        run = speculative.generate(model, ids, cache, new_tokens, draft_tokens=drafts)
        _sync(device)
    return run, max(time.perf_counter() - t0 - prompt_s, 1e-9)


def prompt_ids(tok, text: str, tokens: int, device) -> torch.Tensor:
    """A passage of about ``tokens`` tokens of ``text`` and the request to repeat it."""
    ask = tok(ASK, add_special_tokens=False).input_ids
    passage = tok(text, add_special_tokens=False).input_ids[: max(1, tokens - len(ask))]
    return torch.tensor([passage + ask], device=device)


def measure(model, ids: torch.Tensor, args) -> list[dict]:
    rows = []
    for kind in CACHES:
        row = dict(prompt=ids.shape[1], cache=kind, new_tokens=args.new_tokens, drafts=args.drafts)
        runs = {}
        for mode, drafts in (("greedy", 0), ("speculative", args.drafts)):
            timed(model, ids, kind, min(args.new_tokens, 16), drafts)  # warm-up
            results = [timed(model, ids, kind, args.new_tokens, drafts) for _ in range(args.repeats)]
            run = results[0][0]
            runs[mode] = run
            row[f"{mode}_tok_s"] = len(run.tokens) / statistics.median(s for _, s in results)
            row[f"{mode}_steps"] = run.steps
        spec = runs["speculative"]
        row.update(
            acceptance=spec.acceptance,
            accepted=spec.accepted,
            drafted=spec.drafted,
            rejected_steps=spec.rejected_steps,
            speedup=row["speculative_tok_s"] / row["greedy_tok_s"],
            exact=spec.tokens == runs["greedy"].tokens,
            tokens=spec.tokens,
        )
        print(
            f"[P={row['prompt']}] {kind}: greedy {row['greedy_tok_s']:.1f} tok/s, speculative "
            f"{row['speculative_tok_s']:.1f} ({row['speedup']:.2f}x), acceptance {row['acceptance']:.2f}, "
            f"exact {row['exact']}",
            flush=True,
        )
        rows.append(row)
    for row in rows:  # the speculative rows against the 16-bit cache's
        full = next(r for r in rows if r["prompt"] == row["prompt"] and r["cache"] == "dynamic")
        row["vs_dynamic_speculative"] = row["speculative_tok_s"] / full["speculative_tok_s"]
    return rows


def markdown(res: dict) -> str:
    m, s = res["meta"], res["setup"]
    lines = [
        f"# Speculative decoding over TQCache ({describe(m)})",
        "",
        made_by(m),
        "",
        f"{s['model']}; the prompt: {s['prompt']}; {s['new_tokens']} "
        f"new tokens; up to {s['drafts']} prompt-lookup drafts a step, verified in one forward and the "
        "rejected ones cropped. Tokens/s over the decode (the prompt's forward taken off), the median of "
        f"{s['repeats']} runs. exact: the speculative tokens equal greedy decoding's over the same cache. "
        "dynamic: transformers' DynamicCache (the model's dtype) under SDPA; tq: the default TQCache.",
        "",
    ]
    header = ["prompt", "cache", "greedy tok/s", "speculative tok/s", "speedup", "vs dynamic speculative"]
    header += ["acceptance", "steps (greedy / speculative)", "exact"]
    body = [
        [
            r["prompt"],
            r["cache"],
            fmt(r["greedy_tok_s"]),
            fmt(r["speculative_tok_s"]),
            f"{r['speedup']:.2f}x",
            f"{r['vs_dynamic_speculative']:.2f}x",
            f"{r['acceptance']:.2f}",
            f"{r['greedy_steps']} / {r['speculative_steps']}",
            "yes" if r["exact"] else "no",
        ]
        for r in res["rows"]
    ]
    return "\n".join(lines + markdown_table(header, body)) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--drafts", type=int, default=8, help="drafts a step (TQCache's verify_tokens is 16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a tiny random Llama on the CPU")
    p.add_argument("--data", default=str(default_data_dir()), help="SmolLM2 assets (flash_attn_tq.testing.assets)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    register()
    prompts = [int(x) for x in args.prompts.split(",") if x]
    if args.quick:
        device = torch.device("cpu")
        model = random_llama(dict(TINY_LLAMA, initializer_range=0.2), dtype=torch.float32)
        desc, prompt = "a tiny random Llama (float32, CPU)", "a random 20-token span three times"
        span = torch.randint(0, TINY_LLAMA["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
        inputs = [torch.cat([span] * 3, 1)]
        args.new_tokens, args.repeats = min(args.new_tokens, 40), 1
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model_dir, text_file = ensure_assets(Path(args.data))
        tok, model = load_smollm2(model_dir)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        model = model.to(device=device, dtype=dtype)
        desc = f"SmolLM2-135M-Instruct ({str(dtype).replace('torch.', '')})"
        prompt = f"a passage of {text_file.name} and the request to repeat it"
        text = open(text_file, encoding="utf-8").read()
        inputs = [prompt_ids(tok, text, n, device) for n in prompts]
    setup = dict(model=desc, prompt=prompt, new_tokens=args.new_tokens, drafts=args.drafts, repeats=args.repeats)
    import transformers

    res = {"meta": stamp(transformers=transformers.__version__), "setup": setup, "rows": []}
    for ids in inputs:
        res["rows"] += measure(model, ids, args)
        write_results(args.out, "speculative", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
