"""Per-(layer, kv head) key sensitivity of SmolLM2 on the synthetic copy sequence (the measurement
TQCache.calibrated makes), compared with the copy-task ranking on news text, and the key bits it
allocates (CPU).

  python3 benchmarks/experiments/head_bits.py
      -> benchmarks/results/head_key_sensitivity.json (KL a head at 3 / 4 bits, the layer's 8-bit floor)
"""
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
from flash_attn_tq.integrations.transformers import (  # noqa: E402
    DEFAULTS, allocate_head_bits, head_key_sensitivity)

OUT = ROOT / "benchmarks" / "results" / "head_key_sensitivity.json"
COPY = ROOT / "benchmarks" / "results" / "copy_head_sensitivity.json"

torch.set_num_threads(2)
model_dir, _ = E.ensure_assets(Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata")))
tok, model = E.load_model(model_dir)
opts = {k: v for k, v in DEFAULTS.items() if k not in ("late_k_bits", "k_bits")}
if OUT.exists():
    kl = {tuple(int(x) for x in k.split(",")): v for k, v in json.loads(OUT.read_text())["kl"].items()}
else:
    t0 = time.time()
    kl = head_key_sensitivity(model, bits=(3, 4), **opts)
    OUT.write_text(json.dumps(dict(options=opts, seconds=round(time.time() - t0),
                                   kl={f"{i},{h},{b}": v for (i, h, b), v in sorted(kl.items())}), indent=1))
heads = sorted({(i, h) for i, h, _ in kl})
gain8 = {k: kl[(*k, 3)] - kl[(*k, 8)] for k in heads}
rank = sorted(heads, key=lambda k: -gain8[k])
print("synthetic KL ranking (3-bit minus 8-bit):", [(f"{i},{h}", round(gain8[(i, h)], 4)) for i, h in rank[:12]])
if COPY.exists():
    copy = json.loads(COPY.read_text())["delta"]
    crank = sorted(copy, key=lambda k: -copy[k])
    print("news copy ranking:", crank[:12])
    top = {f"{i},{h}" for i, h in rank[:9]}
    print("overlap of the top 9:", len(top & set(crank[:9])), sorted(top & set(crank[:9])))
for bits in ((3, 4, 8), (3, 8), (3, 4)):
    sub = {k: v for k, v in kl.items() if k[2] in bits}
    alloc = allocate_head_bits(sub, heads, 45)
    raised = {f"{i},{h}": b for (i, h), b in alloc.items() if b != 3}
    print(bits, "->", raised)
