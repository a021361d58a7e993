"""Small tensors travel in batches: many in one region of the staging arena, one message.

One message per tensor cost the training thread an encode, a queue put and a
wake-up, and the sender thread a send, for each tensor: 33 µs a tensor for
10,000 small ones, 28x a memcpy of the same bytes (benchmarks/limits.py). A batch
takes one region of the arena, copies each small tensor into it when it is
emitted (the snapshot is taken at once, as for any tensor), and goes out as one
``tensors`` message (docs/format.md) when it is full, when the step changes,
when a tensor that is not batched comes (regions must go out in the order they
were taken, for the arena's ring), and before a commit, an abort, a flush or a
close. Only in shared memory: inline, every tensor is a frame anyway.

A batch sent before it filled gives the rest of its region back to the arena
(``Arena.shrink``): in a ``state_dict()``'s order (a weight, its bias, a norm's
weight, ...) every large tensor sends the open batch, and regions of an eighth of
the arena holding one bias each filled staging with bytes nobody used while the
daemon, still gathering the chunk they belong to, held them all.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from .staging import ALIGN, Region

SMALL = 64 * 1024  # tensors up to this size are batched
BATCH_BYTES = 4 * 2**20  # one batch's region (at most an eighth of the arena)
BATCH_ITEMS = 4096  # tensors per batch: bounds one header's size and decode time


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
        self._frozen = False  # the open batch holds declared-frozen tensors (only those)

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
                ctypes.memmove(self._base + at, src.data_ptr(), item.nbytes)  # releases the GIL
        else:
            self._copy(Region(at, item.nbytes), item)
        self._items.append([name, item.dtype.name, item.shape, item.nbytes, item.is_numpy, at])  # wire.BATCH_ITEM
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
