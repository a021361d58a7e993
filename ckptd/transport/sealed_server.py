"""The listening end of the peer port's transport (``ckptd.transport.sealed``): one
thread waits on every connection at once (``Server.poll``) and gets whole messages back
with who sent them; answers are queued per connection and written as its socket takes
them. Bounded (docs/tiers.md, "No message stops it"): connections in all and per client
key; the bytes of unfinished messages in all (``assembling``: past two messages' bound
only the oldest unfinished message is read on); a connection's answers not yet written (past
``unread_cap`` its requests are not read); a handshake within ``handshake_s``; a
message's records never ``stall_s`` apart. A connection that breaks the protocol is
closed, logged once a minute per kind."""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import socket
import time
from typing import Any

from nacl import bindings as nb
from nacl.exceptions import CryptoError

from ..errors import SealBroken
from .sealed import (CURVE, GREETING, HELLO, INITIATE, MAGIC, PLAIN, RECORD, TO_CLIENT, TO_SERVER, Boxes, Inbound,
                     Outbound, HELLO_NONCE, INITIATE_NONCE, READY_NONCE, address, raw_key, stream, user_id)

log = logging.getLogger("ckptd.peer")

Received = tuple[bytes, list[Any], "str | None"]
_LOG_EVERY_S = 60.0


class _Conn:
    def __init__(self, sock: socket.socket, ident: bytes, now: float, deadline: float, who: str) -> None:
        self.sock, self.ident, self.who = sock, ident, who
        self.user: str | None = None
        self.stage = "greeting"
        self.hs, self.hs_got = bytearray(GREETING), 0
        self.inbound: Inbound | None = None
        self.out = Outbound(open_=False)
        self.deadline, self.last, self.began = deadline, now, now
        self.events = 0
        self.key = b""
        self.client_eph = self.eph_secret = b""


class Server:
    """``listen``: ``tcp://HOST:PORT`` or ``ipc://PATH``; ``curve``: the port's
    ``PeerCurveServer`` (its ``callback`` admits a client key), None for plaintext; with
    one key shared by every node, ``per_key`` does not apply. OSError when it cannot
    listen there."""

    def __init__(self, listen: str, curve: Any, *, max_header: int, max_payload: int, unread_cap: int,
                 handshake_s: float = 10.0, stall_s: float = 10.0, max_connections: int = 256, per_key: int = 64,
                 assembling_cap: int | None = None) -> None:
        self.limits = max_header, max_payload
        self.unread_cap, self.handshake_s, self.stall_s = unread_cap, handshake_s, stall_s
        self.max_connections, self.per_key = max_connections, per_key
        message = max_header + max_payload + RECORD
        self.assembling_cap = 2 * message if assembling_cap is None else assembling_cap
        self.curve = curve
        family, addr = address(listen)
        self.listener = stream(family)
        self._path = addr if family == socket.AF_UNIX else None
        try:
            if family != socket.AF_UNIX:
                self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(addr)
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.conns: dict[bytes, _Conn] = {}
        self.assembling = 0
        self._per_user: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._logged: dict[str, float] = {}
        self._expired = time.monotonic()

    def wake(self) -> None:
        """From any thread: end the current ``poll`` at once."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def poll(self, timeout: float) -> list[Received]:
        """Wait up to ``timeout`` s; the messages that came whole: (connection, [header,
        payload?], the client's key in Z85 or None)."""
        got: list[Received] = []
        for key, mask in self.sel.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                self._drain_wake()
            else:
                self._ready(key.data, mask, got)
        now = time.monotonic()
        if now - self._expired > 0.5:
            self._expired = now
            self._expire(now)
        for conn in list(self.conns.values()):
            self._interest(conn)
        return got

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _ready(self, conn: _Conn, mask: int, got: list[Received]) -> None:
        if conn.ident not in self.conns:
            return
        try:
            if mask & selectors.EVENT_WRITE:
                conn.out.write(conn.sock)
            if mask & selectors.EVENT_READ:
                self._read(conn, got)
        except SealBroken as exc:
            self._drop(conn, "protocol", f"it broke the protocol: {exc}")
        except OSError as exc:
            self._drop(conn, None, f"{exc.strerror or exc}")

    def send(self, ident: bytes, header: bytes, payload: Any, *, counted: bool) -> bool:
        """Queue an answer on connection ``ident`` and write what its socket takes now;
        False when that connection is gone. ``counted``: its bytes count in ``unwritten``."""
        conn = self.conns.get(ident)
        if conn is None:
            return False
        conn.out.put(header, payload, counted)
        try:
            conn.out.write(conn.sock)
        except OSError as exc:
            self._drop(conn, None, f"{exc.strerror or exc}")
            return False
        self._interest(conn)
        return True

    def unwritten(self, ident: bytes | None = None) -> int:
        """Counted answer bytes not yet written: to ``ident``, or to every connection."""
        if ident is not None:
            conn = self.conns.get(ident)
            return conn.out.counted if conn is not None else 0
        return sum(c.out.counted for c in self.conns.values())

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._log("accept", "peer port: cannot accept a connection: %s", exc)
                return
            if len(self.conns) >= self.max_connections:
                sock.close()
                self._log("connections", "peer port: refused a connection from %s: %d are open, at most %d",
                          peer or "a local socket", len(self.conns), self.max_connections)
                continue
            self._admit(sock, str(peer or "a local socket"))

    def _admit(self, sock: socket.socket, who: str) -> None:
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        now = time.monotonic()
        conn = _Conn(sock, b"c%d" % next(self._ids), now, now + self.handshake_s, who)
        conn.out.raw.append(MAGIC + (CURVE if self.curve is not None else PLAIN))
        self.conns[conn.ident] = conn
        conn.events = selectors.EVENT_READ
        self.sel.register(sock, conn.events, conn)
        try:
            conn.out.write(sock)
        except OSError as exc:
            self._drop(conn, None, f"{exc.strerror or exc}")

    def _read(self, conn: _Conn, got: list[Received]) -> None:
        """Read what ``conn`` sent, at most 64 reads at a time (the others' turn)."""
        for _ in range(64):
            if conn.ident not in self.conns or conn.inbound is not None and not self._may_read(conn):
                return
            inbound = conn.inbound
            buf = memoryview(conn.hs)[conn.hs_got:] if inbound is None else inbound.buffer()
            held = 0 if inbound is None else inbound.held
            try:
                n = conn.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            if n == 0:
                self._drop(conn, "mid" if inbound is not None and inbound.mid else None, "it closed the connection")
                return
            conn.last = time.monotonic()
            if inbound is None:
                conn.hs_got += n
                if conn.hs_got == len(conn.hs):
                    self._handshake(conn)
                continue
            if not inbound.mid:
                conn.began = conn.last
            message = inbound.received(n)
            self.assembling += inbound.held - held
            if message is not None:
                got.append((conn.ident, [message[0]] + ([message[1]] if message[1] is not None else []), conn.user))

    def _may_read(self, conn: _Conn) -> bool:
        """Whether ``conn``'s next record may be read: its answers are being taken, and
        the unfinished messages in all are within their cap (else only the oldest)."""
        if conn.out.unwritten > self.unread_cap:
            return False
        if self.assembling < self.assembling_cap:
            return True
        unfinished = [c for c in self.conns.values() if c.inbound is not None and c.inbound.mid]
        return bool(unfinished) and conn is min(unfinished, key=lambda c: c.began)

    def _interest(self, conn: _Conn) -> None:
        if conn.ident not in self.conns:
            return
        events = selectors.EVENT_READ if conn.inbound is None or self._may_read(conn) else 0
        events |= selectors.EVENT_WRITE if conn.out.pending() else 0
        if events != conn.events:
            if events & ~conn.events & selectors.EVENT_READ:
                conn.last = time.monotonic()  # paused by this port, not stalled by its client
            if conn.events and events:
                self.sel.modify(conn.sock, events, conn)
            elif events:
                self.sel.register(conn.sock, events, conn)
            else:
                self.sel.unregister(conn.sock)
            conn.events = events

    def _expire(self, now: float) -> None:
        for conn in list(self.conns.values()):
            if conn.inbound is None and now > conn.deadline:
                self._drop(conn, "handshake", f"it did not finish its handshake within {self.handshake_s:g} s")
            elif conn.inbound is not None and conn.inbound.mid and now - conn.last > self.stall_s \
                    and conn.events & selectors.EVENT_READ:
                self._drop(conn, "stall", f"it sent nothing for {self.stall_s:g} s in the middle of a message")

    def _handshake(self, conn: _Conn) -> None:
        got = bytes(conn.hs)
        try:
            if conn.stage == "greeting":
                self._greeting(conn, got)
            elif conn.stage == "hello":
                self._hello(conn, got)
            else:
                self._initiate(conn, got)
        except CryptoError:
            raise SealBroken(f"its {conn.stage.upper()} does not open (another port's key, or not CurveZMQ)") from None

    def _greeting(self, conn: _Conn, got: bytes) -> None:
        if got[:len(MAGIC)] != MAGIC:
            raise SealBroken("its greeting is not ckptd's (not a ckptd peer, or another version)")
        mine = CURVE if self.curve is not None else PLAIN
        if got[len(MAGIC):] != mine:
            self._drop(conn, "mode", "it dials " + ("in plaintext a port with keys" if mine == CURVE
                                                      else "with keys a port in plaintext"))
        elif mine == PLAIN:
            self._open(conn, None)
        else:
            conn.stage, conn.hs, conn.hs_got = "hello", bytearray(HELLO), 0

    def _hello(self, conn: _Conn, got: bytes) -> None:
        conn.client_eph = got[:32]
        if nb.crypto_box_open(got[32:], HELLO_NONCE, conn.client_eph, raw_key(self.curve.secret)) != bytes(64):
            raise SealBroken("a HELLO of other than zeros")
        eph_public, conn.eph_secret = nb.crypto_box_keypair()
        nonce = os.urandom(16)
        conn.out.raw.append(nonce + nb.crypto_box(eph_public, b"WELCOME-" + nonce, conn.client_eph,
                                                  raw_key(self.curve.secret)))
        conn.key = nb.crypto_box_beforenm(conn.client_eph, conn.eph_secret)
        conn.stage, conn.hs, conn.hs_got = "initiate", bytearray(INITIATE), 0
        conn.out.write(conn.sock)

    def _initiate(self, conn: _Conn, got: bytes) -> None:
        inner = nb.crypto_box_open_afternm(got, INITIATE_NONCE, conn.key)
        client, vouch_nonce, vouch = inner[:32], inner[32:48], inner[48:]
        if nb.crypto_box_open(vouch, b"VOUCH---" + vouch_nonce, client, conn.eph_secret) \
                != conn.client_eph + raw_key(self.curve.public):
            raise SealBroken("an INITIATE whose vouch is not for this session")
        user = user_id(client)
        if not self.curve.callback("ckptd", user.encode()):
            self._drop(conn, None, "its key is not admitted")
            return
        if self._per_user.get(user, 0) >= self.per_key and not getattr(self.curve, "shared", False):
            self._drop(conn, "per_key", f"key {user} has {self.per_key} connections open already")
            return
        conn.user = user
        self._per_user[user] = self._per_user.get(user, 0) + 1
        boxes = Boxes(conn.key, TO_CLIENT, TO_SERVER)
        conn.out.raw.append(nb.crypto_box_afternm(b"", READY_NONCE, conn.key))
        conn.out.boxes = boxes
        self._open(conn, boxes)

    def _open(self, conn: _Conn, boxes: Boxes | None) -> None:
        conn.inbound = Inbound(boxes, *self.limits)
        conn.out.open = True
        conn.out.write(conn.sock)

    def _drop(self, conn: _Conn, kind: str | None, why: str) -> None:
        if self.conns.pop(conn.ident, None) is None:
            return
        if kind is not None:
            self._log(kind, "peer port: closed the connection from %s: %s", conn.who, why)
        else:
            log.debug("peer port: the connection from %s closed: %s", conn.who, why)
        if conn.events:
            self.sel.unregister(conn.sock)
        conn.sock.close()
        if conn.inbound is not None:
            self.assembling -= conn.inbound.held
        if conn.user is not None:
            self._per_user[conn.user] -= 1
            if not self._per_user[conn.user]:
                del self._per_user[conn.user]

    def _log(self, kind: str, fmt: str, *args: Any) -> None:
        """A warning at most once a minute per kind: a broken client may retry at once."""
        now = time.monotonic()
        if now - self._logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[kind] = now
            log.warning(fmt, *args)

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn, None, "the port closed")
        self.sel.close()
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass
