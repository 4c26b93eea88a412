"""Python-side cost of one TQCache decode step, on the CPU: dispatched torch ops by flash_attn_tq function.

    python -m scripts.profile_decode_ops [QKV_DUMP] [--prompt 300]

On the GPU a small model's decode step is bound by the host: every torch op costs a dispatch and a
launch. This runs the GPU code path's Python side on the CPU with the two kernels (pack, fused
attention) replaced by stubs of the same shapes, counts the ops each flash_attn_tq function
dispatches in one decode step (a randomly initialised SmolLM2-shaped Llama, config from the
benchmarks/dump_qkv.py file), and times the step against transformers' DynamicCache (model compute
included).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn_tq import dispatch, ops


class CountByFunction(TorchDispatchMode):
    """Counts dispatched ops by the innermost flash_attn_tq function on the Python stack."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, where = sys._getframe(1), "model (outside flash_attn_tq)"
        while frame is not None:
            name = frame.f_code.co_filename
            if "flash_attn_tq" + os.sep in name:
                where = name.split("flash_attn_tq" + os.sep)[-1] + ":" + frame.f_code.co_name
                break
            frame = frame.f_back
        self.counts[where] += 1
        return func(*args, **(kwargs or {}))


def stub_kernels() -> None:
    """The GPU branches of the Python code, with shape-correct stand-ins for the two kernels."""
    cpu_as_gpu = dispatch.Device("cuda", extension=True, prefill_smem=True)
    dispatch.Device.of = staticmethod(lambda device: cpu_as_gpu)  # plans: fused launches, the pack kernel
    ops.pack = lambda k, v, stores, **books: None
    ops.decode = lambda q, stores, lens, bidx=None, **options: (
        torch.zeros_like(q),
        torch.zeros(q.shape[0], q.shape[2], q.shape[1]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "qkv", nargs="?", default=".qkv/smollm2_qkv.pt", help="benchmarks/dump_qkv.py output (for the config)"
    )
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache

    data = torch.load(args.qkv, map_location="cpu")
    cfg = {k: v for k, v in dict(data["config"]).items() if k in LlamaConfig().to_dict() or k == "head_dim"}
    config = LlamaConfig(**cfg)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(10, config.vocab_size, (1, args.prompt))

    def step_time(cache_kv, token):
        t = time.perf_counter()
        for _ in range(args.steps):
            model(token, past_key_values=cache_kv, use_cache=True)
        return (time.perf_counter() - t) / args.steps * 1e3

    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        t_dynamic = step_time(out.past_key_values, token)

        stub_kernels()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        out = model(
            ids, past_key_values=TQCache(config, max_cache_len=args.prompt + 2 * args.steps + 8), use_cache=True
        )
        pkv = out.past_key_values
        model(token, past_key_values=pkv, use_cache=True)
        counter = CountByFunction()
        with counter:
            model(token, past_key_values=pkv, use_cache=True)
        t_tq = step_time(pkv, token)
    layers = config.num_hidden_layers
    print(f"one decode step, {layers} layers, prompt {args.prompt}: {sum(counter.counts.values())} dispatched ops")
    for where, n in counter.counts.most_common():
        print(f"  {n:6d} ({n / layers:6.1f} a layer)  {where}")
    print(f"step time on this CPU (model compute included): TQCache {t_tq:.1f} ms, DynamicCache {t_dynamic:.1f} ms")


if __name__ == "__main__":
    main()
