"""The producer side, as a module: ``from ckptd import producer``.

Each function forwards to one default ``Producer``, made on first use from the
environment (CKPTD_ENDPOINT, CKPTD_RUN, RANK, WORLD_SIZE) and the config file,
or by ``configure()``. ``Producer`` itself is the same API on an instance.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

from ..manifest import CheckpointInfo
from .client import CommitHandle, Producer

__all__ = [
    "CommitHandle", "Producer", "checkpoint", "close", "commit", "configure", "current", "emit", "emit_many",
    "flush", "latest", "preempt", "preempted", "prepare", "save", "should_save", "stats", "wait_complete",
]

_default: Producer | None = None
_default_lock = threading.Lock()


def configure(endpoint: str | None = None, run: str | None = None, rank: int | None = None,
              world_size: int | None = None, **options: Any) -> Producer:
    """(Re)create the default producer; closes the previous one first. ``options``:
    the ``[producer]`` keys of config.toml, ``retention=`` (this run's own
    ``[retention]`` keys), ``format=`` (``"chunk"`` or ``"hdf5"``: this run's
    storage format; default the daemon's) and ``prepare=`` (the state the loop will save,
    as ``save`` takes it, or its bytes: staging for it is made now, in the background, so
    the first checkpoint blocks no longer than the later ones; ``prepare()``)."""
    global _default
    with _default_lock:
        old, _default = _default, None
        if old is not None:
            old.close()
        _default = Producer(endpoint, run, rank=rank, world_size=world_size, **options)
        return _default


def current() -> Producer | None:
    """The default producer if one is made and open (``configure``'s, or the first
    function's), else None; never makes one. ``ckptd.dcp`` shares it with the module's
    functions when it is the same run and rank."""
    with _default_lock:
        return _default if _default is not None and not _default.closed else None


def _get() -> Producer:
    global _default
    with _default_lock:
        if _default is None:
            _default = Producer()
        return _default


def emit(name: str, tensor: Any, *, step: int | None = None,
         global_shape: Any = None, offset: Any = None) -> str:
    return _get().emit(name, tensor, step=step, global_shape=global_shape, offset=offset)


def emit_many(tensors: dict[str, Any], *, step: int | None = None) -> list[str]:
    return _get().emit_many(tensors, step=step)


def commit(step: int, *, metadata: dict[str, Any] | None = None) -> CommitHandle:
    return _get().commit(step, metadata=metadata)


def checkpoint(step: int, metadata: dict[str, Any] | None = None) -> AbstractContextManager[CommitHandle]:
    return _get().checkpoint(step, metadata)


def save(state: Any, step: int, *, metadata: dict[str, Any] | None = None,
         replicated: Any = None, frozen: Any = None) -> CommitHandle:
    return _get().save(state, step, metadata=metadata, replicated=replicated, frozen=frozen)


def prepare(state: Any, *, replicated: Any = None) -> int:
    return _get().prepare(state, replicated=replicated)


def flush(timeout: float | None = None) -> None:
    _get().flush(timeout)


def latest(run: str | None = None) -> CheckpointInfo | None:
    return _get().latest(run)


def should_save(step: int, *, min_steps: int | None = None, max_steps: int | None = None,
                min_seconds: float | None = None, max_seconds: float | None = None) -> bool:
    """Whether the advised checkpoint interval has passed (``Producer.should_save``)."""
    return _get().should_save(step, min_steps=min_steps, max_steps=max_steps, min_seconds=min_seconds,
                              max_seconds=max_seconds)


def preempt() -> None:
    """A notice that the job ends soon, from the user's own code (``Producer.preempt``)."""
    _get().preempt()


def preempted() -> bool:
    """Whether a preemption notice arrived (``Producer.preempted``)."""
    return _get().preempted


def stats() -> dict[str, Any]:
    """The default producer's figures (``Producer.stats``)."""
    return _get().stats()


def wait_complete(step: int, timeout: float | None = None, *, tier: str | None = None) -> CheckpointInfo:
    """Until every rank's share of ``step`` is durable in the remote tier (else the shared
    root); ``tier="peer"``: until every rank's share has a copy in a peer's memory."""
    return _get().wait_complete(step, timeout, tier=tier)


def abort(step: int) -> None:
    _get().abort(step)


def close() -> None:
    """Close the default producer (waiting for its commits); the next call makes a new one."""
    global _default
    with _default_lock:
        old, _default = _default, None
    if old is not None:
        old.close()
