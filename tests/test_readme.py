"""The README's Python examples run as written (on this machine: the CPU parts; a block that imports
transformers is skipped without it)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    code = BLOCKS[index]
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme_example"})
