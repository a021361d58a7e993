"""Replica comparison under real torchrun (gloo, CPU): DDP on 3 ranks, HSDP (FSDP2 on a
2 x 2 mesh) and tensor parallel with Replicate() norms, each with one bit of one rank's
copy of a parameter flipped before a save (tests/replicas_job.py). The step names the
tensor and the rank, ``ckptd verify`` fails naming them, a clean step reports ``{}``, and
under "refuse" a restarted job resumes from the step before (docs/training.md)."""

from __future__ import annotations

import json
from pathlib import Path

import conftest
import pytest

import ckptd
from conftest import cli

JOB = Path(__file__).with_name("replicas_job.py")


def torchrun(daemon, nproc: int, mode: str, out: Path) -> None:
    conftest.torchrun(JOB, daemon, nproc, mode, out, timeout=400)


@pytest.fixture(scope="module")
def flipped(tmp_path_factory):
    """The 4-rank job that saves DDP, HSDP and TP runs with one bit flipped (once for the module)."""
    from conftest import Daemon

    base = tmp_path_factory.mktemp("replicas")
    daemon = Daemon(base / "d").start()
    out = base / "out"
    out.mkdir()
    try:
        torchrun(daemon, 4, "flips", out)
        results = [json.loads((out / f"flips-r{r}.json").read_text()) for r in range(4)]
        yield daemon, out, results
    finally:
        daemon.cleanup()


def _diverged(daemon, run: str) -> dict[int, dict | None]:
    return {i.step: i.diverged for i in ckptd.list_checkpoints(run, root=daemon.root)}


def _verify_names(daemon, run: str, step: int, tensor: str, ranks: list[int]) -> None:
    r = cli("verify", run, str(step), "--root", str(daemon.root))
    assert r.returncode == 1, r.stdout + r.stderr
    for rank in ranks:
        assert f"tensor {tensor!r}" in r.stderr and f"rank {rank} (host " in r.stderr, r.stderr
    assert json.loads(cli("verify", run, str(step), "--root", str(daemon.root), "--json").stdout)["diverged"] \
        == {tensor: ranks}


@pytest.mark.slow
def test_ddp_on_3_ranks_names_the_flipped_tensor_and_rank(flipped) -> None:
    daemon, _, results = flipped
    assert _diverged(daemon, "ddp") == {1: {}, 2: {"model.module.2.weight": [2]}, 3: {}}
    _verify_names(daemon, "ddp", 2, "model.module.2.weight", [2])
    for step in (1, 3):
        assert cli("verify", "ddp", str(step), "--root", str(daemon.root)).returncode == 0
    # "warn": the flipped step was the latest when it was made; each commit's info saw the
    # comparison where its rank completed the step (the others' shares alone: None)
    assert ckptd.latest("ddp", root=daemon.root).step == 3
    step2 = [r["ddp"]["steps"][1] for r in results[:3]]
    assert any(s["diverged"] == {"model.module.2.weight": [2]} for s in step2), step2
    assert all(s["diverged"] in (None, {"model.module.2.weight": [2]}) for s in step2), step2
    assert "replicas of tensor 'model.module.2.weight' disagree: rank 2" in daemon.log_tail(2000)


@pytest.mark.slow
def test_ddp_under_refuse_resumes_from_the_step_before(flipped) -> None:
    daemon, out, _ = flipped
    assert _diverged(daemon, "ddp-refuse") == {1: {}, 2: {"model.module.2.weight": [1]}, 3: {}}
    # step 3 is clean again: the newest; without it, a restart must skip the refused step 2
    assert ckptd.latest("ddp-refuse", root=daemon.root).step == 3
    step3 = daemon.root / "ddp-refuse" / "step-000000000003"
    for f in step3.iterdir():
        f.unlink()
    step3.rmdir()
    (daemon.root / "ddp-refuse" / "latest").unlink()  # a reader follows the scan
    assert ckptd.latest("ddp-refuse", root=daemon.root).step == 1
    infos = ckptd.list_checkpoints("ddp-refuse", root=daemon.root)
    assert [(i.step, i.refused) for i in infos] == [(1, False), (2, True)]
    torchrun(daemon, 3, "resume", out)
    for rank in range(3):
        assert json.loads((out / f"resume-r{rank}.json").read_text()) == {"step": 1, "same_as_step_1": True}
    listed = cli("list", "ddp-refuse", "--root", str(daemon.root)).stdout
    assert "refused: replicas differ: model.module.2.weight on ranks 1" in listed, listed


@pytest.mark.slow
def test_hsdp_names_both_holders_of_the_flipped_shard(flipped) -> None:
    daemon, _, _ = flipped
    # rank 3's shard of model.0.weight has one other copy, on rank 1: two copies, both named
    assert _diverged(daemon, "hsdp") == {1: {}, 2: {"model.0.weight": [1, 3]}}
    _verify_names(daemon, "hsdp", 2, "model.0.weight", [1, 3])


@pytest.mark.slow
def test_tp_names_the_rank_of_the_flipped_norm(flipped) -> None:
    daemon, _, _ = flipped
    assert _diverged(daemon, "tp") == {1: {}, 2: {"model.1.weight": [0]}}
    _verify_names(daemon, "tp", 2, "model.1.weight", [0])
