"""ckptd: checkpoints off the training loop's critical path.

    from ckptd import producer            # emit / commit / checkpoint / save, in training
    import ckptd; ckptd.load("run")       # resume from the newest complete checkpoint
"""

import logging

# A library's records reach the application's handlers, never Python's bare
# last-resort printer: a failed checkpoint is reported once, by its exception.
logging.getLogger("ckptd").addHandler(logging.NullHandler())

from . import producer  # noqa: E402
from .errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from .manifest import CheckpointInfo
from .producer import CommitHandle, Producer
from .reader import latest, list_checkpoints, load, load_into

__all__ = [
    "CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointNotFound",
    "CommitHandle", "Producer", "latest", "list_checkpoints", "load", "load_into", "producer",
]
from .version import __version__ as __version__  # re-exported


def __getattr__(name: str):  # ckptd.dcp: imported on first use (it imports torch.distributed.checkpoint)
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
