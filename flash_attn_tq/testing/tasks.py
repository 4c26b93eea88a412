"""The quality study's tasks: perplexity windows, copy retrieval, and the log-probs of a model that
decodes token by token through a cache (what ``generate`` computes, teacher-forced).

Token ids are int64 tensors, ``[n]`` for one text or ``[B, L]`` for a batch of windows; log-probs
are float32, ``[rows, vocab]`` or ``[B, rows, vocab]``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch

from .simulation import Sim


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs ``[n, vocab]`` (float32) of one text ``ids [n]`` in one forward (no cache:
    the model's attention implementation, the simulation's where installed, sees every token)."""
    h = model.model(ids[None]).last_hidden_state[0]
    return torch.log_softmax(model.lm_head(h).float(), -1)


def ppl_windows(ids: torch.Tensor, length: int, count: int, start: int = 0) -> list[torch.Tensor]:
    """Up to ``count`` consecutive windows of ``length`` tokens of ``ids [n]`` from ``start``."""
    n = max(0, min(count, (len(ids) - start) // length))
    return [ids[start + i * length : start + (i + 1) * length] for i in range(n)]


def product_windows(ids: torch.Tensor, length: int, decode: int, count: int) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens for the product path, spread evenly over the text but
    never closer than ``decode`` tokens apart, so the decoded (scored) tails of two windows never
    overlap: a short text is tiled by them, a long one sampled end to end."""
    last = len(ids) - length
    if last < 0 or count < 1:
        return []
    n = min(count, last // decode + 1)
    starts = [round(i * last / (n - 1)) if n > 1 else 0 for i in range(n)]
    return [ids[s : s + length] for s in starts]


def std_error(values: Sequence[float] | torch.Tensor) -> float:
    """The standard error of the mean of per-window (or per-task) values (0 for one value)."""
    t = torch.as_tensor(values, dtype=torch.float64)
    return t.std().item() / math.sqrt(len(t)) if len(t) > 1 else 0.0


def copy_tasks(
    ids: torch.Tensor, ctx: int, depths: Iterable[float], seeds: Iterable[int], span: int = 64
) -> list[torch.Tensor]:
    """Copy-retrieval sequences: for each seed, a random ``span``-token sequence (tokens drawn from
    the text's vocabulary) inserted at each depth (a fraction) of the text's first ``ctx`` tokens and
    repeated at the end: ``[ctx + 2 * span]`` each."""
    pool = torch.unique(ids)
    tasks = []
    for seed in seeds:
        g = torch.Generator().manual_seed(1000 + seed)
        sp = pool[torch.randint(0, len(pool), (span,), generator=g)]
        for d in depths:
            at = int(d * ctx)
            tasks.append(torch.cat([ids[:at], sp, ids[at:ctx], sp]))
    return tasks


@torch.no_grad()
def copy_predictions(
    model: Any, seq: torch.Tensor, span: int = 64, skip: int = 8, prefill: bool = False
) -> torch.Tensor:
    """Greedy predictions ``[span - skip]`` of the repeat's tokens ``skip..span-1`` (teacher-forced).
    ``prefill``: the context and the repeat's first ``skip`` tokens are the prompt, prefilled in full
    precision, and the rest of the repeat is decoded over the cache (TQCache's ``prefill="full"``,
    ``generate`` on a long document); otherwise every token is decoded through the cache (the
    stricter setting). Under the simulation (:class:`Sim`)."""
    L = len(seq)
    Sim.prefill_len = L - span + skip if prefill else 0
    try:
        h = model.model(seq[None]).last_hidden_state[0, L - span + skip - 1 : L - 1]
    finally:
        Sim.prefill_len = 0
    return model.lm_head(h).argmax(-1)


def copy_accuracy(model: Any, seq: torch.Tensor, span: int = 64, skip: int = 8, prefill: bool = False) -> float:
    """The fraction of the repeat's tokens ``skip..span-1`` that :func:`copy_predictions` gets right."""
    pred = copy_predictions(model, seq, span, skip, prefill)
    return (pred == seq[len(seq) - span + skip :]).float().mean().item()


@torch.no_grad()
def decode_log_probs(model: Any, seqs: torch.Tensor, prompt: int, cache: Any) -> torch.Tensor:
    """What ``generate`` over ``cache`` computes, teacher-forced: ``seqs [B, L]`` prefilled up to
    ``prompt`` in one forward (TQCache's ``prefill="full"``: the prompt attends in full precision and
    is quantized into the cache), then ``seqs[:, t]`` fed one a forward for t = prompt..L-2. Returns
    the float32 log-probs ``[B, L - prompt, vocab]`` of rows prompt-1..L-2 (the predictions of
    tokens prompt..L-1)."""
    logits = model(seqs[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    rows = [torch.log_softmax(logits[:, -1:].float(), -1)]
    for t in range(prompt, seqs.shape[1] - 1):
        logits = model(seqs[:, t : t + 1], past_key_values=cache, use_cache=True).logits
        rows.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(rows, 1)


@torch.no_grad()
def decode_log_probs_graph(model: Any, seqs: torch.Tensor, prompt: int, cache: Any) -> torch.Tensor:
    """:func:`decode_log_probs` with the decode steps replayed as CUDA graphs (GraphDecoder: the same
    kernels without Python's per-step cost; ``cache`` built with ``max_cache_len``)."""
    from ..integrations.graphs import GraphDecoder

    dec = GraphDecoder(model, cache)
    rows = [torch.log_softmax(dec.prefill(seqs[:, :prompt]).float(), -1)[:, None]]
    for t in range(prompt, seqs.shape[1] - 1):
        rows.append(torch.log_softmax(dec.step(seqs[:, t : t + 1]).float(), -1)[:, None])
    dec.check()
    return torch.cat(rows, 1)
