"""The writer daemon: ``Daemon`` runs one main loop over a few parts, and ``serve`` runs it.

The loop is a sequence of named steps (``serve_forever``, as gunicorn's arbiter):
signals, the drain's end, poll, the I/O threads' results, messages, housekeeping.
The parts: ``Sessions`` (who is connected), ``Ledger`` (bytes and commits under way),
``Lifecycle`` (signals, drain, systemd), ``Replies`` (the ROUTER socket), and
``Handlers`` (one method per message), which get the parts they use.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import math
import os
import queue
import signal
import time
from typing import Any, Iterator

import zmq

from .. import env, failpoints
from ..config import Config, ConfigError, load as load_config, writer_threads
from ..transport import wire
from ..transport.wakeup import WakePipe
from .arenas import Arenas
from .handlers import Handlers
from .ledger import Ledger
from .lifecycle import Lifecycle, Reporter, keep_freed_memory, lower_priority
from .liveness import Liveness
from .measuring import Measuring
from .metrics import Figures, MetricsServer
from .notify import use_journal_priorities
from .owners import Owners
from .recovery import remove_orphans
from .bucket_relay import BucketFetch
from .landing_jobs import ShareJobs
from .relay import Relay
from .replies import Replies
from .sessions import Sessions
from .share import Result
from .stagehold import StagingHolds
from .upkeep import Upkeep
from .writer import Writer

log = logging.getLogger("ckptd.daemon")


class Inbox:
    """What the I/O threads hand the main loop; its pipe wakes the loop (signals' too)."""

    def __init__(self) -> None:
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.pipe = WakePipe()

    def post(self, result: Result) -> None:
        self._results.put(result)
        self.pipe.wake()

    def take(self) -> Iterator[Result]:
        while True:
            try:
                yield self._results.get_nowait()
            except queue.Empty:
                return


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.lifecycle = Lifecycle(config.daemon.drain_timeout)
        self.replies = Replies(config)
        self.arenas = Arenas()
        self.inbox = Inbox()
        self.poller = zmq.Poller()
        self.upkeep: Upkeep | None = None
        self.writer: Writer | None = None
        self.ledger: Ledger | None = None
        self.sessions: Sessions | None = None
        self.reporter: Reporter | None = None
        self.handlers: Handlers | None = None

    def start(self) -> None:
        """Lock the root, clean it, bind. After this the daemon is ready to serve."""
        config, cfg, root = self.config, self.config.daemon, self.config.root
        lower_priority(cfg.nice)  # before any thread starts: threads inherit it
        keep_freed_memory()
        root.mkdir(parents=True, exist_ok=True)
        self.lifecycle.lock(root)
        removed = remove_orphans(root)
        if removed:
            log.info("removed %d orphan file(s) left by an earlier crash", removed)
        upkeep = self.upkeep = Upkeep(config)
        measuring = Measuring(root, config.advise.mtbf, upkeep.tier_names())
        ledger = self.ledger = Ledger(cfg.memory_budget, Figures(), measuring)
        upkeep.on_persisted(measuring.uploaded)
        upkeep.yield_to(ledger.busy)
        holds = StagingHolds(wake=self.inbox.pipe.wake)
        holds.enabled = upkeep.send_staged(holds.find, holds.sent)
        upkeep.start()
        writer = self.writer = Writer(self.inbox.post, fsync=cfg.fsync, after_commit=upkeep.after_commit,
                                      hdf5=config.hdf5, direct_io=cfg.direct_io, write_rate=cfg.write_rate,
                                      threads=writer_threads(cfg.writer_threads),
                                      reuse_unchanged=cfg.reuse_unchanged, holds=holds)
        self.replies.bind(self.arenas)
        sessions = self.sessions = Sessions(Liveness(cfg.session_timeout), Owners(root), ledger, self.replies,
                                            writer)
        reporter = self.reporter = Reporter(config, self.lifecycle, sessions, ledger, upkeep)
        shares = ShareJobs(root, self.inbox.pipe.wake)
        relay = reporter.relay = Relay(config, self.replies, self.inbox.pipe.wake,
                                       sessions.owners, shares) if config.peer.enabled else None
        fetch = reporter.fetch = BucketFetch(config, self.replies, self.inbox.pipe.wake, shares) \
            if config.remote.enabled else None
        if fetch is not None:
            upkeep.serve_pulls(fetch.pull)
        self.handlers = Handlers(config, sessions=sessions, ledger=ledger, replies=self.replies,
                                 lifecycle=self.lifecycle, arenas=self.arenas, writer=writer, upkeep=upkeep,
                                 reporter=reporter, relay=relay, fetch=fetch)
        if cfg.metrics:
            self.lifecycle.metrics = MetricsServer(cfg.metrics, ledger.figures, reporter.live_figures)
        self.lifecycle.install(self.inbox.pipe.write_fd)
        log.info("serving %s, checkpoints under %s (pid %d)", config.endpoint, root, os.getpid())
        # Only now (docs/service.md): orphans are gone, the index is built, the socket listens.
        self._notify_status("READY=1")

    def close(self) -> None:
        if self.handlers is not None and self.handlers.relay is not None:
            self.handlers.relay.close()  # its threads post replies the loop no longer sends
        if self.handlers is not None and self.handlers.fetch is not None:
            self.handlers.fetch.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.take_results()
        if self.upkeep is not None:
            self.upkeep.close()
            self.upkeep = None
        if self.ledger is not None:
            self.ledger.measuring.close()
        self.replies.close()
        self.arenas.close()
        if self.sessions is not None:
            self.sessions.liveness.close()
        self.lifecycle.close()

    def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain: refuse new steps, finish the rest,
        exit. The loop wakes at least every second, and twice per watchdog interval,
        to send WATCHDOG=1: a hung loop stops the pings, and systemd restarts it."""
        assert self.sessions is not None
        self.poller.register(self.inbox.pipe.fd, zmq.POLLIN)
        self.arenas.register(self.poller)
        self.poller.register(self.sessions.liveness.fileno(), zmq.POLLIN)
        while True:
            self.handle_signals()
            if self.maybe_finish_drain():
                break
            events = self.poll()
            self.take_results()
            self.read_messages(events)
            self.watch_producers(events)
            self.housekeep()
        self._shutdown()

    def handle_signals(self) -> None:
        """Call ``handle_<signal>`` for each signal queued since the last pass."""
        now = time.monotonic()
        for signum in self.lifecycle.take_signals():
            getattr(self, "handle_" + signal.Signals(signum).name[3:].lower())(signum, now)

    def maybe_finish_drain(self) -> bool:
        """While stopping: whether every commit received is durable and no step is open.
        Past the drain's deadline, open steps fail, told why."""
        assert self.sessions is not None and self.ledger is not None
        if not self.lifecycle.stopping:
            return False
        if self.lifecycle.deadline_passed(time.monotonic()):
            for sess, open_step in self.sessions.open_steps():
                self.sessions.fail_step(sess, open_step, (
                    f"the daemon is stopping and stopped waiting for step {open_step.share.step} to be "
                    f"committed ({self.lifecycle.why}); it was not saved"), None)
        if self.ledger.commits or self.sessions.open_steps():
            return False
        if self.replies.reading:
            self._read_batch()
        return True

    def poll(self) -> dict[Any, int]:
        """Wait for messages, results, signals or a deadline, reading only within budget."""
        assert self.sessions is not None and self.ledger is not None and self.handlers is not None
        now = time.monotonic()
        timeout = self.lifecycle.ping(now)
        if self.sessions.liveness.pending():
            timeout = min(timeout, 0.1)
        settle = self.handlers.settle_deadline()
        if settle is not None:
            timeout = min(timeout, settle - now)
        reading = not self.ledger.over_budget
        if not reading and self.replies.reading:
            # Over budget: messages wait in the producers' staging (they block or raise
            # there), so what gathers in arenas goes to the writer.
            for sess in self.sessions:
                sess.flush()
        self.replies.follow(self.poller, reading)
        events = dict(self.poller.poll(math.ceil(max(timeout, 0.0) * 1000)))
        if self.inbox.pipe.fd in events:
            self.inbox.pipe.drain()
        return events

    def take_results(self) -> None:
        """Account for what the I/O threads finished; answer commits."""
        for result in self.inbox.take():
            if self.handlers is not None:
                self.handlers.on_result(result)
        if self.writer is not None and self.sessions is not None:
            self.writer.holds.settle(self.sessions)
        if self.handlers is not None:
            self.handlers.answer_settled(time.monotonic())

    def read_messages(self, events: dict[Any, int]) -> None:
        self.arenas.take(self.poller, events)
        if self.replies.readable(events):
            self._read_batch()

    def watch_producers(self, events: dict[Any, int]) -> None:
        """End the sessions of local producers that died; a moving drain is noted."""
        assert self.sessions is not None
        now, liveness = time.monotonic(), self.sessions.liveness
        if self.replies.reading and (liveness.fileno() in events or liveness.pending()):
            self.sessions.end_dead(now)
        if self.lifecycle.stopping and events:
            self.lifecycle.moved(now)

    def housekeep(self) -> None:
        """Once a second: expire handoffs and silent sessions, tell systemd how it goes."""
        assert self.sessions is not None
        now = time.monotonic()
        if not self.lifecycle.housekeeping_due(now):
            return
        self.arenas.expire(self.poller, now)
        if self.replies.reading:
            self.sessions.expire(now)
        else:
            self.sessions.keep_alive(now)
        if self.lifecycle.stopping:
            self.lifecycle.extend_stop_timeout(now)
        self._notify_status()

    def _read_batch(self, limit: int = 256) -> None:
        """Handle the messages waiting now (up to ``limit``), then send coalesced acks."""
        assert self.sessions is not None and self.ledger is not None and self.handlers is not None
        for _ in range(limit):
            frames = self.replies.receive()
            if frames is None:
                break
            self.handlers.dispatch(frames)
            if self.ledger.over_budget:
                break
        self.sessions.ack_all()

    def _notify_status(self, *lines: str) -> None:
        assert self.reporter is not None
        self.lifecycle.notify(self.reporter.line(), *lines)

    def handle_term(self, signum: int, now: float) -> None:
        """Drain: finish the commits received, wait for open steps, refuse new ones."""
        assert self.sessions is not None and self.ledger is not None
        if self.lifecycle.stopping:
            self.lifecycle.stop_waiting(signum, now)
            return
        self.lifecycle.begin_drain(now)
        log.info(
            "stopping on %s: finishing %d commit(s) in progress; waiting up to %g s for %d open step(s) "
            "to be committed; refusing new steps and producers", signal.Signals(signum).name,
            self.ledger.commits, self.config.daemon.drain_timeout, len(self.sessions.open_steps()))
        self._notify_status("STOPPING=1")

    handle_int = handle_term

    def handle_hup(self, signum: int, now: float) -> None:
        """Re-read the config file and apply its logging and retention settings;
        connections and steps in flight are untouched."""
        path = self.config.path
        if path is None:
            log.warning("SIGHUP: the daemon was started without a config file; nothing to reload")
            return
        self.lifecycle.notifier.send("RELOADING=1",
                                     f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        try:
            new = load_config(path)
        except ConfigError as exc:
            log.error("SIGHUP: not reloaded, the running settings stay: %s", exc)
        else:
            log.info("reloaded %s: log_level = %s; [retention] applied", path, new.daemon.log_level)
            logging.getLogger().setLevel(new.daemon.log_level.upper())
            if self.upkeep is not None:
                self.upkeep.reload(new.retention)
            cfg = self.config.daemon
            later = [f.name for f in dataclasses.fields(new.daemon)
                     if f.name != "log_level" and getattr(new.daemon, f.name) != getattr(cfg, f.name)]
            if later:
                log.warning("%s changed in %s; a restart applies %s", ", ".join(later), path,
                            "it" if len(later) == 1 else "them")
        self._notify_status("READY=1")

    def _shutdown(self) -> None:
        """After the drain: let the producers go, finish what the I/O threads hold. The
        steps left here failed and were reported; any other still gets its error."""
        assert self.sessions is not None and self.handlers is not None and self.writer is not None
        assert self.ledger is not None
        log.info("drained: every commit received is durable (newest: %s); letting %d producer(s) go",
                 self.ledger.finished(), len(self.sessions))
        self.handlers.answer_settled(time.monotonic(), every=True)
        for sess in self.sessions:
            for step, open_step in sess.steps.items():
                if open_step.share.error is None:
                    self.replies.send(sess.identity, "error", seq=None, step=step,
                                      message=f"the daemon stopped before step {step} was committed")
            self.replies.send(sess.identity, "error", seq=None, step=None, code=wire.STOPPING,
                              message=f"the ckptd daemon (pid {os.getpid()}) stopped")
            self.sessions.end(sess, "was disconnected: the daemon is stopping")
        self.writer.close()
        self.writer = None
        self.take_results()


def serve(config: Config) -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; return the exit status."""
    logging.captureWarnings(True)
    use_journal_priorities()
    faulthandler.enable(all_threads=True)
    failpoints.arm(env.failpoints())
    daemon = Daemon(config)
    try:
        daemon.start()
        daemon.serve_forever()
    finally:
        daemon.close()
    log.info("stopped")
    return 0
