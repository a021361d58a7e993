"""The writer daemon: one main loop that owns the ROUTER socket and every session.

Control flow lives here only. Signal handlers just wake the loop (gunicorn's
arbiter does the same); the loop reads messages, validates them, batches
tensors into chunks for the I/O threads (``writer``), and answers producers.
A bad message gets an error reply naming what was wrong, or is dropped and
logged when it cannot be answered; it never stops the loop.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import mmap
import os
import queue
import signal
import socket
import time
from pathlib import Path
from typing import Any

import zmq

from .. import __version__, handoff, state as state_mod, units, unixsock, wire
from ..attempt import check_attempt
from ..config import FORMATS, Config, ConfigError, load as load_config, writer_threads
from ..curve import CurveServer
from ..errors import CheckpointError, ProtocolError
from ..names import check_rank, check_run, check_step
from ..wakeup import WakePipe
from .metrics import Figures, MetricsServer
from .notify import Notifier, status_line, use_journal_priorities
from .liveness import Liveness, peer_pid
from .measuring import Measuring
from .owners import NotOwner, Owners, principal
from .process import keep_freed_memory, lock_root, lower_priority
from .session import Session
from .assembly import OpenStep, StepError
from .attempts import resave
from .recovery import remove_orphans
from .upkeep import Upkeep
from .writer import Result, Share, Writer

log = logging.getLogger("ckptd.daemon")

IPC_PATH_MAX = 107  # sun_path in struct sockaddr_un, less the terminating NUL
# While draining, each tick asks systemd for this much more time (EXTEND_TIMEOUT_USEC)...
EXTEND_S = 10.0
# ...as long as open steps may still be committed, or the drain moved within this long.
STALL_S = 60.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
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
        self.handoffs: handoff.Listener | None = None  # staging arenas offered by local producers
        self.owners = Owners(self.root)
        self.liveness = Liveness()  # local producers' processes: a death ends its session at once
        # Commits in flight whose bytes are in a producer's shared arena, by arena: if the
        # same arena comes back in a new hello (the producer reconnected), it is about to
        # be reused, and those commits must not complete with bytes overwritten under them.
        self.arena_commits: dict[tuple[int, int], list[Share]] = {}
        self.measuring: Measuring | None = None  # what saves cost, failures: the interval advice
        self._timings: dict[tuple[str, int, int], Any] = {}  # (run, rank, step) -> its commit's timing

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
        tiers = ("local",) + (("remote",) if self.upkeep.uploader is not None else ()) \
            + (("peer",) if self.upkeep.peer is not None else ())
        self.measuring = Measuring(self.root, self.config.advise.mtbf, tiers)
        if self.upkeep.uploader is not None:
            self.upkeep.uploader.on_uploaded = self.measuring.uploaded
        if self.upkeep.peer is not None:
            measuring = self.measuring
            self.upkeep.peer.replicator.on_replicated = \
                lambda run, step, rank, lag: measuring.uploaded(run, step, rank, lag, tier="peer")
        if self.upkeep.peer is not None:  # replication pauses while a step is received or committed
            self.upkeep.peer.yield_to(lambda: self.queued > 0 or bool(self.committing))
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
            self.metrics = MetricsServer(self.cfg.metrics, self.figures, self._live_figures)
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
                self.handoffs = handoff.Listener(str(path))
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
        if self.handoffs is not None:
            self.handoffs.close()
            self.handoffs = None
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
        if self.handoffs is not None:
            poller.register(self.handoffs.fileno(), zmq.POLLIN)
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
            want = self.queued < self.cfg.memory_budget
            if want != reading:
                # Over budget: leave messages in the producers' staging (they block
                # or raise there) until the writer has freed memory.
                if want:
                    poller.register(self.router, zmq.POLLIN)
                else:
                    poller.unregister(self.router)
                    self._flush_chunks()
                reading = want
            events = dict(poller.poll(math.ceil(max(timeout, 0.0) * 1000)))
            if self._wake.fd in events:
                self._wake.drain()
            self._drain_results()
            if self.handoffs is not None:
                self._take_handoffs(poller, events)
            if reading and self.router in events:
                self._read_batch()
            now = time.monotonic()
            if reading and (self.liveness.fileno() in events or self.liveness.pending()):
                self._end_dead_sessions(now)
            if self.stopping and events:
                self._last_progress = now  # bytes arrived, or the I/O threads finished something
            if now - last_housekeeping >= 1.0:
                if self.handoffs is not None:
                    self._expire_handoffs(poller, now)
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
            signal.Signals(signum).name, len(self.committing), self.cfg.drain_timeout, len(self._open_steps()),
        )
        self._notify_status("STOPPING=1")

    def _open_steps(self) -> list[tuple[Session, OpenStep]]:
        """Steps begun and not yet failed, committed or aborted."""
        return [(sess, st) for sess in self.sessions.values() for st in sess.steps.values()
                if st.share.error is None]

    def _drained(self, now: float) -> bool:
        """While stopping: whether every commit received is durable and no step is open."""
        if now >= self._drain_deadline:
            for sess, open_step in self._open_steps():
                self._fail_step(sess, open_step, (
                    f"the daemon is stopping and stopped waiting for step {open_step.share.step} to be "
                    f"committed ({self._drain_why}); it was not saved"), None)
        return not self.committing and not self._open_steps()

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
            self._reload_retention(new)
            later = [f.name for f in dataclasses.fields(new.daemon)
                     if f.name != "log_level" and getattr(new.daemon, f.name) != getattr(self.cfg, f.name)]
            if later:
                log.warning("%s changed in %s; a restart applies %s", ", ".join(later), path,
                            "it" if len(later) == 1 else "them")
        self._notify_status("READY=1")

    def _reload_retention(self, config: Config) -> None:
        """Apply ``config``'s retention settings (SIGHUP) to the passes from now on."""
        if self.upkeep is not None:
            self.upkeep.reload(config.retention)

    # -- status: systemd's STATUS=, `ckptd status`, metrics ------------------------------------
    def _notify_status(self, *lines: str) -> None:
        """Send ``lines`` (READY=1, ...) with STATUS=; alone, STATUS= only when it changed."""
        status = self._status_text()
        if lines or status != self._status:
            self._status = status
            self.notifier.send(*lines, status_line(status))

    def _status_text(self) -> str:
        if self.stopping:
            return (f"stopping: {len(self.committing)} commit(s) in progress, {len(self._open_steps())} "
                    "open step(s); new steps are refused")
        runs = sorted({s.run for s in self.sessions.values()})
        text = f"{len(self.sessions)} producer(s)"
        if runs:
            text += f" of run(s) {', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''}"
        text += f"; {self.queued / 2**20:.1f} MiB queued"
        last = self.figures.last_commit
        if last is None:
            return text + "; no commit yet"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"]))
        return text + f"; last commit: run {last['run']} step {last['step']} at {when}"

    def _live_figures(self) -> dict[str, Any]:
        """Figures of the moment, for the metrics thread: plain reads, no iteration."""
        return {"queued_bytes": self.queued, "memory_budget": self.cfg.memory_budget,
                "producers": len(self.sessions), "commits_in_progress": len(self.committing),
                "draining": self.stopping, "remote": self.upkeep.remote_figures() if self.upkeep else None,
                "peer": self.upkeep.peer_figures() if self.upkeep else None,
                "advice": self.measuring.all_advice() if self.measuring else {}}

    def _status_report(self) -> dict[str, Any]:
        """What `ckptd status` prints (the wire's ``report``)."""
        snap, now = self.figures.snapshot(), time.time()
        return {
            "version": __version__, "pid": os.getpid(), "state": "stopping" if self.stopping else "serving",
            "endpoint": self.endpoint, "root": str(self.root), "time": now, "started": snap["started"],
            "metrics": self.metrics.url if self.metrics else None,
            "queued_bytes": self.queued, "memory_budget": self.cfg.memory_budget,
            "commits_in_progress": len(self.committing),
            "producers": [
                {"run": s.run, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "host": s.host,
                 "transport": "shm" if s.shm is not None else "inline",
                 "open_steps": sorted(k for k, st in s.steps.items() if st.share.error is None)}
                for s in self.sessions.values()
            ],
            "commits": snap["commits"], "bytes_written": snap["bytes_written"], "bytes_reused": snap["bytes_reused"], "errors": snap["errors"],
            "commit_seconds": {"sum": snap["latency"]["sum"], "count": snap["latency"]["count"]},
            "last_commit": snap["last_commit"], "recent_commits": snap["recent"],
            "runs": snap["runs"],
            "remote": self.upkeep.remote_figures() if self.upkeep else None,  # the uploads, with [remote]
            "peer": self.upkeep.peer_figures() if self.upkeep else None,  # replicas sent and held, with [peer]
            "advice": self.measuring.all_advice() if self.measuring else {},  # per run (docs/advise.md)
        }

    def _read_batch(self, limit: int = 256) -> None:
        """Handle the messages waiting now (up to ``limit``), then send coalesced acks."""
        assert self.router is not None
        for _ in range(limit):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._handle(frames)
            if self.queued >= self.cfg.memory_budget:
                break
        for sess in self.sessions.values():
            self._ack(sess)

    def _ack(self, sess: Session) -> None:
        through = sess.acknowledgeable()
        if through > sess.acked:
            self._send(sess.identity, "ack", seq=through)
            sess.acked = through

    # -- staging arenas handed over by local producers (ckptd.handoff) ---------------------
    def _take_handoffs(self, poller: zmq.Poller, events: dict[Any, int]) -> None:
        assert self.handoffs is not None
        if self.handoffs.fileno() in events:
            for fd in self.handoffs.accept():
                poller.register(fd, zmq.POLLIN)
        for fd in [fd for fd in self.handoffs.connections if fd in events]:
            poller.unregister(fd)
            refused = self.handoffs.receive(fd)
            if refused:
                log.warning("%s", refused)

    def _expire_handoffs(self, poller: zmq.Poller, now: float) -> None:
        assert self.handoffs is not None
        for fd in self.handoffs.expire(now):
            poller.unregister(fd)

    def _map_arena(self, h: dict[str, Any]) -> tuple[memoryview, tuple[int, int]] | None:
        """Map the staging arena that the hello's token names, read-only; return it and
        its identity, or None (and a warning: the producer then sends inline, or fails if
        it insists) if it cannot."""
        why = None
        claimed = self.handoffs.claim(h["shm_token"]) if self.handoffs is not None else None
        if claimed is None:
            why = "no staging memory was handed over under its token"
        elif claimed.size < h["shm_size"]:
            why = f"its staging memory is {claimed.size} bytes, not the {h['shm_size']} its hello declares"
        else:
            try:
                mm = mmap.mmap(claimed.fd, h["shm_size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                why = f"mapping its staging memory failed: {exc}"
        if claimed is not None:
            os.close(claimed.fd)  # the mapping keeps the memory alive
        if why is not None:
            log.warning("producer of run %r rank %s (pid %s): %s; it sends tensors inline",
                        h["run"], h["rank"], h["pid"], why)
            return None
        return memoryview(mm), claimed.ident

    def _disown_arena(self, arena: tuple[int, int]) -> None:
        """The arena is back under a new session, whose producer reuses it from now on:
        fail the commits still being written from it (their producer was told already)."""
        for share in self.arena_commits.pop(arena, []):
            if share.error is None:
                share.error = (f"step {share.step} was not saved: its producer reconnected before the daemon "
                               "had written its shared staging memory, which the producer now reuses")
                log.warning("run=%s step=%d rank=%d: %s", share.run, share.step, share.rank, share.error)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            header, payload = wire.decode(frames[1:])
        except ProtocolError as exc:
            log.warning("bad message from peer %s: %s", identity.hex(), exc)
            self.figures.error("protocol")
            self._send(identity, "error", seq=None, step=None, message=f"protocol error: {exc}")
            return
        op = header["op"]
        sess = self.sessions.get(identity)
        if sess is not None:
            sess.last_seen = time.monotonic()
        if sess is None and op not in ("hello", "latest", "status"):
            # After a daemon restart, a producer's socket reconnects by itself and
            # keeps talking: tell it that its session (and steps in flight) are gone.
            self._send(identity, "error", seq=header.get("seq"), step=None, code=wire.NO_SESSION,
                       message=f"{op!r} from a producer without a session (the daemon restarted?); send hello first")
            return
        try:
            if op == "hello":
                self._on_hello(identity, header, frames[1])
            elif op == "ping":
                self._send(identity, "pong", seq=header["seq"])
            elif op == "latest":
                self._on_latest(identity, header)
            elif op == "status":
                self._send(identity, "report", seq=header["seq"], status=self._status_report())
            elif op == "tensor":
                assert sess is not None
                self._on_tensor(sess, header, payload)
            elif op == "tensors":
                assert sess is not None
                self._on_tensors(sess, header)
            elif op == "same":
                self._on_same(sess, header)
            elif op == "commit":
                self._on_commit(sess, header)
            elif op == "abort":
                self._drop_step(sess, header["step"])
            elif op == "drain":
                self._on_drain(sess)
            elif op == "bye":
                self._end_session(sess, "said bye")
            else:
                raise ProtocolError(f"{op!r} is not a message a producer sends")
        except ProtocolError as exc:
            log.warning("peer %s: %s", sess.label if sess else identity.hex(), exc)
            self.figures.error("protocol")
            self._send(identity, "error", seq=header.get("seq"), step=None, message=str(exc))

    # -- messages ---------------------------------------------------------------------
    def _on_hello(self, identity: bytes, h: dict[str, Any], frame: zmq.Frame) -> None:
        if self.stopping:
            log.info("refused a producer of run %r (pid %s): the daemon is stopping", h["run"], h["pid"])
            self._send(identity, "error", seq=None, step=None, code=wire.STOPPING,
                       message="the daemon is stopping; connect again once it has restarted")
            return
        if h["v"] != wire.VERSION:
            raise ProtocolError(f"protocol version {h['v']} is not supported; this daemon speaks {wire.VERSION}")
        try:
            check_run(h["run"])
            check_rank(h["rank"], h["world_size"])
            if h["attempt"] is not None:
                check_attempt(h["attempt"])
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        fmt = h["format"] or self.cfg.format
        if fmt not in FORMATS:
            raise ProtocolError(f"format {fmt!r} is not one of {', '.join(map(repr, FORMATS))}")
        for other in self.sessions.values():
            if other.run == h["run"] and other.world_size != h["world_size"] and other.identity != identity:
                raise ProtocolError(
                    f"run {h['run']!r} already has producers with world_size {other.world_size}, "
                    f"not {h['world_size']}"
                )
        if not self.cfg.shared_runs:
            try:
                self.owners.check(h["run"], principal(frame, tcp=not self.endpoint.startswith("ipc://")))
            except NotOwner as exc:
                raise ProtocolError(str(exc)) from None
            except OSError as exc:
                raise ProtocolError(f"cannot tell who owns run {h['run']!r}: {exc}") from None
        if identity in self.sessions:
            self._end_session(self.sessions[identity], "said hello again")
        key = (h["run"], h["rank"])
        previous = self.owner.get(key)
        if previous is not None and previous in self.sessions:
            # A restarted trainer: its predecessor's unfinished steps can never complete.
            gone = self.sessions[previous]  # another process took its rank: it is gone without a goodbye
            self._end_session(gone, "was replaced by a new producer for the same rank",
                              failed=(gone.pid, gone.host) != (h["pid"], h["host"]))
        if h["retention"] is not None:
            assert self.upkeep is not None
            try:
                self.upkeep.set_run_policy(h["run"], h["retention"])
            except ConfigError as exc:
                raise ProtocolError(str(exc)) from None
        sess = Session(identity, h["run"], h["rank"], h["world_size"], h["pid"], h["host"], fmt,
                       attempt=h["attempt"], chunk_size=self.cfg.chunk_size)
        if h["shm_token"] is not None and h["shm_size"] is not None:
            mapped = self._map_arena(h)
            if mapped is not None:
                sess.shm, sess.arena = mapped
                self._disown_arena(sess.arena)  # before the welcome: nothing is reused yet
                # Chunks gather in the producer's arena until written: at most a quarter
                # of it per chunk, so that writing one never waits for the arena to fill.
                sess.chunk_size = max(1, min(self.cfg.chunk_size, len(sess.shm) // 4))
        self.sessions[identity] = sess
        self.owner[key] = identity
        assert self.measuring is not None
        self.measuring.hello(sess.run, sess.attempt)
        pid = peer_pid(frame) if self.endpoint.startswith("ipc://") else None
        if pid is not None:  # tcp:// producers keep session_timeout
            self.liveness.watch(identity, pid)
        log.info("producer connected: %s host=%s format=%s transport=%s", sess.label, sess.host, sess.format,
                 "shm" if sess.shm is not None else "inline")
        self._send(identity, "welcome", v=wire.VERSION, max_frame=self.cfg.max_frame, daemon_pid=os.getpid(),
                   shm=sess.shm is not None, batch=True, advice=self.measuring.advice(sess.run, max_age=1.0))

    def _on_latest(self, identity: bytes, h: dict[str, Any]) -> None:
        try:
            check_run(h["run"])
        except ValueError as exc:
            raise ProtocolError(f"latest: {exc}") from None
        assert self.upkeep is not None
        info = self.upkeep.latest(h["run"])  # from the index: no disk access
        self._send(identity, "answer", seq=h["seq"], info=info.to_dict() if info else None)

    def _open_step(self, sess: Session, step: int, seq: int) -> OpenStep:
        """The open step ``step`` of ``sess``, created on first use. A step that may not
        be written is still returned, already failed, so that the rest of its
        messages are dropped quietly until the producer aborts or commits it."""
        open_step = sess.steps.get(step)
        if open_step is not None:
            return open_step
        assert self.writer is not None
        open_step = sess.steps[step] = OpenStep(
            Share(self.root, sess.run, sess.rank, sess.world_size, step, format=sess.format, owner=sess.identity,
                  attempt=sess.attempt, chunk_size=self.cfg.chunk_size),
            self.writer, sess.chunk_size)
        try:
            check_step(step)
        except ValueError as exc:
            self._fail_step(sess, open_step, str(exc), seq)
            return open_step
        if self.stopping:  # draining: steps begun before SIGTERM finish, new ones do not start
            self._fail_step(sess, open_step, (
                f"the daemon is stopping: step {step} of run {sess.run!r} was refused and not saved; "
                "save it again once the daemon has restarted"), seq, discard=False)
            return open_step
        verdict = resave(open_step.share.dir, sess.run, sess.rank, step, sess.attempt,
                         in_flight=(sess.run, sess.rank, step) in self.committing)
        if verdict.error is not None:
            self._fail_step(sess, open_step, verdict.error, seq, discard=False)
        elif verdict.replace:
            self.writer.replace_earlier(open_step.share)
        return open_step

    def _on_tensor(self, sess: Session, h: dict[str, Any], payload: zmq.Frame | None) -> None:
        seq = sess.received = h["seq"]  # an inline piece is received: its staging is free
        self.upkeep.received()  # a snapshot is under way: uploads to the remote tier hold off
        open_step = self._open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return  # failed and reported; dropped until the producer aborts
        try:
            if payload is not None:
                if len(payload) > self.cfg.max_frame:  # libzmq's limit also admits 64 MiB headers
                    raise StepError(f"tensor {h['name']!r}: a piece of {len(payload)} bytes exceeds "
                                    f"max_frame ({self.cfg.max_frame})")
                self.queued += open_step.add_piece(h, payload.buffer)
                return
            open_step.add_piece(h, self._shared_piece(sess, h), seq)
        except StepError as exc:
            self._fail_step(sess, open_step, str(exc), seq)
            return
        sess.unwritten.append(seq)  # its staging is free once the writer is done with it
        if sum(st.gathered for st in sess.steps.values()) >= len(sess.shm) // 2:
            # Several open steps gather chunks in the arena: write them before it fills.
            for st in sess.steps.values():
                st.flush()

    def _on_tensors(self, sess: Session, h: dict[str, Any]) -> None:
        """A batch of small tensors in one region of shared memory (docs/protocol.md)."""
        seq = sess.received = h["seq"]
        open_step = self._open_step(sess, h["step"], seq)
        if open_step.share.error is not None:
            return
        taken = 0
        try:
            for piece in wire.batch_pieces(h):
                open_step.add_piece(piece, self._shared_piece(sess, piece), seq)
                taken += piece["length"] > 0  # an empty tensor holds no piece of the region
        except StepError as exc:
            self._fail_step(sess, open_step, str(exc), seq)
        if taken:  # the pieces handed on are reported written, one by one
            sess.expect(seq, taken)
        if sum(st.gathered for st in sess.steps.values()) >= len(sess.shm or b"") // 2:
            for st in sess.steps.values():
                st.flush()

    def _on_same(self, sess: Session, h: dict[str, Any]) -> None:
        """Tensors declared unchanged since an earlier step (``save(frozen=...)``)."""
        open_step = self._open_step(sess, h["step"], h["seq"])
        if open_step.share.error is not None:
            return
        try:
            open_step.add_same(h)
        except StepError as exc:
            self._fail_step(sess, open_step, str(exc), h["seq"])

    @staticmethod
    def _shared_piece(sess: Session, h: dict[str, Any]) -> memoryview:
        """The piece's bytes in the producer's arena, checked against the arena's bounds."""
        if sess.shm is None:
            raise StepError(f"tensor {h['name']!r} names shared memory, but this producer shared none")
        start, end = h["offset"], h["offset"] + h["length"]
        if end > len(sess.shm):
            raise StepError(
                f"tensor {h['name']!r}: bytes [{start}, {end}) lie outside the {len(sess.shm)} bytes "
                "of shared staging memory"
            )
        return sess.shm[start:end]

    @staticmethod
    def _on_drain(sess: Session) -> None:
        """The producer waits for staging: hand every chunk still gathered in its arena to
        the writer, so that it waits only for bytes being written (docs/protocol.md)."""
        for open_step in sess.steps.values():
            open_step.flush()

    def _flush_chunks(self) -> None:
        for sess in self.sessions.values():
            for open_step in sess.steps.values():
                open_step.flush()

    def _on_commit(self, sess: Session, h: dict[str, Any]) -> None:
        step, seq = h["step"], h["seq"]
        open_step = self._open_step(sess, step, seq)
        share = open_step.share
        try:
            open_step.check_commit(h)
            structure = _parse_json(h["state"], "state")
            metadata = _parse_json(h["metadata"], "metadata")
            if not isinstance(metadata, dict):
                raise StepError("commit metadata must be a JSON object")
            missing = [n for n in state_mod.tensor_names(structure)
                       if n not in open_step.names and n not in share.replicas]
            if missing:
                raise StepError(f"the saved state refers to tensors never sent: {missing[:5]}")
        except StepError as exc:
            if share.error is None:
                self._fail_step(sess, open_step, str(exc), seq)
            else:  # the step failed earlier: this is the commit's answer
                self._send(sess.identity, "error", seq=seq, step=step,
                           message=f"step {step} was not committed: {share.error}")
            self._drop_step(sess, step)
            return
        open_step.flush()
        del sess.steps[step]
        self._timings[(share.run, share.rank, step)] = h["timing"]
        self.committing.add((share.run, share.rank, step))
        if sess.arena is not None:
            self.arena_commits.setdefault(sess.arena, []).append(share)
        assert self.writer is not None
        self.writer.commit(share, structure, metadata, token=(sess.identity, seq, open_step.received_bytes))

    def _fail_step(self, sess: Session, open_step: OpenStep, message: str, seq: int | None,
                   *, discard: bool = True) -> None:
        """Report a failed step once and throw away what was written of it."""
        share = open_step.share
        log.warning("%s step=%d failed: %s", sess.label, share.step, message)
        self.figures.error("step")
        self._send(sess.identity, "error", seq=seq, step=share.step, message=message)
        share.error = message
        share.reported = True
        self._release_partial(sess, open_step)
        open_step.flush()  # the writer frees (not writes) a failed share's bytes
        if discard:
            assert self.writer is not None
            self.writer.discard(share)

    def _drop_step(self, sess: Session, step: int) -> None:
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

    def _end_session(self, sess: Session, why: str, *, failed: bool = False) -> None:
        """End a session; ``failed``: its producer went without a goodbye (its attempt failed)."""
        log.info("producer %s %s; discarding %d unfinished step(s)", sess.label, why, len(sess.steps))
        if failed and self.measuring is not None:
            self.measuring.ended(sess.run, sess.attempt, why)
        for step in list(sess.steps):
            self._drop_step(sess, step)
        self.sessions.pop(sess.identity, None)
        self.liveness.forget(sess.identity)
        if self.owner.get((sess.run, sess.rank)) == sess.identity:
            del self.owner[(sess.run, sess.rank)]

    def _end_dead_sessions(self, now: float) -> None:
        """End the sessions of local producers whose process exited (ckptd.daemon.liveness)."""
        last_seen = lambda i: self.sessions[i].last_seen if i in self.sessions else 0.0  # noqa: E731
        for identity, pid in self.liveness.ended(now, last_seen):
            if identity in self.sessions:
                self._end_session(self.sessions[identity], f"died (process {pid} exited)", failed=True)
            else:  # never happens: sessions and the watch end together; a stray watch must not stop the loop
                self.liveness.forget(identity)

    def _keep_alive(self, now: float) -> None:
        """While the daemon is not reading (over budget), producers' pings go unread:
        tell them it is alive, and do not hold their silence against them."""
        for sess in self.sessions.values():
            sess.last_seen = now
            self._send(sess.identity, "pong", seq=0)

    def _expire_sessions(self, now: float) -> None:
        for sess in list(self.sessions.values()):
            if now - sess.last_seen > self.cfg.session_timeout:
                self._end_session(sess, f"was silent for {self.cfg.session_timeout:.0f} s", failed=True)

    # -- results from the I/O threads ----------------------------------------------------
    def _post(self, result: Result) -> None:  # called from I/O threads
        self.results.put(result)
        self._wake.wake()

    def _drain_results(self) -> None:
        while True:
            try:
                r = self.results.get_nowait()
            except queue.Empty:
                return
            self.queued -= r.nbytes
            share = r.share
            if r.seqs:
                sess = self.sessions.get(share.owner)
                if sess is not None:
                    sess.mark_written(r.seqs)
                    self._ack(sess)
            if r.kind == "failed":
                self._report_failure(share, r.message)
            elif r.kind in ("committed", "commit_failed"):
                self.committing.discard((share.run, share.rank, share.step))
                timing = self._timings.pop((share.run, share.rank, share.step), None)
                self._forget_arena_commit(share)
                identity, seq, nbytes = r.token
                if r.kind == "committed":
                    assert r.info is not None
                    secs = max(time.monotonic() - share.started, 1e-9)
                    # received but stored already; and copied from an earlier step (daemon.reuse)
                    nbytes += share.copied - share.recognised
                    log.info("committed run=%s step=%d rank=%d bytes=%d reused=%d tensors=%d seconds=%.3f "
                             "rate=%s", share.run, share.step, share.rank, nbytes, share.reused,
                             len(share.records), secs, units.rate(nbytes, secs))
                    self.figures.committed(share.run, share.step, share.rank, nbytes, secs, share.reused)
                    assert self.measuring is not None
                    self.measuring.committed(share.run, share.rank, share.step, share.attempt, timing, secs)
                    self._send(identity, "committed", seq=seq, step=share.step, info=r.info.to_dict(),
                               advice=self.measuring.advice(share.run, max_age=1.0))
                else:
                    self.figures.error("commit")
                    self._send(identity, "error", seq=seq, step=share.step,
                               message=f"step {share.step} was not committed: {r.message}")

    def _forget_arena_commit(self, share: Share) -> None:
        for arena, shares in list(self.arena_commits.items()):
            if share in shares:
                shares.remove(share)
                if not shares:
                    del self.arena_commits[arena]
                return

    def _report_failure(self, share: Share, message: str) -> None:
        """Tell the producer at once when a write failed, before it commits."""
        identity = self.owner.get((share.run, share.rank))
        sess = self.sessions.get(identity) if identity else None
        if sess is not None and sess.steps.get(share.step) is not None and sess.steps[share.step].share is share:
            if not share.reported:
                share.reported = True
                self.figures.error("step")
                self._send(sess.identity, "error", seq=None, step=share.step, message=message)

    # -- sending ------------------------------------------------------------------------
    def _send(self, identity: bytes, op: str, **fields: Any) -> None:
        assert self.router is not None
        try:
            self.router.send_multipart([identity, wire.encode(op, **fields)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading
            log.debug("reply %s to %s dropped: %s", op, identity.hex(), exc)

    # -- shutdown ------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """After the drain: let the producers go, finish what the I/O threads hold.

        The loop exits once every commit received is durable and no step is open,
        so the only steps left here already failed and were reported; any other
        step still gets its error, never silence."""
        log.info("drained: every commit received is durable; letting %d producer(s) go", len(self.sessions))
        for sess in list(self.sessions.values()):
            for step, open_step in sess.steps.items():
                if open_step.share.error is None:
                    self._send(sess.identity, "error", seq=None, step=step,
                               message=f"the daemon stopped before step {step} was committed")
            # so that the producer says "stopped" at once, not "no answer" a timeout later
            self._send(sess.identity, "error", seq=None, step=None, code=wire.STOPPING,
                       message=f"the ckptd daemon (pid {os.getpid()}) stopped")
            self._end_session(sess, "was disconnected: the daemon is stopping")
        assert self.writer is not None
        self.writer.close()  # runs every queued job, commits included
        self.writer = None
        self._drain_results()


def _parse_json(text: str, what: str) -> Any:
    try:
        value = json.loads(text)
        # json.loads takes NaN, Infinity, 1e999 and lone surrogates, which the manifest
        # cannot hold: refuse them here, or its write fails on the syncer thread
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return value
    except (ValueError, RecursionError) as exc:
        raise StepError(f"commit {what} is not valid JSON: {exc}") from None


def serve(config: Config) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; return the exit status."""
    logging.captureWarnings(True)  # a library's warnings.warn() is a log line like any other
    use_journal_priorities()  # under systemd: journalctl -p warning finds warnings
    # A crash or the watchdog's SIGABRT prints every thread's stack to the log.
    faulthandler.enable(all_threads=True)
    daemon = Daemon(config)
    try:
        daemon.start()
        daemon.serve_forever()
    finally:
        daemon.close()
    log.info("stopped")
    return 0


