#!/usr/bin/env bash
# The torch-free core (carpool/engine: scheduler, block manager, engine driven by a
# fake runner; carpool/batching; the runtime and config) imported and tested in a
# fresh virtual environment that has neither torch nor numpy nor transformers: the
# proof that the core needs none. The torch side is carpool/workers.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3.11 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
# The core's own libraries: llguidance (grammars) and tokenizers (the detokenizer's
# DecodeStream, Rust without torch).
python -m pip install --quiet "$(grep '^pytest' requirements-dev.txt)" \
  "$(grep '^hypothesis' requirements-dev.txt)" "$(grep '^llguidance' requirements.txt)" \
  "$(grep '^tokenizers' requirements.txt)"
for heavy in torch numpy transformers; do
  if python -c "import $heavy" 2>/dev/null; then
    echo "check_core: $heavy is importable, so this is not a torch-free environment" >&2
    exit 1
  fi
done
# Every module of the core imports here (the grammar library it uses included).
PYTHONPATH="$checkout" python - <<'EOF'
import importlib
import pkgutil

import carpool.batching
import carpool.engine

for package in (carpool.engine, carpool.batching):
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
for name in ("carpool.runtime", "carpool.config", "carpool.stats", "carpool.paths", "carpool.admission"):
    importlib.import_module(name)
print("check_core: the core's modules import without torch")
EOF
PYTHONPATH="$checkout" python -m pytest -q -p no:cacheprovider \
  tests/unit/batching \
  tests/unit/engine/test_block_manager.py \
  tests/unit/engine/test_engine_core.py \
  tests/unit/engine/test_engine_process.py \
  tests/unit/engine/test_scheduler.py \
  tests/unit/engine/test_sequence.py \
  tests/unit/engine/test_sliding_window_blocks.py \
  tests/unit/engine/test_speculative.py \
  tests/unit/test_config.py \
  tests/unit/test_runtime.py
