#!/usr/bin/env bash
# Set up, then lint, type check and run the whole test suite (real daemons, torchrun, SeaweedFS,
# the frameworks). Arguments go to pytest: -m "not slow" skips the multi-process jobs. The suite
# runs three test files at a time (pytest-xdist; a file's tests stay together, so its module-scoped
# fixtures run once; the longest files go first, in tests/conftest.py's order, which
# --no-loadscope-reorder keeps: by default xdist hands out the files with most tests first, which
# left the multi-process files, of few tests each, to the end): CKPTD_TEST_WORKERS=N for N at
# a time, 0 for one process. Three on 2 cores, because many tests wait on fsync, sockets and
# subprocesses: the suite then takes about 6½ minutes on the 2-core machines this project runs on.
# The tests' Python subprocesses (torchrun and its workers, the frameworks' scripts, the daemon)
# fork from servers that imported torch, or the daemon's modules, once: tests/forkserver.py;
# CKPTD_TEST_FORK=0 execs a fresh interpreter for each instead (the suite then takes 17 to 30
# minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
# Tools some tests run, from Debian packages: tests/test_systemd.py checks the shipped units
# with systemd's own tools and runs them under a real systemd (package systemd);
# tests/test_hdf5.py lists HDF5 files with h5dump (hdf5-tools). As root with apt-get (CI runs
# as root on a fresh machine) they are installed where missing; otherwise this says so first,
# and the tests that need a missing tool are skipped, naming it (tests/conftest.py) -- except
# under CI=true, where they run and fail: a CI machine must have them.
missing=()
{ command -v systemd-analyze && command -v systemd-sysusers && [ -x /lib/systemd/systemd ]; } >/dev/null \
    || missing+=(systemd)
command -v h5dump >/dev/null || missing+=(hdf5-tools)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: installing Debian's ${missing[*]} (for tests/test_systemd.py, tests/test_hdf5.py)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    elif [ "${CI:-}" = true ]; then
        echo "scripts/test.sh: cannot install ${missing[*]} (not root, or no apt-get), and CI=true: the tests" \
             "that need them will fail; install them first: sudo apt-get install ${missing[*]}" >&2
    else
        echo "scripts/test.sh: cannot install ${missing[*]} (not root, or no apt-get): the tests that need them" \
             "are skipped, each naming the tool. To run them: sudo apt-get install ${missing[*]}" >&2
    fi
fi
bash scripts/setup.sh test
py=${VENV:-.venv}/bin/python
echo "scripts/test.sh: lint (ruff) and type check (mypy ckptd; settings in pyproject.toml)" >&2
"$py" -m ruff check --quiet ckptd tests benchmarks examples
"$py" -m mypy
echo "scripts/test.sh: running the test suite" >&2
exec "$py" -m pytest -q -n "${CKPTD_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
