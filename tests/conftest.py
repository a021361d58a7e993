"""Shared fixtures: a real daemon subprocess on a real socket, real files in a temp root."""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Iterator

import pytest

import forkserver
from ports import free_port  # noqa: F401  (the tests import it from here)
from ckptd import Producer
from ckptd.transport import curve
from ckptd.daemon.launcher import ServeProcess

REPO = Path(__file__).resolve().parent.parent


def reuse_bytecode() -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (and no ``PYTHONPYCACHEPREFIX``), compiled modules go
    to ~/.cache/ckptd-tests/pycache instead, for this process and every one the tests start.
    scripts/setup.sh installs with ``--no-compile``, so without this every fresh interpreter
    and every fork server compiled torch from source again: ``import torch`` took 5 CPU-s
    instead of 2.6, and tests/test_replicas_training.py 30 CPU-s instead of 14. Nothing is
    written beside the sources, which is what the variable is for."""
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(cache, "ckptd-tests", "pycache")
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


reuse_bytecode()


# The files that take longest (the sum of their tests' times in ``pytest -n 2 --junitxml``
# of the whole suite, 2 cores), most first; re-measure when the suite changes. Other files
# follow, those with more multi-process jobs (``slow``) first.
LONGEST = ("test_cluster.py", "test_peer.py", "test_peer_fuzz.py", "test_peer_reader.py", "test_systemd.py",
           "test_writer_death.py", "test_model.py", "test_peer_send.py", "test_fastpaths.py", "test_read_once.py",
           "test_cluster_retention.py", "test_remote_faults.py", "test_fuzz.py", "test_newcomer.py",
           "test_reuse.py", "test_faults.py", "test_crash.py", "test_tiers.py", "test_advise.py",
           "test_transformers.py", "test_index.py", "test_plan.py", "test_hdf5.py", "test_preempt.py",
           "test_liveness.py", "test_transport.py", "test_lightning.py", "test_docs.py", "test_retention.py",
           "test_sharded_training.py", "test_sealed.py", "test_hostile_files.py", "test_notify.py",
           "test_example_ddp.py", "test_dcp.py", "test_multinode.py", "test_optim_resume.py", "test_accelerate.py")


FORKSERVER = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    """Each process that runs tests starts its fork server (tests/forkserver.py): its Python
    subprocesses, torchrun's workers among them, start without importing torch again.
    ``CKPTD_TEST_FORK=0``: every subprocess execs a fresh interpreter, as before."""
    runs_tests = os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None)
    if runs_tests and os.environ.get("CKPTD_TEST_FORK", "1") != "0" and not config.option.collectonly:
        folder = Path(tempfile.mkdtemp(prefix="ckfs", dir="/tmp"))  # a socket path holds at most 107 bytes
        config.stash[FORKSERVER] = (forkserver.ensure_server(folder), folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    server, folder = config.stash.get(FORKSERVER, (None, None))
    if server is not None:
        server.terminate()
        server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first. pytest-xdist hands out whole files in collection order
    (scripts/test.sh: ``--dist loadfile --no-loadscope-reorder``; without the second, it
    hands out the files with most tests first), so the longest start at once and the last
    file to finish is a short one rather than a one-minute torchrun job started at the end."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        return (LONGEST.index(name) if name in LONGEST else len(LONGEST), -slow[item.path])

    items.sort(key=rank)  # stable: each file's own order stays


# Tools some tests run, each with the Debian package that has it (scripts/test.sh installs
# them as root). ``@pytest.mark.needs(tool, ...)`` on such a test: where one is missing it is
# skipped, naming the tool and how to install it; under CI (CI=true) it runs and fails, as a
# missing tool there is the machine's fault, never a reason to skip.
TOOLS = {"systemd-analyze": "systemd", "systemd-sysusers": "systemd", "/lib/systemd/systemd": "systemd",
         "h5dump": "hdf5-tools"}


def missing_tools(tools: tuple[str, ...]) -> list[str]:
    return [t for t in tools if not (os.access(t, os.X_OK) if t.startswith("/") else shutil.which(t))]


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("CI") == "true":
        return
    for mark in item.iter_markers("needs"):
        missing = missing_tools(mark.args)
        if missing:
            packages = " ".join(sorted({TOOLS[t] for t in missing}))
            pytest.skip(f"needs {', '.join(missing)}, not installed here: install it with "
                        f"`sudo apt-get install {packages}` (scripts/test.sh does, as root); CI=true runs this test")


def torchrun(job: Path, daemon: "Daemon", nproc: int, mode: str, out: Path, *, run: str | None = None,
             expect_ok: bool = True, timeout: float = 300) -> str:
    """``python -m torch.distributed.run`` of ``job MODE OUT`` on ``nproc`` ranks (gloo, one
    intra-op thread each) against ``daemon``; its stdout and stderr. ``expect_ok``: a
    non-zero exit fails the test with the output's tail."""
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint, CKPTD_ROOT=str(daemon.root),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if run is not None:
        env["CKPTD_RUN"] = run
    env.pop("CKPTD_CONFIG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           "--max-restarts", "0", "--monitor-interval", "0.2", str(job), mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, f"{mode} on {nproc} ranks failed:\n{text[-8000:]}"
    return text


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``ckptd ARGS`` in this process (``ckptd.cli.main``), as a CompletedProcess: its
    exit status, stdout and stderr, with the logging a fresh process would set up (the
    CLI's warnings go to its stderr). ``env``: variables set for the call. A process
    costs ~2 s of imports on a loaded machine; a few tests (``ckptd serve``, a pipe
    closed early, tests/test_newcomer.py) still run the real command."""
    from ckptd.cli import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []  # as in a fresh process, so that the CLI's basicConfig applies
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse: --help, usage errors
                status = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.handlers, root.level = handlers, level
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["ckptd", *args], status, out.getvalue(), err.getvalue())


class Daemon(ServeProcess):
    """A ``ckptd serve`` subprocess with its own config, root (``base/ckpt``) and socket,
    started by the one launcher the tests and benchmarks share (ckptd/daemon/launcher.py)."""

    def __init__(self, base: Path, tables: dict[str, dict[str, object]] | None = None, **daemon_keys: object) -> None:
        self.base = base
        # nice 0, not the default 19: a test waits on its daemon, and at 19 a daemon beside
        # three busy test processes on 2 cores got 1.5% of a CPU (a 256 KiB commit took 30 s)
        keys = {"chunk_size": "4MiB", "log_level": "debug", "nice": 0, **daemon_keys}
        super().__init__(base, {"daemon": keys, **(tables or {})})  # tables: e.g. {"index": {"observer": "polling"}}

    def start(self, wait: bool = True, timeout: float = 30.0) -> "Daemon":  # type: ignore[override]
        super().start(wait=wait, timeout=timeout)
        return self

    def kill(self) -> None:
        """kill -9, as a crash would; its socket file goes too."""
        super().kill()
        (self.sock_dir / "d.sock").unlink(missing_ok=True)

    def producer(self, run: str = "t", **options: object) -> Producer:
        options.setdefault("staging_size", "64MiB")
        options.setdefault("timeout", 5)
        return Producer(self.endpoint, run, **options)

    def cleanup(self) -> None:
        """At teardown: kill -9 (what a test left running need not drain), then close."""
        if self.alive():
            super().kill()
        self.close()


DAEMONS = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    """A failed test's report ends with the log of each daemon it started: what the
    daemon did (at debug level) is what tells a slow commit from a lost one in CI."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        for i, d in enumerate(item.stash.get(DAEMONS, [])):
            report.sections.append((f"daemon {i} log ({d.log}), last 80 lines", d.log_tail(80)))
    return report


@pytest.fixture
def make_daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """``make_daemon(**daemon_keys)`` -> a started Daemon; all are killed at teardown
    (and a failed test's report shows their logs)."""
    made: list[Daemon] = []
    request.node.stash[DAEMONS] = made

    def make(start: bool = True, tables: dict | None = None, **keys: object) -> Daemon:
        d = Daemon(tmp_path / f"d{len(made)}", tables, **keys)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


@contextlib.contextmanager
def module_daemon(factory: pytest.TempPathFactory, **daemon_keys: object) -> Iterator[Daemon]:
    """A started Daemon for the tests of one module that each write runs of their own names
    and neither stop, kill nor reconfigure it: one start for the file instead of one per
    test. A module-scoped fixture yields it through ``shared(request, d)``."""
    d = Daemon(factory.mktemp("shared") / "d", **daemon_keys).start()
    try:
        yield d
    finally:
        d.cleanup()


def shared(request: pytest.FixtureRequest, d: Daemon) -> Daemon:
    """``d`` for this test: alive (an earlier test must not have stopped it), and its log in
    the report should this test fail."""
    assert d.alive(), f"the module's shared daemon is gone (an earlier test stopped it):\n{d.log_tail(40)}"
    request.node.stash[DAEMONS] = [d]
    return d


@pytest.fixture(scope="module")
def _module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with module_daemon(tmp_path_factory) as d:
        yield d


@pytest.fixture
def shared_daemon(_module_daemon: Daemon, request: pytest.FixtureRequest) -> Daemon:
    """The module's one daemon (``module_daemon`` with the default keys), through ``shared``."""
    return shared(request, _module_daemon)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never read the developer's own config or environment."""
    for var in ("CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    # the built-in defaults, whatever ~/.config/ckptd or /etc/ckptd hold on this machine
    monkeypatch.setenv("CKPTD_CONFIG", "none")
    monkeypatch.chdir(tmp_path)


# -- tcp:// with CurveZMQ (docs/security.md) ---------------------------------------------------
@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A daemon key pair, a producer ('alice') whose public key the daemon admits, and a
    stranger ('mallory') whose key pair is as valid but not admitted."""
    k = tmp_path / "keys"
    server_public, server_secret = curve.keygen("daemon", k)
    alice_public, alice_secret = curve.keygen("alice", k)
    _, mallory_secret = curve.keygen("mallory", k)
    clients = k / "clients"
    clients.mkdir()
    os.link(alice_public, clients / "alice.key")
    return {"server": server_public, "server_secret": server_secret, "clients": clients,
            "alice": alice_secret, "mallory": mallory_secret}


def start_tcp(make_daemon, keys: dict[str, Path]):
    """A real `ckptd serve` on 127.0.0.1 with CurveZMQ; returns (daemon, endpoint)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = make_daemon(start=False, endpoint=endpoint, curve_secret_key=str(keys["server_secret"]),
                    curve_clients=str(keys["clients"]))
    d.start()  # READY=1 once it listens (ckptd/daemon/launcher.py)
    return d, endpoint


# -- the remote tier: a real S3 server (SeaweedFS) on 127.0.0.1 ------------------------------
@pytest.fixture(scope="session")
def _seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One SeaweedFS per test process, started when a test first asks for ``s3``: a
    start and a stop cost ~4 s, and each test gets an empty bucket of its own anyway."""
    from seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def s3(_seaweed, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A started SeaweedFS S3 server with an empty bucket ``ckptd`` and the standard AWS
    variables pointing at it (daemons started by the test inherit them). A test may stop,
    kill and start it (same ports, same data folder); the next test finds it started and
    the bucket emptied."""
    from seaweed import empty_bucket, make_bucket

    server = _seaweed
    if server.proc is None or server.proc.poll() is not None:
        server.stop()  # what a kill left: its socket files
        server.start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    make_bucket(server, "ckptd")
    empty_bucket(server, "ckptd")
    yield server
