"""TQCache under transformers' tensor parallelism: two CPU processes (gloo) split a tiny Llama's kv
heads, each rank's cache holds its own in 3 bits, and greedy decoding gives the single process's
tokens; per-head options and calibration name the model's heads and agree on every rank."""

import os
import socket

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it

from flash_attn_tq.integrations.parallel import first_kv_head  # noqa: E402
from flash_attn_tq.integrations.transformers import TQCache  # noqa: E402
from flash_attn_tq.testing.assets import TINY_LLAMA, random_llama  # noqa: E402

WORLD = 2
# four kv heads, two a rank; weights larger than the default init so that greedy decoding does not
# settle on one token
CONFIG = dict(TINY_LLAMA, num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.2)
PROMPT, NEW = 40, 24
HEADS = {(0, 1): {"k_bits": 8, "v_bits": 8}, (1, 2): {"k_bits": 4}}  # a head of each rank's share


def _load(path, **kwargs):
    from transformers import LlamaForCausalLM

    # (float64: the split matmuls and the all-reduce round differently from one process; far below a token flip)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="tq_kvcache", **kwargs)


def _decode(model, make_cache):
    """Greedy tokens of ``model`` over ``make_cache(model)``, with the cache's per-head widths as
    ``{(layer, model kv head): (k_bits, v_bits)}``."""
    ids = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = make_cache(model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    widths = {}
    for i, layer in enumerate(cache.layers):
        for heads, spec in zip(layer.groups, layer.group_specs):
            for h in heads:
                widths[(i, layer.first_head + h)] = (spec.k_bits, spec.v_bits)
    return out[0, PROMPT:].tolist(), widths, dict(cache.layer_options), dict(cache.head_options)


def _with_head_options(model):
    return TQCache(model.config, head_options=HEADS)


def _calibrated(model):
    return TQCache.calibrated(model, copy_heads=0)


CASES = {"head_options": _with_head_options, "calibrated": _calibrated}


def _rank(rank, path, port, case, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _load(path, tp_plan="auto")
        results.put((rank, _decode(model, CASES[case])))
    finally:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    random_llama(CONFIG).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_tokens_equal_one_process(model_path, case, monkeypatch):
    tokens, widths, layer_options, head_options = _decode(_load(model_path), CASES[case])
    assert len(set(tokens)) > 3, "the tiny model's greedy tokens should not be one token repeated"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks on the CPU (gloo), GPU or not
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, model_path, port, case, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    for rank in range(WORLD):
        r_tokens, r_widths, r_layers, r_heads = got[rank]
        assert (r_layers, r_heads) == (layer_options, head_options), f"rank {rank}'s calibrated layout"
        # the rank holds kv heads [2 rank, 2 rank + 2) of every layer, at the model's widths for them
        assert sorted({h for _, h in r_widths}) == [2 * rank, 2 * rank + 1]
        assert r_widths == {k: w for k, w in widths.items() if k in r_widths}
        assert r_tokens == tokens, f"rank {rank}"


def test_first_kv_head():
    assert first_kv_head(4, 4) == 0
    assert first_kv_head(4, None) == 0
    assert first_kv_head(2, 4, tp_rank=1) == 2
    assert first_kv_head(1, 8, tp_rank=7) == 7
    with pytest.raises(ValueError, match="does not split"):
        first_kv_head(3, 4, tp_rank=0)
    with pytest.raises(ValueError, match="does not split"):
        first_kv_head(8, 4, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank: 2 is not a rank"):
        first_kv_head(2, 4, tp_rank=2)
    with pytest.raises(ValueError, match="pass tp_rank="):
        first_kv_head(2, 4)  # no process group here


def test_shard_places_head_options_by_model_head():
    """One rank's shard of a layer, fed by hand: its local head 0 is the model's head 2."""
    from transformers import LlamaConfig

    cache = TQCache(LlamaConfig(**CONFIG), head_options={(0, 2): {"k_bits": 8, "v_bits": 8}}, tp_rank=1)
    k = torch.randn(1, 2, 5, CONFIG["head_dim"])
    cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    assert layer.first_head == 2
    widths = {h: (s.k_bits, s.v_bits) for heads, s in zip(layer.groups, layer.group_specs) for h in heads}
    layer_spec = cache.layer_spec(0)
    assert widths[0] == (8, 8) and widths[1] == (layer_spec.k_bits, layer_spec.v_bits)
    with pytest.raises(ValueError, match="tp_rank must be"):
        TQCache(LlamaConfig(**CONFIG), tp_rank=-1)
