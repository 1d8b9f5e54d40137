#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (pass pytest arguments through).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy
python -m pytest "$@"
