"""Bucket shares read once a cluster (docs/tiers.md, "Read once"): each share of a step
has one fetcher among the daemons of the ``[peer]`` list (``PeerPull.fetcher``);
a daemon that is not its fetcher asks the fetcher (``pull`` on the peer port) to land it
from the bucket, then copies its files from the fetcher's root, every tensor checked
against the bucket's own manifest. Start at ``PeerPull.land``.
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import zmq

from ..config import Config
from ..errors import CheckpointCorrupt, PeerDown, PeerRefused, ProtocolError
from ..manifest import Manifest
from ..peer import messages
from ..remote import catalog, fetch
from ..remote.store import Store
from . import landing
from .peer_discovery import reader_keys
from .peer_transfer import PeerTransfer, share_files

PULL_POLL_S = 0.1
PULL_WAIT_S = 600.0
FAILED = (CheckpointCorrupt, PeerDown, PeerRefused, ProtocolError)


class PeerPull:
    def __init__(self, config: Config) -> None:
        self.config, self.cfg = config, config.peer
        self.nodes = sorted({self.cfg.listen, *self.cfg.peers})
        self.ctx: zmq.Context = zmq.Context.instance()
        self.closing = threading.Event()

    @functools.cached_property
    def keys(self) -> Any:
        return reader_keys(self.config)

    @functools.cached_property
    def transfer(self) -> PeerTransfer:
        return PeerTransfer(self.ctx, self.cfg, self.keys)

    def fetcher(self, run: str, step: int, rank: int) -> str | None:
        """The ``listen`` endpoint of the daemon that reads this share from the bucket;
        None: this one. Every daemon of one peer list picks the same: the ranks of a step
        in turn from a node its name picks, so that each node fetches as many shares."""
        node = self.nodes[(zlib.crc32(f"{run}/{step}".encode()) + rank) % len(self.nodes)]
        return None if node == self.cfg.listen else node

    def land(self, endpoint: str, store: Store, root: Path, run: str, step: int, rank: int) -> int:
        """The share landed in ``root`` from the fetcher at ``endpoint`` (once it has it);
        the bytes copied. One of ``FAILED`` when the fetcher cannot serve it (the caller
        then reads the bucket itself)."""
        self._pulled(endpoint, run, step, rank)
        got = 0

        def files(folder: Path) -> Manifest:
            nonlocal got
            manifest = catalog.read_manifest(store, run, step, rank).unpacked()
            sizes = {f: n for f, n in share_files(manifest).items() if f in fetch.missing_files(manifest, folder)}
            landing.stream(folder, sizes, functools.partial(self.transfer.read_files, endpoint, manifest))
            got = sum(sizes.values())
            return manifest

        landing.land(root, run, step, rank, files)
        return got

    def _pulled(self, endpoint: str, run: str, step: int, rank: int) -> None:
        """Once the fetcher says the share is in its root, asked every ``PULL_POLL_S``
        while it downloads; PeerDown after ``PULL_WAIT_S``."""
        link = messages.Link(self.ctx, endpoint, self.keys)
        deadline = time.monotonic() + PULL_WAIT_S
        try:
            while True:
                header, _ = link.request({"op": "pull", "run": run, "step": step, "rank": rank},
                                         timeout=self.cfg.stall)
                if header.get("landed") is True:
                    return
                if time.monotonic() > deadline:
                    raise PeerDown(f"{endpoint}: run {run!r} step {step} rank {rank} not landed after "
                                   f"{PULL_WAIT_S:g} s")
                if self.closing.wait(PULL_POLL_S):
                    raise PeerDown("this daemon is stopping")
        finally:
            link.close()
