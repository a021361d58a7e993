"""Staging memory: one arena, allocated and pre-faulted once, reused for every snapshot.

First-touch page faults cost more than the copy itself (1 GiB into fresh pages
blocked 2.5 s here, into warm pages 0.15 s), so ``emit`` never allocates: it takes
a region of this arena, copies the tensor into it and hands it to the sender. The
arena is a ring: regions are taken at the head and given back, oldest first, when
the daemon acknowledges them, which is exactly the order they were sent in.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError

ALIGN = 64  # every region starts on a cache line, so any dtype view of it is aligned


@dataclass(eq=False)
class Region:
    start: int
    nbytes: int
    seq: int = -1  # the wire sequence number it travels under; set by the sender


class Arena:
    def __init__(self, size: int) -> None:
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(-1, size, flags=flags)  # MAP_POPULATE pre-faults every page
        self.capacity = size
        self._live: deque[Region] = deque()
        self._head = 0
        self._cond = threading.Condition()
        self._broken: str | None = None
        self.blocked_s = 0.0  # total time callers waited for space

    def tensor(self) -> Any:
        """The whole arena as one flat uint8 torch tensor (no copy)."""
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def view(self, region: Region) -> memoryview:
        return memoryview(self._mm)[region.start:region.start + region.nbytes]

    def alloc(self, nbytes: int, *, timeout: float, block: bool, what: str) -> Region:
        """Take ``nbytes`` (at most ``capacity``), waiting up to ``timeout`` s for space."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes cannot fit an arena of {self.capacity}")
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        deadline = None
        with self._cond:
            while True:
                if self._broken:
                    raise CheckpointError(self._broken)
                start = self._fit(need)
                if start is not None:
                    region = Region(start, nbytes)
                    self._live.append(region)
                    self._head = start + need
                    return region
                if not block:
                    raise CheckpointError(
                        f"staging memory is full ({self.capacity} bytes in flight to the daemon) "
                        f"while staging {what}; raise [producer] staging_size, or set on_full = \"block\""
                    )
                now = time.monotonic()
                deadline = deadline or now + timeout
                if now >= deadline:
                    raise CheckpointError(
                        f"waited {timeout:g} s for staging memory while staging {what}: the daemon "
                        f"is not draining fast enough; raise [producer] staging_size or emit_timeout"
                    )
                self._cond.wait(deadline - now)
                self.blocked_s += time.monotonic() - now

    def _fit(self, need: int) -> int | None:
        if not self._live:
            return 0 if need <= self.capacity else None
        tail = self._live[0].start
        if self._head > tail:  # live data is [tail, head): free space at the end, then the start
            if self._head + need <= self.capacity:
                return self._head
            return 0 if need <= tail else None
        return self._head if self._head + need <= tail else None  # wrapped: free is [head, tail)

    def release_through(self, seq: int) -> None:
        """Give back every region sent under a sequence number up to ``seq``."""
        with self._cond:
            freed = False
            while self._live and 0 <= self._live[0].seq <= seq:
                self._live.popleft()
                freed = True
            if freed:
                self._cond.notify_all()

    def release(self, region: Region) -> None:
        """Give back a region that was never sent (its copy failed)."""
        with self._cond:
            try:
                self._live.remove(region)
            except ValueError:
                return
            if self._live:
                last = self._live[-1]
                self._head = last.start + max(ALIGN, -(-last.nbytes // ALIGN) * ALIGN)
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget every region (the connection that carried them is gone) and mend a break."""
        with self._cond:
            self._live.clear()
            self._head = 0
            self._broken = None
            self._cond.notify_all()

    def break_(self, message: str) -> None:
        """Make every waiting and future ``alloc`` raise ``message`` until ``reset``."""
        with self._cond:
            self._broken = message
            self._cond.notify_all()

    def close(self) -> None:
        self.break_("the producer is closed")
        try:
            self._mm.close()
        except BufferError:
            pass  # a frame still references it; the mapping goes with the last reference
