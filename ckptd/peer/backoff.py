"""Which partners the sender skips for now: a partner that failed (did not answer,
hung in mid-transfer) is skipped for ``heartbeat`` seconds, then twice, four times
as long … up to ``CAP_HEARTBEATS`` heartbeats while it keeps failing, and is tried
again at once after any answer. A dead node so costs this node one ``[peer]
timeout`` per back-off period, never one per share."""

from __future__ import annotations

import time
from typing import Any

CAP_HEARTBEATS = 12  # the longest skip: 12 heartbeats (1 minute at the default 5 s)


class Backoff:
    """Not thread-safe: its owner (the ``Replicator``) holds its lock around every call."""

    def __init__(self, heartbeat: float) -> None:
        self.heartbeat = heartbeat
        self._failed: dict[str, int] = {}  # peer -> failures in a row
        self._until: dict[str, float] = {}  # peer -> monotonic time until which it is skipped

    def failed(self, peer: str) -> float:
        """``peer`` did not answer: skip it; the seconds it is skipped for."""
        n = self._failed[peer] = self._failed.get(peer, 0) + 1
        skip = self.heartbeat * min(2 ** (n - 1), CAP_HEARTBEATS)
        self._until[peer] = time.monotonic() + skip
        return skip

    def answered(self, peer: str) -> None:
        """``peer`` answered a request: it is tried again at once, its back-off starts over."""
        self._failed.pop(peer, None)
        self._until.pop(peer, None)

    def due(self) -> list[str]:
        """The peers that failed and whose skip has run out: to be tried again."""
        now = time.monotonic()
        return sorted(p for p, t in self._until.items() if t <= now)

    def skipped(self, peer: str) -> bool:
        return self._until.get(peer, 0.0) > time.monotonic()

    def figures(self) -> dict[str, Any]:
        """``down``: the peers skipped now; ``backoff``: for each peer that failed and has
        not answered since, its failures in a row and the seconds it is still skipped."""
        now = time.monotonic()
        return {"down": sorted(p for p, t in self._until.items() if t > now),
                "backoff": {p: {"failures": n, "skipped_s": round(max(0.0, self._until[p] - now), 3)}
                            for p, n in sorted(self._failed.items())}}
