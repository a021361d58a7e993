"""One request to several peers at once, the answers collected within one deadline:
the sender's liveness checks (``holds``), its batched ``drop``s and its first
``ping``s, and a reader's ``steps`` and ``manifests`` (``ckptd.tiers.peer_reader``). A peer that is down or slow costs the others nothing: it is the one
left without an answer when the deadline passes."""

from __future__ import annotations

import time
from typing import Any

import zmq

from ..errors import PeerDown, PeerRefused, ProtocolError
from . import messages


def ask_all(links: dict[str, messages.Link], requests: dict[str, dict[str, Any]],
            timeout: float) -> dict[str, dict[str, Any] | Exception]:
    """Send ``requests[peer]`` on ``links[peer]`` for every peer, without waiting on any
    one; each peer's answer header, or the exception that stands for it (PeerDown: not
    connected or no answer by the deadline; PeerRefused: an error answer; ProtocolError)."""
    deadline = time.monotonic() + timeout
    out: dict[str, dict[str, Any] | Exception] = {}
    rids: dict[str, int] = {}
    unsent = dict(requests)
    poller = zmq.Poller()
    for peer in unsent:
        poller.register(links[peer].sock, zmq.POLLOUT)
    while unsent or rids.keys() - out.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        events = dict(poller.poll(int(left * 1000) + 1))
        for peer in [p for p in unsent if events.get(links[p].sock, 0) & zmq.POLLOUT]:
            try:
                rids[peer] = links[peer].send(unsent.pop(peer), timeout=0)
            except PeerDown as exc:
                out[peer] = exc
            poller.modify(links[peer].sock, zmq.POLLIN)
        for peer in [p for p in rids if p not in out and events.get(links[p].sock, 0) & zmq.POLLIN]:
            try:
                out[peer] = links[peer].recv(rids[peer], timeout=0.001)[0]
            except PeerDown:
                continue
            except (PeerRefused, ProtocolError) as exc:
                out[peer] = exc
    for peer in requests:
        if peer not in out:
            what = "not connected" if peer in unsent else "no answer"
            out[peer] = PeerDown(f"{links[peer].endpoint}: {what} in {timeout:g} s")
    return out
