"""Sharded tensors: where a piece sits in its whole tensor, who stores a replicated one,
and which bytes of a stored piece a target needs.

A *piece* is a block of a tensor: its global offsets and its own sizes (DCP's
``ChunkStorageMetadata``). ``describe_dtensor`` names a DTensor's; ``piece_name`` keys a
rank's later pieces of one tensor; ``assign_writers`` picks, the same on every rank, the
one rank that writes a piece several hold; ``overlap`` is what a load copies.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .manifest import Shard


@dataclass(frozen=True)
class DTensorPiece:
    """A DTensor's local shard and what places it.

    ``local``: the plain local torch.Tensor
    ``group``: global ranks holding this same piece (more than one: replicated)"""

    local: Any
    shard: Shard
    group: tuple[int, ...]


def is_dtensor(value: Any) -> bool:
    # no DTensor exists before torch.distributed.tensor is imported, which plain-tensor producers need not pay for
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def describe_dtensor(name: str, value: Any, cache: dict[Any, Any] | None = None) -> DTensorPiece:
    """This rank's piece of DTensor ``value``; TypeError for a placement that has no
    place in the whole tensor (Partial: values still to be reduced). ``cache``: a dict
    kept across the tensors of one state (FSDP's many same-shaped pieces are placed once)."""
    mesh, placements = value.device_mesh, tuple(value.placements)
    key = (id(mesh), placements, tuple(value.shape))
    place = cache.get(key) if cache is not None else None
    if place is None:
        place = _place(name, value.shape, mesh, placements)
        if cache is not None:
            cache[key] = place
    sizes, shard, group = place
    local = value.to_local()
    if list(local.shape) != sizes:
        raise TypeError(f"tensor {name!r}: its DTensor local shard has shape {list(local.shape)}, but its "
                        f"placements {list(placements)} give {sizes}; save value.full_tensor() instead")
    return DTensorPiece(local, shard, group)


def _place(name: str, shape: Any, mesh: Any, placements: tuple[Any, ...]) -> tuple[list[int], Shard, tuple[int, ...]]:
    """``(local sizes, Shard, group)`` of this rank's piece of a DTensor of ``shape``."""
    from torch.distributed.tensor import Replicate, Shard as TShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for dim, p in enumerate(placements):
        if not isinstance(p, (TShard, _StridedShard, Replicate)):
            raise TypeError(
                f"tensor {name!r} is a DTensor with placement {p!r} on mesh dimension {dim}, which ckptd "
                "cannot store: its local values are not a piece of the tensor but still to be reduced; "
                "redistribute it first, e.g. value.redistribute(placements=[Replicate()] * mesh.ndim), "
                "or save value.full_tensor()"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TypeError(f"tensor {name!r} is a DTensor on a device mesh this rank is not part of; "
                        "save it from the ranks of its mesh")
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    # the ranks holding the same piece: this rank's coordinate on sharded mesh
    # dimensions, any coordinate on replicated ones
    index = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(placements, coordinate))
    group = tuple(sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist()))
    shard = Shard(global_shape=list(shape), offsets=[int(o) for o in offsets],
                  placements=[str(p) for p in placements], mesh_shape=list(mesh.shape))
    return [int(n) for n in sizes], shard, group


def hand_shard(name: str, shape: Sequence[int], global_shape: Any, offset: Any) -> Shard:
    """The piece that ``emit(..., global_shape=, offset=)`` names; ValueError if it does not fit."""
    if (global_shape is None) != (offset is None):
        raise ValueError(f"emit({name!r}, ...): pass both global_shape= and offset= (a sharded piece), "
                         "or neither (a whole tensor)")
    try:
        g = [int(n) for n in global_shape]
        o = [int(n) for n in offset]
    except (TypeError, ValueError):
        raise ValueError(f"emit({name!r}, ...): global_shape= and offset= must be sequences of ints, "
                         f"got {global_shape!r} and {offset!r}") from None
    try:
        return Shard.parse({"global_shape": g, "offsets": o}, list(shape))
    except ValueError as exc:
        raise ValueError(f"emit({name!r}, ...): {exc}") from None


def piece_name(name: str, offsets: Sequence[int]) -> str:
    """The key a rank keeps its second and later pieces of tensor ``name`` under, in its
    manifest and its chunk file (``name@4,0`` for the piece at offsets [4, 0]); the
    record's ``shard.tensor`` says whose piece it is (docs/format.md)."""
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"


def assign_writers(items: Iterable[tuple[str, int, tuple[int, ...]]]) -> dict[str, int]:
    """``{name: writer rank}`` for replicated pieces ``(name, nbytes, group)``.

    Largest first, each goes to the least-loaded rank of its group (lowest rank on a
    tie), with one load count per group. Every rank of a group sees the same pieces
    with the same sizes, so each computes the same answer alone.
    """
    loads: dict[tuple[int, ...], dict[int, int]] = {}
    writers: dict[str, int] = {}
    for name, nbytes, group in sorted(items, key=lambda it: (-it[1], it[0])):
        load = loads.setdefault(group, dict.fromkeys(group, 0))
        writer = min(group, key=lambda r: (load[r], r))
        load[writer] += nbytes
        writers[name] = writer
    return writers


@dataclass(frozen=True)
class Box:
    """A block of a tensor: global ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The block both hold, or None."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))
    if any(h <= low for low, h in zip(lo, hi)) and lo:
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def local_slices(box: Box, within: Box) -> tuple[slice, ...]:
    """``box`` as slices of the local tensor of the piece ``within``."""
    return tuple(slice(o - w, o - w + n) for o, w, n in zip(box.offsets, within.offsets, box.sizes))


def byte_span(box: Box, within: Box, itemsize: int) -> tuple[int, int, int]:
    """``(start, length, rows)``: the contiguous bytes of ``within``'s C-order storage
    that hold ``box``, and ``rows``, the number of separate runs inside that span
    (1: the span is exactly ``box``). The span runs from ``box``'s first element to
    its last; a caller reads it whole and copies ``box`` out, or reads straight
    into its target when ``rows == 1``."""
    ndim = len(within.sizes)
    if ndim == 0:
        return 0, itemsize, 1
    strides = [itemsize] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * within.sizes[d + 1]
    rel = [o - w for o, w in zip(box.offsets, within.offsets)]
    start = sum(r * s for r, s in zip(rel, strides))
    last = sum((r + n - 1) * s for r, n, s in zip(rel, box.sizes, strides))
    # the innermost dimension where the box does not span the piece whole ends a run
    j = ndim - 1
    while j >= 0 and box.sizes[j] == within.sizes[j]:
        j -= 1
    rows = math.prod(box.sizes[:j]) if j > 0 else 1
    return start, last + itemsize - start, rows

