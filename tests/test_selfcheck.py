"""``python -m flash_attn_tq.selfcheck``: what its timing line says it measured."""

import sys

from flash_attn_tq import selfcheck


def test_cpu_timing_is_labelled_a_mean():
    calls = []
    time_us, how = selfcheck.decode_timer(False, reps=3)
    assert how == "CPU mean of 3 calls after one warm-up" and "median" not in how
    assert time_us(lambda: calls.append(1)) >= 0
    assert len(calls) == 4  # one warm-up call, then the three timed ones


def test_gpu_timing_without_triton_is_labelled(monkeypatch):
    """Without triton (not a declared dependency of the package) the GPU timing falls back to CUDA
    events and says so, instead of an ImportError at the end of the self-check."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.testing", None)
    _, how = selfcheck.decode_timer(True, reps=3)
    assert how == f"GPU median of {selfcheck.CUDA_REPS} calls, CUDA events (triton not installed)"
