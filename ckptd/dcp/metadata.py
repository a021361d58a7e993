"""DCP's ``Metadata`` as JSON (never pickled), and synthesized from ckptd manifests
(docs/format.md, "DCP's metadata")."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)

from .. import dtypes, state as state_mod
from ..errors import CheckpointCorrupt
from ..manifest import Manifest

METADATA_KEY = "ckptd.dcp"
ENCODING_VERSION = 1
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """A faithful JSON form of DCP's ``Metadata`` (docs/training.md): every field, typed."""
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
                                     memory_format=_MEMORY_FORMATS[t["memory_format"]],
                                     pin_memory=bool(t["pin_memory"]))
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
    structure, tensors = state_mod.flatten(value)
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
        for key, rec in m.tensors.items():
            name = rec.tensor_name(key)
            index = MetadataIndex(name, rec.offsets)
            if index in storage:
                continue
            storage[index] = (m.rank, key)
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
