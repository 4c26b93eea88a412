"""Decode steps of a transformers model over a :class:`~flash_attn_tq.integrations.transformers.TQCache`
replayed as one CUDA graph each: the whole step (embeddings, every layer's quantize-on-write and fused
attention, the head) in one launch, so a small model decodes at the GPU's pace, not Python's.

Usage::

    cache = TQCache(model.config, max_cache_len=4096)   # fixed capacity: the graph's tensors never move
    decoder = GraphDecoder(model, cache)
    ids = decoder.generate(prompt_ids, max_new_tokens=256)  # greedy
    # or step by step: logits = decoder.prefill(prompt_ids); logits = decoder.step(next_ids)

The first decode step runs eagerly (on a side stream: library and kernel initialisation), the second
is captured, later ones replay it. What makes a step capturable: the cache has its capacity up front
(``max_cache_len``; a step that would outgrow it raises), every length the kernels read is on the
GPU (``seqlens``), the split count is chosen from the capacity, and nothing reads the GPU back inside
the step (pack errors are checked after it: :meth:`GraphDecoder.check`).
"""

from __future__ import annotations

import torch

from ..optional_deps import transformers_missing

try:
    from .transformers import ATTN_IMPLEMENTATION, TQCache, TQLayer
except ImportError as e:  # without transformers, or an older one
    raise transformers_missing("flash_attn_tq.integrations.graphs", e) from e


class GraphDecoder:
    """Prefill eagerly, then decode one token a step with each step replayed as a CUDA graph.

    Args:
        model: a transformers causal LM (Llama family) on a CUDA device, with
            ``attn_implementation="tq_kvcache"``.
        cache: an empty :class:`TQCache` built with ``max_cache_len`` (the prompt plus every decoded
            token must fit) and no protected layers (their 16-bit cache grows each step).
    """

    def __init__(self, model, cache: TQCache):
        if not isinstance(cache, TQCache):
            raise TypeError(f"cache must be a TQCache, got {type(cache).__name__}")
        if cache.initial_capacity is None:
            raise ValueError("cache: build it with max_cache_len (a CUDA graph needs a fixed capacity)")
        if cache.protected_layers:
            raise ValueError("cache: protected_layers keep a growing 16-bit cache, which a CUDA graph cannot hold")
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"model: set attn_implementation={ATTN_IMPLEMENTATION!r} first")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"model: CUDA graphs need a CUDA device, the model is on {device}")
        self.model, self.cache, self.device = model, cache, device
        self.capacity = int(cache.initial_capacity)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._steps = 0  # decode steps taken (0: the next runs eagerly, 1: the next is captured)
        self._ids = self._pos = self._logits = None

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.cache.get_seq_length()

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``input_ids [B, P]`` (eager); returns the last position's logits ``[B, vocab]``."""
        if self.length:
            raise RuntimeError("prefill: the cache is not empty (one GraphDecoder a sequence batch)")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, prompt_len], got {tuple(input_ids.shape)}")
        if input_ids.shape[1] >= self.capacity:
            raise ValueError(
                f"the prompt ({input_ids.shape[1]} tokens) leaves no room in max_cache_len={self.capacity}"
            )
        pos = torch.arange(input_ids.shape[1], device=self.device).expand(input_ids.shape[0], -1)
        logits = self._forward(input_ids.to(self.device), pos)
        self.check()
        return logits

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step: ``ids [B, 1]`` (the tokens just chosen) in, the next logits ``[B, vocab]``
        out (a view of the graph's output buffer: copy it to keep it past the next step)."""
        n = self.length
        if n == 0:
            raise RuntimeError("step: call prefill first")
        if n + 1 > self.capacity:
            raise ValueError(f"cache full: max_cache_len={self.capacity} tokens")
        if ids.dim() != 2 or ids.shape[1] != 1:
            raise ValueError(f"ids must be [batch, 1], got {tuple(ids.shape)}")
        ids = ids.to(self.device)
        if self._steps == 0:  # eager, on a side stream (cuBLAS and kernel set-up outside the capture)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                logits = self._forward(ids, torch.full_like(ids, n))
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.check()
        else:
            if self.graph is None:
                self._capture(ids)
            self._ids.copy_(ids)
            self._pos.fill_(n)
            self.graph.replay()
            for layer in self._layers():  # the host-side counters the replayed step did not advance
                layer.first_chunk, layer.length = False, layer.length + 1
            logits = self._logits
        self._steps += 1
        return logits

    def _layers(self) -> list[TQLayer]:
        return [layer for layer in self.cache.layers if isinstance(layer, TQLayer)]

    def _capture(self, ids: torch.Tensor) -> None:
        self._ids, self._pos = ids.clone(), torch.zeros_like(ids)
        saved = [(layer.length, layer.first_chunk) for layer in self._layers()]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # (records the step without running it)
            self._logits = self._forward(self._ids, self._pos)
        for layer, (length, first) in zip(self._layers(), saved):
            layer.length, layer.first_chunk = length, first

    def check(self) -> None:
        """Raise ValueError for a pack error (NaN/Inf in K/V, a cache overflow) of the steps so far."""
        self.cache.pack_errors.check()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``input_ids [B, P]`` followed by up to ``max_new_tokens`` tokens: greedy, or sampled
        (``do_sample``, with ``temperature``, ``top_k``, ``top_p`` as transformers applies them) with
        ``generator``. With ``eos_token_id`` a sequence that emits it continues with it, and decoding
        stops once every sequence has (``[B, P + n]``, n <= max_new_tokens)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if input_ids.shape[1] + max_new_tokens > self.capacity + 1:
            raise ValueError(
                f"{input_ids.shape[1]} prompt + {max_new_tokens} new tokens exceed max_cache_len={self.capacity}"
            )
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")

        def choose(logits: torch.Tensor) -> torch.Tensor:
            if not do_sample:
                return logits.argmax(-1, keepdim=True)
            return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), 1, generator=generator)

        out = [input_ids.to(self.device)]
        nxt = choose(self.prefill(input_ids))
        done = None if eos_token_id is None else nxt[:, 0] == eos_token_id
        out.append(nxt)
        for _ in range(max_new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            nxt = choose(self.step(nxt))
            if done is not None:
                nxt = torch.where(done[:, None], torch.full_like(nxt, eos_token_id), nxt)
                done = done | (nxt[:, 0] == eos_token_id)
            out.append(nxt)
        self.check()
        return torch.cat(out, 1)


def sampling_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """float32 probabilities ``[B, vocab]`` from ``logits [B, vocab]``: divided by ``temperature``, then
    only the ``top_k`` largest kept, then the smallest set whose probability reaches ``top_p`` (the
    most likely token always stays), as transformers' logits warpers do."""
    x = logits.float() / temperature
    if top_k is not None and 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= top_p  # the mass before a token already reaches top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)
