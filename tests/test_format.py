"""Tests for flash_attn_tq.format: the packed code layout.

The expected bytes are built here, one bit at a time, from the rules written in the module
docstring (pair slots, words, the 3-bit spare slot), with plain Python integers; nothing is
shared with the implementation under test.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn_tq import format as fmt
from flash_attn_tq.format import bits_per_element, code_bytes, pack_codes, pair_elements, unpack_codes

HEAD_DIMS = (32, 64, 128, 256)
BITS = (2, 3, 4)


# ----------------------------------------------------------------------------- independent layout

def doc_pair(s: int, head_dim: int) -> tuple[int, int]:
    """Docstring: lo = 16 * (s % M) + s // M, hi = lo + 8, M = head_dim // 16."""
    m = head_dim // 16
    lo = 16 * (s % m) + s // m
    return lo, lo + 8


def doc_words(codes: list[int], bits: int) -> list[int]:
    """32-bit words for one vector, built bit by bit from the docstring's rules."""
    d = len(codes)
    nwords = d * bits // 32
    words = [0] * nwords

    def put(word: int, bit: int, value: int, width: int) -> None:
        for i in range(width):
            if (value >> i) & 1:
                words[word] |= 1 << (bit + i)

    for s in range(d // 2):
        lo_el, hi_el = doc_pair(s, d)
        lo, hi = codes[lo_el], codes[hi_el]
        if bits == 4:
            put(s // 4, 4 * (s % 4), lo, 4)
            put(s // 4, 16 + 4 * (s % 4), hi, 4)
        elif bits == 2:
            put(s // 8, 2 * (s % 8), lo, 2)
            put(s // 8, 16 + 2 * (s % 8), hi, 2)
        else:
            b, r = divmod(s, 16)
            if r < 15:
                put(3 * b + r // 5, 3 * (r % 5), lo, 3)
                put(3 * b + r // 5, 16 + 3 * (r % 5), hi, 3)
            else:
                for i in range(3):
                    put(3 * b + i, 15, (lo >> i) & 1, 1)
                    put(3 * b + i, 31, (hi >> i) & 1, 1)
    assert all(0 <= w < 2**32 for w in words)
    return words


def doc_bytes(codes: list[int], bits: int) -> list[int]:
    out = []
    for w in doc_words(codes, bits):
        out += [(w >> (8 * i)) & 0xFF for i in range(4)]  # little-endian
    return out


def code_vectors(head_dim: int, bits: int) -> dict[str, list[int]]:
    n = 1 << bits
    g = torch.Generator().manual_seed(1000 * bits + head_dim)
    return {
        "index_mod": [i % n for i in range(head_dim)],
        "index_mod_rev": [(head_dim - 1 - i) % n for i in range(head_dim)],
        "all_max": [n - 1] * head_dim,
        "zeros": [0] * head_dim,
        "one_hot_13": [(n - 1) if i == 13 else 0 for i in range(head_dim)],
        "index_div7": [(i // 7) % n for i in range(head_dim)],
        "random": torch.randint(0, n, (head_dim,), generator=g).tolist(),
    }


# ----------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("head_dim,bits,nbytes", [
    (128, 3, 48), (64, 3, 24), (32, 3, 12), (256, 3, 96),
    (128, 4, 64), (64, 4, 32), (128, 2, 32), (64, 2, 16),
])
def test_code_bytes(head_dim, bits, nbytes):
    assert code_bytes(head_dim, bits) == nbytes
    packed = pack_codes(torch.zeros(head_dim, dtype=torch.long), bits)
    assert packed.dtype == torch.uint8 and packed.shape == (nbytes,)


@pytest.mark.parametrize("head_dim,bits,bpe", [
    (128, 3, 3.25), (64, 3, 3.5), (128, 4, 4.25), (64, 4, 4.5), (128, 2, 2.25), (256, 3, 3.125),
])
def test_bits_per_element(head_dim, bits, bpe):
    assert bits_per_element(head_dim, bits) == pytest.approx(bpe, abs=1e-12)


# ----------------------------------------------------------------------------- pair permutation

@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_pair_elements_bijection_and_formula(head_dim):
    p = pair_elements(head_dim)
    assert p.dtype == torch.long and p.shape == (head_dim // 2, 2)
    flat = p.reshape(-1).tolist()
    assert sorted(flat) == list(range(head_dim))  # every element exactly once
    m = head_dim // 16
    for s in range(head_dim // 2):
        lo, hi = p[s].tolist()
        assert (lo, hi) == doc_pair(s, head_dim)
        # thread group g = s // M owns rows g and g + 8 of 16-row block s % M
        assert lo // 16 == s % m and lo % 16 == s // m
        assert hi - lo == 8 and hi // 16 == lo // 16
    assert fmt.PAIR_GROUPS == 8


def test_pair_elements_explicit_d32():
    # M = 2: slots alternate between the two 16-row blocks
    p = pair_elements(32).tolist()
    assert p[:6] == [[0, 8], [16, 24], [1, 9], [17, 25], [2, 10], [18, 26]]
    assert p[-1] == [23, 31]


# ----------------------------------------------------------------------------- bit layout

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_pack_matches_documented_layout(head_dim, bits):
    vecs = code_vectors(head_dim, bits)
    codes = torch.tensor(list(vecs.values()), dtype=torch.long)
    packed = pack_codes(codes, bits)
    for i, (name, vec) in enumerate(vecs.items()):
        assert packed[i].tolist() == doc_bytes(vec, bits), f"layout mismatch for {name}"
    # and unpack of the hand-built bytes gives back the codes
    hand = torch.tensor([doc_bytes(v, bits) for v in vecs.values()], dtype=torch.uint8)
    assert torch.equal(unpack_codes(hand, bits, head_dim), codes)


def test_layout_spot_checks_3bit():
    """A few explicit bits of the 3-bit layout at head_dim 32 (M = 2, one 16-slot block)."""
    d = 32
    # element 0 is lo of slot 0 -> word 0, bits 0..2
    c = [0] * d
    c[0] = 5
    w = doc_words(c, 3)
    assert w == [5, 0, 0]
    b = pack_codes(torch.tensor(c), 3).tolist()
    assert b == [5] + [0] * 11
    # element 8 is hi of slot 0 -> word 0, bits 16..18
    c = [0] * d
    c[8] = 7
    assert pack_codes(torch.tensor(c), 3).tolist() == [0, 0, 7, 0] + [0] * 8
    # slot 15 = (lo 16*(15%2) + 15//2 = 23, hi 31): spare bits 15 / 31 of words 0..2
    c = [0] * d
    c[23] = 0b101
    c[31] = 0b010
    words = [0x8000, 0x80000000, 0x8000]
    expect = []
    for x in words:
        expect += [(x >> (8 * i)) & 0xFF for i in range(4)]
    assert pack_codes(torch.tensor(c), 3).tolist() == expect
    # slot 5 (r = 5) -> word 1 at bit 0: slot 5 is lo element 16*(5%2) + 5//2 = 18
    c = [0] * d
    c[18] = 3
    assert pack_codes(torch.tensor(c), 3).tolist() == [0] * 4 + [3, 0, 0, 0] + [0] * 4


def test_layout_spot_checks_4bit_2bit():
    c = [0] * 64  # M = 4
    c[16] = 0xA  # slot 1 (lo = 16*1 + 0) -> word 0 bits 4..7
    c[24] = 0x3  # its hi -> word 0 bits 20..23
    assert pack_codes(torch.tensor(c), 4)[:4].tolist() == [0xA0, 0, 0x30, 0]
    c = [0] * 64
    c[1] = 3  # slot 4 (lo = 16*0 + 1) -> 2-bit word 0, bits 8..9
    assert pack_codes(torch.tensor(c), 2)[:4].tolist() == [0, 3, 0, 0]


# ----------------------------------------------------------------------------- fuzzed round trip

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.sampled_from(BITS),
    head_dim=st.sampled_from(HEAD_DIMS),
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.int16]),
)
def test_roundtrip_fuzz(bits, head_dim, lead, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, head_dim), generator=g).to(dtype)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, code_bytes(head_dim, bits))
    out = unpack_codes(packed, bits, head_dim)
    assert out.dtype == torch.int64 and out.shape == codes.shape
    assert torch.equal(out, codes.long())


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), head_dim=st.sampled_from(HEAD_DIMS), seed=st.integers(0, 2**31 - 1))
def test_unpack_pack_fuzz_bytes(bits, head_dim, seed):
    """Every byte string is a valid packing: unpack then pack returns the same bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (3, code_bytes(head_dim, bits)), generator=g).to(torch.uint8)
    assert torch.equal(pack_codes(unpack_codes(raw, bits, head_dim), bits), raw)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from(BITS), head_dim=st.sampled_from((32, 64, 128)), seed=st.integers(0, 2**31 - 1))
def test_pack_matches_layout_fuzz(bits, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (head_dim,), generator=g)
    assert pack_codes(codes, bits).tolist() == doc_bytes(codes.tolist(), bits)


def test_roundtrip_noncontiguous_input():
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 8, (128, 5), generator=g).t()  # [5, 128], non-contiguous
    assert not codes.is_contiguous()
    assert torch.equal(unpack_codes(pack_codes(codes, 3), 3, 128), codes)
    packed = pack_codes(codes.contiguous(), 3)
    assert torch.equal(pack_codes(codes, 3), packed)


def test_empty_leading_shape():
    for bits in BITS:
        codes = torch.zeros(0, 3, 64, dtype=torch.long)
        packed = pack_codes(codes, bits)
        assert packed.shape == (0, 3, code_bytes(64, bits))
        assert unpack_codes(packed, bits, 64).shape == (0, 3, 64)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("bits", BITS)
def test_out_of_range_codes(bits):
    codes = torch.zeros(2, 64, dtype=torch.long)
    codes[1, 37] = 1 << bits
    with pytest.raises(ValueError, match="codes must lie"):
        pack_codes(codes, bits)
    codes[1, 37] = -1
    with pytest.raises(ValueError, match="codes must lie"):
        pack_codes(codes, bits)


@pytest.mark.parametrize("bad", [0, 1, 5, 8])
def test_bad_bits(bad):
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(64, dtype=torch.long), bad)
    with pytest.raises(ValueError, match="bits"):
        unpack_codes(torch.zeros(24, dtype=torch.uint8), bad, 64)
    with pytest.raises(ValueError, match="bits"):
        code_bytes(64, bad)


@pytest.mark.parametrize("head_dim", [0, 16, 48, 96 + 8, 100, -32])
def test_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        code_bytes(head_dim, 3)
    if head_dim > 0:
        with pytest.raises(ValueError, match="head_dim"):
            pack_codes(torch.zeros(head_dim, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="head_dim"):
        unpack_codes(torch.zeros(12, dtype=torch.uint8), 3, head_dim)


def test_non_power_of_two_multiple_of_32_is_fine():
    codes = torch.arange(96) % 8
    assert code_bytes(96, 3) == 36
    assert torch.equal(unpack_codes(pack_codes(codes, 3), 3, 96), codes)
    assert pack_codes(codes, 3).tolist() == doc_bytes(codes.tolist(), 3)


def test_wrong_packed_length_or_dtype():
    good = pack_codes(torch.arange(128) % 8, 3)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(good[:-4], 3, 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(torch.cat([good, good[:4]]), 3, 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(good.to(torch.int32), 3, 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(good.to(torch.int8), 3, 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(good, 4, 128)  # 48 bytes is a 3-bit vector, not 4-bit
