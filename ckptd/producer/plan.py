"""A cached plan for saving a state whose layout repeats (``Producer.save``).

A plan keeps the layout (containers, keys, which leaves are tensors), every tensor's
class, dtype and shape, and one staging region with its views and packed wire messages;
a matching save copies every tensor with one ``torch._foreach_copy_``. Anything else
goes the general way. Calls, in order: ``collect``, then under the emit lock ``take``
and ``copy`` (None from any: the general way); after a general save, ``build``.
"""

from __future__ import annotations

import functools
import json
import operator
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .. import dtypes
from ..transport import wire
from ..state import encode
from .batch import BATCH_BYTES, BATCH_ITEMS, SMALL
from .staging import ALIGN, LARGE, PAGE, Arena, Region

# node tags: a tensor, a plain value, a container of nodes, a container of tensors only
_TENSOR, _PLAIN, _DICT, _SEQ, _TDICT, _TSEQ = range(6)
_SIGNATURE = operator.attrgetter("__class__", "dtype", "shape")
_CHUNK = 256  # tensors checked, then copied, at a time: their metadata is still in cache for the copy
_VIEWS_KEPT = 2
SHIP = 32 * 2**20


@functools.cache
def _plain_types() -> frozenset[type]:
    import torch

    return frozenset((torch.Tensor, torch.nn.Parameter))


@functools.cache
def _arrays() -> tuple[type, ...]:
    import numpy as np
    import torch

    return (torch.Tensor, np.ndarray)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


@dataclass(eq=False)
class _Placed:
    """The arena views and packed messages of a plan at one region start.

    ``messages``: (op, wire.pack_fields(...)) but seq and step
    ``ends``: for each message, the index after the last tensor it describes"""

    views: list[Any]
    messages: list[tuple[str, tuple[bytes, int]]]
    ends: list[int]


@dataclass(eq=False)
class Plan:
    """What a general save of one state layout produced; see the module docstring.

    ``signatures``: (class, torch dtype, torch.Size) of each tensor
    ``offsets``: within the plan's region
    ``room``: sizing.room_for(nbytes): what the general save would report
    ``json_parts``: the structure's JSON around its plain values
    ``uses``: saves it served (Producer.stats-like figure, for tests and debugging)"""

    layout: Any
    names: list[str]
    signatures: list[tuple[type, Any, Any]]
    nbytes: list[int]
    offsets: list[int]
    region_bytes: int
    room: int
    json_parts: list[str]
    uses: int = 0
    _stops: list[int] | None = None
    _placed: OrderedDict[tuple[int, int], _Placed] = field(default_factory=OrderedDict)

    @classmethod
    def build(cls, state: Any, structure: Any, tensors: dict[str, Any], capacity: int,
              room: int) -> "Plan | None":
        """The plan of a state that a general save just staged whole (every tensor a plain
        CPU torch tensor this rank writes), or None where a plan cannot serve it."""
        plain = _plain_types()
        values = list(tensors.values())
        if not values or not set(map(type, values)) <= plain or any(t.is_cuda for t in values):
            return None
        slot = f"ckptd-slot-{uuid.uuid4().hex}"
        layout = _layout(state, structure, (), plain)
        if layout is None:
            return None
        parts = _json(_template(structure, slot)).split(_json(slot))
        if len(parts) != _count_slots(layout) + 1:
            return None
        sizes = [t.nbytes for t in values]
        if max(sizes) > capacity // 4:
            return None
        offsets, end = [], 0
        for n in sizes:
            align = PAGE if n >= LARGE else ALIGN
            end = -(-end // align) * align
            offsets.append(end)
            end += n
        region_bytes = max(PAGE, -(-end // PAGE) * PAGE)
        if region_bytes > capacity:
            return None
        return cls(layout=layout, names=list(tensors), signatures=list(map(_SIGNATURE, values)), nbytes=sizes,
                   offsets=offsets, region_bytes=region_bytes, room=room, json_parts=parts)

    def collect(self, state: Any) -> tuple[list[Any], str] | None:
        """This save's tensors in the plan's order and its structure's JSON text, or None
        when ``state`` does not have the plan's layout and names (``copy`` checks the
        tensors themselves)."""
        tensors: list[Any] = []
        plains: list[str] = []
        try:
            if not _collect(state, self.layout, tensors, plains) or len(tensors) != len(self.names):
                return None
        except (TypeError, ValueError):
            return None
        parts = self.json_parts
        text = parts[0] + "".join(p + q for p, q in zip(plains, parts[1:])) if plains else parts[0]
        return tensors, text

    def take(self, arena: Arena) -> Region | None:
        """The plan's region of staging if it is free now, else None (nothing was taken)."""
        return arena.try_alloc(self.region_bytes)

    def copy(self, region: Region, tensors: list[Any], arena: Arena, arena_t: Any,
             ship: Any = None) -> list[tuple[str, tuple[bytes, int]]] | None:
        """Copy ``tensors`` (from ``collect``) into ``region``; return the messages that
        describe them (``(op, wire.pack_fields(...))``, all but ``seq`` and ``step``), to be
        sent in order with the region carried by the last. None: a tensor's class, dtype
        or shape is not the plan's (nothing is sent; the region was given back).
        ``ship``: where the plan holds ``2 * SHIP`` bytes or more, called with the messages
        of each ``SHIP`` bytes copied, the rest returned (``_copy_shipping``).

        Each chunk of tensors is checked, then copied: checking all first cost a quarter
        of the copy at 10,000 tensors, their metadata fetched from memory twice."""
        import torch

        placed = self._place(arena, arena_t, region.start)
        if ship is not None and self.region_bytes >= 2 * SHIP:
            return self._copy_shipping(placed, region, tensors, arena, ship)
        views, signatures = placed.views, self.signatures
        try:
            with torch.no_grad():  # a Parameter's copy is not recorded for autograd
                for i in range(0, len(tensors), _CHUNK):
                    chunk = tensors[i:i + _CHUNK]
                    if list(map(_SIGNATURE, chunk)) != signatures[i:i + _CHUNK]:
                        arena.release(region)
                        return None
                    torch._foreach_copy_(views[i:i + _CHUNK], chunk)
        except (AttributeError, RuntimeError, NotImplementedError):  # not a dense tensor: the general way says why
            arena.release(region)
            return None
        except BaseException:
            arena.release(region)
            raise
        self.uses += 1
        return placed.messages

    def _copy_shipping(self, placed: _Placed, region: Region, tensors: list[Any], arena: Arena,
                       ship: Any) -> list[tuple[str, tuple[bytes, int]]] | None:
        """``copy`` of a large plan: the daemon writes the first bytes while the rest are
        copied, not once all are. Every tensor is checked first (what was shipped cannot
        be taken back), then each ``SHIP`` bytes are copied and their messages shipped.
        An error after a part was shipped keeps the region: the caller sends it after."""
        import torch

        strided = torch.strided
        if list(map(_SIGNATURE, tensors)) != self.signatures \
                or not all(t.layout is strided and t.device.type == "cpu" for t in tensors):
            arena.release(region)
            return None
        views, messages, ends = placed.views, placed.messages, placed.ends
        done = sent = 0
        shipped = False
        try:
            with torch.no_grad():
                for stop in self._parts():
                    torch._foreach_copy_(views[done:stop], tensors[done:stop])
                    done, first = stop, sent
                    while sent < len(messages) and ends[sent] <= done:
                        sent += 1
                    if sent < len(messages) and sent > first:
                        ship(messages[first:sent])
                        shipped = True
                    else:
                        sent = first
        except BaseException:
            if not shipped:
                arena.release(region)
            raise
        self.uses += 1
        return messages[sent:]

    def _parts(self) -> list[int]:
        """Where the copy of ``_copy_shipping`` stops to ship: after each ``SHIP`` bytes."""
        if self._stops is None:
            stops, counted = [], 0
            for i, n in enumerate(self.nbytes, 1):
                counted += n
                if counted >= SHIP:
                    stops.append(i)
                    counted = 0
            if not stops or stops[-1] != len(self.nbytes):
                stops.append(len(self.nbytes))
            self._stops = stops
        return self._stops

    def prepare(self, arena: Arena, arena_t: Any) -> None:
        """Make the views and messages for a region at the arena's start, where the next
        save lands once the daemon has drained staging, so that it is not the one that
        pays for making them (the general save that built the plan pays, once)."""
        self._place(arena, arena_t, 0)

    def forget_views(self) -> None:
        """Drop the views into the arena (it is being replaced: they would keep it mapped)."""
        self._placed.clear()

    def _place(self, arena: Arena, arena_t: Any, start: int) -> _Placed:
        key = (id(arena), start)
        placed = self._placed.get(key)
        if placed is not None:
            self._placed.move_to_end(key)
            return placed
        views = []
        for (_, dtype, shape), n, off in zip(self.signatures, self.nbytes, self.offsets):
            at = start + off
            views.append(arena_t[at:at + n].view(dtype).view(shape))
        placed = _Placed(views, *self._messages(start))
        self._placed[key] = placed
        while len(self._placed) > _VIEWS_KEPT:
            self._placed.popitem(last=False)
        return placed

    def _messages(self, start: int) -> tuple[list[tuple[str, tuple[bytes, int]]], list[int]]:
        """The wire messages for the region at ``start``: a small tensor rides in a batch
        (``tensors``, as ``Batcher`` sends them), a larger one alone (``tensor``); and
        where each ends (``_Placed.ends``: a batch ends after its last small tensor, and
        after the larger ones sent before it)."""
        out: list[tuple[str, tuple[bytes, int]]] = []
        ends: list[int] = []
        items: list[list[Any]] = []
        first = 0
        for i, (name, (_, dtype, shape), n, off) in enumerate(zip(self.names, self.signatures, self.nbytes,
                                                                   self.offsets)):
            d, shape = dtypes.by_torch(dtype).name, list(shape)
            if n > SMALL:
                out.append(("tensor", wire.pack_fields(name=name, dtype=d, shape=shape, nbytes=n, numpy=False,
                                                       start=0, offset=start + off, length=n)))
                ends.append(i + 1)
                continue
            if items and (len(items) >= BATCH_ITEMS or off + n - first > BATCH_BYTES):
                out.append(("tensors", wire.pack_fields(items=items)))
                ends.append(i)
                items = []
            if not items:
                first = off
            items.append([name, d, shape, n, False, start + off])
        if items:
            out.append(("tensors", wire.pack_fields(items=items)))
            ends.append(len(self.names))
        return out, ends


def _layout(value: Any, node: Any, path: tuple[Any, ...], plain: frozenset[type]) -> Any:
    """The layout node of ``value``, whose ``flatten`` structure is ``node``; None where a
    plan cannot stand for it (a numpy array)."""
    if isinstance(node, dict):
        if "tensor" in node:
            return (_TENSOR,) if type(value) in plain else None
        if "ndarray" in node:
            return None
        if "dict" in node and type(value) in (dict, OrderedDict):
            keys = tuple(value)
            key_types = None if all(type(k) is str for k in keys) else tuple(map(type, keys))
            meta = "meta" in node
            children = [_layout(v, n, path + (k,), plain) for v, (k, n) in zip(value.values(), node["dict"])]
            if any(c is None for c in children):
                return None
            if children and all(c[0] == _TENSOR for c in children):
                return (_TDICT, type(value), keys, key_types, meta, path)
            return (_DICT, type(value), keys, key_types, meta, path, tuple(children))
        for tag in ("list", "tuple"):
            if tag in node and type(value) in (list, tuple):
                children = [_layout(v, n, path + (i,), plain) for i, (v, n) in enumerate(zip(value, node[tag]))]
                if any(c is None for c in children):
                    return None
                if children and all(c[0] == _TENSOR for c in children):
                    return (_TSEQ, type(value), len(value))
                return (_SEQ, type(value), len(value), tuple(children))
    return (_PLAIN, path)


def _template(node: Any, slot: str) -> Any:
    """``node`` (a ``flatten`` structure) with ``slot`` in place of each plain value and
    of each dict's ``meta``: its JSON text, split at the slots, is the plan's template."""
    if isinstance(node, dict):
        if "tensor" in node or "ndarray" in node:
            return node
        if "dict" in node:
            out = {"dict": [[k, _template(v, slot)] for k, v in node["dict"]], "ordered": node["ordered"]}
            if "meta" in node:
                out["meta"] = slot
            return out
        for tag in ("list", "tuple"):
            if tag in node:
                return {tag: [_template(v, slot) for v in node[tag]]}
    return slot


def _count_slots(layout: Any) -> int:
    tag = layout[0]
    if tag == _PLAIN:
        return 1
    if tag == _TDICT:
        return int(layout[4])
    if tag == _DICT:
        return int(layout[4]) + sum(_count_slots(c) for c in layout[6])
    if tag == _SEQ:
        return sum(_count_slots(c) for c in layout[3])
    return 0


_CONTAINERS = (dict, OrderedDict, list, tuple)


def _collect(value: Any, layout: Any, tensors: list[Any], plains: list[str]) -> bool:
    """Append ``value``'s tensors to ``tensors`` and its plain values' JSON to ``plains``,
    in ``flatten``'s order; False where ``value`` does not have ``layout``."""
    tag = layout[0]
    if tag == _TENSOR:
        tensors.append(value)
        return True
    if tag == _PLAIN:
        if type(value) in _CONTAINERS or isinstance(value, _arrays()):
            return False
        plains.append(_json(encode(value, layout[1], {})))
        return True
    if tag == _TDICT or tag == _DICT:
        if type(value) is not layout[1] or tuple(value) != layout[2] \
                or (layout[3] is not None and tuple(map(type, value)) != layout[3]):
            return False
        if tag == _TDICT:
            tensors.extend(value.values())
        else:
            for v, child in zip(value.values(), layout[6]):
                if child[0] == _TENSOR:
                    tensors.append(v)
                elif not _collect(v, child, tensors, plains):
                    return False
        return _collect_meta(value, layout[4], layout[5], plains)
    if type(value) is not layout[1] or len(value) != layout[2]:
        return False
    if tag == _TSEQ:
        tensors.extend(value)
        return True
    return all(_collect(v, child, tensors, plains) for v, child in zip(value, layout[3]))


def _collect_meta(value: Any, had_meta: bool, path: tuple[Any, ...], plains: list[str]) -> bool:
    """A state_dict's ``_metadata`` (module versions), encoded as ``state._encode_dict`` does."""
    meta = getattr(value, "_metadata", None) if type(value) is OrderedDict else None
    if not had_meta:
        return not isinstance(meta, dict)
    if not isinstance(meta, dict):
        return False
    try:
        plains.append(_json(encode(meta, path + ("_metadata",), {})))
    except TypeError:
        return False
    return True

