"""``torch.distributed.checkpoint`` (DCP) storage through ckptd: ``StorageWriter``,
``AsyncStorageWriter`` and ``StorageReader`` for ``dcp.save``, ``dcp.async_save`` and
``dcp.load``. The only package that imports ``torch.distributed.checkpoint``.

A DCP checkpoint made here is an ordinary ckptd step: each rank emits its write items
(``storage_writer``), rank 0 commits last with DCP's ``Metadata`` as JSON under
``"ckptd.dcp"`` (``metadata``), and ``storage_reader`` reads it back (or synthesizes
the metadata for a step ``producer.save`` made). Nothing is pickled.
"""

from .metadata import METADATA_KEY, decode_metadata, encode_metadata, synthesize_metadata
from .storage_reader import StorageReader
from .storage_writer import AsyncStorageWriter, StorageWriter

__all__ = ["AsyncStorageWriter", "METADATA_KEY", "StorageReader", "StorageWriter", "decode_metadata",
           "encode_metadata", "synthesize_metadata"]
