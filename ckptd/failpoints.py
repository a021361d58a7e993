"""Failpoints: faults a test switches on in a real daemon, by name, from outside.

``CKPTD_FAILPOINTS="writer.chunk"`` makes every pass through that point raise
``Failpoint``; ``"writer.chunk@3"`` the third and later; several are comma-separated.
The daemon arms them once, as it starts (``arm``); unarmed, ``hit`` is one dict lookup.
They produce what a kill -9 cannot: an unexpected exception on a daemon thread.
"""

from __future__ import annotations

import threading

from .errors import Failpoint

_ARMED: dict[str, int] = {}
_passes: dict[str, int] = {}
_lock = threading.Lock()


def arm(spec: str) -> None:
    """Arm the points ``spec`` names (``$CKPTD_FAILPOINTS``), and only those."""
    with _lock:
        _ARMED.clear()
        _passes.clear()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, first = item.partition("@")
            _ARMED[name] = int(first) if first else 1


def hit(point: str) -> None:
    """Raise ``Failpoint`` if ``point`` is armed and its pass has come."""
    if point not in _ARMED:
        return
    with _lock:
        n = _passes[point] = _passes.get(point, 0) + 1
    if n >= _ARMED[point]:
        raise Failpoint(f"failpoint {point} (pass {n}), armed by CKPTD_FAILPOINTS")

