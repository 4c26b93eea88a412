"""Measurement helpers for the benchmark scripts (``benchmarks/``) and the tests.

* :mod:`.timing`: CUDA-event medians with warm-up (``triton.testing.do_bench``), CUDA-graph replay
  timing, interleaved rounds, device/host clocks, the time inside a model's attention function
  and a profile's kernel times;
* :mod:`.report`: the results stamp (GPU, torch, CUDA, git commit, date, the command line) and the
  JSON / Markdown / PNG writers every results file goes through;
* :mod:`.workloads`: random caches, the default cache's kinds of layer, a serving engine's mixed step
  over a paged cache, upstream FlashAttention-2;
* :mod:`.fp16_decode`: the fast fp16 anchor (a static 16-bit cache read by a decode kernel, for
  transformers models) and :mod:`.fill` (the batch a card's memory holds, caches filled synthetically);
* :mod:`.speculative`: speculative decoding as a serving engine runs it (prompt-lookup drafts, one
  verify forward a step, rejected drafts cropped);
* the quality study (``benchmarks/eval_quality.py``): :mod:`.configs` (every configuration it
  measures), :mod:`.quality` (what a configuration means for a model: bits by layer and head, the
  TQCache that holds it, calibrated widths), :mod:`.simulation` (each layer's K/V through a real
  cache round trip), :mod:`.tasks` (perplexity windows, copy retrieval, token-by-token decoding)
  and :mod:`.assets` (SmolLM2 and the texts, fetched with pip; random Llamas).

The benchmark scripts import what they share from here (``from flash_attn_tq.testing import ...``)
and nothing from each other. triton, matplotlib and transformers are imported only where used.
"""

from . import assets, configs, quality, simulation, tasks
from .report import (
    MISSING,
    command_line,
    cpu_name,
    describe,
    fmt,
    git_commit,
    gpu_name,
    made_by,
    markdown_table,
    missing_notes,
    rerendered,
    save_plot,
    stamp,
    write_json,
    write_results,
    write_text,
)
from .timing import Clock, bench, bench_graph, host_ms, interleaved, profiled_times, timed_attention
from .workloads import (
    DEFAULT_LAYERS,
    DEFAULT_OPTS,
    ServingStep,
    default_layers,
    fill_cache,
    fill_default,
    rope_freqs,
    serving_step,
    slot_mapping,
    upstream_fa2,
    weighted_default,
)

__all__ = [
    "assets",
    "configs",
    "quality",
    "simulation",
    "tasks",
    "MISSING",
    "command_line",
    "cpu_name",
    "describe",
    "fmt",
    "git_commit",
    "gpu_name",
    "made_by",
    "markdown_table",
    "missing_notes",
    "rerendered",
    "save_plot",
    "stamp",
    "write_json",
    "write_results",
    "write_text",
    "Clock",
    "bench",
    "bench_graph",
    "host_ms",
    "interleaved",
    "profiled_times",
    "timed_attention",
    "DEFAULT_LAYERS",
    "DEFAULT_OPTS",
    "ServingStep",
    "default_layers",
    "fill_cache",
    "fill_default",
    "rope_freqs",
    "serving_step",
    "slot_mapping",
    "upstream_fa2",
    "weighted_default",
]
