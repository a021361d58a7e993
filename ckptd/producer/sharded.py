"""What of a state this rank writes: DTensors as their local pieces, and replicated
tensors by one rank each (``Producer.save(replicated=...)``, DTensor Replicate).

``plan`` runs on every rank with the same state layout and reaches the same
answer on each, without communicating (``sharding.assign_writers``); a rank
neither copies nor sends a tensor another rank writes, and its manifest lists
the tensor under ``written_by`` instead.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable

from ..manifest import Shard
from ..sharding import assign_writers, describe_dtensor, is_dtensor


@dataclass
class Plan:
    """What this rank stages of a state.

    ``stage``: name -> (plain tensor, piece)
    ``written_by``: name -> the rank that writes it
    ``shared``: every piece this rank holds a copy of that other ranks hold too (written here or
        not): name -> (plain tensor, piece), the copies compared across ranks (ckptd.replicas)"""

    stage: dict[str, tuple[Any, Shard | None]] = field(default_factory=dict)
    written_by: dict[str, int] = field(default_factory=dict)
    shared: dict[str, tuple[Any, Shard | None]] = field(default_factory=dict)


def replicated_matcher(replicated: Any) -> Callable[[str], bool]:
    """``replicated=`` as a test of tensor names: None/False (none), True (all) or fnmatch globs."""
    if replicated is None or replicated is False:
        return lambda name: False
    if replicated is True:
        return lambda name: True
    if isinstance(replicated, str):
        raise TypeError(f"replicated={replicated!r}: pass a list of globs, e.g. replicated=[{replicated!r}], "
                        "or True")
    try:
        globs = list(replicated)
    except TypeError:
        raise TypeError(f"replicated= must be True, None or a list of fnmatch globs of tensor names, "
                        f"not {type(replicated).__name__}") from None
    bad = [g for g in globs if not isinstance(g, str)]
    if bad:
        raise TypeError(f"replicated= holds {bad[0]!r}, not a glob string")
    return lambda name: any(fnmatch.fnmatchcase(name, g) for g in globs)


def plan(tensors: dict[str, Any], rank: int, world_size: int, replicated: Any = None) -> Plan:
    """Split ``{name: tensor}`` into what this rank stages and what other ranks write."""
    is_replicated = replicated_matcher(replicated)
    out = Plan()
    shared: list[tuple[str, int, tuple[int, ...]]] = []
    everyone = tuple(range(world_size))
    placed: dict[Any, Any] = {}
    for name, value in tensors.items():
        if is_dtensor(value):
            piece = describe_dtensor(name, value, placed)
            out.stage[name] = (piece.local, piece.shard)
            group, local = piece.group, piece.local
        else:
            out.stage[name] = (value, None)
            group = everyone if world_size > 1 and is_replicated(name) else ()
            local = value
        if len(group) > 1:
            if rank not in group:
                raise ValueError(f"tensor {name!r} is held by ranks {list(group)}, not by this rank {rank}: "
                                 "the producer's rank must be the process's global rank (RANK)")
            shared.append((name, _nbytes(local), group))
            out.shared[name] = out.stage[name]
    for name, writer in assign_writers(shared).items():
        if writer != rank:
            del out.stage[name]
            out.written_by[name] = writer
    return out


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or array (its dense size: what ``emit`` would copy)."""
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    return int(getattr(value, "nbytes", 0))
