"""Shared fixtures."""

import pytest


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The CPU stands in for a GPU with the built extension: dispatch plans fused launches and the
    quantize-on-write kernel for CPU tensors. The ops themselves need a stand-in too (a test's own,
    or test_ops_schema's recording ops)."""
    from flash_attn_tq import dispatch

    real = dispatch.read_device

    def read_device(device, wgmma_on):
        if device.type != "cpu":
            return real(device, wgmma_on)
        return dispatch.Device("cuda", extension=True, prefill_smem=True)

    monkeypatch.setattr(dispatch, "read_device", read_device)
    monkeypatch.setattr(dispatch, "_DEVICES", {})  # (facts read before the patch)


@pytest.fixture
def cpu_as_gpu_later(request):
    """cpu_as_gpu, switched on when the test calls the returned function (after its CPU-only steps)."""
    return lambda: request.getfixturevalue("cpu_as_gpu")
