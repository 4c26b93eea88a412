"""``python -m flash_attn_tq.verify`` on CPU (the reference path): shape/option combinations, captured
q/k/v, a deliberately broken attention and the JSON output."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import flash_attn_tq
from flash_attn_tq import verify

SMALL = ["--batch", "2", "--seqlen", "96", "--q-heads", "4", "--kv-heads", "2", "--device", "cpu"]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--quantizer", "asym", "--head-dim", "64", "--seqlen-q", "5"],
        ["--head-dim", "64", "--sink-tokens", "4", "--fp16-window", "8", "--dtype", "bfloat16"],
        ["--key-center", "rope", "--k-bits", "4", "--seqlen-q", "3"],
        ["--key-center", "mean", "--quantizer", "asym", "--k-bits", "8", "--v-bits", "2"],
        ["--page-size", "16", "--sink-tokens", "2", "--fp16-window", "4"],
    ],
)
def test_shapes_pass(extra, capsys):
    assert verify.main(SMALL + extra) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "FAIL" not in out
    assert "path: quantized:reference (q is not on a CUDA device)" in out
    for row in ("attention output rel. error", "pack/unpack mismatches", "bits/element", "K relative MSE"):
        assert row in out


def test_qkv_file(tmp_path, capsys):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 64, generator=gen)
    k = torch.randn(1, 80, 2, 64, generator=gen) * 3 + 1  # not N(0, 1): the error is reported, not judged
    v = torch.randn(1, 80, 2, 64, generator=gen)
    path = tmp_path / "qkv.pt"
    verify.save_qkv(str(path), q, k, v)
    assert verify.main(["--qkv", str(path), "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["batch"] == 1 and result["config"]["seqlen"] == 80 and result["config"]["seqlen_q"] == 2
    mse = [c for c in result["checks"] if "relative MSE" in c["check"]]
    assert len(mse) == 2 and all(c["verdict"] == "INFO" and c["bound"] is None for c in mse)
    # a (q, k, v) tuple works too; mismatched shapes are a usage error
    torch.save((q, k, v), tmp_path / "t.pt")
    assert verify.main(["--qkv", str(tmp_path / "t.pt"), "--device", "cpu"]) == 0
    torch.save((q, k[..., :32], v[..., :32]), tmp_path / "bad.pt")
    with pytest.raises(SystemExit) as e:
        verify.main(["--qkv", str(tmp_path / "bad.pt"), "--device", "cpu"])
    assert e.value.code == 2


def test_broken_attention_fails(monkeypatch, capsys):
    def garbage(q, cache, **kw):
        return torch.randn_like(q), torch.randn(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(flash_attn_tq, "flash_attn_with_kvcache", garbage)
    assert verify.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "SOME CHECKS FAILED" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("attention")] == ["FAIL", "FAIL"]


def test_nan_output_fails_and_json_stays_strict(monkeypatch, capsys):
    def nans(q, cache, **kw):
        out = torch.full_like(q, float("nan"))
        return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(flash_attn_tq, "flash_attn_with_kvcache", nans)
    assert verify.main(SMALL + ["--json"]) == 1
    text = capsys.readouterr().out
    result = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert result["passed"] is False
    assert result["checks"][0]["value"] == "nan" and result["checks"][0]["verdict"] == "FAIL"


def test_json_output(capsys):
    assert verify.main(SMALL + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] is True and result["device"] == "cpu"
    assert result["path"].startswith("quantized:reference")
    assert result["bits_per_element"] == flash_attn_tq.format.bits_per_element(128, 3, 2)
    for c in result["checks"]:
        assert set(c) == {"check", "value", "bound", "ok", "verdict"}
        assert c["verdict"] in ("PASS", "INFO")


def test_bounds():
    # turbo: the grid's Gaussian MSE (3 bits: 0.0375); asym: step^2 / 12 over the expected range
    assert verify.typical_rel_mse("turbo", 3, 128) == pytest.approx(0.0374, abs=1e-3)
    assert verify.typical_rel_mse("asym", 3, 128) == pytest.approx(0.046, rel=0.05)
    assert verify.typical_rel_mse("asym", 3, 64) < verify.typical_rel_mse("asym", 3, 128)
    assert verify.default_rope_inv_freq(8).tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001])


def test_bad_options_are_usage_errors():
    for bad in (["--head-dim", "96"], ["--seqlen-q", "200"], ["--kv-heads", "3"]):
        with pytest.raises(SystemExit) as e:
            verify.main(SMALL + bad)
        assert e.value.code == 2


@pytest.mark.gpu
def test_unusable_device_is_a_usage_error(monkeypatch, capsys):
    """--device cuda where no CUDA device is visible (and a malformed device) is an argparse error
    naming --device (exit code 2), not a traceback from deep inside torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("cuda", "cuda:1", "gpu0"):
        with pytest.raises(SystemExit) as e:
            verify.main(SMALL[:-2] + ["--device", device])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: --device {device}" in err or f"error: --device '{device}'" in err
        assert "Traceback" not in err
    assert verify.device_problem("cpu") is None


def test_unusable_device_from_the_command_line():
    """The module as a user runs it, with no CUDA device visible: one error line, exit code 2."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [sys.executable, "-m", "flash_attn_tq.verify", "--device", "cuda"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(pathlib.Path(__file__).resolve().parents[1]),
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m flash_attn_tq.verify: error: --device cuda: no CUDA device"), last


@pytest.mark.skipif(
    not torch.cuda.is_available() or not flash_attn_tq.ops.extension_available(),
    reason="needs a CUDA GPU and the flash_attn_tq_cuda extension",
)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "--head-dim",
            "64",
            "--sink-tokens",
            "16",
            "--fp16-window",
            "112",
            "--key-center",
            "rope",
            "--dtype",
            "bfloat16",
        ],
        ["--page-size", "256", "--seqlen-q", "300", "--k-bits", "4"],
    ],
)
def test_shapes_pass_on_the_gpu(extra, capsys):
    """The same checks through the fused kernels (default options, the default cache's side and RoPE
    center in bf16, a paged prefill-sized chunk)."""
    args = ["--batch", "2", "--seqlen", "1000", "--q-heads", "8", "--kv-heads", "2", "--device", "cuda"]
    assert verify.main(args + extra) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "path: quantized:fused-cuda" in out
