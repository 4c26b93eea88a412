"""``python -m flash_attn_tq.verify --quick``: what its timing line says it measured."""

import sys

from flash_attn_tq import verify


def test_cpu_timing_is_labelled_a_mean():
    calls = []
    time_us, how = verify.decode_timer(False, reps=3)
    assert how == "CPU mean of 3 calls after one warm-up" and "median" not in how
    assert time_us(lambda: calls.append(1)) >= 0
    assert len(calls) == 4  # one warm-up call, then the three timed ones


def test_gpu_timing_without_triton_is_labelled(monkeypatch):
    """Without triton (not a declared dependency of the package) the GPU timing falls back to CUDA
    events and says so, instead of an ImportError at the end of the self-check."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.testing", None)
    _, how = verify.decode_timer(True, reps=3)
    assert how == f"GPU median of {verify.CUDA_REPS} calls, CUDA events (triton not installed)"


def test_quick_check_passes_on_the_cpu(capsys):
    """The install check runs end to end on the reference path and says what it measured."""
    assert verify.main(["--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "TQCache's default" in out and "CPU mean" in out
