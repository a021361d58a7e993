"""accelerate's ``save_state`` / ``load_state``, through ckptd.

    ckptd_accelerate.prepare(accelerator)              # once, after the first optimizer step
    ckptd_accelerate.save_state(accelerator, step)     # returns once copied
    info = ckptd_accelerate.load_state(accelerator)    # newest complete step; info.step

What ``Accelerator.save_state`` covers is one ckptd step: process 0 saves the unwrapped
models and the rest, every process its RNG states. FSDP and DeepSpeed go through ``ckptd.dcp``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .. import env, index, reader
from ..errors import CheckpointNotFound
from ..manifest import CheckpointInfo
from ..producer import CommitHandle, Producer
from . import require, rng

_accelerate = require("accelerate", "accelerate")

log = logging.getLogger("ckptd.integrations.accelerate")

_producers: dict[tuple[Any, ...], Producer] = {}
_producers_lock = threading.Lock()


def save_state(accelerator: Any, step: int, *, run: str | None = None, endpoint: str | None = None,
               metadata: dict[str, Any] | None = None, **producer_options: Any) -> CommitHandle:
    """Snapshot this process's share of ``accelerator``'s state as ``step`` of ``run``
    (default ``$CKPTD_RUN``); returns the commit's handle once the tensors are copied.
    ``producer_options`` (``staging_size=``, ``retention=``, ...) apply when this
    process's producer for the run is made, on the first call."""
    _check_unsharded(accelerator)
    return producer_for(accelerator, run, endpoint, **producer_options).save(_share(accelerator), step,
                                                                              metadata=metadata)


def prepare(accelerator: Any, *, run: str | None = None, endpoint: str | None = None,
            **producer_options: Any) -> int:
    """Make this process's staging for ``save_state``'s checkpoints now, in the background
    (``Producer.prepare``; nothing is copied); returns the staging bytes one takes. Takes
    the options ``save_state`` does (they apply when the producer is made)."""
    _check_unsharded(accelerator)
    return producer_for(accelerator, run, endpoint, **producer_options).prepare(_share(accelerator))


def _share(accelerator: Any) -> dict[str, Any]:
    """This process's share of a checkpoint: process 0 the prepared and registered objects,
    every process its RNG states and ``accelerator.step``."""
    share: dict[str, Any] = {"step": accelerator.step, "rng": rng.capture()}
    if accelerator.process_index == 0:
        share["models"] = [accelerator.unwrap_model(m).state_dict() for m in accelerator._models]
        share["optimizers"] = [o.state_dict() for o in accelerator._optimizers]
        share["schedulers"] = [s.state_dict() for s in accelerator._schedulers]
        share["dataloaders"] = [d.state_dict() for d in _stateful(accelerator)]
        share["custom"] = [o.state_dict() for o in accelerator._custom_objects]
        if accelerator.scaler is not None:
            share["scaler"] = accelerator.scaler.state_dict()
    return share


def load_state(accelerator: Any, step: int | None = None, *, run: str | None = None,
               root: str | os.PathLike[str] | None = None, strict: bool = True) -> CheckpointInfo:
    """Restore ``accelerator``'s prepared objects, registered objects and this process's
    RNG states from ``step`` (None: the newest complete step, agreed by every process);
    return its CheckpointInfo."""
    _check_unsharded(accelerator)
    run = _run(run)
    path, manifests = reader.find(run, reader.agreed_step(run, root, local=True) if step is None else step, root)
    step, world = manifests[0].step, manifests[0].world_size
    first = reader.load(run, step, root=root, rank=0)
    rank = accelerator.process_index
    if rank == 0:
        mine: dict[str, Any] | None = first
    elif rank < world:
        mine = reader.load(run, step, root=root, rank=rank)
    else:
        mine = None
        log.warning("step %d of run %r was saved by %d processes; process %d keeps its own RNG states",
                    step, run, world, rank)
    _restore_all("models", first, [accelerator.unwrap_model(m) for m in accelerator._models], strict=strict)
    _restore_all("optimizers", first, accelerator._optimizers)
    _restore_all("schedulers", first, accelerator._schedulers)
    _restore_all("dataloaders", first, _stateful(accelerator))
    _restore_all("custom", first, accelerator._custom_objects, what="objects registered for checkpointing")
    if accelerator.scaler is not None and "scaler" in first:
        accelerator.scaler.load_state_dict(first["scaler"])
    if mine is not None:
        rng.restore(mine["rng"])
        accelerator.step = mine["step"]
    info = index.step_info(path)
    if info is None:
        raise CheckpointNotFound(f"step {step} of run {run!r} was removed while it was being loaded")
    return info


def producer_for(accelerator: Any, run: str | None = None, endpoint: str | None = None,
                 **producer_options: Any) -> Producer:
    """This process's producer for ``run`` (made once, rank and world size from ``accelerator``)."""
    key = (_run(run), endpoint, accelerator.process_index, accelerator.num_processes)
    with _producers_lock:
        producer = _producers.get(key)
        if producer is None:
            producer = _producers[key] = Producer(endpoint, key[0], rank=key[2], world_size=key[3],
                                                  **producer_options)
        return producer


def close() -> None:
    """Wait for every save to be durable (CheckpointError if one failed) and disconnect."""
    with _producers_lock:
        producers = list(_producers.values())
        _producers.clear()
    for producer in producers:
        producer.close()


def _run(run: str | None) -> str:
    run = run if run is not None else env.run()
    if not run:
        raise ValueError("pass run=\"name\" or set CKPTD_RUN")
    return run


def _check_unsharded(accelerator: Any) -> None:
    kind = str(accelerator.distributed_type)
    if any(s in kind for s in ("FSDP", "DEEPSPEED", "MEGATRON")):
        raise NotImplementedError(
            f"ckptd.integrations.accelerate saves replicated (DDP or single-process) state; under {kind} the "
            "model and optimizer are sharded: save them with torch.distributed.checkpoint and ckptd.dcp"
        )


def _stateful(accelerator: Any) -> list[Any]:
    return [d for d in accelerator._dataloaders if getattr(d, "use_stateful_dataloader", False)]


def _restore_all(key: str, share: dict[str, Any], targets: list[Any], *, what: str | None = None,
                 **kwargs: Any) -> None:
    states = share.get(key, [])
    if len(states) != len(targets):
        raise ValueError(f"the checkpoint holds {len(states)} {what or key}, and this accelerator has "
                         f"{len(targets)}: prepare (or register) the same ones, in the same order, as when it was saved")
    for target, state in zip(targets, states):
        target.load_state_dict(state, **kwargs)
