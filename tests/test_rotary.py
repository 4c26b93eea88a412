"""flash_attn_tq.layers.rotary: the rotary embedding API of flash_attn.layers.rotary (2.8.3).

The reference treats each rotated channel pair as a complex number and multiplies it by
exp(i * angle) in float64; it shares no code with the module under test."""

import math
import zlib

import pytest
import torch

from flash_attn_tq.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
    rotate_half,
)


def gen_for(*parts):
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def tables(gen, seqlen_ro, rotary_dim, dtype=torch.float64):
    """Random angles (seqlen_ro, rotary_dim / 2) float64 and their cos / sin in dtype."""
    angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return angles, angles.cos().to(dtype), angles.sin().to(dtype)


def complex_rotary(x, angles, positions, interleaved):
    """x (..., H, D) float64, positions (...) ints (-1: leave the token alone)."""
    x = x.double().clone()
    half = angles.shape[1]
    rd = 2 * half
    pos = positions.clamp(min=0)
    theta = angles[pos] * (positions >= 0).unsqueeze(-1)  # (..., half)
    turn = torch.polar(torch.ones_like(theta), theta).unsqueeze(-2)  # over heads
    if interleaved:
        re, im = x[..., 0:rd:2], x[..., 1:rd:2]
    else:
        re, im = x[..., :half], x[..., half:rd]
    z = torch.complex(re, im) * turn
    if interleaved:
        x[..., 0:rd:2], x[..., 1:rd:2] = z.real, z.imag
    else:
        x[..., :half], x[..., half:rd] = z.real, z.imag
    return x


def dense_positions(batch, seqlen, offsets):
    steps = torch.arange(seqlen).unsqueeze(0)
    if isinstance(offsets, torch.Tensor):
        return steps + offsets.long().unsqueeze(1)
    return (steps + offsets).expand(batch, seqlen)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=atol)


OFFSETS = ["zero", "int", "tensor"]


def make_offsets(kind, gen, batch, limit):
    if kind == "zero":
        return 0
    if kind == "int":
        return int(torch.randint(0, limit + 1, (1,), generator=gen))
    return torch.randint(0, limit + 1, (batch,), generator=gen, dtype=torch.int32)


# ------------------------------------------------------------------ apply_rotary_emb


@pytest.mark.parametrize("offsets_kind", OFFSETS)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_emb_matches_formula(inplace, interleaved, rotary_fraction, offsets_kind):
    gen = gen_for("apply", inplace, interleaved, rotary_fraction, offsets_kind)
    batch, seqlen, heads, d = 3, 13, 2, 16
    rd = int(d * rotary_fraction)
    angles, cos, sin = tables(gen, 2 * seqlen, rd)
    offsets = make_offsets(offsets_kind, gen, batch, seqlen)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64)
    x_before = x.clone()
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets)
    want = complex_rotary(x_before, angles, dense_positions(batch, seqlen, offsets), interleaved)
    close(out, want, atol=1e-12)
    assert torch.equal(out[..., rd:], x_before[..., rd:])  # channels past rotary_dim untouched
    if inplace:
        assert out.data_ptr() == x.data_ptr() and torch.equal(x, out)
    else:
        assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    """16-bit input and tables: the rotation by the stored (rounded) cos / sin, computed in
    float32 and rounded once to the input's dtype."""
    gen = gen_for("lowp", str(dtype))
    batch, seqlen, heads, d = 2, 21, 3, 32
    _, cos, sin = tables(gen, seqlen + 5, d, dtype)
    x = torch.randn(batch, seqlen, heads, d, generator=gen).to(dtype)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=5)
    assert out.dtype == dtype
    turn = torch.complex(cos.double(), sin.double())[5 : 5 + seqlen].unsqueeze(-2)
    xd = x.double()
    z = torch.complex(xd[..., : d // 2], xd[..., d // 2 :]) * turn
    want = torch.cat([z.real, z.imag], dim=-1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), want, atol=4 * eps, rtol=2 * eps)


def test_interleaved_is_permuted_rotate_half():
    gen = gen_for("perm")
    batch, seqlen, heads, d, rd = 2, 6, 2, 12, 8
    _, cos, sin = tables(gen, seqlen, rd)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64)
    # channel order that puts the even channels of the rotary part first, the odd ones next
    perm = torch.cat([torch.arange(0, rd, 2), torch.arange(1, rd, 2), torch.arange(rd, d)])
    inverse = torch.argsort(perm)
    a = apply_rotary_emb(x, cos, sin, interleaved=True)
    b = apply_rotary_emb(x[..., perm], cos, sin, interleaved=False)[..., inverse]
    close(a, b, atol=1e-13)


def test_rotate_half_and_torch_reference():
    x = torch.arange(1.0, 7.0)
    assert rotate_half(x).tolist() == [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]
    assert rotate_half(x, interleaved=True).tolist() == [-2.0, 1.0, -4.0, 3.0, -6.0, 5.0]
    gen = gen_for("torch-ref")
    batch, seqlen, heads, d, rd = 2, 5, 3, 10, 6
    angles, cos, sin = tables(gen, 9, rd)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([1, 4])
    pos = dense_positions(batch, seqlen, offsets)
    for interleaved in (False, True):
        want = complex_rotary(x, angles, pos, interleaved)
        close(apply_rotary_emb_torch(x, cos[pos], sin[pos], interleaved), want, atol=1e-12)
        close(apply_rotary_emb_torch(x[:1], cos[1:6], sin[1:6], interleaved), want[:1], atol=1e-12)
    assert apply_rotary_emb_func is apply_rotary_emb


def test_norm_and_relative_position():
    """Rotations keep norms, and q.k depends only on the distance between positions."""
    gen = gen_for("relative")
    d = 16
    rope = RotaryEmbedding(d)
    q = torch.randn(1, 1, 1, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, d, generator=gen, dtype=torch.float64)
    rope._update_cos_sin_cache(64, device=q.device, dtype=torch.float64)
    cos, sin = rope._cos_cached, rope._sin_cached

    def at(x, p):
        return apply_rotary_emb(x, cos, sin, seqlen_offsets=p)

    # (the tables are built in float32, as upstream, then stored in float64)
    close(at(q, 9).norm(), q.norm(), atol=1e-6)
    dots = [(at(q, m) * at(k, m - 3)).sum().item() for m in (3, 10, 40, 63)]
    assert max(dots) - min(dots) < 1e-5


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradient_is_inverse_rotation(interleaved):
    gen = gen_for("grad", interleaved)
    batch, seqlen, heads, d, rd = 2, 7, 2, 10, 6
    angles, cos, sin = tables(gen, 12, rd)
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    want = complex_rotary(g, -angles, dense_positions(batch, seqlen, offsets), interleaved)
    close(x.grad, want, atol=1e-12)
    assert cos.grad is None

    def fn(t):
        return apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)

    y = x.detach().requires_grad_()
    assert torch.autograd.gradcheck(fn, (y,))
    assert torch.autograd.gradgradcheck(fn, (y,))


def test_inplace_on_leaf_that_requires_grad():
    """As upstream, the in-place variants accept a leaf that requires grad."""
    gen = gen_for("leaf")
    batch, seqlen, heads, d = 2, 5, 2, 8
    _, cos, sin = tables(gen, seqlen, d)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    out = apply_rotary_emb(x, cos, sin, inplace=True)
    ref = apply_rotary_emb(ref_x, cos, sin)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.detach(), ref.detach())
    close(x.grad, ref_x.grad, atol=1e-13)


# ------------------------------------------------------------------ varlen and limits


@pytest.mark.parametrize("offsets_kind", OFFSETS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen_matches_per_sequence(interleaved, offsets_kind):
    gen = gen_for("varlen", interleaved, offsets_kind)
    lengths = [4, 0, 7, 1]
    cu = torch.tensor(
        [2] + [2 + sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32
    )  # starts at row 2: rows 0, 1 and the tail are outside
    total, heads, d, rd = int(cu[-1]) + 3, 2, 8, 8
    angles, cos, sin = tables(gen, 16, rd)
    offsets = make_offsets(offsets_kind, gen, len(lengths), 8)
    x = torch.randn(total, heads, d, generator=gen, dtype=torch.float64)
    out = apply_rotary_emb(
        x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=max(lengths)
    )
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        off = offsets[b : b + 1] if isinstance(offsets, torch.Tensor) else offsets
        seq = apply_rotary_emb(x[None, rows], cos, sin, interleaved=interleaved, seqlen_offsets=off)
        close(out[rows], seq[0], atol=1e-13)
        pos = torch.arange(n) + (int(offsets[b]) if isinstance(offsets, torch.Tensor) else offsets)
        close(out[rows], complex_rotary(x[rows], angles, pos, interleaved), atol=1e-12)
    outside = [0, 1] + list(range(int(cu[-1]), total))
    assert torch.equal(out[outside], x[outside])
    # in place
    y = x.clone()
    apply_rotary_emb(
        y,
        cos,
        sin,
        interleaved=interleaved,
        inplace=True,
        seqlen_offsets=offsets,
        cu_seqlens=cu,
        max_seqlen=max(lengths),
    )
    assert torch.equal(y, out)


def test_positions_past_the_table_are_left_alone():
    """With per-sequence offsets, tokens at or past seqlen_ro keep their values (kernel)."""
    gen = gen_for("past")
    batch, seqlen, heads, d = 2, 6, 1, 4
    angles, cos, sin = tables(gen, 8, d)
    x = torch.randn(batch, seqlen, heads, d, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([0, 5])
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    pos = dense_positions(batch, seqlen, offsets)
    pos = torch.where(pos < 8, pos, torch.full_like(pos, -1))
    close(out, complex_rotary(x, angles, pos, False), atol=1e-12)
    assert torch.equal(out[1, 3:], x[1, 3:])


def test_argument_checks():
    x = torch.randn(2, 6, 1, 8)
    cos = torch.ones(8, 4)
    with pytest.raises(ValueError, match="exceeds"):
        apply_rotary_emb(x, cos, cos, seqlen_offsets=3)  # 3 + 6 > 8
    with pytest.raises(ValueError, match="exceeds"):
        apply_rotary_emb(torch.randn(2, 9, 1, 8), cos, cos)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(torch.randn(2, 6, 1, 6), cos, cos)
    with pytest.raises(ValueError, match="shape"):
        apply_rotary_emb(x, cos, cos, seqlen_offsets=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_rotary_emb(x, cos, cos, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(2, 6, 4, 8), cos, cos)


# ------------------------------------------------------------------ qkv / kv helpers


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("offsets_kind", OFFSETS)
@pytest.mark.parametrize("separate_k_tables", [False, True])
def test_apply_rotary_emb_qkv_(gqa, offsets_kind, separate_k_tables):
    gen = gen_for("qkv", gqa, offsets_kind, separate_k_tables)
    batch, seqlen, hq, d, rd = 2, 9, 4, 8, 4
    hk = 1 if gqa else hq
    angles, cos, sin = tables(gen, 2 * seqlen, rd)
    angles_k, cos_k, sin_k = tables(gen, 2 * seqlen, rd) if separate_k_tables else (angles, None, None)
    offsets = make_offsets(offsets_kind, gen, batch, seqlen)
    shape = (batch, seqlen, hq + 2 * hk, d) if gqa else (batch, seqlen, 3, hq, d)
    qkv = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    before = qkv.detach().clone()
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=offsets, num_heads_q=hq if gqa else None)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(qkv.detach(), out.detach())
    if gqa:
        q, k, v = before.split([hq, hk, hk], dim=2)
        got_q, got_k, got_v = out.detach().split([hq, hk, hk], dim=2)
    else:
        q, k, v = before.unbind(2)
        got_q, got_k, got_v = out.detach().unbind(2)
    pos = dense_positions(batch, seqlen, offsets)
    close(got_q, complex_rotary(q, angles, pos, False), atol=1e-12)
    close(got_k, complex_rotary(k, angles_k, pos, False), atol=1e-12)
    assert torch.equal(got_v, v)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    if gqa:
        gq, gk, gv = g.split([hq, hk, hk], dim=2)
        dq, dk, dv = qkv.grad.split([hq, hk, hk], dim=2)
    else:
        (gq, gk, gv), (dq, dk, dv) = g.unbind(2), qkv.grad.unbind(2)
    close(dq, complex_rotary(gq, -angles, pos, False), atol=1e-12)
    close(dk, complex_rotary(gk, -angles_k, pos, False), atol=1e-12)
    assert torch.equal(dv, gv)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_kv_(interleaved):
    gen = gen_for("kv", interleaved)
    batch, seqlen, heads, d = 2, 7, 2, 6
    angles, cos, sin = tables(gen, 12, d)
    offsets = torch.tensor([3, 1], dtype=torch.int64)
    kv = torch.randn(batch, seqlen, 2, heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    before = kv.detach().clone()
    out = apply_rotary_emb_kv_(kv, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    pos = dense_positions(batch, seqlen, offsets)
    close(out[:, :, 0], complex_rotary(before[:, :, 0], angles, pos, interleaved), atol=1e-12)
    assert torch.equal(out[:, :, 1].detach(), before[:, :, 1])
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    close(kv.grad[:, :, 0], complex_rotary(g[:, :, 0], -angles, pos, interleaved), atol=1e-12)
    assert torch.equal(kv.grad[:, :, 1], g[:, :, 1])


# ------------------------------------------------------------------ RotaryEmbedding


def rope_angles(dim, base, seqlen):
    inv_freq = [base ** (-(2 * i) / dim) for i in range(dim // 2)]
    return torch.tensor([[p * f for f in inv_freq] for p in range(seqlen)], dtype=torch.float64)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotary_embedding_qkv(interleaved, rotary_dim):
    gen = gen_for("module", interleaved, rotary_dim)
    batch, seqlen, heads, d = 2, 5, 3, 8
    rope = RotaryEmbedding(rotary_dim, base=500.0, interleaved=interleaved)
    qkv = torch.randn(batch, seqlen, 3, heads, d, generator=gen)
    before = qkv.clone()
    out = rope(qkv, seqlen_offset=4)
    assert out.data_ptr() == qkv.data_ptr()
    assert rope._cos_cached.shape == (seqlen + 4, rotary_dim // 2)
    assert rope._cos_cached.dtype == torch.float32
    angles = rope_angles(rotary_dim, 500.0, seqlen + 4)
    close(rope._cos_cached, angles.cos(), atol=1e-6)
    close(rope._sin_cached, angles.sin(), atol=1e-6)
    pos = dense_positions(batch, seqlen, 4)
    for i in (0, 1):
        close(out[:, :, i], complex_rotary(before[:, :, i], angles, pos, interleaved), atol=2e-6)
    assert torch.equal(out[:, :, 2], before[:, :, 2])


def test_rotary_embedding_q_and_kv_and_tensor_offsets():
    gen = gen_for("module-kv")
    batch, seqlen, hq, hk, d = 3, 4, 4, 2, 8
    rope = RotaryEmbedding(d)
    q = torch.randn(batch, seqlen, hq, d, generator=gen)
    kv = torch.randn(batch, seqlen, 2, hk, d, generator=gen)
    q0, kv0 = q.clone(), kv.clone()
    offsets = torch.tensor([0, 3, 6], dtype=torch.int32)
    q_out, kv_out = rope(q, kv, seqlen_offset=offsets, max_seqlen=10)
    assert rope._cos_cached.shape[0] == 10
    angles = rope_angles(d, 10000.0, 10)
    pos = dense_positions(batch, seqlen, offsets)
    close(q_out, complex_rotary(q0, angles, pos, False), atol=2e-6)
    close(kv_out[:, :, 0], complex_rotary(kv0[:, :, 0], angles, pos, False), atol=2e-6)
    assert torch.equal(kv_out[:, :, 1], kv0[:, :, 1])
    # GQA-packed qkv
    qkv = torch.cat([q0, kv0[:, :, 0], kv0[:, :, 1]], dim=2)
    out = rope(qkv, seqlen_offset=offsets, max_seqlen=10, num_heads_q=hq)
    close(out[:, :, :hq], q_out, atol=1e-6)
    close(out[:, :, hq : hq + hk], kv_out[:, :, 0], atol=1e-6)


def test_rotary_embedding_xpos():
    """XPos: q scaled by zeta ** ((p - L // 2) / scale_base), k by its inverse."""
    gen = gen_for("xpos")
    batch, seqlen, heads, d, scale_base = 1, 6, 1, 8, 16
    rope = RotaryEmbedding(d, scale_base=scale_base)
    qkv = torch.randn(batch, seqlen, 3, heads, d, generator=gen, dtype=torch.float64)
    before = qkv.clone()
    rope(qkv)
    L = rope._seq_len_cached
    zeta = torch.tensor([(2 * i + 0.4 * d) / (1.4 * d) for i in range(d // 2)], dtype=torch.float64)
    power = (torch.arange(L, dtype=torch.float64) - L // 2) / scale_base
    scale = zeta.unsqueeze(0) ** power.unsqueeze(1)  # (L, d / 2)
    angles = rope_angles(d, 10000.0, L)
    pos = dense_positions(batch, seqlen, 0)
    sc = torch.cat([scale, scale], dim=-1)[pos].unsqueeze(-2)
    close(qkv[:, :, 0], complex_rotary(before[:, :, 0], angles, pos, False) * sc, atol=1e-6)
    close(qkv[:, :, 1], complex_rotary(before[:, :, 1], angles, pos, False) / sc, atol=1e-6)
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])


def test_rotary_embedding_cache_and_precision():
    rope = RotaryEmbedding(8, device="cpu")  # upstream's positional order: dim, base, ..., device
    RotaryEmbedding(8, 10000.0, False, None, torch.device("cpu"))
    x = torch.randn(1, 4, 3, 1, 8)
    rope(x.clone())
    first = rope._cos_cached
    rope(x.clone()[:, :2])  # shorter: cache kept
    assert rope._cos_cached is first
    rope(x.clone(), seqlen_offset=3)  # longer: rebuilt
    assert rope._cos_cached.shape[0] == 7
    rope(x.clone().double())  # other dtype: rebuilt
    assert rope._cos_cached.dtype == torch.float64
    fresh = RotaryEmbedding(8).eval()
    with torch.inference_mode():
        fresh(x.clone())
    assert fresh._cos_cached.is_inference()
    fresh(x.clone())  # eval mode: the inference-mode cache is fine
    assert fresh._cos_cached.is_inference()
    fresh.train()(x.clone())  # training after an inference-mode cache: rebuilt
    assert not fresh._cos_cached.is_inference()

    # a module cast to bfloat16 still builds its tables from float32 positions ...
    low = RotaryEmbedding(8).to(torch.bfloat16)
    assert low.inv_freq.dtype == torch.bfloat16
    low._update_cos_sin_cache(300, dtype=torch.float32)
    close(low._cos_cached, rope_angles(8, 10000.0, 300).cos(), atol=2e-4)
    # ... unless asked for the older behaviour, where positions past 256 round in bfloat16
    old = RotaryEmbedding(8, pos_idx_in_fp32=False).to(torch.bfloat16)
    old._update_cos_sin_cache(300, dtype=torch.float32)
    err = (old._cos_cached.double() - rope_angles(8, 10000.0, 300).cos()).abs().max().item()
    assert err > 1e-2
