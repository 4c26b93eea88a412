"""tests/upstream/run.py on a small stand-in for upstream's test file (inside a stand-in sdist): the
alias package, the sampling, the per-function counts and reasons, the exit status."""

import importlib.util
import io
import json
import sys
import tarfile
import textwrap
import zlib
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parent / "upstream" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("upstream_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STAND_IN = """
import os
import time

import pytest
import torch
from flash_attn import flash_attn_func, flash_attn_with_kvcache
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.flash_attn_interface import _get_block_size_n
from flash_attn.layers.rotary import apply_rotary_emb

is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)


@pytest.mark.parametrize("i", range(40))
def test_sampled(i):
    assert is_sm90
    q = torch.randn(1, 4, 2, 8, device="cuda")
    window = torch.randint(0, 4, (2,))
    out = flash_attn_func(q, q, q, window_size=window)
    assert out.shape == q.shape and out.device.type == "cpu"


@pytest.mark.parametrize("d", [32, 64, 128])
def test_fails(d):
    assert _get_block_size_n("cuda", d, True, False) == 64, "width"


def test_raises():
    cache = torch.zeros(1, 2, 1, 8)
    flash_attn_with_kvcache(torch.zeros(1, 1, 1, 8), cache, cache, window_size=(1.5, 2))


@pytest.mark.parametrize("x", [0, 1])
def test_skips(x):
    if x:
        pytest.skip("not together")


@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False


def test_never_selected():
    pass


@pytest.mark.parametrize("i", range(2))
def test_slow(i):
    if i and os.environ.get("STAND_IN_SLOW"):
        time.sleep(120)


@pytest.mark.parametrize("i", range(3))
def test_big(i):
    # STAND_IN_OOM = a marker file: out of memory the first time (and every time with "always")
    mark = os.environ.get("STAND_IN_OOM")
    if i == 1 and mark and (not os.path.exists(mark) or os.environ.get("STAND_IN_OOM_ALWAYS")):
        open(mark, "w").close()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. Process 7 has 70 GiB")
"""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdist") / "flash_attn-2.8.3.post2.tar.gz"
    data = textwrap.dedent(STAND_IN).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("flash_attn-2.8.3.post2/tests/test_flash_attn.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_sample_rates(run):
    assert run.sample_rates([]) == {"*": 1}
    assert run.sample_rates(["7", "test_x=3"]) == {"*": 7, "test_x": 3}
    for bad in ("0", "test_x=a", "-2"):
        with pytest.raises(SystemExit):
            run.sample_rates([bad])


def test_emulate_cpu_keeps_lines(run, tmp_path):
    f = tmp_path / "t.py"
    f.write_text("a = 'cuda'\nb = \"cuda\"\nc = 'cudagraph'\n")
    run.emulate_cpu(f)
    assert f.read_text() == "a = 'cpu'\nb = \"cpu\"\nc = 'cudagraph'\n"


def test_stand_in_suite(run, sdist, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["run.py"])
    out = tmp_path / "suite"
    never = next(i for i in range(1, 1000) if zlib.crc32(b"test_flash_attn.py::test_never_selected") % i)
    argv = ["--sdist", str(sdist), "--emulate-cpu", "--out", str(out) + ".json", "--sample", "3"]
    argv += ["--sample", f"test_never_selected={never}", "--sample", "test_fails=1", "-n", "2", "--timeout", "60"]
    rc = run.main(argv)
    assert rc == 1
    result = json.loads(out.with_suffix(".json").read_text())
    per = result["functions"]
    assert list(per)[:6] == [
        "test_sampled",
        "test_fails",
        "test_raises",
        "test_skips",
        "test_xfail",
        "test_never_selected",
    ]
    kept = sum(zlib.crc32(f"test_flash_attn.py::test_sampled[{i}]".encode()) % 3 == 0 for i in range(40))
    assert 0 < kept < 40
    assert per["test_sampled"] == dict(per["test_sampled"], collected=40, selected=kept, passed=kept, failed=0)
    assert per["test_sampled"]["deselected"] == 40 - kept
    assert per["test_never_selected"]["selected"] == 0 and per["test_never_selected"]["deselected"] == 1
    fails = per["test_fails"]
    assert (fails["passed"], fails["failed"]) == (1, 2)  # (widths 128, 64, 32)
    assert fails["failures"] == [
        dict(
            reason="test_flash_attn.py:26: AssertionError: width",
            count=2,
            example="test_flash_attn.py:26: AssertionError: width",
            first="test_flash_attn.py::test_fails[32]",
        )
    ]
    raises = per["test_raises"]
    if raises["selected"]:
        assert raises["failed"] == 1 and "window_size must be a pair of ints" in raises["failures"][0]["example"]
    skips = per["test_skips"]
    assert skips["passed"] + skips["skipped"] == skips["selected"]
    assert result["totals"]["failed"] == fails["failed"] + raises["failed"]
    stamp = result["stamp"]
    assert stamp["sdist"] == sdist.name and stamp["sample"]["*"] == 3 and stamp["gpu"].startswith("cpu")
    assert stamp["alias"]["block_size_n"] == "flash_attn_tq.baseline"
    md = out.with_suffix(".md").read_text()
    assert "| `test_fails` | 3 | 0 | 1 | 2 |" in md and "## Exclusion classes" in md


def test_all_passing_exits_zero(run, sdist, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run.py"])
    out = tmp_path / "suite"
    rc = run.main(["--sdist", str(sdist), "--emulate-cpu", "--out", str(out), "-k", "test_sampled or test_skips"])
    assert rc == 0
    per = json.loads(out.with_suffix(".json").read_text())["functions"]
    assert per["test_sampled"]["passed"] == 40 and per["test_skips"]["skipped"] == 1
    assert per["test_skips"]["skips"] == [dict(reason="not together", count=1)]
    assert per["test_fails"]["selected"] == 0 and per["test_fails"]["deselected"] == 3


def test_missing_sdist(run, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        run.main(["--sdist", str(tmp_path / "nope.tar.gz")])


def test_deadline(run, sdist, tmp_path, monkeypatch):
    """A run stopped at its --deadline reports what ran; the rest counts as not run (exit status 1)."""
    monkeypatch.setattr(sys, "argv", ["run.py"])
    monkeypatch.setenv("STAND_IN_SLOW", "1")
    out = tmp_path / "suite"
    argv = ["--sdist", str(sdist), "--emulate-cpu", "--out", str(out), "-k", "test_slow", "--deadline", "20"]
    assert run.main(argv) == 1
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["stamp"]["stopped_at_deadline"] == 20
    row = result["functions"]["test_slow"]
    assert (row["selected"], row["passed"], row["failed"], row["not_run"]) == (2, 1, 0, 1)
    assert "stopped at its --deadline of 20 s" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("always", [False, True])
@pytest.mark.parametrize("rerun", [False, True])
def test_out_of_memory(run, sdist, tmp_path, monkeypatch, always, rerun):
    """A test out of GPU memory beside other workers counts apart (exit status 1: no verdict);
    --rerun-oom runs it again alone, where it passes, or fails for good if it runs out again."""
    monkeypatch.setattr(sys, "argv", ["run.py"])
    monkeypatch.setenv("STAND_IN_OOM", str(tmp_path / "mark"))
    if always:
        monkeypatch.setenv("STAND_IN_OOM_ALWAYS", "1")
    out = tmp_path / "suite"
    argv = ["--sdist", str(sdist), "--emulate-cpu", "--out", str(out), "-k", "test_big"] + ["--rerun-oom"] * rerun
    rc = run.main(argv)
    result = json.loads(out.with_suffix(".json").read_text())
    row, md = result["functions"]["test_big"], out.with_suffix(".md").read_text()
    counts = (row["passed"], row["failed"], row["oom"], row["not_run"])
    if not rerun:
        assert rc == 1 and counts == (2, 0, 1, 0) and result["totals"]["oom"] == 1
        assert row["out_of_memory"] == [
            dict(line="test_flash_attn.py:61", count=1, first="test_flash_attn.py::test_big[1]")
        ]
        assert "## Out of GPU memory beside other workers (not rerun)" in md
        assert run.render(out.with_suffix(".json")) == 0  # (a second classification changes nothing)
        again = json.loads(out.with_suffix(".json").read_text())
        assert again["functions"] == result["functions"] and again["totals"] == result["totals"]
    elif always:
        assert rc == 1 and counts == (2, 1, 0, 0)
        assert row["failures"][0]["example"].startswith("test_flash_attn.py:61: (run alone) ")
    else:
        assert rc == 0 and counts == (3, 0, 0, 0) and result["stamp"]["rerun_oom"]["tests"] == 1
        assert "were run again one at a time" in md
