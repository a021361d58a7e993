"""One request to several peers at once, the answers collected within one deadline:
the sender's liveness checks (``holds``), its batched ``drop``s and its first
``ping``s, and a reader's ``steps`` and ``manifests`` (``ckptd.tiers.peer_reader``). A peer that is down or slow costs the others nothing: it is the one
left without an answer when the deadline passes."""

from __future__ import annotations

import select
import time
from typing import Any

from ..errors import PeerDown, PeerRefused, ProtocolError
from . import messages

RETRY_S = 0.1


def ask_all(links: dict[str, messages.Link], requests: dict[str, dict[str, Any]],
            timeout: float) -> dict[str, dict[str, Any] | Exception]:
    """Send ``requests[peer]`` on ``links[peer]`` for every peer, without waiting on any
    one (a peer not yet connected is tried again every ``RETRY_S``); each peer's answer
    header, or the exception that stands for it (PeerDown: not connected or no answer by
    the deadline; PeerRefused: an error answer; ProtocolError)."""
    deadline = time.monotonic() + timeout
    out: dict[str, dict[str, Any] | Exception] = {}
    rids: dict[str, int] = {}
    unsent = dict(requests)
    while unsent or rids.keys() - out.keys():
        for peer in list(unsent):
            try:
                rids[peer] = links[peer].send(unsent[peer], timeout=0)
            except PeerDown:
                continue
            del unsent[peer]
        left = deadline - time.monotonic()
        if left <= 0:
            break
        poll = select.poll()
        waiting = {links[p].sock: p for p in rids if p not in out}
        for fd in waiting:
            poll.register(fd, select.POLLIN)
        wait = min(left, RETRY_S) if unsent else left
        for fd, _ in poll.poll(int(wait * 1000) + 1):
            peer = waiting[fd]
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
