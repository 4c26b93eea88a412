"""The batch a card's memory holds: how many sequences of a given length a cache fits beside a model,
caches filled with synthetic K/V through their normal write path, and decode steps timed at that batch
(``benchmarks/bench_generate.py --fill``).

A cache's bytes a sequence are read off a probe cache of two sequences (both kinds allocate their
whole capacity on the first write); the batch is what the free memory holds after a reserve for the
decode step's activations and CUDA-graph pool. Filling writes random N(0, 1) K/V a layer and a chunk
at a time through the layer's ``update`` (and TQCache's ``commit``: the pack kernel), as a prefill
would, without the prefill's arithmetic.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from .timing import Clock


def cache_nbytes(cache) -> int:
    """Bytes a transformers cache holds: TQCache layers' QuantizedKVCaches (``nbytes``), other layers'
    ``keys`` and ``values`` tensors."""
    total = 0
    for layer in cache.layers:
        caches = getattr(layer, "caches", None)
        if caches is not None:
            total += sum(int(qc.nbytes) for qc in caches)
        else:
            kv = (getattr(layer, "keys", None), getattr(layer, "values", None))
            total += sum(t.numel() * t.element_size() for t in kv if isinstance(t, torch.Tensor))
    return total


def fill_synthetic(
    cache, config, batch: int, tokens: int, dtype, device, chunk: int | None = None, seed: int = 0
) -> None:
    """Write ``tokens`` random key/value vectors a sequence into every layer of ``cache``, ``chunk``
    tokens a write (default: a power of two from 256 to 4096, at most 64K tokens over the batch, so
    that a write's transient copies stay small beside a card-filling cache)."""
    if chunk is None:
        chunk = 4096
        while chunk > 256 and chunk * batch > 65536:
            chunk //= 2
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, config.num_key_value_heads, 0, config.head_dim)
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            for s0 in range(0, tokens, chunk):
                n = min(chunk, tokens - s0)
                k = torch.randn(*shape[:2], n, shape[3], generator=gen, device=device, dtype=dtype)
                v = torch.randn(*shape[:2], n, shape[3], generator=gen, device=device, dtype=dtype)
                cache.update(k, v, i)  # (a TQCache makes its layers on their first update)
                commit = getattr(cache.layers[i], "commit", None)
                if commit is not None:
                    commit()


def bytes_per_sequence(make_cache: Callable[[], Any], config, dtype, device) -> int:
    """A cache's bytes a sequence: a cache of two sequences after one 16-token write, halved."""
    probe = make_cache()
    fill_synthetic(probe, config, 2, 16, dtype, device)
    per_seq = cache_nbytes(probe) // 2
    del probe
    torch.cuda.empty_cache()
    return per_seq


def largest_batch(per_sequence: int, device, reserve: int) -> tuple[int, int]:
    """(the batch the free GPU memory holds after ``reserve`` bytes, the free bytes)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return max((free - reserve) // per_sequence, 0), free


@torch.no_grad()
def decode_steps(model, cache, batch: int, position: int, steps: int, warmup: int) -> dict[str, float]:
    """``warmup`` then ``steps`` greedy decode steps of ``model`` over ``cache`` (holding ``position``
    tokens a sequence), each step under ``torch.compile(mode="reduce-overhead")`` on a GPU (eager on
    the CPU); the median step time and tokens/s."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    call = torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False, dynamic=False) if cuda else model
    clock = Clock(device)
    nxt = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    times = []
    for i in range(warmup + steps):
        pos = torch.full((1, 1), position + i, dtype=torch.long, device=device)
        torch.compiler.cudagraph_mark_step_begin()
        a = clock.mark()
        out = call(input_ids=nxt, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        b = clock.mark()
        if i >= warmup:
            times.append((a, b))
    if cuda:
        torch.cuda.synchronize(device)
        torch._dynamo.reset()
    step_ms = statistics.median(clock.ms(a, b) for a, b in times)
    return dict(step_ms=step_ms, tok_s=batch * 1e3 / step_ms)


def measure_filled(
    model,
    make_cache: Callable[[], Any],
    tokens: int,
    steps: int,
    warmup: int,
    reserve: int,
    batch: int | None = None,
    retries: int = 3,
) -> dict[str, Any]:
    """One cache kind at the largest batch the card holds (``batch``: that batch instead; on the CPU
    it must be given; ``make_cache()``: a new empty cache, sized by its first write): bytes a sequence,
    the batch, the cache's bytes, the seconds the fill took and
    :func:`decode_steps`' timing. Running out of memory retries at 90% of the batch."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    per_seq = bytes_per_sequence(make_cache, model.config, dtype, device)
    free = None
    if batch is None:
        batch, free = largest_batch(per_seq, device, reserve)
    row: dict[str, Any] = dict(per_seq_bytes=per_seq, free_bytes=free, oom_retries=0)
    for attempt in range(retries + 1):
        cache = None
        try:
            cache = make_cache()
            t0 = time.perf_counter()
            fill_synthetic(cache, model.config, batch, tokens, dtype, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row.update(batch=batch, kv_bytes=cache_nbytes(cache), fill_s=round(time.perf_counter() - t0, 2))
            row.update(decode_steps(model, cache, batch, tokens, steps, warmup))
            return row
        except torch.cuda.OutOfMemoryError:
            if attempt == retries:
                raise
            row["oom_retries"] += 1
            batch = int(batch * 0.9)
        finally:
            del cache
            if device.type == "cuda":
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    return row
