"""Where the default's copy-retrieval loss comes from: eval_quality.py's simulation with the keys or the
values of the quantized tokens left at full precision, or with 4-bit keys in every layer.
Usage: python3 benchmarks/experiments/copy_kv_split.py [CTX] [full,default,default+vfull,default+kfull,k4]
(CTX: the copy context, 4000 by default; 3 seeds x depths 10/50/90%; results in benchmarks/NOTES.md)."""
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

torch.set_num_threads(2)
model_dir, text = E.ensure_assets(Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata")))
tok, model = E.load_model(model_dir)
E.install_sim(model)
E.Sim.calib = 256
ids = tok(text.read_text(errors="replace"), return_tensors="pt").input_ids[0]
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
tasks = E.copy_tasks(ids, ctx, (0.1, 0.5, 0.9), range(3))
quantized_roundtrip = E.Sim.roundtrip


def roundtrip(key, value, cfg, calib, query=None):
    """The simulation's round trip, then the keys (kfull) or values (vfull) put back at full precision."""
    k_hat, v_hat, k16, v16 = quantized_roundtrip(key, value, cfg, calib, query)
    if cfg.get("kfull"):
        k_hat = key.float().clone()
    if cfg.get("vfull"):
        v_hat = value.float().clone()
    return k_hat, v_hat, k16, v16


E.Sim.roundtrip = staticmethod(roundtrip)
default = E.resolve(E.CONFIGS[E.DEFAULT], model)
names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["full", "default", "default+vfull", "default+kfull", "k4"]
for name in names:
    if name == "full":
        cfg = None
    elif name.startswith("k4"):  # 4-bit keys in every layer (4.25 bits/element at head_dim 64: over the budget)
        cfg = dict(default, k_layer_bits={i: 4 for i in range(model.config.num_hidden_layers)}, vfull="vfull" in name)
    else:
        cfg = dict(default, kfull="kfull" in name, vfull="vfull" in name)
    E.Sim.cfg = cfg
    t0 = time.time()
    accs = [E.copy_accuracy(model, seq) for seq in tasks]
    print(json.dumps(dict(name=name, ctx=ctx, copy=sum(accs) / len(accs), accs=[round(a, 3) for a in accs],
                          seconds=round(time.time() - t0, 1))), flush=True)
