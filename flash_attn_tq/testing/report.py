"""Results stamps and writers for the benchmark scripts.

Every results file a script under ``benchmarks/`` writes carries a stamp (:func:`stamp`): the machine
(GPU name, CPU model), the torch and CUDA versions, the git commit, the date and the command line that
made it, so each table in ``benchmarks/results/`` names the one command that regenerates it. The
JSON files hold the stamp under ``"meta"``; the Markdown tables say it in a line under their title
(:func:`describe`, :func:`made_by`).

A value a run could not measure is ``None`` in the JSON and :data:`MISSING` in a table, with the
reason in a note under it (:func:`missing_notes`): a table never shows a number from another run.

Nothing here imports torch at module level, nor matplotlib (the optional plots import it when
drawn), so a CPU-only user can import this module cheaply. ``python -m flash_attn_tq.testing
WORDS...`` prints a one-line stamp for the command ``WORDS`` (for the logs shell scripts write).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

MISSING = "–"  # what a table shows where a run measured nothing (see missing_notes)


# ----------------------------------------------------------------------------------------- stamp


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """The checkout's short commit hash, ``"unknown"`` outside a git checkout.

    ``GIT_COMMIT`` in the environment wins: a copy of the tree without its ``.git`` (a device
    machine's) is stamped with what the caller passes. ``cwd`` defaults to the running script's
    directory (the checkout whose code is measured), else the working directory."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        return commit
    if cwd is None:
        script = Path(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
        cwd = script.resolve().parent if script is not None and script.exists() else Path.cwd()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that runs this process again, as a shell would take it: ``python SCRIPT ARGS``
    with SCRIPT relative to the working directory where it lies under it (``python -m pkg.mod``
    runs show as the module's file, the same program)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    script = argv[0]
    if script not in ("", "-c", "-m") and os.path.exists(script):
        path = Path(script).resolve()
        try:
            script = str(path.relative_to(Path.cwd().resolve()))
        except ValueError:
            script = str(path)
    return shlex.join(["python", script, *argv[1:]])


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_name() -> str | None:
    """The current CUDA device's name, None where torch sees no GPU."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def stamp(command: str | None = None, **extra: Any) -> dict[str, Any]:
    """The stamp of a results file: ``{"gpu", "cpu", "torch", "cuda", "commit", "date", "command"}``
    and ``extra`` (a script's own fields: the transformers version, thread counts, ...).

    ``gpu`` is None on a machine without one; ``cuda`` is torch's CUDA version (None for a CPU
    build); ``date`` is UTC; ``command`` defaults to :func:`command_line`."""
    import torch

    meta = {
        "gpu": gpu_name(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command or command_line(),
    }
    meta.update(extra)
    return meta


def describe(meta: Mapping[str, Any]) -> str:
    """``"NVIDIA H200, torch 2.11.0, CUDA 13.0, commit abc1234"`` (the CPU's model where the run had
    no GPU), for a table's title. Stamps of older files may lack fields: those are left out."""
    parts = [meta.get("gpu") or (f"CPU: {meta['cpu']}" if meta.get("cpu") else None)]
    if meta.get("torch"):
        parts.append(f"torch {meta['torch']}")
    if meta.get("cuda"):
        parts.append(f"CUDA {meta['cuda']}")
    if meta.get("transformers"):
        parts.append(f"transformers {meta['transformers']}")
    parts.append(f"commit {meta.get('commit') or 'unknown'}")
    return ", ".join(p for p in parts if p)


def made_by(meta: Mapping[str, Any]) -> str:
    """The line under a table's title that names the command which made it, and when (and the
    command that rendered the table again from its JSON, see :func:`rerendered`)."""
    when = f", {meta['date']}" if meta.get("date") else ""
    if meta.get("command"):
        line = f"Made by `{meta['command']}` (commit {meta.get('commit') or 'unknown'}{when})."
    else:
        line = f"Measured at commit {meta.get('commit') or 'unknown'}{when} (the command was not recorded)."
    if meta.get("rendered_by"):
        line += f" Table written again from its JSON by `{meta['rendered_by']}` ({meta.get('rendered_at')})."
    return line


def rerendered(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` with ``rendered_by`` (this process's command line) and ``rendered_at`` (UTC) added: the
    stamp of a table written again from a results JSON, its measurement's stamp kept as it was."""
    return dict(meta, rendered_by=command_line(), rendered_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


# ------------------------------------------------------------------------------------ formatting


def fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """``format(x, spec) + suffix``, or :data:`MISSING` for a value the run did not measure."""
    return MISSING if x is None else format(x, spec) + suffix


def missing_notes(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str]) -> list[str]:
    """Notes for a table's :data:`MISSING` cells: for each ``key: label`` of ``columns`` whose value
    is None in some rows, one line with the reasons those rows give under ``key + "_missing"``
    (their text, once each). No line for a column every row measured."""
    rows = list(rows)
    notes = []
    for key, label in columns.items():
        absent = [r for r in rows if r.get(key) is None]
        if not absent:
            continue
        reasons = sorted({str(r.get(f"{key}_missing") or "the reason was not recorded") for r in absent})
        count = "every row" if len(absent) == len(rows) else f"{len(absent)} of {len(rows)} rows"
        notes.append(f"{MISSING} under {label} ({count}): not measured in this run: {'; '.join(reasons)}.")
    return notes


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table's lines: the header, the rule, a line a row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------------------- writers


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it: a reader (or a run cut short)
    sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """``payload`` as indented JSON (values JSON cannot hold as their ``str``)."""
    path = Path(path)
    _replace(path, json.dumps(payload, indent=1, default=str) + "\n")
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` to ``path`` (a newline added where it lacks one)."""
    path = Path(path)
    _replace(path, text if text.endswith("\n") else text + "\n")
    return path


def save_plot(path: str | os.PathLike, draw: Callable[[Any], Any], dpi: int = 120) -> bool:
    """Draw a figure and save it as ``path``: ``draw(plt)`` gets ``matplotlib.pyplot`` (imported here,
    the Agg backend) and returns the figure. False, with the reason printed, where matplotlib is not
    installed or the drawing fails: the tables are the result, a plot is a convenience."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot {Path(path).name}: {e}")
        return False
    try:
        fig = draw(plt)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
    except Exception as e:  # (a plot never fails the run)
        print(f"no plot {Path(path).name}: {type(e).__name__}: {e}")
        return False
    return True


def write_results(
    out_dir: str | os.PathLike,
    stem: str,
    payload: Mapping[str, Any],
    markdown: str | None = None,
    plot: Callable[[Any], Any] | None = None,
) -> list[Path]:
    """``<stem>.json`` (``payload``), ``<stem>.md`` (``markdown``) and ``<stem>.png`` (``plot``, see
    :func:`save_plot`) under ``out_dir``; returns the paths written.

    ``payload["meta"]`` must hold the run's :func:`stamp` (with its command; for a table written
    again from an older JSON, :func:`rerendered`'s): no results file without the command that made
    it. Each file is replaced whole, so a script may call this after every row and a run cut short
    keeps what it measured.
    """
    meta = payload.get("meta")
    if not isinstance(meta, Mapping) or not (meta.get("command") or meta.get("rendered_by")):
        raise ValueError("a results payload carries its stamp, with the command, under 'meta'")
    out = Path(out_dir)
    written = [write_json(out / f"{stem}.json", payload)]
    if markdown is not None:
        written.append(write_text(out / f"{stem}.md", markdown))
    if plot is not None and save_plot(out / f"{stem}.png", plot):
        written.append(out / f"{stem}.png")
    return written
