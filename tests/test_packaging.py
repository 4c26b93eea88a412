"""Packaging: what setup.py declares (read from its source, nothing is built) and the architectures a
build picks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "setup.py"


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
    # triton: only the benchmarks and the GPU self-check time with it (selfcheck falls back without)
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
