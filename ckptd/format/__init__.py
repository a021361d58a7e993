"""The storage formats of new checkpoints, each one module behind one protocol
(``protocol.Format``): ``chunk`` (safetensors chunk files) and ``hdf5``.

The daemon's writer asks a share's format to write it (``get(share.format)``); the
reader asks a data file's format to check and read it (``for_file(name)``); neither
ever tests which format it has. A new format is one more module here, listed below.
Importing this package loads neither h5py nor numpy: the HDF5 module loads h5py only
once it writes or reads a file.
"""

from __future__ import annotations

from . import chunk, hdf5
from .protocol import DataReader, Entry, Format, Ref, Stored, WriteIO, Written

_ALL: tuple[Format, ...] = (chunk.FORMAT, hdf5.FORMAT)
BY_NAME: dict[str, Format] = {f.name: f for f in _ALL}
FORMATS = tuple(BY_NAME)

__all__ = ["BY_NAME", "FORMATS", "DataReader", "Entry", "Format", "Ref", "Stored", "WriteIO", "Written", "for_file",
           "get"]


def get(name: str) -> Format:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"storage format {name!r} is not one of {', '.join(map(repr, FORMATS))}") from None


def for_file(file: str) -> Format | None:
    """The format of data file ``file`` (by its name), or None if it is not a data file."""
    return next((f for f in _ALL if f.owns(file)), None)
