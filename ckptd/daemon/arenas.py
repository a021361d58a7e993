"""Staging arenas handed over by local producers, as the daemon keeps them.

A producer on the daemon's host passes its staging arena's descriptor over a unix
socket beside the ZeroMQ one (``ckptd.transport.handoff``); its hello names it by token, and
the daemon maps it read-only, so tensors arrive as offsets into it, not as bytes on
the socket (docs/format.md). ``Arenas`` owns that socket's connections and which
commits are still being written out of which arena.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import zmq

from ..transport import handoff
from .share import Share

log = logging.getLogger("ckptd.daemon")

Arena = tuple[int, int]  # an arena's identity: (st_dev, st_ino) of its memfd


class Arenas:
    def __init__(self) -> None:
        self.listener: handoff.Listener | None = None  # none until ``listen``; never for tcp://
        # Commits in flight whose bytes are in a producer's shared arena, by arena: if the
        # same arena comes back in a new hello (the producer reconnected), it is about to
        # be reused, and those commits must not complete with bytes overwritten under them.
        self.commits: dict[Arena, list[Share]] = {}

    def listen(self, ipc_path: str) -> None:
        """Accept arenas on the handoff socket beside the ZeroMQ socket file ``ipc_path``."""
        self.listener = handoff.Listener(ipc_path)

    def register(self, poller: zmq.Poller) -> None:
        if self.listener is not None:
            poller.register(self.listener.fileno(), zmq.POLLIN)

    def take(self, poller: zmq.Poller, events: dict[Any, int]) -> None:
        """Accept new handoff connections and receive the descriptors that arrived."""
        if self.listener is None:
            return
        if self.listener.fileno() in events:
            for fd in self.listener.accept():
                poller.register(fd, zmq.POLLIN)
        for fd in [fd for fd in self.listener.connections if fd in events]:
            poller.unregister(fd)
            refused = self.listener.receive(fd)
            if refused:
                log.warning("%s", refused)

    def expire(self, poller: zmq.Poller, now: float) -> None:
        """Drop handoff connections, and arenas never claimed, that waited too long."""
        if self.listener is None:
            return
        for fd in self.listener.expire(now):
            poller.unregister(fd)

    def map(self, h: dict[str, Any]) -> tuple[memoryview, Arena] | None:
        """Map the staging arena that the hello ``h``'s token names, read-only; return it
        and its identity, or None (and a warning: the producer then sends inline, or fails
        if it insists) if it cannot."""
        why = None
        claimed = self.listener.claim(h["shm_token"]) if self.listener is not None else None
        if claimed is None:
            why = "no staging memory was handed over under its token"
        elif claimed.size < h["shm_size"]:
            why = f"its staging memory is {claimed.size} bytes, not the {h['shm_size']} its hello declares"
        else:
            try:
                mm = mmap.mmap(claimed.fd, h["shm_size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                why = f"mapping its staging memory failed: {exc}"
        if claimed is not None:
            os.close(claimed.fd)  # the mapping keeps the memory alive
        if why is not None:
            log.warning("producer of run %r rank %s (pid %s): %s; it sends tensors inline",
                        h["run"], h["rank"], h["pid"], why)
            return None
        assert claimed is not None
        return memoryview(mm), claimed.ident

    def reused(self, arena: Arena) -> None:
        """The arena is back under a new session, whose producer reuses it from now on:
        fail the commits still being written from it (their producer was told already)."""
        for share in self.commits.pop(arena, []):
            if share.error is None:
                share.error = (f"step {share.step} was not saved: its producer reconnected before the daemon "
                               "had written its shared staging memory, which the producer now reuses")
                log.warning("run=%s step=%d rank=%d: %s", share.run, share.step, share.rank, share.error)

    def committing(self, arena: Arena, share: Share) -> None:
        """``share``'s commit is being written, some of it out of ``arena``."""
        self.commits.setdefault(arena, []).append(share)

    def committed(self, share: Share) -> None:
        """``share``'s commit ended (durable or failed): its arena may be reused safely."""
        for arena, shares in list(self.commits.items()):
            if share in shares:
                shares.remove(share)
                if not shares:
                    del self.commits[arena]
                return

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
