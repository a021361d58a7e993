"""Every rank of a job resumes the same step: ranks whose roots hold different newest
steps (real steps a real daemon committed, copied as a copy in flight or a replaced
node leaves them) agree on the newest step all of them can read, under a real
torchrun (tests/agree_job.py); a process without a group looks on its own, as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptd

import agree_job
from conftest import torchrun

RUN = agree_job.RUN
# each case: the steps each rank's root holds
ROOTS = {
    "split": ({10, 20}, {10}),             # rank 1 lacks the newest step
    "rounds": ({20, 30}, {10, 20, 25}),    # the oldest newest (25) is not on rank 0: a second round
    "some_none": ({10, 20}, set()),
    "fresh": (set(), set()),
    "failure": ({10, 20}, {10, 20}),       # rank 1's config file is broken
}


def save_steps(daemon, steps: list[int], run: str = RUN) -> Path:
    """Two ranks' shares of each step, committed by the daemon; its run folder."""
    producers = [daemon.producer(run, rank=r, world_size=2) for r in (0, 1)]
    try:
        for step in steps:
            for rank, p in enumerate(producers):
                p.save(agree_job.saved(step, rank), step).wait(30)
    finally:
        for p in producers:
            p.close()
    return daemon.root / run


def build_roots(source: Path, out: Path) -> None:
    """OUT/<case>/r<rank>: a root holding that rank's steps of the case, and the daemon's
    ``latest`` pointer (which names a step a root may lack, as after a lost copy)."""
    for case, per_rank in ROOTS.items():
        for rank, steps in enumerate(per_rank):
            root = out / case / f"r{rank}"
            root.mkdir(parents=True)
            if steps:
                (root / RUN).mkdir()
                shutil.copy2(source / "latest", root / RUN / "latest")
            for step in steps:
                name = f"step-{step:012d}"
                shutil.copytree(source / name, root / RUN / name)
    (out / "broken.toml").write_text("[daemon\nroot = ")


@pytest.fixture(scope="module")
def got(_module_daemon, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's results of every case, from one torchrun job."""
    out = tmp_path_factory.mktemp("agree")
    build_roots(save_steps(_module_daemon, [10, 20, 25, 30]), out)
    torchrun(Path(agree_job.__file__), _module_daemon, 2, ",".join(ROOTS), out)
    return [json.loads((out / f"agree-r{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_every_rank_resumes_the_same_step(got: list[dict]) -> None:
    # each rank alone still answers from its own root
    assert [r["split"]["own"]["value"] for r in got] == [20, 10]
    assert [r["rounds"]["own"]["value"] for r in got] == [30, 25]
    for case, want in (("split", 10), ("rounds", 20)):
        for rank, r in enumerate(got):
            res = r[case]
            assert res["agreed"] == {"value": want}, (case, rank, res)
            assert res["resume"] == {"value": want}, (case, rank, res)
            assert res["load_into"] == {"value": [want, want, float(want * 10 + rank)]}, (case, rank, res)
            assert res["dcp"] == {"value": want}, (case, rank, res)


@pytest.mark.slow
def test_ranks_with_a_step_and_ranks_without_all_raise_naming_them(got: list[dict]) -> None:
    for lookup in ("agreed", "resume", "load_into", "dcp"):
        first = got[0]["some_none"][lookup]
        assert first.get("error") == "CheckpointNotFound", (lookup, first)
        assert "rank 1 found no complete checkpoint, while rank 0 found step 20" in first["message"], first
        assert got[1]["some_none"][lookup] == first  # the same error on every rank


@pytest.mark.slow
def test_a_fresh_start_is_none_on_every_rank(got: list[dict]) -> None:
    # a fresh start: None on every rank, and load_into without a step has nothing to load
    for r in got:
        fresh = r["fresh"]
        assert fresh["own"] == fresh["agreed"] == fresh["resume"] == {"value": None}, fresh
        assert fresh["load_into"]["error"] == "CheckpointNotFound", fresh
        assert "no checkpoints on any of the 2 ranks" in fresh["load_into"]["message"], fresh


@pytest.mark.slow
def test_a_rank_that_cannot_look_makes_every_rank_raise_its_error(got: list[dict]) -> None:
    # rank 1 cannot look (its config is broken): rank 0 raises rank 1's error too, no rank hangs
    assert got[1]["failure"]["own"]["error"] == "ConfigError" and got[0]["failure"]["own"] == {"value": 20}
    for lookup in ("agreed", "resume", "load_into"):
        first = got[0]["failure"][lookup]
        assert first.get("error") == "ValueError", (lookup, first)
        assert first["message"].startswith(f"rank 1 could not look up the newest step of run {RUN!r}"), first
        assert "broken.toml" in first["message"], first
        assert got[1]["failure"][lookup] == first
    assert got[0]["failure"]["dcp"] == got[1]["failure"]["dcp"] == {"value": 20}  # the DCP reader reads no config


def test_a_process_without_a_group_looks_on_its_own(shared_daemon) -> None:
    run, root = "alone", shared_daemon.root
    assert ckptd.latest(run, root=root, agree=True) is None
    save_steps(shared_daemon, [10, 20], run)
    assert not torch.distributed.is_initialized()
    assert ckptd.latest(run, root=root, agree=True) == ckptd.latest(run, root=root)
    assert ckptd.latest(run, root=root, agree=True, verify=True).step == 20
    target = {"w": torch.zeros(4), "step": -1}
    assert ckptd.load_into(target, run, root=root).step == 20 and target["step"] == 20
