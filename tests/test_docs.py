"""The generated parts of the docs match the code: README.md's support matrix and docs/api.md's
reference are what scripts/make_docs.py writes from the case table and the public signatures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE_DOCS = ROOT / "scripts" / "make_docs.py"


def run_check() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MAKE_DOCS), "--check"], capture_output=True, text=True, cwd=ROOT)


def test_generated_docs_are_up_to_date():
    """The support matrix (README.md, docs/api.md) and, with transformers installed, the API reference."""
    done = run_check()
    assert done.returncode == 0, done.stdout + done.stderr


def test_api_reference_is_checked_with_transformers():
    pytest.importorskip("transformers")
    done = run_check()
    assert "not checked" not in done.stdout, done.stdout


def test_check_fails_on_a_stale_block(tmp_path, monkeypatch):
    """--check reports a block that differs from the code, and writes nothing."""
    spec = importlib.util.spec_from_file_location("make_docs", MAKE_DOCS)
    make_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_docs)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- support-matrix:begin -->\n| stale |\n<!-- support-matrix:end -->\n")
    api = tmp_path / "docs" / "api.md"
    api.parent.mkdir()
    api.write_text("<!-- support-matrix:begin -->\n<!-- support-matrix:end -->\n<!-- api:begin -->\n<!-- api:end -->\n")
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)
    monkeypatch.setattr(make_docs, "README", readme)
    monkeypatch.setattr(make_docs, "API", api)
    before = readme.read_text()
    assert make_docs.main(["--check"]) == 1
    assert readme.read_text() == before
    if importlib.util.find_spec("transformers") is not None:
        assert make_docs.main([]) == 0 and "| K3V3 |" in readme.read_text()
        assert make_docs.main(["--check"]) == 0


def test_support_matrix_lists_every_fused_width():
    from flash_attn_tq.kernel_cases import FUSED_DECODE_BITS

    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- support-matrix:begin -->")[1].split("<!-- support-matrix:end -->")[0]
    for kb, vb in FUSED_DECODE_BITS:
        assert f"| K{kb}V{vb} |" in block
