"""The step a lost node needs stays in peer memory (docs/tiers.md, "Holding"): real
daemons on 127.0.0.1 stand for nodes; a node dies between its commit and its
replication, and a job resumed from an older step is replicated."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import ckptd
from conftest import Daemon, free_port
from test_peer import _held, _status, _wait


def _share(step: int, rank: int) -> torch.Tensor:
    return torch.arange(65536, dtype=torch.float32) + step * 1000 + rank


def _commit(node: Daemon, step: int, rank: int, world: int = 2, **opts: object) -> None:
    with node.producer("job", rank=rank, world_size=world, **opts) as p:
        p.save({"w": _share(step, rank), "step": step}, step).wait(30)


def test_a_node_lost_between_its_commit_and_its_replication_resumes_from_the_step_before(
        tmp_path: Path, monkeypatch) -> None:
    """Two ranks on nodes A and B, their replicas on a spare C; both keep 1 step on disk.
    B's step 2 reaches C, A commits step 2 and dies before replicating it: step 1 is the
    newest complete in peer memory, and C keeps it (before, B's step 2 evicted step 1 of
    both ranks at C as it was offered, keep_last applying per run across ranks)."""
    a_, b_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    keep = {"retention": {"keep_last": 1}}
    a = Daemon(tmp_path / "a", tables={"peer": {"listen": a_, "peers": [c_]}, **keep})
    b = Daemon(tmp_path / "b", tables={"peer": {"listen": b_, "peers": [c_]}, **keep})
    c = Daemon(tmp_path / "c", tables={"peer": {"listen": c_, "peers": [a_, b_]}})
    try:
        monkeypatch.setenv("CKPTD_FAILPOINTS", "peer.replicate@2")  # A replicates its first share only
        a.start()
        monkeypatch.delenv("CKPTD_FAILPOINTS")
        b.start()
        c.start()
        _commit(a, 1, 0)
        _commit(b, 1, 1)
        _wait(lambda: {(1, 0), (1, 1)} <= set(_held(c)), "step 1 of both ranks held by the spare")
        _commit(b, 2, 1)
        _wait(lambda: _held(c).get((2, 1)) == "memory", "B's step 2 held by the spare")
        _commit(a, 2, 0)
        _wait(lambda: "failpoint peer.replicate" in a.log_text(), "A's step 2 not replicated")
        assert _status(a)["peer"]["under_replicated"] == 1
        a.kill()  # lost with its disk, between its commit of step 2 and its replication
        shutil.rmtree(a.root)
        held = _held(c)
        assert held.get((1, 0)) == held.get((1, 1)) == "memory", held
        a.start()
        monkeypatch.setenv("CKPTD_CONFIG", str(a.config))
        state = ckptd.load("job", rank=0)
        assert state["step"] == 1 and torch.equal(state["w"], _share(1, 0))
        # once newer steps are complete at C, keep_last bounds what it holds again
        _commit(a, 2, 0)
        _commit(a, 3, 0)
        _commit(b, 3, 1)
        _wait(lambda: {(2, 0), (2, 1), (3, 0), (3, 1)} <= set(_held(c)), "steps 2 and 3 held")
        _wait(lambda: not {(1, 0), (1, 1)} & set(_held(c)), "step 1 forgotten once two newer steps are complete")
        assert _status(c)["peer"]["thread_restarts"] == 0
    finally:
        for n in (a, b, c):
            n.cleanup()


def test_a_resume_from_an_older_step_is_replicated_and_counted(tmp_path: Path) -> None:
    """Attempt 1 saves steps 10 and 20; attempt 2 resumes from 10 and saves 15: a share
    older in steps than the newest committed is still this rank's newest, so it is sent
    (before, it was dropped unsent and never counted as under-replicated)."""
    a_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = Daemon(tmp_path / "a", tables={"peer": {"listen": a_, "peers": [c_], "heartbeat": "0.5s"}})
    c = Daemon(tmp_path / "c", tables={"peer": {"listen": c_, "peers": [a_]}})
    try:
        c.start()
        a.start()
        for step in (10, 20):
            _commit(a, step, 0, world=1, attempt="one")
            _wait(lambda: _held(c).get((step, 0)) == "memory", f"step {step} held")
        c.kill()  # the share of the new attempt has no partner for a while: it is counted
        _commit(a, 15, 0, world=1, attempt="two")
        _wait(lambda: _status(a)["peer"]["under_replicated"] == 1, "the resumed attempt's share counted")
        c.start()
        _wait(lambda: _held(c).get((15, 0)) == "memory", "the resumed attempt's share replicated")
        _wait(lambda: _status(a)["peer"]["under_replicated"] == 0, "replicated")
    finally:
        for n in (a, c):
            n.cleanup()
