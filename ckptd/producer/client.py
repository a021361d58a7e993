"""``Producer``: the API a training loop calls (docs/usage.md).

``emit`` validates a tensor, copies it into the staging arena (a snapshot: the
caller may overwrite the tensor as soon as ``emit`` returns) and queues it for
the sender thread. ``commit`` closes a step and returns a ``CommitHandle`` that
resolves when the daemon has made the step durable, or fails with
``CheckpointError``. Failures always reach the caller: through the handle,
``flush()`` and ``close()``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import config as config_mod
from .. import curve
from .. import dtypes, env, handoff, measures, unixsock, wire
from ..attempt import current as current_attempt
from ..errors import CheckpointError
from ..manifest import CheckpointInfo, Shard, check_json
from ..names import check_name, check_rank, check_run, check_step
from ..sharding import Box, hand_shard, intersect, is_dtensor, piece_name
from ..state import flatten
from . import frozen as frozen_mod, sharded, sizing
from .batch import Batcher
from .pacing import Pacer, broadcast_from_rank0, check_bounds
from .plan import Plan
from .staging import Arena, Region
from .transport import Transport

log = logging.getLogger("ckptd.producer")

PLANS_KEPT = 4  # state layouts whose save plans a producer keeps (plan.py)


class CommitHandle:
    """The outcome of one ``commit``: resolves once the daemon made the step durable."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._event = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: str | None = None
        self.observed = False  # a failure raised by wait() is not raised again by flush()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the commit is acknowledged; return its info or raise CheckpointError."""
        if not self._event.wait(timeout):
            raise CheckpointError(f"commit of step {self.step} was not acknowledged within {timeout} s")
        if self._error is not None:
            self.observed = True
            raise CheckpointError(self._error)
        assert self._info is not None
        return self._info

    def _resolve(self, info: CheckpointInfo | None = None, error: str | None = None) -> bool:
        if self._event.is_set():
            return False
        self._info, self._error = info, error
        self._event.set()
        return True

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<CommitHandle step={self.step} {state}>"


@dataclass(eq=False)
class _Step:
    """What this producer knows of a step it is emitting or committing."""

    names: set[str] = field(default_factory=set)
    pieces: dict[str, list[Box]] = field(default_factory=dict)  # hand-placed pieces emitted, by tensor
    room: int = 0  # staging bytes its tensors take at once (sizing.room_for)
    replicas: dict[str, int] = field(default_factory=dict)  # tensors of the step another rank writes
    handle: CommitHandle | None = None  # set once commit() was called
    error: str | None = None  # the daemon failed it before commit()
    opened: bool = False  # a tensor of it went out alone: the daemon knows the step is open
    began: float = field(default_factory=time.monotonic)  # its first emit: the stall of emit + commit


def _frozen_first(items: dict[str, "_Tensor"], matches: Callable[[str], bool]) -> dict[str, "_Tensor"]:
    """``items`` with the tensors ``frozen=`` names first, each marked: together they fill
    chunk files of their own, which the next step links whole (docs/speed.md §5)."""
    frozen = {}
    for name, item in items.items():
        if matches(name):
            item.frozen = True
            frozen[name] = item
    return frozen | {n: i for n, i in items.items() if not i.frozen} if frozen else items


def _same_item(t: "_Tensor") -> tuple:
    """What a ``same`` item says of a tensor (wire.SAME_ITEM, after the name)."""
    return (t.dtype.name, list(t.shape), t.is_numpy, None if t.shard is None else t.shard.to_dict())


@dataclass(slots=True, eq=False)
class _Tensor:
    """A validated tensor or array, ready to stage (not frozen: made once per tensor, on
    the training thread, where a frozen dataclass's slower __init__ showed at 10,000 tensors)."""

    source: Any
    dtype: dtypes.Dtype
    shape: list[int]
    nbytes: int
    is_numpy: bool
    is_cuda: bool
    shard: Shard | None = None  # a piece of a larger tensor
    frozen: bool = False  # save(frozen=...) names it: sent in chunks of frozen tensors only


class Producer:
    def __init__(
        self,
        endpoint: str | None = None,
        run: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        retention: dict[str, Any] | None = None,
        format: str | None = None,
        **options: Any,
    ) -> None:
        cfg = config_mod.load()
        log.info("ckptd producer (pid %d): %s", os.getpid(), config_mod.describe(cfg))
        merged = {**dataclasses.asdict(cfg.producer), **options}
        self.options: config_mod.ProducerConfig = config_mod.build(
            config_mod.ProducerConfig, merged, "Producer options"
        )
        if endpoint is None:
            endpoint = env.endpoint()
        self.endpoint = (
            config_mod.resolve_endpoint(endpoint, Path.cwd()) if endpoint else cfg.endpoint
        )
        self._curve_keys = curve.client_keys(self.endpoint, cfg, options)  # tcp:// only; files checked now
        # the config that starts a daemon at this endpoint, for "start one with ..." hints
        self._serve_config = cfg.path if cfg.path is not None and self.endpoint == cfg.endpoint else None
        run = run if run is not None else env.run()
        self.run = check_run(run) if run is not None else None
        if rank is None:
            rank = 0 if env.rank() is None else env.rank()
        if world_size is None:
            world_size = 1 if env.world_size() is None else env.world_size()
        self.rank, self.world_size = check_rank(rank, world_size)
        # the launcher's node-local identity (torchrun, Slurm's wrappers): information only,
        # each node's ranks reach their own node's daemon through its endpoint
        local_rank, local_world_size = env.local_rank(), env.local_world_size()
        self.local_rank = self.rank if local_rank is None else local_rank
        self.local_world_size = self.world_size if local_world_size is None else local_world_size
        # this run's own [retention] keys, checked here and applied by the daemon
        self.retention = retention
        if retention is not None:
            from ..retention import merge

            merge(cfg.retention, retention, "Producer(retention=...)")
        # this run's storage format; None: the daemon's [daemon] format
        if format is not None and format not in config_mod.FORMATS:
            raise ValueError(f"format={format!r}: use one of {', '.join(map(repr, config_mod.FORMATS))}, "
                             "or None for the daemon's [daemon] format")
        self.format = format
        self.attempt = current_attempt(self.options.attempt, self.world_size, env.elastic())  # elastic restarts

        self._lock = threading.Lock()  # bookkeeping shared with the sender thread
        self._emit_lock = threading.Lock()  # one emit at a time: regions go out in order
        self._steps: dict[int, _Step] = {}
        self._commits: dict[int, CommitHandle] = {}  # wire seq -> handle
        self._queries: dict[int, list[Any]] = {}  # wire seq -> [event, answer]
        self._failures: list[CommitHandle] = []  # failed commits flush() has not raised yet
        self._seq = 0
        self._current_step: int | None = None
        self._transport: Transport | None = None
        self._welcome: threading.Event | None = None
        self._hello_error: str | None = None
        self._max_frame = 0
        self._shm = False  # this connection's tensors travel through the shared arena
        self._batcher: Batcher | None = None  # small tensors' open batch (shared memory only)
        self._batches = False  # the daemon takes batches (its welcome says so)
        # the layouts of the last few states saved, newest last, for their next saves (plan.py);
        # a few, since a loop may save more than one state (a model, and its optimizer apart)
        self._plans: list[Plan] = []
        self._closed = False
        self._frozen = frozen_mod.Frozen()  # save(frozen=...): what the daemon stores already
        self._blocked_before = 0.0  # blocked_seconds of arenas that grown ones replaced
        self._arena: Arena | None = None
        self._arena_error: BaseException | None = None
        # staging_size = "auto": start small, grow to fit (sizing); else exactly what was asked
        self._growth: sizing.Growth | None = None
        size = self.options.staging_size
        if size is None:
            self._growth = sizing.Growth(self.options.staging_limit or sizing.default_limit())
            size = min(sizing.INITIAL, self._growth.limit)
        # Allocate and pre-fault staging in the background now, so the first
        # checkpoint does not pay for page faults (mmap releases the GIL).
        self._arena_ready = threading.Thread(target=self._make_arena, args=(size,), name="ckptd-staging",
                                             daemon=True)
        self._arena_ready.start()
        self._cuda: Any = None
        self._advice: dict[str, Any] | None = None  # the daemon's interval advice for this run (should_save)
        self._pacer = Pacer()
        self._agree: Any = None  # rank 0's plan to every rank (pacing.broadcast_from_rank0), made at first use
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            p = ref()
            if p is not None:
                p._close_at_exit()
        atexit.register(close_at_exit)
        # Find the daemon now, not at the first checkpoint hours in (on_no_daemon).
        self._connector: threading.Thread | None = None
        if self.run is not None:
            if self.options.on_no_daemon == "raise":
                with self._emit_lock:
                    self._ensure_connected()
            else:
                self._connector = threading.Thread(target=self._connect_early, name="ckptd-connect", daemon=True)
                self._connector.start()

    # -- public API -------------------------------------------------------------------------
    def emit(self, name: str, tensor: Any, *, step: int | None = None,
             global_shape: Any = None, offset: Any = None) -> str:
        """Snapshot ``tensor`` as ``name`` of ``step`` and return; it is written in the background.

        ``global_shape=`` and ``offset=`` (per dimension) say that ``tensor`` is the
        piece at ``offset`` of a tensor of ``global_shape`` that several ranks hold
        pieces of (each rank emits its own under the same name; a rank may emit
        several pieces of one tensor, which must not overlap). A DTensor is stored
        as its local piece; one replicated over ranks is written by one of them.

        Returns the name the tensor is stored under: ``name``, except for a rank's
        second and later pieces of one tensor (``sharding.piece_name``, docs/format.md)."""
        step = self._resolve_step(step)
        check_name(name)
        if global_shape is not None or offset is not None:
            if is_dtensor(tensor):
                raise ValueError(f"emit({name!r}, ...): a DTensor places itself; drop global_shape= and offset=")
            item = self._describe(name, tensor)
            item = dataclasses.replace(item, shard=hand_shard(name, item.shape, global_shape, offset))
        elif is_dtensor(tensor):
            planned = sharded.plan({name: tensor}, self.rank, self.world_size)
            if name in planned.replicas:  # another rank of its mesh writes this replicated piece
                with self._emit_lock:
                    self._claim(step, name, replica_of=planned.replicas[name])
                return name
            source, shard = planned.stage[name]
            item = dataclasses.replace(self._describe(name, source), shard=shard)
        else:
            item = self._describe(name, tensor)
        with self._emit_lock:
            self._grow_between_steps()
            if global_shape is not None:
                name, item = self._place_piece(step, name, item)
            self._claim(step, name)
            try:
                self._stage(step, name, item)
            except BaseException:
                with self._lock:
                    st = self._steps.get(step)
                    if st is not None:
                        st.names.discard(name)
                raise
            with self._lock:
                st = self._steps.get(step)
                if st is not None:
                    st.room += sizing.room_for([item.nbytes])
                    if global_shape is not None and item.shard is not None:
                        st.pieces.setdefault(item.shard.tensor or name, []).append(
                            Box(tuple(item.shard.offsets), tuple(item.shape)))
        return name

    def _place_piece(self, step: int, name: str, item: _Tensor) -> tuple[str, _Tensor]:
        """Where a hand-placed piece of tensor ``name`` is kept: under ``name`` if it is
        this rank's first piece of it in ``step``, else under ``piece_name``, its shard
        naming the tensor (docs/format.md). ValueError if it overlaps one emitted before."""
        assert item.shard is not None
        box = Box(tuple(item.shard.offsets), tuple(item.shape))
        with self._lock:
            st = self._steps.get(step)
            earlier = list(st.pieces.get(name, ())) if st is not None else []
        for other in earlier:
            both = intersect(box, other)
            if both is not None and both.numel:
                raise ValueError(f"emit({name!r}, ...): the piece at offsets {list(box.offsets)} of shape "
                                 f"{list(box.sizes)} overlaps the piece at offsets {list(other.offsets)} of shape "
                                 f"{list(other.sizes)} emitted before in step {step}; emit each block once")
        if not earlier:
            return name, item
        return piece_name(name, box.offsets), dataclasses.replace(
            item, shard=dataclasses.replace(item.shard, tensor=name))

    def commit(self, step: int, *, metadata: dict[str, Any] | None = None, structure: Any = None,
               replicas: dict[str, int] | None = None) -> CommitHandle:
        """Close ``step``: the daemon makes it durable, then the handle resolves.

        For layers that emit a state piece by piece (``ckptd.dcp``): ``structure`` is
        the saved state's structure (``ckptd.state.flatten``'s) over the tensors
        emitted, and ``replicas`` names the tensors it refers to that another rank
        writes (``{name: that rank}``)."""
        check_step(step)
        state_json = None if structure is None else json.dumps(structure, ensure_ascii=False, allow_nan=False)
        with self._emit_lock:
            for name, writer in (replicas or {}).items():
                self._claim(step, check_name(name), replica_of=writer)
        return self._commit(step, metadata, None, state_json)

    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None,
             replicated: Any = None, frozen: Any = None) -> CommitHandle:
        """Snapshot a nested state (``{"model": sd, "optim": osd, ...}``) as ``step`` and commit it.

        DTensors are stored as this rank's pieces. ``replicated``: True (every plain
        tensor is the same on every rank) or fnmatch globs of tensor names; each such
        tensor, and each DTensor piece several ranks hold, is written by one rank.
        ``frozen``: True or fnmatch globs of tensors that do not change between saves
        (a frozen base model): once a step holding them is committed, later saves
        neither copy nor send them, and the new step refers to the stored copy. A
        torch tensor whose in-place version counter moved is copied again all the
        same (``ckptd.producer.frozen``)."""
        began = time.monotonic()  # the training loop is blocked from here to the commit
        check_step(step)
        pattern = frozen_mod.globs(frozen)
        with _no_cyclic_gc():
            # a plan copies every tensor; frozen= ones go the general way, which leaves them out
            by_plan = self._save_by_plan(state, step, metadata, replicated, began) if pattern is None else None
            if by_plan is not None:
                return by_plan
            structure, tensors = flatten(state)  # TypeError/ValueError before anything is sent
            planned = sharded.plan(tensors, self.rank, self.world_size, replicated)
            items = {name: dataclasses.replace(self._describe(name, t), shard=shard)
                     for name, (t, shard) in planned.stage.items()}
            for name in planned.replicas:  # checked on every rank, though another writes it
                if not is_dtensor(tensors[name]):
                    self._describe(name, tensors[name])
            meta_json = _metadata_json(metadata)
            state_json = json.dumps(structure, ensure_ascii=False, allow_nan=False)
            try:
                with self._emit_lock:
                    self._grow_between_steps()
                    for name, writer in planned.replicas.items():
                        self._claim(step, name, replica_of=writer)
                    self._claim(step, *items)
                    if pattern is not None:
                        self._send_same(step, items, pattern)
                        items = _frozen_first(items, pattern)
                    for name, item in items.items():
                        self._stage(step, name, item)
            except BaseException:
                self.abort(step)
                raise
            room = sizing.room_for([i.nbytes for i in items.values()])
            if pattern is None:  # (items lacks the frozen tensors it did not send)
                self._keep_plan(state, structure, tensors, planned, items, replicated, room)
        with self._lock:
            st = self._steps.get(step)
            if st is not None:  # _commit asks sizing for room to fit it next time
                st.room = room
        return self._commit(step, metadata, meta_json, state_json, began=began)

    def _save_by_plan(self, state: Any, step: int, metadata: Any, replicated: Any,
                      began: float) -> CommitHandle | None:
        """``save`` by the cached plan of the last state saved (plan.py), or None (nothing
        done) where it does not serve this one; then ``save`` goes the general way."""
        if not self._plans or (replicated and self.world_size > 1):
            return None
        for plan in reversed(self._plans):
            got = plan.collect(state)
            if got is not None:
                break
        else:
            return None
        tensors, state_json = got
        meta_json = _metadata_json(metadata)
        try:
            with self._emit_lock:
                self._grow_between_steps()
                self._ensure_connected()
                arena = self._arena
                if self._batcher is None or plan not in self._plans or arena is None:
                    return None  # inline now, or a new connection; the general way, which plans anew
                self._batcher.flush()  # regions go out in the order they were taken
                region = plan.take(arena)
                if region is None:
                    return None  # staging is busy: the general way streams through it
                messages = plan.copy(region, tensors, arena, self._arena_t)
                if messages is None:  # a tensor changed: the general way, which plans anew
                    self._plans.remove(plan)
                    return None
                try:
                    self._claim(step, *plan.names)
                except BaseException:
                    arena.release(region)
                    raise
                with self._lock:
                    st = self._steps[step]
                    st.opened = True
                    st.room = plan.room
                self._send_planned(step, region, messages)
                self._plans.remove(plan)
                self._plans.append(plan)  # the newest used
        except BaseException:
            self.abort(step)
            raise
        return self._commit(step, metadata, meta_json, state_json, began=began)

    def _send_planned(self, step: int, region: Region, messages: list[tuple[str, Any]]) -> None:
        """Queue a plan's messages in order; its one region goes back with the last's ack."""
        assert self._transport is not None
        with self._lock:  # consecutive numbers, queued in their order
            first = self._seq + 1
            self._seq += len(messages)
            region.seq = self._seq
            for i, (op, packed) in enumerate(messages):
                self._transport.send(wire.encode_packed(op, packed, seq=first + i, step=step), wake=False)

    def _keep_plan(self, state: Any, structure: Any, tensors: dict[str, Any], planned: Any,
                   items: dict[str, _Tensor], replicated: Any, room: int) -> None:
        """After a general save: the plan for the next save of the same layout, where one serves."""
        if self._batcher is None or self._arena is None or planned.replicas or (replicated and self.world_size > 1) \
                or len(items) != len(tensors) or any(i.shard is not None or i.is_numpy or i.is_cuda for i in items.values()):
            return
        plan = Plan.build(state, structure, tensors, self._arena.capacity, room)
        if plan is not None:
            plan.prepare(self._arena, self._arena_t)
            self._plans = [*self._plans[-(PLANS_KEPT - 1):], plan]

    @contextmanager
    def checkpoint(self, step: int, metadata: dict[str, Any] | None = None) -> Iterator[CommitHandle]:
        """Emits inside the block belong to ``step``; a clean exit commits (without
        waiting), an exception aborts the step."""
        check_step(step)
        meta_json = _metadata_json(metadata)
        if self._current_step is not None:
            raise ValueError(f"checkpoint({step}) inside checkpoint({self._current_step}); blocks do not nest")
        handle = CommitHandle(step)
        self._current_step = step
        began = time.monotonic()
        try:
            yield handle
        except BaseException:
            self.abort(step)
            handle._resolve(error=f"step {step} was aborted by an exception in its checkpoint block")
            raise
        finally:
            self._current_step = None
        self._commit(step, metadata, meta_json, None, handle=handle, began=began)

    def abort(self, step: int) -> None:
        """Drop an uncommitted step; the daemon discards what it received of it."""
        with self._lock:
            st = self._steps.get(step)
            if st is None or st.handle is not None:
                return
            del self._steps[step]
        if self._transport is not None and self._transport.lost is None:
            with self._emit_lock:
                self._send_batch()
            self._send("abort", step=step, reason="aborted by the producer")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every commit made so far is durable; raise CheckpointError naming
        every failed commit that no ``handle.wait()`` has raised already."""
        if self._transport is not None and self._transport.lost is None:
            with self._emit_lock:
                self._send_batch()
        with self._lock:
            handles = [st.handle for st in self._steps.values() if st.handle is not None]
        for h in handles:
            if not h._event.wait(timeout):
                raise CheckpointError(f"commit of step {h.step} was not acknowledged within {timeout} s")
        self._raise_unseen_failures()

    def _raise_unseen_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        unseen = [h._error for h in failures if not h.observed]
        if unseen:
            raise CheckpointError("; ".join(e for e in unseen if e))

    def wait_complete(self, step: int, timeout: float | None = None, *, tier: str | None = None) -> CheckpointInfo:
        """Wait until every rank's share of ``step`` is durable in the remote tier (or,
        with no ``[remote]``, on the shared root), as the storage itself shows it;
        ``tier="peer"``: until every rank's share has a replica in a peer's memory."""
        from ..completion import wait_complete

        return wait_complete(self._need_run(), check_step(step), timeout=timeout, world_size=self.world_size,
                             tier=tier)

    def latest(self, run: str | None = None) -> CheckpointInfo | None:
        """Ask the daemon for the newest complete checkpoint of ``run`` (default: this run)."""
        run = check_run(run) if run is not None else self._need_run()
        with self._emit_lock:
            self._ensure_connected()
        done = threading.Event()
        answer: list[Any] = [done, None]
        seq = self._send("latest", register=self._queries, value=answer, run=run)
        if not done.wait(self.options.timeout):
            raise CheckpointError(f"the daemon at {self.endpoint} did not answer within {self.options.timeout:.0f} s")
        self._queries.pop(seq, None)
        reply = answer[1]
        if reply.get("op") == "error":
            raise CheckpointError(reply["message"])
        return CheckpointInfo.from_dict(reply["info"]) if reply["info"] else None

    def close(self) -> None:
        """Wait for outstanding commits, then disconnect and free staging memory; raise
        CheckpointError, as ``flush`` does, naming every failed commit not raised yet
        (also when the daemon was lost: a step is committed, or the caller is told)."""
        if self._closed:
            return
        if self._connector is not None:
            self._connector.join()
        try:
            if self._transport is not None and self._transport.lost is None:
                self.flush()
            else:
                self._raise_unseen_failures()
        finally:
            self._closed = True
            transport, self._transport = self._transport, None
            if transport is not None:
                if transport.lost is None:
                    transport.send(wire.encode("bye"))
                transport.close()
            self._arena_ready.join()
            if self._growth is not None:
                self._growth.close()
            if self._arena is not None:
                self._unpin()
                self._arena.close()

    def stats(self) -> dict[str, Any]:
        """How this producer is doing: its identity (``rank``, ``world_size`` and the
        launcher's ``local_rank``, ``local_world_size``), ``transport`` ("shm" or
        "inline", None before the first connection), ``staging_bytes`` (the arena's size
        now), ``staging_limit`` (what it may grow to: its fixed size unless
        ``staging_size = "auto"``), ``blocked_seconds`` (total time ``emit`` waited for
        staging space, i.e. for the daemon, since the producer was made)."""
        arena = self._arena
        return {
            "rank": self.rank, "world_size": self.world_size,
            "local_rank": self.local_rank, "local_world_size": self.local_world_size,
            "transport": None if self._transport is None else ("shm" if self._shm else "inline"),
            "staging_bytes": arena.capacity if arena is not None else 0,
            "staging_limit": self._growth.limit if self._growth is not None else self.options.staging_size,
            "blocked_seconds": self._blocked_before + (arena.blocked_s if arena is not None else 0.0),
        }

    def should_save(self, step: int, *, min_steps: int | None = None, max_steps: int | None = None,
                    min_seconds: float | None = None, max_seconds: float | None = None) -> bool:
        """Whether to save ``step`` now: True once the daemon's advised interval
        (docs/advise.md) has passed since the last step this answered True for, within
        the bounds given (which always win). Cheap: no round trip to the daemon. With
        no advice yet (a run's first save) it answers True at once. Every rank answers
        the same for a step (rank 0 decides, docs/advise.md): call it on every rank, at
        every step, with the same bounds. The first call connects to the daemon, if
        this producer has not yet."""
        check_step(step)
        check_bounds(min_steps, max_steps, min_seconds, max_seconds)
        if self._agree is None:  # the first call: connected, so that the welcome's advice is here
            with self._emit_lock:
                self._ensure_connected()
            self._agree = broadcast_from_rank0(self.world_size)
        advice = self._advice
        interval = advice.get("interval_seconds") if advice else None
        return self._pacer.should_save(step, interval, self._agree, (min_steps, max_steps, min_seconds, max_seconds))

    def advice(self) -> dict[str, Any] | None:
        """The daemon's latest interval advice for this run, as ``ckptd advise --json``
        prints it (it came with the last commit's reply), or None before any."""
        return self._advice

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- emit, piece by piece -------------------------------------------------------------------
    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            if self._current_step is None:
                raise ValueError(
                    "emit() needs a step: pass step=..., or call it inside `with producer.checkpoint(step):`"
                )
            return self._current_step
        return check_step(step)

    def _describe(self, name: str, value: Any) -> _Tensor:
        import numpy as np
        import torch

        if (type(value) is torch.Tensor or type(value) is torch.nn.Parameter) and value.layout is torch.strided \
                and (value.is_cpu or value.is_cuda) and not value.is_quantized and not value.is_nested:
            d = dtypes.by_torch(value.dtype)  # the common case, checked in as few calls as it takes
            return _Tensor(value, d, list(value.shape), value.numel() * d.itemsize, False, value.is_cuda)
        if isinstance(value, np.ndarray):
            found = dtypes.BY_NUMPY.get(value.dtype.name)
            if found is None or value.dtype.hasobject:
                raise TypeError(f"array {name!r} has numpy dtype {value.dtype}, which ckptd cannot store")
            if value.dtype.byteorder not in "=|":
                raise TypeError(
                    f"array {name!r} is big-endian ({value.dtype}); convert it with "
                    "arr.astype(arr.dtype.newbyteorder('='))"
                )
            return _Tensor(value, found, list(value.shape), value.nbytes, True, False)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor or numpy.ndarray")
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
        return _Tensor(value, d, list(value.shape), value.numel() * d.itemsize, False, value.is_cuda)

    def _claim(self, step: int, *names: str, replica_of: int | None = None) -> None:
        with self._lock:
            st = self._steps.get(step)
            if st is None:
                st = self._steps[step] = _Step()
            if st.handle is not None:
                raise ValueError(f"step {step} was already committed by this producer")
            if len(names) == 1:
                clash = names[0] in st.names or names[0] in st.replicas
            else:  # a save's thousands of names, checked in C
                clash = not st.names.isdisjoint(names) or not st.replicas.keys().isdisjoint(names)
            if clash:
                name = next(n for n in names if n in st.names or n in st.replicas)
                raise ValueError(f"tensor name {name!r} was already emitted in step {step}")
            if replica_of is None:
                st.names.update(names)
            else:
                st.replicas.update(dict.fromkeys(names, replica_of))

    def _stage(self, step: int, name: str, item: _Tensor) -> None:
        self._ensure_connected()
        arena = self._arena
        assert arena is not None
        # A step's first tensor goes out alone and wakes the sender, so that the daemon
        # knows the step is open at once (a SIGTERM then waits for its commit, docs/service.md);
        # later ones leave the sender asleep until the commit (Transport.send), and small
        # ones wait in a batch. (A batch item has no shard field: pieces go alone.)
        st = self._steps.get(step)
        wake = st is None or not st.opened
        if st is not None:
            if not wake and self._batcher is not None and item.shard is None and self._batcher.wants(item):
                self._batcher.take(step, name, item)
                return
            st.opened = True
        if self._batcher is not None:
            self._batcher.flush()  # regions go out in the order they were taken
        header = dict(step=step, name=name, dtype=item.dtype.name, shape=item.shape,
                      nbytes=item.nbytes, numpy=item.is_numpy)
        if item.shard is not None:
            header["shard"] = item.shard.to_dict()
        if item.frozen:
            header["frozen"] = True
        # In shared memory a large tensor goes in quarters of the arena, so that the
        # daemon writes one while the next is copied; inline, frames are capped too.
        piece = arena.capacity // 4 if self._shm else min(arena.capacity, self._max_frame)
        if item.nbytes <= piece:
            region = self._alloc(item.nbytes, name)
            event = None
            if region is not None:
                try:
                    event = self._copy_whole(region, item)
                except BaseException:
                    arena.release(region)
                    raise
            self._send_tensor(header, 0, region, event, wake)
            return
        # Larger than staging or the daemon's frame limit: travel in pieces. emit
        # still returns only when every byte is copied, so the snapshot holds.
        flat = self._flat_bytes(item)
        for start in range(0, item.nbytes, piece):
            n = min(piece, item.nbytes - start)
            region = self._alloc(n, name)
            assert region is not None
            try:
                event = self._copy_bytes(region, flat, start, n, item)
            except BaseException:
                arena.release(region)
                raise
            self._send_tensor(header, start, region, event, wake)
            wake = False

    def _alloc(self, nbytes: int, name: str) -> Region | None:
        if nbytes == 0:
            return None
        assert self._arena is not None
        return self._arena.alloc(
            nbytes, timeout=self.options.emit_timeout, block=self.options.on_full == "block",
            what=f"tensor {name!r} ({nbytes} bytes)", on_wait=self._drain,
        )

    def _drain(self) -> None:
        """Before waiting for staging: ship what was queued without waking the sender,
        and ask the daemon to write out every chunk it still gathers for this producer
        (``drain``), so that the wait is only ever for bytes being written. The daemon
        gives staging back only once it has written it, and it would otherwise hold
        the small tensors of an open chunk until the commit, which cannot come while
        this emit waits (docs/protocol.md, Flow control). Under ``_emit_lock``, so no
        other region is taken before the wait."""
        if self._transport is None or self._transport.lost is not None:
            return
        if self._shm:
            self._send("drain")  # wakes the sender: what was queued leaves before it
        else:
            self._transport.kick()  # inline, staging is free once the daemon has read it

    def _copy_whole(self, region: Region, item: _Tensor) -> Any:
        """Copy a tensor into its region as its own dtype and shape (strided views included)."""
        assert self._arena is not None
        if item.is_numpy:
            import numpy as np

            dst = self._arena_np[region.start:region.start + region.nbytes]
            np.copyto(dst.view(item.source.dtype).reshape(item.shape), item.source, casting="no")
            return None
        dst = self._arena_t[region.start:region.start + region.nbytes]
        dst = dst.view(item.source.dtype).view(item.shape)
        if item.is_cuda:
            return self._copy_from_cuda(dst, item.source)
        dst.copy_(item.source.detach())
        return None

    def _flat_bytes(self, item: _Tensor) -> Any:
        """The tensor's bytes as one flat uint8 view (a contiguous copy only if it is strided)."""
        if item.is_numpy:
            import numpy as np

            return np.ascontiguousarray(item.source).reshape(-1).view(np.uint8)
        import torch

        t = item.source.detach().resolve_conj().resolve_neg()  # materialise lazy views
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _copy_bytes(self, region: Region, flat: Any, start: int, n: int, item: _Tensor) -> Any:
        if item.is_numpy:
            self._arena_np[region.start:region.start + n] = flat[start:start + n]
            return None
        dst = self._arena_t[region.start:region.start + n]
        if item.is_cuda:
            return self._copy_from_cuda(dst, flat[start:start + n])
        dst.copy_(flat[start:start + n])
        return None

    def _send_tensor(self, header: dict[str, Any], start: int, region: Region | None, event: Any,
                     wake: bool = True) -> None:
        assert self._arena is not None and self._transport is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
            if region is not None:
                region.seq = seq
        if self._shm and region is not None:  # the daemon reads the bytes where they are
            msg = wire.encode("tensor", seq=seq, start=start, offset=region.start, length=region.nbytes, **header)
            self._transport.send(msg, None, event, wake=wake)
            return
        payload = self._arena.view(region) if region is not None else b""
        self._transport.send(wire.encode("tensor", seq=seq, start=start, **header), payload, event, wake=wake)

    # -- CUDA: pinned staging, side stream, events (docs/usage.md, CUDA tensors) ---------------------------------
    def _copy_from_cuda(self, dst: Any, src: Any) -> Any:
        """Start an async device-to-host copy into pinned staging; return its event.

        The side stream first waits for the current stream (the tensor's producer
        kernels), and the current stream then waits for the copy, so later in-place
        updates cannot race it; the CPU never blocks. The sender thread waits on
        the returned event before shipping the bytes.
        """
        import torch

        self._pin()
        device = src.device
        current = torch.cuda.current_stream(device)
        side = self._cuda["streams"].setdefault(device, torch.cuda.Stream(device))
        src = src.detach()
        device_copy = self.options.gpu_snapshot == "device"
        if device_copy:
            # A device-to-device clone on the current stream (HBM bandwidth) is the
            # snapshot: later updates change src, not the clone, so the training
            # stream never waits for the slower copy to the host.
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

    def _pin(self) -> None:
        if self._cuda is not None:
            return
        import torch

        t = self._arena_t
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0:
            raise CheckpointError(f"cudaHostRegister of {t.numel()} bytes of staging failed (error {err})")
        self._cuda = {"ptr": t.data_ptr(), "streams": {}}

    def _unpin(self) -> None:
        if self._cuda is not None:
            import torch

            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._cuda["ptr"])
            self._cuda = None

    # -- commit -------------------------------------------------------------------------------
    def _commit(self, step: int, metadata: Any, meta_json: str | None, state_json: str | None,
                handle: CommitHandle | None = None, began: float | None = None) -> CommitHandle:
        if meta_json is None:
            meta_json = _metadata_json(metadata)
        handle = handle or CommitHandle(step)
        with self._lock:
            st = self._steps.setdefault(step, _Step())
            if st.handle is not None:
                raise ValueError(f"step {step} was already committed by this producer")
            st.handle = handle
            error = st.error
            room = st.room
        self._want_staging(room)
        if error is not None:  # the daemon failed this step already: do not commit it
            self._finish(step, handle, error=error)
            if self._transport is not None and self._transport.lost is None:
                self._send("abort", step=step, reason="failed before commit")
            return handle
        try:
            with self._emit_lock:
                self._ensure_connected()
                self._send_batch()
        except CheckpointError as exc:
            self._finish(step, handle, error=str(exc))
            handle.observed = True  # raised here, to the caller: flush() and close() do not raise it again
            raise
        # what this save cost the training loop, and the loads before it (docs/advise.md)
        timing = {"stall_s": time.monotonic() - (st.began if began is None else began),
                  "restore_s": measures.take_restored(self.run) if self.run is not None else None}
        self._send("commit", register=self._commits, value=handle, step=step,
                   ntensors=len(st.names), state=state_json or "null", metadata=meta_json,
                   replicas=st.replicas or None, timing=timing)
        return handle

    def _send_same(self, step: int, items: dict[str, _Tensor], pattern: Any) -> None:
        """Describe the frozen tensors the daemon stores already (``same``) and take them
        out of ``items``, which are staged after: before any tensor, so the message opens
        the step and the daemon links them first (under _emit_lock)."""
        base, same = self._frozen.split(step, items, pattern, _same_item)
        if not same:
            return
        self._ensure_connected()
        self._send_batch()
        self._send("same", step=step, base=base, items=same)
        with self._lock:
            st = self._steps.get(step)
            if st is not None:
                st.opened = True

    def _finish(self, step: int, handle: CommitHandle, info: CheckpointInfo | None = None,
                error: str | None = None) -> None:
        self._frozen.done(step, error is None)
        with self._lock:
            st = self._steps.get(step)
            if st is not None and st.handle is handle:
                del self._steps[step]
            if handle._resolve(info, error) and error is not None:
                self._failures.append(handle)
        if error is not None:
            log.error("checkpoint step %d failed: %s", step, error)

    # -- the connection -------------------------------------------------------------------------
    def _need_run(self) -> str:
        if self.run is None:
            raise ValueError("no run id: pass run= to configure() / Producer(), or set CKPTD_RUN")
        return self.run

    def _make_arena(self, size: int) -> None:
        try:
            self._arena = Arena(size)
        except BaseException as exc:  # reported at first use
            self._arena_error = exc

    def _want_staging(self, room: int) -> None:
        """A checkpoint takes ``room`` bytes of staging: with "auto", grow to fit it."""
        if self._growth is not None and self._arena is not None:
            self._growth.want(room, self._arena.capacity)

    def _grow_between_steps(self) -> None:
        """Swap in a grown arena (sizing) while no step is in flight; under _emit_lock.

        The daemon maps an arena for the life of a connection, so the new one comes
        with a new connection: a bye, then the next send says hello with it."""
        if self._growth is None:
            return
        with self._lock:
            if self._steps:  # bytes of those steps may still be in the old arena
                return
        arena = self._growth.take()
        if arena is None:
            return
        self._arena_ready.join()
        old, self._arena = self._arena, arena
        transport, self._transport = self._transport, None
        if transport is not None:
            if transport.lost is None:
                transport.send(wire.encode("bye"))
            transport.close()
        self._unpin()
        self._set_views()
        for plan in self._plans:
            plan.forget_views()  # they would keep the old arena mapped
        if old is not None:
            self._blocked_before += old.blocked_s
            old.close()

    def _set_views(self) -> None:
        """Typed views of the whole arena, which every copy into staging goes through."""
        import numpy as np

        assert self._arena is not None
        self._arena_t = self._arena.tensor()
        self._arena_np = np.frombuffer(self._arena._mm, dtype=np.uint8)

    def _connect_early(self) -> None:
        """At start, in the background: connect, or warn that no daemon answers."""
        try:
            with self._emit_lock:
                if not self._closed:
                    self._ensure_connected()
        except CheckpointError as exc:
            message = (f"ckptd: {exc}. Until that is mended, checkpoints of run {self.run!r} fail "
                       "(set [producer] on_no_daemon = \"raise\" to fail at start instead)")
            log.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # never let the thread die silently
            log.exception("ckptd producer: connecting to the daemon failed")

    def _start_hint(self) -> str:
        if self._serve_config is not None:
            return f"start one with `ckptd serve -c {self._serve_config}`, or point CKPTD_ENDPOINT at a running one"
        return (f"start one whose [daemon] endpoint is {self.endpoint} (`ckptd serve -c CONFIG`), "
                "or point CKPTD_ENDPOINT at a running one")

    def _ensure_connected(self) -> None:
        if self._closed:
            raise CheckpointError("this producer is closed")
        if self._transport is not None and self._transport.lost is None:
            return
        run = self._need_run()
        self._arena_ready.join()
        if self._arena is None:
            raise CheckpointError(
                f"cannot allocate staging memory: {self._arena_error}; lower [producer] staging_size"
            )
        if not hasattr(self, "_arena_t"):
            self._set_views()
        old, self._transport = self._transport, None
        self._frozen.forget()  # the daemon there may keep another root
        if self._batcher is not None:
            self._batcher.drop()  # its region went with the old connection
            self._batcher = None
        if old is not None:
            old.close()
            if old.stopped and self.endpoint.startswith("ipc://") \
                    and not unixsock.in_use(self.endpoint[len("ipc://"):]):
                # it said it stopped, and nobody took its place: say so now, not a timeout later
                raise CheckpointError(f"{old.lost}, and no daemon listens there now; {self._start_hint()}")
        self._arena.reset()  # whatever the old connection carried is gone with it
        self._welcome = threading.Event()
        self._hello_error = None
        token = self._offer_arena()
        self._shm = False
        transport = Transport(self.endpoint, timeout=self.options.timeout, heartbeat=self.options.heartbeat,
                              on_reply=self._on_reply, on_lost=self._on_lost, curve_keys=self._curve_keys)
        transport.send(wire.encode("hello", v=wire.VERSION, run=run, rank=self.rank,
                                   world_size=self.world_size, pid=os.getpid(), host=socket.gethostname(),
                                   retention=self.retention, format=self.format, shm_token=token,
                                   shm_size=self._arena.capacity if token else None, attempt=self.attempt))
        if not self._welcome.wait(self.options.timeout) or self._hello_error or transport.lost:
            transport.close()
            if self._hello_error:
                raise CheckpointError(f"the daemon at {self.endpoint} refused this producer: {self._hello_error}")
            if transport.refused or transport.stopped:
                raise CheckpointError(transport.lost)
            hint = self._start_hint()
            if self._curve_keys is not None:  # a CurveZMQ refusal looks like silence from here
                hint += ("; or the daemon refused this producer's CurveZMQ key, or curve_server_key is not "
                         "the daemon's public key (the daemon's log, or `ckptd status -c CONFIG`, says which)")
            raise CheckpointError(
                f"no ckptd daemon answered at {self.endpoint} within {self.options.timeout:g} s; {hint}")
        if token and not self._shm and self.options.transport == "shm":
            transport.close()
            raise CheckpointError(
                f"the daemon at {self.endpoint} could not map this producer's staging memory (its log says "
                "why); set [producer] transport = \"inline\" or \"auto\" to send tensors through the socket"
            )
        self._transport = transport
        self._batcher = Batcher(self._arena.capacity, self._arena_t.data_ptr(), self._alloc, self._arena.shrink,
                                self._send_region, self._copy_whole) if self._shm and self._batches else None

    def _send_batch(self) -> None:
        """Send the open batch of small tensors, if any (under ``_emit_lock``)."""
        if self._batcher is not None:
            self._batcher.flush()

    def _send_region(self, step: int, region: Region, items: list[Any], frozen: bool = False) -> None:
        assert self._transport is not None
        with self._lock:
            self._seq += 1
            region.seq = seq = self._seq
        fields = {"frozen": True} if frozen else {}
        self._transport.send(wire.encode("tensors", seq=seq, step=step, items=items, **fields), wake=False)

    def _offer_arena(self) -> bytes | None:
        """Hand the staging arena to the daemon, if this connection uses shared memory;
        return the token that the hello names it by."""
        mode = self.options.transport
        assert self._arena is not None
        if mode == "inline":
            return None
        ipc = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if ipc is None:
            why = f"the endpoint {self.endpoint} is not an ipc:// socket on this host"
        elif self._arena.fd < 0:
            why = "this system has no memfd_create"
        else:
            try:
                return handoff.offer(ipc, self._arena.fd, self.options.timeout)
            except handoff.HandoffRefused as exc:
                why = f"the daemon refused it: {exc}"
            except OSError as exc:
                why = f"no daemon takes it at {handoff.socket_path(ipc)}: {exc.strerror or exc}"
        if mode == "shm":
            raise CheckpointError(
                f"[producer] transport = \"shm\", but staging memory cannot be shared with the daemon: {why}; "
                "use transport = \"auto\" or \"inline\""
            )
        log.debug("tensors go inline through the socket: %s", why)
        return None

    def _send(self, op: str, *, register: dict[int, Any] | None = None, value: Any = None, **fields: Any) -> int:
        assert self._transport is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
            if register is not None:
                register[seq] = value
        self._transport.send(wire.encode(op, seq=seq, **fields))
        return seq

    # -- replies, on the sender thread -------------------------------------------------------------
    def _on_reply(self, h: dict[str, Any]) -> None:
        op = h["op"]
        if op == "ack":
            if self._arena is not None:
                self._arena.release_through(h["seq"])
        elif op == "welcome":
            self._max_frame = h["max_frame"]
            self._shm = bool(h["shm"])
            self._batches = bool(h["batch"])  # this daemon takes ``tensors`` messages
            if h["advice"] is not None:
                self._advice = h["advice"]
            if self._welcome is not None:
                self._welcome.set()
        elif op == "committed":
            if h["advice"] is not None:
                self._advice = h["advice"]
            handle = self._commits.pop(h["seq"], None)
            if handle is not None:
                self._finish(h["step"], handle, info=CheckpointInfo.from_dict(h["info"]))
        elif op == "answer":
            self._answer(h)
        elif op == "error":
            self._on_error(h)

    def _answer(self, h: dict[str, Any]) -> None:
        query = self._queries.get(h["seq"]) if h.get("seq") is not None else None
        if query is not None:
            query[1] = h
            query[0].set()

    def _on_error(self, h: dict[str, Any]) -> None:
        seq, step, message = h["seq"], h["step"], h["message"]
        if self._welcome is not None and not self._welcome.is_set() and step is None:
            self._hello_error = message  # the hello itself was refused
            self._welcome.set()
            return
        if seq is not None and seq in self._queries:
            self._answer(h)
            return
        handle = self._commits.pop(seq, None) if seq is not None else None
        if step is None and handle is None:
            log.warning("the daemon reported: %s", message)
            return
        with self._lock:
            st = self._steps.get(step) if step is not None else None
            if handle is None and st is not None:
                handle = st.handle
                if handle is not None:
                    self._commits = {k: v for k, v in self._commits.items() if v is not handle}
                elif st.error is None:
                    st.error = message  # reported again when the step is committed
        if handle is not None:
            self._finish(handle.step, handle, error=message)

    def _on_lost(self, message: str) -> None:
        """The daemon went silent: every step in flight fails, loudly."""
        if self._arena is not None:
            self._arena.break_(message)  # wakes an emit waiting for staging
        with self._lock:
            commits, self._commits = self._commits, {}
            for st in self._steps.values():
                if st.handle is None and st.error is None:
                    st.error = message
            queries = list(self._queries.values())
        for handle in commits.values():
            self._finish(handle.step, handle, error=message)
        for query in queries:
            query[1] = {"op": "error", "message": message}
            query[0].set()
        if self._welcome is not None:
            self._welcome.set()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # at exit there is no caller left to raise to: warn, never silently
            warnings.warn(f"ckptd producer at exit: {exc}", RuntimeWarning, stacklevel=1)


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while ``save`` makes its few objects per tensor:
    at 10,000 tensors its collections, each walking the training process's heap, were
    a third of the stall. Reference counting frees as usual; the pause ends with the call."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _metadata_json(metadata: Any) -> str:
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    return check_json(metadata, "commit metadata")
