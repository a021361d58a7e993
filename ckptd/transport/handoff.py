"""Handing a producer's staging arena (a memfd) to a daemon on the same host.

Beside its ``ipc://PATH`` socket the daemon listens on a Unix seqpacket socket,
``PATH.shm``: a producer sends a random 16-byte token with the memfd attached
(SCM_RIGHTS), and its ``hello`` names the token; the daemon then maps the arena
read-only. Who may connect is decided by the socket's folder, as for the ZeroMQ
socket. Start at ``Listener`` (the daemon's side) and ``offer`` (the producer's).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass

from ..errors import HandoffRefused
from . import unixsock

log = logging.getLogger("ckptd.daemon")
TOKEN_BYTES = 16
SUFFIX = ".shm"
MAX_PENDING = 64
PENDING_TTL = 60.0
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK  # a shrinking file would turn the daemon's reads into SIGBUS


def socket_path(ipc_path: str) -> str:
    return ipc_path + SUFFIX


def offer(ipc_path: str, fd: int, timeout: float) -> bytes:
    """Send ``fd`` to the daemon listening beside ``ipc_path``; return the token that
    names it. OSError if nobody listens; HandoffRefused if the daemon says no."""
    token = os.urandom(TOKEN_BYTES)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path(ipc_path))
        socket.send_fds(sock, [token], [fd])
        answer = sock.recv(512)
    if answer != b"ok":
        raise HandoffRefused(answer.decode(errors="replace") or "the daemon closed the connection")
    return token


@dataclass
class Handoff:
    """A memory file handed over a Unix socket.

    ``ident``: (st_dev, st_ino): the same memory file, whichever descriptor"""

    fd: int
    size: int
    ident: tuple[int, int]
    pid: int
    uid: int
    gid: int
    received: float


class Listener:
    """The daemon's ``PATH.shm`` socket and the handoffs it holds until a hello claims them.

    Non-blocking throughout: the main loop polls ``fileno()`` and each accepted
    connection's ``fileno()``, and calls ``accept``/``receive`` when they are
    readable, so a peer that connects and says nothing delays nobody.
    """

    def __init__(self, ipc_path: str) -> None:
        self.path = socket_path(ipc_path)
        unixsock.refuse_if_served(self.path, socket.SOCK_SEQPACKET, "staging handoffs")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(self.path)
        self._bound = unixsock.BoundSocket.of(self.path)
        os.chmod(self.path, 0o660)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.connections: dict[int, tuple[socket.socket, float]] = {}
        self._pending: dict[bytes, Handoff] = {}

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> list[int]:
        """Accept every waiting connection; return their descriptors to poll."""
        fds = []
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return fds
            except OSError as exc:
                log.warning("cannot accept a staging handoff on %s: %s", self.path, exc)
                return fds
            if len(self.connections) >= MAX_PENDING:
                # a peer that connects and says nothing must not take every descriptor: refuse, the producer sends inline
                conn.close()
                continue
            conn.setblocking(False)
            self.connections[conn.fileno()] = (conn, time.monotonic())
            fds.append(conn.fileno())

    def receive(self, fd: int) -> str | None:
        """Read one handoff from connection ``fd``, answer it and close the connection.
        Return a description of what was refused (for the log), or None."""
        conn, _ = self.connections.pop(fd)
        try:
            return self._receive(conn)
        finally:
            conn.close()

    def _receive(self, conn: socket.socket) -> str | None:
        try:
            msg, fds, flags, _ = socket.recv_fds(conn, TOKEN_BYTES + 1, 1)
        except OSError as exc:
            return f"reading a handoff failed: {exc}"
        try:
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            why = _check(msg, fds, flags)
            if why is None:
                st = os.fstat(fds[0])
                self._add(msg, Handoff(fds.pop(), st.st_size, (st.st_dev, st.st_ino), pid, uid, gid,
                                       time.monotonic()))
            _answer(conn, b"ok" if why is None else why.encode())
            return None if why is None else f"refused a handoff from pid {pid} (uid {uid}): {why}"
        finally:
            for extra in fds:
                os.close(extra)

    def _add(self, token: bytes, handoff: Handoff) -> None:
        old = self._pending.pop(token, None)
        if old is not None:
            os.close(old.fd)
        while len(self._pending) >= MAX_PENDING:
            os.close(self._pending.pop(next(iter(self._pending))).fd)
        self._pending[token] = handoff

    def claim(self, token: bytes) -> Handoff | None:
        """The handoff sent with ``token`` (the caller owns its fd now), or None."""
        return self._pending.pop(token, None)

    def expire(self, now: float) -> list[int]:
        """Drop unclaimed handoffs and silent connections older than PENDING_TTL; return
        the connections' descriptors (closed now: stop polling them)."""
        for token in [t for t, h in self._pending.items() if now - h.received > PENDING_TTL]:
            os.close(self._pending.pop(token).fd)
        stale = [fd for fd, (_, t) in self.connections.items() if now - t > PENDING_TTL]
        for fd in stale:
            self.connections.pop(fd)[0].close()
        return stale

    def close(self) -> None:
        for handoff in self._pending.values():
            os.close(handoff.fd)
        self._pending.clear()
        for conn, _ in self.connections.values():
            conn.close()
        self.connections.clear()
        self._sock.close()
        self._bound.remove()


def _check(token: bytes, fds: list[int], flags: int) -> str | None:
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        return "the message was longer than a token and one descriptor"
    if len(token) != TOKEN_BYTES or len(fds) != 1:
        return f"expected a {TOKEN_BYTES}-byte token and one descriptor"
    st = os.fstat(fds[0])
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return "the descriptor is not a non-empty memory file"
    try:
        seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & _REQUIRED_SEALS:
        return "the memory file is not sealed against shrinking (F_SEAL_SHRINK)"
    return None


def _answer(conn: socket.socket, text: bytes) -> None:
    try:
        conn.send(text[:500])
    except OSError:
        pass  # the producer gave up waiting; it learns from its hello
