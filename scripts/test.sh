#!/usr/bin/env bash
# Set up, then lint, type check and run the whole test suite (real daemons, torchrun, SeaweedFS,
# the frameworks). Arguments go to pytest: -m "not slow" skips the multi-process jobs. The suite
# runs three test files at a time (pytest-xdist; a file's tests stay together, so its module-scoped
# fixtures run once; the longest files go first, tests/conftest.py): CKPTD_TEST_WORKERS=N for N at
# a time, 0 for one process. Three on 2 cores, because many tests wait on fsync, sockets and
# subprocesses: pytest's part took 337 s with two and 276 s with three here (258 s with four), and
# 4 to 8 minutes on the 2-core machines this project has run on. The tests' Python
# subprocesses (torchrun and its workers, the frameworks' scripts, the daemon) fork from servers
# that imported torch, or the daemon's modules, once: tests/forkserver.py; CKPTD_TEST_FORK=0 execs
# a fresh interpreter for each instead (the suite then takes 17 to 30 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
py=${VENV:-.venv}/bin/python
# tests/test_systemd.py checks the shipped units with systemd's own tools and runs
# them under a real systemd: install Debian's systemd where it is missing (CI runs
# as root on a fresh machine). Where it is present this does nothing.
if ! command -v systemd-analyze >/dev/null || [ ! -x /lib/systemd/systemd ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: installing Debian's systemd (for tests/test_systemd.py)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    else
        echo "scripts/test.sh: tests/test_systemd.py needs systemd (systemd-analyze, /lib/systemd/systemd); install it" >&2
    fi
fi
# tests/test_hdf5.py lists HDF5 files with h5dump (Debian's hdf5-tools). Where it is
# present this does nothing.
if ! command -v h5dump >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: installing Debian's hdf5-tools (h5dump, for tests/test_hdf5.py)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hdf5-tools >/dev/null
    else
        echo "scripts/test.sh: tests/test_hdf5.py needs h5dump; install Debian's hdf5-tools" >&2
    fi
fi
echo "scripts/test.sh: lint (ruff) and type check (mypy ckptd; settings in pyproject.toml)" >&2
"$py" -m ruff check --quiet ckptd tests benchmarks examples
"$py" -m mypy
echo "scripts/test.sh: running the test suite" >&2
exec "$py" -m pytest -q -n "${CKPTD_TEST_WORKERS:-3}" --dist loadfile "$@"
