"""Which peers to leave out for now. A peer that failed (did not answer, hung in
mid-transfer) is skipped for ``first`` seconds, then twice, four times as long …
up to ``cap`` while it keeps failing, and is tried again at once after any answer:
a dead node so costs one ``[peer] timeout`` per back-off period, never one per
request. The sender keeps one (``first`` = a heartbeat, ``cap`` = ``CAP_HEARTBEATS``
heartbeats); each reading process keeps one for all its peer tiers
(``ckptd.tiers.peer_reader``: 10 s, up to 160 s)."""

from __future__ import annotations

import threading
import time
from typing import Any

CAP_HEARTBEATS = 12


class Backoff:
    def __init__(self, first: float, cap: float) -> None:
        self.first, self.cap = first, cap
        self._lock = threading.Lock()
        self._failed: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def failed(self, peer: str) -> float:
        """``peer`` did not answer: skip it; the seconds it is skipped for."""
        with self._lock:
            self._failed[peer] = self._failed.get(peer, 0) + 1
            skip = self.period(peer)
            self._until[peer] = time.monotonic() + skip
        return skip

    def answered(self, peer: str) -> None:
        """``peer`` answered a request: it is tried again at once, its back-off starts over."""
        with self._lock:
            self._failed.pop(peer, None)
            self._until.pop(peer, None)

    def period(self, peer: str) -> float:
        """The length of ``peer``'s present skip (0 if it has not failed since it last answered)."""
        n = self._failed.get(peer, 0)
        return min(self.first * 2 ** (n - 1), self.cap) if n else 0.0

    def failures(self, peer: str) -> int:
        """``peer``'s failures to answer since it last answered."""
        return self._failed.get(peer, 0)

    def left(self, peer: str) -> float:
        """The seconds ``peer`` is still skipped for (0: ask it)."""
        return max(0.0, self._until.get(peer, 0.0) - time.monotonic())

    def skipped(self, peer: str) -> bool:
        return self.left(peer) > 0

    def due(self) -> list[str]:
        """The peers that failed and whose skip has run out: to be tried again."""
        now = time.monotonic()
        with self._lock:
            return sorted(p for p, t in self._until.items() if t <= now)

    def figures(self) -> dict[str, Any]:
        """``down``: the peers skipped now; ``backoff``: for each peer that failed and has
        not answered since, its failures in a row and the seconds it is still skipped."""
        now = time.monotonic()
        with self._lock:
            return {"down": sorted(p for p, t in self._until.items() if t > now),
                    "backoff": {p: {"failures": n, "skipped_s": round(max(0.0, self._until[p] - now), 3)}
                                for p, n in sorted(self._failed.items())}}
