"""Per-(layer, kv head) key sensitivity for copy retrieval, then 16-bit keys for the most sensitive heads
(eval_quality.py's simulation, CPU).

  python3 benchmarks/experiments/copy_head_keys.py sens
      NLL of two 1K copy tasks (news text, seeds 100-101: spans the evaluation does not use) with only
      one kv head's keys quantized (3-bit turbo, key centring, scale-only), a forward a head;
      -> benchmarks/results/copy_head_sensitivity.json
  python3 benchmarks/experiments/copy_head_keys.py eval N 4000,1000
      copy accuracy (3 seeds x depths 10/50/90%) of turbo3+kc+sink4+w124 (scale-only) with the N most
      sensitive heads' keys kept at 16 bits (KEY_BITS=8: 8-bit codes; VALUE_BITS=8/16: their values too)

Results in benchmarks/NOTES.md (session 9)."""
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import eval_quality as E  # noqa: E402

SENSITIVITY = ROOT / "benchmarks" / "results" / "copy_head_sensitivity.json"
SPAN = 64

torch.set_num_threads(2)
model_dir, text = E.ensure_assets(Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata")))
tok, model = E.load_model(model_dir)
ids = tok(text.read_text(errors="replace"), return_tensors="pt").input_ids[0]
num_layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
# the layer being attended, the only quantized (layer, head) in the sensitivity pass, 16-bit key heads
state = dict(layer=None, only=None, full_key_heads=set(), key_bits=16, value_bits=None)
sim_attention, sim_roundtrip = E.Sim.attention, E.Sim.roundtrip


def attention(module, *args, **kwargs):
    state["layer"] = module.layer_idx
    return sim_attention(module, *args, **kwargs)


def roundtrip(key, value, cfg, calib, query=None):
    k_hat, v_hat, k16, v16 = sim_roundtrip(key, value, cfg, calib, query)
    layer = state["layer"]
    if state["only"] is not None:  # everything at full precision but the keys of one (layer, head)
        quantized = k_hat
        k_hat, v_hat = key.float().clone(), value.float().clone()
        if state["only"][0] == layer:
            k_hat[:, state["only"][1]] = quantized[:, state["only"][1]]
    heads = [h for full_layer, h in state["full_key_heads"] if full_layer == layer]
    if heads and (state["key_bits"] != 16 or state["value_bits"]):
        hi = dict(cfg, k_bits=min(state["key_bits"], 8), v_bits=state["value_bits"] or cfg["v_bits"])
        k8, v8 = sim_roundtrip(key, value, hi, calib, query)[:2]
    for head in heads:
        k_hat[:, head] = key.float()[:, head] if state["key_bits"] == 16 else k8[:, head]
        if state["value_bits"]:
            v_hat[:, head] = value.float()[:, head] if state["value_bits"] == 16 else v8[:, head]
    return k_hat, v_hat, k16, v16


E.Sim.attention = staticmethod(attention)
E.Sim.roundtrip = staticmethod(roundtrip)
E.install_sim(model)
E.Sim.calib = 256
E.Sim.cfg = dict(E.CONFIGS["turbo3+kc+sink4+w124"], scale_only=True)

if sys.argv[1] == "sens":
    tasks = E.copy_tasks(ids, 1000, (0.3,), range(100, 102))

    def repeat_nll():
        total = 0.0
        for seq in tasks:
            lp = E.log_probs(model, seq)
            n = len(seq)
            total -= lp[n - SPAN + 7: n - 1].gather(1, seq[n - SPAN + 8:, None]).sum().item()
        return total

    state["only"] = (-1, -1)
    base = repeat_nll()
    delta = {}
    t0 = time.time()
    for layer in range(num_layers):
        for head in range(kv_heads):
            state["only"] = (layer, head)
            delta[f"{layer},{head}"] = repeat_nll() - base
        print(layer, [round(delta[f"{layer},{h}"], 3) for h in range(kv_heads)], round(time.time() - t0), flush=True)
    SENSITIVITY.write_text(json.dumps(dict(base=base, delta=delta)))
else:
    delta = json.loads(SENSITIVITY.read_text())["delta"]
    top = int(sys.argv[2])
    heads = sorted(delta, key=lambda k: -delta[k])[:top]
    state["full_key_heads"] = {tuple(int(x) for x in k.split(",")) for k in heads}
    state["key_bits"] = int(os.environ.get("KEY_BITS", 16))
    state["value_bits"] = int(os.environ.get("VALUE_BITS", 0)) or None
    print(f"{state['key_bits']}-bit keys, values {state['value_bits']} in", heads, flush=True)
    for ctx in (int(c) for c in sys.argv[3].split(",")):
        tasks = E.copy_tasks(ids, ctx, (0.1, 0.5, 0.9), range(3))
        t0 = time.time()
        accs = [E.copy_accuracy(model, seq) for seq in tasks]
        print(json.dumps(dict(top=top, ctx=ctx, copy=sum(accs) / len(accs), accs=[round(a, 3) for a in accs],
                              seconds=round(time.time() - t0))), flush=True)
