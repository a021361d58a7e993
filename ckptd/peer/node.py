"""The daemon's part of the peer tier: the holder of other nodes' replicas, the
``ckptd-peer-serve`` thread that receives and serves them, and the
``ckptd-peer-send`` thread that replicates this node's commits. Owned by
``ckptd.daemon.upkeep``, fed after each local commit and each retention pass."""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

import zmq

from ..config import Config, ConfigError
from .keys import daemon_curve
from .holder import Holder
from .replicator import Replicator
from .server import PeerServer

log = logging.getLogger("ckptd.peer")


class PeerNode:
    def __init__(self, config: Config, keep_last: Callable[[str], int]) -> None:
        cfg = config.peer
        if cfg.listen in cfg.peers and len(cfg.peers) == 1:
            raise ConfigError(f"[peer] peers of {config.path or 'the config'} names only this daemon's own listen "
                              f"endpoint {cfg.listen}: list the other nodes' [peer] listen endpoints")
        server_curve, self.keys = daemon_curve(config)
        self.ctx = zmq.Context()
        self.holder = Holder(cfg.memory, cfg.stall)
        node_id = uuid.uuid4().hex  # this daemon, told apart from its peers (a peer list may name it)
        try:
            self.server = PeerServer(self.ctx, cfg.listen, config.root, self.holder, server_curve,
                                     cfg.frame + 65536, node_id)
        except Exception:
            self.ctx.term()
            raise
        self._curve = server_curve
        self.replicator = Replicator(self.ctx, config.root, cfg, self.keys, keep_last, node_id)
        self.cfg = cfg

    def start(self) -> None:
        self.server.start()
        self.replicator.start()
        log.info("peer tier: serving peers on %s (%s), holding up to %d MiB of their replicas; "
                 "replicating each commit to %d of %s", self.cfg.listen,
                 "CurveZMQ" if self.keys else "no encryption: [daemon] curve_secret_key is not set",
                 self.cfg.memory >> 20, self.cfg.replicas, ", ".join(self.replicator.peers) or "no peer")

    def close(self) -> None:
        self.replicator.close()
        self.server.close()
        if self._curve is not None:
            self._curve.close()
        self.ctx.term()

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Replication pauses while ``busy()`` (a step is being received or committed)."""
        self.replicator.busy = busy

    def committed(self, run: str, step: int, rank: int) -> None:
        self.replicator.enqueue(run, step, rank)

    def dropped(self, run: str, steps: list[int]) -> None:
        self.replicator.dropped(run, steps)

    def figures(self) -> dict[str, Any]:
        return {"listen": self.cfg.listen, "replicas": self.cfg.replicas, **self.holder.figures(),
                **self.replicator.figures()}
