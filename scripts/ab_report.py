"""Results files of a two-tree A/B (``scripts/ab_trees.sh``): ``<name>.json`` and ``<name>.md``.

    python -m scripts.ab_report AB_DIR --a REV --b REV [--command CMD] [--out benchmarks/results] [--name refactor_ab]

AB_DIR is the folder ab_trees.sh wrote (``decode_{A,B}_{round}.json``, ``eager_...``, ``gen_A``/``gen_B``
and ``ab_trees.json``). The stamp (GPU, torch, CUDA, date) is the B tree's generate run's. Tables:
the decode kernels as CUDA graphs (medians over rounds, B / A); the eager call's host-bound time a
round at a time, with the position each tree ran in within its round (a ratio compares the trees in
the same position: the position can move a host-bound time more than the trees differ); the
generate rows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from flash_attn_tq.testing import write_results


def load_rounds(folder: str, kind: str, tree: str) -> dict[int, dict]:
    out = {}
    for f in glob.glob(os.path.join(folder, f"{kind}_{tree}_*.json")):
        out[int(f.rsplit("_", 1)[1].split(".")[0])] = json.load(open(f))
    return out


def report(folder: str, a: str, b: str, command: str) -> tuple[dict, str]:
    meta = json.load(open(os.path.join(folder, "gen_B", "generate.json")))["meta"]
    stamp = f"{meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}; A = {a}, B = {b}; {meta['date']}"
    decode = {t: load_rounds(folder, "decode", t) for t in "AB"}
    eager = {t: load_rounds(folder, "eager", t) for t in "AB"}
    rounds = sorted(decode["A"])
    run = {k: meta[k] for k in ("gpu", "torch", "cuda", "date") if k in meta}
    res = {
        "meta": dict(run, commit=b, old_commit=a, command=command, rounds=len(rounds)),
        "decode_graph_us": {},
        "eager_us": {},
    }
    md = [
        f"# Two trees A/B: {a} (A) against {b} (B)",
        "",
        f"{stamp}. Made by `{command}`, then `python -m scripts.ab_report` on its folder.",
        "",
        "## Decode kernels as CUDA graphs (µs, medians over the rounds)",
        "",
        "32 q / 8 kv heads, head_dim 128, float16 (scripts/time_decode.py); `default` = TQCache's default layer mix.",
        "",
        "| B·S | config | A µs | B µs | B / A |",
        "|---|---|---:|---:|---:|",
    ]
    for shape, times in decode["A"][rounds[0]].items():
        for cfg in times:
            va, vb = (statistics.median(decode[t][r][shape][cfg] for r in rounds) for t in "AB")
            res["decode_graph_us"].setdefault(shape, {})[cfg] = dict(A=va, B=vb, ratio=vb / va)
            md.append(f"| {shape} | {cfg} | {va:.1f} | {vb:.1f} | {vb / va:.3f} |")
    md += [
        "",
        "## The eager call (µs a call, host-bound), round by round",
        "",
        "`flash_attn_with_kvcache(q, cache)` 200 calls back to back, wall time a call (scripts/eager_call.py); "
        "`_graph`: the same call replayed as a CUDA graph. Rounds alternate the order (odd rounds A first); "
        "B / A compares the two trees in the same position of their rounds.",
        "",
        "| B·S | measure | " + " | ".join(f"round {r}: A / B" for r in rounds) + " | B / A, first | B / A, second |",
        "|---|---|" + "---:|" * (len(rounds) + 2),
    ]
    first = {r: "A" if r % 2 else "B" for r in rounds}
    for shape, times in eager["A"][rounds[0]].items():
        for m in times:
            cells = [f"{eager['A'][r][shape][m]:.1f} / {eager['B'][r][shape][m]:.1f}" for r in rounds]
            pos = {}
            for where in ("first", "second"):
                at = {t: [eager[t][r][shape][m] for r in rounds if (first[r] == t) == (where == "first")] for t in "AB"}
                pos[where] = statistics.median(at["B"]) / statistics.median(at["A"]) if at["A"] and at["B"] else None
            res["eager_us"].setdefault(shape, {})[m] = dict(
                A=[eager["A"][r][shape][m] for r in rounds], B=[eager["B"][r][shape][m] for r in rounds], **pos
            )
            ratios = " | ".join("–" if x is None else f"{x:.2f}" for x in pos.values())
            md.append(f"| {shape} | {m} | " + " | ".join(cells) + f" | {ratios} |")
    gen = json.load(open(os.path.join(folder, "ab_trees.json")))
    rows = {k: v for k, v in gen.items() if k.startswith("generate")}
    if rows:
        res["generate"] = rows
        md += [
            "",
            "## generate (tokens/s, one run each)",
            "",
            "SmolLM2-135M's architecture, random weights, 2K prompt (benchmarks/bench_generate.py): `tq` the "
            "eager TQCache decode step, `tq_compiled` the step under torch.compile (CUDA graphs).",
            "",
            "| row | A | B | B / A |",
            "|---|---:|---:|---:|",
        ]
        for k, v in rows.items():
            md.append(f"| {k[len('generate ') :]} | {v['A']:.1f} | {v['B']:.1f} | {v['ratio']:.3f} |")
    return res, "\n".join(md) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--a", required=True, help="the A tree's commit")
    p.add_argument("--b", required=True, help="the B tree's commit")
    p.add_argument("--command", default="bash scripts/ab_trees.sh OLD_DIR 2")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="refactor_ab")
    args = p.parse_args(argv)
    res, md = report(args.folder, args.a, args.b, args.command)
    write_results(args.out, args.name, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
