"""Small tensors travel in batches: many in one region of the staging arena, one message.

A ``Batcher`` copies each small tensor into its region as it is emitted (the snapshot
is taken at once) and sends one ``tensors`` message when it is full, when the step
changes, before a tensor that is not batched (regions go out in the order they were
taken) and before a commit, abort, flush or close. A batch sent before it filled gives
the rest of its region back (``Arena.shrink``). Shared memory only.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from .staging import ALIGN, Region

SMALL = 64 * 1024
BATCH_BYTES = 4 * 2**20
BATCH_ITEMS = 4096


class Batcher:
    """The open batch of one connection. ``alloc(nbytes, what)`` takes a region of the
    arena (blocking as ``emit`` does), ``shrink(region, nbytes)`` gives back the end of
    the newest region, ``send(step, region, items, frozen)`` numbers and queues the
    message, ``copy(region, item)`` copies a tensor the fast path cannot (strided, lazily
    conjugated, numpy) into a region; ``base`` is the arena's address."""

    def __init__(self, capacity: int, base: int, alloc: Callable[[int, str], Region | None],
                 shrink: Callable[[Region, int], None], send: Callable[[int, Region, list[list[Any]], bool], None],
                 copy: Callable[[Region, Any], Any]) -> None:
        self.size = min(BATCH_BYTES, capacity // 8)
        self._base = base
        self._alloc, self._shrink, self._send, self._copy = alloc, shrink, send, copy
        self._step: int | None = None
        self._region: Region | None = None
        self._used = 0
        self._items: list[list[Any]] = []
        self._frozen = False

    def wants(self, item: Any) -> bool:
        """Whether ``item`` (a validated ``_Tensor``) goes into a batch."""
        return not item.is_cuda and item.nbytes <= SMALL and item.nbytes <= self.size

    def take(self, step: int, name: str, item: Any) -> None:
        """Copy ``item`` into the open batch of ``step`` (opening one if need be)."""
        offset = -(-self._used // ALIGN) * ALIGN
        if (self._region is None or step != self._step or offset + item.nbytes > self._region.nbytes
                or len(self._items) >= BATCH_ITEMS or item.frozen != self._frozen):
            self.flush()
            self._region = self._alloc(self.size, f"a batch of small tensors (for {name!r})")
            self._step, self._frozen, offset = step, item.frozen, 0
        region = self._region
        assert region is not None
        at = region.start + offset
        src = item.source
        if not item.is_numpy and src.is_contiguous() and not src.is_conj() and not src.is_neg():
            if item.nbytes:
                ctypes.memmove(self._base + at, src.data_ptr(), item.nbytes)
        else:
            self._copy(Region(at, item.nbytes), item)
        self._items.append([name, item.dtype.name, item.shape, item.nbytes, item.is_numpy, at])
        self._used = offset + item.nbytes

    def flush(self) -> None:
        """Send the open batch, if any. A region taken is always sent (even with no
        tensors, after a failed copy): the arena frees regions in order, by their seq."""
        region, self._region = self._region, None
        if region is not None:
            self._shrink(region, self._used)  # before any other region is taken after it
            items, self._items, self._used = self._items, [], 0
            assert self._step is not None
            self._send(self._step, region, items, self._frozen)

    def drop(self) -> None:
        """Forget the open batch: its connection, and the arena's regions, are gone."""
        self._region, self._items, self._used, self._step = None, [], 0, None
