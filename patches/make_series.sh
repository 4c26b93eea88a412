#!/usr/bin/env bash
# Regenerate the patch series against upstream flash-attn 2.8.3 from this repository's sources.
#   bash patches/make_series.sh path/to/flash_attn-2.8.3.post2.tar.gz
# (the sdist: `pip download --no-deps --no-build-isolation flash-attn==2.8.3.post2`). The patches add
# our files to upstream's tree and three lines to its setup.py; they never carry upstream code beyond
# the diff context git needs.
set -euo pipefail
sdist=${1:?usage: make_series.sh flash_attn-2.8.3.post2.tar.gz}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" --no-same-owner -C "$work"
up=$(echo "$work"/flash_attn-*)
cd "$up"
git init -q
git -c user.name=upstream -c user.email=upstream@localhost add -A
git -c user.name=upstream -c user.email=upstream@localhost commit -qm "flash-attn 2.8.3 (sdist)"
commit() { git -c user.name="flash_attn_tq" -c user.email="dev@flash-attn-tq.local" commit -q -m "$1" -m "$2"; }

mkdir -p csrc/flash_attn/src
cp "$here"/csrc/flash_attn/src/tq_*.h "$here"/csrc/flash_attn/src/tq_*.cu "$here"/csrc/flash_attn/src/generate_instantiations.py csrc/flash_attn/src/
git add csrc/flash_attn/src
commit "csrc: fused split-KV decode and chunked prefill over a 3-bit packed KV cache" \
"Adds the packed K/V code format (tq_format.h), two K/V loader policies sharing one kernel body: a
packed 3/4-bit loader that stages tiles with cp.async and expands them straight into m16n8k16
fragments, and an fp16/bf16 loader (cp.async + ldmatrix) (tq_kv_loader.h); the split-KV decode kernel
with its combine pass (tq_decode_kernel.h); a prefill kernel for many query rows that expands each
packed tile once into shared memory for 256 rows (tq_prefill_kernel.h; on sm_90a builds a variant
whose warpgroups multiply through wgmma, tq_wgmma.h); the query/output
row helpers both share (tq_rows.h); the decode kernel's variant that adds each score's RoPE-centre
term q . R(p) c for caches whose keys are stored less R(p) c (tq_rope_centre.h); quantize-on-write with in-kernel slot resolution and checks
(tq_pack_kernel.h), launch templates and one instantiation file per (dtype, head dim, loader).
Nothing upstream changes."

cp "$here"/csrc/flash_attn/flash_api_tq.cpp csrc/flash_attn/
git add csrc/flash_attn/flash_api_tq.cpp
commit "csrc: register flash_attn_tq::decode_kvcache, decode_kv16 and pack_kv" \
"torch.library ops (traceable with fake implementations registered from Python, CUDA-graph safe:
num_splits is chosen on the host). Built inside flash_attn_2_cuda with FLASH_TQ_NO_PYBIND_MODULE."

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
commit "setup.py: build the 3-bit decode kernels into flash_attn_2_cuda" \
"Adds flash_api_tq.cpp and the tq_*.cu instantiations to the extension's sources; the module
itself stays upstream's (FLASH_TQ_NO_PYBIND_MODULE). Upstream targets sm_90, not sm_90a, so this
build runs the mma.sync prefill variant on Hopper (the wgmma one needs FLASH_TQ_SM90A and sm_90a)."

rm -f "$here"/patches/*.patch
git format-patch -q -o "$here/patches" HEAD~3
ls "$here/patches"
