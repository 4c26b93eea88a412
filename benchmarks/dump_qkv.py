"""Dump real post-RoPE Q/K/V of a few SmolLM2 layers (CPU) for benchmarks/check_real_qkv.py.

    python benchmarks/dump_qkv.py [--tokens 4096] [--layers 0,7,15,23,29] [--out /tmp/qdata/smollm2_qkv.pt]

Output (torch.save, float16): {"q": {layer: [1, Hq, S, D]}, "k"/"v": {layer: [1, Hkv, S, D]},
"scaling", "model", "text", "config": the model's LlamaConfig as a dict}. About 9.4 KB per token
and layer (4096 tokens x 5 layers: ~40 MB). Model and text are fetched as the quality study fetches
them (flash_attn_tq.testing.assets).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from flash_attn_tq.testing.assets import GGUF, default_data_dir, ensure_assets, load_smollm2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?")
    p.add_argument("--data", default=str(default_data_dir()), help="SmolLM2 assets ($TQ_EVAL_DATA)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--start", type=int, default=0, help="first token of the text")
    p.add_argument("--layers", default="0,7,15,23,29")
    p.add_argument("--out", default="/tmp/qdata/smollm2_qkv.pt")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model_dir, default_text = ensure_assets(Path(args.data))
    text = Path(args.text) if args.text else default_text
    tok, model = load_smollm2(model_dir)
    layers = [int(x) for x in args.layers.split(",")]
    ids = tok(text.read_text(errors="replace"), return_tensors="pt").input_ids[0][args.start : args.start + args.tokens]
    dump = {"q": {}, "k": {}, "v": {}}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if module.layer_idx in layers:
            for name, t in (("q", query), ("k", key), ("v", value)):
                dump[name][module.layer_idx] = t.detach().to(torch.float16).contiguous()
        G = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(
            query, key.repeat_interleave(G, 1), value.repeat_interleave(G, 1), is_causal=True, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    from transformers import AttentionInterface

    AttentionInterface.register("qkv_dump", capture)
    model.set_attn_implementation("qkv_dump")
    with torch.no_grad():
        model.model(ids[None], use_cache=False)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    dump.update(
        scaling=model.model.layers[0].self_attn.scaling, model=GGUF, text=text.name, tokens=len(ids), config=cfg
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dump, out)
    print(
        f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): layers {layers}, {len(ids)} tokens, "
        f"q {tuple(dump['q'][layers[0]].shape)}, k/v {tuple(dump['k'][layers[0]].shape)}"
    )


if __name__ == "__main__":
    main()
