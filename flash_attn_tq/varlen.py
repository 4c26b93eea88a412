"""A mixed serving step over a :class:`~flash_attn_tq.cache.QuantizedKVCache`
(``flash_attn_varlen_func(kv_cache=)``), planned once and run for every layer.

The step's layout (which sequences append how many new tokens, which attend in which launch, where
each query row goes) is read from ``cu_seqlens_q`` / ``cu_seqlens_k`` on the host. Unplanned, every
call reads them back from the GPU (a device sync), lays the step out and, after each append, reads
the pack kernel's error word (another sync). :func:`plan_varlen` lays it out once a step: the
layers' calls then read nothing back, so the host runs ahead of the GPU, as FlashInfer's
``plan()`` / ``run()``.

A planned call also leaves the pack kernel's error bits (NaN/Inf values, positions past the
cache's capacity) in the plan, for :meth:`VarlenPlan.check` (one read a step) instead of one read a
call; each planned call raises for the errors an earlier call left once they have reached the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from .health import PackErrors
from .spec import is_int


@dataclass(frozen=True, eq=False)  # (tensor fields: compared by identity)
class Append:
    """The sequences of a step that bring ``n`` new tokens each (one pack launch)."""

    n: int
    tokens: torch.Tensor  # [seqs, n] int64: rows of the call's k / v
    rows: torch.Tensor  # [seqs] int32: their cache rows


@dataclass(frozen=True, eq=False)  # (tensor fields: compared by identity)
class Launch:
    """One attention launch of a step: sequences ``seqs`` with their queries left-padded to ``width``
    rows (bottom-right causal alignment holds per sequence; padding rows come first and are dropped)."""

    seqs: tuple[int, ...]
    width: int
    rows: torch.Tensor | None  # [len(seqs)] int32 cache rows (None: rows 0..batch-1, the whole batch)
    token: torch.Tensor  # [tokens] int64: each query token's row of q
    seq: torch.Tensor  # [tokens] int64: its sequence's index in the launch
    row: torch.Tensor  # [tokens] int64: its row in the padded launch
    full: bool  # every sequence has width queries: whole rows gathered and scattered, no padding
    sel: torch.Tensor  # [len(seqs)] int64: the sequences (per-sequence ALiBi slopes)


@dataclass(frozen=True, eq=False)  # (tensor fields: compared by identity)
class VarlenPlan:
    """A mixed step's layout (:func:`plan_varlen`): ``total_q`` query tokens of ``batch`` sequences,
    ``total_k`` new K/V tokens, the appends grouped by new-token count, and at most two attention
    launches (the decoding sequences, one query each; the others padded to the longest of them)."""

    batch: int
    total_q: int
    total_k: int | None  # None: the step brings no new K/V
    appends: tuple[Append, ...]
    launches: tuple[Launch, ...]
    device: torch.device
    errors: PackErrors = field(default_factory=PackErrors, init=False)
    # the error bits' host mirror: [pinned int32 [1], the event after its latest copy] once made
    _mirror: list = field(default_factory=list, repr=False, init=False)

    def check(self) -> None:
        """Raise ValueError for the pack kernel's errors of the planned calls so far (one device sync)."""
        try:
            self.errors.check()
        finally:  # (the check synced: no copy into the mirror is in flight)
            if self._mirror:
                self._mirror[0].zero_()

    def check_landed(self) -> None:
        """Raise for the errors earlier planned calls left, once their copy to the host has landed (no
        sync; nothing while a CUDA graph is being captured)."""
        if not self._mirror or ops.capturing() or not self._mirror[1].query():
            return
        host = self._mirror[0]
        bits = int(host.item())  # (pinned host memory, every copy into it done: no device sync)
        if bits:
            host.zero_()
            self.errors.flags.zero_()
            ops.raise_pack_errors(bits)

    def note_writes(self) -> None:
        """After a planned call's appends: copy the error bits to the host mirror, without waiting (the
        bits accumulate, so the latest copy holds every earlier call's)."""
        if self.errors.flags is None or ops.capturing() or self.errors.flags.device.type != "cuda":
            return
        if not self._mirror:
            self._mirror += [torch.zeros(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()]
        self._mirror[0].copy_(self.errors.flags, non_blocking=True)
        self._mirror[1].record()


def check_cu_seqlens(cu: torch.Tensor, name: str) -> None:
    """``cu`` is an int32 vector of at least one entry (its form only: nothing is read)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be int32 (batch + 1,), got {got}")


def _host_bounds(cu: torch.Tensor, name: str) -> list[int]:
    check_cu_seqlens(cu, name)
    bounds = cu.tolist()  # (one device sync where cu lives on the GPU)
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must rise from 0, got {bounds}")
    return bounds


def plan_varlen(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    device: torch.device | str,
) -> VarlenPlan:
    """The layout of a mixed step whose sequence ``b`` brings queries ``cu_seqlens_q[b] ..
    cu_seqlens_q[b+1]`` and new K/V ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]`` (``None``: no new K/V).
    ``cu_seqlens_*``: int32 ``[batch + 1]``, best on the host (no device sync); ``device``: where the
    step's tensors live. Pass the plan to every layer's ``flash_attn_varlen_func(..., kv_cache=,
    plan=)`` of the step and call :meth:`VarlenPlan.check` once the step is done."""
    if not is_int(max_seqlen_q):
        raise TypeError(f"max_seqlen_q must be an int, got {max_seqlen_q!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # ("cuda": the current device, as tensors made there)
        device = torch.device("cuda", torch.cuda.current_device())
    qb = _host_bounds(cu_seqlens_q, "cu_seqlens_q")
    lens_q = [b - a for a, b in zip(qb, qb[1:])]
    batch = len(lens_q)
    if max(lens_q, default=0) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query ({max(lens_q)})")
    # every index tensor of the step goes to the device in one copy (views of one int64 buffer), made
    # on the host with vectorized ops (a step's chunks hold thousands of tokens)
    pieces: list[torch.Tensor] = []

    def put(values: torch.Tensor | list[int]) -> int:
        pieces.append(torch.as_tensor(values, dtype=torch.long).reshape(-1))
        return len(pieces) - 1

    def spans(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each element's run index, its offset in the run) over runs of ``counts`` elements."""
        run = torch.repeat_interleave(torch.arange(len(counts)), counts)
        first = torch.cumsum(counts, 0) - counts
        return run, torch.arange(int(counts.sum())) - first[run]

    groups = []  # (n, tokens piece, rows piece)
    total_k = None
    if cu_seqlens_k is not None:
        kb = _host_bounds(cu_seqlens_k, "cu_seqlens_k")
        if len(kb) != batch + 1:
            raise ValueError(f"cu_seqlens_k must be int32 (batch + 1 = {batch + 1},) like cu_seqlens_q")
        total_k = kb[-1]
        by_length: dict[int, list[int]] = {}  # sequences with as many new tokens share one append
        for b in range(batch):
            if kb[b + 1] > kb[b]:
                by_length.setdefault(kb[b + 1] - kb[b], []).append(b)
        k_starts = torch.tensor(kb[:-1], dtype=torch.long)
        for n, seqs in by_length.items():  # e.g. all decoding sequences (n = 1) in one launch
            tokens = k_starts[seqs].unsqueeze(1) + torch.arange(n)  # [seqs, n] rows of k / v
            groups.append((n, put(tokens), put(seqs)))
    q_starts, q_lens = torch.tensor(qb[:-1], dtype=torch.long), torch.tensor(lens_q, dtype=torch.long)
    parts = []  # (seqs, width, full, token, seq, row, sel pieces)
    for seqs in ([b for b in range(batch) if lens_q[b] == 1], [b for b in range(batch) if lens_q[b] > 1]):
        if not seqs:
            continue
        width = max(lens_q[b] for b in seqs)
        # token j of sequence seqs[i] sits at padded row width - len + j of row i
        lens = q_lens[seqs]
        seq, j = spans(lens)
        token, row = q_starts[seqs][seq] + j, width - lens[seq] + j
        full = all(lens_q[b] == width for b in seqs)
        parts.append((seqs, width, full, put(token), put(seq), put(row), put(seqs)))
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    views, at = [], 0
    for piece in pieces:
        views.append(flat[at : at + len(piece)])
        at += len(piece)
    appends = tuple(Append(n, views[t].view(-1, n), views[r].int()) for n, t, r in groups)
    launches = tuple(
        Launch(
            seqs=tuple(seqs),
            width=width,
            rows=None if seqs == list(range(batch)) else views[sel].int(),
            token=views[token],
            seq=views[seq],
            row=views[row],
            full=full,
            sel=views[sel],
        )
        for seqs, width, full, token, seq, row, sel in parts
    )
    return VarlenPlan(batch, qb[-1], total_k, appends, launches, device)
