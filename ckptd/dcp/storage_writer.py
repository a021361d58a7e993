"""``StorageWriter`` and ``AsyncStorageWriter``: DCP saves through the daemon (the package's
docstring says how)."""

from __future__ import annotations

import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import Metadata, StorageWriter as _Writer
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import config as config_mod, state as state_mod
from ..attempt import current as current_attempt
from .. import env
from .ids import is_checkpoint_id, step_of as _step_of
from .metadata import METADATA_KEY, encode_metadata


class StorageWriter(_Writer):
    """A DCP ``StorageWriter`` that saves through the ckptd daemon as ``step`` of ``run``.

    ``run`` (default ``$CKPTD_RUN``), the endpoint (``$CKPTD_ENDPOINT``, else the
    config's) and ``**options`` (the ``[producer]`` keys, e.g. ``staging_size``) are
    those of ``ckptd.Producer``. ``step`` may instead come as DCP's ``checkpoint_id``.
    One producer per run and rank is kept per process and reused by later saves (its
    staging is allocated once); ``producer=`` uses yours instead (not with
    ``AsyncCheckpointerType.PROCESS``, which sends the writer to another process).
    """

    def __init__(self, run: str | None = None, step: int | None = None, *, endpoint: str | None = None,
                 producer: Any = None, durable: bool = True, metadata: dict[str, Any] | None = None,
                 timeout: float | None = None, **options: Any) -> None:
        super().__init__()
        self.run = run if run is not None else env.run()
        self.step = None if step is None else _step_of(step)
        self.endpoint = endpoint
        self.durable = durable
        self.metadata = dict(metadata or {})
        self.timeout = timeout
        self.options = options
        # decided here: a process executor's helper has another parent, and every rank must agree
        world = env.group_world_size()
        self.options.setdefault("attempt", current_attempt(
            str(options.get("attempt") or config_mod.load().producer.attempt), world, env.elastic()) or "")
        self._producer = producer
        self._own_producer = producer is None
        self.rank = 0
        self.is_coordinator = True
        self._structure: Any = None
        self._staged_structure: Any = None
        self._emitted: set[str] = set()
        self._keys: dict[Any, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        if not self._own_producer:
            raise TypeError("a ckptd.dcp.StorageWriter given producer= cannot go to another process "
                            "(AsyncCheckpointerType.PROCESS); give it run= and the producer's options instead")
        state = dict(self.__dict__)
        state["_producer"] = None
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self._structure, self._emitted, self._keys = None, set(), {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("ckptd.dcp.StorageWriter needs DCP's collectives (use_collectives=True): rank 0 "
                             "commits the step last, with the global metadata")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else env.group_rank()
        if self.step is None:
            raise ValueError("ckptd.dcp.StorageWriter: no step; pass StorageWriter(run=..., step=N) "
                             "(or dcp.save(..., checkpoint_id=N))")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Copy this rank's tensor items into staging (emit); a non-coordinator commits."""
        producer = self._get_producer()
        assert self.step is not None
        results = []
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=(self.rank, None)))
                    continue
                nbytes, key = self._write_item(producer, item, planner)
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=(self.rank, key)))
            self._structure = self._staged_structure or _structure_of(planner)
            if not self.is_coordinator:
                handle = producer.commit(self.step, structure=_prune(self._structure, self._emitted))
                if self.durable:
                    handle.wait(self.timeout)
        except BaseException:
            producer.abort(self.step)
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_item(self, producer: Any, item: Any, planner: SavePlanner) -> tuple[int, str]:
        """Emit one tensor write item (a whole tensor, a DTensor's local shard, or one of
        the chunks a ShardedTensor has on this rank); its bytes, and the name of its
        record (a rank's later chunks of one tensor have their own, ``sharding.piece_name``)."""
        fqn = item.index.fqn
        tensor = planner.resolve_data(item)
        chunk, size = item.tensor_data.chunk, list(item.tensor_data.size)
        if item.type == WriteItemType.TENSOR and list(chunk.sizes) == size:
            key = producer.emit(fqn, tensor, step=self.step)
        else:
            key = producer.emit(fqn, tensor, step=self.step, global_shape=size, offset=list(chunk.offsets))
        self._emitted.add(fqn)
        self._keys[item.index] = key
        return tensor.numel() * tensor.element_size(), key

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: rank 0's share, with DCP's metadata as JSON, is committed last."""
        producer = self._get_producer()
        assert self.step is not None
        metadata.storage_data = {wr.index: wr.storage_data for ranks in results for wr in ranks}
        metadata.storage_meta = self.storage_meta()
        writers = {index.fqn: rank for index, (rank, name) in metadata.storage_data.items() if name is not None}
        structure = self._structure
        written_by = {name: writers.get(name, -1) for name in state_mod.tensor_names(structure)
                      if name not in self._emitted}
        unwritten = sorted(name for name, rank in written_by.items() if rank < 0)
        try:
            if unwritten:
                raise ValueError(f"ckptd.dcp: DCP's plan writes tensors {unwritten[:3]} on no rank")
            handle = producer.commit(self.step, structure=structure, written_by=written_by,
                                     metadata={**self.metadata, METADATA_KEY: encode_metadata(metadata)})
        except BaseException:
            producer.abort(self.step)
            raise
        if self.durable:
            handle.wait(self.timeout)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"ckptd:{self.run}/{self.step}", save_id=uuid.uuid4().hex)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def _get_producer(self) -> Any:
        if self._producer is None:
            self._producer = _shared_producer(self.endpoint, self.run, self.rank, env.group_world_size(), self.options)
        return self._producer


class AsyncStorageWriter(StorageWriter):
    """A ``StorageWriter`` that is DCP's stager too, for ``dcp.async_save`` with the thread
    executor (its default). ``async_save`` calls ``stage`` on the training thread: this
    rank's tensors are copied straight into the producer's staging (one copy, into memory
    allocated once, as ``producer.save`` does) and their structure is taken; the
    background thread's ``write_data`` then only reports them and commits. With
    ``StorageWriter``, DCP's own stager copies into fresh memory first and ``write_data``
    copies again.

    Not for ``AsyncCheckpointerType.PROCESS`` (the staged bytes belong to this process's
    producer; pickling it raises) nor for a custom planner (staging plans with DCP's
    ``DefaultSavePlanner``). A plain tensor that every rank holds (DCP's dedup gives it to
    one rank) is staged by every rank: for DDP-style states use ``StorageWriter``.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        if self.step is None:
            raise ValueError("ckptd.dcp.AsyncStorageWriter stages at async_save: pass AsyncStorageWriter(step=N)")
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict)
        self.rank = env.group_rank()
        producer = self._get_producer()
        self._emitted, self._keys, self._staged_structure = set(), {}, None
        try:
            for item in planner.create_local_plan().items:
                if item.type != WriteItemType.BYTE_IO:
                    self._write_item(producer, item, planner)
            self._staged_structure = _structure_of(planner)
        except BaseException:
            producer.abort(self.step)
            raise
        return state_dict

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and _step_of(checkpoint_id) != self.step:
            raise ValueError("ckptd.dcp.AsyncStorageWriter: the step was fixed when it was staged; "
                             "give it as AsyncStorageWriter(step=N), not as checkpoint_id")
        self._structure = None

    def _write_item(self, producer: Any, item: Any, planner: SavePlanner) -> tuple[int, str]:
        if self._staged_structure is None:
            return super()._write_item(producer, item, planner)
        key = self._keys.get(item.index)
        if key is None:
            raise ValueError(f"ckptd.dcp.AsyncStorageWriter: DCP's plan writes {item.index.fqn!r} at offsets "
                             f"{list(item.index.offset or [])}, which was not staged (a custom planner?); "
                             "use ckptd.dcp.StorageWriter")
        return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize, key

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        if self._producer is not None and self.step is not None:
            self._producer.abort(self.step)
        raise TypeError("ckptd.dcp.AsyncStorageWriter stages into this process's producer, so it cannot go to "
                        "another process (AsyncCheckpointerType.PROCESS); use ckptd.dcp.StorageWriter there")


_PRODUCERS: dict[tuple, Any] = {}
_PRODUCERS_LOCK = threading.Lock()


def _shared_producer(endpoint: str | None, run: str | None, rank: int, world: int, options: dict[str, Any]) -> Any:
    """This process's producer for (endpoint, run, rank): made once, its staging reused."""
    from .. import producer as default
    from ..producer import Producer

    mine = default.current()
    if (mine is not None and (mine.run, mine.rank, mine.world_size) == (run, rank, world)
            and (endpoint is None or config_mod.resolve_endpoint(endpoint, Path.cwd()) == mine.endpoint)):
        return mine
    key = (endpoint, run, rank, world, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _PRODUCERS_LOCK:
        p = _PRODUCERS.get(key)
        if p is None or p.closed:
            p = _PRODUCERS[key] = Producer(endpoint, run, rank=rank, world_size=world, **options)
        return p


def _structure_of(planner: SavePlanner) -> Any:
    """This rank's whole state as ckptd's structure (tensors by their DCP names)."""
    flat = getattr(planner, "state_dict", None)
    if flat is None:
        raise TypeError(f"ckptd.dcp needs a planner that keeps its state_dict (DefaultSavePlanner and its "
                        f"subclasses do); {type(planner).__name__} does not")
    mappings = getattr(planner, "mappings", None) or {}
    nested: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = tuple(mappings.get(fqn, (fqn,)))
        _set_path(nested, path, value)
    structure, tensors = state_mod.flatten(nested)
    strays = sorted(set(tensors) - set(flat))
    if strays:  # ckptd names a tensor by its path as DCP does; a key with a "." in it can differ
        raise ValueError(f"ckptd.dcp: tensors {strays[:3]} are named differently by DCP; rename the keys "
                         "of the state that hold a '.'")
    return structure


def _set_path(nested: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = nested
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _prune(structure: Any, keep: set[str]) -> Any:
    """``structure`` without the tensors another rank writes (DCP's dedup gave them away)."""
    if isinstance(structure, dict):
        if "tensor" in structure or "ndarray" in structure:
            return structure if (structure.get("tensor") or structure.get("ndarray")) in keep else _PRUNED
        out = {}
        for tag, node in structure.items():
            if tag == "dict":
                out[tag] = [[k, v] for k, v in ((k, _prune(v, keep)) for k, v in node) if v is not _PRUNED]
            elif tag in ("list", "tuple"):
                out[tag] = [None if v is _PRUNED else v for v in (_prune(v, keep) for v in node)]
            else:
                out[tag] = node
        return out
    return structure


_PRUNED = object()
