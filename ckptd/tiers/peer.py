"""The peers' memory (``[peer]``, docs/tiers.md): daemons hold each other's newest
shares. This module is the daemon's part (``PeerTarget``; it imports ZeroMQ only when
one is made); the readers' is ``peer_reader``; the network service itself is ``ckptd.peer``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from .. import picks
from ..config import Config, ConfigError
from ..manifest import CheckpointInfo
from ..units import size

log = logging.getLogger("ckptd.peer")

NAME = "peer"
TABLE = "peer"


def open_target(config: Config, keep_last: Callable[[str], int],
                 on_complete: Callable[[str, list[CheckpointInfo]], None]) -> PeerTarget | None:
    """The daemon's part of the peer tier with ``[peer]``, else None. ``keep_last(run)``:
    the run's local retention (partners hold no more steps of it than that)."""
    return PeerTarget(config, keep_last) if config.peer.enabled else None


class PeerTarget:
    """The daemon's part: the holder of other nodes' replicas, the ``ckptd-peer-serve``
    thread that receives and serves them, and the ``ckptd-peer-send`` thread that
    replicates this node's commits (a ``ckptd.tiers.base.CopyTarget`` that ``Forgets``,
    ``Yields`` and ``Reports``)."""

    name = NAME

    def __init__(self, config: Config, keep_last: Callable[[str], int]) -> None:
        from ..peer.holder import Holder
        from ..peer.keys import daemon_curve
        from ..peer.copier import Copier
        from ..peer.port import PeerServer

        cfg = config.peer
        if cfg.listen in cfg.peers and len(cfg.peers) == 1:
            raise ConfigError(f"[peer] peers of {config.path or 'the config'} names only this daemon's own listen "
                              f"endpoint {cfg.listen}: list the other nodes' [peer] listen endpoints")
        server_curve, self.keys = daemon_curve(config)
        self.holder = Holder(cfg.memory, cfg.stall)
        node_id = uuid.uuid4().hex  # this daemon, told apart from its peers (a peer list may name it)
        self.server = PeerServer(cfg.listen, config.root, self.holder, server_curve, cfg.frame + 65536, node_id)
        self._curve = server_curve
        self.replicator = Copier(config.root, cfg, self.keys, keep_last, node_id, direct_io=config.daemon.direct_io)
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

    def committed(self, run: str, step: int, rank: int, nbytes: int, due: tuple[str, ...] | None) -> None:
        self.replicator.enqueue(run, step, rank, due)

    def pending(self, run: str) -> set[int]:
        """The steps the partners hold (or are sent) as the newest of a rank: local
        retention keeps them while steps not due for the peers come after them."""
        return self.replicator.held_steps(run)

    def dropped(self, run: str, steps: list[int]) -> None:
        """Partners drop their replicas of these steps."""
        self.replicator.dropped(run, steps)

    def yield_to(self, busy: Callable[[], bool]) -> None:
        """Replication pauses while ``busy()`` (a step is being received or committed)."""
        self.replicator.busy = busy

    def send_staged(self, find: Callable[[Any], Any], sent: Callable[[Any], None]) -> bool:
        """Shares go to the partners out of their producer's staging while ``find`` holds
        them (``ckptd.daemon.stagehold``); whether any partner is configured."""
        self.replicator.staged, self.replicator.on_sent = find, sent
        return bool(self.replicator.peers) and self.cfg.replicas > 0

    def serve_pulls(self, pull: Callable[..., bool]) -> None:
        self.server.pull = pull

    def on_persisted(self, callback: Callable[[str, int, int, float], None]) -> None:
        self.replicator.on_replicated = callback

    def figures(self) -> dict[str, Any]:
        return {"listen": self.cfg.listen, "replicas": self.cfg.replicas, **self.holder.figures(),
                **self.replicator.figures(), **self.server.figures()}


def status_lines(p: dict[str, Any]) -> list[str]:
    """The peer tier's lines of ``ckptd status``, from its figures (``PeerTarget.figures``)."""
    out = [f"peer:         {p['listen']}: holding {p['held_shares']} replica(s) of peers' shares "
           f"({size(p['held_bytes'])} of {size(p['memory'])}), {p['evicted']} evicted, {p['rejected']} rejected",
           f"              {p['under_replicated']} share(s) of this node under-replicated (of {p['replicas']} "
           f"replica(s) each); {p['replicated_shares']} sent ({size(p['replicated_bytes'])}, "
           f"{size(p.get('staged_bytes', 0))} of it from staging), "
           f"{p['failures']} failed, {p.get('replicas_lost', 0)} lost with their holder"] + picks.status_line(p)
    down = set(p.get("down", ()))
    backoff = p.get("backoff", {})
    for peer in p.get("peers", ()):
        state = "up"
        if peer in backoff:
            b = backoff[peer]
            state = (f"not answering ({b['failures']} time(s) in a row), skipped for {b['skipped_s']:.0f} s more"
                     if peer in down else f"not answering ({b['failures']} time(s) in a row), tried again next")
        out.append(f"  partner {peer}: {state}; holds {p.get('holding', {}).get(peer, 0)} of this node's newest shares")
    return out
