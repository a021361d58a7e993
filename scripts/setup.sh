#!/usr/bin/env bash
# Create a virtual environment (if missing) and install what one job needs; safe to re-run.
#   bash scripts/setup.sh          the demo's: torch, ckptd and its runtime dependencies
#   bash scripts/setup.sh test     the test command's: also the frameworks, the remote tier,
#                                  pytest, lint and type check (requirements-test.txt)
#   bash scripts/setup.sh bench    the benchmarks': also matplotlib and s3fs
# VENV=path picks the environment (default .venv), PYTHON=python3.x the interpreter that makes
# it, TORCH=spec the torch to install (default: the version in constraints.txt, CPU build
# unless nvidia-smi finds a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-demo}
case $job in
    demo) req=requirements.txt; what="ckptd and its runtime dependencies" ;;
    test) req=requirements-test.txt; what="ckptd, the frameworks, the remote tier and the test tools" ;;
    bench) req=benchmarks/requirements.txt; what="ckptd, the test tools and the benchmarks' plotting and S3 clients" ;;
    *) echo "scripts/setup.sh: unknown job '$job'; use demo, test or bench" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
py=$VENV/bin/python
pip=("$py" -m pip install --quiet --disable-pip-version-check --prefer-binary --no-compile)
version=$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' constraints.txt)

# torch first, alone, as an exact build. Installed together with everything else, pip's resolver
# is free to take any file that satisfies torch==VERSION: where a backtracking search revisits
# torch it took PyPI's CUDA build (2.5 GB with its nvidia-* wheels) over a local +cpu wheel.
# Installed first, torch is kept by every later install (constraints.txt pins it).
have=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ -n "${TORCH:-}" ]; then
    echo "scripts/setup.sh: installing $TORCH into $VENV" >&2
    "${pip[@]}" "$TORCH"
elif [ "${have%%+*}" != "$version" ]; then
    if command -v nvidia-smi >/dev/null; then
        echo "scripts/setup.sh: installing torch $version (CUDA build: nvidia-smi found a GPU) into $VENV" >&2
        "${pip[@]}" "torch==$version"
    else
        echo "scripts/setup.sh: installing torch $version (CPU build) into $VENV" >&2
        # a +cpu wheel where pip already finds one (a --find-links folder, a mirror); else
        # PyTorch's own CPU index; else (macOS: PyPI's build is the CPU one) plain PyPI
        "${pip[@]}" "torch==$version+cpu" 2>/dev/null \
            || "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==$version+cpu" 2>/dev/null \
            || "${pip[@]}" "torch==$version"
    fi
fi
echo "scripts/setup.sh: installing $what into $VENV ($req)" >&2
"${pip[@]}" -c constraints.txt -r "$req" -e .
