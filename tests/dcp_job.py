"""A 2-rank FSDP2 job (torchrun, gloo on CPU) for tests/test_dcp.py: DCP through ckptd.

Every rank trains the same tiny model, sharded by ``fully_shard`` (a dimension of 5
over 2 ranks: uneven shards), and saves its state with ``get_state_dict``:

  step 1  dcp.save through ckptd.dcp.StorageWriter
  step 2  dcp.async_save, thread executor
  step 3  dcp.async_save, ckptd.dcp.AsyncStorageWriter (it stages into ckptd itself)
  run "dcp-process" step 1  dcp.async_save, process executor
  run "ps" step 1  producer.save of the same state (ckptd's own sharded format)
  and DCP's own FileSystemWriter, the reference

then loads each back into a fresh, differently initialized model: steps 1-3 and the
producer.save'd one with dcp.load(storage_reader=ckptd.dcp.StorageReader(...)), step 1
also with ckptd.load_into, and compares every value with DCP's own load of its own
save. Rank 0 writes the reference, unsharded, to OUT/reference.safetensors.

    torchrun --nproc-per-node=2 dcp_job.py ENDPOINT ROOT OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd
import ckptd.dcp
from ckptd import Producer

RUN = "dcp"
PROCESS_RUN = "dcp-process"


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        loss = ((model(torch.randn(4, 6, generator=g)) - torch.randn(4, 3, generator=g)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state by its dotted name, DTensors gathered whole."""
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
    if items is None:
        return {prefix: full(state)}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        x, y = a[k], b[k]
        ok = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert ok, f"{what}: {k} differs"


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, opt = build(seed=1)
    train(model, opt, 1)  # the optimizer has state to be overwritten
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd}


def loaded(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    return flat({"model": msd, "optim": osd})


def main(endpoint: str, root: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(seed=0)
    train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    options = dict(endpoint=endpoint, staging_size="16MiB", timeout=20)

    dcp.save(state, checkpoint_id=str(out / "reference"))  # DCP's own
    dcp.save(state, storage_writer=ckptd.dcp.StorageWriter(run=RUN, step=1, **options))
    dcp.async_save(state, storage_writer=ckptd.dcp.StorageWriter(run=RUN, step=2, **options)).result()
    dcp.async_save(state, storage_writer=ckptd.dcp.AsyncStorageWriter(run=RUN, step=3, **options)).result()
    # the process executor's helper process has a producer of its own for its run and rank:
    # saves from the training process go to another run (docs/training.md, DCP users)
    dcp.async_save(state, storage_writer=ckptd.dcp.StorageWriter(run=PROCESS_RUN, step=1, **options),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    with Producer(endpoint, "ps", staging_size="16MiB", timeout=20) as p:
        p.save(state, 1).wait(60)
    dist.barrier()

    m, o, target = fresh()
    dcp.load(target, checkpoint_id=str(out / "reference"))
    reference = loaded(m, o, target)
    same(reference, flat(state), "DCP's own save and load")
    for run, step in ((RUN, 1), (RUN, 2), (RUN, 3), (PROCESS_RUN, 1), ("ps", 1)):
        m, o, target = fresh()
        dcp.load(target, storage_reader=ckptd.dcp.StorageReader(run, step, root=root))
        same(loaded(m, o, target), reference, f"dcp.load of {run} step {step} through ckptd.dcp")
    m, o, target = fresh()
    ckptd.load_into(target, RUN, 1, root=root, verify=True)  # a DCP checkpoint, read by ckptd
    same(loaded(m, o, target), reference, "ckptd.load_into of the DCP checkpoint")
    m, o, target = fresh()
    dcp.load(target, storage_reader=ckptd.dcp.StorageReader(RUN, root=root))  # the newest complete: 3
    same(loaded(m, o, target), reference, "dcp.load of the newest step")
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in reference.items() if isinstance(v, torch.Tensor)},
                  str(out / "reference.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
