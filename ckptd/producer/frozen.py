"""``save(..., frozen=[globs])``: tensors the producer need not copy again (``Frozen``).

From the second checkpoint on, a declared-frozen tensor is described by a ``same``
message naming the step it was last committed in, and the daemon links that stored
copy (``ckptd.daemon.reuse``). A torch tensor whose storage address or ``_version``
moved since is copied again; writes that bypass the counter (``.data``, numpy views,
DLPack) are not seen: for those the declaration is the promise.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class _Stored:
    """A frozen tensor as it was last sent.

    ``item``: what the daemon checks against the stored record: dtype, shape, numpy, shard
    ``at``: where and in which version the bytes were: (data_ptr, _version), or () for numpy"""

    item: tuple
    at: tuple


def globs(frozen: Any) -> Callable[[str], bool] | None:
    """``frozen=`` as a test of a tensor name (True: every tensor), or None for none.
    Plain names (no ``*?[``, as an integration lists a model's frozen parameters) are
    a set lookup; the globs among them one compiled pattern. A glob that is not a
    string is a TypeError naming it."""
    if frozen is None or frozen is False:
        return None
    if frozen is True:
        return lambda name: True
    if isinstance(frozen, str):
        frozen = [frozen]
    if not isinstance(frozen, (list, tuple, set, frozenset)) or not all(isinstance(g, str) for g in frozen):
        raise TypeError(f"frozen must be True or a list of fnmatch globs of tensor names, not {frozen!r}")
    exact = {g for g in frozen if not _WILD.search(g)}
    wild = [g for g in frozen if _WILD.search(g)]
    if not wild:
        return exact.__contains__ if exact else None
    pattern = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in wild))
    return lambda name: name in exact or pattern.fullmatch(name) is not None


_WILD = re.compile(r"[*?\[]")


def _where(source: Any) -> tuple:
    version = getattr(source, "_version", None)
    if version is None:
        return ()
    return (source.data_ptr(), version)


class Frozen:
    """Which declared-frozen tensors the daemon already stores, and since which step.

    ``split`` at each save; ``done`` when the daemon answers a commit. Only a step
    the daemon acknowledged becomes a base: until then a save sends everything."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: int | None = None
        self._stored: dict[str, _Stored] = {}
        self._pending: dict[int, dict[str, _Stored]] = {}

    def split(self, step: int, items: dict[str, Any], matches: Callable[[str], bool] | None,
              describe: Any) -> tuple[int | None, list[list[Any]]]:
        """Take the tensors of ``items`` stored unchanged since the base out of it; return
        the base step and their ``same`` items (``describe(item)`` -> dtype, shape, numpy,
        shard). Those that ``matches`` are remembered for step ``step``."""
        if matches is None:
            return None, []
        with self._lock:
            base, stored = self._base, self._stored
        same: list[list[Any]] = []
        pending = {}
        for name, t in items.items():
            if not matches(name):
                continue
            now = _Stored(describe(t), _where(t.source))
            pending[name] = now
            if base is not None and stored.get(name) == now:
                same.append([name, *now.item])
        for entry in same:
            del items[entry[0]]
        with self._lock:
            self._pending[step] = pending
        return (base if same else None), same

    def done(self, step: int, ok: bool) -> None:
        """The daemon committed ``step`` (``ok``) or failed it."""
        with self._lock:
            pending = self._pending.pop(step, None)
            if ok and pending is not None:
                self._base, self._stored = step, pending
            elif not ok or step > (self._base or -1):
                # failed, or a newer step without them: the next save sends them all again
                self._base, self._stored = None, {}

    def forget(self) -> None:
        """A new connection (another daemon, maybe another root): send everything again."""
        with self._lock:
            self._base, self._stored, self._pending = None, {}, {}
