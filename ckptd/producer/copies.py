"""Copies into staging: the snapshot ``emit`` and ``save`` take.

``describe`` checks a tensor or array and says how to stage it (an ``Item``). ``Copier``
owns the staging arena (made in the background, grown between steps by ``sizing``) and
every copy into it; ``Copier.stage`` copies one tensor and hands its regions to the
connection. When a copy returns the caller may overwrite the tensor.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .. import config as config_mod
from .. import dtypes
from ..errors import CheckpointError
from ..manifest import Shard
from . import sizing
from .plan import Plan
from .batch import Batcher
from .staging import Arena, Region, background_priority

if TYPE_CHECKING:
    from .steps import Step

log = logging.getLogger("ckptd.producer")


@dataclass(slots=True, eq=False)
class Item:
    """A validated tensor or array, ready to stage (not frozen: made once per tensor, on
    the training thread, where a frozen dataclass's slower __init__ showed at 10,000 tensors).

    ``shard``: a piece of a larger tensor
    ``frozen``: save(frozen=...) names it: sent in chunks of frozen tensors only"""

    source: Any
    dtype: dtypes.Dtype
    shape: list[int]
    nbytes: int
    is_numpy: bool
    is_cuda: bool
    shard: Shard | None = None
    frozen: bool = False


def describe(name: str, value: Any) -> Item:
    """``value`` (tensor ``name``) as an ``Item``; TypeError saying why ckptd cannot store it."""
    import numpy as np
    import torch

    if (type(value) is torch.Tensor or type(value) is torch.nn.Parameter) and value.layout is torch.strided \
            and (value.is_cpu or value.is_cuda) and not value.is_quantized and not value.is_nested:
        d = dtypes.by_torch(value.dtype)
        return Item(value, d, list(value.shape), value.numel() * d.itemsize, False, value.is_cuda)
    if isinstance(value, np.ndarray):
        found = dtypes.BY_NUMPY.get(value.dtype.name)
        if found is None or value.dtype.hasobject:
            raise TypeError(f"array {name!r} has numpy dtype {value.dtype}, which ckptd cannot store; "
                            "convert it to a numeric dtype torch has (e.g. .astype(numpy.float32))")
        if value.dtype.byteorder not in "=|":
            raise TypeError(
                f"array {name!r} is big-endian ({value.dtype}); convert it with "
                "arr.astype(arr.dtype.newbyteorder('='))"
            )
        return Item(value, found, list(value.shape), value.nbytes, True, False)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor or numpy.ndarray; "
                        "convert it first (torch.as_tensor(value) takes numbers, lists and buffers)")
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"tensor {name!r} is a {type(value).__name__}, a tensor subclass ckptd cannot store; store a "
            "plain tensor made from it (for a wrapper subclass, its inner tensor or .to_dense(); for "
            "a sharded tensor, each rank's piece with emit(..., global_shape=, offset=))")
    why = None
    if value.layout != torch.strided:
        why = f"is sparse ({value.layout}); store value.to_dense()"
    elif value.is_quantized:
        why = "is quantized; store value.dequantize() or its int_repr()"
    elif value.is_nested:
        why = "is a nested tensor; store its components"
    elif value.device.type == "meta":
        why = "is on the meta device and has no data"
    elif value.device.type not in ("cpu", "cuda"):
        why = f"is on device {value.device}; move it to the CPU first"
    if why:
        raise TypeError(f"tensor {name!r} {why}")
    d = dtypes.lookup(dtypes.torch_name(value.dtype))
    return Item(value, d, list(value.shape), value.numel() * d.itemsize, False, value.is_cuda)


def frozen_first(items: dict[str, Item], matches: Callable[[str], bool]) -> dict[str, Item]:
    """``items`` with the tensors ``frozen=`` names first, each marked: together they fill
    chunk files of their own, which the next step links whole (docs/performance.md)."""
    frozen = {}
    for name, item in items.items():
        if matches(name):
            item.frozen = True
            frozen[name] = item
    return frozen | {n: i for n, i in items.items() if not i.frozen} if frozen else items


def same_item(t: Item) -> tuple:
    """What a ``same`` item says of a tensor (wire.SAME_ITEM, after the name)."""
    return (t.dtype.name, list(t.shape), t.is_numpy, None if t.shard is None else t.shard.to_dict())


class Outlet(Protocol):
    """What ``Copier.stage`` sends through: a connected ``connection.Connection``."""

    batcher: Batcher | None
    shm: bool
    max_frame: int

    def drain(self, through: int | None = None) -> None: ...

    def send_tensor(self, header: dict[str, Any], start: int, region: Region | None, event: Any,
                    wake: bool = True) -> None: ...


class Copier:
    """The staging arena of one producer and the copies into it.

    The arena is made in the background at once (``ready()`` waits for it), so the
    first checkpoint does not pay for page faults. ``arena_t`` is a uint8 tensor over
    the whole arena, which every torch copy into staging (and a save plan's) goes
    through. A grown arena replaces it only between steps (``swap_grown``)."""

    def __init__(self, options: config_mod.ProducerConfig) -> None:
        self._options = options
        self.arena: Arena | None = None
        self._arena_error: BaseException | None = None
        self.arena_t: Any = None
        self._arena_np: Any = None
        self._cuda: dict[str, Any] | None = None
        self._blocked_before = 0.0
        self.last_room = 0
        self.prepared_bytes = 0
        self.growth: sizing.Growth | None = None
        size = options.staging_size
        if size is None:
            self.growth = sizing.Growth(options.staging_limit or sizing.default_limit())
            size = min(sizing.INITIAL, self.growth.limit)
            if options.expected_bytes:
                size = sizing.size_for(options.expected_bytes, self.growth.limit)
                self.growth.made(size)
                self.prepared_bytes = options.expected_bytes
        self._first_size = size
        # made and pre-faulted in the background: the first checkpoint does not pay for page faults
        self._arena_ready = threading.Thread(target=self._make_arena, args=(size,), name="ckptd-staging",
                                             daemon=True)
        self._arena_ready.start()

    def ready(self) -> Arena:
        """The arena, once made; CheckpointError if it could not be."""
        self._arena_ready.join()
        if self.arena is None:
            raise CheckpointError(
                f"cannot allocate staging memory: {self._arena_error}; lower [producer] staging_size"
            )
        if self.arena_t is None:
            self._set_views()
        return self.arena

    @property
    def capacity(self) -> int:
        """The arena's size now (0 while it is being made)."""
        return self.arena.capacity if self.arena is not None else 0

    @property
    def ready_bytes(self) -> int:
        """A grown arena's size, made and waiting for the next checkpoint; 0: none."""
        return self.growth.ready_bytes if self.growth is not None else 0

    @property
    def limit(self) -> int | None:
        """What staging may grow to: its fixed size unless ``staging_size = "auto"``."""
        return self.growth.limit if self.growth is not None else self._options.staging_size

    @property
    def blocked_s(self) -> float:
        """Seconds copies waited for staging space, over every arena this producer had."""
        return self._blocked_before + (self.arena.blocked_s if self.arena is not None else 0.0)

    def want(self, room: int) -> None:
        """A checkpoint took ``room`` bytes of staging (said at its commit): with "auto",
        grow to fit it, in the background."""
        self.last_room = room
        if self.growth is not None and self.arena is not None:
            self.growth.want(room, self.arena.capacity)

    def prepare(self, room: int) -> None:
        """A checkpoint of ``room`` bytes of staging is coming: with "auto", make the arena
        for it now, in the background; the next checkpoint takes it (``swap_grown``)."""
        if self.growth is None or self._arena_error is not None:
            return
        self.prepared_bytes = max(self.prepared_bytes, room)
        # never waits for the first arena (expected_bytes: it may be large and still faulting)
        have = self.arena.capacity if self.arena is not None else self._first_size
        self.growth.want(room, have, ahead=True)

    def regrow(self, room: int, idle: Callable[[], bool]) -> Arena | None:
        """Between steps (``idle()``: none in flight, whose bytes may still be in the arena):
        a grown arena put in place (``swap_grown``), else one to stream a checkpoint of
        ``room`` bytes through (0: the last checkpoint's; ``bridge``); the old one, for
        ``retire`` once the connection that mapped it is closed, or None."""
        if self.growth is None or not idle():
            return None
        old = self.swap_grown()
        return old if old is not None else self.bridge(room or self.last_room)

    def take(self, plan: Plan) -> Region | None:
        """The plan's region of staging if it is free now, else None (nothing was taken)."""
        return None if self.arena is None else plan.take(self.arena)

    def copy_planned(self, plan: Plan, region: Region, tensors: list[Any],
                     ship: Callable[[list[Any]], None]) -> list[tuple[str, Any]] | None:
        """``tensors`` copied into ``region`` by ``plan``: the messages not shipped yet
        (``Plan.copy``), or None (a tensor changed)."""
        assert self.arena is not None
        return plan.copy(region, tensors, self.arena, self.arena_t, ship)

    def release(self, region: Region) -> None:
        assert self.arena is not None
        self.arena.release(region)

    def plan(self, state: Any, structure: Any, tensors: dict[str, Any], room: int) -> Plan | None:
        """A plan for the next save of ``state``'s layout (``Plan.build``), its views and
        messages made now, or None where none serves."""
        if self.arena is None:
            return None
        plan = Plan.build(state, structure, tensors, self.arena.capacity, room)
        if plan is not None:
            plan.prepare(self.arena, self.arena_t)
        return plan

    def swap_grown(self) -> Arena | None:
        """Put a grown arena in place, if one is ready (or, asked for by ``prepare``,
        being made: then wait for it); return the old one, for ``retire`` once nothing
        uses it (the daemon maps it for the life of a connection)."""
        if self.growth is None:
            return None
        arena = self.growth.take(wait=True)
        return None if arena is None else self._install(arena)

    def bridge(self, room: int) -> Arena | None:
        """With "auto", before a checkpoint of ``room`` bytes of staging that the arena
        cannot hold (nothing in flight): put a larger arena, of up to ``sizing.BRIDGE``,
        in place now for it to stream through (``sizing.bridge_for``); return the old
        one, for ``retire``, or None where none is made. The arena that fits is made
        in the background after its commit (``want``)."""
        if self.growth is None:
            return None
        self._arena_ready.join()
        if self.arena is None:
            return None
        size = sizing.bridge_for(room, self.arena.capacity, self.growth.limit)
        if size is None:
            return None
        try:
            arena = Arena(size)
        except (OSError, ValueError) as exc:
            log.warning("could not make %d MiB of staging for a checkpoint of %d MiB: %s; it streams "
                        "through the %d MiB there is", size >> 20, room >> 20, exc, self.arena.capacity >> 20)
            return None
        log.info("staging grew from %d MiB to %d MiB for a checkpoint of %d MiB (the arena that holds it is "
                 "made after it)", self.arena.capacity >> 20, size >> 20, room >> 20)
        return self._install(arena)

    def _install(self, arena: Arena) -> Arena | None:
        """Put ``arena`` in place of the current one (between steps); return the old one."""
        self._arena_ready.join()
        old, self.arena = self.arena, arena
        self._unpin()
        self._set_views()
        return old

    def retire(self, old: Arena | None) -> None:
        if old is not None:
            self._blocked_before += old.blocked_s
            old.close()

    def close(self) -> None:
        """Free staging (after the connection that used it is closed)."""
        self._arena_ready.join()
        if self.growth is not None:
            self.growth.close()
        if self.arena is not None:
            self._unpin()
            self.arena.close()

    def _make_arena(self, size: int) -> None:
        background_priority()
        try:
            self.arena = Arena(size)
        except BaseException as exc:
            self._arena_error = exc

    def _set_views(self) -> None:
        """Typed views of the whole arena, which every copy into staging goes through."""
        import numpy as np

        assert self.arena is not None
        self.arena_t = self.arena.tensor()
        self._arena_np = np.frombuffer(self.arena._mm, dtype=np.uint8)

    def stage(self, conn: Outlet, st: Step | None, step: int, name: str, item: Item) -> None:
        """Copy ``item`` into staging and queue it on ``conn`` (connected, under its
        emit lock): into the open batch, whole, or in pieces."""
        arena = self.arena
        assert arena is not None
        # a step's first tensor wakes the sender: the daemon knows the step is open (a SIGTERM waits for its commit)
        wake = st is None or not st.opened
        batcher = conn.batcher
        if st is not None:
            if not wake and batcher is not None and item.shard is None and batcher.wants(item):
                batcher.take(step, name, item)
                return
            st.opened = True
        if batcher is not None:
            batcher.flush()
        header = dict(step=step, name=name, dtype=item.dtype.name, shape=item.shape,
                      nbytes=item.nbytes, numpy=item.is_numpy)
        if item.shard is not None:
            header["shard"] = item.shard.to_dict()
        if item.frozen:
            header["frozen"] = True
        # in shared memory, quarters of the arena: the daemon writes one while the next is copied
        piece = arena.capacity // 4 if conn.shm else min(arena.capacity, conn.max_frame)
        if item.nbytes <= piece:
            region = self.alloc(item.nbytes, name, conn.drain)
            event = None
            if region is not None:
                try:
                    event = self.copy_whole(region, item)
                except BaseException:
                    arena.release(region)
                    raise
            conn.send_tensor(header, 0, region, event, wake)
            return
        # larger than staging or a frame: in pieces; emit returns only once every byte is copied
        flat = self._flat_bytes(item)
        for start in range(0, item.nbytes, piece):
            n = min(piece, item.nbytes - start)
            region = self.alloc(n, name, conn.drain)
            assert region is not None
            try:
                event = self._copy_bytes(region, flat, start, n, item)
            except BaseException:
                arena.release(region)
                raise
            conn.send_tensor(header, start, region, event, wake)
            wake = False

    def alloc(self, nbytes: int, name: str, on_wait: Callable[[int | None], None]) -> Region | None:
        """A region of ``nbytes`` for tensor ``name``, waiting (``on_full = "block"``) up
        to ``emit_timeout``; ``on_wait`` runs before any wait (``Arena.alloc``). None for no bytes."""
        if nbytes == 0:
            return None
        assert self.arena is not None
        return self.arena.alloc(
            nbytes, timeout=self._options.emit_timeout, block=self._options.on_full == "block",
            what=f"tensor {name!r} ({nbytes} bytes)", on_wait=on_wait,
        )

    def copy_whole(self, region: Region, item: Item) -> Any:
        """Copy a tensor into its region as its own dtype and shape (strided views
        included); return the CUDA event the sender waits on, or None."""
        if item.is_numpy:
            import numpy as np

            dst = self._arena_np[region.start:region.start + region.nbytes]
            np.copyto(dst.view(item.source.dtype).reshape(item.shape), item.source, casting="no")
            return None
        dst = self.arena_t[region.start:region.start + region.nbytes]
        dst = dst.view(item.source.dtype).view(item.shape)
        if item.is_cuda:
            return self._copy_from_cuda(dst, item.source)
        dst.copy_(item.source.detach())
        return None

    @staticmethod
    def _flat_bytes(item: Item) -> Any:
        """The tensor's bytes as one flat uint8 view (a contiguous copy only if it is strided)."""
        if item.is_numpy:
            import numpy as np

            return np.ascontiguousarray(item.source).reshape(-1).view(np.uint8)
        import torch

        t = item.source.detach().resolve_conj().resolve_neg()
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _copy_bytes(self, region: Region, flat: Any, start: int, n: int, item: Item) -> Any:
        if item.is_numpy:
            self._arena_np[region.start:region.start + n] = flat[start:start + n]
            return None
        dst = self.arena_t[region.start:region.start + n]
        if item.is_cuda:
            return self._copy_from_cuda(dst, flat[start:start + n])
        dst.copy_(flat[start:start + n])
        return None

    def _copy_from_cuda(self, dst: Any, src: Any) -> Any:
        """Start an async device-to-host copy into pinned staging; return its event.

        The side stream first waits for the current stream (the tensor's producer
        kernels), and the current stream then waits for the copy, so later in-place
        updates cannot race it; the CPU never blocks. The sender thread waits on
        the returned event before shipping the bytes.
        """
        import torch

        cuda = self._pin()
        device = src.device
        current = torch.cuda.current_stream(device)
        side = cuda["streams"].setdefault(device, torch.cuda.Stream(device))
        src = src.detach()
        device_copy = self._options.gpu_snapshot == "device"
        if device_copy:
            # the clone on the current stream is the snapshot: the training stream never waits for the host copy
            src = src.clone()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        src.record_stream(side)  # the allocator must not reuse src's memory before the copy
        if not device_copy:
            current.wait_event(event)  # in-place updates after emit wait for the copy
        return event

    def _pin(self) -> dict[str, Any]:
        if self._cuda is not None:
            return self._cuda
        import torch

        t = self.arena_t
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0:
            raise CheckpointError(f"cudaHostRegister of {t.numel()} bytes of staging failed (error {err})")
        self._cuda = {"ptr": t.data_ptr(), "streams": {}}
        return self._cuda

    def _unpin(self) -> None:
        if self._cuda is not None:
            import torch

            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._cuda["ptr"])
            self._cuda = None
