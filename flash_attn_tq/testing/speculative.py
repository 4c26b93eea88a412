"""Speculative decoding as a serving engine runs it, over any transformers cache: the prompt is
written by one forward, then each step drafts tokens by prompt lookup (the continuation of the last
n-gram's latest earlier occurrence), verifies them and the step's token in one multi-token forward,
keeps the greedy prefix that matches and crops the rejected drafts from the cache.

With ``draft_tokens=0`` every step is a one-token decode: greedy decoding over the same cache. Over a
:class:`~flash_attn_tq.integrations.transformers.TQCache` the two give the same tokens when each query
of a verify call attends as a one-token decode would (``CacheSpec.verify_tokens``), which is what
``tests/test_assisted_generation.py`` holds them to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpeculativeRun:
    """A run's generated tokens and what its verify steps did."""

    tokens: list[int]
    steps: int = 0  # forwards after the prompt's
    drafted: int = 0
    accepted: int = 0
    rejected_steps: int = 0  # steps that cropped rejected drafts
    lengths: list[int] = field(default_factory=list)  # query tokens a step

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones (0 without drafts)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def lookup_drafts(seq: list[int], draft_tokens: int, ngram: int = 3) -> list[int]:
    """Up to ``draft_tokens`` tokens that followed the latest earlier occurrence of the sequence's last
    ``ngram`` (then shorter) tokens; none where no n-gram recurs."""
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + draft_tokens]
    return []


@torch.no_grad()
def generate(model, ids: torch.Tensor, cache, new_tokens: int, draft_tokens: int = 8, ngram: int = 3) -> SpeculativeRun:
    """Greedy generation of ``new_tokens`` after ``ids [1, prompt]`` over ``cache`` (empty), verifying up
    to ``draft_tokens`` prompt-lookup drafts a step (0: one-token decoding)."""
    if ids.shape[0] != 1:
        raise ValueError(f"ids: one sequence [1, prompt], got batch {ids.shape[0]}")
    logits = model(ids, past_key_values=cache, use_cache=True).logits
    run = SpeculativeRun(tokens=[int(logits[0, -1].argmax())])
    prompt = ids[0].tolist()
    while len(run.tokens) < new_tokens:
        want = min(draft_tokens, new_tokens - len(run.tokens) - 1)
        drafts = lookup_drafts(prompt + run.tokens, want, ngram) if want > 0 else []
        step = torch.tensor([[run.tokens[-1], *drafts]], device=ids.device)
        preds = model(step, past_key_values=cache, use_cache=True).logits[0].argmax(-1).tolist()
        n = 0
        while n < len(drafts) and preds[n] == drafts[n]:
            n += 1
        if n < len(drafts):
            cache.crop(-(len(drafts) - n))
            run.rejected_steps += 1
        run.tokens += drafts[:n] + [preds[n]]
        run.steps += 1
        run.drafted += len(drafts)
        run.accepted += n
        run.lengths.append(step.shape[1])
    run.tokens = run.tokens[:new_tokens]
    return run
