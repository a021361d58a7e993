"""Validation of everything a user names: run ids, tensor names, steps, ranks.

Run ids become directory names, so they are held to a strict pattern. Tensor
names never become paths; they only need to be printable, bounded text (and not
the one key safetensors reserves).
"""

from __future__ import annotations

import re

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_NAME_BYTES = 1024
RESERVED_NAME = "__metadata__"  # a chunk file's safetensors header holds its metadata there
MAX_STEP = 10**12 - 1
MAX_WORLD_SIZE = 99_999

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_run(run: object) -> str:
    if not isinstance(run, str):
        raise ValueError(f"run id must be a str, got {type(run).__name__}")
    if not RUN_ID_PATTERN.fullmatch(run):
        # ASCII only: a look-alike (fullwidth solidus, Cyrillic "а") never reaches a path
        shown = repr(run) if len(run) <= 140 else f"{run[:40]!r}... ({len(run)} characters)"
        raise ValueError(
            f"invalid run id {shown}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return run


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise ValueError(f"tensor name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("tensor name is empty")
    if name == RESERVED_NAME:
        raise ValueError(f"tensor name {name!r} is reserved: safetensors keeps the file's metadata "
                         "under that key; rename the tensor")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    bad = _CONTROL.search(name)
    if bad:
        raise ValueError(
            f"tensor name {name!r} contains the control character {bad.group()!r}; "
            "names must be printable text"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"tensor name {name!r} is not valid unicode text") from exc
    return name


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int, got {type(step).__name__} {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} is out of range 0..{MAX_STEP}")
    return step


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    for label, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{label} must be an int, got {value!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:  # type: ignore[operator]
        raise ValueError(f"world_size {world_size} is out of range 1..{MAX_WORLD_SIZE}")
    if not 0 <= rank < world_size:  # type: ignore[operator]
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    return rank, world_size  # type: ignore[return-value]
