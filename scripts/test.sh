#!/usr/bin/env bash
# The whole test suite: lint, format check, types, then every test (real weights, real
# servers on loopback, real Prometheus). `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
exec pytest -q -p no:cacheprovider "$@"
