"""The ``ckptd-peer-send`` thread: each share this daemon commits is copied to the memory
of ``replicas`` partners (``partners.of``), after the local commit, one
``sender.PartnerSender`` thread per partner. It decides who gets what: partners that
fail are backed off (``backoff``), the newest share of each (run, rank) is the one worth
a copy (an older one under way is cancelled rather than read from its files,
``_cancellable``), each heartbeat asks the partners which copies they still hold
(``holds``) and sends retention's deletions (``drop``). Start reading at ``Copier.enqueue``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable


from .. import index, layout, picks
from ..config import ConfigError, PeerConfig
from .. import failpoints
from ..errors import CheckpointCorrupt, ProtocolError
from . import messages, partners, supervise
from .asking import ask_all
from .backoff import CAP_HEARTBEATS, Backoff
from .sender import CANCELLED, DOWN, DROPPED, GONE, HELD, REFUSED, RETURNED, Job, Pacer, PartnerSender

log = logging.getLogger("ckptd.peer")

Key = tuple[str, int, int]


class Copier(supervise.Supervised):
    def __init__(self, root: Path, config: PeerConfig, keys: Any,
                 keep_last: Callable[[str], int], node_id: str, *, direct_io: bool = False) -> None:
        if config.rate and config.frame / config.rate > config.stall / 2:
            raise ConfigError(f"[peer] rate {config.rate} bytes/s sends a frame of {config.frame} bytes in "
                              f"{config.frame / config.rate:.1f} s, and a partner gives a transfer up after "
                              f"{config.stall:g} s ([peer] stall) without a part: raise rate, or lower frame to at most "
                              f"{int(config.rate * config.stall / 2)} bytes")
        self.node_id = node_id
        self.direct_io = direct_io
        self.root = root
        self.cfg = config
        self.keys = keys
        self.keep_last = keep_last
        self.peers = tuple(p for p in config.peers if p != config.listen)
        super().__init__("ckptd-peer-send")
        self._queue: deque[Key] = deque()
        self._drops: dict[str, set[int]] = {}
        # the newest share of each (run, rank) committed here -> the partners holding it
        self._holders: dict[Key, set[str]] = {}
        self._sending: dict[Key, set[str]] = {}
        self._tried: dict[Key, set[str]] = {}
        self._sent_to: dict[str, set[str]] = {}
        self._newest: dict[tuple[str, int], int] = {}
        self._cancelled: dict[tuple[str, int], int] = {}
        self._checked = time.monotonic()
        self._backoff = Backoff(config.heartbeat, config.heartbeat * CAP_HEARTBEATS)
        self._links: dict[str, messages.Link] = {}
        self._senders: dict[str, PartnerSender] = {}
        self._pacer = Pacer(config.rate)
        self.figures_ = {"replicated_shares": 0, "replicated_bytes": 0, "failures": 0, "send_seconds": 0.0,
                         "replicas_lost": 0, "drop_messages": 0, "dropped_steps": 0, "staged_bytes": 0,
                         "file_bytes_read": 0, "cancelled_transfers": 0}
        self.busy: Callable[[], bool] = lambda: False
        # (run, step, rank, seconds from local commit to held by `replicas` partners): the
        # peer tier's persist time for the interval advice (ckptd.daemon.measuring)
        self.on_replicated: Callable[[str, int, int, float], None] | None = None
        self._committed_at: dict[Key, float] = {}
        self._versions: dict[str, Any] = {}
        self.staged: Callable[[Key], Any] = lambda key: None
        self.on_sent: Callable[[Key], None] = lambda key: None
        self.picks = picks.Picks("peer")

    # -- from other threads ----------------------------------------------------------------
    def close(self) -> None:
        super().close()
        for sender in list(self._senders.values()):
            sender.close()

    def enqueue(self, run: str, step: int, rank: int, due: tuple[str, ...] | None = None) -> None:
        """After the local commit of a share (the syncer thread): replicate it, if its
        step is due for the peers (``ckptd.picks``; else the partners keep the one before)."""
        with self._cv:
            if not self.picks.decide(run, step, due, any(k[0] == run and k[2] == rank for k in self._holders)):
                return
            # the last share committed of a (run, rank) is its newest, whatever its step: after a
            # resume from an older step (a new attempt) the new attempt's shares are what a recovery wants
            self._newest[(run, rank)] = step
            for k in [k for k in self._holders if k[0] == run and k[2] == rank and k[1] != step]:
                self._forget_share(k)
            self._holders[(run, step, rank)] = set()
            self._committed_at[(run, step, rank)] = time.time()
            self._queue.append((run, step, rank))
            self._cv.notify()

    def dropped(self, run: str, steps: list[int]) -> None:
        """Retention deleted ``steps`` of ``run`` here: partners drop their replicas (at
        the next heartbeat, with every other step deleted meanwhile)."""
        with self._cv:
            gone = set(steps)
            for k in [k for k in self._holders if k[0] == run and k[1] in gone]:
                self._forget_share(k)
            self._drops.setdefault(run, set()).update(gone)

    def held_steps(self, run: str) -> set[int]:
        """The steps of ``run`` whose shares the partners hold (or are sent) as their rank's newest."""
        with self._cv:
            return {k[1] for k in self._holders if k[0] == run}

    def figures(self) -> dict[str, Any]:
        with self._cv:
            holding: dict[str, int] = {p: 0 for p in self.peers}
            for peers in self._holders.values():
                for p in peers:
                    holding[p] = holding.get(p, 0) + 1
            return dict(self.figures_, thread_restarts=sum(supervise.restarts().values()),
                        rate=self.cfg.rate, under_replicated=len(self._under_replicated()), peers=list(self.peers),
                        holding=holding, sending=sum(len(p) for p in self._sending.values()),
                        peer_versions=dict(self._versions), protocol_version=messages.VERSION,
                        **self._backoff.figures(), **self.picks.figures())

    def _under_replicated(self) -> list[Key]:
        return [k for k, peers in self._holders.items() if len(peers) < self.cfg.replicas]

    def _forget_share(self, key: Key) -> None:
        """No copy of ``key`` is wanted any more (superseded, deleted); the lock held."""
        self._holders.pop(key, None)
        self._committed_at.pop(key, None)
        self._tried.pop(key, None)
        if key not in self._sending:  # else once its transfers end (``_done``)
            self.on_sent(key)

    # -- the thread ------------------------------------------------------------------------
    def _closing(self) -> None:
        for link in self._links.values():
            link.close()

    def _run(self) -> None:
        self._check_peers()
        while True:
            with self._cv:
                while not (self._stop or self._queue or self._check_due()):
                    self._cv.wait(max(0.01, self._checked + self.cfg.heartbeat - time.monotonic()))
                if self._stop:
                    break
                # the heartbeat's checks first when due: a long queue never holds them off
                key = self._queue.popleft() if self._queue and not self._check_due() else None
            try:
                if key is not None:
                    self._assign(key)
                else:
                    self._checked = time.monotonic()
                    self._send_drops()
                    self._probe()
                    self._check_holders()
            except Exception:  # a bug: reported, and the next share is still copied
                log.exception("replicating %s failed", key or "(the heartbeat's checks)")

    def _check_due(self) -> bool:
        return time.monotonic() >= self._checked + self.cfg.heartbeat

    def _assign(self, key: Key) -> None:
        """Give ``key`` to as many partners as it lacks, the first of its order that are
        neither holding it, nor sending it, nor failed it this round, nor backed off."""
        run, step, rank = key
        with self._cv:
            if key not in self._holders:
                return
            have, sending = self._holders[key], self._sending.get(key, set())
            want = self.cfg.replicas - len(have) - len(sending)
            skip = have | sending | self._tried.get(key, set())
            candidates = [p for p in partners.of(self.cfg, run, rank)
                          if p in self.peers and p not in skip and not self._backoff.skipped(p)][:max(want, 0)]
            held = len(have)
        if want <= 0:
            return
        if not candidates:
            if not sending:
                log.warning("run %r step %d rank %d has %d of %d replicas: no other peer took it "
                            "(under-replicated; retried every %g s)", run, step, rank, held, self.cfg.replicas,
                            self.cfg.heartbeat)
            return
        failpoints.hit("peer.replicate")
        job = self._job(key)
        with self._cv:
            if job is None:
                self._forget_share(key)
                return
            if key not in self._holders:
                return
            for peer in candidates:
                self._sending.setdefault(key, set()).add(peer)
                self._sender(peer).put(job)

    def _job(self, key: Key) -> Job | None:
        """``key``'s manifest as committed here, or None (and why) if it cannot be sent."""
        run, step, rank = key
        step_path = layout.step_dir(self.root, run, step)
        try:
            m = index.read_share(step_path, rank)
            data = layout.read_small(step_path / layout.manifest_name(rank), 64 * 2**20) if m is not None else b""
        except (CheckpointCorrupt, OSError) as exc:
            log.warning("cannot replicate run %r step %d rank %d: %s", run, step, rank, exc)
            return None
        if m is None:
            return None
        if any(t.offset is None for t in m.tensors.values()):
            log.warning("run %r step %d rank %d is not replicated: it has chunked (compressed) HDF5 datasets, "
                        "whose bytes a holder cannot check (docs/tiers.md)", run, step, rank)
            return None
        return Job(key, m, data, self.keep_last(run))

    def _sender(self, peer: str) -> PartnerSender:
        sender = self._senders.get(peer)
        if sender is None:
            sender = self._senders[peer] = PartnerSender(
                len(self._senders) + 1, peer, self.keys, self.cfg, self.root, self._pacer,
                lambda: self.busy(), self._wanted, self._done, direct_io=self.direct_io,
                staged=lambda key: self.staged(key), count=self._count, cancellable=self._cancellable)
            sender.start()
        return sender

    def _count(self, staged: int, read: int) -> None:
        """A transfer's bytes: sent from staging, and read from the files."""
        with self._cv:
            self.figures_["staged_bytes"] += staged
            self.figures_["file_bytes_read"] += read

    def _wanted(self, key: Key) -> bool:
        with self._cv:
            return key in self._holders and not self._stop

    def _cancellable(self, key: Key) -> bool:
        """Whether a transfer of ``key`` under way, whose next part would be read from its
        files, is given up: only when no copy of it is wanted any more (a newer share of
        its rank was committed, or retention deleted it), and never twice in a row for a
        rank (``_cancelled``: (run, rank) -> the step cancelled). So the transfer after a cancelled one runs to its end, whatever supersedes
        it: the partners fall at most one share behind, and meanwhile keep the rank's
        newest copy they hold (``holder._protected``) for a recovery."""
        with self._cv:
            if key in self._holders:
                return False
            step = self._cancelled.get((key[0], key[2]))
            return step is None or step == key[1]

    def _done(self, peer: str, job: Job, outcome: str, nbytes: int, seconds: float) -> None:
        """A partner's thread ended a job (``sender``'s outcomes)."""
        key = job.key
        replicated = None
        with self._cv:
            sending = self._sending.get(key)
            if sending is not None:
                sending.discard(peer)
                if not sending:
                    del self._sending[key]
                    if key not in self._holders:
                        self.on_sent(key)
            if outcome in (HELD, REFUSED, DOWN):
                self._sent_to.setdefault(key[0], set()).add(peer)
                self.figures_["send_seconds"] += seconds
            if outcome == HELD:
                if self._cancelled.get((key[0], key[2]), key[1]) < key[1]:
                    del self._cancelled[(key[0], key[2])]
                self._backoff.answered(peer)
                self.figures_["replicated_shares"] += 1
                self.figures_["replicated_bytes"] += nbytes
                if key in self._holders:
                    self._holders[key].add(peer)
                    if len(self._holders[key]) >= self.cfg.replicas:
                        replicated = self._committed_at.pop(key, None)
                        self.on_sent(key)
                elif not layout.step_dir(self.root, key[0], key[1]).exists():
                    # retention deleted the step while it was being sent (its drop may have gone
                    # before the partner held it): the partner drops it at the next heartbeat
                    self._drops.setdefault(key[0], set()).add(key[1])
                log.debug("run %r step %d rank %d replicated to %s", *key, peer)
            elif outcome in (REFUSED, DOWN, RETURNED):
                if outcome != RETURNED:
                    self.figures_["failures"] += 1
                    self._tried.setdefault(key, set()).add(peer)
                if outcome == DOWN:
                    self._backoff.failed(peer)
                if key in self._holders and not self._stop:
                    self._queue.append(key)
                    self._cv.notify()
            elif outcome == GONE:
                self._forget_share(key)
            elif outcome == CANCELLED:
                self._cancelled[(key[0], key[2])] = key[1]
                self.figures_["cancelled_transfers"] += 1
            else:
                assert outcome == DROPPED, outcome
        if replicated is not None and self.on_replicated is not None:
            self.on_replicated(*key, max(0.0, time.time() - replicated))

    def _control(self, peer: str) -> messages.Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = messages.Link(peer, self.keys)
        return link

    def _ask(self, requests: dict[str, dict[str, Any]], timeout: float) -> dict[str, dict[str, Any] | Exception]:
        """``ask_all`` on this thread's links; a peer without an answer gets a new link
        (no stale answer is ever read as a later one's)."""
        links: dict[str, messages.Link] = {}
        answers: dict[str, dict[str, Any] | Exception] = {}
        for peer in requests:
            try:
                links[peer] = self._control(peer)
            except messages.PeerRefused as exc:
                answers[peer] = exc
        answers.update(ask_all(links, {p: r for p, r in requests.items() if p in links}, timeout))
        for peer, asked in links.items():
            self._note_version(peer, asked.version, answers.get(peer))
        for peer, answer in answers.items():
            if isinstance(answer, Exception):
                link = self._links.pop(peer, None)
                if link is not None:
                    link.close()
        return answers

    def _note_version(self, peer: str, version: int | None, answer: Any) -> None:
        """Name a peer of another protocol version in the log and ``status`` (``peer_versions``)."""
        if isinstance(answer, messages.PeerVersion):
            seen: Any = f"newer than {messages.VERSION}"
        elif version is not None and version != messages.VERSION:
            seen = version
        else:
            self._versions.pop(peer, None)
            return
        if self._versions.get(peer) != seen:
            log.warning("peer %s speaks peer protocol version %s, this node %d (docs/runbook.md: upgrading a "
                        "cluster)%s", peer, seen, messages.VERSION, f": {answer}" if isinstance(answer, Exception)
                        else "")
        self._versions[peer] = seen

    def _check_holders(self) -> None:
        """Ask the partners holding this node's newest shares, all at once, which they
        still hold; forget the replicas of one that does not answer or no longer holds
        them, and queue every under-replicated share again (to the partners it lacks)."""
        with self._cv:
            by_peer: dict[str, list[Key]] = {}
            for key, peers in self._holders.items():
                for p in peers:
                    by_peer.setdefault(p, []).append(key)
            self._tried.clear()
        requests = {p: {"op": "holds", "shares": [list(k) for k in keys[:messages.MAX_SHARES_ASKED]]}
                    for p, keys in by_peer.items()}
        for peer, answer in self._ask(requests, self.cfg.timeout).items():
            keys = by_peer[peer][:messages.MAX_SHARES_ASKED]
            try:
                if isinstance(answer, Exception):
                    raise answer
                held = messages.field(answer, "held", list)
                if len(held) != len(keys):
                    raise ProtocolError(f"{peer}: holds answered {len(held)} of {len(keys)} shares")
                lost = [k for k, h in zip(keys, held) if h is not True]
                why = "no longer holds them (restarted, or evicted them for newer steps)"
                with self._cv:
                    self._backoff.answered(peer)
            except messages.PeerVersion:
                continue
            except (messages.PeerDown, messages.PeerRefused, ProtocolError) as exc:
                with self._cv:
                    skip = self._backoff.failed(peer)
                lost, why = keys, f"does not answer ({exc}; skipped for {skip:g} s)"
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

    def _probe(self) -> None:
        """Ping, all at once, the partners that failed and whose back-off has run out
        (none that a share is on its way to: its transfer tells): one that answers is
        tried again at once, one that does not is skipped twice as long, so that
        ``ckptd status`` says which are back even while no share needs them."""
        with self._cv:
            busy = set().union(*self._sending.values())
            due = [p for p in self._backoff.due() if p not in busy]
        for peer, answer in self._ask({p: {"op": "ping"} for p in due}, self.cfg.timeout).items():
            with self._cv:
                if isinstance(answer, Exception):
                    self._backoff.failed(peer)
                else:
                    self._backoff.answered(peer)
                    log.info("peer %s answers again", peer)

    def _send_drops(self) -> None:
        """Every step retention deleted since the last heartbeat, to the partners that
        were sent replicas of its run: one message per partner (split at
        ``messages.MAX_STEPS_DROPPED`` steps), all sent at once, answered within one
        ``timeout``; a partner backed off is not asked (its replicas go by its own
        ``keep_last`` and budget)."""
        with self._cv:
            drops, self._drops = self._drops, {}
            per_peer: dict[str, list[dict[str, list[int]]]] = {}
            for run in sorted(drops):
                for peer in sorted(self._sent_to.get(run, ())):
                    if not self._backoff.skipped(peer):
                        _add_steps(per_peer.setdefault(peer, [{}]), run, sorted(drops[run]))
        while per_peer:
            requests: dict[str, dict[str, Any]] = {p: {"op": "drop", "runs": batches.pop(0)}
                                                   for p, batches in per_peer.items()}
            per_peer = {p: b for p, b in per_peer.items() if b}
            answers = self._ask(requests, self.cfg.timeout)
            with self._cv:
                self.figures_["drop_messages"] += len(requests)
                self.figures_["dropped_steps"] += sum(len(s) for r in requests.values() for s in r["runs"].values())
                for peer, answer in answers.items():
                    if isinstance(answer, Exception):
                        log.info("peer %s did not take a drop of %d run(s)' deleted steps: %s (it forgets them "
                                 "by its own keep_last and budget)", peer, len(requests[peer]["runs"]), answer)
                        per_peer.pop(peer, None)
                    else:
                        self._backoff.answered(peer)

    def _check_peers(self) -> None:
        """Say at start which peers cannot be reached, and drop any that is this daemon."""
        if self.cfg.listen in self.cfg.peers:
            log.warning("[peer] peers names this daemon's own listen endpoint %s; it is ignored (a share "
                        "needs a copy on another node)", self.cfg.listen)
        if not self.peers:
            log.warning("[peer] peers names no other daemon: nothing is replicated; list the other nodes' "
                        "[peer] listen endpoints")
        answers = self._ask({p: {"op": "ping"} for p in self.peers}, self.cfg.timeout * 3)
        for p, answer in answers.items():
            if isinstance(answer, Exception):
                log.warning("[peer] peer %s is unreachable at start (%s); shares go to the next peers until "
                            "it answers", p, answer)
            elif answer.get("node") == self.node_id:
                self.peers = tuple(q for q in self.peers if q != p)
                log.warning("[peer] peer %s is this daemon itself; it is ignored", p)
            else:
                log.info("[peer] peer %s answers", p)


def _add_steps(batches: list[dict[str, list[int]]], run: str, steps: list[int]) -> None:
    """Add ``steps`` of ``run`` to the last of ``batches``, starting a new batch each
    time one reaches ``messages.MAX_STEPS_DROPPED`` steps."""
    while steps:
        room = messages.MAX_STEPS_DROPPED - sum(len(s) for s in batches[-1].values())
        if room <= 0:
            batches.append({})
            continue
        batches[-1].setdefault(run, []).extend(steps[:room])
        steps = steps[room:]
