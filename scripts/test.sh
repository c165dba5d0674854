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
# the import contracts in pyproject.toml [tool.importlinter]: the service's layers, doors, engine API, clients
lint-imports
# the slowest tests named at the end: where the suite's time goes. ASR_TEST_WORKERS=N: N pytest-xdist workers
# (default 0: one process; on 2 cores the real-time interim and turn tests starve with more, README).
exec pytest -q -p no:cacheprovider --durations=30 -n "${ASR_TEST_WORKERS:-0}" --dist loadgroup "$@"
