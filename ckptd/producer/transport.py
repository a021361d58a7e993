"""The producer's end of the wire: a DEALER socket owned by one thread, ``ckptd-sender``.

The training thread never touches the socket (ZeroMQ's are not thread-safe): it queues
messages on a ``Transport`` and returns. The sender waits for a staged GPU copy's event,
ships zero-copy frames, hands replies to ``on_reply``, pings, and calls ``on_lost`` once
the daemon is silent too long or, over ``ipc://``, its process exited (``pidwatch``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from ..transport import wire
from ..transport import curve
from ..transport.pidwatch import ProcessWatch, Silence, peer_pid
from ..transport.wakeup import WakePipe
from ..errors import ProtocolError

log = logging.getLogger("ckptd.producer")


CLOSE_LINGER_MS = 1000
# once nothing came from a dead daemon for this long, libzmq has handed on all it sent
GRACE_S = 0.5
# how long a silent daemon whose process runs is waited for: ``timeout``s, seconds (pidwatch.Silence)
BUSY_TIMEOUTS, BUSY_LIMIT_S = 6, 60.0


@dataclass
class _Link:
    """The sender thread's connection: its socket and what it knows of the daemon.

    ``want_pid``: over ipc://, until the first reply names the daemon's process
    ``died``: when the daemon's process was seen to exit
    ``silence``: over ipc://: whether the daemon's silence means it is hung"""

    sock: zmq.Socket
    poller: zmq.Poller
    handshake: curve.Handshake
    want_pid: bool
    last_heard: float
    last_ping: float
    outbox: list[tuple[bytes, Any, Any]] = field(default_factory=list)
    seq: int = 0
    daemon: ProcessWatch | None = None
    died: float | None = None
    silence: Silence | None = None


class Transport:
    """One connection to the daemon. ``lost``: why it ended (then ``on_lost`` ran);
    ``refused``: why the daemon refused this producer's CurveZMQ key; ``stopped``: the
    daemon said it stopped (or is stopping)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float,
        heartbeat: float,
        on_reply: Callable[[dict[str, Any]], None],
        on_lost: Callable[[str], None],
        curve_keys: curve.ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._timeout = timeout
        self._heartbeat = heartbeat
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._curve_keys = curve_keys
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = WakePipe()
        # only a sender asleep in poll needs a wake-up: one per message would slow the training thread
        self._idle = False
        self._stop = False
        self._linger = True
        self.lost: str | None = None
        self.refused: str | None = None
        self.stopped = False
        self._welcomed = False
        self._next_proc_check = 0.0
        # its own context: close() terminates it, which waits until the bye has left the socket
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="ckptd-sender", daemon=True)
        self._thread.start()

    def send(self, header: bytes, payload: Any = None, event: Any = None, *, wake: bool = True) -> None:
        """Queue one message; ``event`` (a CUDA event) must complete before it ships.

        ``wake=False`` leaves the sender asleep: it ships the message at the next
        woken send or ``kick``, or within ``heartbeat / 2`` s on its own. A save's
        tensors go that way, so that neither the sender's wake-ups (each one takes
        the GIL from the training thread) nor the daemon's reading and hashing
        compete with the copy on the training node's cores; the commit wakes it."""
        self._queue.put((header, payload, event))
        if wake and self._idle:
            self._wake.wake()

    def kick(self) -> None:
        """Ship what ``send(wake=False)`` queued, now."""
        if self._idle:
            self._wake.wake()

    def close(self, linger: bool = True) -> None:
        """Send what is queued (briefly), then stop the thread and close the socket.
        ``linger=False``: drop what is queued (a hello nobody answered: waiting for it to
        leave would only add CLOSE_LINGER_MS to the producer's timeout)."""
        self._linger = linger
        self._stop = True
        self._wake.wake()
        self._thread.join()
        self._wake.close()
        self._ctx.term()

    def _run(self) -> None:
        link = self._connect()
        try:
            while True:
                events = self._wait(link)
                link.outbox = self._ship(link.sock, self._take_queued(link.outbox))
                if self._receive(link):
                    return
                lost = self._daemon_exited(link, events)
                if lost is None:
                    self.refused = lost = link.handshake.refusal(self.endpoint)
                if lost is not None:
                    self._lose(lost)
                    return
                if self._stop and self._stopped(link):
                    return
                now = time.monotonic()
                self._ping(link, now)
                lost = self._silent(link, now)
                if lost:
                    self._lose(lost)
                    return
                link.poller.modify(link.sock, zmq.POLLIN | (zmq.POLLOUT if link.outbox else 0))
        except Exception as exc:  # never let the thread die silently
            log.exception("ckptd sender thread failed")
            self._lose(f"the ckptd sender thread failed: {exc}")
        finally:
            self._disconnect(link)

    def _connect(self) -> _Link:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # memory is bounded in bytes by the staging arena
        sock.setsockopt(zmq.RCVHWM, 0)
        # a refused CurveZMQ key looks like silence: watch the handshake until the daemon answers
        handshake = curve.secure_client(sock, self._curve_keys, watch=True)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(self._wake.fd, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        if handshake.monitor is not None:
            poller.register(handshake.monitor, zmq.POLLIN)
        now = time.monotonic()
        return _Link(sock, poller, handshake, want_pid=self.endpoint.startswith("ipc://"),
                     last_heard=now, last_ping=now)

    def _wait(self, link: _Link) -> dict[Any, int]:
        """Sleep in poll until a wake-up, a reply, or half a heartbeat (or grace period)."""
        self._idle = True  # before looking at the queue: a message put before this is seen
        wait = 0 if not self._queue.empty() else int(self._heartbeat * 1000 / 2)
        if link.died is not None:
            wait = min(wait, int(GRACE_S * 1000 / 2))
        events = dict(link.poller.poll(wait))
        if self._wake.fd in events:
            self._wake.drain()
        self._idle = False
        return events

    def _receive(self, link: _Link) -> bool:
        """Hand on every reply waiting; True when one ends this connection."""
        while True:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK, copy=not link.want_pid)
            except zmq.Again:
                return False
            link.last_heard = time.monotonic()
            if link.want_pid:
                link.want_pid = False
                link.daemon = self._watch(link.poller, frames[0])
                if link.daemon is not None:
                    link.silence = Silence(link.daemon.pid, self._timeout,
                                           max(BUSY_LIMIT_S, BUSY_TIMEOUTS * self._timeout))
            if link.handshake.monitor is not None:
                link.poller.unregister(link.handshake.monitor)
                link.handshake.close()
            if self._dispatch(frames):
                return True

    def _daemon_exited(self, link: _Link, events: dict[Any, int]) -> str | None:
        """Why the connection is lost once the daemon's process exited and its grace
        period has passed; else None."""
        daemon = link.daemon
        if daemon is not None and link.died is None and self._exited(daemon, events):
            link.died = time.monotonic()
            if daemon.fd >= 0:
                link.poller.unregister(daemon.fd)
        if link.died is None or time.monotonic() - max(link.died, link.last_heard) < GRACE_S:
            return None
        assert daemon is not None
        return f"lost contact with the ckptd daemon at {self.endpoint}: its process (pid {daemon.pid}) exited"

    def _stopped(self, link: _Link) -> bool:
        """After ``close``: whether what is queued has left (or need not)."""
        # the bye, queued before close() set _stop, may have come after this pass took the queue
        link.outbox = self._ship(link.sock, self._take_queued(link.outbox))
        return not link.outbox or not self._linger or time.monotonic() - link.last_heard > 1.0

    def _ping(self, link: _Link, now: float) -> None:
        if now - link.last_ping >= self._heartbeat:
            link.seq += 1
            link.outbox = self._ship(link.sock, [*link.outbox, (wire.encode("ping", seq=link.seq), None, None)])
            link.last_ping = now

    def _silent(self, link: _Link, now: float) -> str | None:
        """Why the connection is lost when the daemon was silent too long; else None."""
        silent = now - link.last_heard
        silence = link.silence
        if not (silence.gone(silent, now) if silence is not None else silent > self._timeout):
            return None
        busy = f", though its process (pid {silence.pid}) kept running" \
            if silence is not None and silent > silence.limit else ""
        return f"lost contact with the ckptd daemon at {self.endpoint}: no answer for {silent:.0f} s{busy}"

    def _lose(self, why: str) -> None:
        self.lost = why
        self._on_lost(why)

    def _disconnect(self, link: _Link) -> None:
        if link.daemon is not None:
            link.daemon.close()
        link.handshake.close()
        # without the bye, the daemon would count this producer until its session timed out
        link.sock.close(linger=CLOSE_LINGER_MS if self.lost is None and self._linger else 0)

    def _watch(self, poller: zmq.Poller, frame: Any) -> ProcessWatch | None:
        """Watch the daemon's process, named by the kernel on ``frame``, or None where it cannot be."""
        pid = peer_pid(frame)
        if pid is None:
            return None
        daemon = ProcessWatch(pid)
        if not daemon.watchable:
            log.debug("cannot watch the daemon's process %d (%s)", pid, daemon.why)
            daemon.close()
            return None
        if daemon.fd >= 0:
            poller.register(daemon.fd, zmq.POLLIN)
        return daemon

    def _exited(self, daemon: ProcessWatch, events: dict[Any, int]) -> bool:
        """Whether the daemon's process exited: its pidfd woke the poll, or (no pidfd) /proc
        says so, looked at once a second."""
        if daemon.fd >= 0:
            return daemon.fd in events and daemon.exited()
        now = time.monotonic()
        if now < self._next_proc_check:
            return False
        self._next_proc_check = now + 1.0
        return daemon.exited()

    def _take_queued(self, outbox: list[tuple[bytes, Any, Any]]) -> list[tuple[bytes, Any, Any]]:
        """``outbox`` with every message queued so far appended (the sender thread only)."""
        while True:
            try:
                outbox.append(self._queue.get_nowait())
            except queue.Empty:
                return outbox

    def _ship(self, sock: zmq.Socket, outbox: list[tuple[bytes, Any, Any]]) -> list[tuple[bytes, Any, Any]]:
        for i, (header, payload, event) in enumerate(outbox):
            if event is not None:
                event.synchronize()
            frames = [header] if payload is None else [header, payload]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return outbox[i:]
        return []

    def _dispatch(self, frames: list[bytes]) -> bool:
        """Hand one reply on; True when it ends this connection."""
        try:
            header, _ = wire.decode(frames)
        except ProtocolError as exc:
            log.warning("ignoring a malformed reply from the daemon: %s", exc)
            return False
        if header["op"] == "error" and header["code"] == wire.NO_SESSION:
            self.lost = (
                f"the ckptd daemon at {self.endpoint} no longer knows this producer "
                "(it was restarted); steps in flight were lost"
            )
            self._on_lost(self.lost)
            return True
        if header["op"] == "welcome":
            self._welcomed = True
        elif header["op"] == "error" and header["code"] == wire.STOPPING and self._welcomed:
            self.stopped = True
            self.lost = f"the ckptd daemon at {self.endpoint} stopped ({header['message']})"
            self._on_lost(self.lost)
            return True
        self._on_reply(header)
        return False
