"""A real model and optimizer: save, load into fresh objects, continue: bitwise identical."""

from __future__ import annotations

import torch

import ckptd


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
        torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)  # the batch of a step depends on the step only
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_resume_from_checkpoint_is_bitwise_identical_to_never_stopping(daemon) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ref_model, ref_opt = make()
    train(ref_model, ref_opt, range(0, 20))

    model, opt = make()
    train(model, opt, range(0, 10))
    with daemon.producer() as p:
        info = p.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 9}, 9).wait(30)
    assert info.step == 9
    # training goes on and changes the live tensors; the checkpoint must not see it
    train(model, opt, range(10, 13))

    fresh_model, fresh_opt = make()
    state = ckptd.load("t", root=daemon.root)
    assert state["step"] == 9
    fresh_model.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    train(fresh_model, fresh_opt, range(10, 20))

    for (name, a), b in zip(ref_model.state_dict().items(), fresh_model.state_dict().values()):
        assert torch.equal(a, b), name
    ref_state, new_state = ref_opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for k in ref_state:
        for field in ref_state[k]:
            assert torch.equal(ref_state[k][field], new_state[k][field]), (k, field)
