"""Retention across nodes (docs/service.md): daemons on 127.0.0.1, each with its own
root, stand for nodes; rank r saves its share on node r. No root ever holds a whole
step, yet each holds at most ``keep_last`` steps plus the one in flight, with the
peers, the bucket or both completing the steps across the nodes; peer memory stays
bounded; the newest step loads bit-exact through another node; ``ckptd prune`` says
where each step is complete."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ckptd
from ckptd import index
from ckptd.daemon.launcher import toml_text
from ckptd.config import DaemonConfig, RetentionConfig, load as load_config
from ckptd.manifest import Manifest
from ckptd.daemon.upkeep import Passes
from ckptd.peer import partners
from ckptd.tiers import completeness
from ckptd.tiers.peer_reader import PeerTier
from conftest import DAEMONS, Daemon, cli, free_port

KEEP = 3
NBYTES = 64 * 1024
URL = "s3://ckptd/cluster"
INTERVAL_S = 1.0  # [daemon] retention_interval: a step completed on another node is counted within it


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


def _node(base: Path, tables: dict) -> Daemon:
    return Daemon(base, tables=tables, retention_interval=INTERVAL_S)


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
    conf.write_text(toml_text({**tables, "daemon": {"root": str(node.root)}, "retention": {**tables["retention"], "keep_last": keep}}))
    r = cli("prune", "job", "-c", str(conf), *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _lines(out: str) -> dict[int, str]:
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


@settings(max_examples=300, deadline=None)
@given(held=st.sets(st.integers(1, 60), min_size=1, max_size=25), data=st.data(),
       keep_last=st.integers(1, 4), keep_every=st.sampled_from([0, 5]))
def test_the_rule_bounds_a_root_whatever_the_cluster_completes(held, data, keep_last, keep_every, tmp_path_factory):
    """The decisions alone: at most keep_last steps, the newest complete one and the one in
    flight kept beside keep_every's; the newest complete step and the step in flight always
    kept; nothing not complete removed while no step is known complete."""
    complete = data.draw(st.sets(st.sampled_from(sorted(held))), "complete")
    run_dir = tmp_path_factory.getbasetemp() / "no-root" / "job"  # only its pins are looked for: none
    s = completeness.Survey("job", {st_: [Manifest("job", st_, 0, 2, 0.0, {})] for st_ in held})
    s.complete = {st_: ("peer",) for st_ in complete}
    s.ranks = {st_: ({0}, 2) for st_ in held - complete}
    policy = RetentionConfig(keep_last=keep_last, keep_every=keep_every)
    d = {x.step: x for x in completeness.decide(s, run_dir, policy, now=0.0, protect=set())}
    kept = {st_ for st_, x in d.items() if x.keep}
    assert sorted(d) == sorted(held) and all(x.reasons for x in d.values())
    flight = max(held)
    assert flight in kept
    if not complete:
        assert kept == held
        return
    every = {st_ for st_ in held if keep_every and st_ % keep_every == 0}
    assert kept == {*sorted(held)[-keep_last:], max(complete), *every}, d
    assert len(kept - every) <= keep_last + 1


def test_every_run_seen_is_passed_again_each_retention_interval() -> None:
    """Without a commit, a pass per run every ``[daemon] retention_interval``; 30 s by default."""
    assert DaemonConfig().retention_interval == 30.0
    pruned: list[str] = []
    passes = Passes(pruned.append, 0.05)
    passes.start()
    try:
        passes.request("a")
        passes.request("b")
        _wait(lambda: pruned.count("a") >= 4 and pruned.count("b") >= 4, lambda: f"passes: {pruned}", timeout=10)
    finally:
        passes.close()
    assert set(pruned) == {"a", "b"}


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["peers", "bucket", "both"])
def test_each_root_holds_what_the_policy_keeps_across_the_cluster(setup, tmp_path, request, monkeypatch) -> None:
    if setup != "peers":
        request.getfixturevalue("s3")
    n = 3 if setup == "peers" else 2
    tables = _tables(setup, n)
    nodes = [_node(tmp_path / f"node{i}", t) for i, t in enumerate(tables)]
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
                  timeout=INTERVAL_S + 30)
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
def test_a_node_down_never_costs_the_newest_complete_step_nor_keep_every(tmp_path, request) -> None:
    """With a peer down, its shares are out of reach: no later step completes, yet the
    rules count those steps as if complete: keep_last's newest steps stay, with the
    newest complete step (10) and keep_every's, and the root stays bounded (before,
    every step saved while the peer was down stayed)."""
    tables = _tables("peers", 2)
    for t in tables:
        t["retention"] = {"keep_last": 2, "keep_every": 4}
    nodes = [_node(tmp_path / f"node{i}", t) for i, t in enumerate(tables)]
    request.node.stash[DAEMONS] = nodes
    try:
        for node in nodes:
            node.start()
        producers = [node.producer("job", rank=r, world_size=2) for r, node in enumerate(nodes)]
        for step in range(1, 11):
            for h in [p.save({"w": _tensor(step, r)}, step) for r, p in enumerate(producers)]:
                h.wait(30)
        _wait(lambda: _on_disk(nodes[0]) == [4, 8, 9, 10], lambda: f"{_on_disk(nodes[0])}")
        # node 0 can tell step 10 complete without node 1 (its share in node 0's memory); a
        # share only node 1's root held would leave step 10 not complete, so counted as any step
        _wait(lambda: (10, 1) in _held(nodes[0]), "node 1's step 10 held by node 0")
        producers[1].close()
        nodes[1].kill()
        for step in range(11, 14):
            producers[0].save({"w": _tensor(step, 0)}, step).wait(30)
        _wait(lambda: _on_disk(nodes[0]) == [4, 8, 10, 12, 13], lambda: f"{_on_disk(nodes[0])}")
        out = _lines(_prune(nodes[0], tables[0], tmp_path, 2, "--dry-run"))
        assert sorted(out) == [4, 8, 10, 12, 13] and all(" keep " in line for line in out.values()), out
        assert "newest" in out[10] and "keep_every=4" in out[4] and "keep_every=4" in out[8], out
        for step in (12, 13):
            assert "not complete across the cluster: rank(s) [0] of 2" in out[step], out
        producers[0].close()
    finally:
        for node in nodes:
            node.cleanup()


def _sampled(node: Daemon, every: float = 0.01) -> tuple[list[int], threading.Event, threading.Thread]:
    """How many step folders ``node``'s root holds, sampled every ``every`` s until the event is set."""
    counts: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            counts.append(len(_on_disk(node)))
            stop.wait(every)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return counts, stop, t


@pytest.mark.slow
def test_a_stopped_partner_never_lets_a_root_grow_past_the_bound(tmp_path, request, monkeypatch) -> None:
    """Node B (rank 1, A's partner) is stopped (SIGSTOP) after step 3: no later step
    completes anywhere, yet while rank 0 saves 10 more, A's root holds at every sample at
    most keep_last steps, the newest complete one and the step in flight (before, it
    kept every step since 3); step 3 loads bit-exact through A before and after
    `ckptd prune`, which says why each step stays or goes."""
    tables = _tables("peers", 2)
    a, b = nodes = [_node(tmp_path / f"node{i}", t) for i, t in enumerate(tables)]
    request.node.stash[DAEMONS] = nodes
    monkeypatch.setenv("CKPTD_CONFIG", str(a.config))
    try:
        for node in nodes:
            node.start()
        producers = [node.producer("job", rank=r, world_size=2) for r, node in enumerate(nodes)]
        for step in range(1, 4):
            for h in [p.save({"w": _tensor(step, r), "step": step}, step) for r, p in enumerate(producers)]:
                h.wait(30)
            _wait(lambda: getattr(ckptd.latest("job"), "step", None) == step, f"step {step} complete")
        _wait(lambda: _held(a) >= {(3, 1)}, "B's step 3 held in A's memory")
        os.kill(b.proc.pid, signal.SIGSTOP)
        counts, stop, sampler = _sampled(a)
        for step in range(4, 14):
            producers[0].save({"w": _tensor(step, 0), "step": step}, step).wait(30)
            want = sorted({3, *range(step - KEEP + 1, step + 1)})
            _wait(lambda: _on_disk(a) == want, lambda: f"step {step}: {a.root} holds {_on_disk(a)}, not {want}")
        stop.set()
        sampler.join()
        assert max(counts) <= KEEP + 2, counts  # keep_last, the newest complete, the one in flight
        out = _lines(_prune(a, tables[0], tmp_path, KEEP, "--dry-run"))
        assert sorted(out) == [3, 11, 12, 13] and all(" keep " in line for line in out.values()), out
        assert "newest" in out[3] and "complete across the cluster in: peer" in out[3], out
        assert "in flight" in out[13], out
        for step in (11, 12):
            assert f"keep_last={KEEP}" in out[step] and "newer than step 3, the newest complete" in out[step], out
        out = _lines(_prune(a, tables[0], tmp_path, 1, "--dry-run"))
        assert [s for s, line in out.items() if "would remove" in line] == [11, 12], out
        assert all("no rule keeps it" in out[s] and "not complete across the cluster: rank(s) [0] of 2"
                   in out[s] for s in (11, 12)), out
        _prune(a, tables[0], tmp_path, 1)
        assert _on_disk(a) == [3, 13]
        for r in range(2):  # rank 1 from A's memory: B is still stopped
            got = ckptd.load("job", rank=r)
            assert got["step"] == 3 and torch.equal(got["w"], _tensor(3, r)), r
        for p in producers:
            p.close()
    finally:
        if b.alive():
            os.kill(b.proc.pid, signal.SIGCONT)
        for node in nodes:
            node.cleanup()


def _held(node: Daemon) -> set[tuple[int, int]]:
    """The (step, rank)s of run "job" that ``node`` holds in its peer memory."""
    tier = PeerTier(load_config(node.config))
    tier.discovery.endpoints = [tier.cfg.listen]
    return {k for k, c in tier.discovery.holdings("job").items() if c[0][1] == "memory"}


@pytest.mark.slow
def test_peer_memory_after_a_reroute_holds_keep_last_steps_of_each_rank(tmp_path, request) -> None:
    """Three nodes in a ring, X -> P -> Q -> X; P is lost after step 4, and X's shares go
    to Q, which then holds two nodes' ranks: P's (the newest of them, what P's
    replacement needs, never evicted) and X's. Q holds at most max(keep_last, 2) steps of
    each rank it holds (`held_ranks`), not keep_last steps of one node's."""
    tables = _tables("peers", 3)
    for t in tables:
        t["peer"]["heartbeat"] = "0.5s"
    nodes = [_node(tmp_path / f"node{i}", t) for i, t in enumerate(tables)]
    request.node.stash[DAEMONS] = nodes
    listens = [t["peer"]["listen"] for t in tables]
    partner = [listens.index(partners.of(load_config(n.config).peer, "job", r)[0]) for r, n in enumerate(nodes)]
    x = 0
    p, q = partner[x], partner[partner[x]]
    try:
        for node in nodes:
            node.start()
        producers = {r: node.producer("job", rank=r, world_size=3) for r, node in enumerate(nodes)}
        for step in range(1, 5):
            for h in [pr.save({"w": _tensor(step, r)}, step) for r, pr in producers.items()]:
                h.wait(30)
        _wait(lambda: {(4, p)} <= _held(nodes[q]) and {(4, x)} <= _held(nodes[p]), "step 4 held")
        producers.pop(p).close()
        nodes[p].kill()
        for step in range(5, 11):  # each of X's shares reaches Q before the next supersedes it
            for h in [pr.save({"w": _tensor(step, r)}, step) for r, pr in producers.items()]:
                h.wait(30)
            _wait(lambda: (step, x) in _held(nodes[q]), lambda: f"X's step {step} at Q: {_held(nodes[q])}")
        held = _held(nodes[q])
        assert (4, p) in held, held  # P's newest: what its replacement resumes from
        for r in (x, p):
            assert len({s for s, rank in held if rank == r}) <= KEEP, held
        peer = _peer(nodes[q])
        assert peer["held_ranks"] == 2 and peer["held_bytes"] <= KEEP * 2 * (NBYTES + 4096), peer
        for pr in producers.values():
            pr.close()
    finally:
        for node in nodes:
            node.cleanup()
