"""How large a producer's staging arena is when ``staging_size = "auto"`` (``Growth``).

The arena starts at ``INITIAL`` bytes and grows to fit the largest checkpoint seen:
``Growth.want`` makes a larger arena on a background thread at nice 19, the producer
swaps it in between checkpoints (``Growth.take``), and until then a larger checkpoint
streams through, or gets an arena of up to ``BRIDGE`` made on the spot (``bridge_for``).
A size known ahead (``expected_bytes``, ``prepare``) is made at once. It never grows
past ``limit``: a share of the node's memory divided among its ranks.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from .. import env
from .staging import ALIGN, PAGE, Arena, background_priority

log = logging.getLogger("ckptd.producer")

INITIAL = 32 * 2**20
BRIDGE = 128 * 2**20
HEADROOM = 1.25
GRAIN = 64 * 2**20  # sizes are rounded up to this, so small changes in size reuse the arena
MEMORY_SHARE = 0.25


def machine_memory() -> int:
    """Physical memory, or the cgroup's limit where one is set and smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def default_limit() -> int:
    """The largest arena ``"auto"`` grows to: ``MEMORY_SHARE`` of memory per local rank."""
    local_ranks = max(1, env.local_world_size() or 1)
    return max(INITIAL, _round_up(int(machine_memory() * MEMORY_SHARE / local_ranks), PAGE))


def size_for(need: int, limit: int) -> int:
    """The arena ``"auto"`` makes for a checkpoint that needs ``need`` bytes of staging."""
    want = int(need * HEADROOM)
    return min(limit, INITIAL if want <= INITIAL else _round_up(want, GRAIN))


def bridge_for(need: int, have: int, limit: int) -> int | None:
    """The arena made on the spot for a checkpoint of ``need`` bytes of staging that the
    arena (``have``) cannot hold, or None: at most ``BRIDGE``, which may be all it needs.

    Such a checkpoint streams through staging while the arena that fits it is made in
    the background for the next one. Streamed, 1 GiB was durable in 0.72-1.0 s through
    32 MiB and 0.46-0.63 s through 128 MiB (the daemon writes pieces of a quarter of
    staging; 0.47-0.55 s with all of it staged), and 128 MiB of page faults cost ~0.04
    s here; a checkpoint of 32-100 MiB fits whole in its 64 or 128 MiB."""
    if need <= have or have >= BRIDGE:
        return None
    size = min(size_for(need, limit), BRIDGE)
    return size if size > have else None


def room_for(sizes: list[int]) -> int:
    """Arena bytes that hold tensors of ``sizes`` at once, alignment included."""
    return sum(_round_up(n, PAGE if n >= 2**20 else ALIGN) + PAGE for n in sizes)


class Growth:
    """Grows an arena in the background to fit what ``want`` asks for, up to ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready: Arena | None = None
        self._target = 0
        self._making = False
        self._awaited = False
        self._capped_warned = False

    def want(self, need: int, have: int, *, ahead: bool = False) -> None:
        """A checkpoint needs ``need`` bytes of staging and the arena has ``have``:
        start making a larger one unless one that fits is made or being made.
        ``ahead``: asked for before the checkpoint (``Producer.prepare``), which then
        waits for it rather than stream through the smaller arena."""
        if need <= have:
            return
        target = size_for(need, self.limit)
        if need > self.limit and not self._capped_warned:
            self._capped_warned = True
            log.warning(
                "a checkpoint needs %s of staging, more than the %s that staging may grow to on "
                "this node; emit waits for the daemon to drain it (set [producer] staging_limit, "
                "or staging_size, to allow more)", _mib(need), _mib(self.limit))
        with self._lock:
            if ahead:
                self._awaited = True
            if target <= max(have, self._target):
                return
            self._target = target
            if self._making:
                return
            self._making = True
            self._thread = threading.Thread(target=self._make, args=(have,), name="ckptd-staging", daemon=True)
            self._thread.start()

    def take(self, wait: bool = False) -> Arena | None:
        """The larger arena, once it is ready (the caller owns it then), else None.
        ``wait``: if one was asked for ahead (``want(ahead=True)``) and is being made,
        wait until it is (the thread ends: it is made, or it failed and logged why)."""
        with self._lock:
            thread = self._thread if wait and self._awaited and self._making else None
        if thread is not None:
            thread.join()
        with self._lock:
            arena, self._ready = self._ready, None
            if wait:
                self._awaited = False
        return arena

    @property
    def ready_bytes(self) -> int:
        """The size of the arena made and waiting for the next checkpoint; 0: none."""
        ready = self._ready
        return ready.capacity if ready is not None else 0

    def made(self, size: int) -> None:
        """The first arena was made at ``size`` (``expected_bytes``): want() counts it."""
        with self._lock:
            self._target = max(self._target, size)

    def close(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
        arena = self.take()
        if arena is not None:
            arena.close()

    def _make(self, have: int) -> None:
        background_priority()
        while True:
            with self._lock:
                size = self._target
            try:
                arena = Arena(size)
            except (OSError, ValueError) as exc:
                log.warning("could not grow staging from %s to %s: %s; checkpoints keep streaming through "
                            "the smaller arena", _mib(have), _mib(size), exc)
                with self._lock:
                    self._making = False
                return
            log.info("staging grew from %s to %s (limit %s); in use from the next checkpoint",
                     _mib(have), _mib(size), _mib(self.limit))
            with self._lock:
                old, self._ready = self._ready, arena
                again = self._target > size
                self._making = again
            if old is not None:
                old.close()
            if not again:
                return


def _round_up(n: int, grain: int) -> int:
    return -(-n // grain) * grain


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
