"""``torch.distributed.checkpoint`` (DCP) storage through ckptd: ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` with ``StorageWriter`` / ``StorageReader`` below.

The only module that imports ``torch.distributed.checkpoint``. A DCP checkpoint made
here is an ordinary ckptd step (checksums, ``verify``, retention, the index,
``latest``, ``list``, ``export``, the CLI, ``ckptd.load_into`` all work on it):

- ``write_data`` (every rank) emits each tensor write item into the producer's
  staging under its DCP name (``model.0.weight``), a DTensor's shard with its global
  shape and offsets (the manifests' ``shard`` records, docs/format.md), and returns
  once the bytes are copied. Non-tensor values (DCP's BYTE_IO items, which DCP would
  ``torch.save``) are not pickled: they are kept as plain values in the rank's saved
  structure (``ckptd.state``), and a value ckptd cannot store without pickling is a
  ``TypeError`` naming it. Ranks other than the coordinator commit at the end of
  ``write_data``.
- ``finish`` (the coordinator, rank 0) commits rank 0's share last, with DCP's global
  ``Metadata`` as JSON in its commit metadata under ``"ckptd.dcp"`` (``encode_metadata``;
  ``CheckpointInfo.metadata`` leaves it out).
  The step is complete when every rank's manifest is there (one attempt's), so
  the metadata becomes visible exactly when the step does.
- ``StorageReader(run, step=None)`` reads the stored metadata, or, for a step saved
  by ``producer.save``/``emit``, synthesizes it from the manifests' records
  (``synthesize_metadata``); ``read_data`` reads only the byte ranges each read
  item needs, straight into the planner's tensors (``ckptd.load_into``'s reader), and
  hands BYTE_IO items the saved plain value, re-serialized here with ``torch.save``
  (DCP's load planner unpickles it; it only ever sees bytes ckptd made from JSON).

With ``durable=True`` (the default) a rank's share is durable before its part of the
save returns: ``dcp.save`` returns once the step is complete; with ``dcp.async_save``
that waiting happens off the training thread.
"""

from __future__ import annotations

import io
import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import Metadata, StorageReader as _Reader, StorageWriter as _Writer
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from . import config as config_mod, dtypes, reader, state as state_mod
from .attempt import current as current_attempt
from .errors import CheckpointCorrupt
from .load_into import _fill, _Piece, _Target  # its reader: byte ranges straight into targets
from .manifest import CheckpointInfo, Manifest
from .sharding import Box

METADATA_KEY = "ckptd.dcp"  # rank 0's commit metadata holds DCP's Metadata under this key (manifest.py)
ENCODING_VERSION = 1
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


# -- the writer ----------------------------------------------------------------------------------
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
        self.run = run if run is not None else os.environ.get("CKPTD_RUN") or None
        self.step = None if step is None else _step_of(step)
        self.endpoint = endpoint
        self.durable = durable
        self.metadata = dict(metadata or {})
        self.timeout = timeout
        self.options = options
        # Decided here, in the training process: a process executor's helper process has
        # another parent, and every rank of one attempt must agree (ckptd.attempt).
        world = _world_size()
        self.options.setdefault("attempt", current_attempt(
            str(options.get("attempt") or config_mod.load().producer.attempt), world) or "")
        self._producer = producer
        self._own_producer = producer is None
        self.rank = 0
        self.is_coordinator = True
        self._structure: Any = None
        self._staged_structure: Any = None  # AsyncStorageWriter: the structure as it was staged
        self._emitted: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        if not self._own_producer:
            raise TypeError("a ckptd.dcp.StorageWriter given producer= cannot go to another process "
                            "(AsyncCheckpointerType.PROCESS); give it run= and the producer's options instead")
        state = dict(self.__dict__)
        state["_producer"] = None  # the other process makes its own
        return state

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self._structure, self._emitted = None, set()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("ckptd.dcp.StorageWriter needs DCP's collectives (use_collectives=True): rank 0 "
                             "commits the step last, with the global metadata")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else _rank()
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
                if item.type == WriteItemType.BYTE_IO:  # a plain value: kept in the structure
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=(self.rank, None)))
                    continue
                nbytes = self._write_item(producer, item, planner)
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=(self.rank,
                                                                                                 item.index.fqn)))
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

    def _write_item(self, producer: Any, item: Any, planner: SavePlanner) -> int:
        """Emit one tensor write item (a whole tensor, or a DTensor's local shard); its bytes."""
        fqn = item.index.fqn
        if fqn in self._emitted:
            raise ValueError(f"ckptd.dcp: tensor {fqn!r} has more than one chunk on rank {self.rank}; "
                             "ckptd stores one piece of a tensor per rank (a DTensor's local shard)")
        tensor = planner.resolve_data(item)
        chunk, size = item.tensor_data.chunk, list(item.tensor_data.size)
        if item.type == WriteItemType.TENSOR and list(chunk.sizes) == size:
            producer.emit(fqn, tensor, step=self.step)
        else:
            producer.emit(fqn, tensor, step=self.step, global_shape=size, offset=list(chunk.offsets))
        self._emitted.add(fqn)
        return tensor.numel() * tensor.element_size()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: rank 0's share, with DCP's metadata as JSON, is committed last."""
        producer = self._get_producer()
        assert self.step is not None
        metadata.storage_data = {wr.index: wr.storage_data for ranks in results for wr in ranks}
        metadata.storage_meta = self.storage_meta()
        writers = {index.fqn: rank for index, (rank, name) in metadata.storage_data.items() if name is not None}
        structure = self._structure
        replicas = {name: writers.get(name, -1) for name in state_mod.tensor_names(structure)
                    if name not in self._emitted}
        unwritten = sorted(name for name, rank in replicas.items() if rank < 0)
        try:
            if unwritten:
                raise ValueError(f"ckptd.dcp: DCP's plan writes tensors {unwritten[:3]} on no rank")
            handle = producer.commit(self.step, structure=structure, replicas=replicas,
                                     metadata={**self.metadata, METADATA_KEY: encode_metadata(metadata)})
        except BaseException:
            producer.abort(self.step)  # what rank 0 emitted is discarded, not left open
            raise
        if self.durable:
            handle.wait(self.timeout)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"ckptd:{self.run}/{self.step}", save_id=uuid.uuid4().hex)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _step_of(checkpoint_id)
        except ValueError:
            return False
        return True

    def _get_producer(self) -> Any:
        if self._producer is None:
            self._producer = _shared_producer(self.endpoint, self.run, self.rank, _world_size(), self.options)
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
        self.rank = _rank()
        producer = self._get_producer()
        self._emitted, self._staged_structure = set(), None
        try:
            for item in planner.create_local_plan().items:
                if item.type != WriteItemType.BYTE_IO:
                    self._write_item(producer, item, planner)
            self._staged_structure = _structure_of(planner)
        except BaseException:
            producer.abort(self.step)
            raise
        return state_dict  # DCP plans with it; its values are never read again

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and _step_of(checkpoint_id) != self.step:
            raise ValueError("ckptd.dcp.AsyncStorageWriter: the step was fixed when it was staged; "
                             "give it as AsyncStorageWriter(step=N), not as checkpoint_id")
        self._structure = None  # what stage() emitted stays

    def _write_item(self, producer: Any, item: Any, planner: SavePlanner) -> int:
        if self._staged_structure is None:  # staging now
            return super()._write_item(producer, item, planner)
        if item.index.fqn not in self._emitted:
            raise ValueError(f"ckptd.dcp.AsyncStorageWriter: DCP's plan writes {item.index.fqn!r}, which was not "
                             "staged (a custom planner?); use ckptd.dcp.StorageWriter")
        return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        if self._producer is not None and self.step is not None:
            self._producer.abort(self.step)  # staged, and now never to be committed
        raise TypeError("ckptd.dcp.AsyncStorageWriter stages into this process's producer, so it cannot go to "
                        "another process (AsyncCheckpointerType.PROCESS); use ckptd.dcp.StorageWriter there")


_PRODUCERS: dict[tuple, Any] = {}
_PRODUCERS_LOCK = threading.Lock()


def _shared_producer(endpoint: str | None, run: str | None, rank: int, world: int, options: dict[str, Any]) -> Any:
    """This process's producer for (endpoint, run, rank): made once, its staging reused."""
    from . import producer as default
    from .producer import Producer

    mine = default._default  # the module's producer (producer.save) of this run: one session, shared
    if (mine is not None and not mine._closed and (mine.run, mine.rank, mine.world_size) == (run, rank, world)
            and (endpoint is None or config_mod.resolve_endpoint(endpoint, Path.cwd()) == mine.endpoint)):
        return mine
    key = (endpoint, run, rank, world, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _PRODUCERS_LOCK:
        p = _PRODUCERS.get(key)
        if p is None or p._closed:
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


# -- the reader -----------------------------------------------------------------------------------
class StorageReader(_Reader):
    """A DCP ``StorageReader`` of step ``step`` of ``run`` (None: the newest complete
    step, chosen at ``read_metadata``). ``root`` defaults to ``$CKPTD_ROOT`` / the
    config's; ``verify=True`` checks the checksum of every record read."""

    def __init__(self, run: str | None = None, step: int | None = None, *,
                 root: str | os.PathLike[str] | None = None, verify: bool = False) -> None:
        super().__init__()
        self.run = run if run is not None else os.environ.get("CKPTD_RUN") or None
        if self.run is None:
            raise ValueError("ckptd.dcp.StorageReader: pass the run (or set CKPTD_RUN)")
        self.step = None if step is None else _step_of(step)
        self.root = root
        self.verify = verify
        self.info: CheckpointInfo | None = None
        self._path: Path | None = None
        self._manifests: list[Manifest] = []
        self.storage_data: dict[MetadataIndex, tuple[int, str | None]] = {}
        self._planner_data: dict[str, tuple[Any, ...]] = {}
        self._values: dict[int, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self._values = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path, manifests = reader.find(self.run, self.step, self.root)
        self._path, self._manifests = path, manifests
        self.info = CheckpointInfo.from_manifests(str(path), manifests)
        stored = manifests[0].metadata.get(METADATA_KEY)
        metadata = decode_metadata(stored, str(path)) if stored is not None else synthesize_metadata(
            manifests, _rank())
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._planner_data = metadata.planner_data or {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._path is not None
        targets, pieces, commits = [], {}, []
        for i, req in enumerate(plan.items):
            rank, name = self._stored(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._value(rank, req.storage_index.fqn), buf)  # plain data, from JSON
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            rec = self._manifests[rank].tensors.get(name) if name is not None else None
            if rec is None:
                raise CheckpointCorrupt(f"{self._path}: DCP's metadata names tensor {name!r} of rank {rank}, "
                                        "which that rank's manifest does not hold")
            dest = planner.resolve_tensor(req).detach()
            origin = [o + s for o, s in zip(rec.offsets, req.storage_offsets)]
            key = f"{name}\0{i}"  # one target per read item, each from its one stored piece
            pieces[key] = [_Piece(rank, name, rec, Box(tuple(rec.offsets), tuple(rec.shape)))]
            box = Box(tuple(origin), tuple(req.lengths))
            if dest.device.type == "cpu" and dest.is_contiguous():
                targets.append(_Target(key, dest, box))
            else:
                targets.append(_Target(key, torch.empty(dest.shape, dtype=dest.dtype), box, final=dest))
            commits.append((req, dest))
        _fill(self._path, targets, pieces, _rank(), self.verify)
        for req, dest in commits:
            planner.commit_tensor(req, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    def _stored(self, index: MetadataIndex) -> tuple[int, str | None]:
        where = self.storage_data.get(index)
        if where is None:
            raise CheckpointCorrupt(f"{self._path}: DCP's metadata does not say where {index.fqn!r} at offsets "
                                    f"{list(index.offset or [])} is stored")
        return where

    def _value(self, rank: int, fqn: str) -> Any:
        """The plain value saved under DCP name ``fqn`` in ``rank``'s structure."""
        if rank not in self._values:
            m = self._manifests[rank]
            self._values[rank] = state_mod.unflatten(m.state, lambda name: None) if m.state is not None else {}
        node = self._values[rank]
        try:
            for key in self._planner_data.get(fqn, (fqn,)):
                node = node[key]
        except (KeyError, IndexError, TypeError):
            raise CheckpointCorrupt(f"{self._path}: rank {rank}'s saved structure has no value {fqn!r}") from None
        return node


# -- DCP's Metadata as JSON (never pickled) ------------------------------------------------------------
def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """A faithful JSON form of DCP's ``Metadata`` (docs/dcp.md): every field, typed."""
    sdm: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"bytes": {}}
        elif isinstance(md, TensorStorageMetadata):
            p = md.properties
            sdm[fqn] = {"tensor": {
                "dtype": dtypes.torch_name(p.dtype), "size": list(md.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
                "layout": str(p.layout).removeprefix("torch."), "requires_grad": bool(p.requires_grad),
                "memory_format": str(p.memory_format).removeprefix("torch."), "pin_memory": bool(p.pin_memory)}}
        else:
            raise TypeError(f"DCP metadata of {fqn!r} is a {type(md).__name__}, which ckptd.dcp cannot store")
    storage = [[index.fqn, None if index.offset is None else list(index.offset), rank, name]
               for index, (rank, name) in (metadata.storage_data or {}).items()]
    meta = metadata.storage_meta
    return {
        "encoding": ENCODING_VERSION, "version": metadata.version, "state_dict_metadata": sdm,
        "planner_data": _plain(metadata.planner_data, "planner_data"), "storage_data": storage,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)},
    }


def decode_metadata(d: Any, where: str) -> Metadata:
    """``encode_metadata``'s inverse; anything malformed is ``CheckpointCorrupt``."""
    try:
        if d.get("encoding") != ENCODING_VERSION:
            raise ValueError(f"encoding {d.get('encoding')!r} is not {ENCODING_VERSION}; upgrade ckptd")
        sdm: dict[str, Any] = {}
        for fqn, md in d["state_dict_metadata"].items():
            if "bytes" in md:
                sdm[fqn] = BytesStorageMetadata()
                continue
            t = md["tensor"]
            props = TensorProperties(dtype=dtypes.torch_dtype(t["dtype"]), layout=getattr(torch, t["layout"]),
                                     requires_grad=bool(t["requires_grad"]),
                                     memory_format=_MEMORY_FORMATS[t["memory_format"]], pin_memory=bool(t["pin_memory"]))
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(t["size"]), [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
        storage = {MetadataIndex(fqn, offset): (int(rank), name) for fqn, offset, rank, name in d["storage_data"]}
        meta = d.get("storage_meta")
        return Metadata(
            state_dict_metadata=sdm, planner_data=_unplain(d.get("planner_data")), storage_data=storage,
            storage_meta=None if meta is None else StorageMeta(meta["checkpoint_id"], meta["save_id"],
                                                               meta["load_id"], list(meta["modules"])),
            version=d.get("version"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{where}: its DCP metadata is malformed: {type(exc).__name__}: {exc}") from None


def _plain(value: Any, what: str) -> Any:
    structure, tensors = state_mod.flatten(value)  # ckptd's tagged JSON: tuples stay tuples
    if tensors:
        raise TypeError(f"DCP's {what} holds tensors ({sorted(tensors)[:3]}); ckptd.dcp stores plain data only")
    return structure


def _unplain(structure: Any) -> Any:
    return state_mod.unflatten(structure, lambda name: None)


def synthesize_metadata(manifests: list[Manifest], rank: int) -> Metadata:
    """DCP ``Metadata`` for a step saved with ``producer.save``/``emit``: every record is
    a chunk of its tensor (a whole one, held by several ranks, this rank's copy); the
    plain values of the saved structure (this rank's, else rank 0's) are BYTE_IO items,
    found where DCP's flattening puts them."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, tuple[int, str | None]] = {}
    order = sorted(manifests, key=lambda m: (m.rank != rank, m.rank))
    for m in order:
        for name, rec in m.tensors.items():
            index = MetadataIndex(name, rec.offsets)
            if index in storage:
                continue
            storage[index] = (m.rank, name)
            md = sdm.get(name)
            if md is None:
                md = sdm[name] = TensorStorageMetadata(TensorProperties(dtype=dtypes.torch_dtype(rec.dtype)),
                                                       torch.Size(rec.global_shape), [])
            md.chunks.append(ChunkStorageMetadata(torch.Size(rec.offsets), torch.Size(rec.shape)))
    own = order[0]
    planner_data: dict[str, tuple[Any, ...]] = {}
    if own.state is not None:
        _values(state_mod.unflatten(own.state, lambda name: _TENSOR), (), own.rank, sdm, storage, planner_data)
    for name in sdm:
        planner_data.setdefault(name, tuple(name.split(".")))
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage)


class _Tensor:
    pass


_TENSOR = _Tensor()


def _values(node: Any, path: tuple[Any, ...], rank: int, sdm: dict[str, Any],
            storage: dict[MetadataIndex, Any], planner_data: dict[str, tuple[Any, ...]]) -> None:
    """Register the plain values under ``node`` as DCP flattens them: dicts are walked,
    lists only where they hold tensors; everything else is one BYTE_IO leaf."""
    if node is _TENSOR:
        planner_data[state_mod.path_name(path)] = path
        return
    if isinstance(node, dict) or (isinstance(node, (list, tuple)) and _holds_tensor(node)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            _values(value, path + (key,), rank, sdm, storage, planner_data)
        return
    if not path:
        return
    fqn = state_mod.path_name(path)
    sdm[fqn] = BytesStorageMetadata()
    storage[MetadataIndex(fqn)] = (rank, None)
    planner_data[fqn] = path


def _holds_tensor(node: Any) -> bool:
    if node is _TENSOR:
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False


# -- small helpers -----------------------------------------------------------------------------------
def _step_of(value: Any) -> int:
    """A step from ``step=`` or DCP's ``checkpoint_id`` (an int, or a str/path ending in digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    tail = None if text is None else str(text).rstrip("/").rsplit("/", 1)[-1].removeprefix("step-")
    if tail is not None and tail.isdigit():
        return int(tail)
    raise ValueError(f"ckptd.dcp: {value!r} is not a step; pass a step number (an int >= 0)")


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK", "")
    return int(env) if env.isdigit() else 0


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() else 1
