#!/usr/bin/env python3
"""Runs upstream flash-attn 2.8.3's own ``tests/test_flash_attn.py`` against flash_attn_tq.

The test file is taken from upstream's sdist into a temporary folder (never into this repository),
beside an alias package ``flash_attn`` whose attention functions are flash_attn_tq's, and run there
by pytest with a small plugin that samples the tests and records each outcome.  The results, per
test function of the file, go to ``benchmarks/results/upstream_suite.json`` and ``.md``.

    python tests/upstream/run.py --sdist flash_attn-2.8.3.post2.tar.gz \\
        --sample 40 --sample test_flash_attn_kvcache=40 -n 8 --timeout 600

``--sample N`` keeps a test when ``zlib.crc32(nodeid) % N == 0`` (the same tests on every machine);
``--sample FUNCTION=N`` sets one function's rate.  ``-k``, ``--timeout`` (pytest-timeout) and
``-n`` (pytest-xdist) go to pytest; the last two are dropped, with a note, where the plugin is
missing.  ``--emulate-cpu`` (a developer option, for machines without a GPU) runs the file on the
CPU: its ``"cuda"`` devices become ``"cpu"`` and the GPU queries it makes answer as an H100 (sm_90).
A test that fails for want of GPU memory while other workers share the GPU is counted apart (no
verdict on it: the run is incomplete); ``--rerun-oom`` runs those again one at a time, where
running out of memory is a failure.  ``--render RESULTS.json`` writes a results file and its .md
again (after a change to the classification).  Exit status 1 when a test failed (outside the
exclusion classes below), ran out of memory beside other workers or did not run; 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDIST_NAME = "flash_attn-2.8.3.post2.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/6c/b1/"
    "b77625e3d11260d2bd6a4fc249a4be9a3da97ff848e2222e810c4f0e0211/" + SDIST_NAME
)
TEST_FILE = "tests/test_flash_attn.py"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "upstream_suite"
FUNCS = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

# Failures of a known cause that an upstream reviewer would accept as not ours to fix, each a dict:
# id, why (the reason, for the .md), and the rule that picks them: function (a test function, or
# None for any), nodeid and reason (regexes searched in the node id and in the failure's reason).
# A failure matching none of them counts as a failure.
EXCLUSIONS: list[dict] = []

# Causes looked at and found to need no exclusion with this test file (the .md lists them).
NOT_EXCLUDED = [
    (
        "dropout pattern bit-equal to upstream's kernel (Philox)",
        "none of the file's tests needs it: each dropout test reads the keep mask back from the "
        "S_dmask the function returns (our baseline writes it in upstream's encoding and shape), "
        "and test_flash_attn_race_condition reseeds torch's generator before each call, which the "
        "baseline draws its mask from, so its repeated calls must be bit-equal here too",
    ),
]

# ---------------------------------------------------------------------------- files in the temp dir

ALIAS_INIT = f'''"""flash_attn, as an alias of flash_attn_tq (written by tests/upstream/run.py)."""

from flash_attn_tq import {", ".join(FUNCS)}

__version__ = "2.8.3"
'''

ALIAS_INTERFACE = f'''"""flash_attn.flash_attn_interface, as an alias of flash_attn_tq."""

from flash_attn_tq import {", ".join(FUNCS)}
from flash_attn_tq.baseline import get_block_size_n as _get_block_size_n
'''

ALIAS_BERT_PADDING = '''"""flash_attn.bert_padding, as an alias of flash_attn_tq.bert_padding."""

from flash_attn_tq.bert_padding import *  # noqa: F401,F403
from flash_attn_tq.bert_padding import __all__  # noqa: F401
'''

ALIAS_ROTARY = '''"""flash_attn.layers.rotary, as an alias of flash_attn_tq.layers.rotary."""

from flash_attn_tq.layers.rotary import *  # noqa: F401,F403
from flash_attn_tq.layers.rotary import __all__  # noqa: F401
'''

# The GPU queries of the test file, answered as an H100 would (--emulate-cpu only).
EMULATE_CONFTEST = '''"""Answers the test file's GPU queries as an H100 (sm_90, 80 GiB) would: --emulate-cpu."""

import types

import torch

torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (emulated)", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132
)
'''

PLUGIN = r'''"""pytest plugin of tests/upstream/run.py: samples the tests, records their outcomes."""

import json
import os
import zlib

import pytest

RESULTS = os.environ["FLASH_ATTN_TQ_UPSTREAM_RESULTS"]
SAMPLE = json.loads(os.environ["FLASH_ATTN_TQ_UPSTREAM_SAMPLE"])
TEST_FILE = os.path.basename(os.environ["FLASH_ATTN_TQ_UPSTREAM_TEST_FILE"])
_config = None
_log = None  # outcomes.jsonl: [nodeid, status, line of the test file or None, first line of the message or None]


def _function(nodeid):
    return nodeid.split("::")[-1].split("[")[0]


def _rate(nodeid):
    return int(SAMPLE.get(_function(nodeid), SAMPLE["*"]))


def pytest_configure(config):
    global _config
    _config = config
    if not hasattr(config, "workerinput"):  # (once, in the main process)
        import flash_attn
        import flash_attn.flash_attn_interface as alias
        import flash_attn_tq

        for name in ("flash_attn_func", "flash_attn_with_kvcache"):
            if getattr(flash_attn, name) is not getattr(flash_attn_tq, name):
                raise pytest.UsageError(f"flash_attn.{name} is not flash_attn_tq's: the alias is not first on sys.path")
        _write("alias.json", dict(flash_attn=flash_attn.__file__, flash_attn_tq=flash_attn_tq.__file__,
                                  block_size_n=alias._get_block_size_n.__module__))


def _write(name, data):
    path = os.path.join(RESULTS, name)
    with open(path + f".{os.getpid()}", "w") as f:
        json.dump(data, f)
    os.replace(path + f".{os.getpid()}", path)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(session, config, items):
    collected = {}
    for item in items:
        collected[_function(item.nodeid)] = collected.get(_function(item.nodeid), 0) + 1
    kept = [item for item in items if zlib.crc32(item.nodeid.encode()) % _rate(item.nodeid) == 0]
    dropped = [item for item in items if zlib.crc32(item.nodeid.encode()) % _rate(item.nodeid) != 0]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    yield  # (-k and the other plugins deselect here)
    selected = {}
    for item in items:
        selected[_function(item.nodeid)] = selected.get(_function(item.nodeid), 0) + 1
    _write("collected.json", {f: dict(collected=n, selected=selected.get(f, 0)) for f, n in collected.items()})


def _reason(report):
    """(the test file's line that raised, or None; the first line of the message)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        reason = (str(longrepr[2]).splitlines() or ["skipped"])[0]
        return None, reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason
    crash = getattr(longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(longrepr)
    lines = [line for line in message.splitlines() if line.strip()] or ["(no message)"]
    first = lines[0].strip()
    where = None
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    for entry in entries:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None and os.path.basename(str(loc.path)) == TEST_FILE:
            where = loc.lineno
    if where is None and crash is not None and os.path.basename(str(crash.path)) == TEST_FILE:
        where = crash.lineno
    return where, first


def pytest_runtest_logreport(report):
    if _config is None or hasattr(_config, "workerinput"):  # (xdist: recorded in the main process)
        return
    status = None
    if report.failed:
        status = "failed"
    elif report.skipped:
        status = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call":
        status = "xpassed" if hasattr(report, "wasxfail") else "passed"
    if status is None:
        return
    where, message = (None, None) if status in ("passed", "xpassed", "xfailed") else _reason(report)
    if status == "failed" and report.when != "call":
        message = f"(in {report.when}) {message}"
    # one line a report, written at once: a run stopped part way keeps what it did (the runner
    # keeps each test's worst outcome)
    global _log
    if _log is None:
        _log = open(os.path.join(RESULTS, "outcomes.jsonl"), "a", buffering=1)
    _log.write(json.dumps([report.nodeid, status, where, message]) + "\n")
'''

# --------------------------------------------------------------------------------------- helpers


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="Run upstream flash-attn 2.8.3's tests/test_flash_attn.py against flash_attn_tq.",
        epilog="Arguments after -- go to pytest unchanged.",
    )
    ap.add_argument(
        "--sdist",
        type=Path,
        help=f"upstream's sdist ({SDIST_NAME}); default: downloaded once into ~/.cache/flash_attn_tq/",
    )
    ap.add_argument(
        "--sample",
        action="append",
        default=[],
        metavar="N | FUNCTION=N",
        help="keep a test when crc32(nodeid) %% N == 0 (default 1: all); FUNCTION=N for one test function",
    )
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=float, help="seconds per test (pytest-timeout)")
    ap.add_argument("-n", dest="workers", help="pytest-xdist workers (a number or 'auto')")
    ap.add_argument(
        "--deadline",
        type=float,
        help="stop pytest after this many seconds and report what ran (the rest counts as not run)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results path, without or with .json (.md beside it)")
    ap.add_argument("--emulate-cpu", action="store_true", help="developer option: run the file on the CPU (see above)")
    ap.add_argument("--keep-temp", action="store_true", help="keep the temporary folder (its path is printed)")
    ap.add_argument(
        "--rerun-oom",
        action="store_true",
        help="run the tests that ran out of GPU memory beside other workers again, one at a time",
    )
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only write the .json and .md again from a results .json (its failures classified as now)",
    )
    args, extra = ap.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    elif extra:
        ap.error(f"unknown arguments {extra} (pytest's go after --)")
    args.pytest_args = extra
    return args


def sample_rates(specs):
    rates = {"*": 1}
    for spec in specs:
        name, _, value = spec.rpartition("=")
        try:
            rate = int(value)
        except ValueError:
            rate = 0
        if rate < 1:
            raise SystemExit(f"--sample {spec}: the rate must be a positive integer")
        rates[name or "*"] = rate
    return rates


def find_sdist(path):
    if path is not None:
        if not path.is_file():
            raise SystemExit(f"--sdist {path}: no such file")
        return path
    cached = Path.home() / ".cache" / "flash_attn_tq" / SDIST_NAME
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {SDIST_URL}\n  -> {cached}", flush=True)
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response, open(f"{cached}.part", "wb") as f:
            while chunk := response.read(1 << 20):
                f.write(chunk)
        os.replace(f"{cached}.part", cached)
    except OSError as err:
        raise SystemExit(
            f"could not download upstream's sdist ({err}).\n"
            f"Fetch {SDIST_URL} on a machine with access and pass it with --sdist PATH "
            f"(or put it at {cached})."
        )
    return cached


def extract_test_file(sdist, dest):
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.split("/", 1)[-1] == TEST_FILE]
        if not members:
            raise SystemExit(f"{sdist}: no {TEST_FILE} inside")
        data = tar.extractfile(members[0]).read().decode()
    path = dest / "test_flash_attn.py"
    path.write_text(data)
    return path


def emulate_cpu(test_file):
    """The file's CUDA devices -> the CPU (line numbers unchanged)."""
    text = test_file.read_text()
    text = re.sub(r"""(["'])cuda\1""", r"\1cpu\1", text)
    test_file.write_text(text)


def write_alias(dest):
    pkg = dest / "flash_attn"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text(ALIAS_INIT)
    (pkg / "flash_attn_interface.py").write_text(ALIAS_INTERFACE)
    (pkg / "bert_padding.py").write_text(ALIAS_BERT_PADDING)
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "rotary.py").write_text(ALIAS_ROTARY)


def test_functions(test_file):
    tree = ast.parse(test_file.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]


def git_commit():
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    if os.environ.get("GIT_COMMIT"):  # (a copy of the tree without its history names its commit so)
        return os.environ["GIT_COMMIT"]
    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine(emulated):
    import torch

    if emulated:
        gpu = "cpu (--emulate-cpu: the test file's GPU queries answered as an H100, sm_90)"
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = "cpu"
    return dict(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda or "none")


def has_extension(env):
    """Whether the tests' processes (``env``: theirs) import the built extension."""
    probe = "from flash_attn_tq import ops; print(ops.extension_available())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return done.stdout.strip() == "True"


def run_pytest(cmd, cwd, env, deadline):
    """Runs pytest in a process group of its own; past ``deadline`` seconds interrupts the group as
    Ctrl-C would, and kills it a minute later (pytest-xdist's workers may go on past an interrupt;
    the outcomes so far are on disk either way).  Returns (exit status, stopped)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=deadline), False
    except subprocess.TimeoutExpired:
        print(f"\n--deadline: {deadline:g} s passed, stopping pytest", flush=True)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=60), True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True
    finally:
        if proc.poll() is None:  # (the runner itself interrupted)
            os.killpg(proc.pid, signal.SIGKILL)


def rerun_alone(cmd, test_file, nodeids, cwd, env, deadline):
    """Runs ``nodeids`` again in one pytest process (no xdist workers: each test has the GPU to
    itself). Returns (exit status, nodeid -> outcome, failure messages marked as run alone)."""
    base = list(cmd)
    if "-n" in base:
        del base[base.index("-n") : base.index("-n") + 2]
    base.remove(str(test_file))
    results = cwd / "results_alone"
    results.mkdir()
    print(f"$ (again, one at a time) {len(nodeids)} tests that ran out of GPU memory", flush=True)
    rc, _ = run_pytest(base + nodeids, cwd, dict(env, FLASH_ATTN_TQ_UPSTREAM_RESULTS=str(results)), deadline)
    outcomes = read_outcomes(results / "outcomes.jsonl")
    marked = {n: [st, at, ALONE + (msg or "") if st == "failed" else msg] for n, (st, at, msg) in outcomes.items()}
    return rc, marked


def render(path):
    """Writes ``path`` (a results .json) and its .md again, the failures classified as now."""
    result = json.loads(path.read_text())
    for row in result["functions"].values():
        row.setdefault("oom", 0)
        split_out_of_memory(row)
    result["totals"] = totals_of(result["functions"])
    result["stamp"]["rendered"] = f"classified again by `run.py --render` at {git_commit()}"
    path.write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(path.with_suffix(".md"), result)
    return 0


def totals_of(per):
    keys = ("collected", "deselected", "passed", "failed", "oom", "excluded", "skipped", "xfailed", "xpassed")
    return {k: sum(row[k] for row in per.values()) for k in (*keys, "not_run")}


def matches_exclusion(rule, function, nodeid, reason):
    return (
        rule.get("function") in (None, function)
        and re.search(rule.get("nodeid", ""), nodeid) is not None
        and re.search(rule.get("reason", ""), reason or "") is not None
    )


RANK = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 3, "failed": 4}
# a failure for want of GPU memory says nothing of the test while other workers share the GPU: its
# own class (the run is incomplete) until it runs alone (--rerun-oom), where it counts as a failure
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory")
ALONE = "(run alone) "


def split_out_of_memory(row):
    """Moves ``row``'s failures for want of GPU memory (not run alone) from ``failures``/``failed`` to
    ``out_of_memory`` (grouped by the test file's line) and ``oom``."""
    kept, lines = [], {g["line"]: dict(g) for g in row.get("out_of_memory", [])}
    for e in row["failures"]:
        if ALONE in e["example"] or not OUT_OF_MEMORY.search(e["example"]):
            kept.append(e)
            continue
        line = e["example"].split(": ", 1)[0] if e["example"].startswith("test_flash_attn.py:") else "?"
        group = lines.setdefault(line, dict(line=line, count=0, first=e["first"]))
        group["count"] += e["count"]
        row["failed"] -= e["count"]
        row["oom"] += e["count"]
    row["failures"] = kept
    row["out_of_memory"] = sorted(lines.values(), key=lambda g: -g["count"])


def read_outcomes(path):
    """nodeid -> [status, line, message]: each test's worst report (a failed teardown after a passed
    call is a failure)."""
    outcomes = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                nodeid, status, where, message = json.loads(line)
            except ValueError:  # (a line cut short by a kill)
                continue
            old = outcomes.get(nodeid)
            if old is None or RANK[status] > RANK[old[0]]:
                outcomes[nodeid] = [status, where, message]
    return outcomes


def summarize(functions, collected, outcomes):
    per = {}
    for f in functions:
        c = collected.get(f, dict(collected=0, selected=0))
        per[f] = dict(
            collected=c["collected"],
            selected=c["selected"],
            deselected=c["collected"] - c["selected"],
            passed=0,
            failed=0,
            oom=0,
            excluded=0,
            skipped=0,
            xfailed=0,
            xpassed=0,
            not_run=0,
            failures={},
            exclusions={},
            skips={},
        )
    for nodeid, (status, where, message) in outcomes.items():
        f = nodeid.split("::")[-1].split("[")[0]
        row = per.setdefault(f, summarize([f], {}, {})[f])
        at = "" if where is None else f"test_flash_attn.py:{where}: "
        reason = at + (message or "")
        if status == "failed":
            rule = next((r for r in EXCLUSIONS if matches_exclusion(r, f, nodeid, reason)), None)
            if rule is not None:
                row["excluded"] += 1
                row["exclusions"][rule["id"]] = row["exclusions"].get(rule["id"], 0) + 1
                continue
            # one entry per line and message, the message's numbers (which differ case to case) as #
            key = at + re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", message or "")
            entry = row["failures"].setdefault(key, dict(reason=key, count=0, example=reason, first=nodeid))
            entry["count"] += 1
        elif status == "skipped":
            row["skips"][reason] = row["skips"].get(reason, 0) + 1
        row[status] += 1
    for row in per.values():
        row["not_run"] = row["selected"] - sum(
            row[s] for s in ("passed", "failed", "excluded", "skipped", "xfailed", "xpassed")
        )
        row["failures"] = sorted(row["failures"].values(), key=lambda e: -e["count"])
        split_out_of_memory(row)
        row["exclusions"] = [dict(id=k, count=n) for k, n in row["exclusions"].items()]
        row["skips"] = [dict(reason=k, count=n) for k, n in sorted(row["skips"].items(), key=lambda kv: -kv[1])]
    return per


def write_markdown(path, result):
    stamp, per, totals = result["stamp"], result["functions"], result["totals"]
    rates = ", ".join(f"{k}={v}" if k != "*" else f"default={v}" for k, v in stamp["sample"].items())
    lines = [
        "# Upstream flash-attn 2.8.3 test suite against flash_attn_tq",
        "",
        f"Upstream's own `{TEST_FILE}` (from `{stamp['sdist']}`), run by `tests/upstream/run.py` with an alias "
        "package `flash_attn` whose attention functions are flash_attn_tq's.",
        "",
        f"- date: {stamp['date']}",
        f"- machine: {stamp['gpu']}; torch {stamp['torch']}, CUDA {stamp['cuda']}",
        f"- flash_attn_tq: {stamp['commit']} (CUDA extension {'built' if stamp['extension'] else 'not built'})",
        f"- command: `{stamp['command']}`",
        f"- pytest: `{stamp['pytest_command']}` (exit status {result['pytest_exit_status']})",
        f"- sample rates (a test is kept when crc32(nodeid) % N == 0): {rates}"
        + (f"; -k `{stamp['keyword']}`" if stamp["keyword"] else ""),
        *([f"- {stamp['rendered']}"] if stamp.get("rendered") else []),
        "",
        "| test function | collected | deselected | passed | failed | out of GPU memory | excluded | skipped "
        "| xfailed | not run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in [*per.items(), ("**all**", totals)]:
        lines.append(
            f"| {name if name.startswith('*') else f'`{name}`'} | {row['collected']} | {row['deselected']} | "
            f"{row['passed']} | {row['failed']} | {row.get('oom', 0)} | {row['excluded']} | {row['skipped']} | "
            f"{row['xfailed']} | {row['not_run']} |"
        )
    lines += ["", "`not run`: selected but without an outcome (pytest stopped or a worker died)."]
    lines.append(
        "`out of GPU memory`: failed for want of GPU memory while other pytest workers shared the GPU: "
        "no verdict on the test (the run is incomplete); `--rerun-oom` runs them again one at a time, "
        "where running out of memory counts as a failure."
    )
    if stamp.get("stopped_at_deadline"):
        lines.append(f"This run was stopped at its --deadline of {stamp['stopped_at_deadline']:g} s.")
    rerun = stamp.get("rerun_oom")
    if rerun:
        lines.append(
            f"{rerun['tests']} tests that ran out of GPU memory beside the other workers were run again one at a "
            f"time (pytest exit status {rerun['pytest_exit_status']}); their outcomes above are those runs'."
        )
    lines.append("")
    lines += ["## Failures", ""]
    failures = [(f, e) for f, row in per.items() for e in row["failures"]]
    if not failures:
        lines.append("None.")
    for f, e in failures:
        lines.append(f"- `{f}`: {e['count']} x `{e['example']}` (first: `{e['first']}`)")
    oom = [(f, g) for f, row in per.items() for g in row.get("out_of_memory", [])]
    if oom:
        lines += ["", "## Out of GPU memory beside other workers (not rerun)", ""]
        lines += [f"- `{f}`: {g['count']} x at `{g['line']}` (first: `{g['first']}`)" for f, g in oom]
    lines += ["", "## Exclusion classes", ""]
    if EXCLUSIONS:
        for rule in EXCLUSIONS:
            n = sum(x["count"] for row in per.values() for x in row["exclusions"] if x["id"] == rule["id"])
            lines.append(f"- `{rule['id']}` ({n} excluded): {rule['why']}")
    else:
        lines.append("None: every failure above counts.")
    lines += ["", "Looked at and not needed:", ""]
    lines += [f"- {what}: {why}." for what, why in NOT_EXCLUDED]
    lines += ["", "## Skips (the test file's own)", ""]
    skips = [(f, s) for f, row in per.items() for s in row["skips"]]
    lines += [f"- `{f}`: {s['count']} x {s['reason']}" for f, s in skips] or ["None."]
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------ main


def main(argv=None):
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(raw_argv)
    if args.render:
        return render(args.render)
    rates = sample_rates(args.sample)
    sdist = find_sdist(args.sdist)
    out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
    tmp = Path(tempfile.mkdtemp(prefix="fa_tq_upstream_"))
    try:
        test_file = extract_test_file(sdist, tmp)
        functions = test_functions(test_file)
        unknown = sorted(set(rates) - {"*"} - set(functions))
        if unknown:
            raise SystemExit(f"--sample: no test function {unknown} in {TEST_FILE}")
        if args.emulate_cpu:
            emulate_cpu(test_file)
            (tmp / "conftest.py").write_text(EMULATE_CONFTEST)
        write_alias(tmp)
        (tmp / "pytest.ini").write_text("[pytest]\n")  # (no ini file of a folder above applies)
        (tmp / "fa_tq_upstream_plugin.py").write_text(PLUGIN)
        results = tmp / "results"
        results.mkdir()

        cmd = [sys.executable, "-m", "pytest", str(test_file), "-p", "fa_tq_upstream_plugin", "-p", "no:cacheprovider"]
        cmd += ["--rootdir", str(tmp), "-q", "-o", "console_output_style=count", "--tb=short"]
        if args.keyword:
            cmd += ["-k", args.keyword]
        if args.timeout:
            if find_spec("pytest_timeout"):
                cmd += ["--timeout", str(args.timeout)]
            else:
                print("note: pytest-timeout is not installed: --timeout ignored", flush=True)
        if args.workers:
            if find_spec("xdist"):
                cmd += ["-n", str(args.workers)]
            else:
                print("note: pytest-xdist is not installed: -n ignored, the tests run in one process", flush=True)
        cmd += args.pytest_args
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), str(REPO), env.get("PYTHONPATH")) if p)
        env["FLASH_ATTN_TQ_UPSTREAM_RESULTS"] = str(results)
        env["FLASH_ATTN_TQ_UPSTREAM_SAMPLE"] = json.dumps(rates)
        env["FLASH_ATTN_TQ_UPSTREAM_TEST_FILE"] = str(test_file)
        print("$", shlex.join(cmd), flush=True)
        started = time.monotonic()
        rc, stopped = run_pytest(cmd, tmp, env, args.deadline)

        def load(name):
            path = results / name
            return json.loads(path.read_text()) if path.is_file() else {}

        collected, outcomes = load("collected.json"), read_outcomes(results / "outcomes.jsonl")
        oom = [n for n, (st, _, msg) in outcomes.items() if st == "failed" and OUT_OF_MEMORY.search(msg or "")]
        rerun = None
        if args.rerun_oom and oom and not stopped:
            left = None if args.deadline is None else max(1.0, args.deadline - (time.monotonic() - started))
            rerun_rc, again = rerun_alone(cmd, test_file, oom, tmp, env, left)
            outcomes.update(again)
            rerun = dict(tests=len(oom), pytest_exit_status=rerun_rc)
        per = summarize(functions, collected, outcomes)
        totals = totals_of(per)
        stamp = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            **machine(args.emulate_cpu),
            commit=git_commit(),
            extension=has_extension(env),
            sdist=sdist.name,
            command=shlex.join([Path(sys.executable).name, sys.argv[0] if argv is None else "run.py", *raw_argv]),
            pytest_command=shlex.join(["pytest", TEST_FILE, *cmd[cmd.index("--rootdir") + 2 :]]),
            sample=rates,
            keyword=args.keyword,
            stopped_at_deadline=args.deadline if stopped else None,
            rerun_oom=rerun,
            alias=load("alias.json"),
        )
        failed_run = not stopped and (rc not in (0, 1, 5) or (rc == 1 and not totals["failed"] and not outcomes))
        result = dict(
            stamp=stamp,
            pytest_exit_status=rc,
            totals=totals,
            functions=per,
            exclusion_classes=[dict(id=r["id"], why=r["why"]) for r in EXCLUSIONS],
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(out.with_suffix(".md"), result)
        width = max(len(f) for f in per)
        print(f"\n{'test function':<{width}}  collected  selected  passed  failed  no memory  excluded  skipped")
        for f, row in per.items():
            print(
                f"{f:<{width}}  {row['collected']:9d}  {row['selected']:8d}  {row['passed']:6d}  {row['failed']:6d}  "
                f"{row['oom']:9d}  {row['excluded']:8d}  {row['skipped']:7d}"
            )
        print(f"results: {out.with_suffix('.json')} and .md", flush=True)
        if failed_run:
            print(f"pytest ended with exit status {rc} (an error before or outside the tests)", flush=True)
        return 1 if totals["failed"] or totals["oom"] or totals["not_run"] or failed_run else 0
    finally:
        if args.keep_temp:
            print(f"temporary folder kept: {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
