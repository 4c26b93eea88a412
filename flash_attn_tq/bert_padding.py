"""Packing padded batches into the varlen layout and back (``flash_attn.bert_padding``).

The functions have the names, signatures and return values of ``flash_attn.bert_padding``
in flash-attn 2.8.3, so ``from flash_attn_tq.bert_padding import pad_input, unpad_input``
can replace the upstream import.  They are written with ordinary indexing, so autograd
(including double backward) goes through them; no extension is needed.

Layout: a padded batch ``(batch, seqlen, ...)`` is viewed as ``batch * seqlen`` rows; the
"unpadded" form keeps only the selected rows, in row-major order, as ``(total_nnz, ...)``,
and ``indices`` are their positions among the ``batch * seqlen`` rows.  ``cu_seqlens``
(int32, ``(batch + 1,)``) are the running totals of the per-sequence token counts, as the
varlen attention functions expect.
"""

import torch

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
    "pad_input",
]


def index_first_axis(input, indices):
    """Rows ``indices`` of ``input`` along its first axis.

    input: (first_axis_dim, ...); indices: (n,) integer tensor.  Returns (n, ...).  The
    gradient scatters back into a zero tensor shaped like ``input``.
    """
    if input.dim() < 1:
        raise ValueError("index_first_axis needs a tensor with at least one dimension")
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at rows ``indices``.

    values: (n, ...); indices: (n,) integer tensor of distinct rows; first_axis_dim: int.
    Returns (first_axis_dim, ...) in the dtype and on the device of ``values``.  The gradient
    for ``values`` is the incoming gradient at rows ``indices``.
    """
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if values.dim() < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"values must have {indices.shape[0]} rows (one per index), got shape {tuple(values.shape)}")
    output = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return output.index_put((indices,), values)


def _cu_seqlens(seqlens):
    """(batch,) int32 counts -> (batch + 1,) int32 running totals starting at 0."""
    cu = torch.zeros(seqlens.shape[0] + 1, dtype=torch.int32, device=seqlens.device)
    cu[1:] = torch.cumsum(seqlens, dim=0, dtype=torch.int32)
    return cu


def _max_int(seqlens):
    return int(seqlens.max().item()) if seqlens.numel() else 0


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Drops the padding of a batch.

    hidden_states: (batch, seqlen, ...).
    attention_mask: (batch, seqlen), bool or int; nonzero marks a valid token.
    unused_mask: optional (batch, seqlen), bool or int; nonzero marks a token that is kept
        in the packed layout (allocated) although it is not valid.

    Returns a 5-tuple:
        hidden_states: (total_nnz, ...), the tokens selected by
            ``attention_mask | unused_mask``, sequence after sequence;
        indices: (total_nnz,) int64, their rows in ``hidden_states.reshape(batch * seqlen, ...)``;
        cu_seqlens: (batch + 1,) int32 running totals of the selected tokens per sequence;
        max_seqlen_in_batch: int, the largest number of selected tokens in one sequence;
        seqused: (batch,) int32, the number of valid tokens (``attention_mask`` only) per
            sequence, for the ``seqused`` arguments of varlen kernels.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (batch, seqlen), got {tuple(attention_mask.shape)}")
    if tuple(hidden_states.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"hidden_states must start with the mask's shape "
            f"{tuple(attention_mask.shape)}, got {tuple(hidden_states.shape)}"
        )
    valid = attention_mask != 0
    selected = valid if unused_mask is None else valid | (unused_mask != 0)
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (
        index_first_axis(rows, indices),
        indices,
        _cu_seqlens(seqlens),
        _max_int(seqlens),
        seqused,
    )


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Unpads a batch whose rows each hold several short sequences back to back.

    hidden_states: (batch, seqlen, ...).
    attention_mask_in_length: (batch, seqlen) int; row b lists the lengths of the
        sequences packed into batch row b, left-aligned and followed by zeros.  For example
        ``[[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]]`` means row 0 holds a sequence of 2 tokens
        then one of 3 (its last token is padding) and row 1 one sequence of 6 tokens.

    Returns a 4-tuple: hidden_states (total_nnz, ...) (the first ``sum(lengths)`` tokens of
    every batch row), indices (total_nnz,) int64 (their rows in the flattened batch),
    cu_seqlens (num_sequences + 1,) int32 over every packed sequence, and
    max_seqlen_in_batch (int, the longest packed sequence).  Attention over the result with
    these ``cu_seqlens`` keeps the packed sequences apart.
    """
    if attention_mask_in_length.dim() != 2:
        raise ValueError(
            f"attention_mask_in_length must have shape (batch, seqlen), got {tuple(attention_mask_in_length.shape)}"
        )
    batch, seqlen = attention_mask_in_length.shape
    lengths = attention_mask_in_length.flatten()
    seqlens = lengths[lengths != 0].to(torch.int32)
    used = attention_mask_in_length.sum(dim=-1)
    positions = torch.arange(seqlen, device=used.device)
    selected = positions.unsqueeze(0) < used.unsqueeze(1)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (
        index_first_axis(rows, indices),
        indices,
        _cu_seqlens(seqlens),
        _max_int(seqlens),
    )


def pad_input(hidden_states, indices, batch, seqlen):
    """Scatters unpadded tokens back into a zero-padded batch (the inverse of unpad_input).

    hidden_states: (total_nnz, ...); indices: (total_nnz,) rows in the flattened
    ``batch * seqlen`` layout (as returned by :func:`unpad_input`); batch, seqlen: ints.
    Returns (batch, seqlen, ...), zero where no token was placed.
    """
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
