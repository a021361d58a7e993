"""ckptd: checkpoints off the training loop's critical path.

    from ckptd import producer            # emit / commit / checkpoint / save, in training
    import ckptd; ckptd.load("run")       # resume from the newest complete checkpoint
"""

import logging as _logging

# a library's records reach the application's handlers, never Python's last-resort printer
_logging.getLogger("ckptd").addHandler(_logging.NullHandler())

from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

from .errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound  # noqa: E402
from .manifest import CheckpointInfo  # noqa: E402
from .version import __version__ as __version__  # noqa: E402  (re-exported)

if _TYPE_CHECKING:
    from . import dcp as dcp, producer
    from .producer import CommitHandle, Producer
    from .reader import latest, list_checkpoints, load, load_into

__all__ = [
    "CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointNotFound",
    "CommitHandle", "Producer", "latest", "list_checkpoints", "load", "load_into", "producer",
]

# imported on first use: the command line and the daemon need none of the producer's imports
_LAZY = {
    "producer": (".producer", None), "Producer": (".producer", "Producer"),
    "CommitHandle": (".producer", "CommitHandle"), "latest": (".reader", "latest"),
    "list_checkpoints": (".reader", "list_checkpoints"), "load": (".reader", "load"),
    "load_into": (".reader", "load_into"), "dcp": (".dcp", None),
}


def __getattr__(name: str) -> _Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(where[0], __name__)
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
