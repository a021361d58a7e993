#!/usr/bin/env bash
# Set up, then run the whole test suite (real daemons, sockets and files; a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
