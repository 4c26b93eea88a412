"""Measurement scripts; each writes its tables to ``benchmarks/results/`` stamped with the command
that made them. Run one as ``python benchmarks/NAME.py`` with the package installed from this
checkout (``pip install -e .``), or as ``python -m benchmarks.NAME`` from the repository root (the
checkout's package, no install needed). The scripts share code only through
:mod:`flash_attn_tq.testing`, never by importing each other."""
