"""A ``flash_attn`` package that re-exports this package (as tests/upstream/run.py writes one, to run
upstream's test file against us) must not be taken for upstream: the baseline would call back into
itself forever."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flash_attn_tq
from flash_attn_tq import interface


def _runner():
    """tests/upstream/run.py, whose alias package these tests check."""
    path = Path(__file__).resolve().parent / "upstream" / "run.py"
    spec = importlib.util.spec_from_file_location("upstream_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNNER = _runner()
FUNCS = RUNNER.FUNCS


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    """Writes a flash_attn package into tmp_path from a dict of file texts; first on sys.path."""

    def write(files):
        for name, text in files.items():
            path = tmp_path / "flash_attn" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        monkeypatch.syspath_prepend(str(tmp_path))
        interface._upstream.cache_clear()

    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] == "flash_attn"}
    yield write
    for name in [name for name in sys.modules if name.split(".")[0] == "flash_attn"]:
        del sys.modules[name]
    sys.modules.update(saved)
    interface._upstream.cache_clear()


ALIAS = {"__init__.py": RUNNER.ALIAS_INIT, "flash_attn_interface.py": RUNNER.ALIAS_INTERFACE}


def test_alias_is_not_upstream(fake_flash_attn):
    fake_flash_attn(ALIAS)
    import flash_attn.flash_attn_interface as alias

    assert alias.flash_attn_func is flash_attn_tq.flash_attn_func
    assert interface._upstream() is None


def test_alias_with_a_backend_attribute_is_not_upstream(fake_flash_attn):
    """Even an alias that also carries a flash_attn_gpu attribute: its functions are ours."""
    files = {name: textwrap.dedent(text) for name, text in ALIAS.items()}
    files["flash_attn_interface.py"] += "flash_attn_gpu = object()\n"
    fake_flash_attn(files)
    import flash_attn.flash_attn_interface as alias

    assert alias.flash_attn_gpu is not None
    assert interface._upstream() is None


def test_calls_through_the_alias(fake_flash_attn, monkeypatch):
    """Each function, called as upstream's test file calls it, reaches the baseline once.  (The
    baseline is picked for CPU tensors anyway; here every tensor also passes for a CUDA one, so a
    mistaken upstream module would be called, and would call back here.)"""
    fake_flash_attn(ALIAS)
    import flash_attn

    monkeypatch.setattr(interface, "_on_upstream_device", lambda *tensors: True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(2, 5, 2, 16, generator=gen) for _ in range(3)]
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [x.flatten(0, 1) for x in (q, k, v)]
    calls = {
        "flash_attn_func": lambda f: f(q, k, v, causal=True, window_size=torch.tensor([2, 0])),
        "flash_attn_kvpacked_func": lambda f: f(q, torch.stack([k, v], 2)),
        "flash_attn_qkvpacked_func": lambda f: f(torch.stack([q, k, v], 2)),
        "flash_attn_varlen_func": lambda f: f(*flat, cu, cu, 5, 5),
        "flash_attn_varlen_kvpacked_func": lambda f: f(flat[0], torch.stack(flat[1:], 1), cu, cu, 5, 5),
        "flash_attn_varlen_qkvpacked_func": lambda f: f(torch.stack(flat, 1), cu, 5),
        "flash_attn_with_kvcache": lambda f: f(q, k.clone(), v.clone(), cache_seqlens=3),
    }
    assert sorted(calls) == sorted(FUNCS)
    for name, call in calls.items():
        out = call(getattr(flash_attn, name))
        assert torch.equal(out, call(getattr(flash_attn_tq.baseline, name))), name
        assert flash_attn_tq.last_path() == "baseline:torch", name


def test_genuine_upstream_is_used(fake_flash_attn):
    """A module with upstream's compiled backend and functions of its own is taken for upstream."""
    fake_flash_attn(
        {
            "__init__.py": "",
            "flash_attn_interface.py": """
                flash_attn_gpu = object()

                def flash_attn_func(*args, **kwargs):
                    return "upstream"
            """,
        }
    )
    up = interface._upstream()
    assert up is not None and up.flash_attn_func() == "upstream"
