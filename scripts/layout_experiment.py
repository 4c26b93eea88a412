"""Does the decode kernel read packed K/V faster head-major ([batch, kv_heads, seq, bytes]: a head's
tokens contiguous) than token-major ([batch, seq, kv_heads, bytes], the cache's layout)?

    python -m scripts.layout_experiment

The kernel takes strides, so the same codes are copied into a head-major buffer viewed as
[batch, seq, kv_heads, bytes]; outputs must match bit for bit. Times are CUDA-graph medians.
"""

from __future__ import annotations

import argparse

import torch

from flash_attn_tq.cache import QuantizedKVCache
from flash_attn_tq.testing import bench_graph as graph_us


def head_major(t: torch.Tensor) -> torch.Tensor:
    b, s, h, n = t.shape
    out = torch.empty(b, h, s, n, dtype=t.dtype, device=t.device).permute(0, 2, 1, 3)
    out.copy_(t)
    return out


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layout_experiment needs a CUDA GPU and the built extension")
    for B, S in ((1, 131072), (8, 32768), (32, 8192), (1, 16384), (8, 4096)):
        cache = QuantizedKVCache(B, S, 8, 128, device="cuda")
        cache.append(
            torch.randn(B, S, 8, 128, device="cuda", dtype=torch.float16),
            torch.randn(B, S, 8, 128, device="cuda", dtype=torch.float16),
        )
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.float16)
        fn_tok = lambda: cache.attend(q, cache.seqlens, None, 0.088, False, 0)  # noqa: E731
        ref = fn_tok()[0]
        t_tok = graph_us(fn_tok)
        for name in ("k_codes", "v_codes", "k_meta", "v_meta"):
            setattr(cache, name, head_major(getattr(cache, name)))
        out = fn_tok()[0]
        same = torch.equal(out, ref)
        t_head = graph_us(fn_tok)
        print(
            f"B={B} S={S}: token-major {t_tok:.1f} us, head-major {t_head:.1f} us "
            f"({t_tok / t_head:.2f}x), identical output: {same}",
            flush=True,
        )
        cache = None  # (not del: lambdas above name them)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
