"""The repository's layout rules for the measurement code: the benchmark scripts and tools share
code only through flash_attn_tq.testing (none imports another, none edits the import path), the
tests import no script, and the shared modules stay small and import no private names."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("benchmarks", "scripts")
PATH_EDITS = ("sys.path." + "insert", "sys.path." + "append", "PYTHON" + "PATH")  # (split: not found here)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # (a copy of the tree without .git)
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.is_file()]


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports; relative ones as '.')."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def script_modules() -> dict[str, Path]:
    return {p.stem: p for d in SCRIPT_DIRS for p in sorted((ROOT / d).glob("*.py")) if p.stem != "__init__"}


# tools that run a child interpreter over a checkout they are given (an A/B of two trees, upstream's
# suite against this one): its environment names that checkout
CHILD_RUNNERS = {"scripts/ab_host.sh", "scripts/ab_trees.sh", "tests/upstream/run.py"}


def test_no_import_path_edits():
    """No file edits Python's import path (results logs aside; a child runner sets its child's)."""
    offenders = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("benchmarks", "results") or path.suffix not in (".py", ".sh", ".md", ".toml", ".cfg"):
            continue
        text = path.read_text(errors="replace")
        edits = PATH_EDITS[:2] if rel.as_posix() in CHILD_RUNNERS else PATH_EDITS
        offenders += [f"{rel}: {edit}" for edit in edits if edit in text]
    assert not offenders, offenders


@pytest.mark.parametrize("directory", ["tests", *SCRIPT_DIRS])
def test_no_script_imports_a_script(directory):
    """Tests and scripts import no benchmark script or tool: what they share is in the package."""
    forbidden = set(script_modules()) | set(SCRIPT_DIRS)
    for path in sorted((ROOT / directory).glob("*.py")):
        bad = imported_modules(path) & forbidden
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_scripts_compile():
    for name, path in script_modules().items():
        compile(path.read_text(), str(path), "exec")


def test_testing_modules_are_small_and_import_no_private_names():
    for path in sorted((ROOT / "flash_attn_tq" / "testing").glob("*.py")):
        lines = path.read_text().count("\n")
        assert lines < 800, f"{path.name}: {lines} lines"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.name} imports {private} from {node.module}"


def test_package_modules_stay_small_and_the_cache_a_facade():
    """No module of the package over 800 lines, and QuantizedKVCache at most 400: its parts (storage,
    key transforms, writes, the fused and reference reads, health, state) live in their own modules."""
    for path in sorted((ROOT / "flash_attn_tq").rglob("*.py")):
        lines = path.read_text().count("\n")
        assert lines <= 800, f"{path.relative_to(ROOT)}: {lines} lines"
    tree = ast.parse((ROOT / "flash_attn_tq" / "cache.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QuantizedKVCache"]
    assert cls.end_lineno - cls.lineno + 1 <= 400
