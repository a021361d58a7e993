"""The readers' view of the peer tier (``ckptd.tiers.peer`` opens it; imported only with
``[peer]``: it imports ZeroMQ): which shares of a run the peers can serve
(from their memory, or their own disks), and fetching the ones this node's root
lacks into it.

With a ``[peer]`` table in the config found by the usual rule, ``ckptd.latest``
counts a step complete when every rank's share is in the local root or with some
peer, and ``ckptd.load`` / ``load_into`` first fill the local root with the shares
they read that it lacks: each from the first peer whose copy verifies (every tensor
against the manifest's checksum; a bad copy is logged and the next peer asked),
written through the durable path (data files fsynced, manifest last), so that the
local rules hold for it as for a share the daemon wrote, and once a node (a lock a
share). A reader asks each peer a small summary (``steps``), then the manifests it
lacks of the step it picked, one holder a rank (``manifests``: docs/tiers.md,
"Recovery"). Peers are asked all at once and given ``[peer] timeout``, together, to
answer; one that does not is not asked again for ``DEAD_S`` seconds, doubled while
it stays silent, up to ``DEAD_MAX_S`` (``SILENT``: a dead node costs a reader
``timeout`` once, whatever the number of dead nodes).
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import functools
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import zmq

from .. import index, layout
from ..config import Config, ConfigError
from ..transport.curve import client_keys
from ..durable import atomic_write, replacing, write_all
from ..errors import CheckpointCorrupt, CheckpointNotFound, ProtocolError
from ..manifest import CheckpointInfo, Checksum, Manifest, TensorRecord
from ..peer import messages
from ..peer.asking import ask_all
from ..peer.backoff import Backoff
from ..peer.holder import check_headers
from ..peer.pages import Prefault
from ..reader.files import bytes_of
from .local import NAME as ROOT
from .peer import NAME

log = logging.getLogger("ckptd.peer")

TIER = NAME
FETCH_THREADS = 4  # shares fetched at once into the root
# A tensor up to this size, read in plaintext from a peer's memory into new memory, comes in
# one message that becomes the tensor's own memory (no copy out of it: the bytes are moved
# once, by the kernel). Larger ones come in ``frame``-sized parts. At 100 Mbit/s such a
# message takes 5 s, within a default ``stall`` (10 s) that the receiver waits for it.
# Under CurveZMQ libzmq copies every message into buffers of its size on both ends (to
# encrypt, to decrypt): for messages this large those are new pages each time, and 512 MiB
# across a 10gbit link took 4.7-6.4 s against 3.6-4.6 s in 4 MiB parts (whose buffers the
# allocator reuses), so there a share always comes in parts.
WHOLE_MAX = 64 * 2**20
# Read in plaintext from a peer's memory into the caller's tensors (``load(out=)``), a tensor
# comes in parts of this size (below glibc's largest mmap threshold, 32 MiB, so that libzmq's
# buffer for each is reused memory, not new pages), each copied into place a slice of
# ``SLICE`` bytes at a time and the slice hashed at once, while it is in the CPU's cache.
INTO_PART = 16 * 2**20
SLICE = 2**20
STEPS_ASKED = 16  # newest steps each peer is asked about for ``latest`` (messages.MAX_STEPS_ANSWERED at most)
DEAD_S = 10.0  # a peer that did not answer is not asked again for this long, doubled while it stays silent
DEAD_MAX_S = 160.0  # ... up to this
LEARNT_S = 10.0  # what ``latest`` learnt of its step serves a ``find`` of that step this long
LOCK_WAIT_S = 600.0  # another process fetching the same share is waited for this long at most
SILENT = Backoff(DEAD_S, DEAD_MAX_S)  # the peers this process does not ask for now
_warned: set[str] = set()  # warnings already logged by this process
_learnt: dict[tuple[Any, ...], tuple[float, "Held"]] = {}  # (endpoints, base, run, step) -> (until, held)

Copy = tuple[str, str, Manifest]  # (endpoint, "memory" or "disk", the share's manifest)
Held = dict[tuple[int, int], list[Copy]]  # (step, rank) -> the peers that can serve it, memory first


@dataclass(frozen=True)
class Seen:
    """A share a peer says (``steps``) it can serve; its manifest is asked only if needed."""

    endpoint: str
    where: str  # "memory" or "disk"
    attempt: str | None
    world_size: int


Summary = dict[int, dict[int, list[Seen]]]  # step -> rank -> the peers that can serve it, memory first


def reader_keys(config: Config) -> Any:
    """A reader's CurveZMQ keys for the peers. With ``[peer] curve_peers`` (one key pair
    per node), this node's daemon key pair, dialing each peer with the key named for its
    endpoint: the peer port admits only the nodes' keys, never a producer's. Else (the
    nodes share one key pair) the ``[producer]`` keys where set, else the shared daemon
    key pair; none for plain TCP. ConfigError naming the key file this process cannot
    read, and what to do."""
    p, d = config.producer, config.daemon
    if config.peer.curve_peers or not (p.curve_server_key and p.curve_secret_key):
        if not d.curve_secret_key:
            return None
        from ..peer.keys import daemon_curve

        try:
            return daemon_curve(config)[1]
        except ConfigError as exc:
            raise ConfigError(
                f"cannot reach the peer tier with CurveZMQ: {exc}. A reader presents this node's daemon key "
                f"pair ([daemon] curve_secret_key {config.resolve_path(d.curve_secret_key)}): run it as the "
                "daemon's user, or make the key readable by the training processes' group (chgrp GROUP FILE; "
                "chmod 640 FILE; docs/security.md)") from None
    return client_keys(config.peer.listen, config)


class PeerTier:
    """The peers' memory (and their own roots), as a reader sees it: a ``Tier``
    (``ckptd.tiers.base``) whose steps are complete when every rank's share is in the
    local root or with some peer."""

    name = NAME
    where = "with its peers"
    durable = False  # memory: gone with the partners' daemons
    poll_interval = 0.2  # a list from every peer costs little
    unreachable: tuple[type[BaseException], ...] = ()  # a peer that does not answer is skipped, logged

    def __init__(self, config: Config, base: Path | None = None) -> None:
        self.config, self.cfg = config, config.peer
        self.base = base
        self.endpoints = list(dict.fromkeys([self.cfg.listen, *self.cfg.peers]))
        self.ctx: zmq.Context = zmq.Context.instance()

    @functools.cached_property
    def keys(self) -> Any:
        """Read when the peers are first asked: the chain is built by calls that never ask
        them (``list_checkpoints``), and a key that cannot be read is their error only."""
        return reader_keys(self.config)

    # -- the Tier interface ----------------------------------------------------------------
    def _base(self) -> Path:
        if self.base is None:
            raise ValueError("this PeerTier was opened without a root: pass base=")
        return self.base

    def list(self, run: str) -> builtins.list[CheckpointInfo]:
        """Nothing: ``list_checkpoints`` names the steps durable in the root or the bucket;
        the peers hold only the newest ones, for ``latest`` and loads."""
        return []

    def find(self, run: str, step: int) -> "PeerHolding | None":
        return self.source(run, step, self._base())

    def complete(self, run: str, step: int,
                 world_size: int | None) -> tuple[CheckpointInfo | None, Callable[[float], str]]:
        """For ``wait_complete(tier="peer")``: every rank's share in some peer's memory
        (the local root and the peers' disks do not count)."""
        nowhere = Path("/nonexistent")
        seen = self.summary(run, step).get(step, {})
        memory = {r: m for r, copies in seen.items() if (m := [c for c in copies if c.where == "memory"])}
        info = self.step_info(run, step, nowhere, self.resolve(run, step, nowhere, memory))
        have = sorted(memory)
        return info, lambda timeout: (
            f"step {step} of run {run!r} has no replica in a peer's memory for every rank after {timeout:g} s: "
            f"rank(s) {have or 'none'} have one (see `ckptd status`: peer.under_replicated, peer.down)")

    # -- asking the peers -------------------------------------------------------------------
    def _ask(self, requests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Send each endpoint its request, all at once, and collect the answers with one
        deadline (``timeout``) for all. A peer that does not answer is not asked again
        for ``DEAD_S`` seconds, doubled each time it stays silent (up to ``DEAD_MAX_S``),
        reset once it answers (``SILENT``): a dead node costs a reader ``timeout`` once, then
        rarely. A process that cannot read its keys asks nobody (one WARNING)."""
        try:
            keys = self.keys
        except ConfigError as exc:  # ``latest`` still answers from the local root (and the bucket)
            _warn_once(f"peer tier: not asked, it holds nothing for this process: {exc}")
            return {}
        links: dict[str, messages.Link] = {}
        for e in requests:
            if SILENT.skipped(e):
                log.info("peer tier: %s not asked: it did not answer; asked again in %.0f s", e, SILENT.left(e))
                continue
            try:
                links[e] = messages.Link(self.ctx, e, keys)
            except messages.PeerRefused as exc:  # no key file for this peer in curve_peers
                _warn_once(f"peer tier: {exc}; that peer is not asked")
        try:
            answers = ask_all(links, {e: requests[e] for e in links}, self.cfg.timeout)
        finally:
            for link in links.values():
                link.close()
        for e, answer in answers.items():
            if not isinstance(answer, messages.PeerDown):
                SILENT.answered(e)  # it answered, if only with an error
                if isinstance(answer, Exception):
                    log.info("peer tier: %s", answer)
                continue
            back_off = SILENT.failed(e)
            log.info("peer tier: %s did not answer within %g s; not asked for %g s", e, self.cfg.timeout, back_off)
        return {e: a for e, a in answers.items() if not isinstance(a, Exception)}

    def summary(self, run: str, step: int | None = None) -> Summary:
        """What the peers can serve of the newest ``STEPS_ASKED`` steps of ``run`` (or of
        ``step`` alone), from one small ``steps`` answer each: no manifest."""
        request: dict[str, Any] = {"op": "steps", "run": run, "limit": STEPS_ASKED if step is None else 1}
        if step is not None:
            request["step"] = step
        out: Summary = {}
        for e, answer in self._ask({e: request for e in self.endpoints}).items():
            try:
                for entry in _maps(messages.field(answer, "steps", list), "steps"):
                    s = messages.field(entry, "step", int)
                    for share in _maps(messages.field(entry, "shares", list), "shares"):
                        rank, world = messages.field(share, "rank", int), messages.field(share, "world_size", int)
                        attempt = share.get("attempt")
                        if step not in (None, s) or rank >= world or not isinstance(attempt, (str, type(None))):
                            raise ProtocolError(f"steps: share {share!r} of step {s} does not fit")
                        seen = Seen(e, str(share.get("where")), attempt, world)
                        out.setdefault(s, {}).setdefault(rank, []).append(seen)
            except ProtocolError as exc:
                log.warning("peer tier: %s answered a bad list of steps, not used: %s", e, exc)
                out = {s: {r: [c for c in v if c.endpoint != e] for r, v in ranks.items()} for s, ranks in out.items()}
        order = {e: i for i, e in enumerate(self.endpoints)}  # after memory, as configured: not as they answered
        for ranks in out.values():
            for copies in ranks.values():
                copies.sort(key=lambda c: (c.where != "memory", order[c.endpoint]))
        return out

    def _manifests(self, run: str, step: int, holders: dict[int, builtins.list[Seen]]) -> dict[int, builtins.list[Copy]]:
        """The manifest of each rank in ``holders``, asked of one holder a rank (the
        first, memory first; the next where that one fails), each checked to be the
        share the holder listed (run, step, rank, attempt, world size). rank -> the
        holders that agree, each with that manifest (their copies are the same share)."""
        got: dict[int, builtins.list[Copy]] = {}
        tried = dict.fromkeys(holders, 0)
        for _ in range(messages.MAX_STEPS_ANSWERED):  # rounds: a holder that keeps answering ``left`` ends too
            asked: dict[str, builtins.list[int]] = {}
            for r, hs in holders.items():
                if r not in got and tried[r] < len(hs):
                    asked.setdefault(hs[tried[r]].endpoint, []).append(r)
            if not asked:
                break
            answers = self._ask({e: {"op": "manifests", "run": run, "step": step, "ranks": ranks}
                                 for e, ranks in asked.items()})
            for e, ranks in asked.items():
                left = self._take(run, step, e, answers.get(e), {r: holders[r][tried[r]:] for r in ranks}, got)
                for r in ranks:
                    if r not in got and r not in left:
                        tried[r] += 1
        return got

    @staticmethod
    def _take(run: str, step: int, e: str, answer: dict[str, Any] | None, asked: dict[int, builtins.list[Seen]],
              got: dict[int, builtins.list[Copy]]) -> set[int]:
        """The manifests of one ``manifests`` answer into ``got`` (``asked``: rank -> the
        holders not yet tried, ``e`` first); the ranks it left out for its size (to be
        asked again)."""
        if answer is None:
            return set()
        try:
            entries = _maps(messages.field(answer, "manifests", list), "manifests")
            left = messages.field(answer, "left", list)
        except ProtocolError as exc:
            log.warning("peer tier: %s: %s", e, exc)
            return set()
        for entry in entries:
            rank = entry.get("rank")
            if not isinstance(rank, int) or rank not in asked or rank in got:
                continue
            seen, rest = asked[rank][0], asked[rank][1:]
            try:
                m = Manifest.from_json(messages.field(entry, "manifest", bytes), f"a manifest from {e}")
            except (CheckpointCorrupt, ProtocolError) as exc:
                log.warning("peer tier: %s", exc)
                continue
            if (m.run, m.step, m.rank, m.attempt, m.world_size) != (run, step, rank, seen.attempt, seen.world_size):
                log.warning("peer tier: %s sent a manifest of run %r step %d rank %d attempt %r of %d ranks for "
                            "the share it listed as run %r step %d rank %d attempt %r of %d; not used", e, m.run,
                            m.step, m.rank, m.attempt, m.world_size, run, step, rank, seen.attempt, seen.world_size)
                continue
            got[rank] = [(c.endpoint, c.where, m) for c in [seen, *rest]]  # one attempt, world size: one share
        return {r for r in left if isinstance(r, int)}

    # -- what the peers hold ---------------------------------------------------------------
    def resolve(self, run: str, step: int, path: Path, seen: dict[int, builtins.list[Seen]]) -> Held:
        """The copies of ``step``'s shares that ``path`` (the step's local folder) lacks,
        if the peers can complete it: each rank's manifest asked of one holder. The
        shares must be of one attempt and world size, and where the local root holds
        some of the step, of that attempt too. {} when the peers cannot complete it
        (then no manifest is asked)."""
        local = {r: m for r in _ranks(path) if (m := _read_share(path, r)) is not None}
        if local:
            first = next(iter(local.values()))
            groups = [(first.attempt, first.world_size)]
        else:  # the attempt most ranks are held of first
            count: dict[tuple[str | None, int], int] = {}
            for copies in seen.values():
                for key in {(c.attempt, c.world_size) for c in copies}:
                    count[key] = count.get(key, 0) + 1
            groups = sorted(count, key=lambda k: -count[k])
        for attempt, world in groups:
            need = [r for r in range(world) if not (r in local and (local[r].attempt, local[r].world_size)
                                                    == (attempt, world))]
            holders = {r: [c for c in seen.get(r, []) if (c.attempt, c.world_size) == (attempt, world)] for r in need}
            if not all(holders.values()):
                continue
            got = self._manifests(run, step, holders)
            if len(got) == len(need):
                return {(step, r): copies for r, copies in got.items()}
        return {}

    def holdings(self, run: str) -> Held:
        """(step, rank) -> [(endpoint, "memory" or "disk", manifest)], memory first, for
        the newest steps the peers list (``ckptd status`` and tests: a reader asks
        only for the step it needs, ``latest``/``find``)."""
        out: Held = {}
        for step, seen in self.summary(run).items():
            for rank, copies in self._manifests(run, step, seen).items():
                out[(step, rank)] = copies
        return out

    def latest(self, run: str, base: Path | None = None) -> CheckpointInfo | None:
        """The newest step whose every rank's share is in the local root or with a peer:
        one ``steps`` answer from each peer, then the manifests of the candidate's ranks
        the root lacks, from one holder each; a ``find`` of it that follows uses them."""
        base = self._base() if base is None else base
        seen = self.summary(run)
        run_dir = base / run
        local_steps = {s for s, _ in index.step_dirs(run_dir)} if run_dir.is_dir() else set()
        for step in sorted(set(seen) | local_steps, reverse=True):
            path = layout.step_dir(base, run, step)
            held = self.resolve(run, step, path, seen.get(step, {}))
            info = self.step_info(run, step, path, held)
            if info is not None and not info.refused:  # replicas that disagree under "refuse" (docs/training.md)
                now = time.monotonic()
                for key in [k for k, (until, _) in _learnt.items() if until <= now]:  # a latest no find followed
                    del _learnt[key]
                _learnt[self._key(base, run, step)] = (now + LEARNT_S, held)
                return info
        return None

    def _key(self, base: Path, run: str, step: int) -> tuple[Any, ...]:
        return tuple(self.endpoints), str(base), run, step

    def held(self, run: str, step: int, base: Path) -> Held:
        """The copies of ``step``'s shares the root at ``base`` lacks: what ``latest``
        learnt of it a moment ago, else asked of the peers for that step alone."""
        learnt = _learnt.pop(self._key(base, run, step), None)
        if learnt is not None and learnt[0] > time.monotonic():
            return learnt[1]
        path = layout.step_dir(base, run, step)
        return self.resolve(run, step, path, self.summary(run, step).get(step, {}))

    def step_info(self, run: str, step: int, path: Path, held: Held) -> CheckpointInfo | None:
        manifests, tiers = [], set()
        candidates = [m for (s, _), copies in held.items() if s == step for _, _, m in copies[:1]]
        local = {r: m for r in _ranks(path) if (m := _read_share(path, r)) is not None}
        world = next(iter(local.values()), None) or (candidates[0] if candidates else None)
        if world is None:
            return None
        for rank in range(world.world_size):
            if rank in local:
                manifests.append(local[rank])
                tiers.add(ROOT)
            elif (step, rank) in held:
                manifests.append(held[(step, rank)][0][2])
                tiers.add(TIER)
        try:
            complete = index.one_attempt(manifests, path)
        except CheckpointCorrupt:
            return None
        if complete is None:
            return None
        return CheckpointInfo.from_manifests(str(path), complete, tiers=tuple(t for t in (ROOT, TIER) if t in tiers))

    # -- fetching --------------------------------------------------------------------------
    def source(self, run: str, step: int, base: Path) -> "PeerHolding | None":
        """The step as local root and peers together hold it, if every rank's share is there."""
        path = layout.step_dir(base, run, step)
        held = self.held(run, step, base)
        info = self.step_info(run, step, path, held)
        if info is None:
            return None
        manifests = [_read_share(path, r) or held[(step, r)][0][2] for r in range(info.world_size)]
        return PeerHolding(self, run, step, base, held, manifests)  # type: ignore[arg-type]

    def fill(self, run: str, step: int, base: Path, held: Held | None = None,
             ranks: Iterable[int] | None = None) -> int:
        """Fetch the shares of ``ranks`` (None: every rank) of ``step`` that the local root
        lacks into it; how many were missing. CheckpointNotFound naming the ranks no peer
        served a good copy of."""
        path = layout.step_dir(base, run, step)
        held = self.held(run, step, base) if held is None else held
        info = self.step_info(run, step, path, held)
        if info is None:
            raise CheckpointNotFound(f"run {run!r} step {step} is no longer complete in the local root and with "
                                     "its peers; load another step (ckptd.latest)")
        wanted = range(info.world_size) if ranks is None else sorted(set(ranks))
        missing = [r for r in wanted if _read_share(path, r) is None]
        if len(missing) > 1:  # the ranks' partners differ (partners.order): a recovery fans in from several peers
            with ThreadPoolExecutor(min(len(missing), FETCH_THREADS), thread_name_prefix="ckptd-peer-fetch") as pool:
                list(pool.map(lambda r: self._fetch_one(run, step, r, base, held), missing))
        elif missing:
            self._fetch_one(run, step, missing[0], base, held)
        lacking = [r for r in missing if _read_share(path, r) is None]
        if lacking:
            raise CheckpointNotFound(f"run {run!r} step {step}: no peer served a good copy of rank(s) {lacking} "
                                     "(see the warnings above); load another step (ckptd.latest)")
        return len(missing)

    def _fetch_one(self, run: str, step: int, rank: int, base: Path, held: Held) -> None:
        """Rank ``rank``'s share from the first peer whose copy verifies, into the root;
        once a node: under a lock on the share, and not if another process of the node
        fetched it meanwhile."""
        path = layout.step_dir(base, run, step)
        layout.ensure_real_dir(path, base)
        with _share_lock(path, rank):
            if _read_share(path, rank) is not None:
                log.info("peer tier: run %r step %d rank %d is in the root: fetched by another process", run,
                         step, rank)
                return
            for endpoint, where, m in held.get((step, rank), []):
                try:
                    self.fetch_share(endpoint, m, base)
                except (CheckpointCorrupt, messages.PeerDown, messages.PeerRefused, ProtocolError) as exc:
                    log.warning("peer tier: run %r step %d rank %d from %s (%s) not used: %s; asking the next",
                                run, step, rank, endpoint, where, exc)
                    continue
                log.info("peer tier: run %r step %d rank %d fetched from %s (%s)", run, step, rank, endpoint, where)
                return

    def fetch_share(self, endpoint: str, m: Manifest, base: Path) -> None:
        """One share from one peer, checked, then written into ``base`` (data files, then
        the manifest). CheckpointCorrupt if a byte does not match."""
        files = {f: m.files.get(f) for f in sorted(set(m.files) | {t.file for t in m.tensors.values()})}
        if any(size is None for size in files.values()):
            raise CheckpointCorrupt("its manifest does not list its files' sizes")
        data = self.read_files(endpoint, m, files)  # type: ignore[arg-type]
        step_dir = layout.step_dir(base, m.run, m.step)
        layout.ensure_real_dir(step_dir, base)
        for file, buf in data.items():
            with replacing(step_dir / file) as tmp:
                tmp.unlink(missing_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                try:
                    write_all(fd, buf)
                finally:
                    os.close(fd)
        atomic_write(step_dir / layout.manifest_name(m.rank), m.to_json())

    def read_records(self, endpoint: str, m: Manifest, records: dict[str, TensorRecord],
                     into: dict[str, Any] | None = None, *, memory: bool = False) -> dict[str, Any]:
        """Tensors of ``m``'s share read from ``endpoint`` straight into their own memory
        (or into ``into``'s tensors of their names: ``load(out=)``), each checked against its
        checksum (CheckpointCorrupt if one does not match). ``memory``: the peer holds the
        share in memory, and serves a tensor of up to ``WHOLE_MAX`` bytes in one message,
        which becomes the tensor's memory (in plaintext)."""
        import torch

        bufs, ranges, fresh = {}, [], []
        for name, rec in records.items():
            if rec.offset is None:
                raise CheckpointCorrupt(f"tensor {name!r} is a chunked HDF5 dataset: not in the peer tier")
            spans = [(name, 0, rec.nbytes, rec.checksum)]
            if into is not None and name in into:
                part = INTO_PART if memory and self.keys is None else 0
                ranges.append(_Range(rec.file, rec.offset, bytes_of(into[name]), spans, part=part))
            elif memory and self.keys is None and 0 < rec.nbytes <= WHOLE_MAX:
                ranges.append(_Range(rec.file, rec.offset, None, spans, whole=rec.nbytes))
            else:
                bufs[name] = torch.empty(rec.nbytes, dtype=torch.uint8)
                fresh.append(memoryview(bufs[name].numpy()))  # type: ignore[arg-type]
                ranges.append(_Range(rec.file, rec.offset, fresh[-1], spans))
        self._read_ranges(endpoint, m, ranges, fresh)
        for r in ranges:
            if r.whole:  # the message's memory, kept alive by the tensor made over it
                bufs[r.spans[0][0]] = torch.frombuffer(r.view, dtype=torch.uint8)
        return {name: rec.as_tensor(bufs[name]) if name in bufs else into[name]  # type: ignore[index]
                for name, rec in records.items()}

    def read_files(self, endpoint: str, m: Manifest, sizes: dict[str, int]) -> dict[str, memoryview]:
        """The files of a share, read from ``endpoint`` and checked: every tensor against
        its checksum (as its bytes arrive) and each chunk file's header against the
        manifest. CheckpointCorrupt if one does not match."""
        where = f"run {m.run!r} step {m.step} rank {m.rank} from {endpoint}"
        import torch

        # torch.empty, not bytearray(n): no zero-filling pass over the pages before the bytes come
        out = {f: memoryview(torch.empty(n, dtype=torch.uint8).numpy()) for f, n in sizes.items()}  # type: ignore[arg-type]
        ranges = [_Range(file, 0, buf, _tensor_spans(m, file, len(buf))) for file, buf in out.items()]
        self._read_ranges(endpoint, m, ranges, list(out.values()))
        check_headers(m, out, where)
        return out

    def _read_ranges(self, endpoint: str, m: Manifest, ranges: builtins.list["_Range"],
                     fresh: builtins.list[memoryview]) -> None:
        """Fill each range's memory from ``endpoint``, in ``frame``-sized parts with
        ``window`` of them in flight, each received by libzmq straight into its place and
        its tensors' bytes hashed right after (while they are in the CPU's cache), the next
        part asked for first; CheckpointCorrupt as soon as a tensor's last byte is in and
        its checksum does not match. ``fresh``: memory allocated for this read, whose pages
        a thread faults in ahead of the bytes."""
        where = f"run {m.run!r} step {m.step} rank {m.rank} from {endpoint}"
        for r in ranges:
            r.check_empty(where)
        parts = ((r, off, min(r.part or self.cfg.frame, r.size - off)) for r in ranges
                 for off in range(0, r.size, r.part or self.cfg.frame))
        link = messages.Link(self.ctx, endpoint, self.keys, hwm=self.cfg.window * 2 + 4,
                         max_message=max(messages.MAX_HEADER_BYTES, WHOLE_MAX, self.cfg.frame))
        prefault = Prefault(fresh, self.cfg.frame)
        try:
            in_flight: deque[tuple[int, _Range, int, int]] = deque()

            def ask() -> None:
                part = next(parts, None)
                if part is not None:
                    r, off, n = part
                    req = {"op": "read", "run": m.run, "step": m.step, "rank": m.rank, "file": r.file,
                           "offset": r.offset + off, "length": n}
                    in_flight.append((link.send(req, timeout=self.cfg.stall), r, off, n))

            for _ in range(self.cfg.window):
                ask()
            while in_flight:
                rid, r, off, n = in_flight.popleft()
                if r.whole:
                    r.view = link.recv_bytes(rid, n, timeout=self.cfg.stall)
                elif r.part:
                    data = link.recv_bytes(rid, n, timeout=self.cfg.stall)
                    ask()  # the next part on its way before this one is copied and hashed
                    r.copy_in(off, data, where)
                    continue
                else:
                    link.recv_into(rid, r.view[off:off + n], timeout=self.cfg.stall)  # type: ignore[index]
                ask()  # the next part on its way before this one is hashed
                r.landed(off, off + n, where)
        finally:
            prefault.close()
            link.close()


class _Range:
    """Bytes of one file (from ``offset``) into ``view``, and the tensors among them:
    (name, start, end, checksum), relative to ``view``. Each tensor is hashed part by part
    as its bytes land, in order, and compared once its last byte is in. ``whole``: the
    range's size, read in one message whose memory becomes ``view`` (``view`` None until
    then); ``part``: the size of the parts it is read in, each copied into ``view``
    (``copy_in``; 0: ``frame``-sized parts received straight into ``view``)."""

    def __init__(self, file: str, offset: int, view: memoryview | None,
                 spans: builtins.list[tuple[str, int, int, str]], *, whole: int = 0, part: int = 0) -> None:
        self.file, self.offset, self.view, self.whole = file, offset, view, whole
        self.size = whole if view is None else len(view)
        self.part = whole or part
        self.spans = spans
        self._todo = deque(sorted(spans, key=lambda s: s[1]))
        self._open: builtins.list[tuple[str, int, int, str, Checksum]] = []

    def check_empty(self, where: str) -> None:
        """Tensors of no bytes: their checksum is the empty string's, compared now."""
        for name, start, end, want in [s for s in self._todo if s[1] == s[2]]:
            self._todo.remove((name, start, end, want))
            _compare(where, name, Checksum(), want)

    def copy_in(self, begin: int, data: memoryview, where: str) -> None:
        """``data`` into ``view`` from ``begin``, a ``SLICE`` at a time, each hashed at once."""
        for at in range(0, len(data), SLICE):
            n = min(SLICE, len(data) - at)
            self.view[begin + at:begin + at + n] = data[at:at + n]  # type: ignore[index]
            self.landed(begin + at, begin + at + n, where)

    def landed(self, begin: int, end: int, where: str) -> None:
        """Bytes ``begin``..``end`` of ``view`` are in (parts land in order)."""
        while self._todo and self._todo[0][1] < end:
            self._open.append((*self._todo.popleft(), Checksum()))
        for span in list(self._open):
            name, start, stop, want, h = span
            if max(begin, start) < min(end, stop):
                h.update(self.view[max(begin, start):min(end, stop)])  # type: ignore[index]
            if stop <= end:
                self._open.remove(span)
                _compare(where, name, h, want)


def _compare(where: str, name: str, h: Checksum, want: str) -> None:
    if h.text() != want:
        raise CheckpointCorrupt(f"{where}: tensor {name!r} does not match its checksum")


def _tensor_spans(m: Manifest, file: str, size: int) -> list[tuple[str, int, int, str]]:
    """The tensors ``file`` holds: (name, start, end, checksum) within it."""
    out = []
    for name, t in m.tensors.items():
        if t.file != file:
            continue
        if t.offset is None:
            raise CheckpointCorrupt(f"tensor {name!r} is a chunked (compressed) HDF5 dataset, whose bytes the peer "
                                    "tier cannot check")
        if t.offset + t.nbytes > size:
            raise CheckpointCorrupt(f"tensor {name!r} lies beyond the end of {file}")
        out.append((name, t.offset, t.offset + t.nbytes, t.checksum))
    return out


class PeerHolding:
    """A step that the local root and the peers hold together: ``ckptd.load`` reads a
    rank's tensors from here, straight into memory (no file written). A
    ``ckptd.tiers.base.Holding``."""

    url = "the peers' memory"
    fills_root = True  # loads that read local files (the whole state, mmap=True) fetch the peers' shares first
    reads_into = True  # load(out=): straight from a peer's memory into the caller's tensors

    def __init__(self, tier: PeerTier, run: str, step: int, base: Path,
                 held: dict[tuple[int, int], list[tuple[str, str, Manifest]]], manifests: list[Manifest]) -> None:
        self.tier, self.run, self.step, self.base = tier, run, step, base
        self.held = held
        self.manifests = manifests

    def fill(self, ranks: Iterable[int] | None = None) -> None:
        """Fetch the shares of ``ranks`` (None: every rank) the local root lacks into it,
        each once a node (several local ranks loading at once wait for one fetch)."""
        self.tier.fill(self.run, self.step, self.base, self.held, ranks)

    def read_tensors(self, manifest: Manifest, records: dict[str, TensorRecord],
                     local: Callable[[dict[str, TensorRecord]], dict[str, Any]],
                     into: dict[str, Any] | None = None) -> dict[str, Any]:
        """``records`` (of one rank's share, its replicated tensors included): those of
        shares in the local root through ``local``, the others from the first peer whose
        bytes match every checksum (into ``into``'s tensors where given: a bad copy's bytes
        are overwritten by the next peer's)."""
        path = layout.step_dir(self.base, self.run, self.step)
        by_writer: dict[int, dict[str, TensorRecord]] = {}
        for name, rec in records.items():
            by_writer.setdefault(layout.file_rank(rec.file), {})[name] = rec  # type: ignore[arg-type]
        out: dict[str, Any] = {}
        for writer, recs in by_writer.items():
            if _read_share(path, writer) is not None:
                out.update(local(recs))
                continue
            problems = []
            for endpoint, where, m in self.held.get((self.step, writer), []):
                try:
                    out.update(self.tier.read_records(endpoint, m, recs, into, memory=where == "memory"))
                    break
                except (CheckpointCorrupt, messages.PeerDown, messages.PeerRefused, ProtocolError) as exc:
                    log.warning("peer tier: run %r step %d rank %d from %s (%s) not used: %s; asking the next",
                                self.run, self.step, writer, endpoint, where, exc)
                    problems.append(f"{endpoint}: {exc}")
            else:
                raise CheckpointNotFound(f"run {self.run!r} step {self.step} rank {writer}: no peer served a "
                                         f"good copy ({'; '.join(problems) or 'none holds it now'})")
        return out


def _maps(value: builtins.list[Any], what: str) -> builtins.list[dict[str, Any]]:
    if not all(isinstance(v, dict) for v in value):
        raise ProtocolError(f"{what}: an entry is not a map")
    return value


@contextlib.contextmanager
def _share_lock(path: Path, rank: int) -> Iterator[None]:
    """Held while this process fetches rank ``rank``'s share into step folder ``path``:
    an flock on ``.fetch-rNNNNN.lock`` there (a name the index, retention and recovery
    leave alone: not a manifest, chunk or temp file). Its holder removes it before
    letting go, and a process that then finds the file it locked gone takes a new one,
    so none is left behind and no two hold it. Waited for ``LOCK_WAIT_S`` at most
    (nothing waits forever): then fetched without it (the durable path keeps it whole)."""
    name = path / f".fetch-r{rank:05d}.lock"
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("peer tier: %s is still locked after %g s; fetching without it", name,
                                    LOCK_WAIT_S)
                        yield
                        return
                    time.sleep(0.05)
            try:
                same = os.stat(name, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    name.unlink(missing_ok=True)  # while still locked: the next one in takes a new file
                return
        finally:
            os.close(fd)


def _warn_once(message: str) -> None:
    """A WARNING logged once a process: a reader polling the tier (``wait_complete``)
    would repeat it every poll."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _ranks(path: Path) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := layout.MANIFEST.fullmatch(n)))


def _read_share(path: Path, rank: int) -> Manifest | None:
    try:
        return index.read_share(path, rank)
    except (CheckpointCorrupt, OSError):
        return None
