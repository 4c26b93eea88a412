"""Tests for flash_attn_tq.quantizers.

Gaussian integrals are recomputed here with scipy (numerical quadrature), the Hadamard matrix is
built by the Sylvester construction, and expected codes come from float64 nearest-level search,
so the checks do not share code with the module under test.
"""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from flash_attn_tq.quantizers import (
    AsymQuantizer,
    TurboQuantizer,
    fwht,
    grid_mse,
    hadamard_signs,
    lloyd_max_codebook,
    round_half_up,
    uniform_levels,
    uniform_step,
)

# ----------------------------------------------------------------------------- independent helpers


def quad_mse(levels) -> float:
    """E[(Y - nearest level)^2], Y ~ N(0,1), by numerical quadrature per cell."""
    levels = sorted(levels)
    edges = [-np.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [np.inf]
    total = 0.0
    for c, lo, hi in zip(levels, edges, edges[1:]):
        val, _ = integrate.quad(lambda y: (y - c) ** 2 * stats.norm.pdf(y), lo, hi, epsabs=1e-13, epsrel=1e-12)
        total += val
    return total


def quad_centroids(levels):
    levels = sorted(levels)
    edges = [-np.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [np.inf]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        m1, _ = integrate.quad(lambda y: y * stats.norm.pdf(y), lo, hi, epsabs=1e-14)
        p = stats.norm.cdf(hi) - stats.norm.cdf(lo)
        out.append(m1 / p)
    return out


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# ----------------------------------------------------------------------------- Lloyd-Max

PUBLISHED_LM = {
    2: ([0.4528, 1.5104], 0.1175),
    3: ([0.2451, 0.7560, 1.3439, 2.1519], 0.03455),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326], 0.009497),
}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_published_values(bits):
    half, mse = PUBLISHED_LM[bits]
    lv = lloyd_max_codebook(bits)
    assert len(lv) == 1 << bits
    assert list(lv) == sorted(lv)
    expected = [-x for x in reversed(half)] + half
    np.testing.assert_allclose(lv, expected, atol=1.5e-4)
    assert grid_mse(bits, "lloyd_max") == pytest.approx(mse, abs=1e-4)
    # symmetric codebook
    np.testing.assert_allclose(np.array(lv), -np.array(lv[::-1]), atol=1e-12)


def test_lloyd_max_mse_values_tight():
    assert grid_mse(3, "lloyd_max") == pytest.approx(0.03455, abs=5e-5)
    assert grid_mse(2, "lloyd_max") == pytest.approx(0.1175, abs=5e-5)
    assert grid_mse(4, "lloyd_max") == pytest.approx(0.0095, abs=2e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_grid_mse_matches_quadrature(bits):
    for grid in ("uniform", "lloyd_max"):
        levels = uniform_levels(bits, uniform_step(bits)) if grid == "uniform" else lloyd_max_codebook(bits)
        assert grid_mse(bits, grid) == pytest.approx(quad_mse(levels), rel=1e-7)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_optimality(bits):
    lv = list(lloyd_max_codebook(bits))
    # centroid condition: each level is E[Y | Y in its cell]
    np.testing.assert_allclose(quad_centroids(lv), lv, atol=1e-8)
    base = quad_mse(lv)
    rng = np.random.default_rng(bits)
    for i in range(len(lv)):
        for eps in (1e-2, -1e-2, 3e-3):
            p = list(lv)
            p[i] += eps
            if p != sorted(p):
                continue
            assert quad_mse(p) > base + 1e-9, (i, eps)
    # a random joint perturbation is worse too
    p = sorted(np.array(lv) + rng.normal(0, 0.02, len(lv)))
    assert quad_mse(p) > base


def test_lloyd_max_beats_uniform():
    for bits in (2, 3, 4):
        assert grid_mse(bits, "lloyd_max") < grid_mse(bits, "uniform")


# ----------------------------------------------------------------------------- uniform grid


@pytest.mark.parametrize("bits,step,mse", [(3, 0.586, 0.0375), (2, 0.996, 0.1188), (4, 0.335, 0.01154)])
def test_uniform_step_values(bits, step, mse):
    s = uniform_step(bits)
    assert s == pytest.approx(step, abs=1e-3)
    assert grid_mse(bits, "uniform") == pytest.approx(mse, abs=2e-4)
    lv = uniform_levels(bits, s)
    assert len(lv) == 1 << bits
    np.testing.assert_allclose(np.diff(lv), s, rtol=1e-12)
    assert sum(lv) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_uniform_step_is_a_minimum(bits):
    s = uniform_step(bits)
    base = quad_mse(uniform_levels(bits, s))
    for eps in (1e-2, -1e-2, 2e-3, -2e-3):
        assert quad_mse(uniform_levels(bits, s + eps)) > base
    # compare with a brute-force scan on a fine grid
    scan = np.linspace(s - 0.02, s + 0.02, 41)
    best = scan[np.argmin([quad_mse(uniform_levels(bits, t)) for t in scan])]
    assert abs(best - s) <= 1e-3


def test_bad_bits():
    for fn in (lloyd_max_codebook, uniform_step):
        with pytest.raises(ValueError, match="bits"):
            fn(5)
    with pytest.raises(ValueError, match="bits"):
        TurboQuantizer(64, 1)
    with pytest.raises(ValueError, match="bits"):
        AsymQuantizer(6)
    with pytest.raises(ValueError, match="grid"):
        TurboQuantizer(64, 3, grid="nf4")
    with pytest.raises(ValueError, match="alpha"):
        AsymQuantizer(3, streaming=True, alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        AsymQuantizer(3, streaming=True, alpha=1.5)


# ----------------------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("d", [1, 2, 8, 32, 64, 128, 256])
def test_fwht_equals_sylvester_matrix(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 5, d, generator=g, dtype=torch.float64)
    h = sylvester(d) / math.sqrt(d)
    expected = x @ h.T
    torch.testing.assert_close(fwht(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [32, 128])
def test_fwht_orthonormal_and_self_inverse(d):
    eye = torch.eye(d, dtype=torch.float64)
    h = fwht(eye)  # rows: transform of basis vectors
    torch.testing.assert_close(h @ h.T, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h.T, rtol=0, atol=0)  # symmetric
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, d, generator=g)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(4, 96))


def test_hadamard_signs_seeded():
    a, b, c = hadamard_signs(128, 1), hadamard_signs(128, 1), hadamard_signs(128, 2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert set(a.tolist()) == {-1.0, 1.0}
    assert a.dtype == torch.float32
    assert 30 < int((a > 0).sum()) < 98


@pytest.mark.parametrize("d", [64, 128])
def test_rotate_unrotate(d):
    q = TurboQuantizer(d, 3, seed=17)
    g = torch.Generator().manual_seed(d + 1)
    x = torch.randn(4, 3, d, generator=g)
    y = q.rotate(x)
    # rotate = H diag(signs) x / sqrt(d), computed densely in float64
    h = sylvester(d) / math.sqrt(d)
    expected = (x.double() * q.signs.double()) @ h.T
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(q.unrotate(y), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(q.rotate(q.unrotate(x)), x, rtol=0, atol=1e-5)
    # inner products are preserved (what makes rotating q and k legitimate)
    torch.testing.assert_close((q.rotate(x[0]) * y[1]).sum(-1), (x[0] * x[1]).sum(-1), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- TurboQuantizer


def rel_mse(q, x):
    codes, meta = q.quantize(x)
    xh = q.dequantize(codes, meta)
    return (((xh - x) ** 2).sum(-1).mean() / (x**2).sum(-1).mean()).item()


def test_turbo_3bit_relative_mse():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(3001, 128, generator=g) * 2.7
    u = rel_mse(TurboQuantizer(128, 3, "uniform", seed=1), x)
    lm = rel_mse(TurboQuantizer(128, 3, "lloyd_max", seed=1), x)
    assert 0.034 <= u <= 0.039, u
    assert 0.032 <= lm <= 0.036, lm
    assert lm < u


@pytest.mark.parametrize("grid", ["uniform", "lloyd_max"])
def test_turbo_bits_ordering(grid):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1501, 64, generator=g)
    e = {b: rel_mse(TurboQuantizer(64, b, grid, seed=9), x) for b in (2, 3, 4)}
    assert e[2] > e[3] > e[4]
    assert 0.10 < e[2] < 0.13 and 0.007 < e[4] < 0.012
    # each close to the per-coordinate grid MSE
    for b in (2, 3, 4):
        assert e[b] == pytest.approx(grid_mse(b, grid), rel=0.12)


@pytest.mark.parametrize("grid", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turbo_norm_correction(grid, bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(257, 128, generator=g) * torch.rand(257, 1, generator=g) * 10
    q = TurboQuantizer(128, bits, grid, seed=3)
    codes, meta = q.quantize(x)
    xh = q.dequantize(codes, meta)
    torch.testing.assert_close(xh.norm(dim=-1), x.norm(dim=-1), rtol=2e-3, atol=1e-6)
    # the rotated-domain values have the same norm
    torch.testing.assert_close(q.dequantize_rotated(codes, meta).norm(dim=-1), x.norm(dim=-1), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turbo_uniform_codes_and_meta_independent(bits):
    d = 128
    q = TurboQuantizer(d, bits, "uniform", seed=21)
    g = torch.Generator().manual_seed(40 + bits)
    x = torch.randn(200, d, generator=g) * 3
    codes, meta = q.quantize(x)
    assert codes.dtype == torch.int64 and meta.dtype == torch.float16 and meta.shape == (200, 2)
    n = 1 << bits
    assert int(codes.min()) >= 0 and int(codes.max()) <= n - 1
    # expected: nearest uniform level to y = rot(x) * sqrt(d) / |x| (float64, dense Hadamard)
    h = sylvester(d) / math.sqrt(d)
    xr = (x.double() * q.signs.double()) @ h.T
    y = xr * math.sqrt(d) / xr.norm(dim=-1, keepdim=True)
    step = uniform_step(bits)
    t = y / step + (n - 1) / 2
    exp = torch.floor(t + 0.5).clamp(0, n - 1).long()
    near_tie = ((t - torch.floor(t)) - 0.5).abs() < 1e-4
    assert ((codes != exp) & ~near_tie).sum() == 0
    # meta: (scale, -scale * (n-1)/2), scale = |x| / |levels| * step
    lvl = (exp.double() - (n - 1) / 2) * step
    scale = x.double().norm(dim=-1) / lvl.norm(dim=-1) * step
    torch.testing.assert_close(meta[:, 0].double(), scale, rtol=1e-3, atol=0)
    torch.testing.assert_close(meta[:, 1].double(), -meta[:, 0].double() * (n - 1) / 2, rtol=1e-3, atol=0)
    # dequantize_rotated is scale * code + offset
    torch.testing.assert_close(
        q.dequantize_rotated(codes, meta), codes.float() * meta[:, :1].float() + meta[:, 1:].float(), rtol=0, atol=0
    )


def test_turbo_lloyd_max_codes_independent():
    d = 64
    q = TurboQuantizer(d, 3, "lloyd_max", seed=2)
    g = torch.Generator().manual_seed(77)
    x = torch.randn(300, d, generator=g)
    codes, meta = q.quantize(x)
    assert torch.equal(meta[:, 1], torch.zeros(300, dtype=torch.float16))
    h = sylvester(d) / math.sqrt(d)
    xr = (x.double() * q.signs.double()) @ h.T
    y = xr * math.sqrt(d) / xr.norm(dim=-1, keepdim=True)
    lv = torch.tensor(lloyd_max_codebook(3), dtype=torch.float64)
    dist = (y.unsqueeze(-1) - lv).abs()
    exp = dist.argmin(-1)
    two = dist.sort(-1).values
    near_tie = (two[..., 1] - two[..., 0]) < 1e-5
    assert ((codes != exp) & ~near_tie).sum() == 0
    np.testing.assert_allclose(q.codebook().numpy(), np.array(lloyd_max_codebook(3), dtype=np.float32))
    assert TurboQuantizer(d, 3, "uniform").codebook() is None


def test_turbo_wrong_dim_and_zero_vector():
    q = TurboQuantizer(64, 3)
    with pytest.raises(ValueError, match="head_dim"):
        q.quantize(torch.zeros(2, 32))
    for grid in ("uniform", "lloyd_max"):
        q = TurboQuantizer(64, 3, grid)
        x = torch.zeros(3, 64)
        x[1] = torch.linspace(-1, 1, 64)
        codes, meta = q.quantize(x)
        xh = q.dequantize(codes, meta)
        assert torch.isfinite(meta.float()).all() and torch.isfinite(xh).all()
        assert torch.equal(xh[0], torch.zeros(64)) and torch.equal(xh[2], torch.zeros(64))
        assert (xh[1] - x[1]).norm() < 0.3 * x[1].norm()


def test_turbo_seed_changes_codes_not_quality():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(500, 128, generator=g)
    a, b = TurboQuantizer(128, 3, seed=0), TurboQuantizer(128, 3, seed=1)
    assert not torch.equal(a.quantize(x)[0], b.quantize(x)[0])
    assert abs(rel_mse(a, x) - rel_mse(b, x)) < 0.004


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 4, 64, generator=g) * 2).to(dtype)
    for q in (TurboQuantizer(64, 3), TurboQuantizer(64, 4, "lloyd_max"), AsymQuantizer(3)):
        c, m = q.quantize(x)
        c32, m32 = q.quantize(x.float())
        assert torch.equal(c, c32) and torch.equal(m, m32)
        assert m.dtype == torch.float16 and c.shape == x.shape
    qs = AsymQuantizer(3, streaming=True)
    c, m, r = qs.quantize(x, None)
    c32, m32, r32 = qs.quantize(x.float(), None)
    assert torch.equal(c, c32) and torch.equal(m, m32) and torch.equal(r, r32)


# ----------------------------------------------------------------------------- round half up


def test_round_half_up_function():
    v = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.4999, -0.50000006, 3.2, 6.5])
    assert round_half_up(v).tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 0.0, -1.0, 3.0, 7.0]


def test_asym_ties_go_up():
    q = AsymQuantizer(3)
    # min 0, max 7 -> scale exactly 1, zero 0; .5 values are exact bin midpoints
    x = torch.tensor([0.0, 7.0, 0.5, 2.5, 4.5, 6.5] + [1.0] * 58)
    codes, meta = q.quantize(x)
    assert meta.tolist() == [1.0, 0.0]
    assert codes[:6].tolist() == [0, 7, 1, 3, 5, 7]  # banker's rounding would give 0, 2, 4, 6
    # min -2.5 is the offset, scale 1: x + 2.5 is -2 -> 0.5 -> code 1, 0 -> 2.5 -> 3, 2 -> 4.5 -> 5
    # (half-even: 0, 2, 4), and the range's ends are codes 0 and 7
    x = torch.tensor([-2.5, 4.5, -2.0, 0.0, 2.0] + [1.0] * 59)
    codes, meta = q.quantize(x)
    assert meta.tolist() == [1.0, -2.5]
    assert codes[:5].tolist() == [0, 7, 1, 3, 5]


def turbo_tie_input(q: TurboQuantizer) -> torch.Tensor:
    """x with rot(x) = (2, 0, 2, 0, ...) / sqrt(d) exactly: y is sqrt(2) or exactly 0 (a tie)."""
    x = torch.zeros(q.head_dim)
    x[0], x[1] = q.signs[0], q.signs[1]
    return x


def test_turbo_uniform_tie_goes_up():
    for bits in (2, 3, 4):
        q = TurboQuantizer(64, bits, "uniform", seed=5)
        x = turbo_tie_input(q)
        y = q.rotate(x)
        assert torch.equal(y[1::2], torch.zeros(32))
        codes, _ = q.quantize(x)
        # y = 0 -> y/step + (n-1)/2 = (n-1)/2, a midpoint: goes up to n/2
        assert codes[1::2].tolist() == [(1 << bits) // 2] * 32


def test_turbo_lloyd_max_tie_goes_up():
    """A value exactly on a Lloyd-Max bin edge takes the upper level, as floor(v + 0.5) does on the
    uniform grid (the middle edge is exactly 0: the codebook is symmetric)."""
    for bits in (2, 3, 4):
        q = TurboQuantizer(64, bits, "lloyd_max", seed=5)
        levels = q.codebook()
        assert float(levels[(1 << bits) // 2] + levels[(1 << bits) // 2 - 1]) == 0.0
        codes, _ = q.quantize(turbo_tie_input(q))
        assert codes[1::2].tolist() == [(1 << bits) // 2] * 32


# ----------------------------------------------------------------------------- AsymQuantizer


def asym_bound(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Per vector: half a step (scale rounded to float16, float32 arithmetic) plus the float16
    rounding of the offset, which is the vector's minimum."""
    scale, offset = meta[..., :1].float(), meta[..., 1:].float()
    return scale / 2 * (1 + 1e-3) + (offset - x.float().amin(-1, keepdim=True)).abs() + 1e-6


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_asym_codes_and_error_bound(bits):
    q = AsymQuantizer(bits)
    g = torch.Generator().manual_seed(60 + bits)
    mag = torch.rand(5, 37, 3, 1, generator=g) * 4 + 0.1
    x = (torch.randn(5, 37, 3, 64, generator=g) + 0.3) * mag
    codes, meta = q.quantize(x)
    n = 1 << bits
    assert codes.shape == x.shape and meta.shape == (5, 37, 3, 2)
    assert int(codes.min()) >= 0 and int(codes.max()) <= n - 1
    scale, offset = meta[..., :1].float(), meta[..., 1:].float()
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    assert (mn < 0).all() and (mx > 0).all()  # vectors straddling 0
    torch.testing.assert_close(scale, ((mx - mn) / (n - 1)).half().float(), rtol=0, atol=0)
    torch.testing.assert_close(offset, mn.half().float(), rtol=0, atol=0)  # the grid starts at the minimum
    torch.testing.assert_close(codes.float(), torch.floor((x - offset) / scale + 0.5).clamp(0, n - 1), rtol=0, atol=0)
    xh = q.dequantize(codes, meta)
    err = (xh - x).abs()
    # every element, the range's ends included, within half a step of its level
    assert (err <= asym_bound(x, meta)).all()
    assert err.mean() < 0.3 * scale.mean()
    # no less accurate than an integer zero point (zero = round(-min / scale), offset -scale * zero),
    # whose grid is shifted off [min, max] by up to half a step (one end clamped)
    zero = torch.floor(-mn / scale + 0.5).clamp(0, n - 1)
    izp = torch.floor(x / scale + zero + 0.5).clamp(0, n - 1)
    err_izp = (izp * scale - (scale * zero).half().float() - x).abs()
    assert (err**2).mean() <= (err_izp**2).mean()
    assert (err / scale).amax() <= 0.5 * (1 + 1e-3) + 1e-3


def test_asym_zero_and_constant_vectors():
    q = AsymQuantizer(3)
    x = torch.stack([torch.zeros(64), torch.full((64,), 0.3), torch.full((64,), -2.0), torch.full((64,), 5.0)])
    codes, meta = q.quantize(x)
    xh = q.dequantize(codes, meta)
    assert torch.isfinite(meta.float()).all() and torch.isfinite(xh).all()
    assert torch.equal(xh[0], torch.zeros(64))
    assert (xh[1:] - x[1:]).abs().max() <= 0.5  # scale falls back to 1
    assert torch.equal(xh[2], x[2]) and torch.equal(xh[3], x[3])
    qs = AsymQuantizer(3, streaming=True)
    c, m, r = qs.quantize(torch.zeros(1, 2, 64), None)
    assert torch.isfinite(m.float()).all() and torch.equal(qs.dequantize(c, m), torch.zeros(1, 2, 64))
    assert torch.equal(r, torch.zeros(2))


def test_asym_vector_not_straddling_zero():
    """Vectors entirely above or below 0 (and constant ones) are coded on their own [min, max], as
    accurately as vectors straddling 0, not clamped to a grid that must contain 0."""
    q = AsymQuantizer(3)
    x = torch.stack(
        [torch.linspace(5, 6, 64), torch.full((64,), 10.0), torch.linspace(-9, -8, 64), torch.linspace(0.5, 100, 64)]
    )
    codes, meta = q.quantize(x)
    xh = q.dequantize(codes, meta)
    err = (xh - x).abs()
    assert (err <= asym_bound(x, meta)).all(), err.amax(-1)
    assert err[0].amax() <= 0.5 / 7 * 1.01 and torch.equal(xh[1], x[1]) and err[2].amax() <= 0.5 / 7 * 1.01
    assert codes[:, 0].tolist() == [0, 0, 0, 0] and codes[[0, 2, 3], -1].tolist() == [7, 7, 7]
    # random vectors shifted off 0: the same relative error as the centred ones, well below 1 bit
    g = torch.Generator().manual_seed(7)
    base = torch.rand(400, 64, generator=g)
    rel = {}
    for shift in (-20.0, 0.0, 20.0):
        v = base + shift
        c, m = q.quantize(v)
        rel[shift] = ((q.dequantize(c, m) - v) ** 2).sum() / ((v - v.mean(-1, keepdim=True)) ** 2).sum()
    assert rel[0.0] < 0.05
    for shift in (-20.0, 20.0):
        assert rel[shift] < 1.1 * rel[0.0], rel


def test_asym_streaming_ema():
    alpha = 0.9
    q = AsymQuantizer(3, streaming=True, alpha=alpha)
    g = torch.Generator().manual_seed(4)
    B, H, d = 2, 3, 64
    x1 = torch.randn(B, 5, H, d, generator=g)
    c1, m1, r1 = q.quantize(x1, None)
    expected1 = x1.abs().amax(dim=(1, 3))  # first call sets the range
    torch.testing.assert_close(r1, expected1, rtol=0, atol=0)
    # NaN range (what a fresh cache holds) also counts as "no range yet"
    _, _, r1n = q.quantize(x1, torch.full((B, H), float("nan")))
    torch.testing.assert_close(r1n, expected1, rtol=0, atol=0)
    x2 = torch.randn(B, 1, H, d, generator=g) * 3
    c2, m2, r2 = q.quantize(x2, r1)
    expected2 = alpha * x2.abs().amax(dim=(1, 3)) + (1 - alpha) * r1
    torch.testing.assert_close(r2, expected2, rtol=1e-6, atol=0)
    # scale = fp16(2 r / (n - 1)) per head, broadcast over tokens
    exp_scale = (2 * r2 / 7).half()
    assert torch.equal(m2[..., 0], exp_scale.unsqueeze(1).expand(B, 1, H))
    # reconstruction within half a step except at clamped codes
    xh = q.dequantize(c2, m2)
    s = m2[..., :1].float()
    inner = (c2 > 0) & (c2 < 7)
    err = (xh - x2).abs()
    assert (err[inner] <= (s / 2 * 1.002 + 1e-3 * s * 8).expand_as(err)[inner]).all()
    assert torch.isfinite(xh).all()
    # the quantizer keeps no state: same call, same answer
    c2b, m2b, r2b = q.quantize(x2, r1)
    assert torch.equal(c2, c2b) and torch.equal(m2, m2b) and torch.equal(r2, r2b)


def test_asym_streaming_centers_vector():
    q = AsymQuantizer(3, streaming=True, alpha=0.95)
    # a vector with values in [5, 6] and range r = 6: codes are centered, error small
    x = torch.linspace(5, 6, 64).reshape(1, 1, 1, 64)
    codes, meta, r = q.quantize(x, None)
    assert r.item() == 6.0
    xh = q.dequantize(codes, meta)
    scale = meta[..., 0].float().item()
    assert scale == pytest.approx(12 / 7, rel=1e-3)
    assert (xh - x).abs().max() <= scale / 2 + 1e-3
    # zero = round(3.5 - (mx + mn) / (2 scale)), clamped to [0, 7]
    zero = round((3.5 - 11 / (2 * scale)) + 1e-9)
    assert -meta[..., 1].float().item() == pytest.approx(scale * max(0, min(7, zero)), rel=1e-3)


def test_asym_update_range_shapes():
    q = AsymQuantizer(3, streaming=True, alpha=0.5)
    x = torch.zeros(2, 4, 3, 32)
    x[1, 2, 0, 5] = -8.0
    r = q.update_range(x, None)
    assert r.shape == (2, 3) and r[1, 0].item() == 8.0 and r[0].abs().sum() == 0
    r2 = q.update_range(torch.zeros(2, 1, 3, 32), r)
    # zero previous range counts as "unset" (not finite and > 0) -> take the new max (0)
    assert r2[1, 0].item() == 4.0 and r2[0].abs().sum() == 0
