"""One serving engine step over a paged 3-bit cache vs a paged fp16 cache (FA2), a layer at a time.

    python -m benchmarks.bench_serving [--seqs 64] [--pages 16,64,256] [--chunk 512] [--quick] [--out DIR]

The step a serving engine runs when requests of mixed lengths share a batch: ``--seqs`` sequences
whose lengths are drawn uniformly from ``--min-len``..``--max-len`` (seeded), a quarter of them
appending a ``--chunk``-token prefill chunk and the rest decoding one token, over a paged cache
whose blocks are in a random order (``flash_attn_tq.testing.serving_step``). 32 q / 8 kv heads,
head_dim 128, float16, one layer:

* ``tq3``, ``default``: ``flash_attn_varlen_func(q, k, v, cu, cu, ..., causal=True, kv_cache=cache)``
  over the 3-bit cache (plain, and the default layer: 16 sinks + 112 recent tokens in 16-bit, keys
  centered before RoPE): the new tokens quantized into their pages (the pack kernel resolves each
  token's slot from the block table and the sequence's length), then attended (the decoding
  sequences in one launch, the chunks in another), then the cache's lengths set back (a 2-µs copy,
  timed with the step); ``planned``: the same call with ``plan=`` (``flash_attn_tq.plan_varlen`` of
  the step's cu_seqlens, made once as an engine would for all its layers), which reads nothing back
  from the GPU;
* ``fa2``: the same tokens in an fp16 paged cache (256-token pages: FA2's paged path needs a
  multiple of 256): the new K/V written through vLLM-style ``slot_mapping`` (``index_copy_``), then
  upstream FlashAttention-2's ``flash_attn_varlen_func(..., block_table=)``, missing with the reason
  where flash_attn is not installed.

Step time: ``triton.testing.do_bench`` median. The split: kernel times from the PyTorch profiler
over 5 steps, by kernel name (pack: the quantize-on-write kernel or the slot copies; attention;
combine: the split-KV merge; other: indexing and copies around them). Attention alone over the
cache after the append: as the varlen call runs it (two launches) and as one launch with every
sequence's queries left-padded to the longest (``attend_padded_us``). Tokens/s for a 32-layer
model's attention side (weights not counted): the step's tokens (every query) / (32 x the step time); decode
tokens/s counts the decoding sequences only. ``max |out - fa2|``: the 3-bit step's output against
FA2's over the same tokens (the quantization error, not a pass/fail; ``tests/test_serving_step.py``
holds the kernels to float32 over the dequantized cache). Writes ``serving.json`` / ``serving.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

import flash_attn_tq as fa
from flash_attn_tq import dispatch
from flash_attn_tq.testing import (
    DEFAULT_OPTS,
    bench,
    bench_graph,
    describe,
    fmt,
    made_by,
    profiled_times,
    rerendered,
    rope_freqs,
    serving_step,
    stamp,
    upstream_fa2,
    write_results,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HQ, HK, D, LAYERS = 32, 8, 128, 32
FA2_PAGE = 256
CATEGORIES = ("pack", "attention", "combine", "other")


def category(kernel: str) -> str:
    """A kernel's part of the step, from its name: the function's own name (before its template
    arguments, which name the packed format of every kernel); an fp16 slot copy is the pack."""
    if "index_copy" in kernel:
        return "pack"
    name = kernel.split("<")[0].split("(")[0].lower()
    if "combine" in name:
        return "combine"
    if "pack" in name:
        return "pack"
    if any(w in name for w in ("decode", "prefill", "flash_fwd", "rope_table", "side_rows")):
        return "attention"
    return "other"


def resplit(row: dict) -> None:
    """The row's split again from its recorded kernels (the step's total kept: what the row's list
    leaves out counts as other)."""
    total = sum(row[c] for c in CATEGORIES)
    for c in CATEGORIES[:3]:
        row[c] = sum(t for k, t, *_ in row["kernels"] if category(k) == c)
    row["other"] = total - sum(row[c] for c in CATEGORIES[:3])
    row["kernels"] = [(k, t, category(k)) for k, t, *_ in row["kernels"]]


def split(fn, steps: int = 5) -> dict:
    """µs a step by kernel category (CATEGORIES; the rest: other), from the profiler over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = dict.fromkeys(CATEGORIES, 0.0)
    kernels = []
    for key, total in profiled_times(prof):
        cat = category(key)
        out[cat] += total / steps
        kernels.append((key[:100], round(total / steps, 1), cat))
    out["kernels"] = sorted(kernels, key=lambda k: -k[1])
    return out


def graphed(row: dict, fn) -> None:
    """The step replayed as a CUDA graph (its kernels and their launch gaps, no host work) into ``row``,
    or why it could not be captured."""
    try:
        row["graph_step_us"] = bench_graph(fn)
    except Exception as e:
        row["graph_step_missing"] = f"{type(e).__name__}: {e}"[:200]


def run(args, page: int, lengths, new, tq_opts: dict, fa2_ref) -> dict:
    step = serving_step(lengths, new, page, HQ, HK, D, seed=args.seed, **tq_opts)
    plan = step.cache.plan(dispatch.Query.of(step.q[None, :1]))
    if not plan.fused:  # (the reference path: a float32 copy of the whole cache, not the product)
        return {"missing": plan.path}
    cu, lens0 = step.cu_seqlens, step.cache.seqlens.clone()

    layout = fa.plan_varlen(cu.cpu(), cu.cpu(), max(new), cu.device)  # (once a step, for every layer)

    def tq(plan=None):  # (plan: the layout above, as an engine's layers take it)
        out, _ = fa.flash_attn_varlen_func(
            step.q, step.k, step.v, cu, cu, max(new), None, causal=True, kv_cache=step.cache, plan=plan
        )
        step.cache.seqlens.copy_(lens0)
        return out

    def tq_planned():
        return tq(layout)

    out = tq()
    row = {"path": fa.last_path(), "step_us": bench(tq)}
    row["planned_equal"] = bool(torch.equal(tq_planned(), out))
    row["planned_step_us"] = bench(tq_planned)
    graphed(row, tq_planned)
    layout.check()
    row.update(split(tq))
    if fa2_ref is not None:
        row["max_abs_vs_fa2"] = (out.float() - fa2_ref.float()).abs().max().item()
    # attention alone over the cache after the step's append: as the varlen call runs it (decoding
    # sequences in one launch, chunks in another) and as one launch with every sequence's queries
    # left-padded to the longest
    step.cache.seqlens.copy_(lens0 + torch.tensor(new, dtype=torch.int32, device="cuda"))
    width = max(new)
    q_pad = step.q.new_zeros(len(new), width, HQ, D)
    for b, n in enumerate(new):
        q_pad[b, width - n :] = step.q[cu[b] : cu[b + 1]]
    row["attend_us"] = bench(
        lambda: fa.flash_attn_varlen_func(step.q, None, None, cu, None, width, None, causal=True, kv_cache=step.cache)
    )
    row["attend_padded_us"] = bench(lambda: fa.flash_attn_with_kvcache(q_pad, step.cache, causal=True))
    return row


def run_fa2(lengths, new, seed: int) -> tuple[dict, torch.Tensor | None]:
    varlen = upstream_fa2("flash_attn_varlen_func")
    if varlen is None:
        return {"missing": "upstream flash_attn is not importable"}, None
    step = serving_step(lengths, new, None, HQ, HK, D, seed=seed, kv16_page=FA2_PAGE)
    k16, v16, table, slots = step.kv16
    cu_q = step.cu_seqlens
    total = [a + b for a, b in zip(lengths, new)]
    cu_k = torch.tensor([0] + total, device="cuda").cumsum(0).to(torch.int32)

    def fa2():
        k16.view(-1, HK, D).index_copy_(0, slots, step.k)
        v16.view(-1, HK, D).index_copy_(0, slots, step.v)
        return varlen(step.q, k16, v16, cu_q, cu_k, max(new), max(total), causal=True, block_table=table)

    out = fa2()
    row = {"step_us": bench(fa2)}
    graphed(row, fa2)
    row.update(split(fa2))
    return row, out


def bench_serving(args) -> dict:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.seqs)]
    chunked = set(rng.sample(range(args.seqs), args.seqs // 4))
    new = [args.chunk if b in chunked else 1 for b in range(args.seqs)]
    tokens, decoding = sum(new), args.seqs - len(chunked)
    res = {
        "meta": stamp(),
        "setup": dict(
            seqs=args.seqs, chunk=args.chunk, lengths=lengths, new=new, heads=[HQ, HK], head_dim=D, layers=LAYERS
        ),
        "rows": [],
    }
    fa2_row, fa2_out = run_fa2(lengths, new, args.seed)
    fa2_row.update(variant="fa2", page=FA2_PAGE)
    rows = [fa2_row]
    configs = {"tq3": {}, "default": dict(DEFAULT_OPTS, rope_inv_freq=rope_freqs(D))}
    for page in args.pages:
        for name, opts in configs.items():
            try:
                row = run(args, page, lengths, new, opts, fa2_out)
            except torch.cuda.OutOfMemoryError as e:
                row = {"missing": f"out of GPU memory: {e}"[:200]}
            row.update(variant=name, page=page)
            rows.append(row)
            torch.cuda.empty_cache()
    for row in rows:
        if row.get("step_us"):
            row["tok_s"] = tokens / (LAYERS * row["step_us"] * 1e-6)
            row["decode_tok_s"] = decoding / (LAYERS * row["step_us"] * 1e-6)
            if fa2_row.get("step_us"):
                row["vs_fa2"] = fa2_row["step_us"] / row["step_us"]
                if row.get("planned_step_us"):
                    row["planned_vs_fa2"] = fa2_row["step_us"] / row["planned_step_us"]
                if row.get("graph_step_us") and fa2_row.get("graph_step_us"):
                    row["graph_vs_fa2"] = fa2_row["graph_step_us"] / row["graph_step_us"]
        print(
            f"{row['variant']:8s} page {row['page']:4d}: {fmt(row.get('step_us'))} µs "
            f"({fmt(row.get('vs_fa2'), '.2f')}x fa2), planned {fmt(row.get('planned_step_us'))} µs "
            f"({fmt(row.get('planned_vs_fa2'), '.2f')}x) {row.get('missing', '')}",
            flush=True,
        )
    res["rows"] = rows
    return res


def markdown(res) -> str:
    m, s = res["meta"], res["setup"]
    lens = s["lengths"]
    lines = [
        f"# A serving step over a paged 3-bit cache vs FP16 FA2 ({describe(m)})",
        "",
        made_by(m),
        "",
        f"{s['seqs']} sequences of {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}); "
        f"{sum(1 for n in s['new'] if n > 1)} append a {s['chunk']}-token prefill chunk, the rest decode one "
        f"token; 32 q / 8 kv heads, head_dim 128, fp16; one layer's step (append + attention) in µs "
        "(do_bench median), shuffled block tables. tq3: the plain 3-bit cache; default: the default layer "
        "(16 sinks + 112 recent tokens in 16-bit, keys centered before RoPE). Split: profiler kernel µs a "
        "step, by kernel: pack (quantize-on-write; FA2: the slot copies), attention (decode and prefill "
        "kernels, the RoPE table, the 16-bit side's rows), combine (the split-KV merge), other (gathers and "
        f"scatters around them). tok/s: every query token of the step over {s['layers']} layers' attention "
        "(weights not counted); decode tok/s: the decoding sequences' tokens only. planned: the same call "
        "with plan= (flash_attn_tq.plan_varlen, made once a step for every layer: nothing read back from "
        "the GPU), its output equal to the unplanned call's ('='); graph: the planned step captured and "
        "replayed as a CUDA graph (the kernels and their launch gaps, as an engine's graphed step; FA2's step "
        "the same way); tok/s count the unplanned step.",
        "",
        "| variant | page | step µs | vs FA2 | planned step µs | planned vs FA2 | graph µs | graph vs FA2 "
        "| pack | attention | combine | other | tok/s (32 layers) | decode tok/s | max abs vs FA2 "
        "| attention µs: two launches / one padded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['variant']} | {r['page']} | {fmt(r.get('step_us'))} | {fmt(r.get('vs_fa2'), '.2f')} "
            f"| {fmt(r.get('planned_step_us'))}{' =' if r.get('planned_equal') else ''} "
            f"| {fmt(r.get('planned_vs_fa2'), '.2f')} | {fmt(r.get('graph_step_us'))} "
            f"| {fmt(r.get('graph_vs_fa2'), '.2f')} "
            f"| {fmt(r.get('pack'))} | {fmt(r.get('attention'))} | {fmt(r.get('combine'))} | {fmt(r.get('other'))} "
            f"| {fmt(r.get('tok_s'), ',.0f')} | {fmt(r.get('decode_tok_s'), ',.0f')} "
            f"| {fmt(r.get('max_abs_vs_fa2'), '.4f')} | {fmt(r.get('attend_us'))} / {fmt(r.get('attend_padded_us'))} |"
        )
    missing = [f"- {r['variant']} page {r['page']}: {r['missing']}" for r in res["rows"] if r.get("missing")]
    missing += [
        f"- {r['variant']} page {r['page']}, graph: {r['graph_step_missing']}"
        for r in res["rows"]
        if r.get("graph_step_missing")
    ]
    return "\n".join(lines + ([""] + missing if missing else [])) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--pages", default="16,64,256", help="page sizes of the 3-bit cache (FA2's: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 sequences of 256-4096 tokens, 64-token chunks")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--name", default="serving")
    p.add_argument("--render", metavar="JSON", help="write the tables again from a results file (no GPU)")
    args = p.parse_args(argv)
    if args.render:
        res = json.load(open(args.render))
        for row in res["rows"]:
            if row.get("kernels"):
                resplit(row)
        res["meta"] = rerendered(res["meta"])
        write_results(args.out, args.name, res, markdown(res))
        return 0
    args.pages = [int(x) for x in args.pages.split(",") if x]
    if args.quick:
        args.seqs, args.min_len, args.max_len, args.chunk = 16, 256, 4096, 64
    if not torch.cuda.is_available():
        p.error("a CUDA GPU is needed (the step runs the fused kernels)")
    res = bench_serving(args)
    md = markdown(res)
    write_results(args.out, args.name, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
