#!/usr/bin/env bash
# Set up, then run the demo: train, checkpoint through a daemon, SIGKILL, resume, compare.
# The set-up installs only what the demo needs (scripts/setup.sh); VENV=path as there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec "${VENV:-.venv}/bin/python" examples/train_resume.py "$@"
