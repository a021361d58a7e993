"""A step a dead node left incomplete, saved again by the resumed job (daemon/supersede.py)."""

from __future__ import annotations

import pytest
import torch

import ckptd


def test_an_abandoned_share_is_superseded_a_complete_step_never(daemon) -> None:
    first = daemon.producer(rank=0, world_size=2)
    try:
        first.save({"w": torch.zeros(8)}, 5).wait(30)  # rank 1's node dies: step 5 never completes
        with pytest.raises(ckptd.CheckpointError, match="already committed for rank 0"):
            first.save({"w": torch.ones(8)}, 5).wait(30)  # the same process twice: a mistake, refused
    finally:
        first.close()
    again = daemon.producer(rank=0, world_size=2)  # the resumed job's rank 0
    other = daemon.producer(rank=1, world_size=2)
    try:
        again.save({"w": torch.full((8,), 2.0)}, 5).wait(30)
        assert ckptd.latest("t", root=daemon.root) is None
        other.save({"w": torch.full((8,), 3.0)}, 5).wait(30)
    finally:
        again.close()
        other.close()
    assert torch.equal(ckptd.load("t", 5, root=daemon.root, rank=0, verify=True)["w"], torch.full((8,), 2.0))
    assert "superseding the share committed" in daemon.log_text()
    late = daemon.producer(rank=0, world_size=2)
    try:
        with pytest.raises(ckptd.CheckpointError, match="already committed for rank 0"):
            late.save({"w": torch.ones(8)}, 5).wait(30)  # step 5 is complete: never overwritten
    finally:
        late.close()
    assert torch.equal(ckptd.load("t", 5, root=daemon.root, rank=0)["w"], torch.full((8,), 2.0))
