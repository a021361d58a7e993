"""The DCP storage layer (ckptd.dcp), with the real torch.distributed.checkpoint: FSDP2 on
2 ranks under torchrun (dcp.save, dcp.async_save with both executors, dcp.load, and the
cross loads: a DCP checkpoint read by ckptd.load_into and ckptd.load, a producer.save'd
one read by dcp.load), single-process use, and kill -9 of the daemon mid-save."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
import ckptd.dcp
import dcp_job as job
from conftest import cli  # ckptd.cli.main in this process


@pytest.mark.slow
def test_fsdp2_two_ranks_dcp_save_async_save_load_and_cross_loads(daemon, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(job.__file__)), daemon.endpoint, str(daemon.root), str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-8000:]
    # in this process, without torch.distributed: every value equal to DCP's own save and load
    reference = load_file(str(out / "reference.safetensors"))
    assert any(k.startswith("optim.state.") for k in reference) and "model.0.weight" in reference
    assert reference["model.0.weight"].shape == (5, 6)  # sharded 3 + 2 rows: uneven
    for run_id in (job.RUN, job.PROCESS_RUN, "ps"):
        whole = ckptd.load(run_id, 1, root=daemon.root, names=list(reference))  # assembled from 2 ranks
        assert all(torch.equal(whole[k], v) for k, v in reference.items()), run_id
        target = {k: torch.zeros_like(v) for k, v in reference.items()}
        ckptd.load_into(target, run_id, 1, root=daemon.root, verify=True)
        assert all(torch.equal(target[k], v) for k, v in reference.items()), run_id
        target = {k: torch.zeros_like(v) for k, v in reference.items()}
        dcp.load(target, storage_reader=ckptd.dcp.StorageReader(run_id, 1, root=daemon.root), no_dist=True)
        assert all(torch.equal(target[k], v) for k, v in reference.items()), run_id
    nested = ckptd.load(job.RUN, 2, root=daemon.root)  # the whole state, structure included
    assert torch.equal(nested["model"]["0.weight"], reference["model.0.weight"])
    assert nested["optim"]["param_groups"][0]["lr"] == 1e-2
    # ordinary ckptd steps: listed, verified, and only safetensors and JSON on disk
    listed = json.loads(cli("list", job.RUN, "--root", str(daemon.root), "--json").stdout)
    assert [i["step"] for i in listed] == [1, 2, 3]
    assert cli("verify", job.RUN, "3", "--root", str(daemon.root)).returncode == 0
    step = daemon.root / job.RUN / "step-000000000001"
    assert {p.suffix for p in step.iterdir()} == {".json", ".safetensors"}
    rank0 = json.loads((step / "manifest-r00000.json").read_text())
    meta = rank0["metadata"][ckptd.dcp.METADATA_KEY]
    assert meta["state_dict_metadata"]["model.0.weight"]["tensor"]["chunks"] == [[[0, 0], [3, 6]], [[3, 0], [2, 6]]]
    assert rank0["tensors"]["model.0.weight"]["shard"]["global_shape"] == [5, 6]


def small_state(seed: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": {f"t{i}": torch.randn(2**14, generator=g) for i in range(n)}, "epoch": seed, "tag": [1, "x"]}


def test_single_process_dcp_save_and_load(daemon) -> None:
    state = small_state(1)
    writer = ckptd.dcp.StorageWriter(run="one", step=7, endpoint=daemon.endpoint, staging_size="8MiB", timeout=60,
                                     metadata={"loss": 0.5})
    dcp.save(state, storage_writer=writer, no_dist=True)
    info = ckptd.latest("one", root=daemon.root)  # dcp.save returns once the step is complete
    assert info.step == 7 and info.metadata == {"loss": 0.5}  # DCP's own metadata stays in the manifest
    target = small_state(2)
    dcp.load(target, storage_reader=ckptd.dcp.StorageReader("one", root=daemon.root), no_dist=True)
    assert target["epoch"] == 1 and target["tag"] == [1, "x"]
    assert all(torch.equal(target["w"][k], v) for k, v in state["w"].items())
    out = daemon.base / "one.safetensors"  # an ordinary step: `ckptd export` takes it as any other
    assert cli("export", "one", "7", "-o", str(out), "--root", str(daemon.root)).returncode == 0
    exported = load_file(str(out))
    assert exported.keys() == {f"w.t{i}" for i in range(4)} and torch.equal(exported["w.t0"], state["w"]["t0"])
    # DCP hands on what its storage layer raised inside a CheckpointException (with its traceback)
    with pytest.raises(CheckpointException, match="ValueError: ckptd.dcp.StorageWriter: no step; pass StorageWriter"):
        dcp.save(state, storage_writer=ckptd.dcp.StorageWriter(run="one", endpoint=daemon.endpoint), no_dist=True)
    with pytest.raises(CheckpointException, match=r"TypeError: state\['x'\] is a builtins.object, which ckptd cannot "
                       "store without pickling"):
        dcp.save({"x": object()}, storage_writer=ckptd.dcp.StorageWriter(
            run="one", step=8, endpoint=daemon.endpoint, staging_size="8MiB", timeout=60), no_dist=True)


def test_kill_daemon_during_dcp_save_leaves_the_previous_step_latest(make_daemon) -> None:
    d = make_daemon()
    options = dict(endpoint=d.endpoint, staging_size="4MiB", timeout=60)
    first = small_state(1)
    dcp.save(first, storage_writer=ckptd.dcp.StorageWriter(run="k", step=1, **{**options, "timeout": 60}), no_dist=True)
    big = {"w": {f"t{i}": torch.full((2**20,), float(i)) for i in range(48)}}  # 192 MiB through 4 MiB
    failure: list[BaseException] = []

    def save() -> None:
        try:
            dcp.save(big, storage_writer=ckptd.dcp.StorageWriter(run="k", step=2, **options), no_dist=True)
        except BaseException as exc:  # reported below
            failure.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 30
    while not list((d.root / "k").glob("step-000000000002/*.safetensors")):  # mid-save: files of step 2
        assert time.monotonic() < deadline and saver.is_alive(), d.log_text()
        time.sleep(0.01)
    d.kill()
    saver.join(60)
    assert not saver.is_alive() and failure, "the save did not fail"
    assert ckptd.latest("k", root=d.root).step == 1
    d.start()  # its start-up clean-up removes what step 2 left
    assert not (d.root / "k" / "step-000000000002").exists()
    target = small_state(3)
    dcp.load(target, storage_reader=ckptd.dcp.StorageReader("k", root=d.root, verify=True), no_dist=True)
    assert target["epoch"] == 1 and all(torch.equal(target["w"][k], v) for k, v in first["w"].items())


def test_async_storage_writer_stages_into_ckptd_and_keeps_the_snapshot(daemon) -> None:
    state = small_state(4)
    want = {k: v.clone() for k, v in state["w"].items()}
    options = dict(endpoint=daemon.endpoint, staging_size="8MiB", timeout=60)
    future = dcp.async_save(state, storage_writer=ckptd.dcp.AsyncStorageWriter(run="st", step=1, **options),
                            no_dist=True)
    for t in state["w"].values():  # the training loop goes on at once: the checkpoint is not torn
        t.add_(1.0)
    state["epoch"] = 99
    future.result()
    target = small_state(5)
    dcp.load(target, storage_reader=ckptd.dcp.StorageReader("st", 1, root=daemon.root, verify=True), no_dist=True)
    assert target["epoch"] == 4 and all(torch.equal(target["w"][k], v) for k, v in want.items())
    # the process executor pickles the writer to send it to its helper process: refused
    with pytest.raises(TypeError, match="cannot go to another process .*use ckptd.dcp.StorageWriter there"):
        pickle.dumps(ckptd.dcp.AsyncStorageWriter(run="st", step=2, **options))
    pickle.loads(pickle.dumps(ckptd.dcp.StorageWriter(run="st", step=2, **options)))  # it can
    assert [i.step for i in ckptd.list_checkpoints("st", root=daemon.root)] == [1]
