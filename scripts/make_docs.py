"""Write the generated parts of the docs from the code, so that they cannot drift from it.

* README.md and docs/api.md, between ``<!-- support-matrix:begin -->`` and ``<!-- support-matrix:end -->``:
  the fused kernel cases, one row a (K, V) width (:func:`flash_attn_tq.dispatch.support_matrix`, which
  reads the case table the kernels are generated from).
* docs/api.md, between ``<!-- api:begin -->`` and ``<!-- api:end -->``: the public API's signatures
  (``inspect.signature``) and the first paragraphs of their docstrings, and :class:`CacheSpec`'s fields
  with their defaults. The transformers integration is imported for it (``pip install ".[transformers]"``).

    python scripts/make_docs.py            # rewrite the generated blocks
    python scripts/make_docs.py --check    # exit 1 if a block is out of date (nothing is written)

It documents the checkout's package: run as a file, it runs itself again as ``python -m
scripts.make_docs`` from the repository root (where that package comes first on the import path).
``--root DIR`` checks or writes DIR/README.md and DIR/docs/api.md instead of the checkout's. Without
transformers, ``--check`` checks the support matrix only and says so; writing needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100  # signature lines wrap here


def package():
    """The checkout's flash_attn_tq and the modules documented here (imported when first needed)."""
    import flash_attn_tq as fa
    from flash_attn_tq import dispatch, spec, verify

    if Path(fa.__file__).resolve().parents[1] != ROOT:
        raise SystemExit(f"make_docs: imported flash_attn_tq from {fa.__file__}, not this checkout: run it from {ROOT}")
    return fa, dispatch, spec, verify


# ----------------------------------------------------------------------------- text helpers


def rst_to_md(text: str) -> str:
    """The docstrings' reST roles and literals as Markdown code spans."""
    text = re.sub(r":[a-z]+:`~([^`]+)`", lambda m: "`" + m.group(1).split(".")[-1] + "`", text)  # ~: last part
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def paragraphs(obj: Any) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    return [p for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]


def args_section(paras: list[str]) -> list[str]:
    """A Google-style ``Args:`` paragraph as Markdown bullets (one an argument, continuation joined)."""
    for p in paras:
        lines = p.splitlines()
        if lines[0].strip() != "Args:":
            continue
        items: list[str] = []
        for line in lines[1:]:
            if re.match(r"^    \S", line):  # a new argument
                name, _, rest = line.strip().partition(": ")
                items.append(f"- `{name}`: {rest}")
            elif items:
                items[-1] += " " + line.strip()
        return [rst_to_md(item) for item in items]
    return []


def summary(obj: Any, count: int = 1, with_args: bool = True) -> str:
    """The first ``count`` docstring paragraphs (an ``Args:`` paragraph excluded), then the arguments."""
    paras = paragraphs(obj)
    text = [rst_to_md(p) for p in paras if not p.startswith("Args:")][:count]
    args = args_section(paras) if with_args else []
    if args:
        text.append("\n".join(args))
    return "\n\n".join(text)


def format_annotation(annotation: Any) -> str:
    if isinstance(annotation, str):  # (postponed annotations: the source text, forward references unquoted)
        return annotation.replace("'", "").replace('"', "")
    if isinstance(annotation, type):
        return annotation.__name__
    return inspect.formatannotation(annotation)


def format_param(p: inspect.Parameter) -> str:
    text = p.name
    if p.kind is p.VAR_POSITIONAL:
        text = "*" + text
    elif p.kind is p.VAR_KEYWORD:
        text = "**" + text
    if p.annotation is not p.empty:
        text += ": " + format_annotation(p.annotation)
    if p.default is not p.empty:
        text += (" = " if p.annotation is not p.empty else "=") + repr(p.default)
    return text


def signature(name: str, fn: Callable, method: bool = False) -> str:
    """``name(params) -> return``, wrapped at :data:`WIDTH` columns (``self``, or a ``method``'s first
    parameter whatever its name, left out)."""
    sig = inspect.signature(fn)
    parts, star = [], False
    for i, p in enumerate(sig.parameters.values()):
        if p.name == "self" or (method and i == 0):
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
        parts.append(format_param(p))
    ret = "" if sig.return_annotation is sig.empty else " -> " + format_annotation(sig.return_annotation)
    one = f"{name}({', '.join(parts)}){ret}"
    if len(one) <= WIDTH:
        return one
    lines, line = [], f"{name}("
    for i, part in enumerate(parts):
        piece = part + ("," if i < len(parts) - 1 else ")" + ret)
        if len(line) + len(piece) + 1 > WIDTH and line.strip() not in ("", f"{name}("):
            lines.append(line.rstrip())
            line = "    "
        line += piece + " "
    lines.append(line.rstrip())
    return "\n".join(lines)


def entry(title: str, name: str, fn: Callable, doc: Any = None, count: int = 1, method: bool = False) -> str:
    """One API entry: a heading, the signature as a code block, the docstring's first paragraphs."""
    body = summary(fn if doc is None else doc, count)
    return f"#### `{title}`\n\n```python\n{signature(name, fn, method)}\n```\n\n{body}\n"


def table(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the blocks


def support_matrix() -> str:
    _, dispatch, _, _ = package()
    return table(dispatch.support_matrix())


def spec_fields() -> str:
    """CacheSpec's fields: name, type, default, and the docstring's line about it."""
    _, _, spec, _ = package()
    bullets = {}
    for p in paragraphs(spec.CacheSpec):
        for item in re.split(r"\n(?=\* )", p):
            if not item.startswith("* "):
                continue
            text = " ".join(line.strip() for line in item[2:].splitlines())
            head, _, rest = text.partition(": ")
            for field in re.findall(r"``(\w+)``", head):
                bullets.setdefault(field, rest)
    rows = []
    for f in dataclasses.fields(spec.CacheSpec):
        meaning = bullets.get(f.name)
        if meaning is None:  # documented inside another field's line
            owner = next((k for k, v in bullets.items() if f"``{f.name}``" in v), None)
            meaning = f"see ``{owner}``" if owner else ""
        rows.append(
            {
                "field": f"`{f.name}`",
                "type": "`" + format_annotation(f.type).replace("|", "\\|") + "`",
                "default": f"`{f.default!r}`",
                "meaning": rst_to_md(meaning).replace("|", "\\|"),
            }
        )
    return table(rows)


def research_options() -> str:
    _, _, spec, _ = package()
    return table([{"option": f"`{k}`", "what it takes": v} for k, v in spec.RESEARCH.items()])


def api_reference() -> str:
    """The generated API reference (needs transformers: the integration is part of it)."""
    fa, dispatch, spec, verify = package()
    from flash_attn_tq.integrations.graphs import GraphDecoder
    from flash_attn_tq.integrations.transformers import TQCache

    Q, C = fa.QuantizedKVCache, spec.CacheSpec
    parts = ["### The flash-attn functions\n"]
    for fn in (
        fa.flash_attn_func,
        fa.flash_attn_kvpacked_func,
        fa.flash_attn_qkvpacked_func,
        fa.flash_attn_varlen_func,
        fa.flash_attn_varlen_kvpacked_func,
        fa.flash_attn_varlen_qkvpacked_func,
        fa.flash_attn_with_kvcache,
        fa.last_path,
    ):
        parts.append(entry(fn.__name__, fn.__name__, fn, count=2))
    parts.append("### A serving step, planned once for every layer\n")
    parts.append(entry("plan_varlen", "plan_varlen", fa.plan_varlen))
    parts.append(entry("VarlenPlan", "VarlenPlan", fa.VarlenPlan))
    parts.append(entry("VarlenPlan.check", "plan.check", fa.VarlenPlan.check, method=True))
    parts.append("### The quantized cache\n")
    parts.append(entry("QuantizedKVCache", "QuantizedKVCache", Q, count=2))
    for m in ("append", "crop", "attend", "plan", "dequantize", "health", "state_dict", "load_state_dict"):
        count = 2 if m == "append" else 1
        parts.append(entry(f"QuantizedKVCache.{m}", f"cache.{m}", getattr(Q, m), count=count, method=True))
    parts.append(entry("QuantizedKVCache.from_state_dict", "QuantizedKVCache.from_state_dict", Q.from_state_dict))
    parts.append("### `CacheSpec`\n")
    parts.append(f"```python\n{signature('CacheSpec', C)}\n```\n\n{summary(C)} Its fields:\n\n{spec_fields()}\n")
    parts.append(
        "Research options (`flash_attn_tq.spec.RESEARCH`; `spec.research` lists those a spec turns on):\n\n"
        + research_options()
        + "\n"
    )
    for m in ("replace", "of", "bits_per_element"):
        parts.append(entry(f"CacheSpec.{m}", f"spec.{m}" if m != "of" else "CacheSpec.of", getattr(C, m)))
    parts.append("### Which kernel runs\n")
    parts.append(entry("dispatch.plan", "flash_attn_tq.dispatch.plan", dispatch.plan))
    parts.append(entry("dispatch.Plan", "flash_attn_tq.dispatch.Plan", dispatch.Plan))
    parts.append("### The CPU cache\n")
    parts.append(entry("CpuQuantizedKVCache", "CpuQuantizedKVCache", fa.CpuQuantizedKVCache))
    parts.append("### transformers\n")
    parts.append(entry("TQCache", "flash_attn_tq.integrations.transformers.TQCache", TQCache))
    parts.append(entry("TQCache.calibrated", "TQCache.calibrated", TQCache.calibrated))
    parts.append(entry("GraphDecoder", "flash_attn_tq.integrations.graphs.GraphDecoder", GraphDecoder))
    for m in ("prefill", "step", "generate"):
        parts.append(entry(f"GraphDecoder.{m}", f"decoder.{m}", getattr(GraphDecoder, m)))
    parts.append("### `verify`\n")
    parts.append(summary(verify, count=5) + "\n")
    for fn in (verify.main, verify.run, verify.save_qkv):
        parts.append(entry(f"verify.{fn.__name__}", f"flash_attn_tq.verify.{fn.__name__}", fn))
    return "\n".join(parts).rstrip() + "\n"


# ----------------------------------------------------------------------------- files


def replace_block(text: str, name: str, body: str, path: Path) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{path}: needs exactly one {begin} ... {end} pair")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body.rstrip()}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if a block is out of date")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree whose README.md and docs/api.md to use")
    args = ap.parse_args(argv)
    readme, api = args.root / "README.md", args.root / "docs" / "api.md"
    with_transformers = importlib.util.find_spec("transformers") is not None
    if not with_transformers and not args.check:
        print("make_docs: the API page documents TQCache: pip install '.[transformers]' first", file=sys.stderr)
        return 2
    matrix = support_matrix()
    blocks = {readme: {"support-matrix": matrix}, api: {"support-matrix": matrix}}
    if with_transformers:
        blocks[api]["api"] = api_reference()
    else:
        print("make_docs: transformers is not installed: the API block of docs/api.md is not checked")
    stale = []
    for path, names in blocks.items():
        old = path.read_text()
        new = old
        for name, body in names.items():
            new = replace_block(new, name, body, path)
        if new != old:
            stale.append(path.relative_to(args.root))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))} (run python scripts/make_docs.py)")
        return 1
    print("up to date" if args.check else f"written: {', '.join(map(str, stale)) or 'nothing changed'}")
    return 0


def as_module(argv: list[str]) -> int:
    """Run again as ``python -m scripts.make_docs`` from the root (a ``--root`` resolved here first)."""
    args = [str(Path(a).resolve()) if i and argv[i - 1] == "--root" else a for i, a in enumerate(argv)]
    args = [f"--root={Path(a[7:]).resolve()}" if a.startswith("--root=") else a for a in args]
    return subprocess.call([sys.executable, "-m", "scripts.make_docs", *args], cwd=ROOT)


if __name__ == "__main__":
    # run as a file, it would import whichever flash_attn_tq is installed: run from the root as a module
    sys.exit(main() if __package__ else as_module(sys.argv[1:]))
