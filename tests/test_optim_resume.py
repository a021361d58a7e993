"""Resuming an optimizer however it was saved: ``opt.state_dict()`` keys its state by
parameter number, ``get_state_dict`` by parameter name; ``load_into`` fills either from
either through ``param_groups``. Under torchrun (gloo, CPU, FSDP2 + Adam, a real daemon)
a job saved the natural way resumes by running the code ckptd's own refusal shows, on
the same and on another number of ranks, and ends bit-exact with the uninterrupted run.
The torchrun jobs are tests/optim_resume_job.py."""

from __future__ import annotations

from pathlib import Path

import conftest
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd

JOB = Path(__file__).with_name("optim_resume_job.py")


def model_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    return model, torch.optim.Adam([{"params": model[0].parameters()},
                                    {"params": model[2].parameters(), "lr": 0.5}], lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def adam_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for per in opt.state_dict()["state"].values() for v in per.values()]


@pytest.mark.parametrize("saved_form", ["numbers", "names"])
@pytest.mark.parametrize("target_form", ["numbers", "names"])
def test_optimizer_state_loads_across_namings(daemon, saved_form: str, target_form: str) -> None:
    model, opt = model_and_adam(0)
    train(model, opt, range(3))
    if saved_form == "numbers":
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
    with daemon.producer("opt") as p:
        p.save(state, 3).wait(30)
    names = [n for n in ckptd.load("opt", 3, root=daemon.root, names=None)["optim"]["state"]]
    assert names == ([0, 1, 2, 3] if saved_form == "numbers" else ["0.weight", "0.bias", "2.weight", "2.bias"])

    fresh, fresh_opt = model_and_adam(1)
    fresh_opt.param_groups[1]["lr"] = 0.125  # a plain value the checkpoint replaces
    msd, osd = get_state_dict(fresh, fresh_opt)  # creates Adam's state (a step with lr 0)
    if target_form == "numbers":
        target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    else:
        target = {"model": msd, "optim": osd}
    keys_before = [g["params"] for g in target["optim"]["param_groups"]]
    ckptd.load_into(target, "opt", root=daemon.root, verify=True)
    # the target keeps its own parameter keys; lr comes back from the checkpoint
    assert [g["params"] for g in target["optim"]["param_groups"]] == keys_before
    assert target["optim"]["param_groups"][1]["lr"] == 0.5
    if target_form == "numbers":
        fresh.load_state_dict(target["model"])
        fresh_opt.load_state_dict(target["optim"])
    else:
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    train(model, opt, range(3, 5))
    train(fresh, fresh_opt, range(3, 5))
    for a, b in zip(list(model.parameters()) + adam_tensors(opt), list(fresh.parameters()) + adam_tensors(fresh_opt)):
        assert torch.equal(a, b)


def test_fresh_optimizer_state_is_refused_naming_what_creates_it(daemon) -> None:
    model, opt = model_and_adam(0)
    train(model, opt, range(1))
    with daemon.producer("opt") as p:
        p.save({"model": model.state_dict(), "optim": opt.state_dict()}, 1).wait(30)
    fresh, fresh_opt = model_and_adam(1)
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}  # Adam has no state yet
    with pytest.raises(ValueError, match=r"state\['optim'\] is an optimizer state with no per-parameter state yet"
                       r".*step 1 holds it for 4 parameters.*get_state_dict\(model, opt\)"):
        ckptd.load_into(target, "opt", root=daemon.root)
    with pytest.raises(ValueError, match=r"state\['optim'\] is an optimizer state over \[1, 2\] parameters .*"
                       r"but over \[2, 2\] in the checkpoint"):
        other = torch.optim.Adam([{"params": [fresh[0].weight]}, {"params": list(fresh[2].parameters())}])
        get_state_dict(fresh, other)
        ckptd.load_into({"optim": other.state_dict()}, "opt", root=daemon.root)


def torchrun(daemon, nproc: int, mode: str, out: Path) -> str:
    return conftest.torchrun(JOB, daemon, nproc, mode, out, run="natural")


@pytest.mark.slow
def test_fsdp2_saved_naturally_resumes_by_the_errors_recipe_bit_exact(daemon, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torchrun(daemon, 2, "train", out)
    want = load_file(str(out / "final.safetensors"))
    assert len(want) == 4 + 4 * 3  # 4 parameters, Adam's step, exp_avg and exp_avg_sq of each
    for world in (2, 4):
        text = torchrun(daemon, world, "resume", out)
        for run in ("natural", "natural-gsd"):
            assert f"resumed {run} on {world} ranks with:" in text, text[-3000:]
            got = load_file(str(out / f"resumed-{run}-{world}.safetensors"))
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(want[name], got[name]), (run, world, name)
    assert "get_state_dict(model, opt)" in text and "set_state_dict(model, opt" in text
