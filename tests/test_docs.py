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


def run_check(*args: str) -> subprocess.CompletedProcess:
    """``scripts/make_docs.py --check`` run as a file, as the README says (it documents the checkout's package)."""
    return subprocess.run([sys.executable, str(MAKE_DOCS), "--check", *args], capture_output=True, text=True)


def test_generated_docs_are_up_to_date():
    """The support matrix (README.md, docs/api.md) and, with transformers installed, the API reference."""
    done = run_check()
    assert done.returncode == 0, done.stdout + done.stderr


def test_api_reference_is_checked_with_transformers():
    pytest.importorskip("transformers")
    done = run_check()
    assert "not checked" not in done.stdout, done.stdout


def test_check_fails_on_a_stale_block(tmp_path):
    """--check reports a block that differs from the code and writes nothing; writing brings it up to date."""
    (tmp_path / "docs").mkdir()
    stale = "# x\n<!-- support-matrix:begin -->\n| stale |\n<!-- support-matrix:end -->\n"
    (tmp_path / "README.md").write_text(stale)
    (tmp_path / "docs" / "api.md").write_text((ROOT / "docs" / "api.md").read_text())
    done = run_check("--root", str(tmp_path))
    assert done.returncode == 1 and "README.md" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "README.md").read_text() == stale
    if importlib.util.find_spec("transformers") is not None:
        wrote = subprocess.run(
            [sys.executable, str(MAKE_DOCS), "--root", str(tmp_path)], capture_output=True, text=True
        )
        assert wrote.returncode == 0, wrote.stdout + wrote.stderr
        assert "| K3V3 |" in (tmp_path / "README.md").read_text()
        assert run_check("--root", str(tmp_path)).returncode == 0


def test_support_matrix_lists_every_fused_width():
    from flash_attn_tq.kernel_cases import FUSED_DECODE_BITS

    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- support-matrix:begin -->")[1].split("<!-- support-matrix:end -->")[0]
    for kb, vb in FUSED_DECODE_BITS:
        assert f"| K{kb}V{vb} |" in block
