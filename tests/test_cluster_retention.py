"""Retention across nodes (docs/service.md): daemons on 127.0.0.1, each with its own
root, stand for nodes; rank r saves its share on node r. No root ever holds a whole
step, yet each holds at most ``keep_last`` steps plus the one in flight, with the
peers, the bucket or both completing the steps across the nodes; peer memory stays
bounded; the newest step loads bit-exact through another node; ``ckptd prune`` says
where each step is complete."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import index
from ckptd.daemon.launcher import toml_text
from ckptd.daemon.upkeep import Passes
from conftest import DAEMONS, Daemon, cli, free_port

KEEP = 3
NBYTES = 64 * 1024
URL = "s3://ckptd/cluster"


def _tables(setup: str, n: int) -> list[dict]:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
    out = []
    for listen in listens:
        t: dict = {"retention": {"keep_last": KEEP}}
        if setup in ("peers", "both"):
            t["peer"] = {"listen": listen, "peers": [e for e in listens if e != listen], "memory": "16MiB",
                         "stall": "3s"}
        if setup in ("bucket", "both"):
            t["remote"] = {"url": URL, "part_bytes": "5MiB", "max_retry_s": 1}
        out.append(t)
    return out


def _tensor(step: int, rank: int) -> torch.Tensor:
    return torch.arange(NBYTES // 4, dtype=torch.float32) * (rank + 1) + step * 1000


def _on_disk(node: Daemon) -> list[int]:
    return sorted(s for s, _ in index.step_dirs(node.root / "job"))


def _wait(cond, what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def _peer(node: Daemon) -> dict | None:
    r = cli("status", "--json", "-c", str(node.config))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["peer"]


def _prune(node: Daemon, tables: dict, tmp_path: Path, keep: int, *args: str) -> str:
    """`ckptd prune job ARGS` on ``node``'s root with a config like its own, but keep_last = ``keep``."""
    conf = tmp_path / f"prune-{node.root.parent.name}.toml"
    conf.write_text(toml_text({**tables, "daemon": {"root": str(node.root)}, "retention": {"keep_last": keep}}))
    r = cli("prune", "job", "-c", str(conf), *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _lines(out: str) -> dict[int, str]:
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["peers", "bucket", "both"])
def test_each_root_holds_what_the_policy_keeps_across_the_cluster(setup, tmp_path, request, monkeypatch) -> None:
    if setup != "peers":
        request.getfixturevalue("s3")
    n = 3 if setup == "peers" else 2
    tables = _tables(setup, n)
    nodes = [Daemon(tmp_path / f"node{i}", tables=t) for i, t in enumerate(tables)]
    request.node.stash[DAEMONS] = nodes  # their logs in a failed test's report
    try:
        for node in nodes:
            node.start()
        producers = [node.producer("job", rank=r, world_size=n) for r, node in enumerate(nodes)]
        for step in range(1, 13):
            for h in [p.save({"w": _tensor(step, r), "step": step}, step) for r, p in enumerate(producers)]:
                h.wait(30)
            for node in nodes:  # the policy's steps, plus the one in flight
                _wait(lambda: len(_on_disk(node)) <= KEEP + 1,
                      lambda: f"step {step}: {node.root} holds steps {_on_disk(node)}")
            if setup != "bucket":
                for node in nodes:
                    held = _peer(node)["held_bytes"]
                    assert held <= KEEP * (n - 1) * (NBYTES + 4096), (step, held)
            for r in range(n):  # rank r's share, read through another node
                monkeypatch.setenv("CKPTD_CONFIG", str(nodes[(r + 1) % n].config))
                _wait(lambda: getattr(ckptd.latest("job"), "step", None) == step, f"step {step} complete")
                got = ckptd.load("job", rank=r)
                assert got["step"] == step and torch.equal(got["w"], _tensor(step, r)), (step, r)
        monkeypatch.delenv("CKPTD_CONFIG")  # `ckptd latest -c` reads that config's tiers, not the discovered one's
        r = cli("latest", "job", "--json", "-c", str(nodes[1].config))
        assert r.returncode == 0 and json.loads(r.stdout)["step"] == 12, r.stderr
        for node in nodes:  # the last step is complete everywhere: no step is in flight
            _wait(lambda: len(_on_disk(node)) == KEEP, lambda: f"{node.root}: {_on_disk(node)}",
                  timeout=Passes.EVERY_S + 30)
        # `ckptd prune` follows the same rule and says why: a stricter keep_last would remove
        # the oldest steps, each complete across the cluster; the newest stays
        out = _lines(_prune(nodes[0], tables[0], tmp_path, 1, "--dry-run"))
        where = {"peers": {"peer"}, "bucket": {"remote"}, "both": {"peer", "remote"}}[setup]
        assert 12 in out and "keep" in out[12] and "newest" in out[12], out
        listed = set(out[12].split("complete across the cluster in: ")[1].split(", "))
        # a rank read through this node was landed in its root by its daemon: complete there too
        assert where - {"peer"} <= listed and listed & (where | {"local"}) and listed <= where | {"local"}, out
        older = [s for s in out if s < 12]
        assert older and all("would remove" in out[s] and "complete across the cluster in:" in out[s]
                                 for s in older), out
        assert _on_disk(nodes[0]) == sorted(out)  # a dry run removes nothing
        # a step rank 0 saved and rank 1 did not: in flight, never removed
        producers[0].save({"w": _tensor(13, 0), "step": 13}, 13).wait(30)
        out = _lines(_prune(nodes[0], tables[0], tmp_path, 1))
        assert "keep" in out[13] and f"not complete across the cluster: rank(s) [0] of {n}" in out[13], out
        assert _on_disk(nodes[0]) == [12, 13]
        for p in producers:
            p.close()
    finally:
        for node in nodes:
            node.cleanup()


def test_a_root_per_node_without_peers_or_bucket_is_named_at_commit_and_at_start(tmp_path, request) -> None:
    nodes = [Daemon(tmp_path / f"node{i}", tables={"retention": {"keep_last": KEEP}}) for i in range(2)]
    request.node.stash[DAEMONS] = nodes  # their logs in a failed test's report
    try:
        for node in nodes:
            node.start()
        producers = [node.producer("job", rank=r, world_size=2) for r, node in enumerate(nodes)]
        for step in range(1, 6):
            for h in [p.save({"w": _tensor(step, r)}, step) for r, p in enumerate(producers)]:
                h.wait(30)
        for p in producers:
            p.close()
        for r, node in enumerate(nodes):
            text = node.log_text()
            assert f"run 'job': no step ever completes in {node.root}: it holds only rank(s) [{r}] of 2" in text
            assert "give the nodes a shared root, or add a [peer] table" in text
            assert text.count("no step ever completes") == 1  # once a run
        nodes[0].kill()  # a daemon started on such a root says so at start
        nodes[0].start()
        _wait(lambda: nodes[0].log_text().count("no step ever completes in") == 2, nodes[0].log_tail)
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
def test_a_node_down_never_costs_a_step_a_rule_keeps(tmp_path, request) -> None:
    """With a peer down, its shares are out of reach: no step is complete as far as this
    node can tell, and nothing is removed (keep_every's steps, the ones rank 0 keeps
    saving alone) until the cluster can tell again."""
    tables = _tables("peers", 2)
    for t in tables:
        t["retention"] = {"keep_last": 2, "keep_every": 4}
    nodes = [Daemon(tmp_path / f"node{i}", tables=t) for i, t in enumerate(tables)]
    request.node.stash[DAEMONS] = nodes
    try:
        for node in nodes:
            node.start()
        producers = [node.producer("job", rank=r, world_size=2) for r, node in enumerate(nodes)]
        for step in range(1, 11):
            for h in [p.save({"w": _tensor(step, r)}, step) for r, p in enumerate(producers)]:
                h.wait(30)
        _wait(lambda: _on_disk(nodes[0]) == [4, 8, 9, 10], lambda: f"{_on_disk(nodes[0])}")
        producers[1].close()
        nodes[1].kill()
        for step in range(11, 14):
            producers[0].save({"w": _tensor(step, 0)}, step).wait(30)
        time.sleep(2)  # the passes after those commits ran
        assert _on_disk(nodes[0]) == [4, 8, 9, 10, 11, 12, 13]
        out = _lines(_prune(nodes[0], tables[0], tmp_path, 2, "--dry-run"))
        assert sorted(out) == [4, 8, 9, 10, 11, 12, 13] and all(" keep " in line for line in out.values()), out
        for step in (11, 12, 13):
            assert "not complete across the cluster: rank(s) [0] of 2" in out[step], out
        producers[0].close()
    finally:
        for node in nodes:
            node.cleanup()
