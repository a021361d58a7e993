"""A training job that torchrun starts for tests/test_sharded_training.py (gloo, CPU).

    torchrun --nproc_per_node=N tests/sharded_job.py MODE OUT_DIR

Modes:
  fsdp-train   FSDP2 (fully_shard) + Adam: train STEPS steps, save step SAVE_AT with
               producer.save (and with DCP's own dcp.save into OUT/dcp, the reference),
               write the final weights to OUT/final-uninterrupted.safetensors, then
               kill -9 itself (every rank): the job dies without closing anything.
  fsdp-resume  FSDP2 on the same world size: load_into the newest checkpoint, train
               to STEPS, write OUT/final-resumed.safetensors.
  reshard      on any world size: load the checkpoint (and its copy that one process
               saved whole, run "<run>-whole") into an FSDP2 model, a
               tensor-parallel model (ColwiseParallel / RowwiseParallel) and a 2-D
               FSDP x TP model, each with ckptd.load_into and with dcp.load from the
               reference; every value must be equal.
  ddp          DDP + Adam with producer.save(..., replicated=True): train, save,
               keep training (uninterrupted reference); load every rank's state back
               into fresh objects, train the same steps again: bit-equal. Writes
               OUT/ddp.json with the bytes on disk.

The last layer has 7 outputs, so that FSDP shards are uneven over 2 and 4 ranks (TP
shards the hidden 8, which DTensor needs even).
Failures raise; the test reads the exit status and stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ckptd
from ckptd import producer

STEPS, SAVE_AT = 6, 3
RUN = os.environ["CKPTD_RUN"]
ROOT = os.environ["CKPTD_ROOT"]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 7))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank
    return torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def fsdp(mesh=None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def tensor_parallel(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = parallelize_module(make_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def fsdp_tp(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.state_dict().items():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone().contiguous()
    return out


def state_of(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assert_same(a: dict, b: dict, what: str) -> int:
    fa, fb = dict(flat(a)), dict(flat(b))
    assert fa.keys() == fb.keys(), (what, sorted(fa.keys() ^ fb.keys()))
    n = 0
    for name, x in fa.items():
        y = fb[name]
        if isinstance(x, torch.Tensor):
            assert type(x) is type(y), (what, name)
            if isinstance(x, DTensor):
                assert x.placements == y.placements, (what, name, x.placements, y.placements)
                x, y = x.to_local(), y.to_local()
            assert x.dtype == y.dtype and x.shape == y.shape, (what, name, x.shape, y.shape)
            assert torch.equal(x, y), (what, name, x, y)
            n += 1
        else:
            assert x == y, (what, name, x, y)
    return n


def fsdp_train(out: Path) -> None:
    model, opt = fsdp()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # emit takes DTensors too: a Replicate one is written by one rank only
    producer.emit("rep", DTensor.from_local(torch.arange(4.0), mesh, [Replicate()]), step=0)
    producer.emit("sharded", DTensor.from_local(torch.full((2,), float(dist.get_rank())), mesh, [Shard(0)]), step=0)
    producer.commit(0).wait(60)
    # a placement ckptd cannot place is refused before anything is sent
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        producer.save({"p": partial}, 100)
    except TypeError as exc:
        assert "Partial" in str(exc) and "'p'" in str(exc) and "redistribute" in str(exc), exc
    else:
        raise AssertionError("a Partial DTensor was accepted")
    for step in range(STEPS):
        train(model, opt, range(step, step + 1))
        if step == SAVE_AT:
            state = state_of(model, opt)
            handle = producer.save({**state, "step": step}, step)
            dcp.save(state, checkpoint_id=str(out / "dcp"))
            handle.wait(60)
    weights = full_weights(model)
    if dist.get_rank() == 0:
        save_file(weights, str(out / "final-uninterrupted.safetensors"))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies: nothing closed, nothing flushed


def fsdp_resume(out: Path) -> None:
    model, opt = fsdp()
    train(model, opt, range(0, 1))  # optimizer state exists, then is overwritten
    state = state_of(model, opt)
    target = {**state, "step": -1}
    info = ckptd.load_into(target, RUN, root=ROOT, verify=True)
    assert info.step == SAVE_AT and target["step"] == SAVE_AT, (info, target["step"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, range(SAVE_AT + 1, STEPS))
    weights = full_weights(model)
    if dist.get_rank() == 0:
        save_file(weights, str(out / "final-resumed.safetensors"))


def reshard(out: Path) -> None:
    world = dist.get_world_size()
    layouts = {"fsdp": lambda: fsdp(), "tp": lambda: tensor_parallel(init_device_mesh("cpu", (world,)))}
    if world % 2 == 0 and world > 2:
        layouts["fsdp_x_tp"] = lambda: fsdp_tp(world)
    for what, build in layouts.items():
        ref_model, ref_opt = build()
        train(ref_model, ref_opt, range(100, 101))
        ref = state_of(ref_model, ref_opt)
        dcp.load(ref, checkpoint_id=str(out / "dcp"))
        # from the 2-rank FSDP2 checkpoint, and from the same state saved whole by 1 process
        for run in (RUN, RUN + "-whole"):
            model, opt = build()
            train(model, opt, range(100, 101))  # optimizer state exists, with values that must go
            mine = state_of(model, opt)
            before = {k: _local(v).clone() for k, v in flat(mine) if isinstance(v, torch.Tensor)}
            ckptd.load_into(mine, run, SAVE_AT, root=ROOT)
            after = {k: _local(v) for k, v in flat(mine) if isinstance(v, torch.Tensor)}
            stale = [k for k, v in before.items() if v.numel() and torch.equal(v, after[k])]
            assert not stale, (what, run, "not loaded", stale)
            n = assert_same(mine, ref, f"{what} on {world} ranks from {run}")
            print(f"rank {dist.get_rank()}: {what} from {run}: {n} tensors equal to dcp.load", flush=True)


def ddp(out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def step_batch(step):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())  # each rank its own data
        return torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g)

    def run(model, opt, steps):
        for step in steps:
            x, y = step_batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, opt = build()
    run(model, opt, range(0, SAVE_AT + 1))
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": SAVE_AT}
    info = producer.save(state, SAVE_AT, replicated=True).wait(60)
    run(model, opt, range(SAVE_AT + 1, STEPS))
    dist.barrier()  # every rank's share is committed
    state_bytes = sum(t.nbytes for _, t in flat(state) if isinstance(t, torch.Tensor))
    step_dir = Path(info.path)
    disk = sum(f.stat().st_size for f in step_dir.iterdir())

    fresh, fresh_opt = build()
    loaded = ckptd.load(RUN, SAVE_AT, root=ROOT, rank=dist.get_rank(), verify=True)
    assert loaded["step"] == SAVE_AT
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optim"])
    run(fresh, fresh_opt, range(SAVE_AT + 1, STEPS))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for k, per in opt.state_dict()["state"].items():
        for field, v in per.items():
            assert torch.equal(v, fresh_opt.state_dict()["state"][k][field]), (k, field)
    if dist.get_rank() == 0:
        (out / "ddp.json").write_text(json.dumps({"state_bytes": state_bytes, "disk_bytes": disk,
                                                  "ranks": dist.get_world_size()}))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    try:
        {"fsdp-train": fsdp_train, "fsdp-resume": fsdp_resume, "reshard": reshard, "ddp": ddp}[mode](out)
        producer.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
