#!/usr/bin/env bash
# Set up, then run the demo: train, checkpoint through a daemon, SIGKILL, resume, compare.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_resume.py "$@"
