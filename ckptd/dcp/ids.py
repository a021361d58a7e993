"""Steps from DCP's ``checkpoint_id``, and this process's rank and world size."""

from __future__ import annotations

import os
from typing import Any


def step_of(value: Any) -> int:
    """A step from ``step=`` or DCP's ``checkpoint_id`` (an int, or a str/path ending in digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    tail = None if text is None else str(text).rstrip("/").rsplit("/", 1)[-1].removeprefix("step-")
    if tail is not None and tail.isdigit():
        return int(tail)
    raise ValueError(f"ckptd.dcp: {value!r} is not a step; pass a step number (an int >= 0)")


def is_checkpoint_id(checkpoint_id: Any) -> bool:
    """Whether DCP's ``checkpoint_id`` names a step (``validate_checkpoint_id``)."""
    try:
        step_of(checkpoint_id)
    except ValueError:
        return False
    return True
