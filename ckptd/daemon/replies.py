"""The ROUTER socket producers talk to: binding it, reading from it, and every reply.

``Replies.bind`` listens on ``[daemon] endpoint`` (an ipc:// path with its handoff
socket beside it, or tcp:// behind CurveZMQ); ``receive`` takes the next message;
``send`` never blocks, and drops a reply to a producer that is gone.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import zmq

from ..config import Config
from ..errors import CheckpointError
from ..transport import handoff, unixsock, wire
from ..transport.curve import CurveServer
from .arenas import Arenas

log = logging.getLogger("ckptd.daemon")

IPC_PATH_MAX = 107


class Replies:
    def __init__(self, config: Config) -> None:
        self.endpoint = config.endpoint
        self._max_frame = config.daemon.max_frame
        self.curve = CurveServer.from_config(config)
        self.reading = False
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._ipc: unixsock.BoundSocket | None = None

    @property
    def local(self) -> bool:
        return self.endpoint.startswith("ipc://")

    def bind(self, arenas: Arenas) -> None:
        self._ctx = zmq.Context()
        router = self._router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 100_000)
        router.setsockopt(zmq.LINGER, 2000)
        router.setsockopt(zmq.MAXMSGSIZE, max(self._max_frame, wire.MAX_HEADER_BYTES) + 4096)
        path = Path(self.endpoint[len("ipc://"):]) if self.local else None
        if path is not None:
            self._prepare_ipc(path, arenas)
        self.curve.secure(self._ctx, router)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise CheckpointError(f"cannot listen on {self.endpoint}: {exc}") from None
        if path is not None:
            # The daemon's user and group may connect whatever the umask (a service's is
            # 0027); the folder then decides who reaches the socket.
            self._ipc = unixsock.BoundSocket.of(str(path))
            os.chmod(path, 0o660)

    def _prepare_ipc(self, path: Path, arenas: Arenas) -> None:
        if len(str(path).encode()) > IPC_PATH_MAX:
            raise CheckpointError(f"ipc socket path {path} is longer than {IPC_PATH_MAX} bytes; "
                                  "choose a shorter [daemon] endpoint")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if unixsock.in_use(str(path), socket.SOCK_STREAM):
            raise CheckpointError(
                f"another process (a ckptd daemon of another root?) already serves {self.endpoint}; "
                "stop it, or give this daemon another [daemon] endpoint")
        # The handoff socket first: a producer that finds the ZeroMQ socket and connects at
        # once must find this one too, or it sends inline for good.
        if len(handoff.socket_path(str(path)).encode()) <= IPC_PATH_MAX:
            arenas.listen(str(path))
        else:
            log.warning("the ipc path %s leaves no room for %s beside it: local producers send "
                        "tensors through the socket (transport \"inline\")", path, handoff.SUFFIX)

    def follow(self, poller: zmq.Poller, reading: bool) -> None:
        """Poll the socket for messages, or leave them waiting in the producers' staging."""
        if reading != self.reading:
            if reading:
                poller.register(self._router, zmq.POLLIN)
            else:
                poller.unregister(self._router)
            self.reading = reading

    def readable(self, events: dict[Any, int]) -> bool:
        return self.reading and self._router in events

    def receive(self) -> list[zmq.Frame] | None:
        """The next message waiting, as its frames, or None."""
        assert self._router is not None
        try:
            return self._router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def send(self, identity: bytes, op: str, **fields: Any) -> None:
        self.send_encoded(identity, op, wire.encode(op, **fields))

    def send_encoded(self, identity: bytes, op: str, header: bytes) -> None:
        """Send a reply already encoded (``wire.encode``), as ``send`` does."""
        assert self._router is not None
        try:
            self._router.send_multipart([identity, header], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply %s to %s dropped: %s", op, identity.hex(), exc)

    def close(self) -> None:
        if self._router is not None:
            self._router.close()
            self._router = None
        self.curve.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._ipc is not None:
            self._ipc.remove()
            self._ipc = None
