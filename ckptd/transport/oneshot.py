"""One question to a daemon on a throwaway socket, and its answer: what the command line
(``ckptd status``, ``latest --endpoint``, ``list``) and the daemon launcher ask. Only
ZeroMQ, the wire format and CurveZMQ: no producer is made, nothing of it imported."""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from ..errors import DaemonUnreachable
from . import curve, unixsock, wire


def request(endpoint: str, header: bytes, timeout: float, curve_keys: curve.ClientKeys | None = None) -> dict[str, Any]:
    """One question to the daemon on a throwaway socket (for the CLI): send a header,
    return the decoded reply; DaemonUnreachable when none answers within ``timeout`` seconds,
    CheckpointError (of the class its code names: wire.raised) with the message of an ``error`` reply.
    ``curve_keys``: a tcp:// endpoint's (``curve.client_keys``)."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # @: Linux's abstract names
        # a socket file that is missing, or that nobody listens on, cannot answer: say so at once
        path = endpoint[len("ipc://"):]
        if not os.path.exists(path):
            raise DaemonUnreachable(f"no ckptd daemon at {endpoint}: the socket file {path} does not exist; "
                                  "start one with `ckptd serve -c CONFIG`, or name a running one's "
                                  "endpoint (--endpoint, -c CONFIG, CKPTD_ENDPOINT)")
        if not unixsock.in_use(path):
            raise DaemonUnreachable(f"no ckptd daemon at {endpoint}: nothing listens on the socket file {path} "
                                  "(a stopped daemon's leftover); start one with `ckptd serve -c CONFIG`")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    handshake = curve.secure_client(sock, curve_keys, watch=True)
    try:
        sock.connect(endpoint)
        sock.send(header)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if handshake.monitor is not None:
            poller.register(handshake.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while not sock.poll(0):
            left = deadline - time.monotonic()
            refused = handshake.refusal(endpoint)
            if refused or left <= 0:
                raise DaemonUnreachable(refused or f"no ckptd daemon answered at {endpoint} within {timeout:g} s")
            poller.poll(max(1, int(left * 1000)))
        reply, _ = wire.decode(sock.recv_multipart())
    finally:
        sock.close(0)
        handshake.close()
    if reply["op"] == "error":
        raise wire.raised(reply["code"])(reply["message"])
    return reply
