"""Python subprocesses of the tests, forked from processes that imported torch once.

On a 2-core machine ``import torch`` costs 7 to 8 s of CPU, and the suite starts a few
hundred Python processes that import it: torchrun, its workers, the framework scripts, the
crash and resume jobs; most of the suite's time went there. Here each pytest process
starts a *fork server*: a single-threaded, bare Python that forks, per set of modules on
first use, a server that imported them (torch, and what ``$TESTS_FORKSERVER_PRELOAD``
names, such as lightning; for the daemon, ``-m ckptd serve``, its own modules and not
torch), which then forks a child per request. ``ForkedPopen``, installed as ``subprocess.Popen`` in the
tests and in every forked child (so torchrun's own worker launches and Lightning's
re-launch of its script come here too), hands ``[sys.executable, ...]`` commands to
them; anything else and any Popen option a fork cannot honour run as before, and an
``env`` without ``$TESTS_FORKSERVER`` asks for a fresh interpreter.

A forked child is a real process with its own pid: signals, kill -9, exit statuses,
process groups, pipes and files behave as for an exec'd one. What differs: the modules
its server imported are already there and read the environment when that server
started (the child's own environment is in ``os.environ`` from its first line on;
``OMP_NUM_THREADS`` is applied); the child is not the requester's child, so its exit
status arrives over a socket instead of ``waitpid`` (``os.getppid()`` in the child names
the requester, as it would); it ends as Python's exit does (threads joined, atexit
handlers, stdio flushed) but without tearing down every module. ``CKPTD_TEST_FORK=0`` (tests/conftest.py) turns it all off.

    python tests/forkserver.py SOCKET      # the first server (started by ``ensure_server``)
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ENV = "TESTS_FORKSERVER"  # the server's socket; where unset, Popen execs as usual
PRELOAD = "TESTS_FORKSERVER_PRELOAD"  # in a child's environment: modules its server imports first (a,b)
_RealPopen = subprocess.Popen
_FLAGS = {"-u"}  # interpreter flags a forked child can honour


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError("fork server connection closed")
        data += part
    return data


def _recv_json(conn: socket.socket) -> Any:
    (n,) = struct.unpack("!I", _recv_exact(conn, 4))
    return json.loads(_recv_exact(conn, n))


def routable(args: Any, kwargs: dict[str, Any]) -> list[str] | None:
    """``args`` as a list where the fork server can start it, else None. An ``env`` without
    ``$TESTS_FORKSERVER`` asks for a fresh interpreter."""
    env = kwargs.get("env")
    if not os.environ.get(ENV) or env is not None and not env.get(ENV) or kwargs.get("shell") or kwargs.get("executable"):
        return None
    if isinstance(args, (str, bytes, os.PathLike)) or not args:
        return None
    argv = [os.fspath(a) for a in args]
    if any(isinstance(a, bytes) for a in argv) or argv[0] != sys.executable:
        return None
    rest = argv[1:]
    while rest and rest[0] in _FLAGS:
        rest = rest[1:]
    if not rest or rest[0].startswith("-") and rest[0] not in ("-m", "-c") or rest[0] in ("-m", "-c") and len(rest) < 2:
        return None  # other interpreter options (-X, -I, ...) need a fresh interpreter
    if kwargs.get("preexec_fn") is not None or kwargs.get("pass_fds") or kwargs.get("close_fds") is False:
        return None
    if any(kwargs.get(k) is not None for k in ("user", "group", "extra_groups", "process_group")):
        return None
    if kwargs.get("umask", -1) != -1 or kwargs.get("restore_signals") is False:
        return None
    cwd = kwargs.get("cwd")
    if cwd is not None and not os.path.isdir(cwd):
        return None  # Popen raises its own error
    return argv


class ForkedPopen(_RealPopen):
    """``subprocess.Popen``, but a ``[sys.executable, ...]`` command is forked by the fork
    server (module docstring); everything else is Popen's own."""

    def __init__(self, args: Any, *a: Any, **kwargs: Any) -> None:
        if a:  # positional options (bufsize, executable, ...): as Popen has them
            names = ("bufsize", "executable", "stdin", "stdout", "stderr", "preexec_fn", "close_fds", "shell", "cwd",
                     "env")
            kwargs.update(zip(names, a))
        self._argv = routable(args, kwargs)
        self._conn: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # type: ignore[override]
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, *rest: Any) -> None:
        if self._argv is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, *rest)
        start_new_session = rest[-2]
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        request = {"argv": self._argv, "env": dict(os.environ if env is None else env), "ppid": os.getpid(),
                   "cwd": os.path.abspath(cwd if cwd is not None else "."), "new_session": bool(start_new_session)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(_server_for(preload_for(self._argv, request["env"]), request["env"]))
            conn.sendmsg([_frame(json.dumps(request).encode())],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            reply = _recv_json(conn)
        except BaseException:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._conn = conn
        self.pid = reply["pid"]
        self._child_created = True

    def _status(self, block: bool) -> int | None:
        """The child's wait status once the server saw it exit, else None."""
        assert self._conn is not None
        if not block and not select.select([self._conn], [], [], 0)[0]:
            return None
        try:
            status = int(_recv_json(self._conn)["status"])
        except (EOFError, OSError, ValueError):  # the server is gone: the child's status is lost with it
            status = 0x7F00  # exit status 127
        self._conn.close()
        self._conn = None
        return status

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:  # type: ignore[override]
        if self._argv is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and self._conn is not None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:  # type: ignore[override]
        if self._argv is None:
            return super()._try_wait(wait_flags)
        if self._conn is None:
            return (self.pid, 0) if self.returncode is None else (0, 0)
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


# What every child gets imported: torch, and what torch.use_deterministic_algorithms()
# imports on its first call (torch._inductor.config, with dynamo: 9 s more of CPU here).
BASE = ("torch", "torch._inductor.config")


# What ``python -m ckptd serve`` imports (and not torch): the daemon under test is forked
# from a server that imported its modules, so they must read nothing of the process
# (its environment, an id) at import: ckptd reads such things as the daemon starts.
DAEMON = ["ckptd.cli", "ckptd.daemon.server", "ckptd.tiers.peer", "ckptd.peer.port", "ckptd.peer.copier"]


def preload_for(argv: list[str], env: dict[str, str]) -> list[str]:
    """The modules the server forking ``argv`` with ``env`` has imported: the daemon's
    for ``-m ckptd serve``; else ``BASE`` and what ``$TESTS_FORKSERVER_PRELOAD`` names."""
    if [a for a in argv[1:] if a not in _FLAGS][:3] == ["-m", "ckptd", "serve"]:
        return DAEMON
    return [*BASE, *sorted(m for m in env.get(PRELOAD, "").split(",") if m and m not in BASE)]


def _server_for(modules: list[str], env: dict[str, str], timeout: float = 300.0) -> str:
    """The socket of the server whose children have ``modules`` imported, forked on
    first use by the first server (a bare Python), or by the one with ``BASE`` where
    ``modules`` adds to it (lightning needs torch imported once, not again); it imports
    them in ``env`` (what they read of the environment at import, such as
    ``HF_HUB_OFFLINE``, is the first requester's)."""
    main = os.environ[ENV]
    path = f"{main}.{zlib.crc32(','.join(modules).encode()):08x}"  # (a socket path holds 107 bytes)
    if not os.path.exists(path):
        base = list(BASE)
        parent = _server_for(base, env) if modules[:len(base)] == base and modules != base else main
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(parent)
            conn.sendall(_frame(json.dumps({"serve": path, "preload": modules, "env": env}).encode()))
            _recv_json(conn)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tests' fork server for {modules} did not start in {timeout:g} s")
            time.sleep(0.05)
    return path


def install() -> None:
    """``subprocess.Popen`` is ``ForkedPopen`` in this process from now on."""
    subprocess.Popen = ForkedPopen  # type: ignore[misc]


def ensure_server(folder: Path, timeout: float = 180.0) -> _RealPopen:
    """Start this process's fork server (its socket and log in ``folder``), install
    ``ForkedPopen`` and point ``$TESTS_FORKSERVER`` at it; returns once it serves."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fork.sock"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    with open(folder / "forkserver.log", "ab") as log:
        server = _RealPopen([sys.executable, __file__, str(path)], env=env, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the tests' fork server did not start: {(folder / 'forkserver.log').read_text()}")
        time.sleep(0.05)
    os.environ[ENV] = str(path)
    install()
    return server


# -- the server ---------------------------------------------------------------------------
def _serve(path: str, preload: list[str]) -> dict[str, Any]:
    """Serve until the process that started us is gone; return (in a forked child only)
    the request that child runs: a command, or ``{"serve": path, "preload": modules}``
    for a server of its own whose children have those modules imported too."""
    import importlib

    for module in preload:
        importlib.import_module(module)

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # appears once it accepts
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket | None] = {}  # pid -> the requester to tell its exit status
    servers: set[str] = set()  # sockets of the servers forked for other preloads
    while os.getppid() == parent:
        try:
            readable = select.select([listener, wake_r], [], [], 1.0)[0]
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:  # reap every child that exited; tell its requester
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_frame(json.dumps({"status": status}).encode()))
                except OSError:
                    pass  # the requester is gone
                conn.close()
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
            fds = array.array("i")
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % 4])
            (n,) = struct.unpack("!I", msg[:4])
            body = msg[4:]
            while len(body) < n:
                body += _recv_exact(conn, n - len(body))
            request = json.loads(body)
        except (OSError, ValueError, EOFError, struct.error):
            conn.close()
            continue
        if "serve" in request and request["serve"] in servers:  # started already
            conn.sendall(_frame(b"{}"))
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:  # the child: what a fresh process would have, then run the request
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for c in (listener, conn, *children.values()):
                if c is not None:
                    c.close()
            os.close(wake_r)
            os.close(wake_w)
            if "serve" not in request:  # a command: its session and standard streams
                if request["new_session"]:
                    os.setsid()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target, inheritable=True)
                for fd in set(fds):
                    if fd > 2:
                        os.close(fd)
            return request
        for fd in fds:
            os.close(fd)
        serving = "serve" in request  # a server: nobody waits for its exit status
        if serving:
            servers.add(request["serve"])
        children[pid] = None if serving else conn
        try:
            conn.sendall(_frame(json.dumps({"pid": pid}).encode()))
        except OSError:
            pass
        if serving:
            conn.close()
    raise SystemExit(0)


def _exit(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: run the request, then end as Python's own exit does (the
    script's exception printed, non-daemon threads joined, atexit handlers run, stdio
    flushed) but without tearing down every module the server imported: that alone
    took over 2 s here (torch with dynamo), and printed torch's own finalizer errors."""
    import threading
    import traceback

    code = 0
    try:
        _run(request, base_path)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        if code == -signal.SIGINT:  # as Python does: die of the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def _run(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: ``python [-u] (SCRIPT | -m MODULE | -c CODE) ARGS`` as a fresh
    interpreter would run it."""
    import runpy

    env = request["env"]
    parent = request["ppid"]
    # The requester is this process's parent as far as anyone asks (ckptd.attempt names
    # torchrun's agent by it), until it exits: then, as for an orphan, init.
    os.getppid = lambda: parent if os.path.exists(f"/proc/{parent}") else 1
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    argv = request["argv"][1:]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    while argv and argv[0] in _FLAGS:
        unbuffered |= argv.pop(0) == "-u"
    if unbuffered:
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    elif os.isatty(1):  # as a fresh interpreter's stdout on a terminal
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        import torch

        torch.set_num_threads(int(threads))
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-c":  # run in a fresh __main__, as -c is
        import types

        sys.path[:] = ["", *extra, *base_path]
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":  # in a module of its own (not this file's globals): alter_sys sets argv[0] too
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base_path]
        sys.argv = argv
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _base = [p for p in sys.path[1:] if os.path.abspath(p) not in _own]
    install()  # children's own launches of Python come here too
    _request: dict[str, Any] = {"serve": sys.argv[1], "preload": [], "env": dict(os.environ)}
    while "serve" in _request:
        os.environ.clear()
        os.environ.update(_request["env"])
        _request = _serve(_request["serve"], _request["preload"])
    del _own
    _exit(_request, _base)
