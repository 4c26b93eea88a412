"""The benchmark scripts run: each as its own process (``python -m benchmarks.NAME`` from the
repository root, so the checkout's package is the one imported), on the CPU, with tiny sizes and no
downloads, writing stamped results into a temporary directory. The runs start together (one
module-scoped fixture) and the tests read their output; the scripts' shared logic is tested in
tests/test_testing.py and tests/test_testing_quality.py, through the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5", allow_module_level=True)

from flash_attn_tq.testing.configs import UNCALIBRATED_DEFAULT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
BITDECODING_ROW = dict(B=8, S=32768, Hq=32, Hk=8, d=128, cudnn_us=250.0, ours_k3v3_us=90.0, ours_k4v3_us=95.0)
BITDECODING_ROW.update(bitdecoding_us=120.0, bitdecoding_timing="eager", ours_k3v3_bytes=2e8, bitdecoding_bytes=2.7e8)


def commands(tmp: Path) -> dict[str, list[str]]:
    """The smoke runs: {name: arguments of ``python -m benchmarks.NAME``}; their inputs written to tmp."""
    g = torch.Generator().manual_seed(0)
    text = tmp / "text.txt"
    text.write_text(" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (900,), generator=g).tolist()))
    bitdecoding = tmp / "bitdecoding_in.json"
    meta = {"gpu": "GPU", "torch": "2", "cuda": "13", "commit": "abc", "command": "python bench_bitdecoding.py"}
    bitdecoding.write_text(json.dumps({"meta": meta, "sanity_mean_abs_err": 0.01, "rows": [BITDECODING_ROW]}))
    return {
        "eval_quality": [
            str(text), "--tiny", "--quick", "--device", "cpu", "--threads", "1",
            "--configs", f"full,{UNCALIBRATED_DEFAULT}", "--path", "both", "--product-configs", UNCALIBRATED_DEFAULT,
            "--product-decode", "12", "--data", str(tmp / "data"), "--out", str(tmp / "eval_quality"),
        ],
        "bench_generate": [
            "--quick", "--models", "smollm2", "--variants", "dynamic,static,kv16,tq", "--profile-steps", "1",
            "--out", str(tmp / "bench_generate"),
        ],
        "bench_generate_fill": [
            "--quick", "--fill", "--out", str(tmp / "bench_generate_fill"),
        ],
        "bench_cpu": [
            "--batch", "1", "--seqlen", "64", "--repeats", "1", "--ref-repeats", "1", "--threads", "1", "--no-quality",
            "--out", str(tmp / "bench_cpu"),
        ],
        "bench_bitdecoding": ["--render", str(bitdecoding), "--out", str(tmp / "bench_bitdecoding")],
        "bench_serving": [
            "--render", str(ROOT / "benchmarks" / "results" / "serving.json"), "--out", str(tmp / "bench_serving"),
        ],
        "bench_speculative": ["--quick", "--out", str(tmp / "bench_speculative")],
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (return code, output, output directory)} of every smoke run, started side by side (one
    CPU thread each: much of a run is the interpreter's start-up)."""
    tmp = tmp_path_factory.mktemp("bench_scripts")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQ_EVAL_DATA=str(tmp / "data"))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{name.removesuffix('_fill')}", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in commands(tmp).items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=600)
        out[name] = (proc.returncode, stdout, tmp / name)
    return out


def finished(runs, name) -> tuple[str, Path]:
    rc, stdout, out = runs[name]
    assert rc == 0, f"benchmarks/{name}.py failed:\n{stdout[-4000:]}"
    return stdout, out


def test_eval_quality_tiny_both_paths(runs):
    """``eval_quality.py TEXT --tiny``: nothing downloaded; simulation and product rows, stamped."""
    _, out = finished(runs, "eval_quality")
    res = json.loads((out / "quality.json").read_text())
    assert res["text"] == "text.txt" and "--tiny" in res["meta"]["command"]
    assert not (out.parent / "data" / "wheels").exists()  # (no asset fetched)
    cfg = UNCALIBRATED_DEFAULT
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
    assert f"`{res['meta']['command']}`" in md


def test_bench_generate_quick_writes_each_row(runs):
    """bench_generate.py --quick: tiny random models on the CPU; the files are written again after
    each row (before the next row is measured), so a run cut short keeps the rows it finished."""
    stdout, out = finished(runs, "bench_generate")
    res = json.loads((out / "generate.json").read_text())
    assert {"gpu", "torch", "cuda", "commit", "command", "transformers"} <= set(res["meta"])
    assert [r["prompt"] for r in res["rows"]] == [200, 300]
    row = res["rows"][0]
    for k in ("model", "B", "prompt", "dynamic_tok_s", "static_tok_s", "tq_tok_s"):
        assert row[k] is not None, k
    assert row["model"] == "smollm2" and row["B"] == 1
    assert 0 < row["tq_cache_bytes"] < row["dynamic_cache_bytes"]
    assert row["static_tokens_agree"] == 1.0  # the same greedy tokens as DynamicCache
    assert row["kv16_tokens_agree"] == 1.0  # the fp16 anchor's cache (here its SDPA fallback) too
    assert row["tq_path"].startswith("quantized:")
    assert 0.0 <= row["tq_attn_wall_share"] <= 1.0
    assert "| smollm2 |" in (out / "generate.md").read_text()
    lines = stdout.splitlines()
    first_write = next(i for i, line in enumerate(lines) if line.startswith("wrote 1 row(s)"))
    second_row = next(i for i, line in enumerate(lines) if line.startswith("[smollm2 B=1 P=300]"))
    assert first_write < second_row


def test_bench_generate_quick_fill(runs):
    """bench_generate.py --quick --fill: each cache filled through its write path and decoded at a
    batch (on the CPU, 2), its bytes a sequence measured; the 3-bit cache holds fewer."""
    _, out = finished(runs, "bench_generate_fill")
    res = json.loads((out / "generate_fill.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"kv16_compiled", "tq_compiled"}
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert r["batch"] == 2 and r["tok_s"] > 0 and r["kv_bytes"] > 0
    assert rows["tq_compiled"]["per_seq_bytes"] < rows["kv16_compiled"]["per_seq_bytes"]
    assert "| tq_compiled | 2 |" in (out / "generate_fill.md").read_text()


def test_bench_cpu_small(runs):
    _, out = finished(runs, "bench_cpu")
    res = json.loads((out / "cpu.json").read_text())
    rows = res["timing"]["1"]
    assert rows[0]["name"] == "SDPA float16 K/V" and any("reference path" in r["name"] for r in rows)
    assert all(r["ms"] > 0 for r in rows)
    assert res["meta"]["threads"] == [1] and "--no-quality" in res["meta"]["command"]
    md = (out / "cpu.md").read_text()
    assert "CpuQuantizedKVCache" in md and "No quality table: --no-quality." in md


def test_bench_bitdecoding_renders_its_table(runs):
    """bench_bitdecoding.py's table (the peer's kernels need a GPU and its source; the table does not)."""
    _, out = finished(runs, "bench_bitdecoding")
    assert json.loads((out / "bitdecoding.json").read_text())["rows"][0]["B"] == 8
    md = (out / "bitdecoding.md").read_text()
    assert "| 8 | 32768 | 250.0 | 90.0 | 95.0 | 120.0 (eager) | 2.78x | 2.08x | 2.22 | 2.25 |" in md
    assert "Made by `python bench_bitdecoding.py`" in md and "written again from its JSON" in md


def test_bench_serving_render(runs):
    """bench_serving.py --render: the tables again from a results file (no GPU); each row's split by
    kernel sums to what the run recorded, and a decode or prefill kernel counts as attention."""
    _, out = finished(runs, "bench_serving")
    res = json.loads((out / "serving.json").read_text())
    assert "rendered_by" in res["meta"]
    for row in res["rows"]:
        for name, us, part in row.get("kernels", []):
            fn = name.split("<")[0]
            if "decode_split" in fn or "prefill_split" in fn:
                assert part == "attention", name
            if "pack_pair" in fn:
                assert part == "pack", name
    assert "| tq3 | 256 |" in (out / "serving.md").read_text()


def test_bench_speculative_quick_is_exact(runs):
    """bench_speculative.py --quick: greedy and speculative decoding over each cache, on the CPU; the
    speculative tokens equal the greedy ones over both caches (TQCache's default included)."""
    _, out = finished(runs, "bench_speculative")
    res = json.loads((out / "speculative.json").read_text())
    assert {"gpu", "torch", "commit", "command", "transformers"} <= set(res["meta"])
    assert [r["cache"] for r in res["rows"]] == ["dynamic", "tq"]
    for r in res["rows"]:
        assert r["exact"] and r["greedy_tok_s"] > 0 and r["speculative_tok_s"] > 0
        assert r["drafted"] > 0 and 0.0 <= r["acceptance"] <= 1.0 and r["speculative_steps"] < r["greedy_steps"]
    assert "| 60 | tq |" in (out / "speculative.md").read_text()
