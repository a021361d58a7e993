"""PyTorch Lightning (and Fabric) checkpoints through ckptd: ``CkptdCheckpointIO``.

    trainer = L.Trainer(plugins=[CkptdCheckpointIO(run="exp1")], callbacks=[ModelCheckpoint(...)])

Lightning decides when to save, a checkpoint's file name and which to remove; this
plugin saves the dict as a ckptd step and writes a small JSON *pointer file* at the
path. ``last*.ckpt`` loads the run's newest complete step; a removed step is deleted
once no pointer names it and a newer one is complete. ``PrepareStaging`` makes staging early.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .. import env, reader, retention
from ..config import default_root
from ..durable import atomic_write
from ..errors import CheckpointError
from ..layout import read_small
from ..names import check_run
from ..producer import CommitHandle, Producer
from . import require

_io = require("lightning.fabric.plugins.io", "lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402

log = logging.getLogger("ckptd.integrations.lightning")

POINTER_KIND = "ckptd-lightning-pointer"
_POINTER_LIMIT = 1 << 16
_LAST = re.compile(r"^last(-v?\d+)?$")


class CkptdCheckpointIO(_io.CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through a ckptd daemon.

    ``run``: the ckptd run (default ``$CKPTD_RUN``). ``endpoint``, ``root``: the
    daemon's socket and checkpoint root (defaults: ``$CKPTD_ENDPOINT`` /
    ``$CKPTD_ROOT``, else config.toml's). ``producer_options``: ``Producer``
    keywords (``staging_size=``, ``retention=``, ``format=``, ...).

    Lightning saves from global rank 0 only (DDP holds one replicated copy of
    the model), so the plugin's producer is always rank 0 of a world of one,
    whatever ``$RANK`` says; every rank can load.
    """

    def __init__(self, run: str | None = None, *, endpoint: str | None = None,
                 root: str | os.PathLike[str] | None = None, **producer_options: Any) -> None:
        run = run if run is not None else env.run()
        if not run:
            raise ValueError("CkptdCheckpointIO needs a run: pass run=\"name\" or set CKPTD_RUN")
        self.run = check_run(run)
        self.endpoint = endpoint
        self.root = root
        self.producer_options = producer_options
        self._producer: Producer | None = None
        self._handles: dict[int, CommitHandle] = {}
        self._doomed: set[int] = set()
        self._dirs: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` through the producer (returns once copied), then point ``path`` at it."""
        if storage_options is not None:
            raise TypeError("CkptdCheckpointIO.save_checkpoint takes no storage_options; "
                            "pass Producer options to CkptdCheckpointIO(...) instead")
        step = self._step_of(checkpoint)
        if step not in self._handles:  # save_last re-saves the step a top-k save just saved
            self._handles[step] = self.producer.save(plain(checkpoint), step, metadata=scores(checkpoint))
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # not fsynced: it is Lightning's bookkeeping; the checkpoint is ckptd's, durable once committed
        atomic_write(target, pointer_bytes(self.run, step), fsync=False)
        self._dirs.add(target.parent.absolute())
        self._reap()

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` points at; for ``last*.ckpt``, the run's newest complete one."""
        run, step = read_pointer(path)
        if self._producer is not None and run == self.run:
            self._producer.flush()
        if _LAST.match(Path(path).stem):
            info = reader.latest(run, root=self.root, agree=True)
            if info is None:
                raise CheckpointError(f"{path} points at run {run!r}, which has no complete checkpoint "
                                      f"under {default_root(self.root)}")
            if info.step != step:
                log.warning("%s names step %d, which is not complete; loading the newest complete "
                            "checkpoint of run %r, step %d", path, step, run, info.step)
            step = info.step
        device = map_location if isinstance(map_location, str) or _is_device(map_location) else "cpu"
        return reader.load(run, step, root=self.root, map_location=device, rank=0)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; its step goes once that is safe (see the module doc)."""
        target = Path(path)
        try:
            run, step = read_pointer(target)
        except FileNotFoundError:
            return
        except ValueError:
            log.warning("%s is not a ckptd pointer file; CkptdCheckpointIO leaves it alone", target)
            return
        target.unlink(missing_ok=True)
        if run == self.run:
            self._doomed.add(step)
        self._reap()

    def teardown(self) -> None:
        """Wait until every save is durable (raising CheckpointError for any that failed),
        apply the removals that were waiting for it, and disconnect."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.flush()
            self._reap()
        finally:
            producer.close()
            self._handles.clear()

    def prepare(self, checkpoint: dict[str, Any]) -> int:
        """Make staging for checkpoints like ``checkpoint`` now, in the background
        (``Producer.prepare``); ``PrepareStaging`` calls it after the first training step.
        Returns the staging bytes one such checkpoint takes."""
        return self.producer.prepare(plain(checkpoint))

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(self.endpoint, self.run, rank=0, world_size=1, **self.producer_options)
        return self._producer

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every save so far is durable (CheckpointError if one failed)."""
        if self._producer is not None:
            self._producer.flush(timeout)

    def _step_of(self, checkpoint: dict[str, Any]) -> int:
        for key in ("global_step", "step"):
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        newest = reader.latest(self.run, root=self.root)
        known = [*self._handles, *([newest.step] if newest else [])]
        return max(known) + 1 if known else 0

    def _reap(self) -> None:
        """Delete the removed steps that are now safe to delete."""
        if not self._doomed:
            return
        newest = reader.latest(self.run, root=self.root)
        live = self._pointed_steps()
        run_dir = default_root(self.root) / self.run
        for step in sorted(self._doomed):
            handle = self._handles.get(step)
            if step in live or (handle is not None and not handle.done()):
                continue
            if newest is None or newest.step <= step:
                continue
            self._doomed.discard(step)
            try:
                trash = retention.delete(run_dir, step)
            except OSError as exc:
                log.warning("cannot delete step %d of run %r (%s); [retention] in the daemon's "
                            "config or Producer retention= can remove it instead", step, self.run, exc)
                continue
            if trash is not None:
                retention.remove_trash(trash)
                log.info("removed step %d of run %r: Lightning removed its last checkpoint path", step, self.run)

    def _pointed_steps(self) -> set[int]:
        """Steps of this run that a pointer file in this plugin's folders still names."""
        steps: set[int] = set()
        for folder in self._dirs:
            for entry in folder.glob("*"):
                try:
                    run, step = read_pointer(entry)
                except (OSError, ValueError):
                    continue
                if run == self.run:
                    steps.add(step)
        return steps


class PrepareStaging(Callback):
    """After the first training step of a fit, a ``CkptdCheckpointIO``'s staging is made
    for what a checkpoint will hold: the model's ``state_dict`` and the optimizers'
    (their state exists from the first step), on global rank 0, which saves. The
    first checkpoint then finds staging made, as the later ones do, instead of
    streaming through the 32 MiB "auto" staging starts with. It costs that staging's
    memory from the first step rather than from the first checkpoint, made on a
    background thread; the training thread only lists the tensors."""

    def __init__(self) -> None:
        self._pending = True

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._pending = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._pending:
            return
        self._pending = False
        plugin = ckptd_io(trainer.strategy.checkpoint_io)
        if plugin is None or not trainer.is_global_zero:  # Lightning saves from global rank 0 only
            return
        plugin.prepare({"state_dict": pl_module.state_dict(),
                        "optimizer_states": [o.state_dict() for o in trainer.optimizers]})


def callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml): every
    Trainer gets a ``PrepareStaging``, which acts only with a ``CkptdCheckpointIO``."""
    return [PrepareStaging()]


def ckptd_io(io: Any) -> CkptdCheckpointIO | None:
    """The ``CkptdCheckpointIO`` in a strategy's checkpoint IO (maybe wrapped, e.g. by
    Lightning's ``AsyncCheckpointIO``), else None."""
    seen = 0
    while io is not None and seen < 8:
        if isinstance(io, CkptdCheckpointIO):
            return io
        io, seen = getattr(io, "checkpoint_io", None), seen + 1
    return None


def pointer_bytes(run: str, step: int) -> bytes:
    return json.dumps({"kind": POINTER_KIND, "run": run, "step": step}).encode() + b"\n"


def read_pointer(path: Any) -> tuple[str, int]:
    """(run, step) from a pointer file; FileNotFoundError if absent, ValueError if it is not one."""
    try:
        data = read_small(os.path.realpath(path), _POINTER_LIMIT)  # save_last="link" makes symlinks
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a ckptd checkpoint pointer: {exc}") from exc
    try:
        doc = json.loads(data)
        if doc.get("kind") != POINTER_KIND:
            raise ValueError("no ckptd pointer kind")
        run, step = check_run(doc["run"]), doc["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"bad step {step!r}")
    except (ValueError, AttributeError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a ckptd checkpoint pointer (the small JSON file CkptdCheckpointIO writes); "
            "a checkpoint saved by Lightning's own TorchCheckpointIO loads without this plugin"
        ) from exc
    return run, step


def plain(value: Any) -> Any:
    """The checkpoint with dict subclasses (Lightning's ``AttributeDict`` hyper-parameters,
    ``defaultdict``) made plain dicts; ``OrderedDict`` stays. Anything else ckptd
    cannot store is left for ``save`` to refuse with a TypeError naming its path."""
    if isinstance(value, dict):
        kind = OrderedDict if type(value) is OrderedDict else dict
        out = kind((k, plain(v)) for k, v in value.items())
        if kind is OrderedDict and hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    return value


def scores(checkpoint: dict[str, Any]) -> dict[str, float]:
    """Each ``ModelCheckpoint``'s monitored value at this save, as commit metadata
    (``{"val_loss": 0.31}``): what ckptd's ``keep_best`` retention ranks by."""
    out: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    for state in (callbacks.values() if isinstance(callbacks, dict) else ()):
        if not isinstance(state, dict) or not isinstance(state.get("monitor"), str):
            continue
        score = state.get("current_score")
        try:
            value = float(score)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[state["monitor"]] = value
    return out


def _is_device(value: Any) -> bool:
    import torch

    return isinstance(value, torch.device)
