"""BitDecoding's Hopper decode kernel beside ours and cuDNN, in one run.

    python benchmarks/bench_bitdecoding.py SRC CUTLASS_INCLUDE [--out DIR] [--quick]
    python benchmarks/bench_bitdecoding.py --render bitdecoding.json [--out DIR]   (the table again, no GPU)

BitDecoding (HPCA 2026; github.com/OpenBitSys/BitDecoding, formerly DD-DuDa/BitDecoding) publishes
speedups over FlashDecoding-v2; its ``hopper`` branch has a fused decode kernel for 4-bit K/V, head_dim
128, float16 (TMA loads in a producer warpgroup, wgmma, per-token scale and zero in float32 for
keys and values: "k-tensor" mode, group 128). SRC is that branch's ``hopper/src`` directory and
CUTLASS_INCLUDE the CUTLASS 3.8 headers it builds against (PyPI ``nvidia-cutlass==3.8.0.0``:
``cutlass_library/source/include``). Nothing of BitDecoding is in this repository: the script writes
a binding of its ``kvcache_qpack`` / ``mha_fwd_kvcache`` into a temporary directory, builds it with
torch's extension loader (sm_90a) and times, at the production shapes (heads 32/8, d 128, one query):

* BitDecoding's 4-bit call (its pack kernel fills the cache; its split heuristic, at least 2 splits),
* our plain K3V3 cache and a K4V3 one, ``flash_attn_with_kvcache``,
* cuDNN SDPA over the fp16 cache,

each replayed as a CUDA graph (eager where a capture fails), and the bytes each reads a step. A
sanity check first: BitDecoding's output against float32 attention over the unquantized K/V.
Writes ``bitdecoding.json`` / ``.md`` under ``--out``, with the run's stamp (GPU, torch, CUDA,
commit, the command); ``--render`` writes the table of such a JSON again (its stamp kept).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import flash_attn_tq as fa
from flash_attn_tq.testing import (
    bench,
    bench_graph,
    describe,
    fill_cache,
    made_by,
    rerendered,
    stamp,
    write_results,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

SHAPES = [(1, 131072), (8, 32768), (32, 8192), (64, 2048), (1, 4096), (8, 1024), (1, 1024)]  # (B, S)
HQ, HK, D = 32, 8, 128

BINDING = r"""
#include "flash_api.h"
#include <torch/extension.h>

// The 4-bit k-tensor layout of BitDecoding's own harness: codes [b, s, h_k, d / 4] uint16,
// per-token parameters [b, d / 128, h_k, s] float32.
void pack4(const at::Tensor &k, at::Tensor &k_pack, at::Tensor &k_params, const at::Tensor &v,
           at::Tensor &v_pack, at::Tensor &v_params, const at::Tensor &cu_seqlens_k, int64_t max_seqlen_k) {
    c10::optional<at::Tensor> no_table = c10::nullopt;
    kvcache_qpack<4>(k, k_pack, k_params, v, v_pack, v_params, no_table, cu_seqlens_k,
                     static_cast<int>(max_seqlen_k), "k-tensor", 128);
}

// k_shape / v_shape: host tensors of the fp16 cache's shape [b, s, h_k, d] (read for sizes and strides)
at::Tensor decode4(at::Tensor q, const at::Tensor &k_shape, const at::Tensor &k_pack, const at::Tensor &k_params,
                   const at::Tensor &v_shape, const at::Tensor &v_pack, const at::Tensor &v_params, double scale,
                   int64_t num_splits) {
    return mha_fwd_kvcache<4>(q, k_shape, k_pack, k_params, v_shape, v_pack, v_params, static_cast<float>(scale),
                              static_cast<int>(num_splits));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack4", &pack4);
    m.def("decode4", &decode4);
}
"""


def build(src: str, cutlass_include: str):
    """BitDecoding's kernels and the binding above as a torch extension module."""
    from torch.utils.cpp_extension import load

    work = tempfile.mkdtemp(prefix="bitdecoding_")
    binding = os.path.join(work, "binding.cu")
    with open(binding, "w") as f:
        f.write(BINDING)
    gen = os.path.join(src, "genfile")
    sources = [binding] + [
        os.path.join(gen, name)
        for name in (
            "flash_fwd_hdim128_fp16_split_sm90.cu",
            "flash_qpack_hdim128_fp16_sm80_4bit.cu",
            "flash_fwd_combine.cu",
        )
    ]
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # (wgmma and setmaxnreg need sm_90a)
    flags = ["-O3", "-std=c++17", "-maxrregcount=255", "-w", "--expt-relaxed-constexpr", "-DNDEBUG"]
    flags += ["-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"]
    # (torch's extension flags switch off cuda_fp16's operators, which CUTLASS uses)
    flags += [f"-U__CUDA_NO_{x}__" for x in ("HALF_OPERATORS", "HALF_CONVERSIONS", "HALF2_OPERATORS")]
    flags += ["-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    # ATen/cuda/CUDAContext.h (in its flash_api.h) includes cusparse.h: the pip CUDA libraries' headers
    # where the toolkit has none
    site = os.path.dirname(os.path.dirname(torch.__file__))
    libs = sorted({os.path.dirname(h) for h in glob.glob(os.path.join(site, "nvidia", "*", "include", "cusparse.h"))})
    return load(
        "bitdecoding_hopper",
        sources,
        extra_include_paths=[src, cutlass_include, *libs],
        extra_cuda_cflags=flags,
        build_directory=work,
        verbose=False,
    )


def bitdecoding_cache(ext, k: torch.Tensor, v: torch.Tensor):
    """BitDecoding's 4-bit cache of ``k, v [B, S, Hk, d]`` fp16, filled by its pack kernel."""
    B, S, Hk, d = k.shape
    dev = k.device
    packs = [torch.empty(B, S, Hk, d // 4, dtype=torch.uint16, device=dev) for _ in range(2)]
    params = [torch.empty(B, d // 128, Hk, S, dtype=torch.float32, device=dev) for _ in range(2)]
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
    ext.pack4(k.reshape(B * S, Hk, d), packs[0], params[0], v.reshape(B * S, Hk, d), packs[1], params[1], cu, S)
    # the fp16 cache's shape as its harness passes it: a host tensor read for sizes and strides only
    shape = torch.empty(B, S, Hk, d, dtype=torch.float16)
    return shape, packs, params


def sanity(ext) -> float:
    """Mean |BitDecoding - float32 attention over the unquantized K/V| at B=1, 1K tokens (its harness's case)."""
    torch.manual_seed(0)
    k = torch.randn(1, 1024, HK, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.rand(1, 1, HQ, D, device="cuda", dtype=torch.float16)
    shape, packs, params = bitdecoding_cache(ext, k, v)
    out = ext.decode4(q, shape, packs[0], params[0], shape, packs[1], params[1], D**-0.5, 0)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    return (out.float() - ref).abs().mean().item()


def timed(fn) -> tuple[float, str]:
    """(µs, how): the call replayed as a CUDA graph, else eager medians (do_bench)."""
    try:
        return bench_graph(fn), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return bench(fn), "eager"


def run_shape(ext, B: int, S: int) -> dict:
    plain, k, v = fill_cache(B, S, HK, D, torch.float16)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.float16)
    row = {"B": B, "S": S, "Hq": HQ, "Hk": HK, "d": D}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_us"] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    row["ours_k3v3_us"], _ = timed(lambda: fa.flash_attn_with_kvcache(q, plain))
    row["ours_k3v3_bytes"] = plain.nbytes
    shape, packs, params = bitdecoding_cache(ext, k, v)
    kt = vt = qt = None  # (not del: the lambda above names them)
    call = lambda: ext.decode4(q, shape, packs[0], params[0], shape, packs[1], params[1], D**-0.5, 0)  # noqa: E731
    row["bitdecoding_us"], row["bitdecoding_timing"] = timed(call)
    row["bitdecoding_bytes"] = sum(t.numel() * t.element_size() for t in packs + params)
    packs = params = plain = None  # (not del: the lambdas above name them)
    k4, _, _ = fill_cache(B, S, HK, D, torch.float16, k_bits=4, v_bits=3)
    row["ours_k4v3_us"], _ = timed(lambda: fa.flash_attn_with_kvcache(q, k4))
    add_ratios(row)
    k4 = k = v = None
    torch.cuda.empty_cache()
    return row


def add_ratios(row: dict) -> None:
    """Each kernel's speedup over cuDNN, and the cache bytes it read a call over its time (TB/s)."""
    for name in ("ours_k3v3", "bitdecoding", "ours_k4v3"):
        row[name + "_vs_cudnn"] = row["cudnn_us"] / row[name + "_us"]
    for name in ("ours_k3v3", "bitdecoding"):
        row[name + "_tb_s"] = row[name + "_bytes"] / row[name + "_us"] / 1e6


def markdown(rows: list[dict], meta: dict, err: float) -> str:
    """bitdecoding.md: the run's stamp, what was timed, a row a shape."""
    cells = []
    for r in rows:
        mark = "" if r["bitdecoding_timing"] == "graph" else " (eager)"
        us = [r["cudnn_us"], r["ours_k3v3_us"], r["ours_k4v3_us"]]
        cells.append(
            [r["B"], r["S"], *(f"{t:.1f}" for t in us), f"{r['bitdecoding_us']:.1f}{mark}"]
            + [f"{r[k]:.2f}x" for k in ("ours_k3v3_vs_cudnn", "bitdecoding_vs_cudnn")]
            + [f"{r[k]:.2f}" for k in ("ours_k3v3_tb_s", "bitdecoding_tb_s")]
        )
    head = ["B", "S", "cuDNN", "ours K3V3", "ours K4V3", "BitDecoding 4-bit", "ours K3V3 / cuDNN"]
    head += ["BitDecoding / cuDNN", "ours K3V3 TB/s", "BitDecoding TB/s"]
    table = ["| " + " | ".join(map(str, c)) + " |" for c in [head, ["---"] * len(head), *cells]]
    about = (
        "Heads 32/8, d 128, fp16, one query, µs (CUDA-graph medians; cuDNN over the fp16 cache, do_bench). "
        "BitDecoding: its `hopper` branch, k-tensor mode, group 128 (per-token float32 parameters), its "
        "own split heuristic; TB/s: the cache's bytes over the time. Its output against float32 attention "
        f"over the unquantized K/V (B=1, 1K tokens): mean |error| {err:.4f}."
    )
    title = f"# BitDecoding (Hopper, 4-bit K/V) beside ours ({describe(meta)})"
    return "\n".join([title, "", made_by(meta), "", about, "", *table]) + "\n"


def write(rows: list[dict], meta: dict, err: float, out_dir: str) -> None:
    """bitdecoding.json (meta, the sanity error, the rows) and bitdecoding.md under out_dir."""
    payload = {"meta": meta, "sanity_mean_abs_err": err, "rows": rows}
    write_results(out_dir, "bitdecoding", payload, markdown(rows, meta, err))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="?", help="BitDecoding's hopper/src directory")
    ap.add_argument("cutlass_include", nargs="?", help="CUTLASS 3.8's include directory")
    ap.add_argument("--out", default=RESULTS, help="output directory (default benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="two shapes")
    ap.add_argument(
        "--render", type=Path, help="no run: bitdecoding.json / .md under --out again from this bitdecoding.json"
    )
    args = ap.parse_args()
    if args.render:
        res = json.loads(args.render.read_text())
        rows = res["rows"]
        for row in rows:
            add_ratios(row)
        write(rows, rerendered(res["meta"]), res["sanity_mean_abs_err"], args.out)
        return
    if not args.src or not args.cutlass_include:
        ap.error("SRC and CUTLASS_INCLUDE are required (or --render JSON)")
    if not torch.cuda.is_available():
        sys.exit("bench_bitdecoding needs a CUDA GPU")
    meta = stamp()
    ext = build(args.src, args.cutlass_include)
    err = sanity(ext)
    print(f"BitDecoding sanity (B=1, 1K): mean |error| {err:.4f}", flush=True)
    rows = []
    for B, S in SHAPES[:2] if args.quick else SHAPES:
        rows.append(run_shape(ext, B, S))
        print(rows[-1], flush=True)
    write(rows, meta, err, args.out)


if __name__ == "__main__":
    main()
