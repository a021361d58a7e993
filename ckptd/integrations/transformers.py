"""Hugging Face ``Trainer`` checkpoints through ckptd: ``CkptdCallback``.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CkptdCallback(run="exp1")])
    trainer.train(resume_from_checkpoint=True)   # ckptd's newest complete checkpoint

The callback attaches to its Trainer (``attach``): the Trainer's checkpoint writer becomes
one ``producer.save`` per process, resuming reads the ckptd checkpoint through the
Trainer's own resume path, and ``save_total_limit`` becomes ``keep_last``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .. import env, reader
from ..durable import atomic_write
from ..names import check_run
from ..producer import Producer
from . import require, rng

_transformers = require("transformers", "transformers")
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

RESUME_DIR = "ckptd-resume"
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")


class CkptdCallback(TrainerCallback):
    """Checkpoints of the Trainer that holds this callback go through a ckptd daemon.

    ``run``: the ckptd run (default ``$CKPTD_RUN``). ``endpoint``, ``root``: the
    daemon's socket and checkpoint root (defaults: ``$CKPTD_ENDPOINT`` /
    ``$CKPTD_ROOT``, else config.toml's). ``producer_options``: ``Producer``
    keywords (``staging_size=``, ``retention=``, ...). ``save_seconds`` lists how
    long each save blocked training.

    ``every="auto"``: save when ckptd's advised interval has passed
    (``producer.should_save``, docs/advise.md) instead of at the Trainer's
    ``save_strategy`` points, within ``bounds`` (``min_steps``, ``max_steps``,
    ``min_seconds``, ``max_seconds``). The default, None, leaves the Trainer's.
    """

    def __init__(self, run: str | None = None, *, endpoint: str | None = None,
                 root: str | os.PathLike[str] | None = None, every: str | None = None,
                 bounds: dict[str, Any] | None = None, **producer_options: Any) -> None:
        run = run if run is not None else env.run()
        if not run:
            raise ValueError("CkptdCallback needs a run: pass run=\"name\" or set CKPTD_RUN")
        if every not in (None, "auto"):
            raise ValueError(f"CkptdCallback(every={every!r}): \"auto\" (ckptd's advised interval) or None "
                             "(the Trainer's save_strategy)")
        self.every, self.bounds = every, dict(bounds or {})
        unknown = set(self.bounds) - {"min_steps", "max_steps", "min_seconds", "max_seconds"}
        if unknown:
            raise ValueError(f"CkptdCallback(bounds=...): unknown {sorted(unknown)}; the bounds are min_steps, "
                             "max_steps, min_seconds, max_seconds")
        self.run = check_run(run)
        self.endpoint, self.root = endpoint, root
        self.producer_options = producer_options
        self.save_seconds: list[float] = []
        self._producer: Producer | None = None
        self._trainer: Any = None
        self._resume_dir: str | None = None
        self._resume: dict[str, Any] = {}
        self._prepare_pending = True

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _owning_trainer()
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer: Any) -> None:
        """Route ``trainer``'s checkpoint writes and resumes through ckptd."""
        if self._trainer is trainer:
            return
        if self._trainer is not None:
            raise ValueError("this CkptdCallback is attached to another Trainer already; give each its own")
        if trainer.args.load_best_model_at_end:
            raise ValueError("CkptdCallback does not support load_best_model_at_end=True (the Trainer reloads "
                             "the best model from its own files); leave it False and load the best step with "
                             "ckptd.load(run, step)")
        self._trainer = trainer
        original_train = trainer.train

        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            return original_train(self._resolve(resume_from_checkpoint), *args, **kwargs)

        trainer.train = train
        trainer._save_checkpoint = self._save_checkpoint
        for name in _LOADERS:
            setattr(trainer, name, self._loader(name, getattr(trainer, name)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With ``every="auto"``: the save points are ckptd's advice, not ``save_strategy``'s
        (this runs after the Trainer's own flow callback, and overrides its decision)."""
        if self.every == "auto":
            control.should_save = self.producer.should_save(state.global_step, **self.bounds)
        if self._prepare_pending:
            self._prepare_pending = False
            self._prepare_staging()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._prepare_pending = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training ends once every checkpoint is durable; a failed one raises CheckpointError."""
        self.flush()

    def flush(self, timeout: float | None = None) -> None:
        if self._producer is not None:
            self._producer.flush(timeout)

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close()

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            args = self._trainer.args
            options = dict(self.producer_options)
            if args.save_total_limit and "retention" not in options:
                options["retention"] = {"keep_last": args.save_total_limit}
            self._producer = Producer(self.endpoint, self.run, rank=args.process_index,
                                      world_size=args.world_size, **options)
        return self._producer

    def _prepare_staging(self) -> None:
        """Process 0: make staging for the checkpoint's model and optimizer now, in the
        background (its memory is taken from the first step rather than the first save;
        other processes save only their RNG states, which the 32 MiB "auto" starts with holds)."""
        trainer = self._trainer
        if trainer is None or not trainer.args.should_save:
            return
        share: dict[str, Any] = {"model": trainer.model.state_dict()}
        if not trainer.args.save_only_model and trainer.optimizer is not None:
            share["optimizer"] = trainer.optimizer.state_dict()
        self.producer.prepare(share)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """What ``Trainer._save_checkpoint`` writes, as one ckptd step of this process's share."""
        started = time.perf_counter()
        trainer = self._trainer
        if trial is not None or trainer.hp_search_backend is not None:
            raise ValueError("CkptdCallback does not save hyper-parameter search trials; "
                             "run the search without it")
        trainer.store_flos()
        args = trainer.args
        share: dict[str, Any] = {}
        if args.should_save:
            share["model"] = trainer.model.state_dict()
            if not args.save_only_model:
                share["optimizer"] = trainer.optimizer.state_dict()
                share["scheduler"] = trainer.lr_scheduler.state_dict()
                scaler = getattr(trainer.accelerator, "scaler", None)
                if scaler is not None:
                    share["scaler"] = scaler.state_dict()
            _export_callback_states(trainer)
            share["trainer_state"] = json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"
        if not args.save_only_model:
            share["rng"] = rng.capture()
        # frozen parameters (a LoRA/PEFT base) are written once; later steps refer to the stored copy
        frozen = [f"model.{n}" for n, p in trainer.model.named_parameters() if not p.requires_grad] \
            if "model" in share else None
        self.producer.save(share, trainer.state.global_step, frozen=frozen or None)
        self.save_seconds.append(time.perf_counter() - started)

    def _resolve(self, resume_from_checkpoint: Any) -> Any:
        """``True``: ckptd's newest complete checkpoint of the run (else the Trainer's own lookup)."""
        if resume_from_checkpoint is not True:
            return resume_from_checkpoint
        self.flush()
        info = reader.latest(self.run, root=self.root, agree=True)
        if info is None:
            return True
        args = self._trainer.args
        first = reader.load(self.run, info.step, root=self.root, rank=0)
        mine = first if args.process_index == 0 else reader.load(self.run, info.step, root=self.root,
                                                                 rank=args.process_index)
        self._resume = {"first": first, "mine": mine}
        folder = Path(args.output_dir) / RESUME_DIR / f"checkpoint-{info.step}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "trainer_state.json", first["trainer_state"].encode(), fsync=False)
        self._resume_dir = str(folder)
        return self._resume_dir

    def _loader(self, name: str, original: Any) -> Any:
        load = getattr(self, name)

        def dispatch(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
            if checkpoint is not None and checkpoint == self._resume_dir:
                return load(*args, **kwargs)
            return original(checkpoint, *args, **kwargs)

        return dispatch

    def _load_from_checkpoint(self, model: Any = None) -> None:
        (model or self._trainer.model).load_state_dict(self._resume["first"]["model"])

    def _load_optimizer_and_scheduler(self) -> None:
        first = self._resume["first"]
        if "optimizer" in first:
            self._trainer.optimizer.load_state_dict(first["optimizer"])
            self._trainer.lr_scheduler.load_state_dict(first["scheduler"])

    def _load_scaler(self) -> None:
        scaler = getattr(self._trainer.accelerator, "scaler", None)
        if scaler is not None and "scaler" in self._resume["first"]:
            scaler.load_state_dict(self._resume["first"]["scaler"])

    def _load_rng_state(self) -> None:
        if "rng" in self._resume["mine"]:
            rng.restore(self._resume["mine"]["rng"])


def _export_callback_states(trainer: Any) -> None:
    """As ``Trainer._save_checkpoint`` does: stateful callbacks' states into ``trainer.state``."""
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(trainer.state.stateful_callbacks[name], list):
            trainer.state.stateful_callbacks[name].append(cb.state())
        else:
            trainer.state.stateful_callbacks[name] = cb.state()


def _owning_trainer() -> Any:
    """The Trainer whose ``__init__`` is running ``on_init_end`` (the frames above this call)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
