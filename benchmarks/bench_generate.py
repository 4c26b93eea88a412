"""End-to-end decode speed of a transformers model over TQCache vs transformers' own KV caches.

    python benchmarks/bench_generate.py [--models smollm2,llama8b] [--prompts 2048,8192] [--new-tokens 64]
        [--variants ...] [--no-compile] [--no-profile] [--quick] [--data DIR] [--out DIR]
    python benchmarks/bench_generate.py --fill [--fill-tokens 32768] [--reserve-gib 4]

Side by side in one run, the same model, prompt and number of decoded tokens through

* ``dynamic``: transformers' ``DynamicCache``, SDPA attention;
* ``static``: transformers' ``StaticCache`` (capacity given up front), SDPA, eager;
* ``static_compiled``: the same with the decode step ``torch.compile(mode="reduce-overhead")``d
  (CUDA graphs: transformers' fastest fp16 decode; CUDA only, ``--no-compile`` skips it);
* ``kv16``, ``kv16_compiled``: the fast fp16 anchor: the same static 16-bit buffers read by this
  project's fp16 decode kernel (``flash_attn_tq.testing.fp16_decode``: only the filled tokens, the
  length on the GPU), eager and compiled as ``static_compiled``;
* ``fa2_compiled``: the same with upstream FlashAttention-2's ``flash_attn_with_kvcache`` as the
  kernel, where flash_attn is installed (else the row records why not);
* ``tq``: ``TQCache(model.config)`` with ``attn_implementation="tq_kvcache"`` (the fused kernels on a GPU);
* ``tq_calibrated``: ``TQCache.calibrated(model)`` (measured once a model; its time is reported as
  ``calibration_s``, not in the decode speed; the cache of each prompt reuses its bit widths);
* ``tq_graph``: ``TQCache(model.config)`` decoded by
  :class:`flash_attn_tq.integrations.graphs.GraphDecoder`, each decode step replayed as one CUDA graph
  (CUDA only), its greedy tokens checked against the eager ``tq`` run's;
* ``tq_compiled``: ``TQCache(model.config, max_cache_len=...)`` with the decode step compiled as
  ``static_compiled``'s (one graph: the step reads no host-side counter), its greedy tokens checked
  against the eager ``tq`` run's;
* ``static_generate``, ``tq_generate``: what a user's ``model.generate(ids, past_key_values=cache)``
  gets, host loop included: transformers compiles the decode steps itself for both caches
  (``is_compileable``). Tokens/s = B x (N1 - N0) / (wall(N1) - wall(N0)), each wall time the median
  of three greedy ``generate`` calls (interleaved) of N0 = ``--warmup`` and N1 = N0 +
  ``--new-tokens`` new tokens on fresh caches (the prefill and the CUDA-graph recording cancel),
  after an untimed call that compiles.

Models: ``smollm2``: SmolLM2-135M-Instruct from its GGUF (float16 on the GPU; assets as
``flash_attn_tq.testing.assets`` finds them, ``--data``), B=1, the ``--prompts`` lengths; ``llama8b``:
a Llama-3-8B-shaped model with random weights (8 decoder layers, hidden 4096, MLP 14336, 32 q / 8 kv
heads, head_dim 128, RoPE theta 500000, vocab 128256), bfloat16, B=8, one 32K-token prompt.
Prompts are random token ids (speed does not depend on the text).

Timing: the prompt is prefilled by one forward (timed on its own, ``*_prefill_ms``), then tokens are
decoded greedily one forward a step (the same count for every cache), ``--warmup`` steps untimed, then
``--new-tokens`` steps each timed with CUDA events; decode tokens/s = B / median step time. After
them, ``--profile-steps`` more steps under ``torch.profiler`` give ``*_attn_share``: the CUDA time of
the attention kernels (names containing decode/flash/attention/sdpa/fmha/combine) over all kernel time,
and (eager variants) ``*_attn_wall_share``: the time spent inside the attention function (the whole
of it: kernels and the PyTorch ops around them) over the step time. Cache bytes: TQCache: its
QuantizedKVCaches' ``nbytes`` (codes, metadata, the 16-bit sinks and recent tokens); the others:
their K/V tensors (the static cache and TQCache as allocated for the run's length).

``--fill``: the batch the memory buys: Llama-3-8B's shape with all 32 layers (random bfloat16
weights), each cache (``--variants``, default the fast fp16 anchor and the default TQCache) at the
largest batch of ``--fill-tokens``-token sequences the free memory holds, filled with synthetic K/V
through its write path (no prefill per sequence), then decoded compiled
(``flash_attn_tq.testing.fill``); writes ``generate_fill.json`` / ``.md``.

Writes ``generate.json`` (``{"meta": the run's stamp (gpu, torch, cuda, transformers, commit, the
command), "rows": [...]}``, rows with ``model, B, prompt, dynamic_tok_s, static_tok_s, tq_tok_s`` and
more) and ``generate.md`` under ``--out`` (default benchmarks/results; with ``--quick``,
/tmp/bench_generate_quick), both written again after each row (a run cut short keeps the rows it
finished). ``--quick``: tiny random Llamas in place of both models, tiny prompts (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from flash_attn_tq.testing import (
    Clock,
    describe,
    fmt,
    made_by,
    profiled_times,
    stamp,
    timed_attention,
    write_results,
)
from flash_attn_tq.testing.assets import (
    GGUF,
    LLAMA3_8B,
    SMOLLM2_135M,
    default_data_dir,
    ensure_model,
    load_smollm2,
    random_llama,
)
from flash_attn_tq.testing.fill import cache_nbytes

RESULTS = Path(__file__).resolve().parent / "results"

ATTN_KEYWORDS = ("decode", "flash", "attention", "sdpa", "fmha", "combine")
FP16_VARIANTS = ("dynamic", "static", "static_compiled", "static_generate", "kv16", "kv16_compiled", "fa2_compiled")
TQ_VARIANTS = ("tq", "tq_calibrated", "tq_graph", "tq_compiled", "tq_generate")
ALL_VARIANTS = FP16_VARIANTS + TQ_VARIANTS
TQ_REFERENCE = ("tq_compiled", "tq_graph", "tq_generate")  # tokens checked against the eager tq run's
FAST_FP16 = ("kv16", "fa2")  # FastStaticCache backends (variant prefixes)
CUDA_ONLY = ("_compiled", "_graph", "_generate")  # (CUDA graphs)
GENERATE_TIMING = "the median of three pairs of generate() calls"

# --quick: tiny random stand-ins (SmolLM2's 3:1 GQA at head_dim 64; the 8B shape's 4:1 at 128)
TINY = {
    "smollm2": dict(
        vocab_size=512,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "llama8b": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}
MODELS = {  # batch, prompts (None: --prompts), variants; GPU dtype
    "smollm2": dict(
        B=1,
        prompts=None,
        dtype=torch.float16,
        variants=ALL_VARIANTS,
    ),
    "llama8b": dict(
        B=8,
        prompts=(32768,),
        dtype=torch.bfloat16,
        variants=tuple(v for v in ALL_VARIANTS if v != "tq_calibrated"),
    ),
}


# --------------------------------------------------------------------------- helpers


def meta() -> dict:
    """The run's stamp (flash_attn_tq.testing.stamp) with the transformers version."""
    import transformers

    return stamp(transformers=transformers.__version__)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter but an untied input embedding (of which
    a step reads B rows)."""
    skip = set()
    emb = model.get_input_embeddings()
    if emb is not None and emb.weight is not getattr(model.get_output_embeddings(), "weight", None):
        skip.add(id(emb.weight))
    return sum(tensor_bytes(p) for p in model.parameters() if id(p) not in skip)


def copy_gbps(device) -> float | None:
    """The device's copy bandwidth, GB/s: a 2 GiB device-to-device copy (bytes read + written over
    its median time); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    from flash_attn_tq.testing import bench

    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * 2**30 / us / 1e3


def kernel_share(prof, cuda: bool) -> tuple[float | None, list]:
    """(attention kernels' share of the device time, the top kernels [(name, us)]) from a profile;
    on the CPU the same over the operators' self time (a rough stand-in)."""
    rows = profiled_times(prof, cuda)
    total = sum(t for _, t in rows)
    if total <= 0:
        return None, []
    attn = sum(t for k, t in rows if any(w in k.lower() for w in ATTN_KEYWORDS))
    top = sorted(rows, key=lambda r: -r[1])[:10]
    return attn / total, [(k[:120], round(t, 1)) for k, t in top]


# --------------------------------------------------------------------------- models


def smollm2_model(data: Path, dtype, device):
    """SmolLM2-135M-Instruct from its GGUF under ``data`` (fetched when missing), SDPA attention."""
    _, model = load_smollm2(ensure_model(data))
    model.set_attn_implementation("sdpa")
    return model.to(device=device, dtype=dtype).eval()


def model_description(name: str, quick: bool, random_weights: bool = False) -> str:
    if quick:
        return f"tiny random Llama standing in for {name}"
    if name == "smollm2" and random_weights:
        return "SmolLM2-135M's architecture, random weights"
    if name == "smollm2":
        return f"SmolLM2-135M-Instruct ({GGUF})"
    return "Llama-3-8B-shaped, 8 layers, random weights"


# --------------------------------------------------------------------------- one run


def attn_implementation(variant: str) -> str:
    """The attention function a variant's model runs."""
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    if variant.startswith("tq"):
        return ATTN_IMPLEMENTATION
    if variant.startswith(FAST_FP16):
        from flash_attn_tq.testing import fp16_decode

        return fp16_decode.ATTN_IMPLEMENTATION
    return "sdpa"


def make_cache(variant, model, capacity, calibrated):
    from transformers import DynamicCache, StaticCache

    if variant == "dynamic":
        return DynamicCache(config=model.config)
    if variant.startswith("static"):
        return StaticCache(config=model.config, max_cache_len=capacity)
    if variant.startswith(FAST_FP16):
        from flash_attn_tq.testing.fp16_decode import FastStaticCache

        return FastStaticCache(model.config, max_cache_len=capacity, backend=variant.split("_")[0])
    from flash_attn_tq.integrations.transformers import TQCache

    if variant == "tq_calibrated":  # the calibrated widths, this run's capacity
        return TQCache(
            model.config,
            max_cache_len=capacity,
            late_k_bits=None,
            layer_options=calibrated.layer_options,
            head_options=calibrated.head_options,
        )
    return TQCache(model.config, max_cache_len=capacity)


@torch.no_grad()
def warm_up(model, device, B):
    """A short prompt and two decode steps through DynamicCache and TQCache: library and kernel
    initialisation out of the first timed prefill."""
    from transformers import DynamicCache

    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache

    ids = torch.randint(0, model.config.vocab_size, (B, 256), device=device)
    for impl, cache in (("sdpa", DynamicCache(config=model.config)), (ATTN_IMPLEMENTATION, TQCache(model.config))):
        model.set_attn_implementation(impl)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for t in range(2):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    sync(device)


@torch.no_grad()
def run_generate(model, variant, ids, args) -> dict:
    """``model.generate`` as a user calls it (see the module docstring): tokens/s from the median wall
    times of generate calls of two lengths."""
    device = ids.device
    B, P = ids.shape
    n0, n1 = max(args.warmup, 2), max(args.warmup, 2) + args.new_tokens
    model.set_attn_implementation(attn_implementation(variant))
    torch._dynamo.reset()

    def generate(n):
        cache = make_cache(variant, model, P + n1 + 8, None)
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        return time.perf_counter() - t, out, cache

    t_w = time.perf_counter()
    generate(n0)  # (compiles)
    warm = round(time.perf_counter() - t_w, 2)
    walls = {n0: [], n1: []}
    for _ in range(3):
        for n in (n0, n1):
            wall, out, cache = generate(n)
            walls[n].append(wall)
    t0, t1 = statistics.median(walls[n0]), statistics.median(walls[n1])
    torch._dynamo.reset()
    return dict(
        tok_s=B * (n1 - n0) / (t1 - t0),
        step_ms=(t1 - t0) * 1e3 / (n1 - n0),
        prefill_ms=None,
        warmup_s=warm,
        cache_bytes=cache_nbytes(cache),
        tokens=out[:, P:].cpu(),
    )


@torch.no_grad()
def run_variant(model, variant, ids, args, calibrated=None) -> dict:
    """Prefill ``ids`` [B, P], then ``warmup + new_tokens (+ 2 x profile_steps)`` greedy decode steps."""
    device = ids.device
    cuda = device.type == "cuda"
    clock = Clock(device)
    B, P = ids.shape
    steps, warmup = args.new_tokens, args.warmup
    prof_steps = 0 if args.no_profile else args.profile_steps
    capacity = P + warmup + steps + 2 * prof_steps + 8  # (the profiled steps run twice: kernels, then wall time)
    compiled = variant.endswith("_compiled")
    graph = variant.endswith("_graph")
    model.set_attn_implementation(attn_implementation(variant))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False, dynamic=False)
        mark_step = torch.compiler.cudagraph_mark_step_begin
    else:
        call, mark_step = model, (lambda: None)
    cache = make_cache(variant, model, capacity, calibrated)
    out = {}
    decoder = None
    if graph:
        from flash_attn_tq.integrations.graphs import GraphDecoder

        decoder = GraphDecoder(model, cache)

    a = clock.mark()
    if graph:
        logits = decoder.prefill(ids)[:, None]
    else:
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    nxt = logits[:, -1:].argmax(-1)
    b = clock.mark()
    sync(device)
    out["prefill_ms"] = clock.ms(a, b)
    del logits

    pos = P
    tokens, marks = [nxt], []

    def step(record):
        nonlocal nxt, pos
        position_ids = torch.full((1, 1), pos, dtype=torch.long, device=device)
        mark_step()
        t0 = clock.mark()
        if graph:
            nxt = decoder.step(nxt).argmax(-1, keepdim=True)
        else:
            o = call(input_ids=nxt, past_key_values=cache, position_ids=position_ids, use_cache=True, logits_to_keep=1)
            nxt = o.logits[:, -1:].argmax(-1)
        t1 = clock.mark()
        if record is not None:
            record.append((t0, t1))
        tokens.append(nxt)
        pos += 1

    t_w = time.perf_counter()
    for _ in range(warmup):
        step(None)
    sync(device)
    out["warmup_s"] = round(time.perf_counter() - t_w, 2)
    if variant.startswith("tq"):
        import flash_attn_tq

        out["path"] = flash_attn_tq.last_path()  # the attention path the last decode step took
    t_d = time.perf_counter()
    for _ in range(steps):
        step(marks)
    sync(device)
    out["decode_wall_s"] = round(time.perf_counter() - t_d, 3)
    times = [clock.ms(s, e) for s, e in marks]
    out["step_ms"] = statistics.median(times)
    out["step_ms_mean"] = sum(times) / len(times)
    out["tok_s"] = B * 1e3 / out["step_ms"]

    if prof_steps:
        try:  # kernel-name share of the device time
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with profile(activities=acts) as prof:
                for _ in range(prof_steps):
                    step(None)
                sync(device)
            out["attn_share"], out["top_kernels"] = kernel_share(prof, cuda)
        except Exception as e:  # (the profiler is a diagnostic: never fail the run for it)
            out["attn_share_error"] = f"{type(e).__name__}: {e}"[:300]
        if not compiled and not graph:  # time inside the attention function over the step time
            spans, stepm = [], []
            with timed_attention(model, clock, spans):
                for _ in range(prof_steps):
                    step(stepm)
            sync(device)
            step_total = sum(clock.ms(s, e) for s, e in stepm)
            out["attn_wall_share"] = sum(clock.ms(s, e) for s, e in spans) / step_total if step_total else None
    out["cache_bytes"] = cache_nbytes(cache)
    if cuda:
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    out["tokens"] = torch.cat(tokens, 1).cpu()  # [B, 1 + steps...]
    cache = None  # (freed before the next variant)
    if compiled:
        torch._dynamo.reset()
    return out


def bench_model(name, args) -> Iterator[dict]:
    """The model's rows, a prompt length each, yielded as each is done."""
    spec = MODELS[name]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = spec["dtype"] if cuda else torch.float32
    t0 = time.perf_counter()
    if args.quick:
        model = random_llama(TINY[name], dtype, device)
    elif name == "smollm2" and args.random_weights:
        model = random_llama(SMOLLM2_135M, dtype, device)
    elif name == "smollm2":
        model = smollm2_model(Path(args.data), dtype, device)
    else:
        model = random_llama(dict(LLAMA3_8B, num_hidden_layers=8), dtype, device)
    print(f"[{name}] model ready in {time.perf_counter() - t0:.1f} s ({dtype}, {device})", flush=True)
    weights, bandwidth = weight_bytes(model), copy_gbps(device)
    B = args.batch or (1 if args.quick and name == "smollm2" else 2 if args.quick else spec["B"])
    if args.quick:
        prompts = [200, 300] if name == "smollm2" else [260]
    else:
        prompts = spec["prompts"] or args.prompts
    if name == "llama8b" and args.llama_prompt:
        prompts = [args.llama_prompt]
    wanted = [v for v in spec["variants"] if v in args.variants]
    if not cuda:
        wanted = [v for v in wanted if not v.endswith(CUDA_ONLY)]
    if args.no_compile:
        wanted = [v for v in wanted if not v.endswith(("_compiled", "_generate"))]

    try:
        warm_up(model, device, B)
    except Exception:  # (a failing cache fails again in its own variant, where the error is recorded)
        traceback.print_exc()
    calibrated, calibration = None, {}
    if "tq_calibrated" in wanted:
        from flash_attn_tq.integrations.transformers import TQCache

        try:
            t0 = time.perf_counter()
            calibrated = TQCache.calibrated(model)
            sync(device)
            calibration = dict(
                calibration_s=round(time.perf_counter() - t0, 2),
                calibrated_layer_options={str(k): v for k, v in calibrated.layer_options.items()},
                calibrated_head_options={f"{i},{h}": v for (i, h), v in calibrated.head_options.items()},
            )
            print(f"[{name}] TQCache.calibrated: {calibration['calibration_s']} s", flush=True)
        except Exception as e:
            traceback.print_exc()
            calibration = dict(calibration_error=f"{type(e).__name__}: {e}"[:300])
            wanted.remove("tq_calibrated")

    for P in prompts:
        g = torch.Generator().manual_seed(P)
        ids = torch.randint(0, model.config.vocab_size, (B, P), generator=g).to(device)
        row = dict(
            model=name,
            model_desc=model_description(name, args.quick, args.random_weights),
            dtype=str(dtype).replace("torch.", ""),
            B=B,
            prompt=P,
            new_tokens=args.new_tokens,
            warmup=args.warmup,
            weight_bytes=weights,
            copy_GBps=bandwidth,
            **calibration,
        )
        row.update({f"{v}_tok_s": None for v in ("dynamic", "static", "tq")})
        results = {}
        for v in wanted:
            free_memory(device)
            try:
                if v.endswith("_generate"):
                    r = run_generate(model, v, ids, args)
                else:
                    r = run_variant(model, v, ids, args, calibrated if v == "tq_calibrated" else None)
            except Exception as e:
                traceback.print_exc()
                row[f"{v}_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"[{name} P={P}] {v}: FAILED ({row[f'{v}_error'][:200]})", flush=True)
                if v.endswith(("_compiled", "_generate")):
                    torch._dynamo.reset()
                continue
            finally:
                free_memory(device)
            results[v] = r
            for k, x in r.items():
                if k != "tokens":
                    row[f"{v}_{k}"] = x
            if bandwidth:  # the step's floor: its weights and K/V read once at the copy bandwidth
                row[f"{v}_floor_ms"] = (weights + r["cache_bytes"]) / bandwidth / 1e6
                row[f"{v}_vs_floor"] = r["step_ms"] / row[f"{v}_floor_ms"]
            print(
                f"[{name} B={B} P={P}] {v}: {r['tok_s']:.1f} tok/s (step {r['step_ms']:.3f} ms, prefill "
                f"{fmt(r['prefill_ms'])} ms, cache {r['cache_bytes'] / 2**20:.1f} MiB, attention share "
                f"{fmt(r.get('attn_share'), '.2f')} kernels / {fmt(r.get('attn_wall_share'), '.2f')} wall)",
                flush=True,
            )
        for v, r in results.items():  # greedy tokens against the reference run (a sanity check)
            ref_name = "tq" if v in TQ_REFERENCE else "dynamic"
            ref = results.get(ref_name)
            if ref is not None and v != ref_name:
                n = min(ref["tokens"].shape[1], r["tokens"].shape[1])
                row[f"{v}_tokens_agree"] = (ref["tokens"][:, :n] == r["tokens"][:, :n]).float().mean().item()
        fp16 = {v: row[f"{v}_tok_s"] for v in FP16_VARIANTS if row.get(f"{v}_tok_s")}
        if fp16:
            best = max(fp16, key=fp16.get)
            row.update(best_fp16=best, best_fp16_tok_s=fp16[best])
            for v in TQ_VARIANTS:
                if row.get(f"{v}_tok_s"):
                    row[f"{v}_vs_best_fp16"] = row[f"{v}_tok_s"] / fp16[best]
            if row.get("tq_cache_bytes") and row.get("dynamic_cache_bytes"):
                row["kv_bytes_ratio"] = row["dynamic_cache_bytes"] / row["tq_cache_bytes"]  # fp16 / TQ
        yield row
    del model
    free_memory(device)


# --------------------------------------------------------------------------- output


def mib(x):
    return "–" if not x else f"{x / 2**20:,.1f}" if x >= 2**20 else f"{x / 2**20:.3f}"


def markdown(res) -> str:
    m = res["meta"]
    lines = [
        f"# End-to-end decode, TQCache vs transformers' caches ({describe(m)})",
        "",
        made_by(m),
        "",
        "Decode tokens/s = B / median step time (CUDA events, one greedy token a step after "
        f"{res['setup']['warmup']} warm-up steps, {res['setup']['new_tokens']} timed). +compile: the decode "
        "step under torch.compile(mode='reduce-overhead') (CUDA graphs). TQCache, CUDA graph: decoded by "
        "GraphDecoder. generate(): model.generate(ids, past_key_values=cache) as a user calls it "
        "(transformers compiles the decode steps of both caches), tokens/s from the wall times of "
        f"{res['setup'].get('generate_timing', GENERATE_TIMING)}. "
        "fp16 kernel: transformers' static buffers read by this project's fp16 decode kernel; FA2: by "
        "upstream FlashAttention-2's flash_attn_with_kvcache (both only the filled tokens). "
        "/ best fp16: over the fastest fp16 row of the run (named). KV MiB: the cache as held after the run "
        "(dynamic: its K/V; TQCache: codes, metadata, window and sinks). Attention share: attention "
        "kernels' share of the step's CUDA time (profiler; in brackets: the time inside the attention "
        "function over the step time).",
        "",
        "| model | dtype | B | prompt | dynamic | static | static+compile | generate(): static "
        "| fp16 kernel | fp16 kernel+compile | FA2+compile "
        "| TQCache | TQCache.calibrated | TQCache+compile | TQCache, CUDA graph | generate(): TQCache "
        "| generate() TQ / static | TQ+compile / best fp16 | KV MiB dynamic | KV MiB TQ | fp16/TQ bytes "
        "| attn share dynamic | attn share TQ | prefill ms dyn / TQ | calibration s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:

        def share(v):
            return f"{fmt(r.get(f'{v}_attn_share'), '.2f')} ({fmt(r.get(f'{v}_attn_wall_share'), '.2f')})"

        gen = r.get("tq_generate_tok_s"), r.get("static_generate_tok_s")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['B']} | {r['prompt']} | {fmt(r.get('dynamic_tok_s'))} "
            f"| {fmt(r.get('static_tok_s'))} | {fmt(r.get('static_compiled_tok_s'))} "
            f"| {fmt(r.get('static_generate_tok_s'))} | {fmt(r.get('kv16_tok_s'))} "
            f"| {fmt(r.get('kv16_compiled_tok_s'))} | {fmt(r.get('fa2_compiled_tok_s'))} | {fmt(r.get('tq_tok_s'))} "
            f"| {fmt(r.get('tq_calibrated_tok_s'))} | {fmt(r.get('tq_compiled_tok_s'))} "
            f"| {fmt(r.get('tq_graph_tok_s'))} | {fmt(r.get('tq_generate_tok_s'))} "
            f"| {fmt(gen[0] / gen[1] if all(gen) else None, '.2f')}x "
            f"| {fmt(r.get('tq_compiled_vs_best_fp16'), '.2f')}x ({r.get('best_fp16', '–')}) "
            f"| {mib(r.get('dynamic_cache_bytes'))} | {mib(r.get('tq_cache_bytes'))} "
            f"| {fmt(r.get('kv_bytes_ratio'), '.2f')} | {share('dynamic')} | {share('tq')} "
            f"| {fmt(r.get('dynamic_prefill_ms'))} / {fmt(r.get('tq_prefill_ms'))} | {fmt(r.get('calibration_s'))} |"
        )
    floors = [
        "",
        "Step time against its floor: the weights a step reads (all but an untied input embedding) and "
        "the cache's bytes (as allocated for the run's length) read once at the device's measured copy "
        "bandwidth (a 2 GiB device-to-device copy).",
        "",
        "| model | B | prompt | copy GB/s | variant | tok/s | step ms | floor ms | step / floor |",
        "|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        for v in ALL_VARIANTS:
            if r.get(f"{v}_floor_ms"):
                floors.append(
                    f"| {r['model']} | {r['B']} | {r['prompt']} | {fmt(r.get('copy_GBps'), '.0f')} | {v} "
                    f"| {fmt(r.get(f'{v}_tok_s'))} | {fmt(r.get(f'{v}_step_ms'), '.3f')} "
                    f"| {fmt(r[f'{v}_floor_ms'], '.3f')} | {fmt(r.get(f'{v}_vs_floor'), '.2f')} |"
                )
    if len(floors) > 6:
        lines += floors
    notes = []
    for r in res["rows"]:
        for k, x in r.items():
            if k.endswith("_error"):
                notes.append(f"- {r['model']} B={r['B']} prompt {r['prompt']}: {k[:-6]} failed: `{x}`")
            if k.endswith("_path") and x and not str(x).startswith("quantized:fused"):
                notes.append(f"- {r['model']} B={r['B']} prompt {r['prompt']}: {k[:-5]} decode took `{x}`")
            if k.endswith("_tokens_agree") and x is not None and x < 1.0:
                notes.append(
                    f"- {r['model']} B={r['B']} prompt {r['prompt']}: {k[:-13]} greedy tokens agree with "
                    f"the reference run at {x:.3f}"
                )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,llama8b", help="comma-separated: smollm2, llama8b")
    p.add_argument("--prompts", default="2048,8192", help="SmolLM2 prompt lengths (tokens)")
    p.add_argument("--llama-prompt", type=int, help="the 8B-shaped model's prompt length (default 32768)")
    p.add_argument("--batch", type=int, help="batch size for every model (default: 1 for smollm2, 8 for llama8b)")
    p.add_argument("--new-tokens", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (compiled variants compile there)")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps profiled for the attention share")
    p.add_argument("--no-profile", action="store_true", help="skip the attention-share measurement")
    p.add_argument("--variants", help="subset of " + ",".join(ALL_VARIANTS) + " (default: all)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled and generate() variants")
    p.add_argument("--quick", action="store_true", help="tiny random models and prompts (CPU smoke test)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2-135M's architecture with random weights in place of the GGUF",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--data", default=str(default_data_dir()), help="SmolLM2 assets (flash_attn_tq.testing.assets; $TQ_EVAL_DATA)"
    )
    p.add_argument("--out", help="output directory (default benchmarks/results; --quick: /tmp/bench_generate_quick)")
    p.add_argument("--tag", help="output file stem (default generate; --fill: generate_fill)")
    p.add_argument(
        "--fill",
        action="store_true",
        help="the batch memory buys: the 8B shape with 32 layers, each cache at the largest batch the card "
        "holds, filled with synthetic K/V (--variants: kv16_compiled,tq_compiled by default)",
    )
    p.add_argument("--fill-tokens", type=int, default=32768, help="--fill: tokens a sequence holds")
    p.add_argument("--reserve-gib", type=float, default=4.0, help="--fill: memory kept for the decode step")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(MODELS)}")
    args.prompts = [int(x) for x in args.prompts.split(",") if x]
    default = "kv16_compiled,tq_compiled" if args.fill else ",".join(ALL_VARIANTS)
    args.variants = [v for v in (args.variants or default).split(",") if v]
    args.tag = args.tag or ("generate_fill" if args.fill else "generate")
    bad = [v for v in args.variants if v not in ALL_VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(ALL_VARIANTS)}")
    if args.quick:
        args.new_tokens = min(args.new_tokens, 4)
        args.warmup = min(args.warmup, 2)
        args.profile_steps = min(args.profile_steps, 2)
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    args.out = Path(args.out or ("/tmp/bench_generate_quick" if args.quick else RESULTS))
    return args


def run_benchmark(args, done=None) -> dict:
    """Every model's rows; ``done(result so far)`` after each row (main writes the files there)."""
    rows = []
    setup = dict(
        new_tokens=args.new_tokens,
        warmup=args.warmup,
        profile_steps=0 if args.no_profile else args.profile_steps,
        quick=args.quick,
        device=str(args.device),
        attention_keywords=list(ATTN_KEYWORDS),
        generate_timing=GENERATE_TIMING,
    )
    res = {"meta": meta(), "setup": setup, "rows": rows}
    for name in args.models:
        for row in bench_model(name, args):
            rows.append(row)
            if done is not None:
                done(res)
    return res


def run_fill(args, done=None) -> dict:
    """--fill: each variant's cache at the largest batch the card holds beside the 32-layer 8B shape."""
    from flash_attn_tq.testing.fill import measure_filled

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = TINY["llama8b"] if args.quick else LLAMA3_8B
    model = random_llama(config, torch.bfloat16 if cuda else torch.float32, device)
    tokens = 300 if args.quick else args.fill_tokens
    capacity = tokens + args.warmup + args.new_tokens + 8
    desc = "tiny random Llama" if args.quick else "Llama-3-8B-shaped, 32 layers, random weights"
    setup = dict(fill=True, tokens=tokens, new_tokens=args.new_tokens, warmup=args.warmup, reserve_gib=args.reserve_gib)
    res = {"meta": meta(), "setup": setup, "rows": []}
    for v in args.variants:
        model.set_attn_implementation(attn_implementation(v))
        row = dict(model=desc, variant=v, prompt=tokens, weight_bytes=weight_bytes(model))
        try:
            row.update(
                measure_filled(
                    model,
                    lambda v=v: make_cache(v, model, capacity, None),
                    tokens,
                    args.new_tokens,
                    args.warmup,
                    int(args.reserve_gib * 2**30),
                    batch=args.batch or (None if cuda else 2),
                )
            )
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[fill] {v}: batch {row.get('batch')}, {fmt(row.get('tok_s'))} tok/s {row.get('error', '')}", flush=True)
        res["rows"].append(row)
        free_memory(device)
        if done is not None:
            done(res)
    return res


def markdown_fill(res) -> str:
    m, s = res["meta"], res["setup"]
    rows = {r["variant"]: r for r in res["rows"]}
    lines = [
        f"# The batch the card holds: the 8B shape, 32 layers ({describe(m)})",
        "",
        made_by(m),
        "",
        f"Each cache at the largest batch of {s['tokens']}-token sequences the free memory holds beside the "
        f"model (after {s['reserve_gib']} GiB kept for the step), filled with synthetic K/V through its "
        "write path (no prefill arithmetic), then decoded greedily with the step compiled "
        f"(torch.compile, CUDA graphs; {s['new_tokens']} timed steps after {s['warmup']}). kv16: the static "
        "fp16 buffers read by this project's fp16 decode kernel; tq: the default TQCache. A run out of memory "
        "(writing or decoding) retries at 90% of the batch; 'out-of-memory retries' counts them (0: the batch "
        "the free memory holds).",
        "",
        "| variant | batch | out-of-memory retries | KV MiB a sequence | KV GiB | tokens/s | step ms | fill s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['variant']} | {r.get('batch', '–')} | {r.get('oom_retries', '–')} | {mib(r.get('per_seq_bytes'))} "
            f"| {fmt(r['kv_bytes'] / 2**30 if r.get('kv_bytes') else None, '.2f')} | {fmt(r.get('tok_s'))} "
            f"| {fmt(r.get('step_ms'), '.2f')} | {fmt(r.get('fill_s'))} |"
        )
    fp16, tq = rows.get("kv16_compiled", {}), rows.get("tq_compiled", {})
    if fp16.get("tok_s") and tq.get("tok_s"):
        lines += [
            "",
            f"TQCache: {tq['batch'] / fp16['batch']:.2f}x the batch, {tq['tok_s'] / fp16['tok_s']:.2f}x the tokens/s.",
        ]
    errors = [f"- {r['variant']}: `{r['error']}`" for r in res["rows"] if r.get("error")]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    render = markdown_fill if args.fill else markdown

    def write(res):  # (after each row: a run cut short keeps what it measured)
        write_results(args.out, args.tag, res, render(res))
        print(f"wrote {len(res['rows'])} row(s) to {args.out / args.tag}.json / .md", flush=True)

    res = run_fill(args, write) if args.fill else run_benchmark(args, write)
    print(render(res))
    print(f"wrote {args.out / (args.tag + '.json')} and {args.tag}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
