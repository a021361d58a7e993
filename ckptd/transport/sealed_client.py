"""One connection of the peer port's asking end (``ckptd.transport.sealed``):
``Channel`` queues requests and writes them as its socket takes them, and reads answers
back whole, with no thread of its own: the caller's waits drive it."""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from collections import deque
from typing import Any

from nacl import bindings as nb
from nacl.exceptions import CryptoError

from ..errors import PeerDown, SealBroken
from .sealed import (CURVE, GREETING, HELLO_NONCE, INITIATE_NONCE, MAGIC, PLAIN, READY, READY_NONCE, TO_CLIENT,
                     TO_SERVER, WELCOME, Boxes, Inbound, Message, Outbound, Sink, address, raw_key, stream)

_QUIET: list[socket.socket] = []


def _never_ready() -> socket.socket:
    if not _QUIET:
        _QUIET.extend(socket.socketpair())
    return _QUIET[0]


class Channel:
    """One connection to a peer port, used from one thread: requests queued and written
    as the socket takes them, answers read back whole. ``broken``: why it is closed (a
    new Channel starts clean). ``keys``: a ``ClientKeys`` (Z85), None for plaintext."""

    def __init__(self, endpoint: str, keys: Any, *, max_header: int, max_payload: int, hwm: int) -> None:
        self.endpoint, self.keys, self.hwm = endpoint, keys, hwm
        self.broken: str | None = None
        self.connected = False
        self.began = time.monotonic()
        family, addr = address(endpoint)
        self.sock = stream(family)
        self._limits = max_header, max_payload
        self._out = Outbound(open_=keys is None)
        self._in: Inbound | None = None
        self._hs = bytearray(GREETING)
        self._hs_got = 0
        self._stage = "greeting"
        self._answers: deque[Message] = deque()
        self._sink: Sink | None = None
        self._out.raw.append(MAGIC + (CURVE if keys is not None else PLAIN))
        if keys is not None:
            self._eph_public, self._eph_secret = nb.crypto_box_keypair()
            self._server = raw_key(keys.server)
            self._out.raw.append(self._eph_public + nb.crypto_box(bytes(64), HELLO_NONCE, self._server,
                                                                  self._eph_secret))
        err = self.sock.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self._break(f"cannot connect: {os.strerror(err)}")

    def send(self, header: bytes, payload: Any, deadline: float) -> None:
        """Queue a message once connected, PeerDown when not connected or when ``hwm``
        messages are still queued at ``deadline``."""
        while self.broken is None and (not self.connected or self._out.messages >= self.hwm):
            if not self._pump(deadline):
                break
        if self.broken is not None or not self.connected or self._out.messages >= self.hwm:
            raise PeerDown(f"{self.endpoint}: not connected or not taking requests ({self.broken or 'timed out'})")
        self._out.put(header, payload, False)
        self._flush()

    def recv(self, deadline: float, sink: Sink | None = None) -> Message:
        """The next answer whole (its payload into ``sink``'s buffer where it gives one);
        PeerDown when none by ``deadline`` or the connection broke."""
        while not self._answers:
            if self.broken is not None:
                raise PeerDown(f"{self.endpoint}: {self.broken}")
            self._sink = sink
            if self._in is not None:
                self._in.sink = sink
            if not self._pump(deadline):
                raise PeerDown(f"{self.endpoint}: no answer by the deadline")
        return self._answers.popleft()

    def _pump(self, deadline: float) -> bool:
        """One wait for the socket, then what it allows read and written; False when
        ``deadline`` passed with nothing ready."""
        left = max(0.0, deadline - time.monotonic())
        poll = select.poll()
        poll.register(self.sock, select.POLLIN | (select.POLLOUT if not self.connected or self._out.pending() else 0))
        events = poll.poll(int(left * 1000) + (left > 0))
        if not events:
            return False
        readable = events[0][1] & (select.POLLIN | select.POLLHUP | select.POLLERR)
        writable = events[0][1] & (select.POLLOUT | select.POLLERR)
        try:
            if writable:
                self._writable()
            if readable:
                self._read()
        except SealBroken as exc:
            self._break(str(exc))
        except OSError as exc:
            self._break(f"connection lost: {exc.strerror or exc}")
        return True

    def _writable(self) -> None:
        if not self.connected:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise SealBroken(f"cannot connect: {os.strerror(err)}")
            self.connected = True
        self._out.write(self.sock)

    def _flush(self) -> None:
        try:
            if self.connected:
                self._out.write(self.sock)
        except OSError as exc:
            self._break(f"connection lost: {exc.strerror or exc}")

    def _read(self) -> None:
        """Read until the socket is empty or an answer is whole (the rest stays in the
        socket, so that polling it tells that more is there)."""
        while self.broken is None:
            buf = memoryview(self._hs)[self._hs_got:] if self._in is None else self._in.buffer()
            try:
                n = self.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                n = 0
            if n == 0:
                raise SealBroken("the peer closed the connection" + (" during the handshake: " + self._refused()
                                                                if self._in is None else ""))
            if self._in is None:
                self._hs_got += n
                if self._hs_got == len(self._hs):
                    self._handshake()
                continue
            message = self._in.received(n)
            if message is not None:
                self._answers.append(message)
                return

    def _refused(self) -> str:
        if self._stage == "welcome":
            return ("the public key this node dials it with is not that port's (the key file named for this "
                    "endpoint in [peer] curve_peers)")
        if self._stage == "ready":
            return ("it does not admit this node's public key: copy this node's NAME.key into its curve_peers "
                    "folder, named for this node's [peer] listen")
        return "is it a ckptd peer port?"

    def _handshake(self) -> None:
        got = bytes(self._hs)
        if self._stage == "greeting":
            if got[:len(MAGIC)] != MAGIC:
                raise SealBroken("not a ckptd peer port (or one of another version): its greeting is not ckptd's")
            mine = CURVE if self.keys is not None else PLAIN
            if got[len(MAGIC):] != mine:
                raise SealBroken("that peer port runs " + ("in plaintext, and this node dials it with keys"
                                                       if mine == CURVE else "with CurveZMQ keys, and this node "
                                                       "has none: set [daemon] curve_secret_key and [peer] "
                                                       "curve_peers (docs/tiers.md, \"Keys\")"))
            self._next_stage("welcome", WELCOME) if mine == CURVE else self._opened(None)
        elif self._stage == "welcome":
            self._welcome(got)
        else:
            try:
                nb.crypto_box_open_afternm(got, READY_NONCE, self._key)
            except CryptoError:
                raise SealBroken("a READY whose box does not open") from None
            self._opened(Boxes(self._key, TO_SERVER, TO_CLIENT))

    def _next_stage(self, stage: str, size: int) -> None:
        self._stage, self._hs, self._hs_got = stage, bytearray(size), 0

    def _welcome(self, got: bytes) -> None:
        try:
            server_eph = nb.crypto_box_open(got[16:], b"WELCOME-" + got[:16], self._server, self._eph_secret)
        except CryptoError:
            raise SealBroken("the server's WELCOME does not open with its public key: is the key file for this "
                         "endpoint that node's key?") from None
        public, secret = raw_key(self.keys.public), raw_key(self.keys.secret)
        vouch_nonce = os.urandom(16)
        vouch = nb.crypto_box(self._eph_public + self._server, b"VOUCH---" + vouch_nonce, server_eph, secret)
        self._key = nb.crypto_box_beforenm(server_eph, self._eph_secret)
        self._out.raw.append(nb.crypto_box_afternm(public + vouch_nonce + vouch, INITIATE_NONCE, self._key))
        self._out.boxes = Boxes(self._key, TO_SERVER, TO_CLIENT)
        self._out.open = True
        self._next_stage("ready", READY)
        self._writable()

    def _opened(self, boxes: Boxes | None) -> None:
        self._in = Inbound(boxes, *self._limits, sink=self._sink)
        self._out.open = True
        self._writable()

    def _break(self, why: str) -> None:
        """Close the connection; its descriptor stays open, on a socket that is never
        ready, so that a poller waiting on it waits for its deadline."""
        if self.broken is None:
            self.broken = why
            os.dup2(_never_ready().fileno(), self.sock.fileno())

    def close(self) -> None:
        self.broken = self.broken or "closed"
        self.sock.close()
