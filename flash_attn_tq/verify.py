"""Verify the quantized attention on your shapes: ``python -m flash_attn_tq.verify``.

Builds a :class:`~flash_attn_tq.QuantizedKVCache` with the given options (on the GPU when there is
one), appends K/V (Gaussian, or captured from a model with ``--qkv file.pt``, see :func:`save_qkv`)
and checks

* attention: :func:`flash_attn_tq.flash_attn_with_kvcache` (``causal=True``) against float32
  attention over ``cache.dequantize()``; the bound is 4x the error of the same float32 attention
  with its inputs and output rounded to the cache dtype, plus a small absolute term;
* the codec: pack/unpack round trip on random codes, bits per element against
  :func:`flash_attn_tq.format.bits_per_element`, and the quantization error (relative MSE of the
  coded K and V): judged on the default Gaussian data (bound: 1.5x its typical value there), and
  reported without a verdict for ``--qkv`` data, which has no typical value.

Prints a verdict table (``--json``: a JSON object) and exits 1 if a check fails.

``--quick`` is the install check: the codec against the published Gaussian errors, then the checks
above over four caches (plain decode, a chunk of queries, keys centered before RoPE, TQCache's
default spec), and a decode timing beside fp16 attention over the same K/V.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

import flash_attn_tq as fa
from flash_attn_tq import baseline
from flash_attn_tq import format as fmt
from flash_attn_tq.keys import rope_turn
from flash_attn_tq.quantizers import grid_mse
from flash_attn_tq.spec import CacheSpec

ROUNDING_FACTOR = 4.0  # the attention error may be this many times the 16-bit rounding error ...
OUT_ATOL = 1e-4  # ... plus this (relative output error)
LSE_ATOL = 1e-3  # ... or this (softmax_lse, absolute)
MSE_MARGIN = 1.5  # the quantization error may be this many times its typical value on Gaussian data


@dataclass
class Check:
    """One row of the verdict table; ``ok`` None: reported, not judged."""

    check: str
    value: float
    bound: float | None
    ok: bool | None

    @property
    def verdict(self) -> str:
        return "INFO" if self.ok is None else "PASS" if self.ok else "FAIL"


def _judged(check: str, value: float, bound: float, exact: bool = False) -> Check:
    """A check that passes when ``value <= bound`` (``exact``: ``value == bound``); NaN fails."""
    return Check(check, value, bound, bool(value == bound) if exact else bool(value <= bound))


# ----------------------------------------------------------------------------- inputs


def save_qkv(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Save ``q [batch, seqlen_q, q_heads, d]`` and ``k, v [batch, seqlen, kv_heads, d]`` (e.g. one
    layer's, captured in a model's attention after RoPE) for ``--qkv path``."""
    torch.save({"q": q.detach().cpu(), "k": k.detach().cpu(), "v": v.detach().cpu()}, path)


def load_qkv(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` from a file holding a dict with keys q, k, v or a (q, k, v) tuple; shapes checked."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    q, k, v = (obj["q"], obj["k"], obj["v"]) if isinstance(obj, dict) else obj
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"{path}: need q [B, Sq, Hq, D] and k, v [B, S, Hkv, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{path}: q {tuple(q.shape)} does not match k {tuple(k.shape)} (batch, head_dim, "
            f"q heads a multiple of kv heads)"
        )
    return q, k, v


def default_rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Llama's RoPE frequencies ``1 / theta ** (2 i / head_dim)``, float32 ``[head_dim / 2]``."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


def synthetic_qkv(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gaussian float32 ``q [B, Sq, Hq, D]``, ``k, v [B, S, Hkv, D]`` (CPU, seeded). With key centering
    the keys get a common part per (sequence, head) for it to remove, turned by RoPE for ``rope``."""
    gen = torch.Generator().manual_seed(args.seed)
    B, S, D = args.batch, args.seqlen, args.head_dim
    q = torch.randn(B, args.seqlen_q, args.q_heads, D, generator=gen)
    k = torch.randn(B, S, args.kv_heads, D, generator=gen)
    v = torch.randn(B, S, args.kv_heads, D, generator=gen)
    if args.key_center != "none":
        k = k + torch.randn(B, 1, args.kv_heads, D, generator=gen)
    if args.key_center == "rope":
        k = rope_turn(k, torch.arange(S), default_rope_inv_freq(D, args.rope_theta))
    return q, k, v


def spec_of(args: argparse.Namespace, head_dim: int) -> CacheSpec:
    """The command line's cache options as a :class:`CacheSpec`."""
    opts: dict[str, Any] = dict(
        k_bits=args.k_bits,
        v_bits=args.v_bits,
        quantizer=args.quantizer,
        fp16_window=args.fp16_window,
        sink_tokens=args.sink_tokens,
        page_size=args.page_size,
        dtype=getattr(torch, args.dtype),
    )
    if args.key_center != "none":
        opts["key_center"] = "rope" if args.key_center == "rope" else True
    if args.key_center == "rope":
        opts["rope_inv_freq"] = default_rope_inv_freq(head_dim, args.rope_theta)
    return CacheSpec(**opts)


def build_cache(
    spec: CacheSpec, batch: int, seqlen: int, kv_heads: int, head_dim: int, device: torch.device, seed: int = 0
) -> fa.QuantizedKVCache:
    """An empty cache of ``seqlen`` tokens of ``spec``; a paged one gets a shuffled block table (so pages
    are not in order)."""
    block_table = None
    if spec.page_size is not None:
        per_seq = math.ceil(seqlen / spec.page_size)
        perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
        block_table = perm.reshape(batch, per_seq).to(torch.int32)
    return fa.QuantizedKVCache(batch, seqlen, kv_heads, head_dim, spec=spec, block_table=block_table, device=device)


# ----------------------------------------------------------------------------- checks


def typical_rel_mse(quantizer: str, bits: int, head_dim: int) -> float:
    """Typical relative MSE of the codec on N(0, 1) vectors: turbo, the grid's per-coordinate MSE
    (the rotation makes coordinates Gaussian); asym, ``step ** 2 / 12`` with the step spanning the
    expected range of ``head_dim`` Gaussians (2 x Blom's estimate of their maximum)."""
    if quantizer == "turbo":
        return grid_mse(bits)
    top = statistics.NormalDist().inv_cdf((head_dim - 0.375) / (head_dim + 0.25))
    return (2 * top / (2**bits - 1)) ** 2 / 12


def check_codec(cache: fa.QuantizedKVCache, k: torch.Tensor, v: torch.Tensor, judge_error: bool) -> list[Check]:
    """Round trip of random codes, bits per element, and the relative MSE of the coded K/V against
    ``k, v [B, S, Hkv, D]`` (positions outside the sinks and the 16-bit window: those are not coded)."""
    checks = []
    gen = torch.Generator().manual_seed(1)
    for bits in sorted({cache.k_bits, cache.v_bits}):
        codes = torch.randint(0, 2**bits, (64, cache.head_dim), generator=gen).to(cache.device)
        back = fa.unpack_codes(fa.pack_codes(codes, bits), bits, cache.head_dim)
        checks.append(_judged(f"{bits}-bit pack/unpack mismatches", float((back != codes).sum()), 0.0, exact=True))
    meta_bytes = 2 if cache.scale_only else 4
    expected = (
        fmt.bits_per_element(cache.head_dim, cache.k_bits, meta_bytes)
        + fmt.bits_per_element(cache.head_dim, cache.v_bits, meta_bytes)
    ) / 2
    stored = sum(t.shape[-1] * t.element_size() for t in (cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta))
    measured = stored * 8 / (2 * cache.head_dim)  # from the tensors' shapes: codes + meta, K and V
    bpe = cache.bits_per_element()
    checks.append(Check("bits/element", bpe, expected, bpe == expected == measured))
    S = k.shape[1]
    coded = slice(cache.sink_tokens, S - cache.side_recent)
    kd, vd = cache.dequantize()
    for name, x, xd, bits in (("K", k, kd, cache.k_bits), ("V", v, vd, cache.v_bits)):
        x, xd = x[:, coded].float().to(xd.device), xd[:, coded]
        if x.shape[1] == 0:
            continue
        rel = (((xd - x) ** 2).sum() / (x**2).sum().clamp(min=1e-30)).item()
        bound = MSE_MARGIN * typical_rel_mse(cache.quantizer, bits, cache.head_dim)
        name = f"{name} relative MSE ({bits}-bit {cache.quantizer})"
        checks.append(_judged(name, rel, bound) if judge_error else Check(name, rel, None, None))
    return checks


def _worst_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error over (sequence, head) of ``[B, Sq, H, D]`` outputs."""
    err = (out.float() - ref).norm(dim=(1, 3))
    scale = ref.norm(dim=(1, 3)).clamp(min=1e-6 * ref.norm().item() / math.sqrt(err.numel()) + 1e-30)
    return (err / scale).max().item()


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference of two ``softmax_lse [B, H, Sq]`` (equal infinities agree)."""
    diff = torch.where(lse == ref, torch.zeros_like(ref), (lse.float() - ref).abs())
    return diff.max().item()


def check_attention(
    cache: fa.QuantizedKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[list[Check], str]:
    """``flash_attn_with_kvcache(q [B, Sq, Hq, D], cache, causal=True)`` against float32 attention over
    the dequantized cache; the output error against full-precision ``k, v`` is reported. Returns the
    checks and :func:`flash_attn_tq.last_path`."""
    out, lse = fa.flash_attn_with_kvcache(q, cache, causal=True, return_softmax_lse=True)
    path = fa.last_path()
    kd, vd = cache.dequantize()
    lens = cache.seqlens
    ref, ref_lse = baseline.attention_reference(q.float(), kd, vd, causal=True, key_lengths=lens)
    rounded = [x.to(cache.dtype).float() for x in (kd, vd)]  # the same attention at 16-bit precision
    r16, r16_lse = baseline.attention_reference(q.float(), *rounded, causal=True, key_lengths=lens)
    out_bound = ROUNDING_FACTOR * _worst_rel_err(r16.to(cache.dtype), ref) + OUT_ATOL
    lse_bound = ROUNDING_FACTOR * _lse_err(r16_lse, ref_lse) + LSE_ATOL
    full, _ = baseline.attention_reference(q.float(), k.float().to(q.device), v.float().to(q.device), causal=True)
    return [
        _judged("attention output rel. error", _worst_rel_err(out, ref), out_bound),
        _judged("attention softmax_lse abs. error", _lse_err(lse, ref_lse), lse_bound),
        Check("output rel. error vs unquantized K/V", _worst_rel_err(out, full), None, None),
    ], path


# ----------------------------------------------------------------------------- driver


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m flash_attn_tq.verify", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=1024, help="keys per sequence (the cache's length)")
    ap.add_argument("--seqlen-q", type=int, default=1, help="queries per sequence (1: decode; more: chunked prefill)")
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--k-bits", type=int, default=3)
    ap.add_argument("--v-bits", type=int, default=3)
    ap.add_argument("--quantizer", choices=("turbo", "asym"), default="turbo")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument(
        "--page-size",
        type=lambda s: None if s.lower() == "none" else int(s),
        default=None,
        help="tokens a page (paged cache), or none (contiguous)",
    )
    ap.add_argument("--sink-tokens", type=int, default=0)
    ap.add_argument("--fp16-window", type=int, default=0)
    ap.add_argument("--key-center", choices=("none", "mean", "rope"), default="none")
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base for --key-center rope")
    ap.add_argument("--qkv", help="a file from save_qkv (q, k, v): use them instead of Gaussian data")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda where a CUDA device is visible, else cpu)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--quick", action="store_true", help="the install check over a few fixed caches (no other options)")
    return ap, ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the cache, append K/V, run every check; a JSON-ready dict (``passed``: no check failed)."""
    q, k, v = load_qkv(args.qkv) if args.qkv else synthetic_qkv(args)
    B, S, Hkv, D = k.shape
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cache = build_cache(spec_of(args, D), B, S, Hkv, D, device, args.seed)
    cache.append(k.to(device, dtype), v.to(device, dtype))
    checks = check_codec(cache, k, v, judge_error=not args.qkv)
    attn, path = check_attention(cache, q.to(device, dtype), k, v)
    checks = attn + checks
    return {
        "config": {
            "batch": B,
            "seqlen": S,
            "seqlen_q": q.shape[1],
            "q_heads": q.shape[2],
            "kv_heads": Hkv,
            "head_dim": D,
            "k_bits": args.k_bits,
            "v_bits": args.v_bits,
            "quantizer": args.quantizer,
            "dtype": args.dtype,
            "page_size": args.page_size,
            "sink_tokens": args.sink_tokens,
            "fp16_window": args.fp16_window,
            "key_center": args.key_center,
            "data": args.qkv or "gaussian",
        },
        "device": str(device),
        "path": path,
        "bits_per_element": cache.bits_per_element(),
        "checks": [dict(asdict(c), value=_json_number(c.value), verdict=c.verdict) for c in checks],
        "passed": all(c.ok is not False for c in checks),
    }


def _json_number(x: float) -> float | str:
    """``x``, or ``"nan"`` / ``"inf"`` (strict JSON has no non-finite numbers)."""
    return x if math.isfinite(x) else str(x)


def format_table(result: dict[str, Any]) -> str:
    """The verdict table of :func:`run`'s result, with a header line and the attention path."""
    c = result["config"]
    layout = "contiguous" if c["page_size"] is None else f"pages of {c['page_size']}"
    head = (
        f"flash_attn_tq {fa.__version__} on {result['device']}: B={c['batch']} S={c['seqlen']} "
        f"Sq={c['seqlen_q']} heads {c['q_heads']}/{c['kv_heads']} d={c['head_dim']} K{c['k_bits']}V{c['v_bits']} "
        f"{c['quantizer']} {c['dtype']} {layout} sinks={c['sink_tokens']} window={c['fp16_window']} "
        f"key_center={c['key_center']} data={c['data']}"
    )
    rows = [("check", "value", "bound", "verdict")]
    for r in result["checks"]:
        value, bound = r["value"], r["bound"]
        rows.append(
            (
                r["check"],
                value if isinstance(value, str) else f"{value:.4g}",
                "-" if bound is None else f"{bound:.4g}",
                r["verdict"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [head] + ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"path: {result['path']}")
    lines.append("all checks passed" if result["passed"] else "SOME CHECKS FAILED")
    return "\n".join(lines)


def device_problem(spec: str) -> str | None:
    """Why ``--device spec`` cannot run here (a usage error), or None."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        return f"--device {spec!r} is not a device torch knows (e.g. cpu, cuda, cuda:1)"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"--device {spec}: no CUDA device is visible on this machine (use --device cpu)"
        if device.index is not None and device.index >= count:
            return f"--device {spec}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})"
    return None


CUDA_REPS = 50  # timed calls a measurement on the GPU without triton
PUBLISHED_REL_MSE = {"uniform": 0.0375, "lloyd_max": 0.0345}  # 3-bit turbo on Gaussian data, head_dim 128


def decode_timer(cuda: bool, reps: int):
    """``(time_us, label)``: ``time_us(fn)`` times ``fn`` in microseconds and ``label`` says what that
    number is. On the GPU: the median of triton's ``do_bench`` (``pip install "flash_attn_tq[bench]"``),
    or without triton the median of CUDA-event-timed calls. On the CPU: the mean of ``reps`` calls
    after one warm-up call."""
    if cuda:
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return (lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3), "GPU median, do_bench"

        def events_us(fn) -> float:
            for _ in range(3):
                fn()
            times = []
            for _ in range(CUDA_REPS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            return sorted(times)[len(times) // 2]

        return events_us, f"GPU median of {CUDA_REPS} calls, CUDA events (triton not installed)"

    def mean_us(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6

    return mean_us, f"CPU mean of {reps} calls after one warm-up"


def quick(device: str, as_json: bool) -> int:
    """The install check (``--quick``): see the module docstring. 0 if every check passed."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 128, generator=gen)
    codec = []
    for grid, published in PUBLISHED_REL_MSE.items():
        qz = fa.TurboQuantizer(128, 3, grid)
        rel = (((qz.dequantize(*qz.quantize(x)) - x) ** 2).sum() / (x**2).sum()).item()
        codec.append(
            Check(
                f"turbo 3-bit {grid} rel. MSE (published {published})",
                rel,
                published + 0.004,
                abs(rel - published) < 0.004,
            )
        )
    shape = (
        dict(batch=4, seqlen=4099, q_heads=32, kv_heads=8) if gpu else dict(batch=2, seqlen=515, q_heads=8, kv_heads=2)
    )
    base = dict(
        head_dim=128,
        seqlen_q=1,
        k_bits=3,
        v_bits=3,
        quantizer="turbo",
        dtype="float16",
        page_size=None,
        sink_tokens=0,
        fp16_window=0,
        key_center="none",
        rope_theta=10000.0,
        qkv=None,
        device=device,
        seed=0,
    )
    cases = {
        "decode": {},
        "chunk of queries": dict(seqlen_q=64 if gpu else 16),
        "keys centered before RoPE": dict(key_center="rope"),
        "TQCache's default": dict(key_center="rope", sink_tokens=16, fp16_window=112, verify_tokens=16),
    }
    results = {name: run(argparse.Namespace(**{**base, **shape, **extra})) for name, extra in cases.items()}
    time_us, how = decode_timer(gpu, reps=3)
    args = argparse.Namespace(**{**base, **shape})
    q, k, v = (t.to(dev, torch.float16) for t in synthetic_qkv(args))
    cache = build_cache(spec_of(args, 128), *k.shape, dev)
    cache.append(k, v)
    t_ours = time_us(lambda: fa.flash_attn_with_kvcache(q, cache))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    t_fp16 = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    timing = dict(how=how, quantized_us=t_ours, fp16_sdpa_us=t_fp16, shape=shape)
    passed = all(c.ok for c in codec) and all(r["passed"] for r in results.values())
    if as_json:
        codec_rows = [dict(asdict(c), verdict=c.verdict) for c in codec]
        print(json.dumps(dict(codec=codec_rows, cases=results, timing=timing, passed=passed), indent=2))
        return 0 if passed else 1
    print(
        f"flash_attn_tq {fa.__version__} | torch {torch.__version__} | device {dev}"
        f"{' (' + torch.cuda.get_device_name(dev) + ')' if gpu else ''}"
    )
    for c in codec:
        print(f"  [{c.verdict}] {c.check}: {c.value:.4f}")
    for name, r in results.items():
        worst = next(c for c in r["checks"] if c["check"].startswith("attention output"))
        print(f"  [{'PASS' if r['passed'] else 'FAIL'}] {name}: {r['path']}, output rel. error {worst['value']:.2e}")
    print(
        f"  decode ({how}): 3-bit cache {t_ours:.1f} us, fp16 SDPA over the same K/V {t_fp16:.1f} us "
        f"(B={shape['batch']}, S={shape['seqlen']}, heads {shape['q_heads']}/{shape['kv_heads']}, d=128; eager calls)"
    )
    if not gpu:
        print("  (the CPU reference path is for correctness, not speed)")
    print("all checks passed" if passed else "SOME CHECKS FAILED")
    return 0 if passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks and print the table (or JSON); 0 if every check passed, 1 otherwise."""
    ap, args = parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        ap.error(problem)
    if args.quick:
        return quick(args.device, args.json)
    if min(args.batch, args.seqlen, args.q_heads, args.kv_heads, args.head_dim) < 1:
        ap.error("--batch, --seqlen, --q-heads, --kv-heads and --head-dim must be positive")
    if not args.qkv and not 1 <= args.seqlen_q <= args.seqlen:
        ap.error(f"--seqlen-q must lie in [1, --seqlen={args.seqlen}]")
    if not args.qkv and args.q_heads % args.kv_heads:
        ap.error(f"--q-heads={args.q_heads} must be a multiple of --kv-heads={args.kv_heads}")
    try:
        result = run(args)
    except ValueError as e:  # bad shapes or options: the cache and the loader say which
        ap.error(str(e))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
