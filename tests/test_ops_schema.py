"""The Python side of the fused path against the ops' C++ schemas, on the CPU: the schemas are read
from csrc/flash_attn/flash_api_tq.cpp and registered here (or taken from the built extension) with
recording CPU implementations, so a call through QuantizedKVCache checks that every tensor and option lands
in its argument of the kernel, and a transformers decode step over TQCache traces whole under
``torch.compile`` (one graph for every step: what ``generate`` compiles)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from flash_attn_tq import dispatch, ops
from flash_attn_tq.cache import QuantizedKVCache

API = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "flash_attn" / "flash_api_tq.cpp"


def _schemas() -> dict[str, str]:
    """op name -> schema, from the m.def("...") calls (adjacent C++ string literals joined)."""
    src = API.read_text()
    out = {}
    for call in re.findall(r'm\.def\(((?:\s*"[^"]*")+)\s*(?:,[^)]*)?\)', src):
        schema = "".join(re.findall(r'"([^"]*)"', call))
        out[schema.split("(", 1)[0]] = schema
    return out


@pytest.fixture(scope="module")
def recorded():
    calls = {}
    if ops.extension_available():  # the built ops (CUDA kernels): recording CPU kernels beside them
        lib = torch.library.Library("flash_attn_tq", "IMPL")
    else:
        lib = torch.library.Library("flash_attn_tq", "DEF")
        schemas = _schemas()
        for name in ("decode_kvcache", "pack_kv"):
            lib.define(schemas[name])
        ops.register_fakes()  # (the extension's import registers them)
    names = {
        name: [a.name for a in getattr(torch.ops.flash_attn_tq, name).default._schema.arguments]
        for name in ("decode_kvcache", "pack_kv")
    }

    def decode(*args):
        a = dict(zip(names["decode_kvcache"], args))
        a["stores"] = ops.unflatten(a["stores"], a["layout"])
        calls.setdefault("decode_kvcache", []).append(a)
        q = args[0]
        return torch.zeros_like(q), q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)

    def pack(*args):
        a = dict(zip(names["pack_kv"], args))
        a["stores"] = ops.unflatten(a["stores"], a["layout"], with_v=a["v"] is not None)
        calls.setdefault("pack_kv", []).append(a)
        if a.get("lengths") is not None:  # what the kernel does last: the rows' new lengths (start may be a view)
            rows = torch.arange(a["start"].numel()) if a["batch_idx"] is None else a["batch_idx"].long()
            a["lengths"][rows] = a["start"] + a["k"].shape[0] // a["start"].numel()

    lib.impl("decode_kvcache", decode, "CPU")
    lib.impl("pack_kv", pack, "CPU")
    yield calls
    lib._destroy()


def _store(call, kind, group=0):
    (store,) = [s for s in call["stores"] if s.kind == kind and s.group == group]
    return store


def test_decode_arguments(recorded):
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    cache = QuantizedKVCache(
        3,
        200,
        2,
        64,
        k_bits=4,
        sink_tokens=16,
        fp16_window=112,
        key_center="rope",
        rope_inv_freq=inv,
        calib_min_tokens=1,
    )
    cache.append(torch.randn(3, 150, 2, 64).half(), torch.randn(3, 150, 2, 64).half())
    rows = torch.tensor([2, 0], dtype=torch.int32)
    q = torch.randn(2, 1, 8, 64).half()
    cache.attend(q, cache.seqlens[rows.long()], rows, 0.125, True, 5, plan=dispatch.Plan("decode"))
    a = recorded["decode_kvcache"][-1]
    codes = _store(a, ops.CODES)
    assert codes.tensors == (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta) and a["cache_batch_idx"] is rows
    assert (codes.k_bits, codes.v_bits, codes.a) == (4, 3, 112)  # (a: the codes end where the window begins)
    assert (a["num_splits"], a["is_causal"], a["softmax_scale"], a["kernel"]) == (5, True, 0.125, 0)
    assert torch.equal(a["rot_signs"], cache.k_quantizer.signs_on("cpu"))
    assert torch.equal(_store(a, ops.CENTER).tensors[0], cache.k_center[rows.long()])
    assert a["rope_inv_freq"] is cache.rope_inv_freq
    side = _store(a, ops.SIDE)
    assert torch.equal(side.tensors[0], cache.kv_side[0]) and torch.equal(side.tensors[1], cache.kv_side[1])
    assert (side.a, side.b) == (16, 112)
    assert a["window_left"] == a["window_right"] == -1 and a["cache_leftpad"] is None and a["softcap"] == 0.0


def test_ring_of_window_codes_in_the_launch(recorded, monkeypatch, cpu_as_gpu):
    """A cache with 4-bit window codes (NO_FP16_WINDOW's form): decode-sized calls hand the ring to the
    launch (no pass of its own); prefill-sized chunks, pages and other widths keep the ring's pass."""
    passes = []
    monkeypatch.setattr("flash_attn_tq.reference.window_attention", lambda *a: passes.append(1) or (a[0], None))
    monkeypatch.setattr("flash_attn_tq.reference.merge_lse", lambda out, lse, *a: (out, lse))
    opts = dict(sink_tokens=16, fp16_window=128, window_bits=4, k_bits=4)
    cache = QuantizedKVCache(3, 300, 2, 64, **opts)
    cache.append(torch.randn(3, 200, 2, 64).half(), torch.randn(3, 200, 2, 64).half())
    assert cache.plan(dispatch.Query(1, 8, 64, torch.float16)).kernel == "ring"
    cache.attend(torch.randn(3, 1, 8, 64).half(), cache.seqlens, None, 0.125, True)
    a = recorded["decode_kvcache"][-1]
    window = _store(a, ops.WINDOW)
    assert window.tensors == (cache.k_window_codes, cache.k_window_meta, cache.v_window_codes, cache.v_window_meta)
    assert window.k_bits == window.v_bits == 4
    assert (_store(a, ops.SIDE).a, _store(a, ops.SIDE).b, _store(a, ops.CODES).a) == (16, 0, 128) and not passes
    cache.attend(torch.randn(3, 40, 8, 64).half(), cache.seqlens, None, 0.125, True)  # 160 rows a kv head
    assert all(s.kind != ops.WINDOW for s in recorded["decode_kvcache"][-1]["stores"]) and passes == [1]
    for other in (dict(opts, window_bits=2), dict(opts, page_size=16), dict(opts, sink_tokens=0)):
        c = QuantizedKVCache(1, 64, 2, 64, **other)
        assert c.plan(dispatch.Query(1, 8, 64, torch.float16)).kernel != "ring", other


def test_pack_writes_the_ring_of_window_codes(recorded, cpu_as_gpu):
    """A cache with 4-bit window codes: the pack launch also writes the ring (from the same, centered
    keys: the RoPE center in the kernel too) and no PyTorch op writes it; other grids keep the ops."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    opts = dict(sink_tokens=16, fp16_window=128, window_bits=4, key_center="rope", rope_inv_freq=inv)
    cache = QuantizedKVCache(2, 300, 2, 64, calib_min_tokens=1, **opts)
    x = torch.randn(2, 40, 2, 64).half()
    for _ in range(2):  # the prompt (calibrates the center), then a chunk with the center known
        recorded.pop("pack_kv", None)
        cache.append(x, x)
    (call,) = recorded["pack_kv"]
    window = _store(call, ops.WINDOW)
    assert window.tensors == (cache.k_window_codes, cache.k_window_meta, cache.v_window_codes, cache.v_window_meta)
    assert window.k_bits == 4 and call["steps"][2 * call["stores"].index(window)] == ops.uniform_step(4)
    assert call["rope_center"] is cache.k_center and torch.equal(call["k"], x.reshape(-1, 2, 64))  # raw keys
    assert not cache.k_window_codes.any()  # (the recording kernel writes nothing: no PyTorch write either)
    lloyd = QuantizedKVCache(2, 300, 2, 64, grid="lloyd_max", **opts)
    recorded.pop("pack_kv", None)
    lloyd.append(x, x)
    assert all(s.kind != ops.WINDOW for s in recorded["pack_kv"][-1]["stores"]) and lloyd.k_window_codes.any()


def test_pack_arguments(recorded, cpu_as_gpu):
    cache = QuantizedKVCache(2, 64, 2, 64, v_bits=4)
    recorded.pop("pack_kv", None)
    flags = torch.zeros(1, dtype=torch.int32)
    cache.append(torch.randn(2, 3, 2, 64).half(), torch.randn(2, 3, 2, 64).half(), error_flags=flags)
    (call,) = recorded["pack_kv"]  # K and V in one launch
    (codes,) = call["stores"]
    assert codes.tensors == (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta) and call["error_flags"] is flags
    assert (codes.k_bits, codes.v_bits, call["capacity"], call["quant"]) == (3, 4, 64, 0)
    assert call["steps"] == [ops.uniform_step(3), ops.uniform_step(4)]
    assert torch.equal(call["v_signs"], cache.v_quantizer.signs_on("cpu"))
    assert call["k"].shape == call["v"].shape == (6, 2, 64)
    # the kernel reads the cache's own counts (0 then) and advances them itself
    assert call["start"].data_ptr() == cache.seqlens.data_ptr() and call["start"].shape == (2,)
    assert call["lengths"] is cache.seqlens and call["tally"].dtype == torch.int32 and call["tally"].numel() == 1
    assert torch.equal(cache.seqlens, torch.full((2,), 3, dtype=torch.int32))


def test_pack_advances_seqlens_unless_start_may_share_them(recorded, cpu_as_gpu):
    """The pack kernel advances seqlens (no PyTorch op after it) however the rows are named, except
    for a caller's start tensor sharing seqlens' memory (rows of it could be read after others moved),
    which the PyTorch update after the kernel takes."""
    cache = QuantizedKVCache(4, 64, 2, 64)
    flags = torch.zeros(1, dtype=torch.int32)
    x = torch.randn(2, 3, 2, 64).half()
    rows, later = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
    for kwargs, kernel, lens in (
        ({}, True, [3, 3, 0, 0]),
        ({"batch_idx": rows}, True, [3, 6, 0, 3]),
        ({"cache_seqlens": 10}, True, [13, 13, 0, 3]),
        ({"cache_seqlens": torch.tensor([1, 2], dtype=torch.int32), "batch_idx": rows}, True, [13, 5, 0, 4]),
        # rows 1, 0 from seqlens' own rows 0, 1: each read before the other moves
        (
            {"cache_seqlens": cache.seqlens[:2], "batch_idx": torch.tensor([1, 0], dtype=torch.int32)},
            False,
            [8, 16, 0, 4],
        ),
        # the same memory through a storage of its own (DLPack), not a view
        ({"cache_seqlens": torch.from_dlpack(cache.seqlens[1:3]), "batch_idx": later}, False, [8, 16, 19, 3]),
    ):
        recorded.pop("pack_kv", None)
        cache.append(x, x, error_flags=flags, **kwargs)
        (call,) = recorded["pack_kv"]
        assert (call.get("lengths") is cache.seqlens) == kernel and (call.get("tally") is not None) == kernel, kwargs
        assert cache.seqlens.tolist() == lens, kwargs


def test_pack_keeps_the_books(recorded, cpu_as_gpu):
    """With the RoPE center and a 16-bit side the pack kernel gets the raw keys, the center, the
    frequencies and each half of kv_side; PyTorch writes neither the centered keys nor the side."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    cache = QuantizedKVCache(
        2,
        300,
        2,
        64,
        sink_tokens=16,
        fp16_window=112,
        key_center="rope",
        rope_inv_freq=inv,
        rope_position_offset=5,
        calib_min_tokens=1,
    )
    recorded.pop("pack_kv", None)
    k, v = torch.randn(2, 150, 2, 64).half(), torch.randn(2, 150, 2, 64).half()
    cache.append(k, v, error_flags=torch.zeros(1, dtype=torch.int32))
    (call,) = recorded["pack_kv"]
    assert torch.equal(call["k"], k.reshape(300, 2, 64)) and torch.equal(call["v"], v.reshape(300, 2, 64))
    assert call["rope_center"] is cache.k_center and call["rope_inv_freq"] is cache.rope_inv_freq
    assert call["rope_offset"] == 5  # (the kernel applies the center to k only)
    side = _store(call, ops.SIDE)
    assert side.tensors[0].data_ptr() == cache.kv_side[0].data_ptr() and side.tensors[0].shape == cache.kv_side[0].shape
    assert side.tensors[1].data_ptr() == cache.kv_side[1].data_ptr()
    assert (side.a, side.b) == (16, 112)
    assert not cache.kv_side.any()  # (the recording op writes nothing)
    assert torch.equal(cache.seqlens, torch.full((2,), 150, dtype=torch.int32))


def test_generate_compiles_one_graph(recorded, cpu_as_gpu):
    """transformers' generate over a TQCache with max_cache_len compiles its decode steps (here with
    the recording ops on the CPU): one graph, no recompilation across steps, no graph break
    (fullgraph), the default options plus a K8V8 head group (both groups in one launch); the tokens
    equal the eager run's."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION, TQCache

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg).eval().half()  # (the kernels' dtypes)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(0, 128, (2, 150))
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # (transformers compiles on CUDA devices only by default)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cache = TQCache(cfg, max_cache_len=200, head_options={(1, 0): {"k_bits": 8, "v_bits": 8}})
        assert cache.is_compileable
        recorded.clear()
        with torch.no_grad():
            runs[compiled] = model.generate(
                ids,
                past_key_values=cache,
                max_new_tokens=6,
                do_sample=False,
                compile_config=compile_config,
                disable_compile=not compiled,
            )
        assert len(recorded["decode_kvcache"]) == 5 * 3  # 5 decode steps, 3 layers (two head groups in one launch)
        assert cache.get_seq_length() == 150 + 5  # (read back from the cache after compiled steps)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert torch.equal(runs[False], runs[True])
    assert not TQCache(cfg).is_compileable and not TQCache(cfg, max_cache_len=64, protected_layers=(0,)).is_compileable
