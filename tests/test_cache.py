"""Tests for flash_attn_tq.cache.QuantizedKVCache (CPU, reference quantize-on-write).

Ground truth is kept in dense float tensors next to the cache; slot addresses of the paged layout
are recomputed here from the block table; expected codes come from the quantizers directly.
"""

import io
import math
import zlib

import pytest
import torch

from flash_attn_tq import QuantizedKVCache
from flash_attn_tq.format import code_bytes, pack_codes, unpack_codes
from flash_attn_tq.quantizers import AsymQuantizer

LAYOUTS = ["contiguous", "paged16", "paged32", "paged64", "paged16-shuffled", "paged32-shuffled"]


def make_cache(layout, B=3, S=83, H=2, d=64, table_seed=0, **kw):
    if layout == "contiguous":
        return QuantizedKVCache(B, S, H, d, **kw)
    page = int(layout.split("-")[0][5:])
    if layout.endswith("shuffled"):
        per_seq = math.ceil(S / page)
        nb = B * per_seq + 3  # a few spare blocks
        g = torch.Generator().manual_seed(table_seed + 99)
        bt = torch.randperm(nb, generator=g)[: B * per_seq].reshape(B, per_seq).to(torch.int32)
        return QuantizedKVCache(B, S, H, d, page_size=page, num_blocks=nb, block_table=bt, **kw)
    return QuantizedKVCache(B, S, H, d, page_size=page, **kw)


class Truth:
    """Dense record of what was written: values and per-row lengths."""

    def __init__(self, cache):
        B, S, H, d = cache.batch_size, cache.max_seqlen, cache.num_kv_heads, cache.head_dim
        self.k = torch.zeros(B, S, H, d)
        self.v = torch.zeros(B, S, H, d)
        self.lens = [0] * B


def fill(cache, seed, prefill=29, steps=9, dtype=torch.float16, scale=1.7, use_tensor_seqlens=True):
    """Prefill every row with ``prefill`` tokens, then single tokens to random subsets of rows
    (random order, via batch_idx), so the rows end with different lengths."""
    g = torch.Generator().manual_seed(seed)
    B, H, d = cache.batch_size, cache.num_kv_heads, cache.head_dim
    t = Truth(cache)

    def write(rows, n):
        k = (torch.randn(len(rows), n, H, d, generator=g) * scale).to(dtype)
        v = (torch.randn(len(rows), n, H, d, generator=g) * scale + 0.2).to(dtype)
        start = torch.tensor([t.lens[r] for r in rows], dtype=torch.int32)
        bidx = torch.tensor(rows, dtype=torch.int32)
        if use_tensor_seqlens:
            cache.append(k, v, cache_seqlens=start, batch_idx=bidx)
        else:
            cache.append(k, v, batch_idx=bidx)
        for i, r in enumerate(rows):
            t.k[r, t.lens[r] : t.lens[r] + n] = k[i].float()
            t.v[r, t.lens[r] : t.lens[r] + n] = v[i].float()
            t.lens[r] += n

    if prefill:
        write(list(range(B)), prefill)
    for _ in range(steps):
        m = int(torch.randint(1, B + 1, (1,), generator=g))
        rows = torch.randperm(B, generator=g)[:m].tolist()
        write(rows, 1)
    if B > 1 and len(set(t.lens)) == 1:
        write([B - 1], 1)
    return t


def slot(cache, b, p):
    """(row, col) of token p of sequence b, recomputed from the block table."""
    if cache.page_size is None:
        return b, p
    return int(cache.block_table[b, p // cache.page_size]), p % cache.page_size


# ----------------------------------------------------------------------------- writing


@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_stores_quantizer_output(layout, quantizer):
    kbits, vbits = (3, 3) if quantizer == "turbo" else (4, 2)
    cache = make_cache(layout, quantizer=quantizer, k_bits=kbits, v_bits=vbits, table_seed=len(layout))
    t = fill(cache, seed=zlib.crc32(f"{layout}/{quantizer}".encode()) % 1000, use_tensor_seqlens=(layout != "paged32"))
    assert cache.seqlens.dtype == torch.int32
    assert cache.seqlens.tolist() == t.lens
    assert len(set(t.lens)) > 1  # rows really differ
    assert cache.scale_only == (quantizer == "turbo")  # the default: scale alone where the offset is implied
    d = cache.head_dim
    for name, qz, bits, x in (("k", cache.k_quantizer, kbits, t.k), ("v", cache.v_quantizer, vbits, t.v)):
        codes_store, meta_store = getattr(cache, f"{name}_codes"), getattr(cache, f"{name}_meta")
        assert codes_store.shape[-1] == code_bytes(d, bits)
        for b, L in enumerate(t.lens):
            exp_codes, exp_meta = qz.quantize(x[b, :L])
            rc = [slot(cache, b, p) for p in range(L)]
            rows = torch.tensor([r for r, _ in rc])
            cols = torch.tensor([c for _, c in rc])
            got = codes_store[rows, cols]  # [L, H, bytes]
            assert torch.equal(unpack_codes(got, bits, d), exp_codes)
            assert torch.equal(got, pack_codes(exp_codes, bits))
            assert torch.equal(meta_store[rows, cols], exp_meta[..., : meta_store.shape[-1]])
        # gather() gives the same thing in a contiguous view, zeros beyond seqlens
        gth = cache.gather()
        for b, L in enumerate(t.lens):
            assert torch.equal(unpack_codes(gth[f"{name}_codes"][b, :L], bits, d), qz.quantize(x[b, :L])[0])
            assert (gth[f"{name}_codes"][b, L:] == 0).all() and (gth[f"{name}_meta"][b, L:] == 0).all()


def test_paged_storage_untouched_outside_written_slots():
    cache = make_cache("paged16-shuffled", B=2, S=40, quantizer="asym")
    t = fill(cache, seed=3, prefill=5, steps=4)
    written = {slot(cache, b, p) for b, L in enumerate(t.lens) for p in range(L)}
    for r in range(cache.k_codes.shape[0]):
        for c in range(cache.k_codes.shape[1]):
            nz = bool(cache.k_meta[r, c].abs().sum() > 0)
            assert nz == ((r, c) in written), (r, c)


@pytest.mark.parametrize("layout", ["paged16", "paged32", "paged64", "paged16-shuffled", "paged64-shuffled"])
@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
def test_paged_dequantize_equals_contiguous(layout, quantizer):
    kw = dict(quantizer=quantizer, k_bits=4, v_bits=3, fp16_window=5)
    pc, cc = make_cache(layout, table_seed=7, **kw), make_cache("contiguous", **kw)
    seed = 11 + len(layout)
    tp, tc = fill(pc, seed), fill(cc, seed)
    assert tp.lens == tc.lens
    kp, vp = pc.dequantize()
    kc, vc = cc.dequantize()
    assert torch.equal(kp, kc) and torch.equal(vp, vc)
    bidx = torch.tensor([2, 0])
    kp2, _ = pc.dequantize(bidx)
    assert torch.equal(kp2, kc[[2, 0]])


@pytest.mark.parametrize("quantizer,grid", [("turbo", "uniform"), ("turbo", "lloyd_max"), ("asym", "uniform")])
@pytest.mark.parametrize("layout", ["contiguous", "paged32-shuffled"])
def test_dequantize_matches_quantizer(layout, quantizer, grid):
    cache = make_cache(layout, quantizer=quantizer, grid=grid, d=128, H=3, S=71, table_seed=5)
    t = fill(cache, seed=21, prefill=17, steps=11)
    k, v = cache.dequantize()
    kr, vr = cache.dequantize(rotated=True)
    assert k.dtype == torch.float32 and k.shape == (3, 71, 3, 128)
    for b, L in enumerate(t.lens):
        for x, got, gotr, qz in ((t.k, k, kr, cache.k_quantizer), (t.v, v, vr, cache.v_quantizer)):
            codes, meta = qz.quantize(x[b, :L])
            meta = meta[..., : cache.k_meta.shape[-1]]  # (scale-only: the offset is implied)
            torch.testing.assert_close(got[b, :L], qz.dequantize(codes, meta), rtol=0, atol=1e-6)
            torch.testing.assert_close(gotr[b, :L], qz.dequantize_rotated(codes, meta), rtol=0, atol=1e-6)
            assert torch.equal(got[b, L:], torch.zeros_like(got[b, L:]))
            assert torch.equal(gotr[b, L:], torch.zeros_like(gotr[b, L:]))
            # and the values are a decent approximation of what was written
            rel = ((got[b, :L] - x[b, :L]) ** 2).sum() / (x[b, :L] ** 2).sum()
            assert rel < 0.06, rel
    if quantizer == "asym":
        assert torch.equal(k, kr)
    else:
        assert not torch.allclose(k, kr)


@pytest.mark.parametrize("quantizer", ["turbo", "asym"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16-shuffled"])
def test_fp16_window(layout, quantizer):
    R = 8
    cache = make_cache(layout, B=4, S=50, quantizer=quantizer, fp16_window=R, verify_tokens=3, table_seed=2)
    ring = R + 2  # (verify_tokens - 1 slots beyond the window)
    g = torch.Generator().manual_seed(8)
    t = Truth(cache)
    # rows get 3 (< R), 8 (= R), 21 (one chunk longer than R), 13 + singles
    plan = [(0, 3), (1, 8), (2, 21), (3, 13)]
    for r, n in plan:
        k = torch.randn(1, n, 2, 64, generator=g).half()
        v = torch.randn(1, n, 2, 64, generator=g).half()
        cache.append(k, v, batch_idx=torch.tensor([r]))
        t.k[r, :n], t.v[r, :n], t.lens[r] = k[0].float(), v[0].float(), n
    for _ in range(6):  # the window wraps around for rows 2 and 3
        k = torch.randn(2, 1, 2, 64, generator=g).half()
        v = torch.randn(2, 1, 2, 64, generator=g).half()
        cache.append(k, v, batch_idx=torch.tensor([3, 2]))
        for i, r in enumerate((3, 2)):
            t.k[r, t.lens[r]], t.v[r, t.lens[r]] = k[i, 0].float(), v[i, 0].float()
            t.lens[r] += 1
    assert cache.seqlens.tolist() == t.lens == [3, 8, 27, 19]
    assert cache.k_window.shape == (4, ring, 2, 64) and cache.k_window.dtype == torch.float16
    k, v = cache.dequantize()
    kq, vq = cache.dequantize(use_window=False)
    tol = dict(rtol=0, atol=2e-5) if quantizer == "turbo" else dict(rtol=0, atol=0)
    for b, L in enumerate(t.lens):
        lo = max(0, L - R)
        torch.testing.assert_close(k[b, lo:L], t.k[b, lo:L], **tol)
        torch.testing.assert_close(v[b, lo:L], t.v[b, lo:L], **tol)
        assert torch.equal(k[b, :lo], kq[b, :lo]) and torch.equal(v[b, :lo], vq[b, :lo])
        # the quantized copy of the window tokens was written too, and differs from the window
        codes, meta = cache.k_quantizer.quantize(t.k[b, :L])
        meta = meta[..., : cache.k_meta.shape[-1]]
        torch.testing.assert_close(kq[b, :L], cache.k_quantizer.dequantize(codes, meta), rtol=0, atol=1e-6)
        assert (kq[b, lo:L] - t.k[b, lo:L]).abs().max() > 1e-3
        assert torch.equal(k[b, L:], torch.zeros_like(k[b, L:]))
        # ring layout: token p lives in slot p % ring, the last `ring` tokens held
        for p in range(max(0, L - ring), L):
            assert torch.equal(cache.k_window[b, p % ring].float(), t.k[b, p])


@pytest.mark.parametrize("quantizer,window_bits", [("turbo", 4), ("asym", 4), ("turbo", 2)])
@pytest.mark.parametrize("layout", ["contiguous", "paged16-shuffled"])
def test_quantized_window(layout, quantizer, window_bits):
    """window_bits < 16: the last R tokens come back as codes of window_bits (the window quantizer's
    round trip of each token), older ones as the main codes; ring slot p % R holds token p."""
    R = 8
    cache = make_cache(layout, B=3, S=50, quantizer=quantizer, fp16_window=R, window_bits=window_bits, table_seed=3)
    assert cache.k_window.dtype == torch.uint8 and cache.k_window.shape == (3, R, 2, code_bytes(64, window_bits))
    assert cache.k_window_meta.shape == (3, R, 2, cache.k_meta.shape[-1])
    g = torch.Generator().manual_seed(9)
    t = Truth(cache)
    for r, n in ((0, 3), (1, 21), (2, 13)):
        k, v = (torch.randn(1, n, 2, 64, generator=g).half() for _ in range(2))
        cache.append(k, v, batch_idx=torch.tensor([r]))
        t.k[r, :n], t.v[r, :n], t.lens[r] = k[0].float(), v[0].float(), n
    for _ in range(5):  # rows 1 and 2 wrap around the ring
        k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
        cache.append(k, v, batch_idx=torch.tensor([2, 1]))
        for i, r in enumerate((2, 1)):
            t.k[r, t.lens[r]], t.v[r, t.lens[r]] = k[i, 0].float(), v[i, 0].float()
            t.lens[r] += 1
    k, v = cache.dequantize()
    kq, vq = cache.dequantize(use_window=False)
    wq = cache.window_quantizer
    mw = cache.k_meta.shape[-1]
    for b, L in enumerate(t.lens):
        lo = max(0, L - R)
        for got, main, true in ((k, kq, t.k), (v, vq, t.v)):
            codes, meta = wq.quantize(true[b, lo:L])
            torch.testing.assert_close(got[b, lo:L], wq.dequantize(codes, meta[..., :mw]), rtol=0, atol=1e-5)
            assert torch.equal(got[b, :lo], main[b, :lo]) and not torch.equal(got[b, lo:L], main[b, lo:L])
            assert torch.equal(got[b, L:], torch.zeros_like(got[b, L:]))
        for p in range(lo, L):  # ring layout
            codes, _ = wq.quantize(t.k[b, p])
            assert torch.equal(cache.k_window[b, p % R], pack_codes(codes, window_bits))
    n1 = t.lens[1]
    err = lambda x: (x[1, n1 - R : n1] - t.k[1, n1 - R : n1]).norm()  # noqa: E731
    assert (err(k) < err(kq)) == (window_bits > cache.k_bits)  # 4 bits: closer than the main 3-bit codes
    assert cache.nbytes == sum(
        x.numel() * x.element_size()
        for x in (
            cache.k_codes,
            cache.v_codes,
            cache.k_meta,
            cache.v_meta,
            cache.k_window,
            cache.v_window,
            cache.k_window_meta,
            cache.v_window_meta,
        )
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(quantizer="asym", fp16_window=8),
        dict(fp16_window=8, sink_tokens=3),
        dict(fp16_window=8, window_bits=4, sink_tokens=3),
        dict(fp16_window=8, sink_tokens=2, page_size=16),
        dict(fp16_window=8, sink_tokens=2, key_center="rope", calib_min_tokens=1),
    ],
)
@pytest.mark.parametrize("how", ["append", "crop"])
def test_recent_slots_after_rollback(options, how):
    """A rollback (an append at cache_seqlens below a row's length, or crop) leaves no discarded token
    in the recent slots: positions whose slot a later, discarded token overwrote read their codes'
    value, the others keep their 16-bit (or window-code) value; rows that do not roll back are
    untouched."""
    R = 8
    if options.get("key_center") == "rope":
        options = dict(options, rope_inv_freq=1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cache = QuantizedKVCache(2, 64, 1, 64, **options)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 20, 1, 64, generator=g).half()
    v = torch.randn(2, 20, 1, 64, generator=g).half()
    cache.append(k, v)
    k_codes, v_codes = cache.dequantize(use_window=False)  # what the codes alone hold
    k_full, v_full = cache.dequantize()
    k2 = torch.randn(2, 1, 1, 64, generator=g).half()
    if how == "append":  # speculative decoding: row 0 drops 5 tokens and writes 1, row 1 appends at 20
        cache.append(k2, k2, cache_seqlens=torch.tensor([15, 20], dtype=torch.int32))
        assert cache.seqlens.tolist() == [16, 21]
    else:
        cache.crop(torch.tensor([15, 20]))
        assert cache.seqlens.tolist() == [15, 20]
    kd, vd = cache.dequantize()
    end = int(cache.seqlens[0])
    # row 0: positions [end - R, 15) - those older than 20 - R = 12 held discarded tokens' slots
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    for p in range(end - R, 15):
        restored = p < 20 - R and p >= cache.sink_tokens
        for got, codes, full in ((kd, k_codes, k_full), (vd, v_codes, v_full)):
            if not restored:
                torch.testing.assert_close(got[0, p], full[0, p], rtol=0, atol=0)
            elif "window_bits" in options:  # the codes' value again as 4-bit window codes
                assert rel(got[0, p], codes[0, p]) < 0.15
            else:
                torch.testing.assert_close(got[0, p], codes[0, p], rtol=0, atol=1e-3)
        if restored:  # the position's own token, not the discarded one that held its slot
            assert rel(kd[0, p], k[0, p].float()) < 0.5 < rel(kd[0, p], k[0, p + R].float())
    kept = int(cache.seqlens[1]) - R  # the other row's window: its slots untouched
    torch.testing.assert_close(kd[1, kept:20], k_full[1, kept:20], rtol=0, atol=0)
    if how == "append":
        assert (kd[0, 15] - k2[0, 0].float()).abs().max() < (0.05 if "window_bits" not in options else 1.0)


def test_crop_refuses_growing_rows():
    cache = QuantizedKVCache(2, 64, 1, 64, fp16_window=8)
    cache.append(torch.randn(2, 10, 1, 64).half(), torch.randn(2, 10, 1, 64).half())
    with pytest.raises(ValueError, match="lengths"):
        cache.crop(11)
    with pytest.raises(ValueError, match="lengths"):
        cache.crop(torch.tensor([1.0, 2.0]))


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "d,kb,vb,R,layout",
    [
        (128, 3, 3, 0, "contiguous"),
        (64, 3, 3, 0, "contiguous"),
        (128, 4, 3, 0, "paged16"),
        (64, 2, 4, 8, "contiguous"),
        (128, 3, 3, 16, "paged32-shuffled"),
    ],
)
def test_nbytes_and_compression(d, kb, vb, R, layout):
    B, S, H = 3, 83, 2
    cache = make_cache(layout, B=B, S=S, H=H, d=d, k_bits=kb, v_bits=vb, fp16_window=R)
    slots = B * S if layout == "contiguous" else cache.k_codes.shape[0] * cache.k_codes.shape[1]
    if layout == "paged16":
        assert slots == B * math.ceil(S / 16) * 16
    mb = 2 if cache.scale_only else 4  # float16 scale (+ offset) a vector
    per_token = H * (d * kb // 8 + d * vb // 8 + 2 * mb)
    ring = R + cache.spec.verify_tokens - 1 if R else 0  # (the slots a verify call's queries need)
    expected = slots * per_token + (2 * B * (ring + 1) * H * d * 2 if R else 0)  # (the side's spare slot)
    assert cache.nbytes == expected
    assert cache.compression_ratio() == pytest.approx(2 * slots * H * d * 2 / expected)
    assert cache.bits_per_element() == pytest.approx(((d * kb // 8 + mb) + (d * vb // 8 + mb)) * 4 / d)


def test_compression_ratio_3bit_128():
    cache = QuantizedKVCache(2, 256, 4, 128)  # default: scale-only metadata
    assert cache.compression_ratio() == pytest.approx(512 / 100)
    assert cache.bits_per_element() == pytest.approx(3.125)
    cache = QuantizedKVCache(2, 256, 4, 128, scale_only=False)
    assert cache.compression_ratio() == pytest.approx(512 / 104)
    assert cache.bits_per_element() == pytest.approx(3.25)
    assert QuantizedKVCache(1, 8, 1, 64).bits_per_element() == pytest.approx(3.25)  # the budget at head_dim 64
    assert QuantizedKVCache(2, 256, 4, 64, scale_only=False).bits_per_element() == pytest.approx(3.5)


# ----------------------------------------------------------------------------- state_dict / to


def assert_same_cache(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and sa.pop("config") == sb.pop("config")
    for name, ta in sa.items():
        tb = sb[name]
        if ta is not None:
            assert torch.equal(ta, tb) or (
                ta.is_floating_point()
                and torch.equal(ta.isnan(), tb.isnan())
                and torch.equal(ta.nan_to_num(), tb.nan_to_num())
            ), name
    ka, va = a.dequantize()
    kb, vb = b.dequantize()
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize(
    "kw",
    [
        dict(layout="contiguous", quantizer="turbo", fp16_window=4),
        dict(layout="paged32", quantizer="asym", fp16_window=5, window_bits=4),
        dict(layout="paged16-shuffled", quantizer="asym", streaming=True, dtype=torch.bfloat16),
        dict(layout="paged32", quantizer="turbo", grid="lloyd_max", k_bits=4, v_bits=2, seed=5),
        dict(layout="paged64-shuffled", quantizer="turbo", seed=3),
        dict(layout="paged16-shuffled", quantizer="turbo", scale_only=True, k_bits=4),
    ],
)
def test_state_dict_roundtrip(kw):
    kw = dict(kw)
    layout = kw.pop("layout")
    src = make_cache(layout, table_seed=4, **kw)
    fill(src, seed=31, dtype=kw.get("dtype", torch.float16))
    sd = src.state_dict()
    assert "config" in sd and sd["config"]["quantizer"] == kw["quantizer"]
    # through torch.save / torch.load (weights_only default)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd2 = torch.load(buf)
    dst = make_cache(layout, table_seed=4, **kw)
    assert dst.seqlens.sum() == 0
    dst.load_state_dict(sd2)
    assert_same_cache(src, dst)
    new = QuantizedKVCache.from_state_dict(sd2)
    assert_same_cache(src, new)
    assert new.config() == src.config()
    # the loaded cache keeps working: append one more token to both and compare
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 1, 2, 64, generator=g).to(src.dtype)
    for c in (src, new):
        c.append(k, k)
    assert_same_cache(src, new)


@pytest.mark.parametrize(
    "change",
    [
        dict(k_bits=4),
        dict(head_dim=128),
        dict(max_seqlen=84),
        dict(fp16_window=2),
        dict(quantizer="asym"),
        dict(seed=1),
        dict(grid="lloyd_max"),
        dict(dtype=torch.bfloat16),
        dict(page_size=16),
    ],
)
def test_load_into_different_config_raises(change):
    base = dict(batch_size=3, max_seqlen=83, num_kv_heads=2, head_dim=64)
    src = QuantizedKVCache(**base)
    fill(src, seed=1, prefill=3, steps=1)
    other = QuantizedKVCache(**{**base, **change})
    with pytest.raises(ValueError, match="configuration"):
        other.load_state_dict(src.state_dict())


def test_to_cpu():
    cache = make_cache("paged16", quantizer="asym", streaming=True, fp16_window=3)
    fill(cache, seed=2)
    k0, v0 = cache.dequantize()
    assert cache.to("cpu") is cache
    assert cache.device == torch.device("cpu")
    for name, t in cache.state_dict().items():
        assert name == "config" or t.device.type == "cpu"
    k1, v1 = cache.to(torch.device("cpu")).dequantize()
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert "paged(page_size=16" in repr(cache)


def test_stores_side_follows_kv_side():
    """The decode op gets views of the cache's kv_side as it is now (kept beside it, replaced with it)."""
    from flash_attn_tq import ops

    cache = QuantizedKVCache(2, 64, 2, 64, sink_tokens=4, fp16_window=8)
    for _ in range(2):
        (side,) = [s for s in cache.stores(2) if s.kind == ops.SIDE]
        assert (side.a, side.b) == (4, 8)
        for i, t in enumerate(side.tensors):
            assert t.data_ptr() == cache.kv_side[i].data_ptr() and t.shape == cache.kv_side[i].shape
        cache.kv_side = cache.kv_side.clone()  # (as .to() replaces it)
    assert [s.kind for s in QuantizedKVCache(2, 64, 2, 64).stores(2)] == [ops.CODES]


# ----------------------------------------------------------------------------- streaming asym


def test_streaming_cache_updates_range():
    alpha = 0.8
    cache = QuantizedKVCache(3, 40, 2, 64, quantizer="asym", streaming=True, alpha=alpha, k_bits=4)
    assert torch.isnan(cache.k_range).all() and cache.k_range.shape == (3, 2)
    g = torch.Generator().manual_seed(6)
    k1 = torch.randn(3, 5, 2, 64, generator=g).half()
    v1 = torch.randn(3, 5, 2, 64, generator=g).half() * 3
    cache.append(k1, v1)
    r_k1 = k1.float().abs().amax(dim=(1, 3))
    torch.testing.assert_close(cache.k_range, r_k1, rtol=0, atol=0)
    torch.testing.assert_close(cache.v_range, v1.float().abs().amax(dim=(1, 3)), rtol=0, atol=0)
    # codes agree with the stateless quantizer fed the same range
    qz = AsymQuantizer(4, streaming=True, alpha=alpha)
    codes, meta, _ = qz.quantize(k1, None)
    assert torch.equal(unpack_codes(cache.k_codes[:, :5], 4, 64), codes)
    assert torch.equal(cache.k_meta[:, :5], meta)
    # one token to rows 2 and 0 only (batch_idx in another order): their ranges follow the EMA
    k2 = torch.randn(2, 1, 2, 64, generator=g).half() * 5
    cache.append(k2, k2, batch_idx=torch.tensor([2, 0]))
    exp = r_k1.clone()
    new = k2.float().abs().amax(dim=(1, 3))
    exp[2] = alpha * new[0] + (1 - alpha) * r_k1[2]
    exp[0] = alpha * new[1] + (1 - alpha) * r_k1[0]
    torch.testing.assert_close(cache.k_range, exp, rtol=1e-6, atol=0)
    assert cache.seqlens.tolist() == [6, 5, 6]
    # the token's scale came from its own row's range
    assert torch.equal(cache.k_meta[2, 5, :, 0], (2 * exp[2] / 15).half())
    assert torch.equal(cache.k_meta[0, 5, :, 0], (2 * exp[0] / 15).half())
    k, _ = cache.dequantize()
    err = (k[2, 5] - k2[0, 0].float()).abs()
    c = unpack_codes(cache.k_codes[2, 5], 4, 64)
    inner = (c > 0) & (c < 15)  # the range lags the new max (alpha < 1): the extremes may clamp
    assert inner.float().mean() > 0.9
    assert (err <= cache.k_meta[2, 5, :, :1].float() * 0.5 + 1e-2)[inner].all()


# ----------------------------------------------------------------------------- errors


def test_overflow():
    cache = QuantizedKVCache(2, 10, 1, 32, quantizer="asym")
    k = torch.randn(2, 8, 1, 32)
    cache.append(k, k)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(k[:, :3], k[:, :3])
    assert cache.seqlens.tolist() == [8, 8]  # nothing changed
    with pytest.raises(ValueError, match="overflow"):
        cache.append(k[:, :1], k[:, :1], cache_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="overflow"):
        cache.append(k[:, :1], k[:, :1], cache_seqlens=-1)
    cache.append(k[:, :2], k[:, :2])
    assert cache.seqlens.tolist() == [10, 10]


def test_bad_new_kv():
    cache = QuantizedKVCache(2, 16, 2, 64)
    good = torch.randn(2, 3, 2, 64)
    with pytest.raises(ValueError, match="head_dim=64"):
        cache.append(torch.randn(2, 3, 2, 32), torch.randn(2, 3, 2, 32))
    with pytest.raises(ValueError, match="kv_heads=2"):
        cache.append(torch.randn(2, 3, 4, 64), torch.randn(2, 3, 4, 64))
    with pytest.raises(ValueError, match="k must be"):
        cache.append(torch.randn(3, 2, 64), good)
    bad = good.clone()
    bad[1, 2, 0, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.append(bad, good)
    bad[1, 2, 0, 7] = float("inf")
    with pytest.raises(ValueError, match="v contains NaN or Inf"):
        cache.append(good, bad)
    with pytest.raises(TypeError, match="k must be float16"):
        cache.append(good.to(torch.int32), good)
    with pytest.raises(TypeError, match="k must be float16"):
        cache.append(good.double(), good)
    with pytest.raises(ValueError, match="same shape"):
        cache.append(good, good[:, :2])
    with pytest.raises(TypeError, match="tensor"):
        cache.append(good.numpy(), good)
    with pytest.raises(ValueError, match="batch_idx"):
        cache.append(good, good, batch_idx=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="cache_seqlens"):
        cache.append(good, good, cache_seqlens=torch.zeros(3, dtype=torch.int32))
    assert cache.seqlens.tolist() == [0, 0] and cache.k_meta.abs().sum() == 0


def test_bad_construction():
    with pytest.raises(ValueError, match="quantizer"):
        QuantizedKVCache(1, 8, 1, 64, quantizer="kivi")
    with pytest.raises(TypeError, match="dtype"):
        QuantizedKVCache(1, 8, 1, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        QuantizedKVCache(1, 8, 1, 48)
    with pytest.raises(ValueError, match="head_dim"):
        QuantizedKVCache(1, 8, 1, 96)  # turbo needs a power of two
    QuantizedKVCache(1, 8, 1, 96, quantizer="asym")  # asym does not
    with pytest.raises(ValueError, match="bits"):
        QuantizedKVCache(1, 8, 1, 64, k_bits=5)
    with pytest.raises(ValueError, match="grid"):
        QuantizedKVCache(1, 8, 1, 64, grid="nf")
    with pytest.raises(ValueError, match="streaming"):
        QuantizedKVCache(1, 8, 1, 64, streaming=True)
    with pytest.raises(ValueError, match="asym"):
        QuantizedKVCache(1, 8, 1, 64, quantizer="asym", grid="lloyd_max")
    for name, args in (("batch_size", (0, 8, 1, 64)), ("max_seqlen", (1, 0, 1, 64)), ("num_kv_heads", (1, 8, 0, 64))):
        with pytest.raises(ValueError, match=name):
            QuantizedKVCache(*args)
    with pytest.raises(ValueError, match="fp16_window"):
        QuantizedKVCache(1, 8, 1, 64, fp16_window=-1)
    with pytest.raises(ValueError, match="window_bits"):
        QuantizedKVCache(1, 8, 1, 64, fp16_window=4, window_bits=5)
    with pytest.raises(ValueError, match="window_bits=4 sets the width of the recent window"):
        QuantizedKVCache(1, 8, 1, 64, window_bits=4)  # (without a window it would change nothing)
    with pytest.raises(ValueError, match="8-bit codes use the uniform grid"):
        QuantizedKVCache(1, 8, 1, 64, k_bits=8, grid="lloyd_max")
    with pytest.raises(ValueError, match="page_size"):
        QuantizedKVCache(1, 8, 1, 64, page_size=0)
    with pytest.raises(ValueError, match="page_size"):
        QuantizedKVCache(1, 8, 1, 64, num_blocks=4)


def test_bad_block_table():
    with pytest.raises(ValueError, match="block_table must be int32"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, block_table=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_table must be int32"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, block_table=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table must be int32"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, block_table=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="fewer than max_seqlen"):
        QuantizedKVCache(2, 33, 1, 64, page_size=16, block_table=torch.zeros(2, 2, dtype=torch.int32))
    bt = torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table entries"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, num_blocks=4, block_table=bt)
    with pytest.raises(ValueError, match="block_table entries"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, block_table=bt - 1)
    with pytest.raises(ValueError, match="num_blocks"):
        QuantizedKVCache(2, 32, 1, 64, page_size=16, num_blocks=3)
    # a valid custom table: num_blocks inferred from its max
    c = QuantizedKVCache(2, 32, 1, 64, page_size=16, block_table=bt)
    assert c.k_codes.shape[:2] == (6, 16)


@pytest.mark.parametrize("k_bits,v_bits", [(3, 3), (4, 3), (2, 4)])
def test_scale_only_metadata(k_bits, v_bits):
    """scale_only stores turbo's float16 scale alone (its offset is -mid * scale): half the metadata,
    the same codes, and values equal to the (scale, offset) format's up to that offset's float16
    rounding."""
    g = torch.Generator().manual_seed(k_bits * 10 + v_bits)
    k = (torch.randn(2, 37, 3, 64, generator=g) * 2 + 0.5).half()
    v = torch.randn(2, 37, 3, 64, generator=g).half()
    full = QuantizedKVCache(2, 40, 3, 64, k_bits=k_bits, v_bits=v_bits, scale_only=False)
    small = QuantizedKVCache(2, 40, 3, 64, k_bits=k_bits, v_bits=v_bits, scale_only=True)
    for c in (full, small):
        c.append(k, v)
    assert small.k_meta.shape == (2, 40, 3, 1) and small.v_meta.shape == (2, 40, 3, 1)
    assert torch.equal(small.k_codes, full.k_codes) and torch.equal(small.v_codes, full.v_codes)
    assert torch.equal(small.k_meta[..., 0], full.k_meta[..., 0])
    assert small.nbytes < full.nbytes
    assert small.bits_per_element() == pytest.approx(full.bits_per_element() - 0.25)  # 16 bits less a vector at d=64
    for a, b, meta, bits in zip(small.dequantize(), full.dequantize(), (full.k_meta, full.v_meta), (k_bits, v_bits)):
        # the stored offset's float16 rounding (2^-11 relative), common to a rotated vector's elements,
        # lands on one element after the inverse Hadamard transform (x sqrt(64))
        offset = meta[..., 0].float().abs().amax() * ((1 << bits) - 1) / 2
        torch.testing.assert_close(a, b, rtol=0, atol=float(offset) * 2**-11 * 8)
    for bad in (dict(quantizer="asym"), dict(fit="mean"), dict(grid="lloyd_max")):
        with pytest.raises(ValueError, match="scale_only"):
            QuantizedKVCache(1, 8, 1, 64, scale_only=True, **bad)


@pytest.mark.parametrize("options", [dict(fp16_window=24, sink_tokens=4), dict(fp16_window=24, window_bits=4)])
@pytest.mark.parametrize("cut", [3, 8, 12])  # tokens dropped: some of the last append's, all of them, older ones too
def test_crop_after_an_append_restores_the_recent_slots_exactly(options, cut):
    """An append of a few tokens then a crop (assisted generation rejecting drafts) leaves the cache as
    if the dropped tokens never came: the recent slots they took give the tokens they displaced back
    exactly where the last append displaced them (older ones from their codes, as before)."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 80, 2, 64, generator=g).half() for _ in range(2))
    a, b = (QuantizedKVCache(2, 128, 2, 64, **options) for _ in range(2))
    a.append(k[:, :60], v[:, :60])
    a.append(k[:, 60:68], v[:, 60:68])  # 8 drafts
    a.crop(torch.tensor([68 - cut, 68]))  # row 1 keeps them all
    kept = 68 - cut
    b.append(k[:, :60], v[:, :60])
    if kept > 60:
        b.append(k[:, 60:kept], v[:, 60:kept])
    elif kept < 60:
        b.crop(kept)
    b.append(k[1:, kept:68], v[1:, kept:68], batch_idx=torch.tensor([1]))
    # row 0 is exact where the last append displaced the tokens; older ones (cut 12) come from codes
    for x, y in zip(a.dequantize(), b.dequantize()):
        torch.testing.assert_close(x[1], y[1], rtol=0, atol=0)
        if kept >= 60:
            torch.testing.assert_close(x[0], y[0], rtol=0, atol=0)
        else:
            torch.testing.assert_close(x[0, kept - 24 + 8 :], y[0, kept - 24 + 8 :], rtol=0, atol=0)
