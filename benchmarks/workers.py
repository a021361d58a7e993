"""Worker processes: each plays one saver (a training process that checkpoints) for the report.

Why processes: the report gives each saver's peak RSS, and the goal for ckptd's is
"payload + arena + 200 MiB". In one process every saver's buffers (the memcpy
target, DCP's stager, six staging arenas) would count against all of them. So
every saver lives in a process of its own, that maps the shared payload
(payload.py) and holds only what that saver holds; the parent, which does
nothing meanwhile, resets and reads each worker's VmHWM around each measurement
(procmem.py).

Roles (one worker per role instance):

* ``baseline``: memcpy three ways, raw write + fsync (buffered and O_DIRECT),
  torch.save, safetensors, naive h5py; one at a time.
* ``dcp``: ``torch.distributed.checkpoint.async_save`` with one executor
  (thread or process) in a single-rank gloo group.
* ``ckptd``: one ``ckptd.Producer`` with one transport and one format.

Protocol: the parent writes one JSON command per line to the worker's stdin; the
worker answers one JSON line on its stdout, which nothing else may write to (the
worker points file descriptor 1 at its log before importing anything that
prints). Run as ``python benchmarks/workers.py NAME``; the first line is its setup.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


# -- the parent's side ------------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker failed a command, died, or did not answer in time."""


class Worker:
    """A worker process and its command pipe. ``call`` sends one command and waits for the
    answer; ``close`` asks it to quit, then kills it if it does not."""

    def __init__(self, name: str, setup: dict[str, Any], log: Path, env: dict[str, str],
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as err:
            # the name on the command line only tells the workers apart in ps and py-spy
            self.proc = subprocess.Popen([sys.executable, str(HERE / "workers.py"), name], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, pass_fds=pass_fds)
        self._send(setup)
        self.ready: dict[str, Any] | None = None  # the setup's answer, once read

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"worker {self.name} is gone:\n{self.log_tail()}") from None

    def _receive(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise WorkerError(f"worker {self.name} did not answer within {timeout:.0f} s:\n{self.log_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"worker {self.name} exited ({self.proc.wait()}):\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"worker {self.name}: {answer['error']}")
        return answer

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._receive(timeout)
        return self.ready

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.wait_ready(timeout)
        self._send({"op": op, **args})
        return self._receive(timeout)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(60)
            except (WorkerError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


# -- the worker's side --------------------------------------------------------------------------
class BaselineRole:
    """memcpy and the synchronous writers, each on the shared payload."""

    def __init__(self, payload: Any, setup: dict[str, Any]) -> None:
        from baselines import CopyTargets

        self.payload = payload
        self.targets = CopyTargets(payload.state)
        self.block = int(setup["block"])

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        import baselines as b

        if op == "memcpy":
            return {"ways": b.memcpy_three_ways(self.targets)}
        path = Path(args["path"])
        state = self.payload.state
        writers: dict[str, Callable[[], float]] = {
            "raw_buffered": lambda: b.raw_write_fsync(self.payload.contiguous_bytes(), path, self.block),
            "raw_direct": lambda: b.raw_write_direct(self.payload.contiguous_bytes(), path, self.block),
            "torch_save": lambda: b.torch_save_fsync(state, path),
            "safetensors": lambda: b.safetensors_fsync(state, path),
            "h5py": lambda: b.naive_h5py_fsync(state, path),
        }
        try:
            seconds = writers[op]()
        except b.DirectIORefused as exc:
            return {"refused": str(exc)}
        finally:
            path.unlink(missing_ok=True)
        return {"blocked_s": seconds, "durable_s": seconds}


class DcpRole:
    def __init__(self, payload: Any, setup: dict[str, Any]) -> None:
        from baselines import DcpSaver

        self.payload = payload
        self.saver = DcpSaver(Path(setup["dir"]), setup["executor"], bool(setup.get("reuse_stager")))

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        blocked, durable = self.saver.once(self.payload.state)
        return {"blocked_s": blocked, "durable_s": durable, "writer_pid": self.saver.writer_pid()}

    def close(self) -> None:
        self.saver.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class CkptdRun:
    """One ckptd checkpoint as the caller saw it."""

    step: int
    blocked_s: float  # time the caller was inside ckptd calls before it could go on
    commit_s: float  # first call into ckptd until the commit was acknowledged (durable)
    staging_wait_s: float  # part of blocked_s spent waiting for staging space


def _staging_waited(p: Any) -> float:
    arena = getattr(p, "_arena", None)  # internal; only a diagnostic, so tolerate its absence
    return float(getattr(arena, "blocked_s", 0.0))


def ckptd_emit(p: Any, state: dict[str, Any], step: int, timeout: float) -> CkptdRun:
    """Every tensor through ``emit`` inside ``with p.checkpoint(step)``; blocking time is
    the sum of the emit calls (the loop around them is the caller's own work)."""
    waited = _staging_waited(p)
    blocked = 0.0
    t0 = time.perf_counter()
    with p.checkpoint(step) as handle:
        for name, tensor in state.items():
            a = time.perf_counter()
            p.emit(name, tensor)
            blocked += time.perf_counter() - a
    handle.wait(timeout)
    return CkptdRun(step, blocked, time.perf_counter() - t0, _staging_waited(p) - waited)


def ckptd_save(p: Any, state: dict[str, Any], step: int, timeout: float) -> CkptdRun:
    """The whole state in one ``save`` call (it also sends the commit)."""
    waited = _staging_waited(p)
    t0 = time.perf_counter()
    handle = p.save(state, step)
    blocked = time.perf_counter() - t0
    handle.wait(timeout)
    return CkptdRun(step, blocked, time.perf_counter() - t0, _staging_waited(p) - waited)


class CkptdRole:
    """One ``ckptd.Producer`` with the transport, format and options of its setup."""

    def __init__(self, payload: Any, setup: dict[str, Any]) -> None:
        import ckptd

        self.payload = payload
        self.timeout = float(setup["timeout"])
        self.producer = ckptd.Producer(setup["endpoint"], setup["run"], format=setup["format"],
                                       **setup["options"])
        self.producer.latest()  # connects now and waits for the staging arena: not a per-checkpoint cost

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        calls = {"emit": ckptd_emit, "save": ckptd_save}
        r = calls[op](self.producer, self.payload.state, int(args["step"]), self.timeout)
        return {"blocked_s": r.blocked_s, "durable_s": r.commit_s, "staging_wait_s": r.staging_wait_s}

    def close(self) -> None:
        self.producer.close()


ROLES = {"baseline": BaselineRole, "dcp": DcpRole, "ckptd": CkptdRole}


def worker_main() -> int:
    proto = os.fdopen(os.dup(1), "w")  # answers only; stray prints go to the log from here on
    os.dup2(2, 1)
    setup = json.loads(sys.stdin.readline())

    def answer(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    import procmem  # before torch: the base RSS of a bare interpreter is part of the record

    rss: dict[str, int] = {"python": procmem.status().get("VmRSS", 0)}
    __import__("torch")  # what every saver loads first; its RSS is the base the report shows

    rss["python_torch"] = procmem.status().get("VmRSS", 0)
    from payload import Layout, SharedPayload

    payload = SharedPayload.attach(int(setup["fd"]), Layout.from_dict(setup["layout"]))
    rss["with_payload"] = procmem.status().get("VmRSS", 0)
    try:
        role = ROLES[setup["role"]](payload, setup)
    except Exception:
        answer({"error": traceback.format_exc()})
        return 1
    rss["ready"] = procmem.status().get("VmRSS", 0)
    answer({"ok": True, "pid": os.getpid(), "rss": rss})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            try:
                answer({"ok": True, **role.handle(op, cmd)})
            except Exception:
                answer({"error": traceback.format_exc()})
    finally:
        close = getattr(role, "close", None)
        if close is not None:
            close()
        payload.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
