#!/usr/bin/env bash
# Regenerate the patch series against upstream flash-attn 2.8.3 from this repository's sources.
#   bash patches/make_series.sh path/to/flash_attn-2.8.3.post2.tar.gz
# (the sdist: `pip download --no-deps --no-build-isolation flash-attn==2.8.3.post2`). The patches add
# our files to upstream's tree and three lines to its setup.py; they never carry upstream code beyond
# the diff context git needs. patches/check_series.sh applies them and compares with csrc/.
set -euo pipefail
sdist=${1:?usage: make_series.sh flash_attn-2.8.3.post2.tar.gz}
here=$(cd "$(dirname "$0")/.." && pwd)
src="$here/csrc/flash_attn/src"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" --no-same-owner -C "$work"
up=$(echo "$work"/flash_attn-*)
cd "$up"
git init -q
git -c user.name=upstream -c user.email=upstream@localhost add -A
git -c user.name=upstream -c user.email=upstream@localhost commit -qm "flash-attn 2.8.3 (sdist)"
base=$(git rev-parse HEAD)
commit() { git -c user.name="flash_attn_tq" -c user.email="dev@flash-attn-tq.local" commit -q -m "$1" -m "$2"; }
# add FILES... (relative to csrc/flash_attn/src, globs allowed) and commit them
add() {
    local subject=$1 body=$2
    shift 2
    mkdir -p csrc/flash_attn/src
    for f in "$@"; do cp "$src"/$f csrc/flash_attn/src/; done
    git add csrc/flash_attn/src
    commit "$subject" "$body"
}

add "csrc: the packed K/V format, kernel parameters and device helpers" \
"tq_format.h mirrors flash_attn_tq/format.py (the Python spec, tested against it): codes of one
vector ordered in 8 groups (the rows a thread owns in an m16n8k16 fragment) and packed into 16-bit
lanes, unpacked with one lop3 a pair of values straight into tensor-core registers. tq_params.h holds
the decode and pack parameters, tq_utils.h the MMA, cp.async, ldmatrix and Walsh-Hadamard helpers.
Nothing upstream changes." \
    tq_format.h tq_params.h tq_utils.h

add "csrc: quantize-on-write kernel" \
"Eight threads a vector: the randomized Hadamard rotation in registers with one shared-memory
transpose, the code run of each thread packed without atomics, cache slots (contiguous, paged or a
vLLM-style slot mapping) resolved and range-checked in the kernel, errors ORed into one flag word.
Without a slot mapping it also keeps the append's books: the 16-bit side's copy of sinks and recent
tokens, the RoPE center's k - R(p) c, and a ring of 4-bit window codes of the chunk's last tokens.
An append's K and V run as one launch (pack_pair_kernel)
for the bit pairs of the case table, whose generated instantiations come with patch 8." \
    tq_pack_kernel.h tq_pack_launch.h

add "csrc: K/V loader policies" \
"One kernel body, two loaders: PackedKV copies 32-token tiles of codes with cp.async and expands them
into fragments (K raw, its scale and offset folded into the scores; V centered, folded into the
probabilities), Fp16KV stages 16-bit tiles for ldmatrix (our FP16 baseline, and the 16-bit side of a
packed cache). The KV storage type is the loader's template parameter, separate from Q's." \
    tq_kv_loader.h

add "csrc: query rows, the RoPE-center term, Hopper wgmma helpers" \
"tq_rows.h: causal limits, each row's recent-window boundary, the query rotation, stores. tq_rope_center.h: each score's q . R(p) c for
caches whose keys are stored less R(p) c, one more MMA chain against a cos/sin table, its
coefficients carried from tile to tile; for the prefill kernel, a per-call table of each position's
H R(p) c, added into the expanded keys. tq_wgmma.h: wgmma.mma_async descriptors and fences for the
prefill kernel's sm_90a variant." \
    tq_rows.h tq_rope_center.h tq_wgmma.h

add "csrc: split-KV decode kernel and its combine pass" \
"S^T = K Q^T and O^T += V^T P^T with the keys as the A operand (the GQA group's rows as N), an online
softmax per warp, warps then splits merged through their log-sum-exp. A packed cache's sinks and
recent window (16-bit) are one more split of the same launch, each query row reading its own last
window's keys from it, and a ring of 4-bit window codes one more (decode_ring_kernel). Variants: contiguous / paged (32+ and 16-token pages), local (window,
leftpad, softcap), RoPE center, 16-bit side, ring." \
    tq_decode_kernel.h tq_decode_launch.h

add "csrc: the prefill kernel's traits and tile steps" \
"The shared-memory layout of a 256-row CTA and its work on one 64-token tile: the packed tile expanded
once into shared memory (mma.sync fragments, or wgmma's swizzled tiles), the online softmax of a half
tile, and the MMAs of a warp or a warpgroup." \
    tq_prefill_tile.h

add "csrc: chunked-prefill kernel over packed K/V" \
"256-row CTAs (from 128 query rows a kv head) that expand each packed tile once into shared memory
for all their rows; on sm_90a builds the warpgroups multiply through wgmma. Over a cache with a
16-bit side they read the codes between the sinks and the window; tq_side_rows.h attends the side
(64-row CTAs, the chunk's rows as the MMA's M) as one more split. With the RoPE center the wgmma
variant adds the table's rows to K." \
    tq_prefill_kernel.h tq_side_rows.h

add "csrc: the kernel cases, generated once" \
"generate_instantiations.py lists the (dtype, head_dim, K bits, V bits, metadata) cases and writes a
tiny .cu file a case (decode, prefill, pack: they build in parallel), the C++ case table the ops
dispatch over (tq_cases.h) and the Python list of fused cases; tq_prefill_launch.h runs the prefill
variant the caller's plan chose (wgmma on sm_90a builds)." \
    generate_instantiations.py tq_cases.h tq_prefill_launch.h 'tq_decode_*.cu' 'tq_prefill_*.cu' 'tq_pack_*.cu'

add "csrc: register flash_attn_tq::decode_kvcache, pack_kv and build_info" \
"torch.library ops (traceable with fake implementations registered from Python, CUDA-graph safe:
num_splits is chosen on the host, tq_heuristics.h). A call describes the cache as a list of K/V
stores (a head group's codes, its RoPE center, its 16-bit side, a ring of window codes, a 16-bit
cache) with six ints each, unpacked in one place, and names the kernel its caller planned; the
binding checks that the stores and the device can run it, over the generated case table. setup.py
builds them into flash_attn_2_cuda (its module stays upstream's: FLASH_TQ_NO_PYBIND_MODULE; upstream
targets sm_90, not sm_90a, so build_info reports no wgmma variant there)." \
    tq_api.h tq_heuristics.h
cp "$here"/csrc/flash_attn/flash_api_tq.cpp csrc/flash_attn/
git add csrc/flash_attn/flash_api_tq.cpp
git commit -q --amend --no-edit

python3 - <<'PY'
import re
p = "setup.py"
s = open(p).read()
anchor = '"csrc/flash_attn/flash_api.cpp",\n'
i = s.index(anchor) + len(anchor)
indent = re.search(r'\n(\s*)"csrc/flash_attn/flash_api.cpp"', s).group(1)
s = s[:i] + indent + '"csrc/flash_attn/flash_api_tq.cpp",\n' + indent + '*sorted(glob.glob("csrc/flash_attn/src/tq_*.cu")),\n' + s[i:]
j = s.index("extra_compile_args={", i)  # the flash_attn_2_cuda extension's keyword arguments
line_start = s.rindex("\n", 0, j) + 1
s = s[:line_start] + s[line_start:j] + 'define_macros=[("FLASH_TQ_NO_PYBIND_MODULE", None)],\n' + s[line_start:]
open(p, "w").write(s)
PY
grep -q "^import glob" setup.py || sed -i '0,/^import os/s//import glob\nimport os/' setup.py
git add setup.py
git commit -q --amend --no-edit

rm -f "$here"/patches/*.patch
GIT_AUTHOR_NAME=flash_attn_tq GIT_AUTHOR_EMAIL=dev@flash-attn-tq.local GIT_COMMITTER_NAME=flash_attn_tq \
    GIT_COMMITTER_EMAIL=dev@flash-attn-tq.local git format-patch -q --cover-letter -o "$here/patches" "$base"
python3 - "$here/patches" "$here/patches/cover-letter.txt" <<'PY'
import pathlib, sys
out, text = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text()
subject, _, body = text.partition("\n\n")
cover = out / "0000-cover-letter.patch"
s = cover.read_text().replace("*** SUBJECT HERE ***", subject.strip()).replace("*** BLURB HERE ***", body.strip())
cover.write_text(s)
PY
ls "$here/patches"
