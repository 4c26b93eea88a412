"""Tests for flash_attn_tq.baseline against an independent, naive float64 reference.

The reference below builds every mask / bias entry one element at a time and
computes each (head, query row) separately; it shares no code with the module
under test.
"""

import math
import zlib

import pytest
import torch

from flash_attn_tq.baseline import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

INF = float("inf")


# ------------------------------------------------------------------ reference


def naive_one(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None, start=0, end=None):
    """One sequence.  q (Sq, Hq, d), k/v (Sk, Hk, d), float64, differentiable.

    Keys with start <= j < end are valid; they form a sequence of length
    end - start whose key j - start is compared against the bottom-right
    diagonal i + (end - start) - Sq.  Returns out (Sq, Hq, d), lse (Hq, Sq)."""
    Sq, Hq, d = q.shape
    Sk, Hk = k.shape[0], k.shape[1]
    end = Sk if end is None else end
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if Sq == 0:
        return q.new_zeros(0, Hq, v.shape[-1]), q.new_zeros(Hq, 0)
    left, right = window
    if causal:
        right = 0
    n = end - start
    allowed = [[False] * Sk for _ in range(Sq)]
    dist = torch.zeros(Sq, Sk, dtype=torch.float64)
    for i in range(Sq):
        diag = i + n - Sq
        for j in range(Sk):
            if j < start or j >= end:
                continue
            jj = j - start
            if left >= 0 and jj < diag - left:
                continue
            if right >= 0 and jj > diag + right:
                continue
            allowed[i][j] = True
            dist[i, j] = abs(diag - jj)
    outs, lses = [], []
    for h in range(Hq):
        kh, vh = k[:, h // (Hq // Hk)], v[:, h // (Hq // Hk)]
        s = (q[:, h] @ kh.T) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s - float(slopes[h]) * dist
        rows_o, rows_l = [], []
        for i in range(Sq):
            idx = [j for j in range(Sk) if allowed[i][j]]
            if not idx:
                rows_o.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                rows_l.append(torch.tensor(INF, dtype=torch.float64))
                continue
            row = s[i, idx]
            m = row.max().detach()
            lse = m + torch.log(torch.exp(row - m).sum())
            p = torch.exp(row - lse)
            rows_o.append(p @ vh[idx])
            rows_l.append(lse)
        outs.append(torch.stack(rows_o))
        lses.append(torch.stack(rows_l))
    return torch.stack(outs, dim=1), torch.stack(lses)


def naive_probs(q, k, scale, causal, window, softcap, slopes):
    """Probabilities (Hq, Sq, Sk) for one sequence, via naive_one with one-hot values."""
    Sk, Hk = k.shape[0], k.shape[1]
    eye = torch.eye(Sk, dtype=torch.float64).unsqueeze(1).expand(Sk, Hk, Sk)
    out, _ = naive_one(q, k, eye, scale, causal, window, softcap, slopes)
    return out.permute(1, 0, 2)


def naive_batch(q, k, v, slopes=None, **kw):
    """Batched (B, S, H, d) wrapper; slopes (H,) or (B, H)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, l = naive_one(q[b], k[b], v[b], slopes=sl, **kw)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def naive_rotary(x, cos, sin, positions, interleaved):
    """x (B, S, H, d) float64; positions (B, S) ints; rotate pair by pair."""
    x = x.clone()
    rot = cos.shape[1] * 2
    B, S = x.shape[:2]
    for b in range(B):
        for s in range(S):
            p = int(positions[b][s])
            for m in range(rot // 2):
                a, c = (2 * m, 2 * m + 1) if interleaved else (m, m + rot // 2)
                xa, xc = x[b, s, :, a].clone(), x[b, s, :, c].clone()
                co, si = float(cos[p, m]), float(sin[p, m])
                x[b, s, :, a] = xa * co - xc * si
                x[b, s, :, c] = xa * si + xc * co
    return x


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


def gen_for(seed):
    return torch.Generator().manual_seed(seed)


def d64(*xs):
    return [x.detach().double() for x in xs]


def assert_close(a, b, atol=2e-5, rtol=2e-5):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=False)


def assert_lse(lse, ref, atol=2e-5):
    lse, ref = lse.double(), ref.double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref))
    assert (lse[torch.isinf(lse)] > 0).all()
    fin = ~torch.isinf(ref)
    torch.testing.assert_close(lse[fin], ref[fin], atol=atol, rtol=atol)


# ------------------------------------------------------------ dense functions

SEQLENS = [(7, 7), (5, 13), (13, 5), (1, 9)]
HEADS = [(4, 4), (4, 2), (3, 1)]
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(3, 1)),
    "window_left_causal": dict(window=(2, -1), causal=True),
    "window_right_only": dict(window=(-1, 2)),
    "softcap_alibi": dict(softcap=2.5, alibi="batch"),
    "alibi_causal": dict(alibi="heads", causal=True),
    "scale": dict(scale=0.31, window=(0, 0)),
}


def _split_opts(opts, gen, B, H):
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    slopes = None
    if alibi == "heads":
        slopes = torch.rand(H, generator=gen)
    elif alibi == "batch":
        slopes = torch.rand(B, H, generator=gen)
    window = opts.get("window", (-1, -1))
    api = dict(
        causal=opts.get("causal", False),
        window_size=window,
        softcap=opts.get("softcap", 0.0),
        alibi_slopes=slopes,
        softmax_scale=opts.get("scale"),
    )
    ref = dict(causal=api["causal"], window=window, softcap=api["softcap"], scale=opts.get("scale"))
    return api, ref, slopes


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"q{s[0]}k{s[1]}")
def test_func_forward(seqlens, heads, opt):
    gen = gen_for(seed_of((seqlens, heads, opt)))
    (Sq, Sk), (Hq, Hk), B, d = seqlens, heads, 2, 6
    q, k, v = randn(gen, B, Sq, Hq, d), randn(gen, B, Sk, Hk, d), randn(gen, B, Sk, Hk, d)
    api, ref, slopes = _split_opts(OPTIONS[opt], gen, B, Hq)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **api)
    assert out.dtype == torch.float32 and out.shape == (B, Sq, Hq, d)
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq)
    out_ref, lse_ref = naive_batch(*d64(q, k, v), slopes=slopes, **ref)
    assert_close(out, out_ref)
    assert_lse(lse, lse_ref)
    assert probs.shape == (B, Hq, Sq, Sk)
    b = B - 1
    p_ref = naive_probs(
        *d64(q[b], k[b]),
        ref["scale"],
        ref["causal"],
        ref["window"],
        ref["softcap"],
        None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b]),
    )
    assert_close(probs[b], p_ref)


@pytest.mark.parametrize("opt", ["causal", "window", "softcap_alibi", "alibi_causal"])
@pytest.mark.parametrize("seqlens", [(5, 11), (11, 5)], ids=lambda s: f"q{s[0]}k{s[1]}")
def test_func_backward(seqlens, opt):
    gen = gen_for(seed_of((seqlens, opt, "bwd")))
    (Sq, Sk), Hq, Hk, B, d = seqlens, 4, 2, 2, 5
    q, k, v = randn(gen, B, Sq, Hq, d), randn(gen, B, Sk, Hk, d), randn(gen, B, Sk, Hk, d)
    dout = randn(gen, B, Sq, Hq, d)
    api, ref, slopes = _split_opts(OPTIONS[opt], gen, B, Hq)
    qs, ks, vs = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn_func(qs, ks, vs, **api).backward(dout)
    q64, k64, v64 = [x.requires_grad_() for x in d64(q, k, v)]
    out_ref, _ = naive_batch(q64, k64, v64, slopes=slopes, **ref)
    out_ref.backward(dout.double())
    for got, want in ((qs.grad, q64.grad), (ks.grad, k64.grad), (vs.grad, v64.grad)):
        assert torch.isfinite(got).all()
        assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_packed_equivalence_and_grads():
    gen = gen_for(11)
    B, S, H, d = 2, 9, 3, 7
    qkv = randn(gen, B, S, 3, H, d)
    dout = randn(gen, B, S, H, d)
    kw = dict(causal=True, window_size=(4, -1), softcap=3.0)
    qkv1 = qkv.clone().requires_grad_()
    out1 = flash_attn_qkvpacked_func(qkv1, **kw)
    out1.backward(dout)
    q2 = qkv[:, :, 0].clone().requires_grad_()
    kv2 = qkv[:, :, 1:].clone().requires_grad_()
    out2 = flash_attn_kvpacked_func(q2, kv2, **kw)
    out2.backward(dout)
    q3, k3, v3 = [qkv[:, :, i].clone().requires_grad_() for i in range(3)]
    out3 = flash_attn_func(q3, k3, v3, **kw)
    out3.backward(dout)
    assert torch.equal(out1, out3) and torch.equal(out2, out3)
    assert_close(qkv1.grad, torch.stack([q3.grad, k3.grad, v3.grad], dim=2))
    assert_close(kv2.grad, torch.stack([k3.grad, v3.grad], dim=2))
    assert_close(q2.grad, q3.grad)
    out_ref, _ = naive_batch(*d64(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), causal=True, window=(4, -1), softcap=3.0)
    assert_close(out1, out_ref)


def test_docstring_causal_masks():
    """The bottom-right aligned causal masks drawn in the upstream docstring."""
    gen = gen_for(1)
    for Sq, Sk, want in ((2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])):
        q, k, v = randn(gen, 1, Sq, 1, 4), randn(gen, 1, Sk, 1, 4), randn(gen, 1, Sk, 1, 4)
        _, _, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert ((probs[0, 0] > 0).int() == torch.tensor(want, dtype=torch.int32)).all()


def test_fully_masked_rows():
    """causal with seqlen_q > seqlen_k: leading rows see no key -> out 0, lse +inf, grads 0."""
    gen = gen_for(3)
    q, k, v = randn(gen, 1, 6, 2, 4), randn(gen, 1, 2, 2, 4), randn(gen, 1, 2, 2, 4)
    qs = q.clone().requires_grad_()
    out, lse, _ = flash_attn_func(qs, k, v, causal=True, return_attn_probs=True)
    assert (out[:, :4] == 0).all() and torch.isposinf(lse[:, :, :4]).all()
    assert torch.isfinite(lse[:, :, 4:]).all()
    out.sum().backward()
    assert torch.isfinite(qs.grad).all() and (qs.grad[:, :4] == 0).all()
    # a window that excludes every key for some rows behaves the same way
    out, lse, _ = flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True)
    assert (out[:, :4] == 0).all() and torch.isposinf(lse[:, :, :4]).all()


# Upstream's S_dmask with dropout: unnormalized exp scores against the kernel's running
# maximum over key blocks (walked last to first), dropped entries negated.  Decoded as
# upstream's tests do: keep = S >= 0, unnormalized = |S|, then rescaled to probabilities.


def naive_scores(q, k, scale, causal, window, softcap, slopes):
    """Scores (Hq, Sq, Sk) for one sequence, float64, -inf where masked; built entry by entry."""
    Sq, Hq, d = q.shape
    Sk, Hk = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    if causal:
        right = 0
    out = torch.full((Hq, Sq, Sk), -INF, dtype=torch.float64)
    for h in range(Hq):
        dots = (q[:, h] @ k[:, h // (Hq // Hk)].T).tolist()
        for i in range(Sq):
            diag = i + Sk - Sq
            for j in range(Sk):
                if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                    continue
                s = dots[i][j] * scale
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s -= float(slopes[h]) * abs(diag - j)
                out[h, i, j] = s
    return out


def running_block_max(scores, block_n):
    """Per entry, the row maximum over its key block and all later blocks (0 if -inf)."""
    H, Sq, Sk = scores.shape
    m = torch.zeros_like(scores)
    for h in range(H):
        for i in range(Sq):
            for j in range(Sk):
                top = scores[h, i, (j // block_n) * block_n :].max().item()
                m[h, i, j] = 0.0 if top == -INF else top
    return m


def check_s_dmask(
    sd, out, lse, q, k, v, p, block_n, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None, atol=2e-5
):
    """One sequence: sd (Hq, Sq, Sk), out (Sq, Hq, d), lse (Hq, Sq; taken before dropout).

    Returns (number of dropped entries, number of allowed entries)."""
    q, k, v = d64(q, k, v)
    Hq, Hk = q.shape[1], k.shape[1]
    scores = naive_scores(q, k, scale, causal, window, softcap, slopes)
    m = running_block_max(scores, block_n)
    allowed = scores > -INF
    lse_ref = torch.logsumexp(scores, dim=-1)
    assert_lse(lse, lse_ref.masked_fill(torch.isneginf(lse_ref), INF), atol=atol)
    keep = sd >= 0
    unnorm = sd.abs().double()
    # dropped entries keep their magnitude; only the sign carries the dropout pattern
    assert_close(unnorm, torch.exp(scores - m), atol=atol, rtol=atol)
    probs = unnorm * torch.exp(m - lse.double().unsqueeze(-1))
    probs = torch.where(allowed, probs, torch.zeros_like(probs))
    p_ref = naive_probs(q, k, scale, causal, window, softcap, slopes)
    assert_close(probs, p_ref, atol=atol, rtol=atol)
    dropped = probs * keep / (1 - p)
    v_h = v.repeat_interleave(Hq // Hk, dim=1)
    out_ref = torch.einsum("hqk,khd->qhd", dropped, v_h)
    assert_close(out, out_ref, atol=atol, rtol=atol)
    return (allowed & ~keep).sum().item(), allowed.sum().item()


# headdim -> key-block width of upstream's forward kernel with dropout
BLOCK_N = {8: 128, 40: 64, 96: 64, 128: 32, 160: 64}
DROPOUT_OPTS = ["plain", "causal", "window", "softcap_alibi"]


@pytest.mark.parametrize("api_fn", ["func", "kvpacked", "qkvpacked"])
@pytest.mark.parametrize("opt", DROPOUT_OPTS)
@pytest.mark.parametrize("d", [8, 40, 128])
def test_dropout_s_dmask(d, opt, api_fn):
    gen = gen_for(seed_of(("dropout", d, opt, api_fn)))
    B, Hq, Hk, p = 2, 2, 1 if api_fn != "qkvpacked" else 2, 0.25
    Sq, Sk = (40, 40) if api_fn == "qkvpacked" else (9, 70)
    q, k, v = randn(gen, B, Sq, Hq, d), randn(gen, B, Sk, Hk, d), randn(gen, B, Sk, Hk, d)
    api, ref, slopes = _split_opts(OPTIONS[opt], gen, B, Hq)
    torch.manual_seed(seed_of(("dropout-rng", d, opt)))
    if api_fn == "func":
        out, lse, sd = flash_attn_func(q, k, v, p, return_attn_probs=True, **api)
    elif api_fn == "kvpacked":
        out, lse, sd = flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), p, return_attn_probs=True, **api)
    else:
        out, lse, sd = flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), p, return_attn_probs=True, **api)
    # upstream's shape: both lengths rounded up to a multiple of 128, the padding zero
    assert sd.shape == (B, Hq, 128, 128) and sd.dtype == q.dtype
    assert (sd[:, :, Sq:] == 0).all() and (sd[:, :, :, Sk:] == 0).all()
    sd = sd[:, :, :Sq, :Sk]
    dropped = allowed = 0
    for b in range(B):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        nd, na = check_s_dmask(
            sd[b],
            out[b],
            lse[b],
            q[b],
            k[b],
            v[b],
            p,
            BLOCK_N[d],
            ref["scale"],
            ref["causal"],
            ref["window"],
            ref["softcap"],
            sl,
        )
        dropped, allowed = dropped + nd, allowed + na
    assert abs(dropped / allowed - p) < 0.06


# upstream's _get_block_size_n, spelled out: head size -> (dropout, no dropout) on sm80 / sm90
UPSTREAM_BLOCK_N = [(32, 128, 128), (64, 64, 128), (96, 64, 64), (128, 32, 64), (256, 64, 64)]


def test_get_block_size_n_table():
    from flash_attn_tq.baseline import get_block_size_n

    for d in range(1, 257):
        want_dropout, want_plain = next((w, p) for top, w, p in UPSTREAM_BLOCK_N if d <= top)
        for causal in (False, True):
            assert get_block_size_n("cpu", d, True, causal) == want_dropout
            assert get_block_size_n(torch.device("cpu"), d, False, causal) == want_plain
    assert {d: get_block_size_n("cpu", d, True, False) for d in BLOCK_N} == BLOCK_N
    for bad in (0, 257, 64.0):
        with pytest.raises(ValueError, match="head_dim"):
            get_block_size_n("cpu", bad, True, False)


def test_get_block_size_n_sm8x(monkeypatch):
    """Only the no-dropout width at head sizes 97-128 depends on the GPU (sm86 / sm89)."""
    from flash_attn_tq import baseline

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, want in (((8, 6), (32, 64)), ((8, 9), (32, 64)), ((8, 0), (64, 64)), ((9, 0), (64, 64))):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert (
            baseline.get_block_size_n("cuda", 128, False, False),
            baseline.get_block_size_n(0, 111, False, True),
        ) == want
        assert baseline.get_block_size_n("cuda:0", 128, True, False) == 32
        assert baseline.get_block_size_n("cpu", 128, False, False) == 64  # not a CUDA device


@pytest.mark.parametrize("api_fn", ["varlen", "varlen_kvpacked", "varlen_qkvpacked"])
def test_dropout_s_dmask_varlen(api_fn):
    gen = gen_for(seed_of(("dropout-varlen", api_fn)))
    lq, lk = [5, 0, 40, 2], [33, 4, 40, 1]
    if api_fn == "varlen_qkvpacked":
        lq = lk
    B, Hq, d, p = len(lq), 2, 40, 0.2
    Hk = 1 if api_fn != "varlen_qkvpacked" else Hq
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, k, v = randn(gen, sum(lq), Hq, d), randn(gen, sum(lk), Hk, d), randn(gen, sum(lk), Hk, d)
    kw = dict(causal=True, softcap=2.0)
    torch.manual_seed(3)
    if api_fn == "varlen":
        out, lse, sd = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lq), max(lk) + 3, p, return_attn_probs=True, **kw
        )
        mq, mk = max(lq), max(lk) + 3
    elif api_fn == "varlen_kvpacked":
        out, lse, sd = flash_attn_varlen_kvpacked_func(
            q, torch.stack([k, v], dim=1), cu_q, cu_k, max(lq), max(lk), p, return_attn_probs=True, **kw
        )
        mq, mk = max(lq), max(lk)
    else:
        out, lse, sd = flash_attn_varlen_qkvpacked_func(
            torch.stack([q, k, v], dim=1), cu_q, max(lq), p, return_attn_probs=True, **kw
        )
        mq, mk = max(lq), max(lk)
    assert sd.shape == (B, Hq, 128, 128) and sd.dtype == q.dtype  # mq, mk rounded up to 128
    assert (sd[:, :, mq:] == 0).all() and (sd[:, :, :, mk:] == 0).all()
    dropped = allowed = 0
    for b in range(B):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        nd, na = check_s_dmask(
            sd[b, :, : lq[b], : lk[b]], out[qs], lse[:, qs], q[qs], k[ks], v[ks], p, 64, causal=True, softcap=2.0
        )
        dropped, allowed = dropped + nd, allowed + na
        assert (sd[b, :, lq[b] :] == 0).all() and (sd[b, :, :, lk[b] :] == 0).all()
    assert abs(dropped / allowed - p) < 0.08


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_s_dmask_half(dtype):
    gen = gen_for(seed_of(("dropout-half", str(dtype))))
    B, S, H, d, p = 1, 40, 2, 96, 0.3
    q, k, v = [randn(gen, B, S, H, d, dtype=dtype) for _ in range(3)]
    torch.manual_seed(1)
    out, lse, sd = flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    assert sd.dtype == dtype and out.dtype == dtype and sd.shape == (B, H, 128, 128)
    sd = sd[:, :, :S, :S]
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    check_s_dmask(sd[0], out[0], lse[0], q[0], k[0], v[0], p, 64, causal=True, atol=tol)


# Decoding S_dmask the way upstream's tests do it, written from the documented semantics: crop
# to the sequence, zero what the mask excludes, keep = S >= 0; the probabilities are
# |S| * exp(m - lse), with lse the row's log-sum-exp and m the row maximum over the entry's key
# block and every later one, both taken from scores the decoder computes itself, in blocks of
# upstream's width from the sequence's first key.


def upstream_style_decode(sd, q, k, block_n, causal=False, window=(-1, -1), slopes=None):
    """One sequence: sd (H, rows >= Sq, cols >= Sk), q (Sq, H, d), k (Sk, Hk, d).

    Returns (probs, keep, allowed), each (H, Sq, Sk).  With ``causal`` the ALiBi bias is the
    column-only ``slope * (j - Sk + 1)`` of upstream's tests, which differs from
    ``-slope * |diag - j|`` by a per-row constant that the decoding must not care about."""
    Sq, H, d = q.shape
    Sk = k.shape[0]
    sd = sd[:, :Sq, :Sk].double()
    kd = k.double().repeat_interleave(H // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) / math.sqrt(d)
    i, j = torch.arange(Sq).view(-1, 1), torch.arange(Sk).view(1, -1)
    diag = i + Sk - Sq
    left, right = window[0], 0 if causal else window[1]
    allowed = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= diag - left
    if right >= 0:
        allowed &= j <= diag + right
    if slopes is not None:
        slope = slopes.double().view(-1, 1, 1)
        scores = scores + (slope * (j - Sk + 1) if causal else -slope * (diag - j).abs())
    scores = scores.masked_fill(~allowed, -INF)
    sd = sd.masked_fill(~allowed, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    lse = lse.masked_fill(torch.isneginf(lse), INF)
    m = torch.empty_like(scores)
    top = torch.full((H, Sq), -INF, dtype=torch.float64)
    for start in reversed(range(0, Sk, block_n)):
        top = torch.maximum(top, scores[..., start : start + block_n].amax(dim=-1))
        m[..., start : start + block_n] = top.unsqueeze(-1)
    return sd.abs() * torch.exp(m - lse), sd >= 0, allowed.expand(H, Sq, Sk)


def softmax_probs(q, k, allowed, slopes=None):
    """Probabilities (H, Sq, Sk) in float64 over the allowed keys, ALiBi as -slope * |diag - j|;
    0 in rows without a key (a vectorized naive_probs, for the longer sequences below)."""
    Sq, H, d = q.shape
    Sk = k.shape[0]
    kd = k.double().repeat_interleave(H // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) / math.sqrt(d)
    if slopes is not None:
        diag = torch.arange(Sq).view(-1, 1) + Sk - Sq
        scores = scores - slopes.double().view(-1, 1, 1) * (diag - torch.arange(Sk)).abs()
    probs = torch.softmax(scores.masked_fill(~allowed, -INF), dim=-1)
    return probs.nan_to_num(0.0)


def upstream_block_n(d):
    return next(w for top, w, _ in UPSTREAM_BLOCK_N if d <= top)


def check_decoded(sd, out, q, k, v, p, causal=False, window=(-1, -1), slopes=None):
    """Decodes one sequence and checks the probabilities and out; returns (dropped, allowed)."""
    probs, keep, allowed = upstream_style_decode(sd, q, k, upstream_block_n(q.shape[-1]), causal, window, slopes)
    ref = softmax_probs(q, k, allowed, slopes)
    assert_close(probs, ref, atol=1e-5, rtol=1e-4)
    Hq, Hk = q.shape[1], k.shape[1]
    out_ref = torch.einsum("hqk,khd->qhd", ref * keep / (1 - p), v.double().repeat_interleave(Hq // Hk, dim=1))
    assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    return (allowed & ~keep).sum().item(), allowed.sum().item()


DECODE_OPTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "local": dict(window=(70, 9)),
    "local_causal_alibi": dict(window=(45, -1), causal=True, alibi=True),
    "alibi": dict(alibi=True),
}


@pytest.mark.parametrize("opt", list(DECODE_OPTS))
@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 224, 256])
def test_dropout_s_dmask_upstream_decoding(d, opt):
    """Every head size of upstream's suite: the decoded probabilities are ours, the keep mask
    reproduces out, and the padded S_dmask has upstream's shape."""
    gen = gen_for(seed_of(("decode", d, opt)))
    kw = dict(DECODE_OPTS[opt])
    B, Sq, Sk, Hq, Hk, p = 2, 37, 300, 4, 2, 0.17
    q, k, v = randn(gen, B, Sq, Hq, d), randn(gen, B, Sk, Hk, d), randn(gen, B, Sk, Hk, d)
    slopes = torch.rand(B, Hq, generator=gen) * 0.3 if kw.pop("alibi", False) else None
    causal, window = kw.get("causal", False), kw.get("window", (-1, -1))
    torch.manual_seed(seed_of(("decode-rng", d, opt)))
    out, _, sd = flash_attn_func(
        q, k, v, p, causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True
    )
    assert sd.shape == (B, Hq, 128, 384)
    dropped = allowed = 0
    for b in range(B):
        nd, na = check_decoded(
            sd[b], out[b], q[b], k[b], v[b], p, causal, window, None if slopes is None else slopes[b]
        )
        dropped, allowed = dropped + nd, allowed + na
    assert abs(dropped / allowed - p) < 0.02


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("opt", ["causal", "local", "alibi"])
def test_dropout_s_dmask_upstream_decoding_varlen(d, opt):
    """Padded varlen: sequence b's entries start at row 0 and column 0 of S_dmask[b]; the rows
    and columns past its lengths (up to max_seqlen rounded up to 128) are zero."""
    gen = gen_for(seed_of(("decode-varlen", d, opt)))
    kw = dict(DECODE_OPTS[opt])
    lq, lk = [30, 0, 17, 129], [200, 5, 140, 131]
    B, Hq, Hk, p = len(lq), 2, 1, 0.17
    q, k, v = randn(gen, sum(lq), Hq, d), randn(gen, sum(lk), Hk, d), randn(gen, sum(lk), Hk, d)
    slopes = torch.rand(B, Hq, generator=gen) * 0.3 if kw.pop("alibi", False) else None
    causal, window = kw.get("causal", False), kw.get("window", (-1, -1))
    cu_q, cu_k = _cu(lq), _cu(lk)
    torch.manual_seed(seed_of(("decode-varlen-rng", d, opt)))
    out, _, sd = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 140, 260, p, causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True
    )
    assert sd.shape == (B, Hq, 256, 384)
    dropped = allowed = 0
    for b in range(B):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert (sd[b, :, lq[b] :] == 0).all() and (sd[b, :, :, lk[b] :] == 0).all()
        sl = None if slopes is None else slopes[b]
        nd, na = check_decoded(sd[b], out[qs], q[qs], k[ks], v[ks], p, causal, window, sl)
        dropped, allowed = dropped + nd, allowed + na
    assert abs(dropped / allowed - p) < 0.03


def test_dropout_s_dmask_decoding_needs_the_right_width():
    """The decoding above is sensitive to the block width (so the tests would catch a wrong one)."""
    gen = gen_for(9)
    q, k, v = randn(gen, 1, 16, 1, 64), randn(gen, 1, 256, 1, 64), randn(gen, 1, 256, 1, 64)
    out, _, sd = flash_attn_func(q, k, v, 0.1, return_attn_probs=True)
    good, _, _ = upstream_style_decode(sd[0], q[0], k[0], 64)
    bad, _, _ = upstream_style_decode(sd[0], q[0], k[0], 128)
    ref = softmax_probs(q[0], k[0], torch.ones(1, 16, 256, dtype=torch.bool))
    assert (good - ref).abs().max() < 1e-5 and (bad - ref).abs().max() > 1e-2


def test_dropout_grads_and_no_dropout_probs():
    gen = gen_for(5)
    B, S, H, d, p = 2, 24, 2, 8, 0.3
    q, k, v = randn(gen, B, S, H, d), randn(gen, B, S, H, d), randn(gen, B, S, H, d)
    qs = q.clone().requires_grad_()
    flash_attn_func(qs, k, v, dropout_p=p).sum().backward()
    assert torch.isfinite(qs.grad).all()
    # without dropout S_dmask is the normalized probabilities (upstream returns an empty tensor)
    _, _, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert_close(probs[0], naive_probs(*d64(q[0], k[0]), None, True, (-1, -1), 0.0, None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_smoke(dtype):
    gen = gen_for(7)
    q, k, v = (
        randn(gen, 2, 9, 4, 16, dtype=dtype),
        randn(gen, 2, 12, 2, 16, dtype=dtype),
        randn(gen, 2, 12, 2, 16, dtype=dtype),
    )
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == dtype and probs.dtype == dtype and lse.dtype == torch.float32
    out_ref, lse_ref = naive_batch(*d64(q, k, v), causal=True)
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    assert_close(out, out_ref, atol=tol, rtol=tol)
    assert_lse(lse, lse_ref, atol=1e-3)
    qs = q.clone().requires_grad_()
    flash_attn_func(qs, k, v, causal=True).float().sum().backward()
    assert qs.grad.dtype == dtype and torch.isfinite(qs.grad).all()


# ----------------------------------------------------------- varlen functions


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


VARLEN_OPTS = ["plain", "causal", "window", "softcap_alibi", "alibi_causal"]


@pytest.mark.parametrize("opt", VARLEN_OPTS)
def test_varlen_forward_backward(opt):
    gen = gen_for(seed_of(("varlen", opt)))
    lq, lk = [3, 1, 7, 0, 5], [5, 2, 7, 3, 1]
    B, Hq, Hk, d = len(lq), 4, 2, 6
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, k, v = randn(gen, sum(lq), Hq, d), randn(gen, sum(lk), Hk, d), randn(gen, sum(lk), Hk, d)
    dout = randn(gen, sum(lq), Hq, d)
    api, ref, slopes = _split_opts(OPTIONS[opt], gen, B, Hq)
    qs, ks, vs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, probs = flash_attn_varlen_func(
        qs, ks, vs, cu_q, cu_k, max(lq), max(lk) + 2, return_attn_probs=True, **api
    )
    assert out.shape == q.shape and lse.shape == (Hq, sum(lq))
    assert probs.shape == (B, Hq, max(lq), max(lk) + 2)
    out.backward(dout)
    q64, k64, v64 = [x.requires_grad_() for x in d64(q, k, v)]
    outs, lses = [], []
    for b in range(B):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, l = naive_one(
            q64[cu_q[b] : cu_q[b + 1]], k64[cu_k[b] : cu_k[b + 1]], v64[cu_k[b] : cu_k[b + 1]], slopes=sl, **ref
        )
        outs.append(o)
        lses.append(l)
    out_ref, lse_ref = torch.cat(outs), torch.cat(lses, dim=1)
    assert_close(out, out_ref)
    assert_lse(lse, lse_ref)
    out_ref.backward(dout.double())
    for got, want in ((qs.grad, q64.grad), (ks.grad, k64.grad), (vs.grad, v64.grad)):
        assert_close(got, want, atol=5e-5, rtol=5e-5)
    b = 2
    sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
    p_ref = naive_probs(
        *d64(q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]]),
        ref["scale"],
        ref["causal"],
        ref["window"],
        ref["softcap"],
        sl,
    )
    assert_close(probs[b, :, : lq[b], : lk[b]], p_ref)
    assert (probs[b, :, lq[b] :] == 0).all() and (probs[b, :, :, lk[b] :] == 0).all()


def test_varlen_packed_equivalence_and_padding_rows():
    gen = gen_for(13)
    lens = [4, 9, 1]
    cu = _cu(lens)
    total, H, d = sum(lens), 3, 5
    qkv = randn(gen, total + 2, 3, H, d)  # two trailing rows not covered by cu_seqlens
    kw = dict(causal=True, softcap=1.5)
    out1, lse1, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), return_attn_probs=True, **kw)
    out2 = flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lens), max(lens), **kw)
    out3 = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max(lens), max(lens), **kw)
    assert torch.equal(out1, out3) and torch.equal(out2, out3)
    assert (out1[total:] == 0).all() and torch.isposinf(lse1[:, total:]).all()
    dense = flash_attn_func(qkv[None, :4, 0], qkv[None, :4, 1], qkv[None, :4, 2], **kw)
    assert_close(out1[:4], dense[0])


@pytest.mark.parametrize("page", [3, 4])
def test_varlen_paged_matches_contiguous(page):
    gen = gen_for(17 + page)
    lq, lk = [2, 5, 1], [7, 3, 10]
    B, Hq, Hk, d = 3, 4, 2, 6
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, k, v = randn(gen, sum(lq), Hq, d), randn(gen, sum(lk), Hk, d), randn(gen, sum(lk), Hk, d)
    nblk = max(math.ceil(n / page) for n in lk) + 1
    num_blocks = B * nblk + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: B * nblk].view(B, nblk).to(torch.int32)
    k_pages = torch.full((num_blocks, page, Hk, d), float("nan"))
    v_pages = torch.full((num_blocks, page, Hk, d), float("nan"))
    for b in range(B):
        for t in range(lk[b]):
            blk = int(block_table[b, t // page])
            k_pages[blk, t % page] = k[cu_k[b] + t]
            v_pages[blk, t % page] = v[cu_k[b] + t]
    kw = dict(causal=True, window_size=(3, -1))
    out_paged = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lq), max(lk), block_table=block_table, **kw)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
    assert torch.isfinite(out_paged).all()
    assert_close(out_paged, out, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------- kv cache


def _kvcache_case(seed, B=3, Bc=None, Sq=3, Snew=3, cap=12, Hq=4, Hk=2, d=8):
    gen = gen_for(seed)
    Bc = B if Bc is None else Bc
    return (
        gen,
        randn(gen, B, Sq, Hq, d),
        randn(gen, Bc, cap, Hk, d),
        randn(gen, Bc, cap, Hk, d),
        randn(gen, B, Snew, Hk, d),
        randn(gen, B, Snew, Hk, d),
    )


def _naive_kvcache(q, kc, vc, seqlens, leftpad=None, slopes=None, **kw):
    """q (B, Sq, H, d) float64, kc/vc per-batch cache rows (B, cap, Hk, d) float64."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, l = naive_one(
            q[b], kc[b], vc[b], start=0 if leftpad is None else int(leftpad[b]), end=int(seqlens[b]), slopes=sl, **kw
        )
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens_kind", ["int", "tensor"])
def test_kvcache_append(seqlens_kind, causal):
    gen, q, kc, vc, k, v = _kvcache_case(100 + causal)
    B, Snew = q.shape[0], k.shape[1]
    lens = [4] * B if seqlens_kind == "int" else [0, 5, 9]
    cache_seqlens = 4 if seqlens_kind == "int" else torch.tensor(lens, dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for b in range(B):
        for t in range(Snew):
            kc_ref[b, lens[b] + t] = k[b, t]
            vc_ref[b, lens[b] + t] = v[b, t]
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=cache_seqlens, causal=causal, return_softmax_lse=True, num_splits=3
    )
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert out.shape == q.shape and lse.shape == (B, q.shape[2], q.shape[1])
    out_ref, lse_ref = _naive_kvcache(*d64(q, kc_ref, vc_ref), [n + Snew for n in lens], causal=causal)
    assert_close(out, out_ref)
    assert_lse(lse, lse_ref)


def test_kvcache_no_new_tokens_and_poisoned_tail():
    gen, q, kc, vc, _, _ = _kvcache_case(7, Sq=2)
    lens = torch.tensor([3, 12, 1], dtype=torch.int32)
    for b in range(3):
        kc[b, int(lens[b]) :] = float("nan")
        vc[b, int(lens[b]) :] = float("inf")
    before = (kc.clone(), vc.clone())
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(1, 0))
    assert torch.equal(kc.isnan(), before[0].isnan()) and torch.equal(vc, before[1])
    assert torch.isfinite(out).all()
    out_ref, _ = _naive_kvcache(*d64(q, kc.nan_to_num(0, 0, 0), vc.nan_to_num(0, 0, 0)), lens, window=(1, 0))
    assert_close(out, out_ref)
    # cache_seqlens=None means the whole cache is valid
    gen, q, kc, vc, _, _ = _kvcache_case(8, Sq=2)
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    out_ref, _ = _naive_kvcache(*d64(q, kc, vc), [kc.shape[1]] * 3, causal=True)
    assert_close(out, out_ref)


def test_kvcache_batch_idx():
    gen, q, kc, vc, k, v = _kvcache_case(21, B=3, Bc=5)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    lens = torch.tensor([2, 6, 0], dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for b in range(3):
        for t in range(k.shape[1]):
            kc_ref[int(idx[b]), int(lens[b]) + t] = k[b, t]
            vc_ref[int(idx[b]), int(lens[b]) + t] = v[b, t]
    slopes = torch.rand(4, generator=gen)
    out = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=idx, alibi_slopes=slopes, causal=True
    )
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # rows 1 and 3 untouched
    rows = idx.long()
    out_ref, _ = _naive_kvcache(*d64(q, kc_ref[rows], vc_ref[rows]), lens + k.shape[1], slopes=slopes, causal=True)
    assert_close(out, out_ref)


@pytest.mark.parametrize("opt", ["plain", "causal", "window", "alibi_causal", "softcap_alibi"])
def test_kvcache_leftpad(opt):
    gen, q, kc, vc, k, v = _kvcache_case(seed_of(("leftpad", opt)))
    lens = torch.tensor([5, 8, 3], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 3], dtype=torch.int32)
    kc[0, :2] = float("nan")  # left padding is never read
    vc[2, :3] = float("nan")
    api, ref, slopes = _split_opts(OPTIONS[opt], gen, 3, q.shape[2])
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=leftpad, return_softmax_lse=True, **api
    )
    assert torch.isfinite(out).all()
    out_ref, lse_ref = _naive_kvcache(
        *d64(q, kc.nan_to_num(0), vc.nan_to_num(0)), lens + k.shape[1], leftpad=leftpad, slopes=slopes, **ref
    )
    assert_close(out, out_ref)
    assert_lse(lse, lse_ref)


@pytest.mark.parametrize("with_new", [False, True])
def test_kvcache_paged_matches_contiguous(with_new):
    gen, q, kc, vc, k, v = _kvcache_case(31 + with_new, cap=12)
    B, page, Hk, d = 3, 4, kc.shape[2], kc.shape[3]
    nblk = kc.shape[1] // page
    num_blocks = B * nblk + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: B * nblk].view(B, nblk).int()
    k_pages = randn(gen, num_blocks, page, Hk, d)
    v_pages = randn(gen, num_blocks, page, Hk, d)
    for b in range(B):
        for t in range(kc.shape[1]):
            k_pages[block_table[b, t // page], t % page] = kc[b, t]
            v_pages[block_table[b, t // page], t % page] = vc[b, t]
    lens = torch.tensor([0, 5, 9], dtype=torch.int32)
    kw = dict(cache_seqlens=lens, causal=True, window_size=(4, -1), return_softmax_lse=True)
    new = (k, v) if with_new else (None, None)
    out_p, lse_p = flash_attn_with_kvcache(q, k_pages, v_pages, *new, block_table=block_table, **kw)
    out_c, lse_c = flash_attn_with_kvcache(q, kc, vc, *new, **kw)
    assert_close(out_p, out_c, atol=1e-6, rtol=1e-6)
    assert_close(lse_p, lse_c, atol=1e-6, rtol=1e-6)
    for b in range(B):  # paged cache now holds the same contents as the contiguous one
        for t in range(kc.shape[1]):
            assert torch.equal(k_pages[block_table[b, t // page], t % page], kc[b, t])
            assert torch.equal(v_pages[block_table[b, t // page], t % page], vc[b, t])


@pytest.mark.parametrize("rotary_dim", [8, 4], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("mode", ["plain", "causal", "local"])
def test_kvcache_rotary(mode, interleaved, rotary_dim):
    gen, q, kc, vc, k, v = _kvcache_case(seed_of(("rot", mode, interleaved, rotary_dim)), Sq=3, Snew=2)
    B, Sq, Snew, cap = q.shape[0], q.shape[1], k.shape[1], kc.shape[1]
    angle = torch.rand(cap + 2, rotary_dim // 2, generator=gen) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    lens = torch.tensor([0, 4, 7], dtype=torch.int32)
    causal, window = mode == "causal", ((2, 1) if mode == "local" else (-1, -1))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k,
        v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=lens,
        causal=causal,
        window_size=window,
        rotary_interleaved=interleaved,
        return_softmax_lse=True,
    )
    pos_k = [[int(lens[b]) + t for t in range(Snew)] for b in range(B)]
    step = 1 if mode != "plain" else 0
    pos_q = [[int(lens[b]) + step * i for i in range(Sq)] for b in range(B)]
    k_ro = naive_rotary(k.double(), cos.double(), sin.double(), pos_k, interleaved)
    q_ro = naive_rotary(q.double(), cos.double(), sin.double(), pos_q, interleaved)
    for b in range(B):
        for t in range(Snew):
            kc_ref[b, pos_k[b][t]] = k_ro[b, t].float()
            vc_ref[b, pos_k[b][t]] = v[b, t]
    assert_close(kc, kc_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc, vc_ref)
    if rotary_dim < q.shape[-1]:  # channels past rotary_dim are untouched
        assert torch.equal(kc[1, 4:6, :, rotary_dim:], k[1, :, :, rotary_dim:])
    out_ref, lse_ref = _naive_kvcache(q_ro, *d64(kc_ref, vc_ref), lens + Snew, causal=causal, window=window)
    assert_close(out, out_ref, atol=5e-5, rtol=5e-5)
    assert_lse(lse, lse_ref, atol=5e-5)


def test_kvcache_half_smoke():
    gen, q, kc, vc, k, v = _kvcache_case(41)
    q, kc, vc, k, v = [x.half() for x in (q, kc, vc, k, v)]
    lens = torch.tensor([1, 3, 6], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    assert out.dtype == torch.float16
    out_ref, _ = _naive_kvcache(*d64(q, kc, vc), lens + k.shape[1], causal=True)
    assert_close(out, out_ref, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------- errors


def _qkv(B=2, S=5, H=4, Hk=2, d=8, dtype=torch.float32):
    gen = gen_for(0)
    return (
        randn(gen, B, S, H, d, dtype=dtype),
        randn(gen, B, S, Hk, d, dtype=dtype),
        randn(gen, B, S, Hk, d, dtype=dtype),
    )


def test_errors_dense():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must have dtype"):
        flash_attn_func(q.long(), k.long(), v.long())
    with pytest.raises(TypeError, match="k must have the same dtype"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match="v must be on the same device"):
        flash_attn_func(q, k, v.to("meta"))
    with pytest.raises(ValueError, match="q must have shape"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="k must have the same head dimension"):
        flash_attn_func(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_func(q, k, v[..., :4])
    with pytest.raises(ValueError, match="number of heads in k/v"):
        flash_attn_func(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_func(q, k, v, alibi_slopes=torch.rand(3))
    with pytest.raises(TypeError, match="alibi_slopes must have dtype"):
        flash_attn_func(q, k, v, alibi_slopes=torch.rand(4, dtype=torch.float64))
    for kwargs, name in (
        (dict(softcap=float("inf")), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
        (dict(dropout_p=None), "dropout_p"),
        (dict(window_size=None), "window_size"),
        (dict(window_size=("a", 1)), "window_size"),
        (dict(alibi_slopes=torch.full((4,), float("nan"))), "alibi_slopes"),
    ):
        with pytest.raises(ValueError, match=name):
            flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="qkv must have size 3"):
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="kv must have size 2"):
        flash_attn_kvpacked_func(q, torch.zeros(2, 5, 3, 2, 8))


def test_errors_varlen():
    q, k, v = [x.flatten(0, 1) for x in _qkv()]
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        flash_attn_varlen_func(q, k, v, cu.long(), cu, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype torch.int32"):
        flash_attn_varlen_func(q, k, v, cu, cu.long(), 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must have shape"):
        flash_attn_varlen_func(q, k, v, cu, cu[:2], 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q.* exceeds"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32), cu, 7, 6)
    with pytest.raises(ValueError, match="q must have shape"):
        flash_attn_varlen_func(q[None], k, v, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flash_attn_varlen_func(q, k, v, cu, cu, None, 6)
    pages = torch.zeros(4, 4, 2, 8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        flash_attn_varlen_func(q, pages, pages, cu, cu, 6, 6, block_table=bt.long())
    with pytest.raises(ValueError, match="block_table must have shape"):
        flash_attn_varlen_func(q, pages, pages, cu, cu, 6, 6, block_table=bt[:1])
    with pytest.raises(ValueError, match="block_table entries"):
        flash_attn_varlen_func(q, pages, pages, cu, cu, 6, 6, block_table=bt + 1)


def test_errors_kvcache():
    gen, q, kc, vc, k, v = _kvcache_case(0, cap=8)
    lens = torch.tensor([2, 5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache overflow"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache overflow"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=6)
    lens = torch.tensor([2, 5, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="cache_seqlens must have dtype torch.int32"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens.long())
    with pytest.raises(ValueError, match="cache_seqlens must have shape"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens[:2])
    with pytest.raises(ValueError, match="cache_seqlens must be given"):
        flash_attn_with_kvcache(q, kc, vc, k, v)
    with pytest.raises(TypeError, match="k_cache must have the same dtype"):
        flash_attn_with_kvcache(q, kc.half(), vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        flash_attn_with_kvcache(q, kc[0], vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn_with_kvcache(q, kc, vc, k, None, cache_seqlens=lens)
    with pytest.raises(ValueError, match="k and v must have shape"):
        flash_attn_with_kvcache(q, kc, vc, k[:, :, :1], v[:, :, :1], cache_seqlens=lens)
    with pytest.raises(ValueError, match="number of heads in k_cache"):
        flash_attn_with_kvcache(q[:, :, :3], kc, vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_batch_idx entries"):
        flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32)
        )
    with pytest.raises(TypeError, match="cache_leftpad must have dtype torch.int32"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens.long())
    cos = torch.ones(16, 2)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin need the new k"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=lens)
    with pytest.raises(ValueError, match="rotary_cos has 5 positions"):
        flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos[:5], rotary_sin=cos[:5], cache_seqlens=lens)
    with pytest.raises(ValueError, match="rotary_dim"):
        flash_attn_with_kvcache(
            q, kc, vc, k, v, rotary_cos=torch.ones(16, 5), rotary_sin=torch.ones(16, 5), cache_seqlens=lens
        )
    pages = torch.zeros(6, 4, 2, 8)
    bt = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=bt.long())
    with pytest.raises(ValueError, match="block_table must have shape"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=bt[:2])
    with pytest.raises(ValueError, match="block_table entries"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=bt + 1)
    with pytest.raises(ValueError, match="cache_batch_idx is not supported"):
        flash_attn_with_kvcache(
            q, pages, pages, cache_seqlens=lens, block_table=bt, cache_batch_idx=torch.arange(3, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="cache overflow"):
        flash_attn_with_kvcache(q, pages, pages, k, v, cache_seqlens=6, block_table=bt)
    with pytest.raises(ValueError, match="k_cache: an expanded tensor"):  # its rows would share the new keys
        flash_attn_with_kvcache(q, kc[:1].expand_as(kc), vc, k, v, cache_seqlens=lens)
