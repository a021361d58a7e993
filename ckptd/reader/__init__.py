"""The reader: find and read complete checkpoints straight from the checkpoint root
(and, where configured, the other tiers of ``ckptd.tiers.chain``: the peers, the
bucket), never through the daemon.

    steps     which steps are complete, where: list_checkpoints, latest, find, find_in_tiers
              (loops over the chain of tiers; no tier named)
    files     a step's data files: records into memory, into tensors, mapped, byte ranges
    checks    a step checked: checksums, each file's own structure, saved structures
    export    one checkpoint to one .safetensors, .h5 or .pt file (`ckptd export`)
    reshard   load_into, and the whole state of a multi-rank step (Piece, Target, fill)
    loading   load and verify

What needs a data file's own structure is its storage format's (``ckptd.format``,
docs/format.md); this package never asks which format a file is in.
"""

from __future__ import annotations

from .checks import check, check_structure, share_records
from .files import read_range, read_tensors
from .loading import destinations, load, verify
from .reshard import Piece, Target, fill, load_into, load_whole, pieces_of
from .finding import find, find_in_tiers, latest, latest_local, list_checkpoints, pick_rank

__all__ = [
    "Piece", "Target", "check", "check_structure", "destinations", "fill", "find", "find_in_tiers", "latest",
    "latest_local", "list_checkpoints", "load", "load_into", "load_whole", "pick_rank", "pieces_of",
    "read_range", "read_tensors", "share_records", "verify",
]
