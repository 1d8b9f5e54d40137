#!/usr/bin/env bash
# The torch-free core (scheduler, block manager, batcher, runtime, config, and the
# engine driven by a fake runner) tested in a fresh virtual environment that has
# neither torch nor numpy nor transformers: the proof that the core needs none.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3.11 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
python -m pip install --quiet "$(grep '^pytest' requirements-dev.txt)" \
  "$(grep '^hypothesis' requirements-dev.txt)"
for heavy in torch numpy transformers; do
  if python -c "import $heavy" 2>/dev/null; then
    echo "check_core: $heavy is importable, so this is not a torch-free environment" >&2
    exit 1
  fi
done
PYTHONPATH="$checkout" python -m pytest -q -p no:cacheprovider \
  tests/unit/batching \
  tests/unit/engine/test_block_manager.py \
  tests/unit/engine/test_engine_core.py \
  tests/unit/engine/test_scheduler.py \
  tests/unit/engine/test_speculative.py \
  tests/unit/test_config.py \
  tests/unit/test_runtime.py
