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
# the slowest tests named at the end: where the suite's time goes (kept under 30 min on 2 cores). Most tests
# wait on audio in real time and on servers starting, so ASR_TEST_WORKERS pytest-xdist workers (default 3)
# share the cores; tests marked xdist_group (tests/conftest.py) stay on one worker.
exec pytest -q -p no:cacheprovider --durations=30 -n "${ASR_TEST_WORKERS:-3}" --dist loadgroup "$@"
