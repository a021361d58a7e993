"""The ``ckptd-peer-send`` thread: each share this daemon commits goes to the memory
of ``replicas`` partner daemons (``partners.of``: ``[peer] placement``), after the local commit and off
the training loop's path (the share's files are read back, from the page cache).

A transfer is an ``offer``, the files in ``frame``-sized parts with ``window`` of
them in flight, and ``done``. A partner that takes no part for ``stall`` seconds,
refuses, or is full is reported (log, ``ckptd status``, metrics) and the next peer
of the order takes the share; a partner that failed is skipped for ``heartbeat``
seconds. Only the newest share of each (run, rank) is worth a replica, the one
committed last (after a resume from an older step, the new attempt's): one still
queued when another commits is superseded. ``[peer] rate`` caps the bytes/s sent. A share no partner took stays
under-replicated and is tried again every ``heartbeat`` seconds while it is the
newest, sent only to partners that do not hold it yet.

Replication stays out of the next save's way: the thread runs at the lowest CPU
priority (nice 19, for itself alone), and before each part it pauses while the daemon
is receiving or committing a step (``busy``), for at most ``stall``/4 at a time, so
that its partner never gives up on a transfer that is only waiting its turn.

A replica can also be lost after it was taken: its holder dies, restarts (its memory
empty) or evicts it. Every ``heartbeat`` seconds each partner holding one of this
node's newest shares is asked which of them it still holds (``holds``, within
``timeout``); a share it no longer holds, or a partner that does not answer, counts
as a replica lost, and the share goes to the next peer of its order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import zmq

from .. import index, layout
from ..config import ConfigError, PeerConfig
from ..daemon import failpoints
from ..errors import CheckpointCorrupt, ProtocolError
from . import partners, supervise, wire

log = logging.getLogger("ckptd.peer")

Key = tuple[str, int, int]
YIELD_AFTER_S = 0.2  # the daemon idle this long after a step's messages: replication goes on


class Replicator:
    def __init__(self, ctx: zmq.Context, root: Path, config: PeerConfig, keys: Any,
                 keep_last: Callable[[str], int], node_id: str) -> None:
        if config.rate and config.frame / config.rate > config.stall / 2:
            raise ConfigError(f"[peer] rate {config.rate} bytes/s sends a frame of {config.frame} bytes in "
                              f"{config.frame / config.rate:.1f} s, and a partner gives a transfer up after "
                              f"{config.stall:g} s ([peer] stall) without a part: raise rate, or lower frame to at most "
                              f"{int(config.rate * config.stall / 2)} bytes")
        self.node_id = node_id  # this daemon's (PeerServer's): a peer that answers with it is this daemon
        self.ctx = ctx
        self.root = root
        self.cfg = config
        self.keys = keys
        self.keep_last = keep_last
        self.peers = tuple(p for p in config.peers if p != config.listen)
        self._cv = threading.Condition()
        self._queue: deque[Key] = deque()
        self._drops: deque[tuple[str, list[int]]] = deque()
        # the newest share of each (run, rank) committed here -> the partners holding it
        self._holders: dict[Key, set[str]] = {}
        self._newest: dict[tuple[str, int], int] = {}  # (run, rank) -> newest step committed
        self._checked = time.monotonic()  # when the holders were last asked
        self._down: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self._links: dict[str, wire.Link] = {}
        self._stop = False
        self.figures_ = {"replicated_shares": 0, "replicated_bytes": 0, "failures": 0, "send_seconds": 0.0,
                         "replicas_lost": 0}
        self.thread = threading.Thread(target=self._loop, name="ckptd-peer-send", daemon=True)
        self.busy: Callable[[], bool] = lambda: False  # the daemon is receiving or committing a step
        # (run, step, rank, seconds from local commit to held by `replicas` partners): the
        # peer tier's persist time for the interval advice (ckptd.daemon.measuring)
        self.on_replicated: Callable[[str, int, int, float], None] | None = None
        self._committed_at: dict[Key, float] = {}  # shares not yet fully replicated -> commit time
        self._busy_seen = 0.0
        self._paced_until = 0.0  # monotonic time by which the bytes sent so far are allowed ([peer] rate)

    # -- from other threads ----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join()

    def enqueue(self, run: str, step: int, rank: int) -> None:
        """After the local commit of a share (the syncer thread): replicate it."""
        with self._cv:
            # the last share committed of a (run, rank) is its newest, whatever its step: after a
            # resume from an older step (a new attempt) the new attempt's shares are what a recovery wants
            self._newest[(run, rank)] = step
            for k in [k for k in self._holders if k[0] == run and k[2] == rank and k[1] != step]:
                del self._holders[k]  # superseded
                self._committed_at.pop(k, None)
            self._holders[(run, step, rank)] = set()
            self._committed_at[(run, step, rank)] = time.time()
            self._queue.append((run, step, rank))
            self._cv.notify()

    def dropped(self, run: str, steps: list[int]) -> None:
        """Retention deleted ``steps`` of ``run`` here: partners drop their replicas."""
        with self._cv:
            for k in [k for k in self._holders if k[0] == run and k[1] in set(steps)]:
                del self._holders[k]
                self._committed_at.pop(k, None)
            self._drops.append((run, steps))
            self._cv.notify()

    def figures(self) -> dict[str, Any]:
        with self._cv:
            now = time.monotonic()
            holding: dict[str, int] = {p: 0 for p in self.peers}
            for peers in self._holders.values():
                for p in peers:
                    holding[p] = holding.get(p, 0) + 1
            return dict(self.figures_, thread_restarts=sum(supervise.restarts().values()),
                        rate=self.cfg.rate, under_replicated=len(self._under_replicated()), peers=list(self.peers),
                        down=sorted(p for p, t in self._down.items() if t > now), holding=holding)

    def _under_replicated(self) -> list[Key]:
        return [k for k, peers in self._holders.items() if len(peers) < self.cfg.replicas]

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        supervise.run(self.thread.name, self._run, lambda: self._stop)
        for link in self._links.values():
            link.close()

    def _run(self) -> None:
        try:  # this thread alone (Linux: a thread's own nice value); the daemon's others keep theirs
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError) as exc:
            log.debug("ckptd-peer-send keeps the daemon's priority: %s", exc)
        self._check_peers()
        while True:
            with self._cv:
                while not (self._stop or self._queue or self._drops or self._check_due()):
                    self._cv.wait(max(0.01, self._checked + self.cfg.heartbeat - time.monotonic()))
                if self._stop:
                    break
                drop = self._drops.popleft() if self._drops else None
                key = self._queue.popleft() if drop is None and self._queue else None
            try:
                if drop is not None:
                    self._send_drop(*drop)
                elif key is not None:
                    if key in self._under_replicated():
                        self._replicate(key)
                else:
                    self._check_holders()
            except Exception:  # a bug: reported, and the next share is still replicated
                log.exception("replicating %s failed", drop or key)

    def _check_due(self) -> bool:
        return time.monotonic() >= self._checked + self.cfg.heartbeat

    def _check_holders(self) -> None:
        """Ask each partner holding one of this node's newest shares which it still
        holds; forget the replicas of one that does not answer or no longer holds them,
        and queue every under-replicated share again (to the partners it lacks)."""
        self._checked = time.monotonic()
        with self._cv:
            by_peer: dict[str, list[Key]] = {}
            for key, peers in self._holders.items():
                for p in peers:
                    by_peer.setdefault(p, []).append(key)
        for peer, keys in by_peer.items():
            try:
                answer, _ = self._link(peer).request({"op": "holds", "shares": [list(k) for k in keys]},
                                                     timeout=self.cfg.timeout)
                held = wire.field(answer, "held", list)
                if len(held) != len(keys):
                    raise ProtocolError(f"{peer}: holds answered {len(held)} of {len(keys)} shares")
                lost = [k for k, h in zip(keys, held) if h is not True]
                why = "no longer holds them (restarted, or evicted them for newer steps)"
            except (wire.PeerDown, wire.PeerRefused, ProtocolError) as exc:
                self._forget(peer)
                self._down[peer] = time.monotonic() + self.cfg.heartbeat
                lost, why = keys, f"does not answer ({exc})"
            if not lost:
                continue
            with self._cv:
                for k in lost:
                    self._holders.get(k, set()).discard(peer)
                self.figures_["replicas_lost"] += len(lost)
            log.warning("peer %s held replicas of %d of this node's newest shares and %s: they go to the "
                        "next peers", peer, len(lost), why)
        with self._cv:
            self._queue.extend(k for k in self._under_replicated() if k not in self._queue)

    def _check_peers(self) -> None:
        """Say at start which peers cannot be reached, and drop any that is this daemon."""
        if self.cfg.listen in self.cfg.peers:
            log.warning("[peer] peers names this daemon's own listen endpoint %s; it is ignored (a share "
                        "needs a replica on another node)", self.cfg.listen)
        if not self.peers:
            log.warning("[peer] peers names no other daemon: nothing is replicated; list the other nodes' "
                        "[peer] listen endpoints")
        for p in list(self.peers):
            try:
                answer, _ = self._link(p).request({"op": "ping"}, timeout=self.cfg.timeout * 3)
            except (wire.PeerDown, wire.PeerRefused, ProtocolError) as exc:
                self._forget(p)
                log.warning("[peer] peer %s is unreachable at start (%s); shares go to the next peers until "
                            "it answers", p, exc)
                continue
            if answer.get("node") == self.node_id:
                self.peers = tuple(q for q in self.peers if q != p)
                log.warning("[peer] peer %s is this daemon itself; it is ignored", p)
            else:
                log.info("[peer] peer %s answers", p)

    def _link(self, peer: str) -> wire.Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = wire.Link(self.ctx, peer, self.keys, hwm=self.cfg.window * 2 + 4)
        return link

    def _forget(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    def _replicate(self, key: Key) -> None:
        run, step, rank = key
        failpoints.hit("peer.replicate")  # a node that dies between its commit and its replication (tests)
        with self._cv:
            if step != self._newest.get((run, rank), step):
                self._holders.pop(key, None)
                self._committed_at.pop(key, None)
                return
        step_path = layout.step_dir(self.root, run, step)
        try:
            m = index.read_share(step_path, rank)
            share = _Share.open(step_path, m) if m is not None else None
        except (CheckpointCorrupt, OSError) as exc:
            log.warning("cannot replicate run %r step %d rank %d: %s", run, step, rank, exc)
            share = None
        if share is not None and any(t.offset is None for t in m.tensors.values()):  # type: ignore[union-attr]
            share.close()
            share = None
            log.warning("run %r step %d rank %d is not replicated: it has chunked (compressed) HDF5 datasets, "
                        "whose bytes a holder cannot check (docs/tiers.md)", run, step, rank)
        if share is None:  # deleted meanwhile
            with self._cv:
                self._holders.pop(key, None)
                self._committed_at.pop(key, None)
            return
        try:
            self._to_partners(key, share)
        finally:
            share.close()

    def _to_partners(self, key: Key, share: "_Share") -> None:
        run, step, rank = key
        step_path = share.path
        manifest_json = layout.read_small(step_path / layout.manifest_name(rank), 64 * 2**20)
        with self._cv:
            have = set(self._holders.get(key, ()))
        want, done = self.cfg.replicas - len(have), 0
        now = time.monotonic()
        for peer in (p for p in partners.of(self.cfg, run, rank) if p in self.peers):
            if done >= want:
                break
            if self._down.get(peer, 0) > now or peer in have:  # a partner holding it already is not sent it again
                continue
            t0 = time.monotonic()
            try:
                self._send(peer, run, step, rank, manifest_json, share)
            except (wire.PeerDown, wire.PeerRefused, ProtocolError) as exc:
                self.figures_["failures"] += 1
                if not isinstance(exc, wire.PeerRefused):  # slow or dead: skipped for a while
                    self._down[peer] = time.monotonic() + self.cfg.heartbeat
                self._forget(peer)
                log.warning("peer %s did not take run %r step %d rank %d (%s); trying the next peer",
                            peer, run, step, rank, exc)
                continue
            done += 1
            with self._cv:
                if key in self._holders:
                    self._holders[key].add(peer)
            self.figures_["replicated_shares"] += 1
            self.figures_["replicated_bytes"] += sum(share.sizes.values())
            self.figures_["send_seconds"] += time.monotonic() - t0
            log.debug("run %r step %d rank %d replicated to %s", run, step, rank, peer)
        with self._cv:
            held = len(self._holders[key]) if key in self._holders else None
            first = self._committed_at.pop(key, None) if held is not None and held >= self.cfg.replicas else None
        if first is not None and self.on_replicated is not None:
            self.on_replicated(run, step, rank, max(0.0, time.time() - first))
        if held is not None and held < self.cfg.replicas:
            log.warning("run %r step %d rank %d has %d of %d replicas: no other peer took it "
                        "(under-replicated; retried every %g s)", run, step, rank, held, self.cfg.replicas,
                        self.cfg.heartbeat)

    def _yield(self) -> None:
        """Wait while the daemon is busy with a step (and a moment after: the gaps between
        a save's tensors), at most ``stall``/4."""
        deadline = time.monotonic() + self.cfg.stall / 4
        while time.monotonic() < deadline and not self._stop:
            now = time.monotonic()
            if self.busy():
                self._busy_seen = now
            elif now - self._busy_seen > YIELD_AFTER_S:
                return
            time.sleep(0.02)

    def _pace(self, n: int) -> None:
        """Hold ``n`` bytes back until ``[peer] rate`` lets them go (nothing without a rate):
        replication's sending stays under the cap, against training's own traffic."""
        if not self.cfg.rate:
            return
        now = time.monotonic()
        self._paced_until = max(self._paced_until, now - 1.0)  # an idle second banks at most one second
        wait = self._paced_until - now
        if wait > 0:
            time.sleep(wait)
        self._paced_until += n / self.cfg.rate

    def _send(self, peer: str, run: str, step: int, rank: int, manifest_json: bytes, share: "_Share") -> None:
        link, stall = self._link(peer), self.cfg.stall
        offer = {"op": "offer", "run": run, "step": step, "rank": rank, "manifest": manifest_json,
                 "files": share.sizes, "keep_last": self.keep_last(run)}
        answer, _ = link.request(offer, timeout=stall)
        xfer = wire.field(answer, "xfer", int)
        in_flight: deque[int] = deque()
        for file, size in share.sizes.items():
            for off in range(0, size, self.cfg.frame):
                if len(in_flight) >= self.cfg.window:
                    link.recv(in_flight.popleft(), timeout=stall)
                self._yield()
                data = share.read(file, off, self.cfg.frame)
                self._pace(len(data))
                part = {"op": "part", "xfer": xfer, "file": file, "offset": off}
                in_flight.append(link.send(part, data, timeout=stall))
        while in_flight:
            link.recv(in_flight.popleft(), timeout=stall)
        link.request({"op": "done", "xfer": xfer}, timeout=stall)

    def _send_drop(self, run: str, steps: list[int]) -> None:
        now = time.monotonic()
        for peer in self.peers:
            if self._down.get(peer, 0) > now:
                continue
            try:
                self._link(peer).request({"op": "drop", "run": run, "steps": steps}, timeout=self.cfg.timeout)
            except (wire.PeerDown, wire.PeerRefused, ProtocolError) as exc:
                self._forget(peer)
                log.debug("peer %s did not take a drop of run %r steps %s: %s", peer, run, steps, exc)


class _Share:
    """A committed share's data files, open for reading parts (from the page cache,
    just after the commit); the holder checks every byte against the manifest."""

    def __init__(self, path: Path, fds: dict[str, int]) -> None:
        self.path = path
        self.fds = fds
        self.sizes = {f: os.fstat(fd).st_size for f, fd in fds.items()}

    @classmethod
    def open(cls, path: Path, m: Any) -> "_Share | None":
        fds: dict[str, int] = {}
        dir_fd = layout.open_step_dir(path)
        try:
            for file in sorted(set(m.files) | {t.file for t in m.tensors.values()}):
                try:
                    fds[file] = layout.open_regular(file, dir_fd=dir_fd)
                except FileNotFoundError:
                    for fd in fds.values():
                        os.close(fd)
                    return None
        finally:
            os.close(dir_fd)
        return cls(path, fds)

    def read(self, file: str, offset: int, length: int) -> bytes:
        data = os.pread(self.fds[file], length, offset)
        if len(data) != min(length, self.sizes[file] - offset):
            raise CheckpointCorrupt(f"{self.path / file} shrank while being replicated")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
