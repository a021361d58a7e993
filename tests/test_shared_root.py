"""Shared filesystem mode: two nodes' daemons write under one root (as on NFS or
Lustre); each node's ranks talk to their own daemon; the index polls; a step is
complete once both nodes' ranks have committed, and ``wait_complete`` sees it
through the root itself. Each daemon runs as a host of its own (a UTS namespace
with its own host name), as on two machines."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

import ckptd


def _as_host(d, name: str):
    d.wrap = ["unshare", "-u", "sh", "-c", f'hostname {name} && exec "$0" "$@"']
    return d.start()


def _latest_step(producer) -> int | None:
    info = producer.latest()  # the daemon's index
    return info.step if info else None


@pytest.fixture
def two_nodes(make_daemon, tmp_path):
    probe = subprocess.run(["unshare", "-u", "hostname", "probe"], capture_output=True, text=True)
    if probe.returncode != 0:  # needs root; CI here runs as root
        pytest.skip(f"cannot give a daemon a host name of its own: {probe.stderr.strip()}")
    shared = tmp_path / "shared-root"
    index = {"index": {"observer": "polling", "poll_interval": 0.2}}
    a = _as_host(make_daemon(start=False, root=str(shared), tables=index), "node-a")
    b = _as_host(make_daemon(start=False, root=str(shared), tables=index), "node-b")
    return shared, a, b


def test_two_daemons_on_one_root(two_nodes, monkeypatch) -> None:
    shared, a, b = two_nodes
    monkeypatch.setenv("CKPTD_ROOT", str(shared))  # wait_complete looks at the shared root
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun sets them: one rank on each node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    p0 = a.producer("job", rank=0, world_size=2)
    assert {k: p0.stats()[k] for k in ("rank", "world_size", "local_rank", "local_world_size")} == {
        "rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 1}
    p1 = b.producer("job", rank=1, world_size=2)
    try:
        p0.save({"w": torch.zeros(1000), "rank": 0}, 1).wait(30)
        with pytest.raises(ckptd.CheckpointError, match=r"not complete in .*rank\(s\) \[0\] are there"):
            p0.wait_complete(1, timeout=1)
        p1.save({"w": torch.ones(1000), "rank": 1}, 1).wait(30)
        info = p0.wait_complete(1, timeout=30)
        assert (info.step, info.ntensors, info.tiers) == (1, 2, ("local",))
        assert p1.wait_complete(1, timeout=30).step == 1
        # each daemon's index sees the step the other completed (polling, no inotify across hosts)
        deadline = time.monotonic() + 30
        while (_latest_step(p0), _latest_step(p1)) != (1, 1):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        p0.close()
        p1.close()
    assert torch.equal(ckptd.load("job", root=shared, rank=1)["w"], torch.ones(1000))
    # a daemon restarting on the shared root leaves the other host's files alone
    b.stop()
    _as_host(b, "node-b")
    assert [i.step for i in ckptd.list_checkpoints("job", root=shared)] == [1]
    assert sorted(p.name for p in (shared / ".").glob(".ckptd-*.lock")) == [".ckptd-node-a.lock", ".ckptd-node-b.lock"]
