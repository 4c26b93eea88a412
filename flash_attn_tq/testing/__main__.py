"""``python -m flash_attn_tq.testing COMMAND [ARGS...]``: print the one-line stamp of a log that
COMMAND writes (``# <machine, torch, CUDA, commit>, <date>: COMMAND ARGS``), for shell scripts whose
output lands in ``benchmarks/results/``."""

from __future__ import annotations

import shlex
import sys
from typing import Sequence

from .report import describe, stamp


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if words else 2
    meta = stamp(command=shlex.join(words))
    print(f"# {describe(meta)}, {meta['date']}: {meta['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
