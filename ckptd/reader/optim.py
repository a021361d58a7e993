"""Optimizer states for ``ckptd.load_into``: one saved under one naming of its parameters
fills a target named the other way.

``torch.optim.Optimizer.state_dict()`` keys its per-parameter state by parameter number
(``optim.state.0.exp_avg``); ``torch.distributed.checkpoint.state_dict.get_state_dict``
by parameter name (``optim.state.0.weight.exp_avg``). Both list the keys of their
parameters in ``param_groups[i]["params"]``, in the order the optimizer holds them
(``get_state_dict`` maps the numbers to names in that very order), so the two lists,
read group by group, pair each target key with its saved one.

An optimizer has no state until its first step (a fresh Adam's ``state`` is empty):
there is then nothing in the target to fill, and no tensor of this job's layout (an
FSDP2 parameter's DTensor sharding) to fill it with. ``get_state_dict(model, opt)``
creates it first (a step with learning rate 0), which is what the error says to call.
"""

from __future__ import annotations

from typing import Any

# what the error for an optimizer without state says to call (tests/optim_resume_job.py runs it)
INIT_CALL = ("model_sd, optim_sd = torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)  "
             "# creates the optimizer's state (a step with lr 0)")


def is_optimizer_state(value: Any) -> bool:
    """Whether ``value`` is an optimizer's ``state_dict()`` (or ``get_state_dict``'s):
    ``{"state": {key: {...}}, "param_groups": [{"params": [key, ...], ...}, ...]}``."""
    return (isinstance(value, dict) and isinstance(value.get("state"), dict)
            and isinstance(value.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"]))


def _keys(state: dict) -> list[Any]:
    return [key for group in state["param_groups"] for key in group["params"]]


def param_keys(target: dict, saved: dict, where: str) -> dict[Any, Any]:
    """The saved key of each of the target's parameters. By name where both name them
    and the names agree; else by place, group by group, which needs the same groups
    of the same sizes (ValueError naming both otherwise)."""
    mine, theirs = _keys(target), _keys(saved)
    if all(isinstance(k, str) for k in mine + theirs) and set(mine) == set(theirs):
        return {k: k for k in mine}
    sizes = [len(g["params"]) for g in target["param_groups"]]
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != saved_sizes:
        raise ValueError(f"{where} is an optimizer state over {sizes} parameters (by param group) here, but over "
                         f"{saved_sizes} in the checkpoint; build the optimizer over the same parameters, in the "
                         "same param groups and order, as the job that saved it")
    return dict(zip(mine, theirs))


def check_has_state(target: dict, saved: dict, where: str, step: int) -> None:
    """A target with no per-parameter state at all cannot take a saved one that has it."""
    if not target["state"] and saved["state"]:
        raise ValueError(
            f"{where} is an optimizer state with no per-parameter state yet (torch.optim creates it at the "
            f"first step), while step {step} holds it for {len(saved['state'])} parameters: there is nothing to "
            f"fill. Create it first, as get_state_dict does, and load into what it returns: {INIT_CALL}; "
            "then ckptd.load_into({'model': model_sd, 'optim': optim_sd}, run) and "
            "torch.distributed.checkpoint.state_dict.set_state_dict(model, opt, model_state_dict=model_sd, "
            "optim_state_dict=optim_sd) (docs/training.md)")
