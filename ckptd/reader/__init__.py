"""The reader: find and read complete checkpoints in the tiers of ``ckptd.tiers.chain``
(the local root, the peers, the bucket), never through the daemon. ``finding``: which
steps are complete, and a step's ``Holding``; ``loading``: ``load`` and ``verify``;
``reshard``: ``load_into`` and the whole state; ``checks``: checksums and structures;
``export``: one checkpoint to one file. Data files are read by ``ckptd.tiers.files``.
"""

from __future__ import annotations

from ..tiers.files import read_range, read_tensors
from .checks import check, check_structure, share_records
from .loading import destinations, load, verify
from .reshard import Piece, Target, fill, load_into, load_whole, pieces_of
from .finding import agreed_step, find, latest, latest_local, list_checkpoints, open_in_tiers, open_step, pick_rank

__all__ = [
    "Piece", "Target", "agreed_step", "check", "check_structure", "destinations", "fill", "find", "latest", "latest_local",
    "list_checkpoints", "load", "load_into", "load_whole", "open_in_tiers", "open_step", "pick_rank", "pieces_of",
    "read_range", "read_tensors", "share_records", "verify",
]
