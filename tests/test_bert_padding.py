"""flash_attn_tq.bert_padding: the padding helpers of flash_attn.bert_padding (2.8.3).

References are built token by token with Python loops."""

import pathlib
import subprocess
import sys
import zlib

import pytest
import torch

import flash_attn_tq
from flash_attn_tq.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def gen_for(seed):
    return torch.Generator().manual_seed(seed)


def random_mask(gen, batch, seqlen, kind):
    """bool (batch, seqlen): right padding, left padding or arbitrary holes."""
    lengths = torch.randint(0, seqlen + 1, (batch,), generator=gen)
    lengths[0] = seqlen  # one full row
    if batch > 1:
        lengths[1] = 0  # one empty row
    pos = torch.arange(seqlen).unsqueeze(0)
    if kind == "right":
        return pos < lengths.unsqueeze(1)
    if kind == "left":
        return pos >= (seqlen - lengths).unsqueeze(1)
    mask = torch.rand(batch, seqlen, generator=gen) < 0.6
    mask[0] = True
    if batch > 1:
        mask[1] = False
    return mask


def loop_unpad(x, mask):
    """(rows, indices, seqlens) by walking the batch token by token."""
    rows, indices, seqlens = [], [], []
    batch, seqlen = mask.shape
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if mask[b, s]:
                rows.append(x[b, s])
                indices.append(b * seqlen + s)
                n += 1
        seqlens.append(n)
    stacked = torch.stack(rows) if rows else x.new_zeros((0, *x.shape[2:]))
    return stacked, indices, seqlens


def cumulative(seqlens):
    out = [0]
    for n in seqlens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64])
def test_unpad_input_matches_loop(kind, mask_dtype):
    gen = gen_for(zlib.crc32(f"{kind}-{mask_dtype}".encode()))
    batch, seqlen, heads, d = 4, 9, 3, 5
    x = torch.randn(batch, seqlen, heads, d, generator=gen)
    mask = random_mask(gen, batch, seqlen, kind)
    result = unpad_input(x, mask.to(mask_dtype))
    assert len(result) == 5
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = result
    rows, want_idx, seqlens = loop_unpad(x, mask)
    assert torch.equal(x_unpad, rows)
    assert indices.dtype == torch.int64 and indices.tolist() == want_idx
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == cumulative(seqlens)
    assert isinstance(max_seqlen, int) and max_seqlen == max(seqlens)
    assert seqused.dtype == torch.int32 and seqused.tolist() == seqlens


def test_unpad_input_with_unused_mask():
    gen = gen_for(1)
    batch, seqlen = 3, 8
    x = torch.randn(batch, seqlen, 4, generator=gen)
    valid = random_mask(gen, batch, seqlen, "right")
    # tokens right after the valid ones are allocated but unused
    unused = torch.zeros_like(valid)
    unused[:, 1:] = valid[:, :-1] & ~valid[:, 1:]
    unused[1, :3] = True
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, valid, unused.int())
    rows, want_idx, seqlens = loop_unpad(x, valid | unused)
    assert torch.equal(x_unpad, rows) and indices.tolist() == want_idx
    assert cu_seqlens.tolist() == cumulative(seqlens) and max_seqlen == max(seqlens)
    assert seqused.tolist() == valid.sum(-1).tolist()


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_round_trip(kind):
    gen = gen_for(7)
    batch, seqlen = 5, 11
    x = torch.randn(batch, seqlen, 2, 3, generator=gen)
    mask = random_mask(gen, batch, seqlen, kind)
    x_unpad, indices, *_ = unpad_input(x, mask)
    back = pad_input(x_unpad, indices, batch, seqlen)
    assert back.shape == x.shape and back.dtype == x.dtype
    assert torch.equal(back, x * mask[:, :, None, None])
    # and unpad(pad(y)) == y
    again, indices2, *_ = unpad_input(back, mask)
    assert torch.equal(again, x_unpad) and torch.equal(indices2, indices)


def test_gradients():
    gen = gen_for(3)
    batch, seqlen = 3, 6
    mask = random_mask(gen, batch, seqlen, "holes")
    x = torch.randn(batch, seqlen, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    x_unpad, indices, *_ = unpad_input(x, mask)
    g = torch.randn(x_unpad.shape, dtype=torch.float64, generator=gen)
    x_unpad.backward(g)
    want = torch.zeros_like(x)
    for n, i in enumerate(indices.tolist()):
        want[i // seqlen, i % seqlen] = g[n]
    assert torch.equal(x.grad, want)  # padded tokens get exactly zero

    y = x_unpad.detach().clone().requires_grad_()
    out = pad_input(y, indices, batch, seqlen)
    h = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    out.backward(h)
    assert torch.equal(y.grad, h.reshape(batch * seqlen, 4)[indices])

    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (x.detach().requires_grad_(),))
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, batch, seqlen), (y,))
    assert torch.autograd.gradgradcheck(lambda t: pad_input(t, indices, batch, seqlen) ** 2, (y,))


def test_index_helpers():
    gen = gen_for(4)
    x = torch.randn(10, 2, 3, generator=gen)
    idx = torch.tensor([7, 0, 3])
    assert torch.equal(index_first_axis(x, idx), torch.stack([x[7], x[0], x[3]]))
    put = index_put_first_axis(x[:3], idx, 8)
    assert put.shape == (8, 2, 3)
    want = torch.zeros(8, 2, 3)
    want[7], want[0], want[3] = x[0], x[1], x[2]
    assert torch.equal(put, want)
    with pytest.raises(ValueError):
        index_put_first_axis(x[:2], idx, 8)


def test_unpad_concatenated_sequences():
    """The example in upstream's docstring: rows holding several packed sequences."""
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.arange(3 * 6 * 2, dtype=torch.float32).view(3, 6, 2)
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(x_unpad, x.reshape(18, 2)[indices])


def test_varlen_attention_on_unpadded_batch():
    """unpad -> varlen attention -> pad equals attention over each sequence alone."""
    gen = gen_for(9)
    batch, seqlen, heads, d = 4, 10, 2, 8
    mask = random_mask(gen, batch, seqlen, "right")
    q, k, v = [torch.randn(batch, seqlen, heads, d, generator=gen) for _ in range(3)]
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, _, _, _, _ = unpad_input(k, mask)
    v_u, _, _, _, _ = unpad_input(v, mask)
    out_u = flash_attn_tq.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True)
    out = pad_input(out_u, idx, batch, seqlen)
    for b in range(batch):
        n = int(mask[b].sum())
        assert (out[b, n:] == 0).all()
        if n:
            ref = flash_attn_tq.flash_attn_func(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], causal=True)
            torch.testing.assert_close(out[b : b + 1, :n], ref, atol=1e-5, rtol=1e-5)


def test_drop_in_imports():
    """The upstream import paths work against the package, also under the name flash_attn."""
    code = (
        "import sys, flash_attn_tq\n"
        "import flash_attn_tq as flash_attn\n"
        "from flash_attn_tq.bert_padding import pad_input, unpad_input, index_first_axis\n"
        "from flash_attn_tq.layers.rotary import apply_rotary_emb, RotaryEmbedding\n"
        "sys.modules['flash_attn'] = flash_attn_tq\n"
        "from flash_attn.bert_padding import unpad_input as u2\n"
        "from flash_attn.layers.rotary import apply_rotary_emb as r2\n"
        "assert u2.__name__ == 'unpad_input' and r2.__name__ == 'apply_rotary_emb'\n"
        "print('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(pathlib.Path(__file__).resolve().parents[1]),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
