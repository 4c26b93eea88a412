"""What a quantized cache holds, as one typed, frozen value: :class:`CacheSpec`.

A spec is validated once, when it is made, with an error that names the field; everything that
builds a cache (:class:`~flash_attn_tq.QuantizedKVCache`, ``TQCache``, ``verify``, the CPU cache)
takes one, and keyword arguments stay as a convenience that builds one. Per-layer and per-head
options are specs too (:meth:`CacheSpec.replace`).

The spec holds the format and the features, not the shape: batch, capacity, kv heads and head_dim
belong to the cache (:meth:`CacheSpec.check_head_dim` checks what depends on head_dim).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

import torch

from .format import SUPPORTED_BITS
from .format import bits_per_element as format_bits
from .quantizers import FITS, GRIDS

QUANTIZERS = ("turbo", "asym")
WINDOW_BITS = (*SUPPORTED_BITS, 16)
DTYPES = (torch.float16, torch.bfloat16)

# Options kept for research: they run, but not on the product's fused path (what each takes is
# said here and in docs/api.md); CacheSpec.research lists the ones a spec turns on.
RESEARCH = {
    "grid": "lloyd_max: attention takes the reference path (the kernels fold the uniform grid's affine levels)",
    "fit": "other than norm: (scale, offset) metadata; attention is fused, the pack kernel writes 'mean' only",
    "streaming": "asym's running range: appends take the PyTorch writes (the pack kernel has no running range)",
    "alpha": "the running range's decay (streaming only)",
}


def is_int(x: Any) -> bool:
    """An integer argument (numpy integers too; not a bool)."""
    # (the exact type first: the ABC check costs ~1 us, and decode calls check their options every call)
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def scale_only_fits(quantizer: str, grid: str, fit: str) -> bool:
    """Whether the scale alone describes a vector: turbo's uniform grid with the norm fit, whose offset
    is always ``-mid * scale``."""
    return quantizer == "turbo" and grid == "uniform" and fit == "norm"


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The format and features of a quantized K/V cache.

    Fields (each checked when the spec is made):

    * ``k_bits``, ``v_bits``: code widths, 2, 3, 4 or 8 (8: one code a byte, uniform grid only).
    * ``quantizer``: ``"turbo"`` (randomized Hadamard rotation + a per-coordinate grid scaled by the
      vector norm) or ``"asym"`` (per-vector min/max, uniform grid).
    * ``grid``: ``"uniform"`` or ``"lloyd_max"`` (research: reference attention).
    * ``fit``: turbo's per-vector fit, ``"norm"`` (default) or one of the research fits
      (:class:`~flash_attn_tq.quantizers.TurboQuantizer`).
    * ``scale_only``: store the float16 scale alone (turbo, uniform grid, norm fit, whose offset is
      always ``-mid * scale``). None: on wherever it fits.
    * ``sink_tokens``: the first tokens of each sequence also kept in 16-bit.
    * ``fp16_window``: the most recent tokens also kept at ``window_bits`` (16: in ``dtype``).
    * ``window_bits``: 16, or 2/3/4/8 for a ring of window codes (needs ``fp16_window > 0``).
    * ``verify_tokens``: the longest multi-token call (a speculative decoding's verify step) whose
      every query sees its own 16-bit window, as a one-token decode at its position would: the side
      keeps ``verify_tokens - 1`` recent slots beyond ``fp16_window`` (a 16-bit window only; TQCache's
      default: 16). A longer call's earlier queries see the part of their window the side no longer
      holds as codes.
    * ``key_center``: False, True (keys minus the first chunk's mean key) or ``"rope"`` (minus
      ``R(p) c``, the first chunk's mean pre-RoPE key turned to each key's position; needs
      ``rope_inv_freq``, the model's ``head_dim / 2`` RoPE frequencies).
    * ``rope_position_offset``: added to a key's cache position for its RoPE angle.
    * ``calib_min_tokens``: a first chunk shorter than this leaves the key center at 0.
    * ``page_size``: None (contiguous) or the tokens a page (paged layout).
    * ``streaming``, ``alpha``: asym's running per-head range and its decay (research).
    * ``seed``: the rotation's sign vector.
    * ``health``: keep health counters on the device.
    * ``dtype``: the 16-bit storage dtype (sinks, window), float16 or bfloat16.
    """

    k_bits: int = 3
    v_bits: int = 3
    quantizer: str = "turbo"
    grid: str = "uniform"
    fit: str = "norm"
    scale_only: bool | None = None
    sink_tokens: int = 0
    fp16_window: int = 0
    window_bits: int = 16
    verify_tokens: int = 1
    key_center: bool | str = False
    rope_inv_freq: tuple[float, ...] | None = None
    rope_position_offset: int = 0
    calib_min_tokens: int = 16
    page_size: int | None = None
    streaming: bool = False
    alpha: float = 0.95
    seed: int = 0
    health: bool = False
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        ints = (
            "k_bits",
            "v_bits",
            "sink_tokens",
            "fp16_window",
            "window_bits",
            "verify_tokens",
            "rope_position_offset",
        )
        for name in ints + ("calib_min_tokens", "seed"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {getattr(self, name)}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {self.grid!r}")
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {self.fit!r}")
        if self.quantizer != "turbo" and self.grid != "uniform":
            raise ValueError("grid: quantizer='asym' uses the uniform grid only")
        if self.quantizer != "turbo" and self.fit != "norm":
            raise ValueError("fit applies to quantizer='turbo' only")
        if self.fit != "norm" and self.grid != "uniform":
            raise ValueError(f"fit: fit={self.fit!r} applies to the uniform grid only")
        if self.grid != "uniform" and 8 in (self.k_bits, self.v_bits, self.window_bits):
            raise ValueError("grid: 8-bit codes use the uniform grid (grid='uniform')")
        for name in ("sink_tokens", "fp16_window", "calib_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.verify_tokens < 1:
            raise ValueError(f"verify_tokens must be >= 1, got {self.verify_tokens}")
        if self.window_bits not in WINDOW_BITS:
            raise ValueError(f"window_bits must be one of {SUPPORTED_BITS} or 16, got {self.window_bits}")
        if self.window_bits != 16 and not self.fp16_window:
            raise ValueError(
                f"window_bits={self.window_bits} sets the width of the recent window: give fp16_window > 0 too"
            )
        fits = scale_only_fits(self.quantizer, self.grid, self.fit)
        if self.scale_only is None:
            object.__setattr__(self, "scale_only", fits)
        elif not isinstance(self.scale_only, bool):
            raise TypeError(f"scale_only must be True, False or None (the quantizer's choice), got {self.scale_only!r}")
        elif self.scale_only and not fits:
            raise ValueError(
                "scale_only needs quantizer='turbo', grid='uniform' and fit='norm' (whose offset is "
                "-mid * scale, so only the scale is stored)"
            )
        if not (isinstance(self.key_center, bool) or self.key_center == "rope"):
            raise ValueError(f"key_center must be True, False or 'rope', got {self.key_center!r}")
        self._check_rope()
        if self.page_size is not None:
            if not is_int(self.page_size):
                raise TypeError(f"page_size must be an int or None, got {self.page_size!r}")
            if self.page_size <= 0:
                raise ValueError(f"page_size must be positive, got {self.page_size}")
            object.__setattr__(self, "page_size", int(self.page_size))
        if not isinstance(self.streaming, bool):
            raise TypeError(f"streaming must be a bool, got {self.streaming!r}")
        if self.streaming and self.quantizer != "asym":
            raise ValueError("streaming applies to quantizer='asym' only")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {self.alpha!r}")
        if not isinstance(self.health, bool):
            raise TypeError(f"health must be a bool, got {self.health!r}")
        if self.dtype not in DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {self.dtype}")

    def _check_rope(self) -> None:
        freqs = self.rope_inv_freq
        if self.key_center != "rope":
            if freqs is not None:
                raise ValueError("rope_inv_freq is only used with key_center='rope'")
            return
        if freqs is None:
            raise ValueError("key_center='rope' needs rope_inv_freq (the model's RoPE frequencies, head_dim / 2)")
        values = torch.as_tensor(freqs, dtype=torch.float32).detach().cpu()
        if values.dim() != 1 or values.numel() == 0 or not bool(torch.isfinite(values).all()):
            raise ValueError(
                f"rope_inv_freq must be a 1-D sequence of finite values (head_dim / 2 of them), got shape "
                f"{tuple(values.shape)} ({int(torch.isfinite(values).sum())} finite)"
            )
        object.__setattr__(self, "rope_inv_freq", tuple(values.tolist()))

    # ------------------------------------------------------------------ derived
    @property
    def rope_center(self) -> bool:
        """Keys centered by ``R(p) c`` (``key_center='rope'``)."""
        return self.key_center == "rope"

    @property
    def window_codes(self) -> bool:
        """The recent window is a ring of ``window_bits`` codes (not 16-bit)."""
        return bool(self.fp16_window) and self.window_bits != 16

    @property
    def side_recent(self) -> int:
        """Recent-token slots of the 16-bit side: the 16-bit window and ``verify_tokens - 1`` more (0
        without one, or with window codes)."""
        return 0 if self.window_bits != 16 or not self.fp16_window else self.fp16_window + self.verify_tokens - 1

    @property
    def side_slots(self) -> int:
        """Slots of the 16-bit side (sinks, then the recent slots); 0: no side."""
        return self.sink_tokens + self.side_recent

    @property
    def meta_words(self) -> int:
        """float16 words of metadata a vector: 1 (scale-only) or 2 (scale, offset)."""
        return 1 if self.scale_only else 2

    @property
    def research(self) -> tuple[str, ...]:
        """The research options (:data:`RESEARCH`) this spec turns on."""
        on = {"grid": self.grid != "uniform", "fit": self.fit != "norm", "streaming": self.streaming}
        return tuple(name for name, used in on.items() if used)

    def check_head_dim(self, head_dim: int) -> None:
        """What depends on head_dim: a multiple of 32 (a power of two for turbo), and ``head_dim / 2``
        RoPE frequencies."""
        if (
            not is_int(head_dim)
            or head_dim <= 0
            or head_dim % 32
            or (self.quantizer == "turbo" and head_dim & (head_dim - 1))
        ):
            raise ValueError(f"head_dim must be a multiple of 32 (a power of two for turbo), got {head_dim}")
        if self.rope_inv_freq is not None and len(self.rope_inv_freq) != head_dim // 2:
            raise ValueError(
                f"rope_inv_freq must hold head_dim / 2 = {head_dim // 2} values, got {len(self.rope_inv_freq)}"
            )

    def bits_per_element(self, head_dim: int) -> float:
        """Average stored bits per K/V element (codes + metadata; the 16-bit side and window excluded)."""
        mb = 2 * self.meta_words
        return (format_bits(head_dim, self.k_bits, mb) + format_bits(head_dim, self.v_bits, mb)) / 2

    def replace(self, **changes: Any) -> "CacheSpec":
        """A copy with ``changes`` (validated again); ``scale_only`` follows the new options unless given."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown cache option(s): {', '.join(sorted(unknown))}")
        if "scale_only" not in changes and {"quantizer", "grid", "fit"} & set(changes):
            changes["scale_only"] = None
        if changes.get("key_center", self.key_center) != "rope" and "rope_inv_freq" not in changes:
            changes["rope_inv_freq"] = None
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """The spec as keyword arguments (``CacheSpec(**spec.options()) == spec``; JSON-friendly but
        for ``dtype``)."""
        out = dataclasses.asdict(self)
        out["rope_inv_freq"] = None if self.rope_inv_freq is None else list(self.rope_inv_freq)
        return out

    @classmethod
    def of(cls, spec: "CacheSpec | None" = None, **options: Any) -> "CacheSpec":
        """``spec`` (default: the defaults) with ``options`` on top: the keyword convenience."""
        if spec is None:
            return cls(**_known(options))
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        return spec.replace(**options) if options else spec


def _known(options: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(CacheSpec)}
    unknown = set(options) - names
    if unknown:
        raise TypeError(f"unknown cache option(s): {', '.join(sorted(unknown))}")
    return dict(options)
