"""`ckptd export`: each format read back by its own library, and the errors."""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptd
from ckptd.reader.export import export
from test_roundtrip import random_tensor, same_bits
from conftest import cli  # ckptd.cli.main in this process


def tensors_of(dtype_names: list[str]) -> dict[str, torch.Tensor]:
    shapes = [(), (0,), (3, 4)]
    return {f"{d}.{i}": random_tensor(d, s, 7 * i + len(d)) for d in dtype_names for i, s in enumerate(shapes)}


# every dtype safetensors' torch API holds (not complex32 or complex128)
ST_DTYPES = ["bfloat16", "bool", "complex64", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
             "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@pytest.fixture
def saved(make_daemon):
    """Step 5 of run t: nested tensors of many dtypes and plain values of every kind."""
    d = make_daemon(format="hdf5")
    state = {
        "model": OrderedDict((k.replace(".", "_"), v) for k, v in tensors_of(ST_DTYPES).items()),
        "optim": {"state": {0: {"step": torch.tensor(10.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "plain": {"none": None, "big": -(2**70), "nan": float("nan"), "s": "ünï", "b": b"\x00\xff",
                  "t": (1, [2]), "dtype": torch.bfloat16, "dev": torch.device("cuda:1"), "size": torch.Size([2])},
    }
    with d.producer() as p:
        p.save(state, 5, metadata={"loss": 0.25}).wait(30)
    return d, state


def test_export_to_safetensors(saved, tmp_path: Path) -> None:
    d, state = saved
    out = tmp_path / "x.safetensors"
    r = cli("export", "t", "5", "-o", str(out), "--root", str(d.root))
    assert r.returncode == 0, r.stderr
    flat = ckptd.load("t", 5, root=d.root, names=[n for n in _names(d)])
    with safe_open(str(out), "pt") as f:
        assert set(f.keys()) == set(flat)
        for name in f.keys():
            assert same_bits(f.get_tensor(name), flat[name]), name
        about = json.loads(f.metadata()["ckptd"])
    assert about["run"] == "t" and about["step"] == 5 and about["metadata"] == {"loss": 0.25}
    assert about["state"] == json.loads((d.root / "t" / "step-000000000005" / "manifest-r00000.json")
                                        .read_text())["state"]  # plain values included


def test_export_to_h5(saved, tmp_path: Path) -> None:
    d, _ = saved
    out = tmp_path / "x.h5"
    export("t", None, out, root=d.root)  # step None: the newest
    flat = ckptd.load("t", 5, root=d.root, names=_names(d))
    with h5py.File(out, "r") as f:
        got = {f[k].attrs["name"]: f[k] for k in f}
        assert set(got) == set(flat)
        for name, t in flat.items():
            assert got[name][()].tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name
            assert got[name].attrs["torch_dtype"] == str(t.dtype).removeprefix("torch.")
        assert json.loads(f.attrs["ckptd"])["metadata"] == {"loss": 0.25}


def test_export_to_pt_loads_with_weights_only(saved, tmp_path: Path) -> None:
    d, state = saved
    out = tmp_path / "x.pt"
    r = cli("export", "t", "-o", str(out), "--root", str(d.root))
    assert r.returncode == 0, r.stderr
    got = torch.load(out, weights_only=True)
    want = ckptd.load("t", root=d.root)
    assert type(got["model"]) is OrderedDict and list(got["model"]) == list(state["model"])
    for k, v in state["model"].items():
        assert same_bits(got["model"][k], v), k
    assert torch.equal(got["optim"]["state"][0]["step"], torch.tensor(10.0))
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    p = got["plain"]
    assert p["none"] is None and p["big"] == -(2**70) and math.isnan(p["nan"]) and p["s"] == "ünï"
    assert p["b"] == b"\x00\xff" and p["t"] == (1, [2]) and p["dtype"] is torch.bfloat16
    assert p["dev"] == torch.device("cuda:1") and p["size"] == torch.Size([2])


def test_export_errors_are_clear_and_leave_nothing(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    with d.producer() as p:
        p.save({"c": torch.ones(2, dtype=torch.complex128), "a": np.arange(3)}, 1).wait(30)
    root = str(d.root)
    cases = [
        (["-o", str(tmp_path / "x.npz")], "unknown suffix '.npz'"),
        (["-o", str(tmp_path / "x.safetensors")], "complex128: 'c'"),
        (["-o", str(tmp_path / "x.pt")], "numpy arrays ('a')"),
        (["-o", str(tmp_path / "nope" / "x.h5")], "does not exist"),
    ]
    for args, message in cases:
        r = cli("export", "t", "1", *args, "--root", root)
        assert r.returncode == 1 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    r = cli("export", "t", "9", "-o", str(tmp_path / "x.h5"), "--root", root)
    assert r.returncode == 1 and "no complete checkpoint at step 9" in r.stderr
    assert [n for n in os.listdir(tmp_path) if n != d.base.name] == []  # no file, no temp file left
    # the formats that can hold it do
    export("t", 1, tmp_path / "ok.h5", root=root)
    with h5py.File(tmp_path / "ok.h5", "r") as f:
        assert np.array_equal(f["a"][()], np.arange(3)) and f["c"][()].dtype == np.complex128


def _names(d) -> list[str]:
    return list(json.loads((d.root / "t" / "step-000000000005" / "manifest-r00000.json").read_text())["tensors"])
