"""Key centering: what a cache subtracts from keys before it codes them, and how that is undone.

``key_center=True`` stores ``k - mu``, ``mu`` the per-(sequence, kv head) mean key of the first chunk
a sequence appends (its prompt): ``q . (k - mu) = q . k - q . mu``, a shift shared by every key of a
query, so the softmax is unchanged and only the lse needs ``q . mu`` back (:meth:`KeyCenter.query_shift`).

``key_center='rope'`` stores ``k - R(p) c``: ``c`` the first chunk's mean key turned back by RoPE and
``R(p)`` RoPE at the key's cache position ``p`` (plus ``rope_position_offset``). RoPE turns a key's
constant part with its position, so this center matches at every position; each score then lacks a
different ``q . R(p) c``, which the fused kernels add back (csrc/flash_attn/src/tq_rope_center.h).
"""

from __future__ import annotations

import torch

from .spec import CacheSpec


def rope_turn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [batch, n, heads, d]`` turned by RoPE to ``positions [batch, n]`` (or ``[n]``) with
    frequencies ``inv_freq [d / 2]``, rotate-half pairs ``(i, i + d/2)`` as transformers' Llama
    (``inverse``: turned back), float32. The angles are float32 products; their cosines and sines are
    taken in float64 and rounded once, as the pack kernel takes them (exact for any angle, so both
    agree to the bit)."""
    ang = (positions.float()[..., None] * inv_freq.to(x.device).float()).double()  # [(batch,) n, d/2]
    cos, sin = ang.cos().float()[..., None, :], ang.sin().float()[..., None, :]
    sin = -sin if inverse else sin
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class KeyCenter:
    """A cache's key center: ``center [batch, kv_heads, d]`` float32 (``mu``, or ``c`` for the RoPE
    center) and ``calibrated [batch]`` bool (rows whose center is set), on the cache's device.

    ``rows`` arguments are int64 cache rows (already clamped, :meth:`QuantizedKVCache.row_index`) or
    None for rows ``0..batch-1``."""

    def __init__(self, spec: CacheSpec, batch_size: int, num_kv_heads: int, head_dim: int, device: torch.device):
        self.enabled, self.rope = bool(spec.key_center), spec.rope_center
        self.min_tokens, self.offset = spec.calib_min_tokens, spec.rope_position_offset
        self.inv_freq = None if spec.rope_inv_freq is None else torch.tensor(spec.rope_inv_freq, device=device)
        self.center = torch.zeros(batch_size, num_kv_heads, head_dim, device=device) if self.enabled else None
        self.calibrated = torch.zeros(batch_size, dtype=torch.bool, device=device) if self.enabled else None
        self.done = False  # every row calibrated (read back once: then appends skip the check)

    def turn(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x [batch, n, kv_heads, d]`` turned by RoPE to ``positions [batch, n]`` plus the offset."""
        return rope_turn(x, positions.float() + self.offset, self.inv_freq, inverse)

    @staticmethod
    def positions_of(positions: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
        if positions is None or tuple(positions.shape) != tuple(k.shape[:2]):
            raise ValueError(
                f"positions: key_center='rope' centers keys by position, so it needs their cache "
                f"positions [batch, n] = {tuple(k.shape[:2])}"
            )
        return positions

    def rows_of(self, rows: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The center's rows ``rows`` (rows 0..batch-1 by default: the table itself or a slice, no gather)."""
        if rows is None:
            return self.center if batch == self.center.shape[0] else self.center[:batch]  # (a slice: a host op)
        return self.center[rows]

    def calibrate(self, k: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor | None, force: bool) -> None:
        """Set the center of ``rows [batch]`` from ``k [batch, n, kv_heads, d]`` (rows already calibrated
        are left alone unless ``force``; a chunk shorter than ``calib_min_tokens`` gives 0)."""
        B, n = k.shape[:2]
        todo = torch.ones(B, dtype=torch.bool, device=k.device) if force else ~self.calibrated[rows]
        if not bool(todo.any()):
            return
        center = torch.zeros(B, *self.center.shape[1:], device=k.device)
        if n >= self.min_tokens:
            kf = k.float()
            center = self.turn(kf, self.positions_of(positions, k), inverse=True).mean(1) if self.rope else kf.mean(1)
        chosen = rows[todo]
        self.center[chosen] = center[todo]
        self.calibrated[chosen] = True

    def at(self, rows: torch.Tensor | None, batch: int, positions: torch.Tensor | None) -> torch.Tensor:
        """What centering subtracts from keys at ``positions [batch, n]``: ``mu`` (``[batch, 1, kv_heads,
        d]``), or ``R(p) c`` (``[batch, n, kv_heads, d]``), float32."""
        c = self.rows_of(rows, batch)[:, None]
        if not self.rope:
            return c
        return self.turn(c.expand(batch, positions.shape[1], *c.shape[2:]), positions)

    def transform(self, k: torch.Tensor, rows: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        """Keys ``[batch, n, kv_heads, d]`` as the codes store them (same dtype)."""
        if not self.enabled:
            return k
        positions = self.positions_of(positions, k) if self.rope else positions
        return (k.float() - self.at(rows, k.shape[0], positions)).to(k.dtype)

    def untransform(self, kt: torch.Tensor, rows: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`transform` (float32)."""
        if not self.enabled:
            return kt.float()
        positions = self.positions_of(positions, kt) if self.rope else positions
        return kt.float() + self.at(rows, kt.shape[0], positions)

    def query_shift(self, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``q . mu`` ``[batch, heads, seqlen_q]``: what ``key_center=True`` removes from every score."""
        if self.rope:
            raise ValueError("key_center='rope' removes a different q . R(p) c from each score: no shared shift")
        B, Sq, H, D = q.shape
        mu = self.rows_of(rows, B)  # [b, kv_heads, d]
        kv_heads = mu.shape[1]
        return torch.einsum("bshgd,bhd->bhgs", q.float().reshape(B, Sq, kv_heads, -1, D), mu).reshape(B, H, Sq)

    def to(self, device: torch.device | str) -> None:
        for name in ("inv_freq", "center", "calibrated"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
