#!/usr/bin/env bash
# Create .venv (if missing) and install ckptd with everything it and its tests need.
# Safe to re-run; the README's two commands call it first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
echo "scripts/setup.sh: installing the pinned CPU torch and the requirements into .venv (a minute or so)" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -r requirements.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
