"""dispatch: which kernel runs, as pure functions of the spec, the call and the device (CPU only: the
devices are described, not used). One row a line of the support matrix (docs/api.md, generated from
the same case table), and each reason the reference path is taken."""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attn_tq import dispatch
from flash_attn_tq.dispatch import Device, Plan, Query, WritePlan
from flash_attn_tq.kernel_cases import (
    FUSED_DECODE_BITS,
    FUSED_HEAD_DIMS,
    FUSED_PAIR_BITS,
    FUSED_RING_BITS,
    PREFILL_BITS,
    PREFILL_MIN_ROWS,
    WGMMA_MIN_ROWS,
)
from flash_attn_tq.spec import CacheSpec

H100 = Device("cuda", extension=True, prefill_smem=True, wgmma=True)
SM80 = Device("cuda", extension=True, prefill_smem=True, wgmma=False)
SMALL_SMEM = Device("cuda", extension=True, prefill_smem=False, wgmma=False)
CPU = Device("cpu", extension=True)
UNBUILT = Device("cuda", extension=False)
INV = tuple(1.0 / 10000.0 ** (i / 32) for i in range(0, 64, 2))  # head_dim 64's RoPE frequencies
DEFAULT = CacheSpec(sink_tokens=16, fp16_window=112, key_center="rope", rope_inv_freq=INV)


def q(rows_per_kv_head: int = 4, d: int = 64, dtype=torch.float16, kv_heads: int = 2, **flags) -> Query:
    """A call with ``rows_per_kv_head`` query rows a kv head (a GQA group of 4)."""
    return Query(max(1, rows_per_kv_head // 4), 4 * kv_heads, d, dtype, **flags)


@pytest.mark.parametrize("bits", FUSED_DECODE_BITS)
@pytest.mark.parametrize("d", FUSED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_fused_case_decodes(bits, d, dtype):
    spec = CacheSpec(k_bits=bits[0], v_bits=bits[1])
    assert dispatch.plan(spec, 2, q(4, d, dtype), H100) == Plan("decode")
    big = dispatch.plan(spec, 2, q(512, d, dtype), H100).kernel
    assert big == ("prefill-wgmma" if bits in PREFILL_BITS else "decode")
    assert dispatch.plan(spec, 2, q(PREFILL_MIN_ROWS, d, dtype), H100).kernel == (
        "prefill" if bits in PREFILL_BITS else "decode"
    )


@pytest.mark.parametrize(
    "rows,device,want",
    [
        (PREFILL_MIN_ROWS - 4, H100, "decode"),
        (PREFILL_MIN_ROWS, H100, "prefill"),
        (WGMMA_MIN_ROWS, H100, "prefill-wgmma"),
        (WGMMA_MIN_ROWS, SM80, "prefill"),
        (WGMMA_MIN_ROWS, SMALL_SMEM, "decode"),
    ],
)
def test_prefill_kernel_by_rows_and_device(rows, device, want):
    assert dispatch.plan(CacheSpec(), 2, q(rows), device).kernel == want


def test_the_rope_center_prefills_only_with_wgmma():
    assert dispatch.plan(DEFAULT, 2, q(WGMMA_MIN_ROWS), H100).kernel == "prefill-wgmma"
    assert dispatch.plan(DEFAULT, 2, q(WGMMA_MIN_ROWS), SM80).kernel == "decode"
    assert dispatch.plan(DEFAULT, 2, q(PREFILL_MIN_ROWS), H100).kernel == "decode"  # (below the wgmma rows)


@pytest.mark.parametrize("pair", FUSED_PAIR_BITS)
def test_pairs_of_head_groups(pair):
    (ka, va), (kb, vb) = pair
    a, b = DEFAULT.replace(k_bits=ka, v_bits=va), DEFAULT.replace(k_bits=kb, v_bits=vb)
    assert dispatch.plan(a, 2, q(4, kv_heads=3), H100, pair=(b, 1)) == Plan("pair")
    assert "beside" in dispatch.plan(b, 1, q(4, kv_heads=3), H100, pair=(a, 2)).reason  # the table's order
    assert dispatch.pair_order((a, b), (True, True)) == (0, 1)
    assert dispatch.pair_order((b, a), (True, True)) == (1, 0)
    assert dispatch.pair_order((a, b), (True, False)) is None  # the wide group's heads not a run
    big = dispatch.plan(a, 2, q(PREFILL_MIN_ROWS, kv_heads=3), H100, pair=(b, 1))
    assert "decode-sized" in big.reason
    assert (
        "differ in sink_tokens"
        in dispatch.plan(a, 2, q(4, kv_heads=3), H100, pair=(b.replace(sink_tokens=8), 1)).reason
    )
    plain = CacheSpec(k_bits=ka, v_bits=va), CacheSpec(k_bits=kb, v_bits=vb)
    assert "16-bit side" in dispatch.plan(plain[0], 2, q(4, kv_heads=3), H100, pair=(plain[1], 1)).reason
    center = DEFAULT.replace(key_center=True)
    reason = dispatch.plan(
        center.replace(k_bits=ka, v_bits=va), 2, q(4, kv_heads=3), H100, pair=(center.replace(k_bits=kb, v_bits=vb), 1)
    ).reason
    assert "post-RoPE" in reason


@pytest.mark.parametrize("bits", FUSED_RING_BITS)
def test_window_codes_in_the_launch_or_a_pass(bits):
    spec = CacheSpec(k_bits=bits[0], v_bits=bits[1], sink_tokens=16, fp16_window=128, window_bits=4)
    assert dispatch.plan(spec, 2, q(4), H100) == Plan("ring")
    assert dispatch.plan(spec, 2, q(PREFILL_MIN_ROWS), H100) == Plan("prefill", window_pass=True)
    for other in (spec.replace(window_bits=2), spec.replace(page_size=64), spec.replace(sink_tokens=0)):
        p = dispatch.plan(other, 2, q(4), H100)
        assert p.kernel == "decode" and p.window_pass, other


@pytest.mark.parametrize(
    "spec,query,device,reason",
    [
        (CacheSpec(), q(4), CPU, "not on a CUDA device"),
        (CacheSpec(), q(4), UNBUILT, "not built"),
        (CacheSpec(), q(4, dtype=torch.float32), H100, "dtype"),
        (CacheSpec(), q(4, d=96), H100, "head_dim 96"),
        (CacheSpec(k_bits=2, v_bits=2), q(4), H100, "K2V2"),
        (CacheSpec(grid="lloyd_max"), q(4), H100, "Lloyd-Max"),
        (CacheSpec(page_size=48), q(4), H100, "power of two"),
        (DEFAULT.replace(page_size=16), q(4), H100, "16-token pages"),
        (CacheSpec(), q(4, alibi=True), H100, "alibi_slopes"),
        (CacheSpec(sink_tokens=4), q(4, local=True), H100, "fp16 window or sink tokens"),
        (CacheSpec(fp16_window=8, window_bits=4), q(4, softcap=True), H100, "fp16 window or sink tokens"),
        (CacheSpec(key_center="rope", rope_inv_freq=INV), q(4, leftpad=True), H100, "key_center='rope'"),
        (CacheSpec(key_center=True), q(4, softcap=True), H100, "softcap with key centering"),
    ],
)
def test_reference_path_and_its_reason(spec, query, device, reason):
    plan = dispatch.plan(spec, 2, query, device)
    assert not plan.fused and reason in plan.reason and plan.path == f"quantized:reference ({plan.reason})"


def test_the_options_the_kernels_take():
    for flags in (dict(local=True), dict(softcap=True), dict(leftpad=True)):
        assert dispatch.plan(CacheSpec(), 2, q(4, **flags), H100) == Plan("decode")
    assert dispatch.plan(CacheSpec(key_center=True), 2, q(4), H100) == Plan("decode", lse_shift=True)
    assert dispatch.plan(CacheSpec(scale_only=False, fit="mean"), 2, q(4), H100).fused


@pytest.mark.parametrize(
    "spec,dtype,want",
    [
        (CacheSpec(), torch.float16, WritePlan(True)),
        (DEFAULT, torch.float16, WritePlan(True, side=True, rope=True)),
        (DEFAULT, torch.bfloat16, WritePlan(True, rope=True)),  # (the side in another dtype: PyTorch copies)
        (DEFAULT.replace(health=True), torch.float16, WritePlan(True)),  # (the counters read the centered keys)
        (
            CacheSpec(sink_tokens=16, fp16_window=128, window_bits=4),
            torch.float16,
            WritePlan(True, side=True, ring=True),
        ),
        (CacheSpec(fp16_window=128, window_bits=4, page_size=64), torch.float16, WritePlan(True)),
        (CacheSpec(quantizer="asym", streaming=True), torch.float16, WritePlan(False, reason="x")),
        (CacheSpec(fit="ls", scale_only=False), torch.float16, WritePlan(False, reason="x")),
        (CacheSpec(), torch.float32, WritePlan(False, reason="x")),
    ],
)
def test_write_plans(spec, dtype, want):
    got = dispatch.write_plan(spec, 64, dtype, H100)
    assert got.reason is not None if want.reason else got == want
    assert not dispatch.write_plan(spec, 64, dtype, CPU).kernel


def test_kv16():
    args = dict(kv_heads=2, kv_dtype=torch.float16, page_size=None, aligned=True, appends=False, device=H100)
    assert dispatch.plan_kv16(q(4), **args) == Plan("kv16") and Plan("kv16").path == "baseline:fused-kv16-cuda"
    assert not dispatch.plan_kv16(q(4), **dict(args, aligned=False)).fused
    assert not dispatch.plan_kv16(q(4), **dict(args, appends=True)).fused
    assert not dispatch.plan_kv16(q(4, local=True), **args).fused
    assert not dispatch.plan_kv16(q(dispatch.MAX_KV16_ROWS + 4), **args).fused
    assert not dispatch.plan_kv16(q(4), **dict(args, page_size=48)).fused
    assert not dispatch.plan_kv16(q(4), **dict(args, kv_dtype=torch.bfloat16)).fused
    assert not dispatch.plan_kv16(q(4), **dict(args, device=CPU)).fused


def test_support_matrix_rows_follow_the_case_table():
    rows = dispatch.support_matrix()
    assert [r["K/V bits"] for r in rows] == [f"K{k}V{v}" for k, v in FUSED_DECODE_BITS]
    for row, bits in zip(rows, FUSED_DECODE_BITS):
        assert (row["prefill kernel"] != "decode kernel") == (bits in PREFILL_BITS)
        assert (row["window codes in the launch"] != "–") == (bits in FUSED_RING_BITS)


def test_plans_are_memoized_per_call_shape():
    from flash_attn_tq import QuantizedKVCache

    cache = QuantizedKVCache(2, 64, 2, 64)
    a = cache.plan(Query(1, 8, 64, torch.float16))
    assert cache.plan(Query(1, 8, 64, torch.float16)) is a
    assert cache.plan(Query(3, 8, 64, torch.float16)) is not a


def test_specs_validate_each_field():
    for bad, field in [
        (dict(k_bits=5), "k_bits"),
        (dict(quantizer="x"), "quantizer"),
        (dict(grid="x"), "grid"),
        (dict(window_bits=4), "window_bits"),
        (dict(scale_only=True, quantizer="asym"), "scale_only"),
        (dict(key_center="x"), "key_center"),
        (dict(key_center="rope"), "rope_inv_freq"),
        (dict(rope_inv_freq=INV), "rope_inv_freq"),
        (dict(page_size=0), "page_size"),
        (dict(streaming=True), "streaming"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(alpha=2.0), "alpha"),
        (dict(k_bits=3.0), "k_bits"),
        (dict(nonsense=1), "nonsense"),
    ]:
        with pytest.raises((TypeError, ValueError), match=field):
            CacheSpec.of(**bad)
    spec = CacheSpec(quantizer="asym")
    assert spec.scale_only is False and CacheSpec().scale_only is True
    assert spec.replace(quantizer="turbo").scale_only is True  # (follows the options unless given)
    assert CacheSpec(**DEFAULT.options()) == DEFAULT and hash(DEFAULT) == hash(CacheSpec(**DEFAULT.options()))
    assert CacheSpec(grid="lloyd_max", streaming=False).research == ("grid",)
    with pytest.raises(ValueError, match="head_dim / 2 = 64"):
        DEFAULT.check_head_dim(128)


def test_cases_cover_the_product():
    """Every width pair of the pair and ring tables has a decode kernel."""
    for a, b in FUSED_PAIR_BITS:
        assert a in FUSED_DECODE_BITS and b in FUSED_DECODE_BITS
    assert set(FUSED_RING_BITS) <= set(PREFILL_BITS)
    assert list(itertools.chain(FUSED_HEAD_DIMS)) == [64, 128]


def test_the_wgmma_switch_is_read_where_the_prefill_kernel_can_run(monkeypatch):
    """FLASH_ATTN_TQ_PREFILL_WGMMA=0 turns the wgmma variant off for prefill-sized calls; a decode-sized
    call's plan key does not read the environment (it runs the decode kernel either way)."""
    monkeypatch.setenv("FLASH_ATTN_TQ_PREFILL_WGMMA", "0")
    assert dispatch.wgmma_switch_for(q(PREFILL_MIN_ROWS), 2) is False
    assert dispatch.wgmma_switch_for(q(PREFILL_MIN_ROWS - 4), 2) is True
    monkeypatch.setenv("FLASH_ATTN_TQ_PREFILL_WGMMA", "1")
    assert dispatch.wgmma_switch_for(q(PREFILL_MIN_ROWS), 2) is True
