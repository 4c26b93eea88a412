"""The fast fp16 anchor (``flash_attn_tq.testing.fp16_decode``): a model decoding over its static
16-bit buffers through this project's fp16 decode kernel, eager and compiled, gives the logits of
transformers' own SDPA over a DynamicCache."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import NEEDS_GPU

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from flash_attn_tq.testing import fp16_decode  # noqa: E402
from flash_attn_tq.testing.assets import TINY_LLAMA, random_llama  # noqa: E402

pytestmark = NEEDS_GPU
CONFIG = dict(TINY_LLAMA, num_attention_heads=8, num_key_value_heads=2, head_dim=128, initializer_range=0.1)


@torch.no_grad()
def _logits(model, cache, ids, steps, call):
    out = [model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
    nxt = out[0].argmax(-1, keepdim=True)
    for t in range(steps):
        pos = torch.full((ids.shape[0], 1), ids.shape[1] + t, device=ids.device)
        torch.compiler.cudagraph_mark_step_begin()
        logits = call(input_ids=nxt, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        out.append(logits.logits[:, -1].clone())
        nxt = out[-1].argmax(-1, keepdim=True)
    return torch.stack(out, 1).float()


@pytest.mark.parametrize("compiled", [False, True])
def test_fp16_anchor_matches_sdpa(compiled):
    model = random_llama(CONFIG, dtype=torch.float16, device="cuda")
    ids = torch.randint(
        0, CONFIG["vocab_size"], (3, 77), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    ref = _logits(model, DynamicCache(config=model.config), ids, 6, model)
    model.set_attn_implementation(fp16_decode.ATTN_IMPLEMENTATION)
    cache = fp16_decode.FastStaticCache(model.config, max_cache_len=96, backend="kv16")
    call = torch.compile(model.__call__, mode="reduce-overhead", dynamic=False) if compiled else model
    got = _logits(model, cache, ids, 6, call)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
