"""Packaging: what setup.py declares (read from its source, nothing is built), the architectures a
build picks, and the ImportError a user without transformers gets from the modules that need it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "setup.py"
INSTALL = 'pip install "flash_attn_tq[transformers]"'


def setup_keywords() -> dict:
    """The literal keyword arguments of setup.py's ``setup(...)`` call."""
    tree = ast.parse(SETUP.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            out = {}
            for kw in node.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    pass  # computed at build time (ext_modules, packages, ...)
            return out
    raise AssertionError("setup.py has no setup(...) call")


def setup_functions(*names: str) -> dict:
    """setup.py's module-level constants and the functions ``names``, executed without the rest (the
    torch import, the extension plan and ``setup()`` itself)."""
    tree = ast.parse(SETUP.read_text())
    keep = [
        n
        for n in tree.body
        if (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in n.targets))
        and not any(isinstance(c, ast.Call) for c in ast.walk(n))
        or (isinstance(n, ast.FunctionDef) and n.name in names)
    ]
    ns = {"re": re, "os": __import__("os")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SETUP), "exec"), ns)
    return ns


def package_imports() -> set[str]:
    """Top-level names of every module the flash_attn_tq package imports."""
    names = set()
    for path in (ROOT / "flash_attn_tq").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_python_requires_matches_torch():
    """torch 2.14 (what the README installs) needs Python >= 3.10: setup.py, ruff and the README say so."""
    assert setup_keywords()["python_requires"] == ">=3.10"
    assert re.search(r'^target-version = "py310"$', (ROOT / "pyproject.toml").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    assert "Python ≥ 3.10" in readme and "3.9" not in readme.split("## API")[0]


def test_dependencies_and_extras():
    kw = setup_keywords()
    # the package itself imports torch only (einops / packaging were declared but never imported)
    assert kw["install_requires"] == ["torch"]
    imported = package_imports()
    assert not imported & {"einops", "packaging"}
    extras = kw["extras_require"]
    # transformers: its own extra (what the ImportError below names), and in [test] for the tests
    assert any(re.fullmatch(r"transformers>=5(\.\d+)*", r) for r in extras["transformers"])
    assert any(r.startswith("transformers") for r in extras["test"])
    # upstream flash-attn's own test file (run against this package) imports einops
    assert "einops" in extras["test"]
    # triton: only the benchmarks and the GPU self-check time with it (verify --quick falls back without)
    assert "triton" in extras["bench"]
    for optional in ("transformers", "triton"):
        assert optional in imported  # imported somewhere, but not required by install_requires
        assert not any(r.startswith(optional) for r in kw["install_requires"])


def test_cuda_archs_default():
    """Without a visible GPU and without FLASH_ATTN_TQ_CUDA_ARCHS, only 90a is built (a compile check)
    and the build says how to skip it and how long it takes; otherwise nothing changes."""
    ns = setup_functions("_cuda_archs", "_parse_archs")
    cuda_archs = ns["_cuda_archs"]
    assert cuda_archs({}, True) == ("80;90a", None)
    archs, note = cuda_archs({}, False)
    assert archs == "90a"
    assert "FLASH_ATTN_TQ_SKIP_CUDA_BUILD=1" in note and "about 10 minutes" in note and "24.7 minutes" in note
    assert "FLASH_ATTN_TQ_CUDA_ARCHS" in note
    for gpu in (True, False):  # an explicit choice wins either way, with nothing to add
        assert cuda_archs({"FLASH_ATTN_TQ_CUDA_ARCHS": "80"}, gpu) == ("80", None)
        assert cuda_archs({"FLASH_ATTN_TQ_CUDA_ARCHS": "  "}, gpu)[0] == ("80;90a" if gpu else "90a")
    assert ns["_parse_archs"](archs) == ["-gencode", "arch=compute_90a,code=sm_90a"]
    doc = ast.get_docstring(ast.parse(SETUP.read_text()))
    assert "``90a`` alone where it sees" in doc and "24.7 minutes" in doc and "FLASH_ATTN_TQ_SKIP_CUDA_BUILD=1" in doc


def test_without_transformers_the_import_error_names_the_install_command():
    """transformers made unimportable (as if not installed): the modules written against it raise an
    ImportError naming the command that installs it; what needs only torch still imports and runs."""
    code = f"""
import sys
sys.modules["transformers"] = None  # `import transformers` now fails as if it were not installed
import importlib
for name in ("flash_attn_tq.integrations.transformers", "flash_attn_tq.integrations.graphs"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        msg = str(e)
        assert {INSTALL!r} in msg and name in msg and "transformers >= 5" in msg, msg
        assert not isinstance(e, ModuleNotFoundError), type(e)
    else:
        raise AssertionError(name + " imported without transformers")
import torch
from flash_attn_tq import qat
from flash_attn_tq.integrations import calibration, options  # (the measurements take the model and the cache class)
x = torch.randn(2, 3, 2, 64)
assert qat.fake_quant(x, bits=3).shape == x.shape  # the fake quantization needs torch only
for fn in (qat.register_fake_quant_attention, qat.make_fake_quant_attention):
    try:
        fn()
    except ImportError as e:
        assert {INSTALL!r} in str(e) and fn.__name__ in str(e), str(e)
    else:
        raise AssertionError(fn.__name__ + " ran without transformers")
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_in_process_without_transformers(monkeypatch):
    """The same through importlib in this process (transformers' own modules already imported)."""
    import importlib

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "flash_attn_tq.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=re.escape(INSTALL)):
        importlib.import_module("flash_attn_tq.integrations.transformers")
