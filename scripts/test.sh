#!/usr/bin/env bash
# Lint and run the whole test suite (slow end-to-end tests included) with tool state kept inside the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PREFECT_HOME="$PWD/.state/test-prefect" TORCH_EXTENSIONS_DIR="$PWD/.state/torch_extensions"
export MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1 HF_HUB_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
ruff check .
ruff format --check .
# Two workers (most tests are tiny models, bound by Python overhead on one core each); a module stays on one worker,
# so its module-scoped fixtures are built once. Modules go out in collection order, the longest first
# (tests/conftest.py LONGEST_FIRST), not xdist's most-tests-first. CITER_TEST_WORKERS=0 runs everything in this process.
python -m pytest -n "${CITER_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
