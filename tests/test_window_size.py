"""window_size in every form upstream flash_attn takes, and the forms it refuses.

Upstream's own tests pass a tensor of two ints (``torch.randint(0, seqlen, (2,))``).  One validator,
``validation.check_options``, turns each accepted form into a plain ``(int, int)`` for the baseline
and the quantized path alike; everything else is a ValueError naming ``window_size``.
"""

import numpy as np
import pytest
import torch

import flash_attn_tq
from flash_attn_tq import QuantizedKVCache, baseline, last_path, validation

ACCEPTED = {
    "tuple": (3, 1),
    "list": [3, 1],
    "tensor int64": torch.tensor([3, 1]),
    "tensor int32": torch.tensor([3, 1], dtype=torch.int32),
    "tensor int16": torch.tensor([3, 1], dtype=torch.int16),
    "tensor int8": torch.tensor([3, 1], dtype=torch.int8),
    "tensor uint8": torch.tensor([3, 1], dtype=torch.uint8),
    "tensor slice": torch.tensor([9, 3, 8, 1])[1::2],
    "numpy int64": np.array([3, 1]),
    "numpy int32": np.array([3, 1], dtype=np.int32),
    "numpy uint16": np.array([3, 1], dtype=np.uint16),
    "numpy integers": (np.int64(3), np.int16(1)),
    "0-d tensors": (torch.tensor(3), torch.tensor(1, dtype=torch.int32)),
    "0-d numpy arrays": [np.array(3), np.array(1, dtype=np.uint8)],
    "mixed": [torch.tensor(3), np.int32(1)],
    "range": range(3, 0, -2),
}

REFUSED = {
    "floats": (3.0, 1),
    "float tensor": torch.tensor([3.0, 1.0]),
    "half tensor": torch.tensor([3, 1], dtype=torch.float16),
    "bool tensor": torch.tensor([True, False]),
    "bools": (True, 1),
    "numpy bools": (np.bool_(True), 1),
    "numpy floats": np.array([3.0, 1.0]),
    "numpy float scalar": (np.float32(3), 1),
    "0-d float tensor": (torch.tensor(3.0), 1),
    "one": (3,),
    "three": (3, 1, 0),
    "tensor of three": torch.tensor([3, 1, 0]),
    "tensor 1x2": torch.tensor([[3, 1]]),
    "0-d tensor": torch.tensor(3),
    "numpy 1x2": np.array([[3, 1]]),
    "nested": ((3, 1), (3, 1)),
    "1-d tensor elements": (torch.tensor([3]), torch.tensor([1])),
    "string": "31",
    "int": 3,
    "None": None,
    "dict": {0: 3, 1: 1},
}


@pytest.mark.parametrize("form", list(ACCEPTED))
def test_check_options_accepts(form):
    got = validation.check_options(0.0, ACCEPTED[form], 0.0)
    assert got == (3, 1) and type(got) is tuple and all(type(x) is int for x in got)


@pytest.mark.parametrize("form", list(REFUSED))
def test_check_options_refuses(form):
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        validation.check_options(0.0, REFUSED[form], 0.0)


def test_negative_bounds_and_fast_path():
    assert validation.check_options(0.0, (-1, -1), 0.0) == (-1, -1)
    assert validation.check_options(0.0, torch.tensor([-1, 5]), 0.0) == (-1, 5)
    assert validation.check_options(0.0, np.array([-7, -1]), 0.0) == (-7, -1)


def _qkv(gen, B=2, Sq=6, Sk=11, H=2, d=16):
    return [torch.randn(B, S, H, d, generator=gen) for S in (Sq, Sk, Sk)]


def _check_each_form(call):
    """call(window) -> tensor; every accepted form gives the tuple's result, each refused form a
    ValueError naming window_size."""
    want = call((3, 1))
    assert not torch.equal(want, call((-1, -1)))  # (the window changes the result)
    for form, window in ACCEPTED.items():
        assert torch.equal(call(window), want), form
    for form, window in REFUSED.items():
        with pytest.raises(ValueError, match="window_size"):
            call(window)


@pytest.mark.parametrize("module", [flash_attn_tq, baseline], ids=["package", "baseline"])
def test_dense_functions(module):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen)
    _check_each_form(lambda w: module.flash_attn_func(q, k, v, window_size=w))
    _check_each_form(lambda w: module.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), window_size=w))
    qkv = torch.stack([q, k[:, :6], v[:, :6]], 2)
    _check_each_form(lambda w: module.flash_attn_qkvpacked_func(qkv, window_size=w))
    if module is flash_attn_tq:
        assert last_path() == "baseline:torch"


@pytest.mark.parametrize("module", [flash_attn_tq, baseline], ids=["package", "baseline"])
def test_varlen_functions(module):
    gen = torch.Generator().manual_seed(2)
    q, k, v = [x.flatten(0, 1) for x in _qkv(gen)]
    cu_q = torch.tensor([0, 6, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 22], dtype=torch.int32)
    _check_each_form(lambda w: module.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 11, window_size=w))
    kv = torch.stack([k, v], 1)
    _check_each_form(lambda w: module.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 6, 11, window_size=w))
    qkv = torch.stack([q, k[:12], v[:12]], 1)
    _check_each_form(lambda w: module.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 6, window_size=w))


@pytest.mark.parametrize("module", [flash_attn_tq, baseline], ids=["package", "baseline"])
def test_kvcache_tensors(module):
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache = _qkv(gen, Sk=20)
    lens = torch.tensor([11, 17], dtype=torch.int32)
    _check_each_form(lambda w: module.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, window_size=w))


def test_quantized_cache():
    """The quantized path (a QuantizedKVCache on the CPU: the reference attention)."""
    gen = torch.Generator().manual_seed(4)
    cache = QuantizedKVCache(2, 32, 2, 64, seed=4)
    for b, n in enumerate((21, 9)):
        kv = [torch.randn(1, n, 2, 64, generator=gen).half() for _ in range(2)]
        cache.append(*kv, batch_idx=torch.tensor([b]))
    q = torch.randn(2, 3, 4, 64, generator=gen).half()
    _check_each_form(lambda w: flash_attn_tq.flash_attn_with_kvcache(q, cache, window_size=w))
    assert last_path().startswith("quantized:")
    # the cache is left as it was by every call, refused ones included
    assert cache.seqlens.tolist() == [21, 9]


def test_kvcache_refuses_before_dispatch():
    """flash_attn_with_kvcache over cache tensors checks the window before it picks a path."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache = _qkv(gen, Sk=20)
    for window in (torch.tensor([2.5, 1.0]), (None, None), "ab"):
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_tq.flash_attn_with_kvcache(q, k_cache, v_cache, window_size=window)
