from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch

from ckptd import state


def test_names_follow_dcp_flattening() -> None:
    s = {"model": {"layers": [{"weight": torch.ones(1)}]}, "optim": {"state": {3: {"exp_avg": torch.ones(1)}}}}
    structure, tensors = state.flatten(s)
    assert list(tensors) == ["model.layers.0.weight", "optim.state.3.exp_avg"]
    assert list(state.tensor_names(structure)) == list(tensors)
    json.dumps(structure, allow_nan=False)  # the structure is plain JSON


def test_round_trip_without_tensors_is_exact() -> None:
    s = OrderedDict([("a", (1, [2.5, None], {"k": b"\x01"})), (7, "x")])
    s._metadata = {"": {"version": 2}}
    structure, tensors = state.flatten(s)
    out = state.unflatten(json.loads(json.dumps(structure)), tensors.__getitem__)
    assert out == s and type(out) is OrderedDict and out._metadata == {"": {"version": 2}}


def test_module_state_dict_keeps_its_version_metadata() -> None:
    sd = torch.nn.BatchNorm1d(3).state_dict()
    structure, tensors = state.flatten(sd)
    out = state.unflatten(structure, tensors.__getitem__)
    assert out._metadata == sd._metadata


@pytest.mark.parametrize("value", [object(), {1.5: 1}, {True: 1}, set([1]), torch.nn.Linear(1, 1)])
def test_unstorable(value) -> None:
    with pytest.raises(TypeError):
        state.flatten({"x": value})
