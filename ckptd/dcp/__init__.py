"""``torch.distributed.checkpoint`` (DCP) storage through ckptd: ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` with ``StorageWriter`` / ``StorageReader`` below.

The only package that imports ``torch.distributed.checkpoint``: ``writer`` (the two
writers), ``reader``, ``metadata`` (DCP's ``Metadata`` as JSON, or synthesized),
``ids``. A DCP checkpoint made here is an ordinary ckptd step (checksums, ``verify``, retention, the index,
``latest``, ``list``, ``export``, the CLI, ``ckptd.load_into`` all work on it):

- ``write_data`` (every rank) emits each tensor write item into the producer's
  staging under its DCP name (``model.0.weight``), a DTensor's shard or a
  ShardedTensor's chunk with its global shape and offsets (the manifests' ``shard``
  records, docs/format.md; a rank's later chunks of one tensor under keys of their
  own), and returns once the bytes are copied. Non-tensor values (DCP's BYTE_IO items, which DCP would
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
  item needs into the planner's tensors (``ckptd.load_into``'s reader), converting
  them to each target's dtype as DCP's own reader does (docs/training.md), and
  hands BYTE_IO items the saved plain value, re-serialized here with ``torch.save``
  (DCP's load planner unpickles it; it only ever sees bytes ckptd made from JSON).

With ``durable=True`` (the default) a rank's share is durable before its part of the
save returns: ``dcp.save`` returns once the step is complete; with ``dcp.async_save``
that waiting happens off the training thread.
"""

from .metadata import METADATA_KEY, decode_metadata, encode_metadata, synthesize_metadata
from .storage_reader import StorageReader
from .storage_writer import AsyncStorageWriter, StorageWriter

__all__ = ["AsyncStorageWriter", "METADATA_KEY", "StorageReader", "StorageWriter", "decode_metadata",
           "encode_metadata", "synthesize_metadata"]
