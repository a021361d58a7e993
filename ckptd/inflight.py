"""The shares this process is downloading into its root, and how far each of their
files is readable: a prefix, as a download lands its bytes in order. The peer port
serves a puller the bytes below that mark while the rest still lands (docs/tiers.md,
"Read once"). The downloader ``track``s a share and moves each file's mark
(``Landing.landed``); the port asks ``marks`` and ``source``, and is told by ``watch``
each time a mark moves or a share stops landing (its waiting pulls are answered then,
not on a timer). Start at ``track``.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Callable, Iterator

ShareAt = tuple[Path, int]


class Landing:
    """One share under way: for each file begun, where its bytes are now (the temporary
    file a download writes) and how many of them; how far a peer has read each."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[Path, int]] = {}
        self.read: dict[str, int] = {}
        self.changed = threading.Condition()

    def landed(self, file: str, path: Path, nbytes: int) -> None:
        with self.changed:
            self.files[file] = (path, nbytes)
        _moved()

    def wait_read(self, file: str, nbytes: int, timeout: float) -> bool:
        """Whether a peer read ``file`` up to ``nbytes`` within ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: self.read.get(file, 0) >= nbytes, timeout)


_lock = threading.Lock()
_landing: dict[ShareAt, Landing] = {}
_streamed = [0]
_watchers: list[Callable[[], None]] = []


def watch(moved: Callable[[], None]) -> None:
    """``moved()`` called, on the downloader's thread, each time a mark moves or a share
    stops landing here: it must return at once (a port's wake)."""
    with _lock:
        _watchers.append(moved)


def unwatch(moved: Callable[[], None]) -> None:
    with _lock:
        if moved in _watchers:
            _watchers.remove(moved)


def _moved() -> None:
    with _lock:
        watchers = list(_watchers)
    for moved in watchers:
        moved()


@contextlib.contextmanager
def track(folder: Path, rank: int) -> Iterator[Landing]:
    """Rank ``rank``'s share landing in step folder ``folder``, served by its marks until
    this ends: once its manifest is written (then from the root), or it failed."""
    share = Landing()
    with _lock:
        _landing[(folder, rank)] = share
    try:
        yield share
    finally:
        with _lock:
            if _landing.get((folder, rank)) is share:
                del _landing[(folder, rank)]
        _moved()


def tracked(folder: Path, rank: int) -> Landing:
    """The share ``track`` registered, else one no peer sees."""
    with _lock:
        return _landing.get((folder, rank)) or Landing()


def marks(folder: Path, rank: int) -> dict[str, int] | None:
    """How far each file of the share begun is readable; None: it is not downloading here."""
    with _lock:
        share = _landing.get((folder, rank))
    if share is None:
        return None
    with share.changed:
        return {f: n for f, (_, n) in share.files.items()}


def source(folder: Path, rank: int, file: str, end: int) -> list[Path]:
    """Where bytes up to ``end`` of ``file`` are, landed: its temporary file, then (renamed
    meanwhile) its place; [] when they have not landed. The read is counted as streamed."""
    with _lock:
        share = _landing.get((folder, rank))
    if share is None:
        return []
    with share.changed:
        path, nbytes = share.files.get(file, (None, 0))
        if path is None or end > nbytes:
            return []
        share.read[file] = max(share.read.get(file, 0), end)
        share.changed.notify_all()
    return [path, folder / file]


def count_streamed(nbytes: int) -> None:
    with _lock:
        _streamed[0] += nbytes


def streamed() -> int:
    """Bytes served to peers from shares still downloading, since this process started."""
    with _lock:
        return _streamed[0]
