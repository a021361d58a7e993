"""A job torchrun starts for tests/test_optim_resume.py (gloo, CPU): FSDP2 + Adam saved the
way people save it, resumed by following ckptd's own error.

    torchrun --nproc_per_node=N tests/optim_resume_job.py MODE OUT_DIR

Modes:
  train    FSDP2 (fully_shard) + Adam on N ranks: train STEPS steps; at step SAVE_AT save
           {"model": model.state_dict(), "optim": opt.state_dict(), "step": s} (run RUN,
           the optimizer's state by parameter number) and the same state as get_state_dict
           gives it (run RUN-gsd, by parameter name); rank 0 writes the final weights and
           Adam state, whole, to OUT/final.safetensors.
  resume   on any number of ranks, for each of the two runs: a model of another init and
           a fresh Adam (no state yet); ckptd.load(run) must refuse, and the code its
           error shows is run as pasted; then train to STEPS and write
           OUT/resumed-<run>-<N>.safetensors as train did.

Every rank gets the same batch, so that the reduced gradient is the same sum of equal
terms on 1, 2 or 4 ranks: the resumed run can end bit-exact with the uninterrupted one on
another number of ranks. Failures raise; the test reads the exit status and stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptd  # noqa: E402
from ckptd import Producer, producer  # noqa: E402
from sharded_job import ROOT, RUN, batch  # noqa: E402

STEPS, SAVE_AT = 5, 2


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def whole(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and every Adam tensor, whole (gathered from the ranks' shards)."""
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.{p}.{k}": v for p, per in osd["state"].items() for k, v in per.items()})
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous().reshape(-1)
            for k, v in out.items()}


def train_and_save(out: Path) -> None:
    model, opt = build(seed=0)
    named = Producer(run=RUN + "-gsd", endpoint=None)
    for step in range(STEPS):
        train(model, opt, range(step, step + 1))
        if step == SAVE_AT:
            producer.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step).wait(60)
            msd, osd = get_state_dict(model, opt)
            named.save({"model": msd, "optim": osd, "step": step}, step).wait(60)
    named.close()
    final = whole(model, opt)
    if dist.get_rank() == 0:
        save_file(final, str(out / "final.safetensors"))


def resume(out: Path) -> None:
    world = dist.get_world_size()
    for run in (RUN, RUN + "-gsd"):
        model, opt = build(seed=1)  # another init, and a fresh Adam: no state yet
        assert not opt.state
        try:
            ckptd.load(run, root=ROOT)
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"ckptd.load({run!r}) under torchrun was not refused")
        code = "\n".join(line[4:] for line in message.splitlines() if line.startswith("    "))
        assert "load_into" in code and "opt" in code, message
        exec(code, {"ckptd": ckptd, "model": model, "opt": opt})  # as the user pastes it
        train(model, opt, range(SAVE_AT + 1, STEPS))
        final = whole(model, opt)
        if dist.get_rank() == 0:
            save_file(final, str(out / f"resumed-{run}-{world}.safetensors"))
            print(f"resumed {run} on {world} ranks with:\n{code}", flush=True)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    try:
        {"train": train_and_save, "resume": resume}[mode](out)
        producer.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
