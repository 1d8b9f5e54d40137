#!/usr/bin/env bash
# Triton's own python_backend examples, laid out as their READMEs say, served by carpool
# and driven by their own clients, unchanged (HTTP 8000, gRPC 8001, metrics 8002, as
# the clients expect). Needs free ports, and the network unless given a checkout.
#   bash scripts/triton_examples.sh [a python_backend checkout | a git ref (main)]
# Not run by CI: the examples are NVIDIA's code and stay out of this repository.
set -euo pipefail
source="${1:-main}"
work="$(mktemp -d)"
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
if [[ -d "$source" ]]; then
  mkdir "$work/python_backend"
  cp -r "$source/examples" "$work/python_backend/"
  ref="$(git -C "$source" rev-parse --short HEAD 2>/dev/null || echo "$source")"
else
  git clone --quiet --depth 1 --branch "$source" \
    https://github.com/triton-inference-server/python_backend "$work/python_backend"
  ref="$source $(git -C "$work/python_backend" rev-parse --short HEAD)"
fi
cd "$work/python_backend"
lay_out() {  # model name, its model.py, its config.pbtxt (none: auto-completed)
  mkdir -p "models/$1/1"
  cp "examples/$2" "models/$1/1/model.py"
  if [[ -n "${3:-}" ]]; then cp "examples/$3" "models/$1/config.pbtxt"; fi
}
lay_out add_sub add_sub/model.py add_sub/config.pbtxt
lay_out pytorch pytorch/model.py pytorch/config.pbtxt
lay_out nobatch_auto_complete auto_complete/nobatch_model.py
lay_out batch_auto_complete auto_complete/batch_model.py
lay_out bls_sync bls/sync_model.py bls/sync_config.pbtxt
lay_out bls_async bls/async_model.py bls/async_config.pbtxt
lay_out custom_metrics custom_metrics/model.py custom_metrics/config.pbtxt
lay_out repeat_int32 decoupled/repeat_model.py decoupled/repeat_config.pbtxt
lay_out square_int32 decoupled/square_model.py decoupled/square_config.pbtxt
lay_out bls_decoupled_sync bls_decoupled/sync_model.py bls_decoupled/sync_config.pbtxt
lay_out bls_decoupled_async bls_decoupled/async_model.py bls_decoupled/async_config.pbtxt
python -m carpool.cli serve --port 8000 --grpc-port 8001 --metrics-port 8002 \
  --model-repository models >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do
  grep -q "carpool ready on" "$work/server.log" && break
  kill -0 "$server" 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 1
done
passed=0
failed=0
for client in add_sub/client.py pytorch/client.py auto_complete/client.py \
  bls/sync_client.py bls/async_client.py custom_metrics/client.py \
  decoupled/repeat_client.py decoupled/square_client.py \
  bls_decoupled/sync_client.py bls_decoupled/async_client.py; do
  if (cd "examples/$(dirname "$client")" && python "$(basename "$client")" >"$work/out" 2>&1) \
    && grep -q "PASS" "$work/out"; then
    echo "PASS  $client"
    passed=$((passed + 1))
  else
    echo "FAIL  $client"
    tail -5 "$work/out"
    failed=$((failed + 1))
  fi
done
echo "$passed passed, $failed failed (python_backend $ref)"
[[ "$failed" == 0 ]]
