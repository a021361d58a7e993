"""Crash a training run with SIGKILL, resume it from ckptd, and get the same weights bit for bit.

    python examples/train_resume.py            # from the repo root; about 10 s on 2 CPU cores

What happens:

1. A ckptd daemon starts from ``config.toml`` (socket and checkpoints under var/).
2. A training worker (this script again, with ``--worker``) trains a small MLP with
   Adam and hands a checkpoint to ckptd every ``--every`` steps. ``producer.save``
   only snapshots the state and returns; the worker polls the commit handles and
   reports a checkpoint only once the daemon has made it durable.
3. Once two checkpoints are durable, the parent kills the worker with SIGKILL in
   the middle of a step, as a crash or a preempted node would.
4. A new worker loads the newest complete checkpoint with ``ckptd.load`` and
   trains on to the end. Meanwhile a third worker trains from scratch without any
   interruption (and without ckptd at all).
5. The two final models are compared tensor by tensor with ``torch.equal``.

Everything is deterministic: one thread, deterministic kernels, data for step s
drawn from a generator seeded with s, and the global RNG (used by dropout) saved
in every checkpoint. That is what makes a bitwise comparison possible.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent


# ======================================================================================
# The worker: an ordinary training loop plus the few lines ckptd needs.
# ======================================================================================

def build_model(args: argparse.Namespace) -> Any:
    """The same architecture and initial weights in every worker (seeded)."""
    import torch
    from torch import nn

    torch.manual_seed(args.seed)
    return nn.Sequential(
        nn.Linear(args.inputs, args.hidden), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(args.hidden, args.outputs),
    )


def batch(args: argparse.Namespace, step: int) -> tuple[Any, Any]:
    """The batch of ``step``: a function of the step alone, so a resumed run sees the same data.

    Targets come from a fixed random "teacher" network, so there is something to learn.
    """
    import torch

    teacher = torch.Generator().manual_seed(args.seed + 1)
    w1 = torch.randn(args.inputs, args.hidden, generator=teacher) / args.inputs ** 0.5
    w2 = torch.randn(args.hidden, args.outputs, generator=teacher) / args.hidden ** 0.5
    data = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch, args.inputs, generator=data)
    return x, torch.tanh(x @ w1) @ w2


def emit_event(event: str, **fields: Any) -> None:
    """One JSON line on stdout: the parent reads these to follow (and narrate) the run."""
    print(json.dumps({"event": event, **fields}), flush=True)


@dataclass
class PendingCheckpoint:
    handle: Any  # ckptd.CommitHandle
    queued_at: float


def report_durable(pending: list[PendingCheckpoint], *, block: bool = False) -> None:
    """Report each checkpoint the daemon has acknowledged, oldest first.

    ``done()`` never blocks, so this costs the training loop nothing. ``wait()`` on
    a done handle returns its CheckpointInfo, or raises CheckpointError if the commit
    failed: a failed checkpoint must stop the run, not be silently skipped.
    """
    while pending and (block or pending[0].handle.done()):
        p = pending.pop(0)
        info = p.handle.wait()
        emit_event("durable", step=info.step, nbytes=info.nbytes, ntensors=info.ntensors,
                   path=info.path, latency_ms=(time.monotonic() - p.queued_at) * 1e3)


def resume(args: argparse.Namespace, model: Any, opt: Any) -> int:
    """Load the newest complete checkpoint into ``model`` and ``opt``; return its step."""
    import ckptd
    import torch

    if args.every > 0:
        # Ask the daemon, not the disk: it answers once the commits it already has for this
        # run are on disk, so a checkpoint handed over just before the crash is the one
        # resumed from, not trained again (a second save of a step is refused).
        from ckptd import producer

        info = producer.latest()
    else:
        info = ckptd.latest(args.run, root=args.root)
    if info is None:
        raise SystemExit(f"run {args.run!r} has no complete checkpoint under {args.root}")
    # Load by step, not "latest": the step we just announced is the one we read.
    state = ckptd.load(args.run, info.step, root=args.root)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"]["torch"])  # dropout masks continue where they left off
    emit_event("resumed", step=state["step"], path=info.path, nbytes=info.nbytes, ntensors=info.ntensors)
    return state["step"]


def train(args: argparse.Namespace) -> None:
    import torch

    # Determinism: same kernels, same reduction order, every time.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = build_model(args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    checkpointing = args.every > 0
    if checkpointing:
        from ckptd import producer

        # Staging holds snapshots until the daemon has them; one checkpoint's worth is plenty here.
        producer.configure(endpoint=args.endpoint, run=args.run, staging_size=args.staging)
    first = resume(args, model, opt) + 1 if args.resume else 1
    pending: list[PendingCheckpoint] = []

    for step in range(first, args.steps + 1):
        x, y = batch(args, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        if checkpointing and step % args.every == 0:
            t0 = time.monotonic()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                     "rng": {"torch": torch.get_rng_state()}}
            # save() copies the tensors into staging and returns: no disk I/O on this path.
            pending.append(PendingCheckpoint(producer.save(state, step=step), t0))
            emit_event("queued", step=step, stall_ms=(time.monotonic() - t0) * 1e3)
        if checkpointing:
            report_durable(pending)
        emit_event("step", step=step, loss=loss.item())
        if args.step_delay:
            time.sleep(args.step_delay)  # stands in for data loading; see --step-delay

    if checkpointing:
        report_durable(pending, block=True)  # the last checkpoints, before we call it a day
        producer.close()
    if args.out:
        from safetensors.torch import save_file

        save_file(model.state_dict(), args.out, metadata={"step": str(args.steps)})
        emit_event("finished", step=args.steps, out=args.out)


# ======================================================================================
# The parent: daemon, workers, the crash, and the comparison.
# ======================================================================================

class Worker:
    """A worker subprocess whose JSON events arrive on a queue (a thread reads its stdout)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                print(f"[{self.name}] {line.rstrip()}")  # not an event: pass it on
        self.events.put(None)  # end of output

    def next_events(self, timeout: float) -> Iterator[dict[str, Any]]:
        """Events until the worker's output ends; raise if none comes for ``timeout`` s."""
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"{self.name} worker printed nothing for {timeout:.0f} s") from None
            if event is None:
                return
            yield event

    def finish(self, timeout: float) -> int:
        self.proc.wait(timeout)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@dataclass
class Daemon:
    proc: subprocess.Popen
    endpoint: str
    root: Path
    log: Path

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM lets it finish commits in flight; SIGKILL only if it will not stop."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _socket_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def start_daemon(config: Path, workdir: Path, timeout: float = 30.0) -> Daemon:
    """Run ``ckptd serve -c CONFIG``; it is ready once its ipc socket appears."""
    from ckptd.config import load as load_config  # resolves paths as the daemon will

    cfg = load_config(config)
    endpoint, root = cfg.endpoint, cfg.root
    sock = Path(endpoint[len("ipc://"):])
    # A socket file left by an earlier daemon that was killed must not pass for ours.
    stale = _socket_identity(sock)
    log = workdir / "daemon.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "-c", str(config)],
                                stdout=out, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, endpoint, root, log)
    try:
        deadline = time.monotonic() + timeout
        while _socket_identity(sock) in (None, stale):
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not open {sock} within {timeout:.0f} s:\n{_tail(log)}")
            time.sleep(0.02)
    except BaseException:  # Ctrl-C included: never leave a daemon behind
        daemon.stop()
        raise
    return daemon


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def worker_argv(args: argparse.Namespace, daemon: Daemon, **overrides: Any) -> list[str]:
    """This script in ``--worker`` mode, with the training settings the parent was given."""
    opts = {"run": args.run, "endpoint": daemon.endpoint, "root": str(daemon.root), "steps": args.steps,
            "every": args.every, "seed": args.seed, "batch": args.batch, "inputs": args.inputs,
            "hidden": args.hidden, "outputs": args.outputs, "staging": args.staging,
            "step_delay": args.step_delay, **overrides}
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    for key, value in opts.items():
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
        elif value is not None and value is not False:  # not `in (None, False)`: 0 == False
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def pick_kill_step(args: argparse.Namespace) -> int:
    """Default: about 2/3 through, halfway between two checkpoints (so never on one)."""
    if args.kill_at is not None:
        return args.kill_at
    return (args.steps * 2 // 3) // args.every * args.every + max(1, args.every // 2)


@dataclass
class CrashReport:
    killed_during: int  # the step the worker was in when SIGKILL landed
    durable: list[int] = field(default_factory=list)  # checkpoints reported durable before


def run_until_killed(worker: Worker, args: argparse.Namespace) -> CrashReport:
    """Follow the worker; SIGKILL it once two checkpoints are durable and it reached --kill-at."""
    kill_at = pick_kill_step(args)
    durable: list[int] = []
    last_step = 0
    killed = False
    for ev in worker.next_events(args.event_timeout):
        if ev["event"] == "step":
            last_step = ev["step"]
        narrate("train", ev)
        if ev["event"] == "durable":
            durable.append(ev["step"])
        # The next step is the one running now: strike only between checkpoints.
        running = last_step + 1
        if not killed and len(durable) >= 2 and running >= kill_at and running % args.every:
            worker.proc.send_signal(signal.SIGKILL)
            killed = True
            # keep reading: lines already in the pipe tell exactly how far it got
    if not killed:
        code = worker.finish(args.event_timeout)
        if code != 0:
            raise RuntimeError(f"the train worker failed with status {code} before it was killed (its error is above)")
        raise RuntimeError(
            f"the worker finished before it could be killed: {len(durable)} checkpoint(s) were durable "
            "by the end; use more --steps or a smaller --every"
        )
    worker.finish(args.event_timeout)
    return CrashReport(last_step + 1, durable)


def narrate(who: str, ev: dict[str, Any]) -> None:
    """Turn worker events into the story the demo prints."""
    kind = ev["event"]
    if kind == "queued":
        print(f"[{who}] step {ev['step']:>4}: checkpoint handed to ckptd (training paused {ev['stall_ms']:.1f} ms)")
    elif kind == "durable":
        print(f"[{who}] step {ev['step']:>4}: checkpoint durable, {ev['nbytes'] / 1e6:.2f} MB in "
              f"{ev['ntensors']} tensors, {ev['latency_ms']:.0f} ms after it was handed over")
    elif kind == "step" and ev["step"] % 50 == 0:
        print(f"[{who}] step {ev['step']:>4}: loss {ev['loss']:.5f}")
    elif kind == "resumed":
        print(f"[{who}] resumed from checkpoint step {ev['step']} ({ev['path']}, "
              f"{ev['nbytes'] / 1e6:.2f} MB)")
    elif kind == "finished":
        print(f"[{who}] finished step {ev['step']}; final weights in {ev['out']}")


def follow(worker: Worker, args: argparse.Namespace, quiet: bool = False) -> dict[str, Any]:
    """Narrate a worker to the end; return its last event of each kind. It must exit 0."""
    last: dict[str, Any] = {}
    for ev in worker.next_events(args.event_timeout):
        last[ev["event"]] = ev
        if not quiet:
            narrate(worker.name, ev)
    code = worker.finish(args.event_timeout)
    if code != 0:
        raise RuntimeError(f"the {worker.name} worker exited with status {code}")
    return last


def compare(resumed: Path, reference: Path) -> list[str]:
    """Every tensor of both files, bitwise. Returns the differences (none: a match)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(resumed), load_file(reference)
    problems = [f"{k}: only in one of the two files" for k in sorted(a.keys() ^ b.keys())]
    for name in sorted(a.keys() & b.keys()):
        if not torch.equal(a[name], b[name]):
            diff = (a[name].double() - b[name].double()).abs().max().item()
            problems.append(f"{name}: differs (max abs difference {diff:.3g})")
    return problems


def demo(args: argparse.Namespace, workdir: Path) -> int:
    config = Path(args.config).resolve()
    daemon = start_daemon(config, workdir)
    workers: list[Worker] = []
    # The producer in each worker also reads its [producer] options from this config.
    env = dict(os.environ, CKPTD_CONFIG=str(config), PYTHONUNBUFFERED="1")

    def spawn(name: str, **overrides: Any) -> Worker:
        workers.append(Worker(name, worker_argv(args, daemon, **overrides), env))
        return workers[-1]

    try:
        params = (args.inputs + 1) * args.hidden + (args.hidden + 1) * args.hidden + (args.hidden + 1) * args.outputs
        print(f"ckptd demo: run {args.run!r}, an MLP of {params:,} parameters trained with Adam for "
              f"{args.steps} steps, a checkpoint every {args.every}")
        print(f"daemon pid {daemon.proc.pid} on {daemon.endpoint}; checkpoints under {daemon.root}")
        reference_out, resumed_out = workdir / "reference.safetensors", workdir / "resumed.safetensors"
        # The uninterrupted run needs no ckptd at all (--every 0); it runs alongside the doomed one.
        reference = spawn("reference", every=0, step_delay=0, out=str(reference_out))
        crash = run_until_killed(spawn("train"), args)
        print(f"[parent] SIGKILL: killed worker during step {crash.killed_during} "
              f"(checkpoints reported durable: {', '.join(map(str, crash.durable))})")

        resumed = follow(spawn("resume", resume=True, step_delay=0, out=str(resumed_out)), args)
        resumed_step = resumed["resumed"]["step"]
        follow(reference, args, quiet=True)
        print(f"[reference] finished step {args.steps} without interruption; final weights in {reference_out}")

        # Durability means: every checkpoint reported durable before the crash survives it.
        if resumed_step < crash.durable[-1]:
            print(f"FAILED: step {crash.durable[-1]} was reported durable, but the newest checkpoint "
                  f"after the crash is step {resumed_step}")
            return 1
        lost_to = min(crash.killed_during, args.steps)
        if resumed_step < lost_to:
            print(f"[parent] the resumed run replayed steps {resumed_step + 1}..{lost_to} "
                  f"that the crash lost, then went on to step {args.steps}")
        else:  # the kill landed after the last step's checkpoint was durable
            print(f"[parent] the crash lost no step: step {resumed_step} was checkpointed before it")
        problems = compare(resumed_out, reference_out)
        if problems:
            print("RESULT: MISMATCH between the resumed and the uninterrupted run:")
            for p in problems:
                print(f"  {p}")
            return 1
        print("RESULT: resumed run matches uninterrupted run bit-for-bit")
        return 0
    finally:
        for w in workers:
            w.kill()
        daemon.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "config.toml"), help="ckptd config (default: the repo's)")
    p.add_argument("--run", default=None, help="run id (default: a fresh demo-<timestamp>-<pid>)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default 200)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="earliest step to SIGKILL the worker in (default: between checkpoints, 2/3 through)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512, help="MLP width (default 512: a 3.7 MB checkpoint)")
    p.add_argument("--outputs", type=int, default=16)
    p.add_argument("--staging", default="64MiB", help="producer staging memory (default 64MiB)")
    p.add_argument("--step-delay", type=float, default=0.005,
                   help="seconds of simulated data loading per step, so the kill lands where aimed "
                        "(default 0.005)")
    p.add_argument("--event-timeout", type=float, default=60.0,
                   help="give up on a worker silent this long (default 60 s)")
    p.add_argument("--workdir", default=None,
                   help="where final weights and the daemon log go (default: a temp folder, "
                        "removed after a successful run)")
    # The worker's own flags: set by the parent, not meant for people.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # The demo kills between two checkpoints, so it needs steps that are not checkpoints (--every 2+).
    if args.steps < 1 or args.every < 0 or (not args.worker and args.every < 2):
        p.error("--steps must be at least 1 and --every at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    from ckptd import CheckpointError

    args = parse_args(argv)
    if args.worker:
        train(args)
        return 0
    args.run = args.run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    # Turn SIGTERM into an exception, so the finally blocks still stop the daemon and workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ckptd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    code = 1
    try:
        code = demo(args, workdir)
    except (RuntimeError, ValueError, CheckpointError) as exc:  # ValueError: a bad config
        print(f"FAILED: {exc}")
    finally:
        if code != 0 or args.workdir:
            print(f"(daemon log and weights kept in {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"(removed {workdir}; pass --workdir to keep the weights and the daemon log)")
    return code


if __name__ == "__main__":
    sys.exit(main())
