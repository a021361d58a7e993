"""The attempt rule (ckptd.attempt, ckptd.daemon.attempts), through a real daemon: a step
is complete only out of one attempt's shares; a new attempt's share replaces an earlier
one's of a step that never became complete; a complete step is never overwritten."""

from __future__ import annotations

import json

import pytest
import torch

import ckptd
from ckptd import env as environment
from ckptd.attempt import current as current_attempt


def current(explicit: str, world_size: int, environ: dict[str, str]) -> str | None:
    return current_attempt(explicit, world_size, environment.elastic(environ))


def save(daemon, rank: int, step: int, attempt: str | None, value: float) -> ckptd.CheckpointInfo:
    options = {"attempt": attempt} if attempt is not None else {}
    with daemon.producer(rank=rank, world_size=2, **options) as p:
        return p.save({"w": torch.full((64,), value), "rank": rank}, step).wait(30)


def attempts(daemon, step: int) -> dict[str, str | None]:
    folder = daemon.root / "t" / f"step-{step:012d}"
    return {m.name: json.loads(m.read_text()).get("attempt") for m in sorted(folder.glob("manifest-r*.json"))}


def test_shares_of_two_attempts_never_make_a_step_and_the_new_one_replaces(daemon) -> None:
    save(daemon, 0, 10, "job7.0", 1.0)  # attempt 0: rank 0 committed, rank 1 died
    save(daemon, 1, 10, "job7.1", 2.0)  # attempt 1: rank 1 first
    assert attempts(daemon, 10) == {"manifest-r00000.json": "job7.0", "manifest-r00001.json": "job7.1"}
    assert ckptd.latest("t", root=daemon.root) is None  # every rank has a manifest, of two attempts
    assert ckptd.list_checkpoints("t", root=daemon.root) == []
    info = save(daemon, 0, 10, "job7.1", 3.0)  # attempt 1's rank 0 replaces attempt 0's share
    assert info.step == 10 and info.ntensors == 2
    assert attempts(daemon, 10) == {"manifest-r00000.json": "job7.1", "manifest-r00001.json": "job7.1"}
    assert torch.equal(ckptd.load("t", 10, root=daemon.root, rank=0, verify=True)["w"], torch.full((64,), 3.0))
    assert "the share of attempt job7.0 (the step never became complete) is replaced by attempt job7.1's" \
        in daemon.log_text()
    folder = daemon.root / "t" / "step-000000000010"
    named = {t["file"] for m in folder.glob("manifest-r*.json") for t in json.loads(m.read_text())["tensors"].values()}
    assert {f.name for f in folder.glob("*.safetensors")} == named  # the old share's files are gone

    with pytest.raises(ckptd.CheckpointError, match=r"step 10 of run 't' is already committed by every rank "
                       r"\(attempt job7.1\).*never "
                       r"overwritten; ckptd.latest\('t'\).*resume from it and save the steps after it"):
        save(daemon, 0, 10, "job7.2", 4.0)
    assert torch.equal(ckptd.load("t", 10, root=daemon.root, rank=0)["w"], torch.full((64,), 3.0))


def test_one_attempt_saving_a_step_twice_and_producers_without_attempt_are_refused(daemon) -> None:
    save(daemon, 0, 20, "a", 1.0)
    with pytest.raises(ckptd.CheckpointError, match="already committed for rank 0 by this attempt of the job"):
        save(daemon, 0, 20, "a", 2.0)
    save(daemon, 0, 30, None, 1.0)  # two ranks outside torchrun, no attempt given: none
    with pytest.raises(ckptd.CheckpointError, match=r"already committed for rank 0; a restarted job's producers "
                       r"need an attempt of their own .*Producer\(attempt=...\)"):
        save(daemon, 0, 30, None, 2.0)
    assert attempts(daemon, 30) == {"manifest-r00000.json": None}


def test_the_attempt_a_producer_derives() -> None:
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "job9", "GROUP_WORLD_SIZE": "2"}
    assert current("", 8, env) == "torchelastic:job9:1"  # several nodes: what every agent shares
    one_node = current("", 2, {**env, "GROUP_WORLD_SIZE": "1"})
    assert one_node.startswith("torchelastic:job9:1:agent-")  # and the torchrun process itself
    assert current("", 2, {**env, "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) != one_node
    me = current("", 1, {})
    assert me.startswith("process-") and me == current("", 1, {})
    assert current("", 2, {}) is None
    assert current("slurm-123.4", 2, env) == "slurm-123.4"
    with pytest.raises(ValueError, match="printable ASCII characters without spaces"):
        current("two words", 2, {})
