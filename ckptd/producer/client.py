"""``Producer``: the API a training loop calls (docs/training.md).

``emit`` copies a tensor into staging (a snapshot: the caller may overwrite it at once)
and queues it; ``commit`` returns a ``CommitHandle`` that resolves once the step is
durable, or fails with ``CheckpointError``; failures always reach the caller. ``Producer``
checks arguments and dispatches to ``stager.Stager`` (the staging sequence),
``connection.Connection`` (the daemon), ``steps.StepBook`` (steps in flight).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterator

from .. import config as config_mod
from .. import advise, measures, replicas
from ..errors import CheckpointError
from ..manifest import CheckpointInfo, check_json
from ..names import check_name, check_run, check_step
from ..sharding import Box, hand_shard, is_dtensor
from ..state import flatten
from . import frozen as frozen_mod, preempt, sharded, sizing
from .connection import Connection, identify
from .copies import Copier, describe
from .pacing import Pacer, broadcast_from_rank0, check_bounds
from .tiering import TierPlan
from .stager import Stager
from .steps import CommitHandle, StepBook

__all__ = ["CommitHandle", "Producer"]

log = logging.getLogger("ckptd.producer")


class Producer:
    """One process's checkpoints of one run (docs/training.md); ``ckptd.producer``'s
    functions forward to a default one. Close it (or use it as a context manager)
    to learn of every failed commit; at exit it is closed for you. ``prepare=state``:
    ``self.prepare(state)`` once made (staging for the first checkpoint made ahead)."""

    def __init__(
        self,
        endpoint: str | None = None,
        run: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        retention: dict[str, Any] | None = None,
        format: str | None = None,
        prepare: Any = None,
        **options: Any,
    ) -> None:
        cfg = config_mod.load()
        log.info("ckptd producer (pid %d): %s", os.getpid(), config_mod.describe(cfg))
        merged = {**dataclasses.asdict(cfg.producer), **options}
        self.options: config_mod.ProducerConfig = config_mod.build(
            config_mod.ProducerConfig, merged, "Producer options"
        )
        who = identify(cfg, self.options, options, endpoint, run, rank, world_size, retention, format)
        self.endpoint, self.run, self.rank, self.world_size = who.endpoint, who.run, who.rank, who.world_size
        self.local_rank, self.local_world_size = who.local_rank, who.local_world_size
        self.retention, self.format, self.attempt = who.retention, who.format, who.attempt

        self._emit_lock = threading.Lock()  # one emit at a time: regions go out in order
        self._sending: Future | None = None
        self._frozen = frozen_mod.Frozen()
        self._book = StepBook(on_done=self._frozen.done)
        self._copier = Copier(self.options)
        if prepare is not None:
            try:
                self.prepare(prepare)
            except BaseException:
                self._copier.close()
                raise
        self._connection = Connection(who, self.options, self._copier, self._book, self._frozen, self._emit_lock)
        self._stager = Stager(self._copier, self._connection, self._book, self._frozen, self._emit_lock)
        self._current_step: int | None = None
        self._pacer = Pacer()
        self._tiers = TierPlan()
        self._picked: tuple[int, tuple[str, ...]] | None = None  # the step should_save chose, its tiers
        self._agree: Any = None
        self._any_rank: Any = None
        self._notices = preempt.Notices(self.options.preempt_signals, self.options.preempt_grace,
                                        preempt.resume_tier(cfg.remote.url, cfg.peer.enabled))
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            p = ref()
            if p is not None:
                p._close_at_exit()
        atexit.register(close_at_exit)
        self._connection.start()

    @property
    def preempted(self) -> bool:
        """A preemption notice arrived: one of ``[producer] preempt_signals``, or ``preempt()``."""
        return self._notices.preempted

    def preempt(self) -> None:
        """A notice that the job ends soon, from the user's own code (a cloud's metadata
        poll, a file): the next ``should_save`` answers True on every rank, and that save
        returns once durable where the job resumes from (docs/runbook.md)."""
        self._notices.preempt()

    @property
    def closed(self) -> bool:
        """``close`` was called: this producer takes nothing more."""
        return self._connection.closed

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
            item = describe(name, tensor)
            item = dataclasses.replace(item, shard=hand_shard(name, item.shape, global_shape, offset))
        elif is_dtensor(tensor):
            planned = sharded.plan({name: tensor}, self.rank, self.world_size)
            if name in planned.written_by:
                with self._emit_lock:
                    self._book.claim(step, name, written_by=planned.written_by[name])
                return name
            source, shard = planned.stage[name]
            item = dataclasses.replace(describe(name, source), shard=shard)
        else:
            item = describe(name, tensor)
        with self._emit_lock:
            piece = None
            if global_shape is not None and item.shard is not None:
                piece = (name, Box(tuple(item.shard.offsets), tuple(item.shape)))
                kept = self._book.place(step, *piece)
                if kept != name:
                    name, item = kept, dataclasses.replace(item, shard=dataclasses.replace(item.shard, tensor=name))
            self._stager.stage(step, {name: item}, room=sizing.room_for([item.nbytes]), grow_for=0, piece=piece)
        return name

    def emit_many(self, tensors: dict[str, Any], *, step: int | None = None) -> list[str]:
        """``emit`` every tensor of ``tensors`` (``{name: tensor}``, in its order) in one call;
        return the names they are stored under.

        The same snapshot as ``emit``'s, for less: a call that emits the same names,
        dtypes and shapes as an earlier call of this producer reuses its layout (a cached
        plan, as ``save``'s: one region of staging, one C++ copy loop, messages made
        once), instead of a validation, a region and a message per tensor. For an
        optimizer's thousands of small tensors, or a block that emits the same tensors
        every step. On an error, the tensors before the one named were emitted."""
        step = self._resolve_step(step)
        if not isinstance(tensors, dict):
            raise TypeError(f"emit_many takes a dict of {{name: tensor}}, not a {type(tensors).__name__}")
        if not tensors:
            return []
        if any(is_dtensor(t) for t in tensors.values()):
            return [self.emit(name, t, step=step) for name, t in tensors.items()]
        with _no_cyclic_gc():
            if self._stager.by_plan(self._stager.many_plans, tensors, step, kick=True) is not None:
                return list(tensors)
            items = {check_name(name): describe(name, t) for name, t in tensors.items()}
            room = sizing.room_for([i.nbytes for i in items.values()])
            with self._emit_lock:
                self._stager.stage(step, items, room=room)
                self._stager.keep_many(tensors, items, room)
        return list(items)

    def commit(self, step: int, *, metadata: dict[str, Any] | None = None, structure: Any = None,
               written_by: dict[str, int] | None = None) -> CommitHandle:
        """Close ``step``: the daemon makes it durable, then the handle resolves.

        For layers that emit a state piece by piece (``ckptd.dcp``): ``structure`` is
        the saved state's structure (``ckptd.state.flatten``'s) over the tensors
        emitted, and ``written_by`` names the tensors it refers to that another rank
        writes (``{name: that rank}``)."""
        check_step(step)
        state_json = None if structure is None else json.dumps(structure, ensure_ascii=False, allow_nan=False)
        with self._emit_lock:
            for name, writer in (written_by or {}).items():
                self._book.claim(step, check_name(name), written_by=writer)
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
        began = time.monotonic()
        check_step(step)
        if self._sending is not None:
            self._sending.result()  # the last save's late commit goes first
        pattern = frozen_mod.globs(frozen)
        meta_json = _metadata_json(metadata)
        with _no_cyclic_gc():
            # a plan copies every tensor; frozen= ones go the general way, which leaves them out
            if pattern is None and not (replicated and self.world_size > 1):
                try:
                    got = self._stager.by_plan(self._stager.save_plans, state, step, kick=False)
                except BaseException:
                    self.abort(step)
                    raise
                if got is not None:
                    return self._commit(step, metadata, meta_json, got[1], began=began)
            structure, tensors = flatten(state)
            planned = sharded.plan(tensors, self.rank, self.world_size, replicated)
            digests = replicas.start(planned.shared, self.options.compare_replicas, written=planned.stage)
            items = {name: dataclasses.replace(describe(name, t), shard=shard)
                     for name, (t, shard) in planned.stage.items()}
            for name in planned.written_by:
                if not is_dtensor(tensors[name]):
                    describe(name, tensors[name])
            state_json = json.dumps(structure, ensure_ascii=False, allow_nan=False)
            try:
                with self._emit_lock:
                    whole = sizing.room_for([i.nbytes for i in items.values()])
                    self._stager.stage(step, items, room=0, grow_for=whole, frozen=pattern, written_by=planned.written_by)
            except BaseException:
                self.abort(step)
                raise
            room = sizing.room_for([i.nbytes for i in items.values()])
            if pattern is None and not planned.written_by and not (replicated and self.world_size > 1):
                with self._emit_lock:
                    self._stager.keep(self._stager.save_plans, state, structure, tensors, items, room)
        self._book.set_room(step, room)
        return self._commit(step, metadata, meta_json, state_json, began=began, digests=digests)

    def prepare(self, state: Any, *, replicated: Any = None) -> int:
        """Make staging ready for checkpoints of ``state`` (as ``save`` takes it) or of
        ``state`` bytes (an int), now, in the background; nothing is copied or sent.

        With ``staging_size = "auto"`` staging starts at 32 MiB and would grow only
        after the first larger checkpoint went through it; call this once, early (after
        building the model and optimizer, before training), and the first checkpoint
        finds staging allocated and pre-faulted at its size (it waits for it, if it is
        still being made). Returns the staging bytes a checkpoint of ``state`` takes.
        A fixed ``staging_size`` is left as it is."""
        if isinstance(state, int) and not isinstance(state, bool):
            if state < 0:
                raise ValueError(f"prepare({state}): a size cannot be negative")
            room = state
        else:
            _, tensors = flatten(state)
            planned = sharded.plan(tensors, self.rank, self.world_size, replicated)
            room = sizing.room_for([describe(name, t).nbytes for name, (t, _) in planned.stage.items()])
        self._copier.prepare(room)
        return room

    @contextmanager
    def checkpoint(self, step: int, metadata: dict[str, Any] | None = None) -> Iterator[CommitHandle]:
        """Emits inside the block belong to ``step``; a clean exit commits (without
        waiting), an exception aborts the step."""
        check_step(step)
        meta_json = _metadata_json(metadata)
        if self._current_step is not None:
            raise ValueError(f"checkpoint({step}) inside checkpoint({self._current_step}); blocks do not nest: "
                             "end the outer block first")
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
        if not self._book.drop(step):
            return
        if self._connection.live:
            with self._emit_lock:
                self._connection.send_batch()
            self._connection.send("abort", step=step, reason="aborted by the producer")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every commit made so far is durable; raise CheckpointError naming
        every failed commit that no ``handle.wait()`` has raised already."""
        if self._connection.live:
            with self._emit_lock:
                self._connection.send_batch()
        self._book.wait_all(timeout)
        self._book.raise_unseen()

    def wait_complete(self, step: int, timeout: float | None = None, *, tier: str | None = None) -> CheckpointInfo:
        """Wait until every rank's share of ``step`` is durable in the remote tier (or,
        with no ``[remote]``, on the shared root), as the storage itself shows it;
        ``tier="peer"``: until every rank's share has a copy in a peer's memory."""
        from ..completion import wait_complete

        return wait_complete(self._connection.need_run(), check_step(step), timeout=timeout,
                             world_size=self.world_size, tier=tier)

    def latest(self, run: str | None = None) -> CheckpointInfo | None:
        """Ask the daemon for the newest complete checkpoint of ``run`` (default: this run)."""
        run = check_run(run) if run is not None else self._connection.need_run()
        with self._emit_lock:
            self._connection.ensure()
        reply = self._connection.ask("latest", run=run)
        return CheckpointInfo.from_dict(reply["info"]) if reply["info"] else None

    def close(self) -> None:
        """Wait for outstanding commits, then disconnect and free staging memory; raise
        CheckpointError, as ``flush`` does, naming every failed commit not raised yet
        (also when the daemon was lost: a step is committed, or the caller is told)."""
        if self.closed:
            return
        self._connection.wait_started()
        try:
            if self._connection.live:
                self.flush()
            else:
                self._book.raise_unseen()
        finally:
            self._notices.close()
            self._connection.close()
            self._copier.close()

    def stats(self) -> dict[str, Any]:
        """How this producer is doing: its identity (``rank``, ``world_size`` and the
        launcher's ``local_rank``, ``local_world_size``), ``transport`` ("shm" or
        "inline", None before the first connection), ``staging_bytes`` (the arena's size
        now), ``staging_ready_bytes`` (a larger one's, made in the background and in use
        from the next checkpoint; 0: none), ``staging_prepared_bytes`` (the largest
        checkpoint's staging bytes that ``prepare`` or ``expected_bytes`` announced to
        "auto" staging, which holds them or is being made to; 0: none), ``staging_limit`` (what it may grow to: its
        fixed size unless ``staging_size = "auto"``), ``blocked_seconds`` (total time
        ``emit`` waited for staging space, i.e. for the daemon, since the producer was made)."""
        conn = self._connection
        return {
            "rank": self.rank, "world_size": self.world_size,
            "local_rank": self.local_rank, "local_world_size": self.local_world_size,
            "transport": conn.transport_kind(),
            "staging_bytes": self._copier.capacity,
            "staging_ready_bytes": self._copier.ready_bytes,
            "staging_prepared_bytes": self._copier.prepared_bytes,
            "staging_limit": self._copier.limit,
            "blocked_seconds": self._copier.blocked_s,
        }

    def should_save(self, step: int, *, min_steps: int | None = None, max_steps: int | None = None,
                    min_seconds: float | None = None, max_seconds: float | None = None) -> bool:
        """Whether to save ``step`` now: True once the daemon's advised interval
        (docs/advise.md) has passed since the last step this answered True for, within
        the bounds given (which always win). Cheap: no round trip to the daemon. With
        no advice yet (a run's first save) it answers True at once. Every rank answers
        the same for a step (rank 0 decides, docs/advise.md): call it on every rank, at
        every step, with the same bounds. The first call connects to the daemon, if
        this producer has not yet, and (in the main thread) hears ``[producer]
        preempt_signals``: after a notice on any rank, the next call answers True on
        every rank, whatever the bounds (docs/runbook.md)."""
        check_step(step)
        check_bounds(min_steps, max_steps, min_seconds, max_seconds)
        if self._agree is None:
            with self._emit_lock:
                self._connection.ensure()
            self._agree = broadcast_from_rank0(self.world_size)
            self._any_rank = preempt.any_rank(self.world_size)
        self._notices.install()
        if self._notices.due(self._any_rank):
            self._picked = (step, self._tiers.took(step))
            return True
        advice = self._connection.advice
        if not self._pacer.should_save(step, advise.most_frequent(advice), self._agree,
                                       (min_steps, max_steps, min_seconds, max_seconds)):
            return False
        due = self._tiers.pick(step, advice, self._agree)
        self._picked = (step, due) if due is not None else None
        return True

    def advice(self) -> dict[str, Any] | None:
        """The daemon's latest interval advice for this run, as ``ckptd advise --json``
        prints it (it came with the last commit's reply), or None before any."""
        return self._connection.advice

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            if self._current_step is None:
                raise ValueError(
                    "emit() needs a step: pass step=..., or call it inside `with producer.checkpoint(step):`"
                )
            return self._current_step
        return check_step(step)

    def _commit(self, step: int, *args: Any, **kwargs: Any) -> CommitHandle:
        if not self._notices.saving:
            return self._send_commit(step, *args, **kwargs)
        return self._notices.commit(step, lambda: self._send_commit(step, *args, **kwargs),
                                    self._connection.need_run(), self.world_size)

    def _send_commit(self, step: int, metadata: Any, meta_json: str | None, state_json: str | None,
                     handle: CommitHandle | None = None, began: float | None = None,
                     digests: replicas.Pending | None = None) -> CommitHandle:
        if meta_json is None:
            meta_json = _metadata_json(metadata)
        handle = handle or CommitHandle(step)
        st = self._book.close_step(step, handle)
        self._copier.want(st.room)
        conn = self._connection
        if st.error is not None:
            self._book.finish(step, handle, error=st.error)
            if conn.live:
                conn.send("abort", step=step, reason="failed before commit")
            return handle
        try:
            with self._emit_lock:
                conn.ensure()
                conn.send_batch()
        except CheckpointError as exc:
            self._book.finish(step, handle, error=str(exc))
            handle.observed = True
            raise
        timing = {"stall_s": time.monotonic() - (st.began if began is None else began),
                  "restore_s": measures.take_restored(self.run) if self.run is not None else None}
        picked, self._picked = self._picked, None
        # only a daemon that advises per tier reads the field: an older one refuses it
        due = {"tiers": list(picked[1])} if picked is not None and picked[0] == step \
            and isinstance((conn.advice or {}).get("tiers"), dict) else {}
        fields: dict[str, Any] = dict(handle=handle, step=step, ntensors=len(st.names), state=state_json or "null",
                                      metadata=meta_json, replicas=st.written_by or None, timing=timing, **due)
        if digests is not None and digests.later:
            self._sending = digests.then(lambda ours: self._send_late(fields, ours))
            return handle
        ours = digests.result() if digests is not None else None
        conn.send("commit", digests=ours or None, compare=self.options.compare_replicas if ours else None, **fields)
        return handle

    def _send_late(self, fields: dict[str, Any], ours: dict[str, str]) -> None:
        """The commit of a save whose replica digests were taken after it returned, from
        the digest thread; a commit that cannot be sent fails its handle."""
        handle = fields["handle"]
        try:
            if not self._connection.live:
                raise CheckpointError("the connection to the daemon was lost before the commit was sent")
            self._connection.send("commit", digests=ours or None,
                                  compare=self.options.compare_replicas if ours else None, **fields)
        except Exception as exc:
            self._book.finish(handle.step, handle, error=f"commit of step {handle.step} not sent: {exc}")

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
