"""flash_attn_tq.testing: the results stamp and writers, the timing helpers, the benchmark caches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flash_attn_tq.testing import (
    DEFAULT_LAYERS,
    MISSING,
    Clock,
    command_line,
    describe,
    fill_cache,
    fmt,
    git_commit,
    host_ms,
    interleaved,
    made_by,
    markdown_table,
    missing_notes,
    rerendered,
    rope_freqs,
    stamp,
    weighted_default,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ report


def test_stamp_names_the_machine_versions_commit_and_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "bench_decode.py"), "--quick", "a b"])
    monkeypatch.chdir(ROOT)
    meta = stamp(threads=2)
    assert {"gpu", "cpu", "torch", "cuda", "commit", "date", "command"} <= set(meta)
    assert meta["torch"] == torch.__version__ and meta["threads"] == 2
    assert meta["command"] == "python benchmarks/bench_decode.py --quick 'a b'"  # as a shell takes it again
    assert meta["date"].endswith("UTC")
    line = made_by(meta)
    assert f"`{meta['command']}`" in line and meta["commit"] in line
    assert f"torch {torch.__version__}" in describe(meta)


def test_git_commit_from_the_environment_or_git(monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_COMMIT", "abc1234+patch")
    assert git_commit() == "abc1234+patch"
    monkeypatch.delenv("GIT_COMMIT")
    assert git_commit(tmp_path) == "unknown"  # not a checkout
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert git_commit(ROOT) == head.stdout.strip()


def test_command_line_outside_the_working_directory(monkeypatch, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    monkeypatch.chdir(ROOT)
    assert command_line([str(script), "-x"]) == f"python {script} -x"
    assert command_line(["-c"]) == "python -c"


def test_describe_and_made_by_of_older_stamps():
    old = {"gpu": "NVIDIA H200", "torch": "2.11", "cuda": "13.0", "commit": "c30e159", "date": "2026-12-05"}
    assert describe(old) == "NVIDIA H200, torch 2.11, CUDA 13.0, commit c30e159"
    assert "not recorded" in made_by(old)
    again = rerendered(old)
    assert again["rendered_by"] and "written again" in made_by(again) and old.get("rendered_by") is None
    assert describe({"cpu": "AMD EPYC", "commit": "x"}) == "CPU: AMD EPYC, commit x"


def test_missing_values_and_their_notes():
    assert fmt(None) == MISSING and fmt(None, ".2f", "x") == MISSING
    assert fmt(1.234, ".2f", "x") == "1.23x"
    rows = [{"fp8": 1.0}, {"fp8": None, "fp8_missing": "flashinfer is not importable"}, {"fp8": None}]
    (note,) = missing_notes(rows, {"fp8": "FP8"})
    assert note.startswith(f"{MISSING} under FP8 (2 of 3 rows)")
    assert "flashinfer is not importable" in note and "not recorded" in note
    assert missing_notes([{"fp8": 1.0}], {"fp8": "FP8"}) == []
    assert markdown_table(["a", "b"], [[1, 2]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_write_results_needs_the_stamp_and_replaces_whole_files(tmp_path):
    with pytest.raises(ValueError, match="stamp"):
        write_results(tmp_path, "t", {"rows": []})
    with pytest.raises(ValueError, match="stamp"):
        write_results(tmp_path, "t", {"meta": {"gpu": "x"}, "rows": []})  # (no command)
    meta = stamp()
    rows = []
    for i in range(2):  # a script writes after each row: a run cut short keeps the rows it finished
        rows.append({"i": i, "t": None})
        written = write_results(tmp_path, "t", {"meta": meta, "rows": rows}, f"# t\n\n{i + 1} rows")
        assert [p.name for p in written] == ["t.json", "t.md"]
        assert json.loads((tmp_path / "t.json").read_text())["rows"] == rows
    assert (tmp_path / "t.md").read_text() == "# t\n\n2 rows\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.md"]  # no temporary files left
    drawn = write_results(tmp_path, "p", {"meta": meta}, None, plot=lambda plt: plt.figure())
    assert (tmp_path / "p.png").exists() == (tmp_path / "p.png" in drawn)  # (only with matplotlib)


def test_stamp_line_for_logs(capsys):
    from flash_attn_tq.testing.__main__ import main

    assert main(["compute-sanitizer", "--tool", "memcheck", "python x.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ") and out.rstrip().endswith(": compute-sanitizer --tool memcheck 'python x.py'")


# ------------------------------------------------------------------------------------ timing


def test_interleaved_rounds_take_every_function_in_turn():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = iter([3.0, 1.0, 5.0, 2.0, 4.0, 9.0])
    out = interleaved(fns, lambda fn: (fn(), next(times))[1], rounds=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # the warm-up, then one call of each a round
    assert out == {"a": 4.0, "b": 2.0}  # medians of (3, 5, 4) and (1, 2, 9)
    assert host_ms(lambda: None) >= 0.0


def test_clock_on_the_host():
    clock = Clock("cpu")
    a = clock.mark()
    b = clock.mark()
    assert not clock.cuda and clock.ms(a, b) >= 0.0


def test_timed_attention_restores_the_interface():
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from flash_attn_tq.testing import timed_attention

    assert transformers
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    spans = []
    with torch.no_grad(), timed_attention(model, Clock("cpu"), spans):
        model(torch.arange(8)[None])
    assert len(spans) == cfg.num_hidden_layers
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


# --------------------------------------------------------------------------------- workloads


def test_fill_cache_holds_the_keys_and_values_it_returns():
    torch.manual_seed(0)
    cache, k, v = fill_cache(2, 40, 2, 64, torch.float16, chunk=16, device="cpu")
    assert k.shape == v.shape == (2, 40, 2, 64) and k.dtype == torch.float16
    assert cache.seqlens.tolist() == [40, 40]
    kd, vd = cache.dequantize()
    err = ((kd[:, :40].float() - k.float()).norm() / k.float().norm()).item()
    assert err < 0.25  # 3-bit codes of these keys, not other data
    assert rope_freqs(64).shape == (32,) and rope_freqs(64)[0] == 1.0


def test_weighted_default_weighs_the_kinds_of_layer():
    layers = {"k3": DEFAULT_LAYERS - 5, "k4": 4, "mixed": 1}
    times = {"k3_us": 10.0, "k4_us": 20.0, "mixed_us": 40.0}
    want = ((DEFAULT_LAYERS - 5) * 10.0 + 4 * 20.0 + 40.0) / DEFAULT_LAYERS
    assert weighted_default(times, layers, "_us") == pytest.approx(want)
