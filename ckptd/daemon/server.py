"""The writer daemon: one main loop that owns the ROUTER socket and every session.

Control flow lives here only: the service's life cycle (start, drain, reload, stop),
the loop, and the sessions and steps that outlive one message. Signal handlers just
wake the loop (gunicorn's arbiter does the same); the loop reads messages and hands
each to its handler (``handlers``: one method per message type), which validates it
and batches tensors into chunks for the I/O threads (``writer``). Staging arenas of
local producers live in ``arenas``; what the daemon reports about itself in ``status``.
A bad message gets an error reply naming what was wrong, or is dropped and logged
when it cannot be answered; it never stops the loop.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import math
import os
import queue
import signal
import socket
import time
from pathlib import Path
from typing import Any

import zmq

from ..transport import handoff, unixsock, wire
from ..version import __version__
from ..config import Config, ConfigError, load as load_config, writer_threads
from ..transport.curve import CurveServer
from ..errors import CheckpointError
from ..transport.wakeup import WakePipe
from .. import env
from .. import failpoints
from . import status
from .arenas import Arenas
from .assembly import OpenStep
from .handlers import Handlers
from .liveness import Liveness
from .measuring import Measuring
from .metrics import Figures, MetricsServer
from .notify import Notifier, status_line, use_journal_priorities
from .owners import Owners
from .process import keep_freed_memory, lock_root, lower_priority
from .recovery import remove_orphans
from .session import Session
from .upkeep import Upkeep
from .share import Result
from .writer import Writer

log = logging.getLogger("ckptd.daemon")

IPC_PATH_MAX = 107  # sun_path in struct sockaddr_un, less the terminating NUL
# While draining, each tick asks systemd for this much more time (EXTEND_TIMEOUT_USEC)...
EXTEND_S = 10.0
# ...as long as open steps may still be committed, or the drain moved within this long.
STALL_S = 60.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.version = __version__  # ckptd's, in the status report (daemon.status)
        self.cfg = config.daemon
        self.root = config.root
        self.endpoint = config.endpoint
        self.curve = CurveServer.from_config(config)  # tcp://: keys checked now, before anything starts
        self.sessions: dict[bytes, Session] = {}
        self.owner: dict[tuple[str, int], bytes] = {}  # (run, rank) -> session identity
        self.committing: set[tuple[str, int, int]] = set()  # (run, rank, step)
        self.queued = 0  # bytes received and not yet written
        self.results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.stopping = False  # SIGTERM or SIGINT came: draining, then exit
        self._signals: list[int] = []  # queued by the handler, acted on by the loop
        self._drain_deadline = math.inf  # monotonic time when open steps stop being waited for
        self._drain_why = ""  # why they stop being waited for, for their producers
        self._last_progress = 0.0  # monotonic time the drain last moved
        self._status = ""  # the last STATUS= sent
        self.notifier = Notifier()  # systemd's NOTIFY_SOCKET and watchdog, if any
        self.figures = Figures()
        self.metrics: MetricsServer | None = None
        self._wake = WakePipe()  # I/O threads and signals wake the loop through it
        self._lock_fd = -1
        self._ipc: unixsock.BoundSocket | None = None  # the ipc:// socket file, once bound
        self.ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.writer: Writer | None = None
        self.upkeep: Upkeep | None = None
        self.arenas = Arenas()  # staging arenas offered by local producers
        self.owners = Owners(self.root)
        self.liveness = Liveness(self.cfg.session_timeout)  # local producers' processes: a death ends its session at once
        self.measuring: Measuring | None = None  # what saves cost, failures: the interval advice
        self.timings: dict[tuple[str, int, int], Any] = {}  # (run, rank, step) -> its commit's timing
        self.handlers = Handlers(self)

    # -- start and stop -------------------------------------------------------------
    def start(self) -> None:
        """Lock the root, clean it, bind. After this the daemon is ready to serve."""
        lower_priority(self.cfg.nice)  # before any thread starts: threads inherit it
        keep_freed_memory()
        layout_root = self.root
        layout_root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_root(self.root)
        removed = remove_orphans(layout_root)
        if removed:
            log.info("removed %d orphan file(s) left by an earlier crash", removed)
        self.upkeep = Upkeep(self.config)
        self.measuring = Measuring(self.root, self.config.advise.mtbf, self.upkeep.tier_names())
        self.upkeep.on_persisted(self.measuring.uploaded)  # each tier's persist time, for the advice
        # copies to the tiers pause while a step is received or committed
        self.upkeep.yield_to(lambda: self.queued > 0 or bool(self.committing))
        self.upkeep.start()
        self.writer = Writer(self._post, fsync=self.cfg.fsync, after_commit=self.upkeep.after_commit,
                             hdf5=self.config.hdf5, direct_io=self.cfg.direct_io, write_rate=self.cfg.write_rate,
                             threads=writer_threads(self.cfg.writer_threads),
                             reuse_unchanged=self.cfg.reuse_unchanged)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise, not vanish
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.router.setsockopt(zmq.LINGER, 2000)
        # A peer that sends a frame larger than this is disconnected by libzmq itself.
        self.router.setsockopt(zmq.MAXMSGSIZE, max(self.cfg.max_frame, wire.MAX_HEADER_BYTES) + 4096)
        self._bind()
        if self.cfg.metrics:
            self.metrics = MetricsServer(self.cfg.metrics, self.figures, lambda: status.live_figures(self))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake.write_fd, warn_on_full_buffer=False)
        log.info("serving %s, checkpoints under %s (pid %d)", self.endpoint, self.root, os.getpid())
        # Only now (docs/service.md, the life of the service): orphans are gone, the index is built, the socket listens.
        self._notify_status("READY=1")

    def _bind(self) -> None:
        assert self.router is not None
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://"):])
            if len(str(path).encode()) > IPC_PATH_MAX:
                raise CheckpointError(
                    f"ipc socket path {path} is longer than {IPC_PATH_MAX} bytes; "
                    "choose a shorter [daemon] endpoint"
                )
            # Who may connect is decided by this folder's permissions (docs/security.md).
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # libzmq replaces a socket file at this path: never one a live daemon serves
            if unixsock.in_use(str(path), socket.SOCK_STREAM):
                raise CheckpointError(
                    f"another process (a ckptd daemon of another root?) already serves {self.endpoint}; "
                    "stop it, or give this daemon another [daemon] endpoint"
                )
            # The handoff socket first: a producer that finds the ZeroMQ socket (and
            # connects at once) must find this one too, or it would send inline for good.
            if len(handoff.socket_path(str(path)).encode()) <= IPC_PATH_MAX:
                self.arenas.listen(str(path))
            else:
                log.warning("the ipc path %s leaves no room for %s beside it: local producers send "
                            "tensors through the socket (transport \"inline\")", path, handoff.SUFFIX)
        self.curve.secure(self.ctx, self.router)  # tcp://: CurveZMQ and the producers' allowlist
        try:
            self.router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise CheckpointError(f"cannot listen on {self.endpoint}: {exc}") from None
        if self.endpoint.startswith("ipc://"):
            # The socket admits the daemon's user and group whatever the umask (a
            # service's is 0027); its folder then decides who may reach it.
            path = self.endpoint[len("ipc://"):]
            self._ipc = unixsock.BoundSocket.of(path)  # ours to remove at exit, and only ours
            os.chmod(path, 0o660)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)  # the wakeup fd wakes the loop, which acts on it

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self._drain_results()
        if self.upkeep is not None:
            self.upkeep.close()
            self.upkeep = None
        if self.measuring is not None:
            self.measuring.close()  # after the uploader: its last figures are written too
            self.measuring = None
        if self.router is not None:
            self.router.close()
            self.router = None
        self.arenas.close()
        self.curve.close()  # its ZAP thread holds a socket, which ctx.term() would wait for
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self._ipc is not None:
            self._ipc.remove()
            self._ipc = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.liveness.close()
        self.notifier.close()

    # -- the loop ---------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain: refuse new steps, finish the
        rest, exit. The loop wakes at least every second, and at least twice per
        watchdog interval, to which it answers with WATCHDOG=1: a hung loop stops
        the pings, and systemd restarts the daemon."""
        assert self.router is not None
        poller = zmq.Poller()
        poller.register(self._wake.fd, zmq.POLLIN)
        self.arenas.register(poller)
        poller.register(self.liveness.fileno(), zmq.POLLIN)
        reading = False
        watchdog = self.notifier.watchdog_s
        next_ping = last_housekeeping = time.monotonic()
        while True:
            now = time.monotonic()
            if self._signals:
                self._on_signals(now)
            if self.stopping and self._drained(now):
                if reading:
                    self._read_batch()  # what already waits (new steps) gets its refusal now
                break
            timeout = 1.0
            if watchdog is not None:
                if now >= next_ping:
                    self.notifier.send("WATCHDOG=1")
                    next_ping = now + watchdog / 2
                timeout = min(timeout, next_ping - now)
            if self.liveness.pending():
                timeout = min(timeout, 0.1)
            settle = self.handlers.settle_deadline()  # a `latest` waiting for its run's commits
            if settle is not None:
                timeout = min(timeout, settle - now)
            want = self.queued < self.cfg.memory_budget
            if want != reading:
                # Over budget: leave messages in the producers' staging (they block
                # or raise there) until the writer has freed memory.
                if want:
                    poller.register(self.router, zmq.POLLIN)
                else:
                    poller.unregister(self.router)
                    for sess in self.sessions.values():  # what gathers in arenas goes to the writer
                        for open_step in sess.steps.values():
                            open_step.flush()
                reading = want
            events = dict(poller.poll(math.ceil(max(timeout, 0.0) * 1000)))
            if self._wake.fd in events:
                self._wake.drain()
            self._drain_results()
            self.handlers.answer_settled(time.monotonic())
            self.arenas.take(poller, events)
            if reading and self.router in events:
                self._read_batch()
            now = time.monotonic()
            if reading and (self.liveness.fileno() in events or self.liveness.pending()):
                self._end_dead_sessions(now)
            if self.stopping and events:
                self._last_progress = now  # bytes arrived, or the I/O threads finished something
            if now - last_housekeeping >= 1.0:
                self.arenas.expire(poller, now)
                if reading:
                    self._expire_sessions(now)
                else:
                    self._keep_alive(now)
                if self.stopping:
                    self._extend_stop_timeout(now)
                self._notify_status()
                last_housekeeping = now
        self._shutdown()

    # -- signals, drain, reload ----------------------------------------------------------
    def _on_signals(self, now: float) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGHUP:
                self._reload()
            elif not self.stopping:
                self._begin_drain(signum, now)
            elif self._drain_deadline > now:
                self._drain_why = f"a second {signal.Signals(signum).name} came"
                log.warning("%s: no longer waiting for open steps", self._drain_why)
                self._drain_deadline = now

    def _begin_drain(self, signum: int, now: float) -> None:
        self.stopping = True
        self._drain_deadline = now + self.cfg.drain_timeout
        self._drain_why = f"drain_timeout ({self.cfg.drain_timeout:g} s) passed"
        self._last_progress = now
        log.info(
            "stopping on %s: finishing %d commit(s) in progress; waiting up to %g s for %d open step(s) "
            "to be committed; refusing new steps and producers",
            signal.Signals(signum).name, len(self.committing), self.cfg.drain_timeout, len(self.open_steps()),
        )
        self._notify_status("STOPPING=1")

    def open_steps(self) -> list[tuple[Session, OpenStep]]:
        """Steps begun and not yet failed, committed or aborted."""
        return [(sess, st) for sess in self.sessions.values() for st in sess.steps.values()
                if st.share.error is None]

    def _drained(self, now: float) -> bool:
        """While stopping: whether every commit received is durable and no step is open."""
        if now >= self._drain_deadline:
            for sess, open_step in self.open_steps():
                self.fail_step(sess, open_step, (
                    f"the daemon is stopping and stopped waiting for step {open_step.share.step} to be "
                    f"committed ({self._drain_why}); it was not saved"), None)
        return not self.committing and not self.open_steps()

    def _extend_stop_timeout(self, now: float) -> None:
        """Keep systemd from killing a drain that is moving (docs/service.md): beyond its
        TimeoutStopSec, it waits as long as these keep coming. A drain stalled for
        STALL_S (a hung disk) stops asking, and systemd's timeout applies again."""
        if now < self._drain_deadline or now - self._last_progress < STALL_S:
            self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(EXTEND_S * 1e6)}")

    def _reload(self) -> None:
        """SIGHUP: re-read the config file and apply its logging and retention
        settings; connections and steps in flight are untouched."""
        path = self.config.path
        if path is None:
            log.warning("SIGHUP: the daemon was started without a config file; nothing to reload")
            return
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            new = load_config(path)
        except ConfigError as exc:
            log.error("SIGHUP: not reloaded, the running settings stay: %s", exc)
        else:
            log.info("reloaded %s: log_level = %s; [retention] applied", path, new.daemon.log_level)
            logging.getLogger().setLevel(new.daemon.log_level.upper())
            if self.upkeep is not None:  # the retention passes from now on
                self.upkeep.reload(new.retention)
            later = [f.name for f in dataclasses.fields(new.daemon)
                     if f.name != "log_level" and getattr(new.daemon, f.name) != getattr(self.cfg, f.name)]
            if later:
                log.warning("%s changed in %s; a restart applies %s", ", ".join(later), path,
                            "it" if len(later) == 1 else "them")
        self._notify_status("READY=1")

    # -- systemd's STATUS= (daemon.status) ------------------------------------------------
    def _notify_status(self, *lines: str) -> None:
        """Send ``lines`` (READY=1, ...) with STATUS=; alone, STATUS= only when it changed."""
        text = status.line(self)
        if lines or text != self._status:
            self._status = text
            self.notifier.send(*lines, status_line(text))

    # -- messages (daemon.handlers) --------------------------------------------------------
    def _read_batch(self, limit: int = 256) -> None:
        """Handle the messages waiting now (up to ``limit``), then send coalesced acks."""
        assert self.router is not None
        for _ in range(limit):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.handlers.dispatch(frames)
            if self.queued >= self.cfg.memory_budget:
                break
        for sess in self.sessions.values():
            self.ack(sess)

    def ack(self, sess: Session) -> None:
        through = sess.acknowledgeable()
        if through > sess.acked:
            self.send(sess.identity, "ack", seq=through)
            sess.acked = through

    # -- steps and sessions: ended by messages (daemon.handlers), the drain and timeouts --------
    def fail_step(self, sess: Session, open_step: OpenStep, message: str, seq: int | None,
                  *, discard: bool = True) -> None:
        """Report a failed step once and throw away what was written of it."""
        share = open_step.share
        log.warning("%s step=%d failed: %s", sess.label, share.step, message)
        self.figures.error("step")
        self.send(sess.identity, "error", seq=seq, step=share.step, message=message)
        share.error = message
        share.reported = True
        self._release_partial(sess, open_step)
        open_step.flush()  # the writer frees (not writes) a failed share's bytes
        if discard:
            assert self.writer is not None
            self.writer.discard(share)

    def drop_step(self, sess: Session, step: int) -> None:
        open_step = sess.steps.pop(step, None)
        if open_step is None:
            return
        if open_step.share.error is None:
            open_step.share.error = "aborted by the producer"
        self._release_partial(sess, open_step)
        open_step.flush()
        assert self.writer is not None
        self.writer.discard(open_step.share)

    def _release_partial(self, sess: Session, open_step: OpenStep) -> None:
        held, seqs = open_step.release_partial()
        self.queued -= held
        sess.mark_written(seqs)

    def end_session(self, sess: Session, why: str, *, failed: bool = False) -> None:
        """End a session; ``failed``: its producer went without a goodbye (its attempt failed)."""
        log.info("producer %s %s; discarding %d unfinished step(s)", sess.label, why, len(sess.steps))
        if failed and self.measuring is not None:
            self.measuring.ended(sess.run, sess.attempt, why)
        for step in list(sess.steps):
            self.drop_step(sess, step)
        self.sessions.pop(sess.identity, None)
        self.liveness.forget(sess.identity)
        if self.owner.get((sess.run, sess.rank)) == sess.identity:
            del self.owner[(sess.run, sess.rank)]

    def _end_dead_sessions(self, now: float) -> None:
        """End the sessions of local producers whose process exited (ckptd.daemon.liveness)."""
        last_seen = lambda i: self.sessions[i].last_seen if i in self.sessions else 0.0  # noqa: E731
        for identity, pid in self.liveness.ended(now, last_seen):
            if identity in self.sessions:
                self.end_session(self.sessions[identity], f"died (process {pid} exited)", failed=True)
            else:  # never happens: sessions and the watch end together; a stray watch must not stop the loop
                self.liveness.forget(identity)

    def _keep_alive(self, now: float) -> None:
        """While the daemon is not reading (over budget), producers' pings go unread:
        tell them it is alive, and do not hold their silence against them."""
        for sess in self.sessions.values():
            sess.last_seen = now
            self.send(sess.identity, "pong", seq=0)

    def _expire_sessions(self, now: float) -> None:
        for sess in list(self.sessions.values()):
            if self.liveness.silent_too_long(sess.identity, now - sess.last_seen, now):
                self.end_session(sess, f"was silent for {now - sess.last_seen:.0f} s", failed=True)

    # -- results from the I/O threads ----------------------------------------------------
    def _post(self, result: Result) -> None:  # called from I/O threads
        self.results.put(result)
        self._wake.wake()

    def _drain_results(self) -> None:
        while True:
            try:
                result = self.results.get_nowait()
            except queue.Empty:
                return
            self.handlers.on_result(result)

    # -- sending ------------------------------------------------------------------------
    def send(self, identity: bytes, op: str, **fields: Any) -> None:
        self.send_encoded(identity, op, wire.encode(op, **fields))

    def send_encoded(self, identity: bytes, op: str, header: bytes) -> None:
        """Send a reply already encoded (``wire.encode``), as ``send`` does."""
        assert self.router is not None
        try:
            self.router.send_multipart([identity, header], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading
            log.debug("reply %s to %s dropped: %s", op, identity.hex(), exc)

    # -- shutdown ------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """After the drain: let the producers go, finish what the I/O threads hold.

        The loop exits once every commit received is durable and no step is open,
        so the only steps left here already failed and were reported; any other
        step still gets its error, never silence."""
        log.info("drained: every commit received is durable; letting %d producer(s) go", len(self.sessions))
        self.handlers.answer_settled(time.monotonic(), every=True)
        for sess in list(self.sessions.values()):
            for step, open_step in sess.steps.items():
                if open_step.share.error is None:
                    self.send(sess.identity, "error", seq=None, step=step,
                              message=f"the daemon stopped before step {step} was committed")
            # so that the producer says "stopped" at once, not "no answer" a timeout later
            self.send(sess.identity, "error", seq=None, step=None, code=wire.STOPPING,
                      message=f"the ckptd daemon (pid {os.getpid()}) stopped")
            self.end_session(sess, "was disconnected: the daemon is stopping")
        assert self.writer is not None
        self.writer.close()  # runs every queued job, commits included
        self.writer = None
        self._drain_results()


def serve(config: Config) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; return the exit status."""
    logging.captureWarnings(True)  # a library's warnings.warn() is a log line like any other
    use_journal_priorities()  # under systemd: journalctl -p warning finds warnings
    # A crash or the watchdog's SIGABRT prints every thread's stack to the log.
    faulthandler.enable(all_threads=True)
    failpoints.arm(env.failpoints())  # read as the daemon starts, not at import
    daemon = Daemon(config)
    try:
        daemon.start()
        daemon.serve_forever()
    finally:
        daemon.close()
    log.info("stopped")
    return 0


