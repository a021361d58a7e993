"""Restores that read each unique byte of the bucket once a node, and once a cluster of
``[peer]`` daemons (docs/tiers.md, "Read once"): local ranks, each a real process,
restore a step complete only in the bucket (a real SeaweedFS, behind a relay that counts
the bytes it serves) through their node's real daemon, which lands each share in the
root, from the bucket or from the share's fetcher among its peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import load as load_config
from ckptd.peer import messages
from ckptd.remote import catalog
from ckptd.tiers.peer_pull import PeerPull
from ckptd.remote.store import Store
from conftest import free_port
from countproxy import CountingProxy
from read_once_job import digests

URL = "s3://ckptd/readonce"
JOB = Path(__file__).with_name("read_once_job.py")
STEP = 4
RANK_S = 180  # a rank's whole restore, imports included, on a loaded machine


def _ddp_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"model": {f"l{i}.weight": torch.randn(512, 1024, generator=g) for i in range(6)},
            "head": torch.arange(5, dtype=torch.bfloat16)}


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture
def proxy(s3):
    p = CountingProxy(s3.ports["s3"])
    yield p
    p.close()


def _upload(make_daemon, monkeypatch, save) -> None:
    """The writing node: its daemon uploads every rank's share; done once the step is
    complete in the bucket."""
    d = make_daemon(tables={"remote": {"url": URL, "part_bytes": "5MiB"}})
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    producers = [d.producer("ddp", rank=r, world_size=3) for r in range(3)]
    try:
        for h in [save(p, r) for r, p in enumerate(producers)]:
            h.wait(60)
        producers[0].wait_complete(STEP, timeout=90)
    finally:
        for p in producers:
            p.close()
    monkeypatch.setenv("CKPTD_CONFIG", "none")


def _unique(run: str) -> int:
    objects = Store(URL).list(catalog.step_prefix(run, STEP))
    return sum(n for k, n in objects.items() if not k.rsplit("/", 1)[-1].startswith("manifest"))


def _ranks(node, proxy: CountingProxy, world: int, args: list[str], out: Path, *, nodes: list | None = None) -> list[dict]:
    """``world`` ranks restoring at once, rank r on ``nodes[r]`` (default: all on ``node``);
    the digests of what each read."""
    return _finish(_start(node, proxy, world, args, out, nodes=nodes), out)


def _start(node, proxy: CountingProxy, world: int, args: list[str], out: Path, *,
           nodes: list | None = None) -> list[subprocess.Popen]:
    on = nodes or [node] * world
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "WORLD_SIZE": str(world)}
    return [subprocess.Popen([sys.executable, str(JOB), args[0], args[1], str(out / f"r{r}.json"), *args[2:]],
                             env={**env, "RANK": str(r), "CKPTD_CONFIG": str(on[r].config)},
                             stderr=subprocess.PIPE, text=True) for r in range(world)]


def _finish(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    world = len(procs)
    try:
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=RANK_S)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                raise AssertionError(f"rank {r} did not restore within {RANK_S} s; its stderr:\n{err[-3000:]}") from None
            assert p.returncode == 0, f"rank {r} exited with {p.returncode}; its stderr:\n{err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"r{r}.json").read_text())["tensors"] for r in range(world)]


def test_local_ranks_restoring_a_replicated_state_read_the_bucket_once(s3, proxy, make_daemon, monkeypatch,
                                                                      tmp_path) -> None:
    want = digests(_flat(_ddp_state()))
    _upload(make_daemon, monkeypatch, lambda p, r: p.save(_ddp_state(), STEP, replicated=True))
    unique = _unique("ddp")
    assert unique >= 6 * 512 * 1024 * 4
    # the floor: one rank reading the bucket itself (no daemon) reads the whole state
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.reset()
    alone = ckptd.load("ddp", STEP, root=tmp_path / "bare", remote=URL, rank=1)
    assert digests(_flat(alone)) == want
    assert proxy.served >= sum(t.nbytes for t in _flat(_ddp_state()).values())  # every tensor byte, once
    # a fresh node: its daemon reads the bucket through the counting relay, as its ranks do
    node = make_daemon(tables={"remote": {"url": URL}})
    proxy.reset()
    got = _ranks(node, proxy, 3, ["load", "ddp"], tmp_path)
    for r, tensors in enumerate(got):
        assert tensors == want, f"rank {r} read other bytes"
    assert proxy.served / unique <= 1.05, (proxy.served, unique)
    fetched = node.status()["fetched"]
    # a rank that starts after the shares landed reads them from the root without asking
    assert fetched["bytes"] == unique and fetched["failed"] == 0 and fetched["asks"] >= 1, fetched


def test_resharding_to_another_world_size_reads_the_bucket_once(s3, proxy, make_daemon, monkeypatch,
                                                                tmp_path) -> None:
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(3 * 256, 2048, generator=g)

    def save(p, r):
        p.emit("w", whole[256 * r:256 * (r + 1)].clone(), step=STEP, global_shape=list(whole.shape),
               offset=[256 * r, 0])
        return p.commit(STEP)

    _upload(make_daemon, monkeypatch, save)
    unique = _unique("ddp")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    node = make_daemon(tables={"remote": {"url": URL}})
    proxy.reset()
    got = _ranks(node, proxy, 2, ["into", "ddp", json.dumps(list(whole.shape))], tmp_path)
    assert all(t == digests({"w": whole}) for t in got)
    assert proxy.served / unique <= 1.05, (proxy.served, unique)
    assert node.status()["fetched"]["shares"] >= 3


def test_nodes_restoring_together_read_each_share_from_the_bucket_once(s3, proxy, make_daemon, monkeypatch,
                                                                      tmp_path) -> None:
    """Two nodes of [peer] daemons: each share is read from the bucket by its fetcher
    alone, and copied from there by the other node."""
    want, unique, _, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "5s")
    got = _ranks(a, proxy, 3, ["load", "ddp"], tmp_path, nodes=[a, a, b])
    assert all(t == want for t in got)
    assert proxy.served / unique <= 1.05, (proxy.served, unique)
    figures = [n.status()["fetched"] for n in (a, b)]
    assert sum(f["bytes"] for f in figures) == unique, figures  # each share from the bucket once, in all
    # the ranks in turn: each node fetches some; it copies the rest from the other, over `pull` or,
    # once they are in that node's root, through the peer tier, whichever comes first
    assert all(0 < f["bytes"] < unique and f["failed"] == 0 for f in figures), figures
    # the copies land as they come, without torch (whose import takes the daemon a minute under load)
    for n in (a, b):
        assert "libtorch" not in Path(f"/proc/{n.pid}/maps").read_text(), f"daemon {n.pid} imported torch"


def test_a_dead_fetcher_leaves_its_shares_to_the_bucket_with_a_warning(s3, proxy, make_daemon, monkeypatch,
                                                                       tmp_path) -> None:
    """A node whose peer (the fetcher of some shares) is gone reads those shares from the
    bucket itself, once, says so in its log, and its ranks still read every byte as saved."""
    want, unique, listens, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "3s")
    b.kill()
    proxy.reset()
    got = _ranks(a, proxy, 2, ["load", "ddp"], tmp_path)
    assert all(t == want for t in got)
    assert proxy.served / unique <= 1.05, (proxy.served, unique)
    fetched = a.status()["fetched"]
    assert fetched["bytes"] == unique and fetched["peer_bytes"] == 0 and fetched["failed"] == 0, fetched
    assert f"from its fetcher {listens[1]} not used" in a.log_text(), a.log_text()[-3000:]


def test_a_pull_copies_a_share_while_its_fetcher_lands_it(s3, proxy, make_daemon, monkeypatch, tmp_path) -> None:
    """The fetcher's download waits after each piece until the other node has read all
    that landed (failpoint ``fetch.piece``): the other node copies each byte of the
    shares it pulls while they are still landing, and its ranks read them as saved."""
    want, unique, _, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "5s", b_failpoints="fetch.piece")
    got = _ranks(a, proxy, 3, ["load", "ddp"], tmp_path)
    assert all(t == want for t in got)
    fa, fb = (n.status()["fetched"] for n in (a, b))
    assert fa["failed"] == 0 and 0 < fa["peer_bytes"] == fb["bytes"] and fa["bytes"] + fb["bytes"] == unique, (fa, fb)
    assert fb["streamed"] == fb["bytes"], fb  # every byte the fetcher landed was copied before it was whole
    assert "no peer read" not in b.log_text(), b.log_text()[-3000:]


def test_a_pull_from_a_fetcher_that_does_not_say_how_far_it_landed_waits_for_the_share(
        s3, proxy, make_daemon, monkeypatch, tmp_path) -> None:
    """A fetcher whose ``pull`` answers lack ``readable`` (as before it was added:
    failpoint ``peer.pull_unmarked``) is copied from once it holds the whole share."""
    want, unique, _, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "5s", b_failpoints="peer.pull_unmarked")
    got = _ranks(a, proxy, 3, ["load", "ddp"], tmp_path)
    assert all(t == want for t in got)
    fa, fb = (n.status()["fetched"] for n in (a, b))
    assert fa["failed"] == 0 and 0 < fa["peer_bytes"] == fb["bytes"] and fb["streamed"] == 0, (fa, fb)


def test_a_fetcher_killed_while_a_pull_copies_leaves_the_share_to_the_bucket(s3, proxy, make_daemon, monkeypatch,
                                                                             tmp_path) -> None:
    """The fetcher dies once the other node has copied part of a share it was landing
    (failpoint ``fetch.hold``: it lands nothing more once that is read): that node reads
    the share from the bucket itself, says so, and its ranks read every byte as saved."""
    want, unique, listens, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "3s", b_failpoints="fetch.hold")
    procs = _start(a, proxy, 3, ["load", "ddp"], tmp_path)
    deadline = time.monotonic() + RANK_S
    while b.status()["fetched"]["streamed"] == 0:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no pull started streaming"
        time.sleep(0.05)
    b.kill()
    got = _finish(procs, tmp_path)
    assert all(t == want for t in got)
    fetched = a.status()["fetched"]
    assert fetched["bytes"] > 0 and fetched["peer_bytes"] == 0 and fetched["failed"] == 0, fetched
    assert f"from its fetcher {listens[1]} not used" in a.log_text(), a.log_text()[-3000:]


def test_a_pull_that_waits_is_answered_once_its_fetchers_mark_moves(s3, proxy, make_daemon, monkeypatch,
                                                                     tmp_path) -> None:
    """A ``pull`` with ``wait_ms`` is not answered while nothing more has landed: the
    fetcher's download holds after each piece until it is read (failpoint
    ``fetch.piece``), and the waiting pull's answer carries the next piece's mark, once
    the asker read the last. One asking to wait longer than the fetcher waits is refused."""
    _, _, listens, (a, b) = _two_peer_nodes(make_daemon, monkeypatch, proxy, "5s", b_failpoints="fetch.piece")
    pull = PeerPull(load_config(a.config))
    rank = next(r for r in range(3) if pull.fetcher("ddp", STEP, r) == listens[1])
    req = {"op": "pull", "run": "ddp", "step": STEP, "rank": rank}
    asks, reads = (messages.Link(listens[1], pull.keys) for _ in range(2))
    try:
        with pytest.raises(messages.PeerRefused, match="wait_ms 5001 is more than this node waits"):
            asks.request({**req, "wait_ms": 5001}, timeout=30)
        deadline = time.monotonic() + RANK_S
        while not (marks := asks.request(req, timeout=30)[0]["readable"]):
            assert time.monotonic() < deadline, "the fetcher never landed a piece"
            time.sleep(0.05)
        (file, first), = marks.items()
        waiting = asks.send({**req, "have": marks, "wait_ms": 5000}, timeout=30)
        asks.recv(asks.send({"op": "ping"}, timeout=30), timeout=30)  # answered while the pull still waits
        reads.request({"op": "read", "run": "ddp", "step": STEP, "rank": rank, "file": file, "offset": 0,
                       "length": first}, timeout=30)
        answer, _ = asks.recv(waiting, timeout=30)
        assert answer["readable"][file] > first, (answer, first)
        _copy_out(asks, reads, req, {file: first})
    finally:
        asks.close()
        reads.close()


def _copy_out(asks, reads, req: dict, read_to: dict) -> None:
    """A share read from its fetcher as it lands, until it has landed."""
    while not (answer := asks.request({**req, "have": read_to, "wait_ms": 1000}, timeout=30)[0])["landed"]:
        for file, mark in answer["readable"].items():
            if mark > read_to.get(file, 0):
                reads.request({**req, "op": "read", "file": file, "offset": read_to.get(file, 0),
                               "length": mark - read_to.get(file, 0)}, timeout=30)
                read_to[file] = mark


def _two_peer_nodes(make_daemon, monkeypatch, proxy, stall: str, b_failpoints: str = ""):
    """A DDP step in the bucket and two [peer] daemons reading it through ``proxy``, the
    second with ``b_failpoints`` armed: the saved digests, the unique bytes, the daemons'
    ``listen`` endpoints and the daemons."""
    want = digests(_flat(_ddp_state()))
    _upload(make_daemon, monkeypatch, lambda p, r: p.save(_ddp_state(), STEP, replicated=True))
    unique = _unique("ddp")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    nodes = []
    for e, armed in zip(listens, ["", b_failpoints]):
        monkeypatch.setenv("CKPTD_FAILPOINTS", armed)
        nodes.append(make_daemon(tables={"remote": {"url": URL},
                                         "peer": {"listen": e, "peers": [o for o in listens if o != e],
                                                  "stall": stall}}))
    monkeypatch.delenv("CKPTD_FAILPOINTS")
    proxy.reset()
    return want, unique, listens, nodes
