"""A producer's connection to its daemon (``Connection``): hello and welcome, replies,
reconnect, bye.

``ensure()`` says hello on first use and after the daemon was lost, and raises
``CheckpointError`` with what to do when none answers; every message gets its ``seq``
here. The sender thread hands each reply to ``_on_reply`` (acks free staging, commits
resolve handles, answers wake ``ask``) and calls ``_on_lost``: every step in flight fails.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import config as config_mod
from ..transport import curve, handoff, unixsock, wire
from .. import env
from ..attempt import current as current_attempt
from ..errors import CheckpointError
from ..manifest import CheckpointInfo
from ..names import check_rank, check_run
from .batch import Batcher
from .copies import Copier
from .frozen import Frozen
from .staging import Region
from .steps import CommitHandle, StepBook
from .transport import Transport

log = logging.getLogger("ckptd.producer")


@dataclass(frozen=True)
class Identity:
    """Who a producer is to its daemon: what its hello says, and where it goes.

    ``local_rank``: the launcher's node-local identity: information only
    ``retention``: this run's own [retention] keys, applied by the daemon
    ``format``: this run's storage format; None: the daemon's [daemon] format
    ``attempt``: this launch among restarts (ckptd.attempt)
    ``curve_keys``: tcp:// only
    ``serve_config``: the config that starts a daemon at this endpoint, for "start one with ..."
        hints"""

    endpoint: str
    run: str | None
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    retention: dict[str, Any] | None
    format: str | None
    attempt: str | None
    curve_keys: curve.ClientKeys | None
    serve_config: Path | None


def identify(cfg: config_mod.Config, options: config_mod.ProducerConfig, given: dict[str, Any],
             endpoint: str | None, run: str | None, rank: int | None, world_size: int | None,
             retention: dict[str, Any] | None, format: str | None) -> Identity:
    """Who a producer is, from its arguments (``given``: the options it was passed),
    else the environment, else the config file; ValueError naming what is wrong."""
    if endpoint is None:
        endpoint = env.endpoint()
    endpoint = config_mod.resolve_endpoint(endpoint, Path.cwd()) if endpoint else cfg.endpoint
    curve_keys = curve.client_keys(endpoint, cfg, given)
    serve_config = cfg.path if cfg.path is not None and endpoint == cfg.endpoint else None
    run = run if run is not None else env.run()
    run = check_run(run) if run is not None else None
    env_rank, env_world = env.rank(), env.world_size()
    rank = rank if rank is not None else 0 if env_rank is None else env_rank
    world_size = world_size if world_size is not None else 1 if env_world is None else env_world
    rank, world_size = check_rank(rank, world_size)
    # each node's ranks reach their own node's daemon through its endpoint: information only
    local_rank, local_world_size = env.local_rank(), env.local_world_size()
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    if retention is not None:
        from ..retention import merge

        merge(cfg.retention, retention, "Producer(retention=...)")
    if format is not None and format not in config_mod.FORMATS:
        raise ValueError(f"format={format!r}: use one of {', '.join(map(repr, config_mod.FORMATS))}, "
                         "or None for the daemon's [daemon] format")
    attempt = current_attempt(options.attempt, world_size, env.elastic())
    return Identity(endpoint, run, rank, world_size, local_rank, local_world_size, retention, format, attempt,
                    curve_keys, serve_config)


class Connection:
    """The daemon connection of one producer, across the daemon's restarts.

    ``emit_lock`` is the producer's: one emit at a time, so that staging regions go
    out in the order they were taken. ``ensure`` and the ``send_*`` methods that
    carry staging run under it; ``send`` and ``ask`` may run on any thread."""

    def __init__(self, who: Identity, options: config_mod.ProducerConfig, copier: Copier, book: StepBook,
                 frozen: Frozen, emit_lock: threading.Lock) -> None:
        self.who = who
        self._options = options
        self._copier = copier
        self._book = book
        self._frozen = frozen
        self._emit_lock = emit_lock
        self._lock = threading.Lock()  # seq numbers and queries, from any thread
        self._seq = 0
        self._queries: dict[int, list[Any]] = {}
        self.transport: Transport | None = None
        self._welcome: threading.Event | None = None
        self._hello_error: str | None = None
        self.max_frame = 0
        self.shm = False
        self.batcher: Batcher | None = None
        self._batches = False
        self.advice: dict[str, Any] | None = None
        self.closed = False
        self._connector: threading.Thread | None = None

    @property
    def live(self) -> bool:
        """Connected, and the daemon not lost."""
        return self.transport is not None and self.transport.lost is None

    def need_run(self) -> str:
        if self.who.run is None:
            raise ValueError("no run id: pass run= to configure() / Producer(), or set CKPTD_RUN")
        return self.who.run

    def start(self) -> None:
        """Find the daemon now, not at the first checkpoint hours in (on_no_daemon)."""
        if self.who.run is None:
            return
        if self._options.on_no_daemon == "raise":
            with self._emit_lock:
                self.ensure()
        else:
            self._connector = threading.Thread(target=self._connect_early, name="ckptd-connect", daemon=True)
            self._connector.start()

    def wait_started(self, timeout: float | None = None) -> None:
        """Until the background connect of ``start`` is done."""
        if self._connector is not None:
            self._connector.join(timeout)

    def _connect_early(self) -> None:
        """At start, in the background: connect, or warn that no daemon answers."""
        try:
            with self._emit_lock:
                if not self.closed:
                    self.ensure()
        except CheckpointError as exc:
            message = (f"ckptd: {exc}. Until that is mended, checkpoints of run {self.who.run!r} fail "
                       "(set [producer] on_no_daemon = \"raise\" to fail at start instead)")
            log.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # never let the thread die silently
            log.exception("ckptd producer: connecting to the daemon failed")

    def _start_hint(self) -> str:
        if self.who.serve_config is not None:
            return f"start one with `ckptd serve -c {self.who.serve_config}`, or point CKPTD_ENDPOINT at a running one"
        return (f"start one whose [daemon] endpoint is {self.who.endpoint} (`ckptd serve -c CONFIG`), "
                "or point CKPTD_CONFIG at a running one's config (the system service's: /etc/ckptd/config.toml) "
                "or CKPTD_ENDPOINT at its endpoint")

    def ensure(self) -> None:
        """Connected: say hello now if there is no connection or the daemon was lost."""
        if self.closed:
            raise CheckpointError("this producer is closed; make a new one (ckptd.Producer(...), or "
                                  "producer.configure(...) for the module-level producer)")
        if self.transport is not None and self.transport.lost is None:
            return
        who, endpoint, timeout = self.who, self.who.endpoint, self._options.timeout
        run = self.need_run()
        arena = self._copier.ready()
        old, self.transport = self.transport, None
        self._frozen.forget()
        if self.batcher is not None:
            self.batcher.drop()
            self.batcher = None
        if old is not None:
            old.close()
            if old.lost is not None and endpoint.startswith("ipc://") and not unixsock.in_use(endpoint[len("ipc://"):]):
                # it stopped or died, and nobody took its place: say so now, not a timeout later
                raise CheckpointError(f"{old.lost}, and no daemon listens there now; {self._start_hint()}")
        arena.reset()
        self._welcome = threading.Event()
        self._hello_error = None
        token = self._offer_arena()
        self.shm = False
        transport = Transport(endpoint, timeout=timeout, heartbeat=self._options.heartbeat,
                              on_reply=self._on_reply, on_lost=self._on_lost, curve_keys=who.curve_keys)
        transport.send(wire.encode("hello", v=wire.VERSION, run=run, rank=who.rank,
                                   world_size=who.world_size, pid=os.getpid(), host=socket.gethostname(),
                                   retention=who.retention, format=who.format, shm_token=token,
                                   shm_size=arena.capacity if token else None, attempt=who.attempt))
        if not self._welcome.wait(timeout) or self._hello_error or transport.lost:
            transport.close(linger=False)
            if self._hello_error:
                raise CheckpointError(f"the daemon at {endpoint} refused this producer: {self._hello_error}")
            if transport.refused or transport.stopped:
                raise CheckpointError(transport.lost)
            hint = self._start_hint()
            if who.curve_keys is not None:
                hint += ("; or the daemon refused this producer's CurveZMQ key, or curve_server_key is not "
                         "the daemon's public key (the daemon's log, or `ckptd status -c CONFIG`, says which)")
            raise CheckpointError(f"no ckptd daemon answered at {endpoint} within {timeout:g} s; {hint}")
        if token and not self.shm and self._options.transport == "shm":
            transport.close()
            raise CheckpointError(
                f"the daemon at {endpoint} could not map this producer's staging memory (its log says "
                "why); set [producer] transport = \"inline\" or \"auto\" to send tensors through the socket"
            )
        self.transport = transport
        copier = self._copier
        self.batcher = Batcher(arena.capacity, copier.arena_t.data_ptr(),
                               lambda n, name: copier.alloc(n, name, self.drain), arena.shrink,
                               self.send_region, copier.copy_whole) if self.shm and self._batches else None

    def _offer_arena(self) -> bytes | None:
        """Hand the staging arena to the daemon, if this connection uses shared memory;
        return the token that the hello names it by."""
        mode, endpoint = self._options.transport, self.who.endpoint
        arena = self._copier.arena
        assert arena is not None
        if mode == "inline":
            return None
        ipc = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
        if ipc is None:
            why = f"the endpoint {endpoint} is not an ipc:// socket on this host"
        elif arena.fd < 0:
            why = "this system has no memfd_create"
        else:
            try:
                return handoff.offer(ipc, arena.fd, self._options.timeout)
            except handoff.HandoffRefused as exc:
                why = f"the daemon refused it: {exc}"
            except OSError as exc:
                why = f"no daemon takes it at {handoff.socket_path(ipc)}: {exc.strerror or exc}"
        if mode == "shm":
            raise CheckpointError(
                f"[producer] transport = \"shm\", but staging memory cannot be shared with the daemon: {why}; "
                "use transport = \"auto\" or \"inline\""
            )
        log.debug("tensors go inline through the socket: %s", why)
        return None

    def drop(self) -> None:
        """Say bye and close the transport; the next ``ensure`` says hello anew (with a
        grown arena, say: the daemon maps an arena for the life of a connection)."""
        transport, self.transport = self.transport, None
        if transport is not None:
            if transport.lost is None:
                transport.send(wire.encode("bye"))
            transport.close()

    def close(self) -> None:
        self.closed = True
        self.drop()

    @property
    def seq(self) -> int:
        """The last seq number taken: how many messages this producer numbered."""
        return self._seq

    def number(self, count: int = 1) -> int:
        """Take ``count`` consecutive seq numbers; return the first."""
        with self._lock:
            first = self._seq + 1
            self._seq += count
        return first

    def send(self, op: str, *, handle: CommitHandle | None = None, **fields: Any) -> int:
        """Send a message that carries no staging; ``handle``: it is that handle's commit."""
        assert self.transport is not None
        seq = self.number()
        if handle is not None:
            self._book.expect(seq, handle)  # before it leaves: the reply may come at once
        self.transport.send(wire.encode(op, seq=seq, **fields))
        return seq

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send a query, wait for its answer; CheckpointError if the daemon does not
        answer within ``timeout`` or answers with an error."""
        done = threading.Event()
        answer: list[Any] = [done, None]
        assert self.transport is not None
        seq = self.number()
        with self._lock:
            self._queries[seq] = answer
        self.transport.send(wire.encode(op, seq=seq, **fields))
        if not done.wait(self._options.timeout):
            raise CheckpointError(f"the daemon at {self.who.endpoint} did not answer within "
                                  f"{self._options.timeout:.0f} s")
        with self._lock:
            self._queries.pop(seq, None)
        reply = answer[1]
        if reply.get("op") == "error":
            raise CheckpointError(reply["message"])
        return reply

    def send_tensor(self, header: dict[str, Any], start: int, region: Region | None, event: Any,
                    wake: bool = True) -> None:
        """Send one tensor's bytes (or a piece of them, from ``start``) staged in ``region``."""
        assert self.transport is not None
        seq = self.number()
        if region is not None:
            region.seq = seq
        if self.shm and region is not None:  # the daemon reads the bytes where they are
            msg = wire.encode("tensor", seq=seq, start=start, offset=region.start, length=region.nbytes, **header)
            self.transport.send(msg, None, event, wake=wake)
            return
        arena = self._copier.arena
        assert arena is not None
        payload = arena.view(region) if region is not None else b""
        self.transport.send(wire.encode("tensor", seq=seq, start=start, **header), payload, event, wake=wake)

    def send_region(self, step: int, region: Region, items: list[Any], frozen: bool = False) -> None:
        """Send a batch of small tensors staged in ``region`` (the batcher's ``send``)."""
        assert self.transport is not None
        region.seq = seq = self.number()
        fields = {"frozen": True} if frozen else {}
        self.transport.send(wire.encode("tensors", seq=seq, step=step, items=items, **fields), wake=False)

    def batches(self) -> bool:
        """Small tensors go out in batches of shared staging (the shared-memory transport),
        which a save plan's one region needs."""
        return self.batcher is not None

    def ready_for_plan(self) -> bool:
        """Connected, by shared memory, with the open batch sent (regions go out in the
        order they were taken): a save plan's region may be taken now. Under the emit lock."""
        self.ensure()
        if self.batcher is None:
            return False
        self.batcher.flush()
        return True

    def send_planned(self, step: int, region: Region | None, messages: list[tuple[str, Any]], *,
                     kick: bool) -> None:
        """Queue a save plan's messages in order; its one region goes back with the last's ack
        (None: a part of them, the region to follow with the last part). ``kick``: wake the
        sender now (the step's first message: the daemon knows it is open at once, as it
        does from emit's first tensor)."""
        assert self.transport is not None
        with self._lock:
            first = self._seq + 1
            self._seq += len(messages)
            if region is not None:
                region.seq = self._seq
            for i, (op, packed) in enumerate(messages):
                self.transport.send(wire.encode_packed(op, packed, seq=first + i, step=step), wake=False)
        if kick:
            self.transport.kick()

    def transport_kind(self) -> str | None:
        """"shm" or "inline"; None before the first connection."""
        return None if self.transport is None else ("shm" if self.shm else "inline")

    def send_batch(self) -> None:
        """Send the open batch of small tensors, if any (under the emit lock)."""
        if self.batcher is not None:
            self.batcher.flush()

    def drain(self, through: int | None = None) -> None:
        """Before waiting for staging: ship what was queued without waking the sender,
        and ask the daemon to write out every chunk it still gathers for this producer
        (``drain``), so that the wait is only ever for bytes being written, and to give
        back the staging up to seq ``through`` it keeps to replicate from. The daemon
        gives staging back only once it has written it, and it would otherwise hold
        the small tensors of an open chunk until the commit, which cannot come while
        this emit waits (docs/format.md, Flow control). Under the emit lock, so no
        other region is taken before the wait."""
        if self.transport is None or self.transport.lost is not None:
            return
        if self.shm:
            self.send("drain", through=through)
        else:
            self.transport.kick()

    def _on_reply(self, h: dict[str, Any]) -> None:
        op = h["op"]
        if op == "ack":
            if self._copier.arena is not None:
                self._copier.arena.release_through(h["seq"])
        elif op == "welcome":
            self.max_frame = h["max_frame"]
            self.shm = bool(h["shm"])
            self._batches = bool(h["batch"])
            if h["advice"] is not None:
                self.advice = h["advice"]
            if self._welcome is not None:
                self._welcome.set()
        elif op == "committed":
            if h["advice"] is not None:
                self.advice = h["advice"]
            self._book.committed(h["seq"], h["step"], CheckpointInfo.from_dict(h["info"]))
        elif op == "answer":
            self._answer(h)
        elif op == "error":
            self._on_error(h)

    def _answer(self, h: dict[str, Any]) -> None:
        with self._lock:
            query = self._queries.get(h["seq"]) if h.get("seq") is not None else None
        if query is not None:
            query[1] = h
            query[0].set()

    def _on_error(self, h: dict[str, Any]) -> None:
        seq, step, message = h["seq"], h["step"], h["message"]
        if self._welcome is not None and not self._welcome.is_set() and step is None:
            self._hello_error = message
            self._welcome.set()
            return
        if seq is not None and seq in self._queries:
            self._answer(h)
            return
        if not self._book.failed(seq, step, message):
            log.warning("the daemon reported: %s", message)

    def _on_lost(self, message: str) -> None:
        """The daemon went silent: every step in flight fails, loudly."""
        if self._copier.arena is not None:
            self._copier.arena.break_(message)
        self._book.lose(message)
        with self._lock:
            queries = list(self._queries.values())
        for query in queries:
            query[1] = {"op": "error", "message": message}
            query[0].set()
        if self._welcome is not None:
            self._welcome.set()
