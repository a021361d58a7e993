"""Several ranks of one run, and several runs, through one daemon at once."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptd


def test_step_is_complete_only_when_every_rank_committed(daemon) -> None:
    p0 = daemon.producer(rank=0, world_size=2)
    p1 = daemon.producer(rank=1, world_size=2)
    try:
        p0.save({"shard": torch.zeros(4), "rank": 0}, 10).wait(30)
        assert ckptd.latest("t", root=daemon.root) is None  # rank 1 has not committed
        info = p1.save({"shard": torch.ones(4), "rank": 1}, 10).wait(30)
        assert info.ntensors == 2 and info.nbytes == 32  # both ranks' shares
    finally:
        p0.close()
        p1.close()
    assert ckptd.latest("t", root=daemon.root).step == 10
    assert ckptd.load("t", root=daemon.root, rank=1)["rank"] == 1
    assert torch.equal(ckptd.load("t", root=daemon.root, rank=0)["shard"], torch.zeros(4))
    # no rank= and no $RANK: the whole state; a tensor each rank stored whole is rank 0's
    whole = ckptd.load("t", root=daemon.root)
    assert whole["rank"] == 0 and torch.equal(whole["shard"], torch.zeros(4))
    assert (daemon.root / "t" / "latest").read_text().strip() == "step-000000000010"


def test_world_size_mismatch_is_refused(daemon) -> None:
    p0 = daemon.producer(rank=0, world_size=2)
    try:
        p0.latest()  # connects
        with pytest.raises(ckptd.CheckpointError, match="world_size 2, not 3"):
            daemon.producer(rank=1, world_size=3).latest()
    finally:
        p0.close()


def test_many_runs_and_ranks_concurrently(daemon) -> None:
    errors: list[BaseException] = []

    def train(run: str, rank: int) -> None:
        try:
            with daemon.producer(run, rank=rank, world_size=2, staging_size="8MiB") as p:
                for step in range(1, 6):
                    g = torch.Generator().manual_seed(step * 10 + rank)
                    p.save({"w": torch.randn(64, 1024, generator=g), "step": step}, step)
                p.flush()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(run, rank)) for run in ("a", "b", "c") for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for run in ("a", "b", "c"):
        assert [i.step for i in ckptd.list_checkpoints(run, root=daemon.root)] == [1, 2, 3, 4, 5]
        for rank in (0, 1):
            g = torch.Generator().manual_seed(50 + rank)
            out = ckptd.load(run, root=daemon.root, rank=rank, verify=True)
            assert out["step"] == 5 and torch.equal(out["w"], torch.randn(64, 1024, generator=g))
