"""Bucket shares read once a cluster (docs/tiers.md, "Read once"): each share of a step
has one fetcher among the daemons of the ``[peer]`` list (``PeerPull.fetcher``);
a daemon that is not its fetcher asks the fetcher (``pull`` on the peer port) to land it
from the bucket, and copies its files as they land there, every tensor checked against
the bucket's own manifest. Start at ``FetcherCopy.fill``.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..errors import CheckpointCorrupt, CheckpointError, PeerDown, PeerRefused, ProtocolError
from ..manifest import Manifest
from ..peer import messages
from ..remote import catalog, fetch
from ..remote.store import Store
from . import landing
from .peer_discovery import reader_keys
from .peer_transfer import PeerTransfer, share_files

log = logging.getLogger("ckptd.daemon")

PULL_POLL_S = 0.05  # a fetcher that answers a pull at once is asked again this often
PULL_LONG_MS = 1000  # a pull waits at its fetcher at most this long for a mark to move
PULL_WAIT_S = 600.0
CLOSING_S = 0.1  # a copy waiting on its fetcher sees this daemon stop within this long
FAILED = (CheckpointCorrupt, PeerDown, PeerRefused, ProtocolError)


class PeerPull:
    def __init__(self, config: Config) -> None:
        self.config, self.cfg = config, config.peer
        self.nodes = sorted({self.cfg.listen, *self.cfg.peers})
        self.closing = threading.Event()

    @functools.cached_property
    def keys(self) -> Any:
        return reader_keys(self.config)

    @functools.cached_property
    def transfer(self) -> PeerTransfer:
        return PeerTransfer(self.cfg, self.keys)

    def fetcher(self, run: str, step: int, rank: int) -> str | None:
        """The ``listen`` endpoint of the daemon that reads this share from the bucket;
        None: this one. Every daemon of one peer list picks the same: the ranks of a step
        in turn from a node its name picks, so that each node fetches as many shares."""
        node = self.nodes[(zlib.crc32(f"{run}/{step}".encode()) + rank) % len(self.nodes)]
        return None if node == self.cfg.listen else node

    def source(self, endpoint: str, store: Store, run: str, step: int, rank: int,
               count: Callable[[int], None]) -> FetcherCopy:
        """The share as its fetcher at ``endpoint`` lands it (``landing.Source``);
        ``count(bytes)`` once it is copied."""
        return FetcherCopy(self, endpoint, store, (run, step, rank), count)


class FetcherCopy:
    """A share copied from its fetcher as the fetcher lands it from the bucket, every
    tensor checked against the bucket's own manifest. Its failure is one of ``FAILED``,
    or a CheckpointError when this daemon stops."""

    def __init__(self, pull: PeerPull, endpoint: str, store: Store, key: tuple[str, int, int],
                 count: Callable[[int], None]) -> None:
        self.pull, self.endpoint, self.store, self.key, self.count = pull, endpoint, store, key, count
        self.what = f"its fetcher {endpoint}"

    def fill(self, folder: Path, placed: Callable[[str], None]) -> Manifest:
        run, step, rank = self.key
        fetcher = _Fetcher(self.pull, self.endpoint, run, step, rank)
        try:
            fetcher.ask()
            manifest = catalog.read_manifest(self.store, run, step, rank).unpacked()
            sizes = {f: n for f, n in share_files(manifest).items() if f in fetch.missing_files(manifest, folder)}
            landing.stream(folder, sizes, functools.partial(self.pull.transfer.read_files, self.endpoint, manifest,
                                                            readable=fetcher.readable), placed)
        except FAILED:
            if self.pull.closing.is_set():
                raise CheckpointError("this daemon is stopping") from None
            raise
        finally:
            fetcher.close()
        self.count(sum(sizes.values()))
        log.info("run %r step %d rank %d landed from %s (%d bytes)", run, step, rank, self.what, sum(sizes.values()))
        return manifest


class _Fetcher:
    """A share as its fetcher lands it: ``pull`` asked (which starts its download), then
    asked again on a thread of its own (``ckptd-pull-marks``), each ask waiting at the
    fetcher (``wait_ms``) until a mark passes what this one has: the copy hears of each
    piece as it lands. A fetcher that answers at once (one that does not wait) is asked
    at most every ``PULL_POLL_S``; one whose answer has no ``readable`` (older still) is
    read once it has the whole share, as before."""

    def __init__(self, pull: PeerPull, endpoint: str, run: str, step: int, rank: int) -> None:
        self.pull, self.endpoint = pull, endpoint
        self.request = {"op": "pull", "run": run, "step": step, "rank": rank}
        self.what = f"{endpoint}: run {run!r} step {step} rank {rank}"
        self.link = messages.Link(endpoint, pull.keys)
        self.landed = False
        self.marks: dict[str, int] = {}
        self.failed: Exception | None = None
        self.changed = threading.Condition()
        self.done = threading.Event()
        self.deadline = time.monotonic() + PULL_WAIT_S

    def ask(self) -> None:
        """The first pull (its download started: its refusal is raised here); the marks
        then followed on a thread, which closes the link once it is done."""
        try:
            self._ask(0)
        except BaseException:
            self.link.close()
            raise
        threading.Thread(target=self._follow, name="ckptd-pull-marks", daemon=True).start()

    def _ask(self, wait_ms: int) -> bool:
        """One pull; whether its answer told more than was known."""
        with self.changed:
            have = dict(self.marks)
        request = {**self.request, "have": have, "wait_ms": wait_ms} if wait_ms else self.request
        header, _ = self.link.request(request, timeout=self.pull.cfg.stall + wait_ms / 1000)
        marks = header.get("readable", {})
        if not isinstance(marks, dict) or not all(isinstance(f, str) and isinstance(n, int) for f, n in marks.items()):
            raise ProtocolError(f"{self.what}: a pull answer whose readable is {marks!r:.200}, not file -> bytes")
        with self.changed:
            moved = header.get("landed") is True and not self.landed or any(n > self.marks.get(f, 0)
                                                                          for f, n in marks.items())
            self.landed = self.landed or header.get("landed") is True
            for file, n in marks.items():
                self.marks[file] = max(n, self.marks.get(file, 0))
            self.changed.notify_all()
        return moved

    def _follow(self) -> None:
        try:
            while not self.landed and not self.done.is_set() and not self.pull.closing.is_set():
                asked = time.monotonic()
                if not self._ask(PULL_LONG_MS) and time.monotonic() - asked < PULL_POLL_S:
                    self.done.wait(PULL_POLL_S)  # answered at once, unchanged: a fetcher that does not wait
        except Exception as exc:
            with self.changed:
                self.failed = exc
                self.changed.notify_all()
        finally:
            self.link.close()

    def readable(self, file: str, need: int, wait: bool) -> int:
        """How far ``file`` may be read: all of it once landed, else up to its mark;
        ``wait``: once that reaches ``need``. The follower's failure raised; PeerDown
        after ``PULL_WAIT_S``, or when this daemon stops."""
        with self.changed:
            while True:
                if self.failed is not None:
                    raise self.failed
                have = sys.maxsize if self.landed else self.marks.get(file, 0)
                if have >= need or not wait:
                    return have
                if time.monotonic() > self.deadline:
                    raise PeerDown(f"{self.what} not landed after {PULL_WAIT_S:g} s")
                if self.pull.closing.is_set():
                    raise PeerDown("this daemon is stopping")
                self.changed.wait(CLOSING_S)

    def close(self) -> None:
        """The follower stops after the pull it waits on (at most ``PULL_LONG_MS``)."""
        self.done.set()
