"""Tests for flash_attn_tq.format: the packed code layout.

The expected bytes are built here, one bit at a time, from the rules written in the module
docstring (the code sequence of 8 groups, 16-bit lanes, the 3-bit 16-code blocks in 3 lanes with
the spare bit 15), with plain Python integers; nothing is shared with the implementation under
test. The kernel-facing K pair mapping of csrc/flash_attn/src/tq_format.h (``k_pair_element`` and
the word / spare extraction the kernels do) is reimplemented here too and checked against the bytes
``pack_codes`` writes.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn_tq import format as fmt
from flash_attn_tq.format import bits_per_element, code_bytes, pack_codes, sequence_elements, unpack_codes

HEAD_DIMS = (32, 64, 128, 256)
BITS = (2, 3, 4, 8)


# ----------------------------------------------------------------------------- independent layout


def doc_seq_element(n: int, head_dim: int) -> int:
    """Docstring: g = n // (D/8), k = n % (D/8), element = 16 (k // 2) + g + 8 (k % 2)."""
    per_group = head_dim // 8
    g, k = n // per_group, n % per_group
    return 16 * (k // 2) + g + 8 * (k % 2)


def doc_lanes(codes: list[int], bits: int) -> list[int]:
    """16-bit lanes for one vector, built bit by bit from the docstring's rules."""
    d = len(codes)
    nlanes = d * bits // 16
    lanes = [0] * nlanes

    def put(lane: int, bit: int, value: int, width: int) -> None:
        for i in range(width):
            if (value >> i) & 1:
                assert not (lanes[lane] >> (bit + i)) & 1, "two codes share a bit"
                lanes[lane] |= 1 << (bit + i)

    for n in range(d):
        c = codes[doc_seq_element(n, d)]
        if bits == 8:
            put(n // 2, 8 * (n % 2), c, 8)
        elif bits == 4:
            put(n // 4, 4 * (n % 4), c, 4)
        elif bits == 2:
            put(n // 8, 2 * (n % 8), c, 2)
        else:
            b, r = divmod(n, 16)
            if r < 15:
                put(3 * b + r // 5, 3 * (r % 5), c, 3)
            else:  # bit i of the spare code -> bit 15 of lane 3b + i
                for i in range(3):
                    put(3 * b + i, 15, (c >> i) & 1, 1)
    assert all(0 <= x < 2**16 for x in lanes)
    return lanes


def doc_bytes(codes: list[int], bits: int) -> list[int]:
    out = []
    for x in doc_lanes(codes, bits):
        out += [x & 0xFF, x >> 8]  # lane l is bytes 2l, 2l + 1 (little-endian)
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


def one_hot(head_dim: int, element: int, value: int) -> list[int]:
    c = [0] * head_dim
    c[element] = value
    return c


def lanes_to_bytes(lanes: list[int]) -> list[int]:
    out = []
    for x in lanes:
        out += [x & 0xFF, x >> 8]
    return out


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "head_dim,bits,nbytes",
    [
        (128, 3, 48),
        (64, 3, 24),
        (32, 3, 12),
        (256, 3, 96),
        (128, 4, 64),
        (64, 4, 32),
        (128, 2, 32),
        (64, 2, 16),
    ],
)
def test_code_bytes(head_dim, bits, nbytes):
    assert code_bytes(head_dim, bits) == nbytes
    packed = pack_codes(torch.zeros(head_dim, dtype=torch.long), bits)
    assert packed.dtype == torch.uint8 and packed.shape == (nbytes,)


@pytest.mark.parametrize(
    "head_dim,bits,bpe",
    [
        (128, 3, 3.25),
        (64, 3, 3.5),
        (128, 4, 4.25),
        (64, 4, 4.5),
        (128, 2, 2.25),
        (256, 3, 3.125),
    ],
)
def test_bits_per_element(head_dim, bits, bpe):
    assert bits_per_element(head_dim, bits) == pytest.approx(bpe, abs=1e-12)


# ----------------------------------------------------------------------------- code sequence


@pytest.mark.parametrize("head_dim", HEAD_DIMS + (96,))
def test_sequence_elements_bijection_and_formula(head_dim):
    p = sequence_elements(head_dim)
    assert p.dtype == torch.long and p.shape == (head_dim,)
    seq = p.tolist()
    assert sorted(seq) == list(range(head_dim))  # every element exactly once
    assert seq == [doc_seq_element(n, head_dim) for n in range(head_dim)]
    per_group = head_dim // 8
    for g in range(fmt.GROUPS):
        # group g: elements 16 m + g, 16 m + g + 8 for m = 0, 1, ... in that order
        expect = []
        for m in range(head_dim // 16):
            expect += [16 * m + g, 16 * m + g + 8]
        assert seq[g * per_group : (g + 1) * per_group] == expect
    assert fmt.GROUPS == 8


def test_sequence_elements_explicit_d32():
    # D/8 = 4 codes a group: rows g, g + 8 of the two 16-row blocks
    p = sequence_elements(32).tolist()
    assert p[:12] == [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26]
    assert p[-4:] == [7, 15, 23, 31]


def test_sequence_elements_device_arg():
    p = sequence_elements(64, device="cpu")
    assert p.device.type == "cpu"
    assert torch.equal(p, sequence_elements(64))


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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_every_single_element_lands_where_documented(head_dim, bits):
    """One-hot at every element, all-ones code: exactly its ``bits`` documented bits are set."""
    top = (1 << bits) - 1
    rows = [one_hot(head_dim, e, top) for e in range(head_dim)]
    packed = pack_codes(torch.tensor(rows), bits).tolist()
    for e in range(head_dim):
        assert packed[e] == doc_bytes(rows[e], bits), f"element {e}"
        assert sum(bin(x).count("1") for x in packed[e]) == bits


def test_layout_spot_checks_3bit_d128():
    """Explicit bits of the 3-bit layout at head_dim 128 (a group is one 16-code block, 24 lanes)."""
    d, nl = 128, 24

    def lanes_of(element: int, value: int) -> list[int]:
        return lanes_to_bytes_inv(pack_codes(torch.tensor(one_hot(d, element, value)), 3).tolist())

    def lanes_to_bytes_inv(b: list[int]) -> list[int]:
        return [b[2 * i] | (b[2 * i + 1] << 8) for i in range(len(b) // 2)]

    def only(lane: int, value: int) -> list[int]:
        out = [0] * nl
        out[lane] = value
        return out

    # element 0 = sequence position 0 -> lane 0, bits 0..2
    assert lanes_of(0, 5) == only(0, 5)
    assert pack_codes(torch.tensor(one_hot(d, 0, 5)), 3).tolist() == [5] + [0] * 47
    # element 8 = position 1 (g 0, k 1) -> lane 0, bits 3..5
    assert lanes_of(8, 7) == only(0, 7 << 3)
    assert pack_codes(torch.tensor(one_hot(d, 8, 7)), 3).tolist() == [0x38] + [0] * 47
    # element 16 = position 2 -> lane 0, bits 6..8: straddles bytes 0 and 1
    assert lanes_of(16, 0b101) == only(0, 0b101 << 6)
    assert pack_codes(torch.tensor(one_hot(d, 16, 0b101)), 3).tolist() == [0x40, 0x01] + [0] * 46
    # element 40 = position 5 (k 5: 16*2 + 8) -> lane 1, bits 0..2
    assert lanes_of(40, 6) == only(1, 6)
    # element 112 = position 14 (k 14: 16*7) -> lane 2, bits 12..14
    assert lanes_of(112, 7) == only(2, 7 << 12)
    # element 1 = position 16 (g 1, k 0) -> block 1: lane 3, bits 0..2 = byte 6
    assert lanes_of(1, 3) == only(3, 3)
    assert pack_codes(torch.tensor(one_hot(d, 1, 3)), 3).tolist() == [0] * 6 + [3] + [0] * 41
    # element 9 = position 17 -> lane 3, bits 3..5
    assert lanes_of(9, 1) == only(3, 1 << 3)
    # spare of block 0: position 15 = element 16*7 + 0 + 8 = 120 -> bit 15 of lanes 0, 1, 2
    assert doc_seq_element(15, d) == 120
    expect = [0] * nl
    expect[0] = expect[2] = 0x8000  # 0b101: bits 0 and 2
    assert lanes_of(120, 0b101) == expect
    assert pack_codes(torch.tensor(one_hot(d, 120, 0b101)), 3).tolist() == ([0, 0x80, 0, 0, 0, 0x80] + [0] * 42)
    expect = [0] * nl
    expect[1] = 0x8000  # 0b010
    assert lanes_of(120, 0b010) == expect
    # spare of block 7: position 127 = element 16*7 + 7 + 8 = 127 -> bit 15 of lanes 21, 22, 23
    assert doc_seq_element(127, d) == 127
    expect = [0] * nl
    expect[21] = expect[22] = expect[23] = 0x8000
    assert lanes_of(127, 7) == expect
    # element 127's neighbour 119 = position 126 (g 7, k 14) -> lane 23, bits 12..14
    assert lanes_of(119, 7) == only(23, 7 << 12)


def test_layout_spot_checks_3bit_d64():
    """At head_dim 64 a 3-bit block holds two groups (8 codes each)."""
    d = 64
    # element 1 = position 8 (g 1, k 0): still block 0, r 8 -> lane 1, bits 9..11
    assert pack_codes(torch.tensor(one_hot(d, 1, 7)), 3).tolist() == [0, 0, 0, 0x0E] + [0] * 20
    # spare of block 0: position 15 = g 1, k 7 -> 16*3 + 1 + 8 = 57 -> bit 15 of lanes 0..2
    assert doc_seq_element(15, d) == 57
    assert pack_codes(torch.tensor(one_hot(d, 57, 7)), 3).tolist() == [0, 0x80] * 3 + [0] * 18
    # element 2 = position 16 (g 2, k 0) -> block 1, lane 3, bits 0..2
    assert pack_codes(torch.tensor(one_hot(d, 2, 4)), 3).tolist() == [0] * 6 + [4] + [0] * 17


def test_layout_spot_checks_4bit_2bit():
    d = 64  # D/8 = 8 codes a group
    # 4 bits: element 8 = position 1 -> lane 0 bits 4..7 (byte 0 high nibble)
    assert pack_codes(torch.tensor(one_hot(d, 8, 0xA)), 4)[:4].tolist() == [0xA0, 0, 0, 0]
    # element 16 = position 2 -> lane 0 bits 8..11 (byte 1 low nibble)
    assert pack_codes(torch.tensor(one_hot(d, 16, 0x3)), 4)[:4].tolist() == [0, 0x3, 0, 0]
    # element 1 = position 8 -> lane 2 bits 0..3 (byte 4)
    assert pack_codes(torch.tensor(one_hot(d, 1, 0xF)), 4).tolist() == [0] * 4 + [0xF] + [0] * 27
    # 2 bits: element 24 = position 3 -> lane 0 bits 6..7
    assert pack_codes(torch.tensor(one_hot(d, 24, 3)), 2)[:4].tolist() == [0xC0, 0, 0, 0]
    # element 32 = position 4 -> lane 0 bits 8..9 (byte 1)
    assert pack_codes(torch.tensor(one_hot(d, 32, 2)), 2)[:4].tolist() == [0, 2, 0, 0]
    # element 1 = position 8 -> lane 1 bits 0..1 (byte 2)
    assert pack_codes(torch.tensor(one_hot(d, 1, 3)), 2)[:4].tolist() == [0, 0, 3, 0]


# ----------------------------------------------------------------------------- kernel-facing K pairs


def hdr_seq_element(n: int, head_dim: int) -> int:
    """tq_format.h seq_element<kHeadDim>(n)."""
    k = n % (head_dim // 8)
    return 16 * (k // 2) + n // (head_dim // 8) + 8 * (k % 2)


def hdr_lane_code_seq(bits: int, lane: int, j: int) -> int:
    """tq_format.h lane_code_seq<kBits>(lane, j)."""
    return 16 * (lane // 3) + 5 * (lane % 3) + j if bits == 3 else lane * (16 // bits) + j


def hdr_k_pair_element(bits: int, head_dim: int, s: int, hi: int) -> int:
    """tq_format.h k_pair_element<kBits, kHeadDim>(s, hi)."""
    if bits == 3:
        sb, r = s // 16, s % 16
        if r == 15:
            return hdr_seq_element(32 * sb + 15 + 16 * hi, head_dim)
        return hdr_seq_element(hdr_lane_code_seq(3, 6 * sb + 2 * (r // 5) + hi, r % 5), head_dim)
    per_lane = 16 // bits
    return hdr_seq_element(hdr_lane_code_seq(bits, 2 * (s // per_lane) + hi, s % per_lane), head_dim)


def words_of(packed: list[int]) -> list[int]:
    """32-bit little-endian words: word w = lanes 2w (low half), 2w + 1 (high half)."""
    return [
        packed[4 * w] | packed[4 * w + 1] << 8 | packed[4 * w + 2] << 16 | packed[4 * w + 3] << 24
        for w in range(len(packed) // 4)
    ]


def k_extract_pair(words: list[int], bits: int, s: int) -> tuple[int, int]:
    """The (lo, hi) codes of K pair slot s, read from one vector's words as the header describes."""
    if bits == 3:
        sb, r = s // 16, s % 16
        w0, w1, w2 = words[3 * sb : 3 * sb + 3]
        if r < 15:  # lane_pair<3>(word 3 sb + r / 5, 3 (r % 5)): code r % 5 of each lane
            x = (words[3 * sb + r // 5] >> (3 * (r % 5))) & 0x00070007
        else:  # spare_pair_k: bit 15 of lanes 0, 1, 2 (lo) and 3, 4, 5 (hi) of the superblock
            x = ((w0 >> 15) & 0x1) | ((w0 >> 30) & 0x2) | ((w1 >> 13) & 0x4)
            x |= ((w1 >> 15) & 0x10000) | ((w2 << 2) & 0x20000) | ((w2 >> 13) & 0x40000)
        return x & 0xFFFF, x >> 16
    per_lane = 16 // bits
    mask = ((1 << bits) - 1) * 0x10001
    x = (words[s // per_lane] >> (bits * (s % per_lane))) & mask
    return x & 0xFFFF, x >> 16


def k_extract_spare_plain(words: list[int], sb: int) -> tuple[int, int]:
    """Slot 15 read literally from the prose: bit i of lo = bit 15 of lane 6 sb + i, hi: lane 6 sb + 3 + i."""
    lanes = []
    for w in words:
        lanes += [w & 0xFFFF, w >> 16]
    lo = sum(((lanes[6 * sb + i] >> 15) & 1) << i for i in range(3))
    hi = sum(((lanes[6 * sb + 3 + i] >> 15) & 1) << i for i in range(3))
    return lo, hi


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_k_pair_element_bijection(head_dim, bits):
    slots = head_dim // 2
    pairs = [(hdr_k_pair_element(bits, head_dim, s, 0), hdr_k_pair_element(bits, head_dim, s, 1)) for s in range(slots)]
    flat = [e for p in pairs for e in p]
    assert sorted(flat) == list(range(head_dim))  # every element in exactly one (slot, half)
    # the header's seq_element is the docstring's (and the implementation's) sequence order
    assert [hdr_seq_element(n, head_dim) for n in range(head_dim)] == sequence_elements(head_dim).tolist()
    if bits == 3:
        # slot 15 of superblock sb pairs the spare codes of its two blocks 2 sb, 2 sb + 1
        for sb in range(head_dim // 32):
            assert pairs[16 * sb + 15] == (
                doc_seq_element(32 * sb + 15, head_dim),
                doc_seq_element(32 * sb + 31, head_dim),
            )


def test_k_pair_element_explicit_3bit_d128():
    # slot 0: word 0 = lanes 0, 1, code 0 -> positions 0 and 5 -> elements 0, 40
    assert (hdr_k_pair_element(3, 128, 0, 0), hdr_k_pair_element(3, 128, 0, 1)) == (0, 40)
    # slot 5: word 1 = lanes 2, 3, code 0 -> positions 10 (block 0) and 16 (block 1) -> 80, 1
    assert (hdr_k_pair_element(3, 128, 5, 0), hdr_k_pair_element(3, 128, 5, 1)) == (80, 1)
    # slot 15: spares of blocks 0 and 1 -> positions 15, 31 -> elements 120, 121
    assert (hdr_k_pair_element(3, 128, 15, 0), hdr_k_pair_element(3, 128, 15, 1)) == (120, 121)
    # slot 16: superblock 1 starts at word 3 = lanes 6, 7 = blocks 2 (position 32) -> 2, and 37 -> 42
    assert (hdr_k_pair_element(3, 128, 16, 0), hdr_k_pair_element(3, 128, 16, 1)) == (2, 42)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_k_pair_extraction_from_packed_bytes(head_dim, bits):
    n = 1 << bits
    g = torch.Generator().manual_seed(77 + 10 * bits + head_dim)
    vecs = list(code_vectors(head_dim, bits).values())
    vecs += torch.randint(0, n, (20, head_dim), generator=g).tolist()
    vecs += [one_hot(head_dim, e, n - 1) for e in range(head_dim)]
    packed = pack_codes(torch.tensor(vecs), bits).tolist()
    for codes, pk in zip(vecs, packed):
        assert pk == doc_bytes(codes, bits)
        words = words_of(pk)
        assert len(words) == code_bytes(head_dim, bits) // 4
        for s in range(head_dim // 2):
            lo_el = hdr_k_pair_element(bits, head_dim, s, 0)
            hi_el = hdr_k_pair_element(bits, head_dim, s, 1)
            assert k_extract_pair(words, bits, s) == (codes[lo_el], codes[hi_el]), f"slot {s}"
            if bits == 3 and s % 16 == 15:
                assert k_extract_spare_plain(words, s // 16) == (codes[lo_el], codes[hi_el])


def test_v_merged_lane_extraction_3bit_d128():
    """V: lane l of two tokens merged into one word; slot r of a 3-lane block is the same element of both."""
    d, bits = 128, 3
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, 8, (2, d), generator=g)
    pk = pack_codes(toks, bits).tolist()
    lanes = [[p[2 * i] | p[2 * i + 1] << 8 for i in range(len(p) // 2)] for p in pk]
    for b in range(d // 16):  # at head_dim 128 block b is thread group b
        merged = [lanes[0][3 * b + i] | lanes[1][3 * b + i] << 16 for i in range(3)]
        for r in range(16):
            if r < 15:
                x = (merged[r // 5] >> (3 * (r % 5))) & 0x00070007
            else:  # spare_pair_merged: bit i of both codes is bit 15 / 31 of word i
                x = ((merged[0] >> 15) & 0x10001) | ((merged[1] >> 14) & 0x20002) | ((merged[2] >> 13) & 0x40004)
            e = doc_seq_element(16 * b + r, d)
            assert e % 8 == b  # group b's rows
            assert (x & 0xFFFF, x >> 16) == (int(toks[0, e]), int(toks[1, e])), f"block {b} slot {r}"


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


@pytest.mark.parametrize("bad", [0, 1, 5, 6, 16])
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


def test_kernel_cases_are_generated_from_one_list():
    """The .cu instantiations, the C++ case table (tq_cases.h) and flash_attn_tq/kernel_cases.py are all
    what csrc/flash_attn/src/generate_instantiations.py writes from its one list."""
    import pathlib
    import subprocess
    import sys

    gen = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "flash_attn" / "src" / "generate_instantiations.py"
    done = subprocess.run([sys.executable, str(gen), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
