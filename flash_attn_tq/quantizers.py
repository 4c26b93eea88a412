"""Reference quantizers (PyTorch, CPU or CUDA): what the kernels must reproduce.

Both quantizers turn a float tensor ``x [..., head_dim]`` into integer codes ``[..., head_dim]`` and
float16 metadata ``[..., 2] = (scale, offset)`` such that, in the quantizer's domain,
``x_hat = scale * level(code) + offset`` (see :mod:`flash_attn_tq.format`). Rounding is always
``floor(v + 0.5)`` (ties go up; a value exactly on an edge between two Lloyd-Max levels likewise
takes the upper one) and every scale (and asym's offset) is rounded to float16 *before* codes are
computed from it, so a kernel doing the same float32 arithmetic gets the same codes except where
the arithmetic's order differs near a bin edge.

* :class:`TurboQuantizer`: randomized Hadamard rotation (seeded signs, fast Walsh-Hadamard), then a
  per-coordinate grid on the unit-variance coordinates ``y = rot(x) * sqrt(d) / |x|``: the uniform
  grid with the MSE-optimal step for N(0, 1) (default), or the Lloyd-Max codebook. Norm correction:
  the scale makes ``|x_hat| = |x|``. Queries are rotated with :meth:`TurboQuantizer.rotate`;
  attention outputs are rotated back with :meth:`TurboQuantizer.unrotate`.
* :class:`AsymQuantizer`: asymmetric uniform per vector (token, kv head), the grid spanning the
  vector's own [min, max] (offset = min, so vectors that do not straddle 0 are coded as well as those
  that do); in streaming mode the scale comes from a per-head range smoothed as
  ``alpha * max|x_new| + (1 - alpha) * ema`` (alpha 0.95) on every append, with an integer zero point.
"""

from __future__ import annotations

import functools
import math

import torch

from .format import SUPPORTED_BITS

GRIDS = ("uniform", "lloyd_max")
FITS = ("norm", "ls", "unbiased", "search", "mean")
SEARCH_STEPS = tuple(0.70 + 0.05 * i for i in range(13))  # step multipliers tried by fit="search"


# ----------------------------------------------------------------------------- grids for N(0, 1)


def _phi(t: float) -> float:
    return math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi) if math.isfinite(t) else 0.0


def _cdf(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / math.sqrt(2)))


def _gaussian_mse(levels: list[float]) -> float:
    """E[(Y - Q(Y))^2] for Y ~ N(0, 1) and nearest-level quantization onto sorted ``levels``."""
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    total = 0.0
    for c, lo, hi in zip(levels, edges, edges[1:]):
        # integral over (lo, hi) of (y - c)^2 phi(y) dy, in closed form
        p = _cdf(hi) - _cdf(lo)
        m1 = _phi(lo) - _phi(hi)  # integral of y phi
        lo_t = lo * _phi(lo) if math.isfinite(lo) else 0.0
        hi_t = hi * _phi(hi) if math.isfinite(hi) else 0.0
        m2 = p + lo_t - hi_t  # integral of y^2 phi
        total += m2 - 2 * c * m1 + c * c * p
    return total


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(bits: int) -> tuple[float, ...]:
    """Lloyd-Max (MSE-optimal) levels for N(0, 1) with ``2**bits`` levels, ascending."""
    _check_bits(bits)
    n = 1 << bits
    levels = [(i - (n - 1) / 2) * 4.0 / n for i in range(n)]
    for _ in range(10000):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = [(_phi(lo) - _phi(hi)) / (_cdf(hi) - _cdf(lo)) for lo, hi in zip(edges, edges[1:])]
        if max(abs(a - b) for a, b in zip(new, levels)) < 1e-13:
            levels = new
            break
        levels = new
    return tuple(levels)


def uniform_levels(bits: int, step: float) -> list[float]:
    n = 1 << bits
    return [(i - (n - 1) / 2) * step for i in range(n)]


_UNIFORM_STEPS: dict[int, float] = {}  # uniform_step's results (a dict: torch.compile reads it as a constant)


def uniform_step(bits: int) -> float:
    """MSE-optimal step of the symmetric uniform ``2**bits``-level grid for N(0, 1)."""
    if bits not in _UNIFORM_STEPS:
        _UNIFORM_STEPS[bits] = _search_uniform_step(bits)
    return _UNIFORM_STEPS[bits]


def _search_uniform_step(bits: int) -> float:
    _check_bits(bits)
    lo, hi = 0.01, 3.0
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):  # golden-section search; the MSE is unimodal in the step
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if _gaussian_mse(uniform_levels(bits, a)) < _gaussian_mse(uniform_levels(bits, b)):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def grid_mse(bits: int, grid: str = "uniform") -> float:
    """Per-coordinate MSE of the grid on N(0, 1) (3 bits: 0.0375 uniform, 0.0345 Lloyd-Max)."""
    levels = uniform_levels(bits, uniform_step(bits)) if grid == "uniform" else list(lloyd_max_codebook(bits))
    return _gaussian_mse(levels)


# ----------------------------------------------------------------------------- rotation


def hadamard_signs(head_dim: int, seed: int) -> torch.Tensor:
    """The seeded random +-1 vector (float32 ``[head_dim]``) of the randomized Hadamard transform."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of two), O(d log d)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Hadamard transform, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, d) * (1.0 / math.sqrt(d))


def round_half_up(v: torch.Tensor) -> torch.Tensor:
    return torch.floor(v + 0.5)


def _as_fp16_float(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(torch.float32)


# ----------------------------------------------------------------------------- quantizers


class TurboQuantizer:
    """Randomized-Hadamard rotation + per-coordinate grid scaled by the vector norm.

    Args:
        head_dim: vector length (a power of two, multiple of 32).
        bits: 2, 3 or 4.
        grid: ``"uniform"`` (default; scale and offset fold into the kernel's scores) or ``"lloyd_max"``.
        seed: seed of the random sign vector.
        fit: how each vector's ``(scale, offset)`` is chosen on the uniform grid. ``"norm"``
            (default): codes on the fixed MSE-optimal N(0, 1) step, scale set so ``|x_hat| = |x|``
            (the GPU quantize-on-write kernel implements this one). ``"ls"``: same codes, then the
            least-squares ``(scale, offset)`` (smallest MSE, but shrinks inner products).
            ``"unbiased"``: same codes, scale with ``<x_hat, x> = |x|^2``. ``"search"``: the step is
            searched per vector over :data:`SEARCH_STEPS` times the N(0, 1) step, keeping the codes
            closest in angle to ``x``, then norm correction. ``"mean"``: the offset stores the mean
            of the rotated vector exactly (the component along ``+-e_0`` of the input: what the
            evaluation's key_pca simulation turns into the keys' main direction) and the codes
            + norm-corrected scale the rest. All stay in the stored format (the fused decode reads
            any per-vector affine); only quantize-on-write falls back to PyTorch.
    """

    name = "turbo"

    def __init__(self, head_dim: int, bits: int = 3, grid: str = "uniform", seed: int = 0, fit: str = "norm"):
        _check_bits(bits)
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        if fit != "norm" and grid != "uniform":
            raise ValueError("fit='ls'/'search' apply to the uniform grid only")
        self.head_dim, self.bits, self.grid, self.seed, self.fit = head_dim, bits, grid, seed, fit
        self.signs = hadamard_signs(head_dim, seed)
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}  # copies made once (CUDA-graph safe)
        self.levels_unit = (
            uniform_levels(bits, uniform_step(bits)) if grid == "uniform" else list(lloyd_max_codebook(bits))
        )

    def _device_copy(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._on_device:
            src = self.signs if name == "signs" else torch.tensor(self.levels_unit, dtype=torch.float32)
            self._on_device[key] = src.to(device)
        return self._on_device[key]

    def rotation_matrix(self, device) -> torch.Tensor:
        """float32 ``[d, d]`` M with ``rotate(x) == x @ M`` (cached per device; one GEMM per call)."""
        key = ("matrix", torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = fwht(torch.diag(self.signs)).to(device)
        return self._on_device[key]

    def signs_on(self, device) -> torch.Tensor:
        """The sign vector on ``device`` (cached)."""
        return self._device_copy("signs", device)

    def codebook(self, device=None) -> torch.Tensor | None:
        """float32 ``[2**bits]`` levels for the Lloyd-Max grid; None for the uniform (affine) grid."""
        if self.grid == "uniform":
            return None
        return self._device_copy("levels", device or "cpu")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d]`` -> float32 rotated ``H (signs * x) / sqrt(d)``."""
        return fwht(x.float() * self.signs_on(x.device))

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rotate` (float32)."""
        return fwht(y.float()) * self.signs_on(y.device)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., d]`` -> (codes int64 ``[..., d]``, meta float16 ``[..., 2]``)."""
        d = self.head_dim
        if x.shape[-1] != d:
            raise ValueError(f"last dim must be head_dim={d}, got {x.shape[-1]}")
        xr = self.rotate(x)
        if self.fit != "norm":
            return self._quantize_fitted(xr)
        norm = xr.norm(dim=-1, keepdim=True)
        inv = torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))
        y = xr * inv
        n = 1 << self.bits
        if self.grid == "uniform":
            step = uniform_step(self.bits)
            codes = round_half_up(y * (1.0 / step) + (n - 1) / 2).clamp_(0, n - 1)
            level = (codes - (n - 1) / 2) * step
        else:
            levels = self.codebook(x.device)
            edges = (levels[1:] + levels[:-1]) / 2
            # right=True: a value exactly on an edge goes up, as floor(v + 0.5) does on the uniform grid
            codes = torch.bucketize(y, edges, right=True).float()
            level = levels[codes.long()]
        lnorm = level.norm(dim=-1, keepdim=True)
        scale = torch.where(lnorm > 0, norm / lnorm, torch.zeros_like(norm))  # norm correction
        if self.grid == "uniform":
            unit_scale = _as_fp16_float(scale * step)
            offset = -unit_scale * ((n - 1) / 2)
            meta = torch.cat([unit_scale, offset], -1)
        else:
            meta = torch.cat([scale, torch.zeros_like(scale)], -1)
        return codes.long(), meta.to(torch.float16)

    def _quantize_fitted(self, xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fit != "norm" on rotated vectors ``xr``: codes + (scale, offset), see the class docstring."""
        d, n = self.head_dim, 1 << self.bits
        norm = xr.norm(dim=-1, keepdim=True)
        y = xr * torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))
        if self.fit == "mean":
            m = xr.mean(-1, keepdim=True)
            r = xr - m
            rn = r.norm(dim=-1, keepdim=True)
            yr = r * torch.where(rn > 0, math.sqrt(d) / rn, torch.zeros_like(rn))
            codes = round_half_up(yr * (1.0 / uniform_step(self.bits)) + (n - 1) / 2).clamp_(0, n - 1)
            cm = codes.mean(-1, keepdim=True)
            cn = (codes - cm).norm(dim=-1, keepdim=True)
            a = _as_fp16_float(torch.where(cn > 0, rn / cn.clamp(min=1e-30), torch.zeros_like(rn)))
            b = _as_fp16_float(m - a * cm)
            return codes.long(), torch.cat([a, b], -1).to(torch.float16)
        mults = SEARCH_STEPS if self.fit == "search" else (1.0,)
        best = None
        for m in mults:  # search: keep the step whose codes point closest to x (largest cosine)
            step = uniform_step(self.bits) * m
            codes = round_half_up(y * (1.0 / step) + (n - 1) / 2).clamp_(0, n - 1)
            lev = codes - (n - 1) / 2
            dot = (lev * xr).sum(-1, keepdim=True)
            lnorm = lev.norm(dim=-1, keepdim=True)
            cos = dot / (lnorm * norm).clamp(min=1e-30)
            if best is None:
                best = [cos, codes]
            else:
                better = cos > best[0]
                best = [torch.where(better, cos, best[0]), torch.where(better, codes, best[1])]
        codes = best[1]
        lev = codes - (n - 1) / 2
        if self.fit == "ls":
            cm = codes.mean(-1, keepdim=True)
            cc = codes - cm
            var = (cc * cc).sum(-1, keepdim=True)
            a = torch.where(var > 0, (cc * xr).sum(-1, keepdim=True) / var.clamp(min=1e-30), torch.zeros_like(var))
            a = _as_fp16_float(a)
            return codes.long(), torch.cat([a, _as_fp16_float(xr.mean(-1, keepdim=True) - a * cm)], -1).to(
                torch.float16
            )
        lnorm = lev.norm(dim=-1, keepdim=True)
        if self.fit == "unbiased":  # <x_hat, x> = |x|^2: q . x_hat is unbiased along x
            dot = (lev * xr).sum(-1, keepdim=True)
            a = torch.where(dot > 0, norm * norm / dot.clamp(min=1e-30), torch.zeros_like(dot))
        else:  # search: norm correction, |x_hat| = |x|
            a = torch.where(lnorm > 0, norm / lnorm.clamp(min=1e-30), torch.zeros_like(norm))
        a = _as_fp16_float(a)
        return codes.long(), torch.cat([a, -a * ((n - 1) / 2)], -1).to(torch.float16)

    def dequantize_rotated(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Codes + meta -> float32 values in the rotated domain (what the kernel attends over). A meta
        of one element is the scale alone (uniform grid, norm fit: offset = -mid * scale)."""
        m = meta.float()
        if self.grid == "uniform":
            level = codes.float()
        else:
            level = self.codebook(codes.device)[codes.long()]
        if m.shape[-1] == 1:
            return (level - ((1 << self.bits) - 1) / 2) * m
        return level * m[..., :1] + m[..., 1:]

    def dequantize(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Codes + meta -> float32 values in the original domain."""
        return self.unrotate(self.dequantize_rotated(codes, meta))

    def clipped(self, xr: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """bool ``[..., d]``: the elements of rotated vectors ``xr`` (:meth:`rotate`) outside the grid's
        range, which the outermost codes clip: beyond half a step past the outermost uniform level,
        or past the outermost Lloyd-Max cell's mirror (in the norm fit's unit scale)."""
        norm = xr.norm(dim=-1, keepdim=True)
        y = xr * torch.where(norm > 0, math.sqrt(self.head_dim) / norm.clamp(min=1e-30), torch.zeros_like(norm))
        lv = self.levels_unit
        return y.abs() > lv[-1] + 0.5 * (lv[-1] - lv[-2])


class AsymQuantizer:
    """Asymmetric uniform quantization per vector.

    ``scale = (max - min) / (2**bits - 1)`` and ``offset = min``, both rounded to float16 first, then
    ``code = clamp(floor((x - offset) / scale + 0.5))``; stored as ``(scale, offset)``, so
    ``x_hat = code * scale + offset``. The grid spans the vector's own [min, max] whether or not it
    contains 0 (a constant vector: scale 1, ``x_hat = fp16(x)``); every element is within half a step
    of its level, plus the float16 rounding of the offset. With ``streaming=True`` the scale is
    ``2 r / (2**bits - 1)`` where ``r`` is a per-head range updated on each :meth:`quantize` call as
    ``alpha * max|x_new| + (1 - alpha) * r`` (the first call sets ``r = max|x_new|``), and an integer
    zero point ``zero`` (offset ``-scale * zero``, clamped to the code range) centers each vector's
    own [min, max] in the code range. Pass the running range tensor as ``ema`` and take the updated
    one from the return value; the quantizer keeps no state itself.
    """

    name = "asym"

    def __init__(self, bits: int = 3, streaming: bool = False, alpha: float = 0.95):
        _check_bits(bits)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.bits, self.streaming, self.alpha = bits, streaming, alpha

    def update_range(self, x: torch.Tensor, ema: torch.Tensor | None) -> torch.Tensor:
        """New per-head range from ``x [..., tokens, heads, d]`` and the previous ``ema [..., heads]``."""
        m = x.float().abs().amax(dim=(-3, -1))
        if ema is None:
            return m
        return torch.where(torch.isfinite(ema) & (ema > 0), self.alpha * m + (1 - self.alpha) * ema, m)

    def quantize(self, x: torch.Tensor, ema: torch.Tensor | None = None):
        """``x [..., d]`` -> (codes int64, meta float16 ``[..., 2]``).

        Streaming mode expects ``x [..., tokens, heads, d]`` and returns ``(codes, meta, new_ema)``.
        """
        n = 1 << self.bits
        xf = x.float()
        mn = xf.amin(-1, keepdim=True)
        mx = xf.amax(-1, keepdim=True)
        if self.streaming:
            new_ema = self.update_range(xf, ema)
            r = new_ema.unsqueeze(-2).unsqueeze(-1)  # [..., 1, heads, 1]
            scale = _as_fp16_float(2 * r / (n - 1)).expand_as(mn)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = round_half_up((n - 1) / 2 - (mx + mn) / (2 * scale)).clamp_(0, n - 1)
            codes = round_half_up(xf / scale + zero).clamp_(0, n - 1)
            meta = torch.cat([scale, -scale * zero], -1).to(torch.float16)
            return codes.long(), meta, new_ema
        # (mx - mn) / (n - 1) correctly rounded, as the pack kernel's division (a float64 quotient rounds
        # to the float32 one; a GPU division by a scalar multiplies by its reciprocal instead)
        scale = _as_fp16_float(((mx - mn).double() / (n - 1)).float())
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        offset = _as_fp16_float(mn)
        codes = round_half_up((xf - offset) / scale).clamp_(0, n - 1)
        return codes.long(), torch.cat([scale, offset], -1).to(torch.float16)

    def dequantize(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        m = meta.float()
        return codes.float() * m[..., :1] + m[..., 1:]

    dequantize_rotated = dequantize  # no rotation: the kernel attends in the original domain

    def clipped(self, x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """bool ``[..., d]``: the elements of ``x`` the codes clipped (an outermost code more than half
        a step away: a streaming range can clip; the per-vector range only by the float16 rounding of
        its offset, where the range is tiny next to the values)."""
        err = (self.dequantize(codes, meta) - x.float()).abs()
        edge = (codes == 0) | (codes == (1 << self.bits) - 1)
        return edge & (err > 0.5 * meta[..., :1].float() * (1 + 1e-3))
