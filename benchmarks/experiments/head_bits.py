"""Per-(layer, kv head) key and value sensitivity of SmolLM2 on the synthetic copy sequence (the measurement
TQCache.calibrated makes), compared with the copy-task ranking on news text, and the key bits it
allocates (CPU).

  python3 benchmarks/experiments/head_bits.py
      -> benchmarks/results/head_sensitivity.json (KL of a head's keys at 3 / 4 bits, its values at 3,
         the layer's 8-bit floor)
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
    DEFAULTS, HEAD_WIDTHS, allocate_head_bits, head_kl, head_sensitivity)

COPY = ROOT / "benchmarks" / "results" / "copy_head_sensitivity.json"

torch.set_num_threads(2)
model_dir, _ = E.ensure_assets(Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata")))
tok, model = E.load_model(model_dir)
opts = {k: v for k, v in DEFAULTS.items() if k not in ("late_k_bits", "k_bits")}
saved = E.load_head_sensitivity()
if saved:
    kl = saved[1]
else:
    t0 = time.time()
    kl = head_sensitivity(model, key_bits=(3, 4), value_bits=(3,), **opts)
    E.HEAD_SENSITIVITY.write_text(json.dumps(dict(options=opts, seconds=round(time.time() - t0),
                                   kl={",".join(map(str, k)): v for k, v in sorted(kl.items())}), indent=1))
heads = sorted({k[:2] for k in kl})
for what, w in (("keys", (3, 8)), ("values", (8, 3))):
    gain = {hd: head_kl(kl, hd, *w) - head_kl(kl, hd, 8, 8) for hd in heads}
    rank = sorted(heads, key=lambda k: -gain[k])
    print(f"synthetic KL of a head's {what} at 3 bits:", [(f"{i},{h}", round(gain[(i, h)], 4)) for i, h in rank[:12]])
if COPY.exists():
    copy = json.loads(COPY.read_text())["delta"]
    crank = sorted(copy, key=lambda k: -copy[k])
    gain = {hd: head_kl(kl, hd, 3, 8) - head_kl(kl, hd, 8, 8) for hd in heads}
    top = {f"{i},{h}" for i, h in sorted(heads, key=lambda k: -gain[k])[:9]}
    print("news copy ranking (keys):", crank[:12], "; top-9 overlap:", sorted(top & set(crank[:9])))
for widths in (HEAD_WIDTHS, ((3, 3), (4, 3), (8, 3)), ((3, 3), (8, 3), (8, 8))):
    alloc = allocate_head_bits(kl, heads, 45, widths)
    print(widths, "->", {f"{i},{h}": w for (i, h), w in alloc.items() if w != (3, 3)})
