"""``StorageReader``: DCP loads from a ckptd step, made by DCP or by ``producer.save``."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata, StorageReader as _Reader
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .. import reader, state as state_mod
from ..errors import CheckpointCorrupt
from ..manifest import CheckpointInfo, Manifest
from ..reader import Piece, Target, fill
from ..sharding import Box
from .. import env
from .ids import is_checkpoint_id, step_of as _step_of
from .metadata import METADATA_KEY, decode_metadata, synthesize_metadata


class StorageReader(_Reader):
    """A DCP ``StorageReader`` of step ``step`` of ``run`` (None: the newest complete
    step, chosen at ``read_metadata``; under a process group, the newest every rank of
    it has, agreed by all: a ``no_dist`` or subgroup load passes a step). ``root`` defaults to ``$CKPTD_ROOT`` / the
    config's; ``verify=True`` checks the checksum of every record read."""

    def __init__(self, run: str | None = None, step: int | None = None, *,
                 root: str | os.PathLike[str] | None = None, verify: bool = False) -> None:
        super().__init__()
        self.run = run if run is not None else env.run()
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
        step = reader.agreed_step(self.run, self.root, local=True) if self.step is None else self.step
        path, manifests = reader.find(self.run, step, self.root)
        self._path, self._manifests = path, manifests
        self.info = CheckpointInfo.from_manifests(str(path), manifests)
        stored = manifests[0].metadata.get(METADATA_KEY)
        metadata = decode_metadata(stored, str(path)) if stored is not None else synthesize_metadata(
            manifests, env.group_rank())
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
                torch.save(self._value(rank, req.storage_index.fqn), buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            rec = self._manifests[rank].tensors.get(name) if name is not None else None
            if rec is None:
                raise CheckpointCorrupt(f"{self._path}: DCP's metadata names tensor {name!r} of rank {rank}, "
                                        "which that rank's manifest does not hold")
            dest = planner.resolve_tensor(req).detach()
            origin = [o + s for o, s in zip(rec.offsets, req.storage_offsets)]
            key = f"{name}\0{i}"
            pieces[key] = [Piece.of(rank, name, rec)]
            # DCP's planner hands a tensor of the caller's dtype: fill casts into it, as
            # DCP's FileSystemReader does (its read_data ends in target.copy_(stored))
            targets.append(Target.of(key, dest, Box(tuple(origin), tuple(req.lengths))))
            commits.append((req, dest))
        fill(self._path, targets, pieces, env.group_rank(), self.verify)
        for req, dest in commits:
            planner.commit_tensor(req, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def _stored(self, index: MetadataIndex) -> tuple[int, str | None]:
        where = self.storage_data.get(index)
        if where is None:
            raise CheckpointCorrupt(f"{self._path}: DCP's metadata does not say where {index.fqn!r} at offsets "
                                    f"{list(index.offset or [])} is stored: the DCP metadata kept in the step's "
                                    "manifest is damaged; load the step with ckptd.load_into, which reads the "
                                    "manifests' tensor records instead, or load another step")
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
