"""Sharded training with real torchrun (gloo on CPU), a real daemon and DCP as the
reference: FSDP2 save, kill -9, resume; resharding 2 -> 1, 2 -> 4 and 1 -> 4, into
FSDP2, TP and FSDP x TP layouts; DDP with one copy of replicated state.
The jobs themselves are tests/sharded_job.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import torch
from safetensors.torch import load_file

import ckptd

JOB = Path(__file__).with_name("sharded_job.py")
SAVE_AT = 3


def torchrun(daemon, nproc: int, mode: str, out: Path, run: str = "fsdp", expect_ok: bool = True) -> str:
    return conftest.torchrun(JOB, daemon, nproc, mode, out, run=run, expect_ok=expect_ok)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One FSDP2 job on 2 ranks: saves step 3 (ckptd and DCP), trains on, is killed -9."""
    from conftest import Daemon

    base = tmp_path_factory.mktemp("fsdp")
    daemon = Daemon(base / "d").start()
    out = base / "out"
    out.mkdir()
    try:
        text = torchrun(daemon, 2, "fsdp-train", out, expect_ok=False)
        assert (out / "final-uninterrupted.safetensors").exists(), text[-6000:]
        # the same state saved whole by one process: for loads 1 -> N
        with daemon.producer("fsdp-whole") as p:
            p.save(ckptd.load("fsdp", SAVE_AT, root=daemon.root), SAVE_AT).wait(60)
        yield daemon, out
    finally:
        daemon.cleanup()


@pytest.mark.slow
def test_fsdp2_resume_after_kill_is_bit_exact(fsdp_run) -> None:
    daemon, out = fsdp_run
    info = ckptd.latest("fsdp", root=daemon.root)
    assert info is not None and info.step == SAVE_AT
    # step 0 was emitted: a Replicate DTensor written by one rank, a Shard(0) one by both
    manifests = [json.loads((Path(info.path).parent / "step-000000000000" / f"manifest-r0000{r}.json").read_text())
                 for r in (0, 1)]
    writers = [r for r in (0, 1) if "rep" in manifests[r]["tensors"]]
    assert len(writers) == 1 and manifests[1 - writers[0]]["replicas"] == {"rep": writers[0]}
    assert manifests[1]["tensors"]["sharded"]["shard"]["offsets"] == [2]
    step0 = ckptd.load("fsdp", 0, root=daemon.root)
    assert torch.equal(step0["rep"], torch.arange(4.0)) and torch.equal(step0["sharded"], torch.tensor([0., 0, 1, 1]))
    torchrun(daemon, 2, "fsdp-resume", out)
    want = load_file(str(out / "final-uninterrupted.safetensors"))
    got = load_file(str(out / "final-resumed.safetensors"))
    assert want.keys() == got.keys() and len(want) == 4
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.slow
def test_fsdp2_checkpoint_reshards_into_4_ranks_tp_and_fsdp_x_tp(fsdp_run) -> None:
    daemon, out = fsdp_run
    text = torchrun(daemon, 4, "reshard", out)
    for layout in ("fsdp", "tp", "fsdp_x_tp"):
        for run in ("fsdp", "fsdp-whole"):  # 2 -> 4 and 1 -> 4
            for rank in range(4):
                assert f"rank {rank}: {layout} from {run}: 16 tensors equal" in text, text[-4000:]


@pytest.mark.slow
def test_fsdp2_checkpoint_loads_whole_in_one_plain_process(fsdp_run) -> None:
    """No torch.distributed process group: ``ckptd.load`` assembles every tensor, and
    ``load_into`` fills plain tensors; both equal DCP's own load of its save."""
    daemon, out = fsdp_run
    script = f"""
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, ckptd
assert not dist.is_initialized()
whole = ckptd.load("fsdp", {SAVE_AT}, root={str(daemon.root)!r})
assert whole["step"] == {SAVE_AT}
ref = {{"model": {{k: torch.zeros_like(v) for k, v in whole["model"].items()}},
        "optim": {{"state": {{p: {{k: torch.zeros_like(v) for k, v in s.items()}} for p, s in whole["optim"]["state"].items()}},
                  "param_groups": whole["optim"]["param_groups"]}}}}
dcp.load(ref, checkpoint_id={str(out / "dcp")!r})
mine = {{"model": {{k: torch.full_like(v, 7) for k, v in whole["model"].items()}},
         "optim": {{"state": {{p: {{k: torch.full_like(v, 7) for k, v in s.items()}} for p, s in whole["optim"]["state"].items()}},
                   "param_groups": [{{"lr": 0.5}}]}}}}
ckptd.load_into(mine, "fsdp", root={str(daemon.root)!r}, verify=True)
assert mine["optim"]["param_groups"][0]["lr"] == whole["optim"]["param_groups"][0]["lr"]
assert whole["model"]["2.weight"].shape == (7, 8)
n = 0
for part in ("model", "optim"):
    def walk(a, b, c, where):
        global n
        if isinstance(a, dict):
            for k in a: walk(a[k], b[k], c[k], where + "." + str(k))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c), where
            n += 1
    walk(whole[part], ref[part], mine[part] if part == "model" else mine[part], part)
print("equal", n)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "equal 16" in proc.stdout  # 4 parameters, 3 Adam tensors for each


@pytest.mark.slow
def test_plain_load_of_a_sharded_step_under_torchrun_names_load_into(fsdp_run) -> None:
    """``model.load_state_dict(ckptd.load(run)["model"])`` on an FSDP2 model under torchrun:
    ckptd refuses with its own message naming ``ckptd.load_into`` (not PyTorch's size
    mismatch), and what the message says to do restores the saved weights."""
    daemon, out = fsdp_run
    job = Path(__file__).with_name("plain_load_job.py")
    env = dict(os.environ, CKPTD_RUN="fsdp", CKPTD_ROOT=str(daemon.root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           "--max-restarts", "0", "--monitor-interval", "0.2", str(job), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for rank in (0, 1):
        result = json.loads((out / f"plain-load-r{rank}.json").read_text())
        error = result["error"]
        assert error is not None and not error.startswith("PyTorch"), error
        assert f"ckptd.load_into({{'model': model_sd, 'optim': optim_sd}}, 'fsdp', {SAVE_AT}, root=" in error, error
        assert f"step {SAVE_AT} of run 'fsdp'" in error and "model_sd, optim_sd = get_state_dict(model, opt)" in error
        assert re.search(r"a \[\d+, \d+\] piece of \[\d+, \d+\]", error) and "rank=" in error, error
        # the last layer's 7 rows, sharded over 2 ranks: 4 and 3
        assert result["piece_shape"] == [[4, 8], [3, 8]][rank], result
    whole = ckptd.load("fsdp", SAVE_AT, root=daemon.root)["model"]  # no RANK here: the whole state
    got = load_file(str(out / "plain-load-weights.safetensors"))
    assert got.keys() == whole.keys()
    for name in whole:
        assert torch.equal(got[name], whole[name]), name


@pytest.mark.slow  # its checkpoint comes from the torchrun job
def test_load_into_names_what_does_not_match(fsdp_run) -> None:
    daemon, _ = fsdp_run
    root = daemon.root
    with pytest.raises(ValueError, match=r"tensor 'model.2.weight' has shape \[7, 15\] here, but \[7, 8\]"):
        ckptd.load_into({"model": {"2.weight": torch.zeros(7, 15)}}, "fsdp", root=root)
    with pytest.raises(ValueError, match=r"tensor 'model.2.bias' is float64 here, but float32"):
        ckptd.load_into({"model": {"2.bias": torch.zeros(7, dtype=torch.float64)}}, "fsdp", root=root)
    with pytest.raises(ckptd.CheckpointNotFound, match=r"has no 'model.9.weight'.*strict=False"):
        ckptd.load_into({"model": {"9.weight": torch.zeros(3), "2.bias": torch.zeros(7)}}, "fsdp", root=root)
    partial = {"model": {"9.weight": torch.zeros(3), "2.bias": torch.zeros(7)}, "epoch": -1}
    ckptd.load_into(partial, "fsdp", root=root, strict=False)
    whole = ckptd.load("fsdp", root=root)
    assert torch.equal(partial["model"]["2.bias"], whole["model"]["2.bias"])
    assert torch.equal(partial["model"]["9.weight"], torch.zeros(3)) and partial["epoch"] == -1


@pytest.mark.slow
def test_ddp_replicated_state_is_one_copy_and_resumes_bit_exact(daemon, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torchrun(daemon, 2, "ddp", out, run="ddp")
    figures = json.loads((out / "ddp.json").read_text())
    ratio = figures["disk_bytes"] / figures["state_bytes"]
    print(f"DDP on {figures['ranks']} ranks, replicated=True: {figures['disk_bytes']} bytes on disk for "
          f"{figures['state_bytes']} bytes of state per rank ({ratio:.3f}x)")
    assert ratio <= 1.1
    step = Path(ckptd.latest("ddp", root=daemon.root).path)
    written = {r: json.loads((step / f"manifest-r0000{r}.json").read_text()) for r in (0, 1)}
    assert written[0]["tensors"] and written[1]["tensors"]  # the work is spread over both ranks
    assert not set(written[0]["tensors"]) & set(written[1]["tensors"])
