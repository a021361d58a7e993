"""The tests' fork server (tests/forkserver.py): a Python subprocess it forks behaves as an
exec'd one would, as far as the tests can tell: argv, environment, working directory,
sys.path, pipes, stdin, exit statuses, signals, sessions, atexit, and the Python it in
turn starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import forkserver

pytestmark = pytest.mark.skipif(not os.environ.get(forkserver.ENV), reason="CKPTD_TEST_FORK=0: no fork server")

PROBE = textwrap.dedent("""
    import atexit, json, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "var": os.environ.get("PROBE_VAR"),
                      "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "torch": "torch" in sys.modules,
                      "in": sys.stdin.read(), "main": __name__, "extra": [p for p in sys.path if p.endswith("extra")]}))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
""")


def _probe(out: str) -> dict:
    import json

    return json.loads(out.splitlines()[0])


def test_a_script_sees_its_own_argv_env_cwd_path_and_stdin(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "extra").mkdir()
    env = dict(os.environ, PROBE_VAR="v1", PROBE_EXIT="3", PYTHONPATH=str(tmp_path / "extra"))
    proc = subprocess.run([sys.executable, "-u", str(script), "a", "b"], input="from stdin", env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert isinstance(proc, subprocess.CompletedProcess) and proc.returncode == 3, proc.stderr
    got = _probe(proc.stdout)
    assert got["argv"] == [str(script), "a", "b"] and got["cwd"] == str(tmp_path) and got["path0"] == str(tmp_path)
    assert got["var"] == "v1" and got["in"] == "from stdin" and got["main"] == "__main__"
    assert got["torch"] and got["pid"] != os.getpid() and got["ppid"] == os.getpid()  # forked by the server
    assert got["extra"] == [str(tmp_path / "extra")]
    assert proc.stdout.splitlines()[-1] == "atexit ran"


def test_c_and_m_and_exceptions_and_signals(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv); raise ValueError('boom')", "x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "['-c', 'x']\n" and "ValueError: boom" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "json.tool"], input='{"a": 1}', capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout == '{\n    "a": 1\n}\n'
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "up\n"
    assert child.poll() is None and os.getsid(child.pid) == child.pid
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.stdout.close()


def test_a_child_starts_python_through_the_server_and_the_daemon_has_no_torch(daemon) -> None:
    nested = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import sys; "
              "print(\"torch\" in sys.modules)'], stdout=subprocess.PIPE, text=True); "
              "print(type(p).__name__, p.communicate()[0].strip(), p.returncode)")
    proc = subprocess.run([sys.executable, "-c", nested], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["ForkedPopen", "True", "0"], proc.stderr
    assert daemon.proc._argv is not None and "libtorch" not in Path(f"/proc/{daemon.pid}/maps").read_text()
    assert forkserver.preload_for([sys.executable, "-m", "ckptd", "serve"], {}) == forkserver.DAEMON
    assert forkserver.routable([sys.executable, "-X", "dev", "x.py"], {}) is None
    assert forkserver.routable(["/bin/true"], {}) is None
    assert forkserver.routable([sys.executable, "x.py"], {"preexec_fn": os.getpid}) is None
    assert forkserver.routable([sys.executable, "-m", "ckptd", "status"], {}) is not None


def test_a_child_can_ask_for_a_server_that_imported_more(tmp_path: Path) -> None:
    show = "import sys; print('json.tool' in sys.modules)"
    env = dict(os.environ, **{forkserver.PRELOAD: "json.tool"})
    assert subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True,
                          timeout=120).stdout == "True\n"
    assert subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=60).stdout == "False\n"
