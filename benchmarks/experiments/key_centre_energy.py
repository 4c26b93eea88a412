"""Why key centring fades with distance from the prompt: energy of SmolLM2's keys at positions
3000-4000 of a 4096-token news window after three kinds of centring (CPU, one forward, ~1 min).

  python3 benchmarks/experiments/key_centre_energy.py [--data /tmp/qdata]

* post: minus the mean post-RoPE key of the first 256 tokens (QuantizedKVCache key_center=True);
* pre: minus R(p) c, c the mean pre-RoPE key (k_proj output) of the first 256 tokens, turned to each
  key's position (eval_quality's rope_center="exact");
* prev256: minus the mean post-RoPE key of the 256 tokens before position 3000 (a local mean).

A 3-bit turbo code's error scales with the energy it codes, so energy is what centring buys.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval_quality as E  # noqa: E402

from flash_attn_tq.cache import rope_turn  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/tmp/qdata")
    args = p.parse_args()
    torch.set_num_threads(2)
    model_dir, text = E.ensure_assets(Path(args.data))
    tok, model = E.load_model(model_dir)
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    ids = tok(text.read_text(errors="replace"), return_tensors="pt").input_ids[0][:4096]
    pre = {}
    for i, layer in enumerate(model.model.layers):  # pre-RoPE keys: k_proj's output (no k-norm in Llama)
        layer.self_attn.k_proj.register_forward_hook(
            lambda m, a, o, i=i: pre.__setitem__(i, o[0].detach().float().reshape(-1, H, D).transpose(0, 1)))
    with torch.no_grad():
        model.model(ids[None])
    inv = model.model.rotary_emb.inv_freq.float()
    pos = torch.arange(len(ids))

    def rope(x):  # pre-RoPE keys [H, S, D] -> post-RoPE, each row at its position
        return rope_turn(x.transpose(0, 1), pos, inv).transpose(0, 1)

    far = slice(3000, 4000)
    energy = lambda x: x.pow(2).sum(-1).mean().item()  # noqa: E731
    print("layer | |k|^2 | post | pre | prev256 | post / pre")
    for i in range(cfg.num_hidden_layers):
        k = rope(pre[i])
        post = energy(k[:, far] - k[:, :256].mean(1, keepdim=True))
        centred = energy(rope(pre[i] - pre[i][:, :256].mean(1, keepdim=True))[:, far])
        local = energy(k[:, far] - k[:, 2744:3000].mean(1, keepdim=True))
        print(f"{i:2d} | {energy(k[:, far]):6.1f} | {post:6.1f} | {centred:6.1f} | {local:6.1f} | {post / centred:4.2f}")


if __name__ == "__main__":
    main()
