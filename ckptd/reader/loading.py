"""Whole loads: ``ckptd.load`` (one rank's share, the whole state of a multi-rank step,
into the caller's tensors, mapped, onto a GPU, from another tier) and ``verify``.

Nothing is ever unpickled: tensors come from the data files by the manifest's
offsets (``files``), the structure from the manifest's JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from .. import devicecopy, dtypes, env, measures, state as state_mod
from ..errors import CheckpointNotFound
from ..manifest import Manifest, TensorRecord
from .checks import check, check_structure, share_records, unflatten_state
from .files import read_tensors
from .optim import is_optimizer_state
from .reshard import load_whole
from .finding import find, find_in_tiers, own_share_here, pick_rank


@measures.timed_restore(0)  # a resume's time, for the interval advice (docs/advise.md)
def load(
    run: str,
    step: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    names: Iterable[str] | None = None,
    map_location: Any = "cpu",
    verify: bool = False,
    rank: int | None = None,
    out: Any = None,
    mmap: bool = False,
    remote: str | None = None,
) -> dict[Any, Any]:
    """Load a complete checkpoint: the state as saved, or ``{name: tensor}``.

    ``step=None`` loads the newest complete step. ``names`` reads only those
    tensors and returns them flat. ``verify=True`` checks each tensor's checksum
    (and that each file's own header agrees with the manifest).
    In a multi-rank checkpoint, ``rank`` (default ``$RANK``) picks whose share
    (its replicated tensors included, wherever they were written); with neither,
    the whole state, sharded tensors assembled to their global shape.
    ``out``: a state (nested, as saved, or flat ``{name: tensor}``) whose tensors
    are read into in place, no memory allocated for them: each must be a contiguous
    CPU tensor (or numpy array) of the record's dtype and shape; the result holds
    those very tensors. ``mmap=True``: tensors are mapped copy-on-write from the
    chunk files (as ``torch.load(mmap=True)``): nothing is read until touched, and
    writes stay in this process; a tensor the format cannot map (a compressed HDF5
    dataset, a misaligned offset) is read as usual.
    ``remote`` (a URL, "" for none, None for the config's ``[remote]``): a step not
    complete in the local root is read from the remote tier, only that rank's
    tensors (or ``names``), in parallel ranged reads, every checksum checked.
    """
    if mmap and out is not None:
        raise ValueError("load(out=..., mmap=True): choose one; out= reads into your tensors, "
                         "mmap=True maps the files instead")
    if mmap and map_location not in (None, "cpu"):
        raise ValueError(f"load(mmap=True) maps the files into CPU memory; map_location={map_location!r} "
                         "would copy every byte at once: load without mmap=True")
    path, manifests, source = find_in_tiers(run, step, root, remote, fill=False)
    whole = rank is None and manifests[0].world_size > 1 and env.rank() is None
    if source is not None and source.fills_root and whole:
        source.fill()  # the whole state reads local files: the peers' shares come into the root first
        source = None
    # one rank's share is the whole state, its tensors held in several pieces assembled
    whole = whole or (manifests[0].world_size == 1 and rank in (None, 0) and out is None and not mmap
                      and source is None
                      and any(rec.tensor_name(k) != k for k, rec in manifests[0].tensors.items()))
    if whole:
        if out is not None or mmap:
            raise ValueError(f"load(out=/mmap=True) reads one rank's share, and step {manifests[0].step} has "
                             f"{manifests[0].world_size} ranks: pass rank=, or fill your tensors of the whole "
                             "state with ckptd.load_into(state, run, step)")
        if source is not None:
            raise ValueError(f"step {manifests[0].step} of run {run!r} is complete only in {source.url}: load "
                             "one rank's share there with rank= (or set RANK), or fetch the step into the "
                             "local root first (ckptd.remote.fetch.fetch_share) to load the whole state")
        return load_whole(path, manifests, names=names, map_location=map_location, verify=verify)
    here = env.rank()
    if rank is None and here is not None and 1 < manifests[0].world_size <= here:
        # a job on more ranks than saved the step has no share of its own: load_into reshards
        _refuse_pieces_by_default(run, step, root, here, manifests[0], share_records(path, manifests, manifests[0]))
    manifest = pick_rank(manifests, rank)
    records = share_records(path, manifests, manifest)
    wanted = list(records) if names is None else list(names)
    missing = [n for n in wanted if n not in records]
    if missing:
        raise CheckpointNotFound(
            f"step {manifest.step} of run {run!r} has no tensor named "
            + ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        )
    rebuild = names is None and manifest.state is not None
    # a tensor this rank stored in several pieces has no one record to hand back for its name
    split = sorted({rec.tensor_name(k) for k, rec in records.items() if rec.tensor_name(k) != k}
                   & ({n for n in wanted if n in records} if not rebuild else set(records)))
    if split:
        raise ValueError(f"rank {manifest.rank} stored tensor {split[0]!r} of step {manifest.step} in several pieces "
                         "(docs/format.md); load the whole state with ckptd.load(run, step) without rank= (and "
                         "without $RANK), or fill your own tensors with ckptd.load_into")
    if rebuild:  # a malformed structure fails now, before gigabytes are read
        check_structure(path, manifest)
    if rank is None and env.rank() is not None:
        _refuse_pieces_by_default(run, step, root, manifest.rank, manifest, {n: records[n] for n in wanted})
    wanted_records = {n: records[n] for n in wanted}
    # from the bucket unless every file it needs was written here (the node that wrote it)
    writers = {manifest.rank} | {manifest.replicas[n] for n in wanted if n in manifest.replicas}
    if source is not None and source.fills_root and (mmap or out is not None and not source.reads_into):
        source.fill(writers)  # these read local files: the shares they read come into the root first
    if source is not None and not all(own_share_here(path, manifests[r]) for r in writers):
        if mmap or out is not None and not source.reads_into:
            raise ValueError(f"load(out=/mmap=True) reads local files, and rank {manifest.rank}'s share of step "
                             f"{manifest.step} is only in {source.url}: load without them, or fetch it first")
        # from that tier (the peers' memory, the bucket), what this root lacks, into out= where
        # given (the peers: straight from their memory); checksums checked
        into = destinations(out, records, manifest.step) if out is not None else None
        tensors = source.read_tensors(manifest, wanted_records,
                                      lambda recs: read_tensors(path, recs, verify=verify, into=into), into)
    else:
        into = destinations(out, records, manifest.step) if out is not None else None
        if into is None and devicecopy.is_cuda(map_location):
            # onto the GPU as each tensor is read, through pinned buffers (ckptd.devicecopy)
            copier = devicecopy.DeviceCopier(map_location)
            tensors = read_tensors(path, wanted_records, verify=verify,  # numpy arrays stay on the host
                                   convert=lambda n, t: t if records[n].numpy else copier.to_device(t))
            copier.finish()
            map_location = None
        else:
            tensors = read_tensors(path, wanted_records, verify=verify, into=into, mapped=mmap)
    if map_location not in (None, "cpu"):
        tensors = {n: t.to(map_location) for n, t in tensors.items()}
    values = {  # (an out= numpy array is one already)
        n: (t.numpy() if records[n].numpy and hasattr(t, "numpy") else t) for n, t in tensors.items()
    }
    return unflatten_state(path, manifest, values) if rebuild else values


def _refuse_pieces_by_default(run: str, step: int | None, root: str | os.PathLike[str] | None, here: int,
                              manifest: Manifest, records: dict[str, TensorRecord]) -> None:
    """Under torchrun ($RANK set, no ``rank=``), a share holding pieces of sharded tensors
    (an FSDP2 / DTensor model's) is refused: its pieces as plain tensors are what
    ``model.load_state_dict`` cannot take, and PyTorch's own error (a size mismatch)
    says nothing of what to do. ``load_into`` fills the model's own sharded state in
    place, the message shows how for this step's structure; ``rank=`` asks for the
    pieces knowingly (docs/training.md)."""
    sharded = [n for n, rec in records.items() if rec.shard is not None and rec.shape != rec.shard.global_shape]
    if not sharded:
        return
    rec = records[sharded[0]]
    assert rec.shard is not None
    raise ValueError(
        f"step {manifest.step} of run {run!r} holds sharded tensors: under torchrun (RANK={here}) "
        f"ckptd.load would return {'this rank' if here == manifest.rank else f'rank {manifest.rank}'}'s pieces as "
        f"plain tensors ({sharded[0]!r}: a {rec.shape} piece of "
        f"{rec.shard.global_shape}), which model.load_state_dict cannot take. Fill your model's "
        "(and optimizer's) own sharded state in place instead, with `model` the model and `opt` its "
        "optimizer (docs/training.md):\n"
        + "".join(f"    {line}\n" for line in _recipe(run, step, root, manifest, sharded))
        + f"or pass rank= (0 to {manifest.world_size - 1}) to get that rank's pieces as plain tensors")


def _recipe(run: str, step: int | None, root: str | os.PathLike[str] | None, manifest: Manifest,
            sharded: list[str]) -> list[str]:
    """Code that restores this step's model and optimizer into the job's own objects,
    keyed as the step was saved (``{"model": ..., "optim": ...}``); get_state_dict
    creates a fresh optimizer's state so that there is something to fill."""
    where = repr(run) + ("" if step is None else f", {step}") + ("" if root is None else f", root={str(root)!r}")
    saved = state_mod.unflatten(manifest.state, lambda name: None) if manifest.state is not None else None
    if not isinstance(saved, dict):
        return ["state = model.state_dict()", f"ckptd.load_into(state, {where})", "model.load_state_dict(state)"]
    opts = [k for k, v in saved.items() if is_optimizer_state(v)]
    models = [k for k in saved if k not in opts and any(n.startswith(f"{k}.") for n in sharded)]
    if not models:  # the model's state_dict() is the whole saved state
        return ["state = model.state_dict()", f"ckptd.load_into(state, {where})", "model.load_state_dict(state)"]
    if not opts:
        return ["model_sd = model.state_dict()", f"ckptd.load_into({{{models[0]!r}: model_sd}}, {where})",
                "model.load_state_dict(model_sd)"]
    return ["from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict",
            "model_sd, optim_sd = get_state_dict(model, opt)",
            f"ckptd.load_into({{{models[0]!r}: model_sd, {opts[0]!r}: optim_sd}}, {where})",
            "set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)"]


def verify(run: str, step: int | None = None, *, root: str | os.PathLike[str] | None = None) -> tuple[Path, list[str]]:
    """Check every tensor of a checkpoint; return its folder and a list of problems,
    one for each damaged tensor, naming it and its file."""
    path, manifests = find(run, step, root)
    return path, check(path, manifests)


def destinations(out: Any, records: dict[str, TensorRecord], step: int) -> dict[str, Any]:
    """The tensors of ``out`` (a state as saved, or flat ``{name: tensor}``) by name,
    each checked against its record (of a rank's share of ``step``): ValueError naming
    the first that cannot take it."""
    import numpy as np
    import torch

    if isinstance(out, dict) and all(isinstance(k, str) and k in records for k in out):
        flat = dict(out)
    else:
        _, flat = state_mod.flatten(out)
    unknown = [n for n in flat if n not in records]
    if unknown:
        raise ValueError(f"load(out=...): step {step} has no tensor named "
                         + ", ".join(map(repr, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
                         + "; pass a state with only the checkpoint's tensors")
    for name, t in flat.items():
        rec = records[name]
        if isinstance(t, np.ndarray):
            ok = t.flags.c_contiguous and t.flags.writeable and dtypes.BY_NUMPY.get(t.dtype.name) is not None \
                and dtypes.BY_NUMPY[t.dtype.name].name == rec.dtype and list(t.shape) == rec.shape
            have = f"a numpy array of {t.dtype} {list(t.shape)}"
        elif isinstance(t, torch.Tensor):
            ok = t.device.type == "cpu" and t.is_contiguous() and dtypes.torch_name(t.dtype) == rec.dtype \
                and list(t.shape) == rec.shape and not t.is_conj() and not t.is_neg()
            have = f"a {t.device.type} tensor of {dtypes.torch_name(t.dtype)} {list(t.shape)}" + (
                "" if t.is_contiguous() else ", not contiguous")
        else:
            ok, have = False, f"a {type(t).__name__}"
        if not ok:
            raise ValueError(f"load(out=...): tensor {name!r} is {rec.dtype} {rec.shape} in the checkpoint; "
                             f"out= holds {have}: pass a contiguous CPU tensor of that dtype and shape")
    return flat
