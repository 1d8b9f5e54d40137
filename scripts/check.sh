#!/usr/bin/env bash
# Lint, type-check, run the whole test suite (pass pytest arguments through), then
# the torch-free core tests where torch is not installed (scripts/check_core.sh) and
# the built wheel as a user installs it (scripts/check_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
python -m pytest "$@"
bash scripts/check_core.sh
bash scripts/check_wheel.sh
