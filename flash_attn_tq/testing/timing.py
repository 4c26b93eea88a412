"""Timing helpers the benchmark scripts share.

All times are medians in microseconds (:func:`bench`, :func:`bench_graph`) or in the timer's own
unit (:func:`interleaved`), after a warm-up: one number a measurement, robust to the odd slow call.

* :func:`bench`: CUDA-event medians of one call, ``triton.testing.do_bench`` (warm-up, the L2 cache
  flushed between calls: what a call costs from cold caches, kernels only, no host time);
* :func:`bench_graph`: the same for the call captured once as a CUDA graph and replayed (how
  serving engines run decode: the kernels without the host's launch cost);
* :func:`interleaved`: rounds that time every function in turn, so that a drift of the machine's
  speed (clocks, a shared host's load) hits every function alike and ratios stay fair;
* :class:`Clock` and :func:`timed_attention`: marks on the device timeline (CUDA events) or the
  host clock, and the span of each call of a transformers model's attention function.

triton and transformers are imported where used; CUDA is touched only by the calls that time on it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Mapping

import torch


def bench(fn: Callable[[], Any], rep_ms: float = 200, warmup_ms: float = 25) -> float:
    """Median µs of a call of ``fn`` on the current CUDA device: ``triton.testing.do_bench`` (CUDA
    events around each call, ``warmup_ms`` of calls first, about ``rep_ms`` of timed calls, the L2
    cache flushed before each)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def bench_graph(fn: Callable[[], Any], rep_ms: float = 200) -> float:
    """Median µs of ``fn`` captured as a CUDA graph and replayed (:func:`bench` of the replay).

    ``fn`` runs once on a side stream first (lazy initialisation, workspace allocations outside
    the capture), then once under capture; it must be capturable (no host synchronisation, static
    shapes and addresses). Raises what the capture raises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep_ms)


def host_ms(fn: Callable[[], Any]) -> float:
    """Wall-clock ms of one call of ``fn`` on the host (``time.perf_counter``; for CPU work)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    timer: Callable[[Callable[[], Any]], float],
    rounds: int = 5,
    warmup: int = 0,
) -> dict[str, float]:
    """``{name: median of timer(fn) over rounds}``: ``warmup`` untimed calls of each function, then
    ``rounds`` rounds that time every function once, in the order given (an A/B measurement whose
    two sides see the same drift). The unit is the timer's (:func:`host_ms`: ms; a lambda around
    :func:`bench`: µs)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: statistics.median(t) for name, t in times.items()}


class Clock:
    """Marks on the device's timeline (CUDA events on a CUDA device) or the host clock (CPU).

    ``mark()`` records a mark now (in stream order on a GPU); ``ms(a, b)`` is the time from mark
    ``a`` to mark ``b`` in ms, read after the device was synchronised."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


@contextlib.contextmanager
def timed_attention(model: Any, clock: Clock, spans: list) -> Iterator[None]:
    """Within the block, each call of ``model``'s attention function (transformers'
    ``ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]``) appends its ``(start, end)``
    marks of ``clock`` to ``spans``; the function registered before is back afterwards (the
    registry's global entry untouched where the wrapper went into its local mapping)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    had_local = name in ALL_ATTENTION_FUNCTIONS._local_mapping
    original = ALL_ATTENTION_FUNCTIONS[name]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = clock.mark()
        out = original(*args, **kwargs)
        spans.append((t0, clock.mark()))
        return out

    ALL_ATTENTION_FUNCTIONS[name] = wrapped  # (the local mapping, looked up at each forward)
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


def profiled_times(prof: Any, cuda: bool = True) -> list[tuple[str, float]]:
    """``(name, µs)`` of each kernel a ``torch.profiler`` run recorded (its self device time; on the CPU,
    ``cuda=False``: each operator's self CPU time), the ones that took no time left out."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if cuda:
            if getattr(e, "device_type", None) != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
        else:
            t = getattr(e, "self_cpu_time_total", 0)
        if t and t > 0:
            rows.append((e.key, float(t)))
    return rows
