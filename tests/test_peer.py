"""The peer tier (docs/tiers.md): three daemons on 127.0.0.1, each with its own root
and [peer] listen port, stand for three nodes; a node is lost (daemon killed, root
deleted) and a fresh one resumes from its peers' memory, bit-exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.config import load as load_config
from ckptd.tiers.peer_reader import PeerTier
from conftest import Daemon, free_port

TRAIN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["CKPTD_CONFIG"] = os.environ["NODE_CONFIGS"].split(",")[rank]  # rank r on node r
    import torch, torch.distributed as dist
    from safetensors.torch import save_file
    import ckptd
    from ckptd import producer
    run, out, steps = os.environ["RUN"], Path(os.environ["OUT"]), int(os.environ["STEPS"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def flat(state):
        out = {f"model.{k}": v for k, v in state["model"].items()}
        for i, s in state["optim"]["state"].items():
            out[f"optim.{i}"] = s["momentum_buffer"]
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    start = 0
    if os.environ.get("RESUME"):
        state = ckptd.load(run)  # this rank's share ($RANK) of the newest complete step, any tier
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        save_file(flat(state), str(out / f"loaded-r{rank}.safetensors"))
        (out / f"resumed-r{rank}").write_text(str(start))
    producer.configure(run=run, staging_size="8MiB")
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        producer.save(state, step).wait(60)
        save_file(flat(state), str(out / f"saved-{step}-r{rank}.safetensors"))
    info = producer.wait_complete(steps, timeout=60, tier="peer")  # every rank's share in a peer's memory
    assert info.step == steps and info.world_size == world, info
    producer.close()
    dist.destroy_process_group()
""")


def _nodes(tmp_path: Path, tables: dict | None = None, memory: str = "64MiB", **peer_keys: object) -> list[Daemon]:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = []
    for i, listen in enumerate(listens):
        peer = {"listen": listen, "peers": [e for e in listens if e != listen], "memory": memory, "stall": "3s",
                **peer_keys}
        nodes.append(Daemon(tmp_path / f"node{i}", tables={**(tables or {}), "peer": peer}))
    return nodes


def _torchrun(tmp_path: Path, out: Path, configs: list[Path], **env: str) -> int:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, NODE_CONFIGS=",".join(map(str, configs)), RUN="job", OUT=str(out),
                    GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=full_env, stdout=open(out / "torchrun.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError((out / "torchrun.log").read_text()[-4000:]) from None
    assert rc == 0, (out / "torchrun.log").read_text()[-4000:]
    return rc


def _status(node: Daemon) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--json", "-c", str(node.config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _status_text(node: Daemon) -> str:
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "-c", str(node.config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["none", "stopped"])
def test_a_lost_node_resumes_from_peer_memory(tmp_path, request, monkeypatch, bucket) -> None:
    tables = {}
    if bucket == "stopped":
        s3 = request.getfixturevalue("s3")
        tables = {"remote": {"url": "s3://ckptd/peer", "max_retry_s": 1}}
    nodes = _nodes(tmp_path, tables)
    try:
        for n in nodes:
            n.start()
        job = tmp_path / "job"
        _torchrun(tmp_path, job, [nodes[0].config, nodes[1].config], STEPS="3")
        for n in nodes[:2]:
            peer = _status(n)["peer"]
            assert peer["under_replicated"] == 0, peer
        # the newest step of each rank is in a peer's memory (an older one may have been
        # skipped for it: replication yields to saves, docs/tiers.md)
        in_memory = {k for n in nodes for k, where in _held(n).items() if where == "memory"}
        assert {(3, 0), (3, 1)} <= in_memory, in_memory

        # node 0 is lost with its disk; a fresh one takes its place, address and config
        nodes[0].kill()
        shutil.rmtree(nodes[0].root)
        if bucket == "stopped":
            s3.stop()
        nodes[0].start()
        assert not (nodes[0].root / "job").exists()
        resumed = tmp_path / "resumed"
        _torchrun(tmp_path, resumed, [nodes[0].config, nodes[1].config], STEPS="5", RESUME="1")
        for r in range(2):
            assert (resumed / f"resumed-r{r}").read_text() == "3"
            assert _equal(load_file(str(resumed / f"loaded-r{r}.safetensors")),
                          load_file(str(job / f"saved-3-r{r}.safetensors"))), r
        # the whole state (every rank's share) on the new node: shares its root lacks come
        # from the peers into it, through the durable path, then load as local files
        monkeypatch.setenv("CKPTD_CONFIG", str(nodes[0].config))
        whole = ckptd.load("job", 5)
        assert whole["step"] == 5 and (nodes[0].root / "job" / "step-000000000005" / "manifest-r00001.json").is_file()
    finally:
        for n in nodes:
            n.cleanup()


# -- faults, in one process: producers of each "node" talk to its daemon --------------------
def _save(node: Daemon, steps: range, nbytes: int = 256 * 1024, rank: int = 0, world: int = 1, **opts) -> dict:
    saved = {}
    with node.producer("job", rank=rank, world_size=world, **opts) as p:
        for step in steps:
            t = torch.arange(nbytes // 4, dtype=torch.float32) + step * 1000 + rank
            p.save({"w": t, "step": step}, step).wait(30)
            saved[step] = t
    return saved


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _held(node: Daemon) -> dict:
    """What node's peer socket lists of run "job": {(step, rank): where}."""
    tier = PeerTier(load_config(node.config))
    tier.discovery.endpoints = [tier.cfg.listen]
    return {k: c[0][1] for k, c in tier.discovery.holdings("job").items()}


def test_a_damaged_replica_is_skipped_for_the_next(tmp_path, monkeypatch, caplog) -> None:
    nodes = _nodes(tmp_path)
    listens = [load_config(n.config).peer.listen for n in nodes]
    nodes[0] = Daemon(tmp_path / "node0b", tables={"peer": {"listen": listens[0], "peers": listens[1:],
                                                            "replicas": 2, "memory": "64MiB"}})
    try:
        monkeypatch.setenv("CKPTD_FAILPOINTS", "peer.serve")  # node 1 flips a byte of all it serves
        nodes[1].start()
        monkeypatch.delenv("CKPTD_FAILPOINTS")
        nodes[0].start()
        nodes[2].start()
        saved = _save(nodes[0], range(1, 2), nbytes=17 * 2**20 + 4096)  # out=: two parts, copied 1 MiB at a time
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "replicated")
        assert _held(nodes[1]).get((1, 0)) == _held(nodes[2]).get((1, 0)) == "memory"
        nodes[0].kill()
        shutil.rmtree(nodes[0].root)
        nodes[0].start()
        monkeypatch.setenv("CKPTD_CONFIG", str(nodes[0].config))
        state = ckptd.load("job", 1)  # the node's daemon fetches it: the bad copy, then the good one
        assert torch.equal(state["w"], saved[1])
        log = nodes[0].log_text()
        assert f"from {listens[1]} (memory) not used" in log and "does not match its checksum" in log, log
        out = torch.zeros_like(saved[1])
        assert ckptd.load("job", 1, out={"w": out})["w"].data_ptr() == out.data_ptr()
        assert torch.equal(out, saved[1])
        assert ckptd.load("job", 1, verify=True)["step"] == 1  # what was written is the good copy
    finally:
        for n in nodes:
            n.cleanup()


def test_a_partner_that_hangs_mid_transfer_is_replaced(tmp_path, monkeypatch) -> None:
    from ckptd.peer import partners

    nodes = _nodes(tmp_path)
    listens = [load_config(n.config).peer.listen for n in nodes]
    first = partners.of(load_config(nodes[0].config).peer, "job", 0)[0]
    hung = nodes[listens.index(first)]
    other = nodes[3 - listens.index(first)]
    cfg = dict(listen=listens[0], peers=listens[1:], memory="64MiB", stall="2s", frame="64KiB")
    nodes[0] = Daemon(tmp_path / "node0b", tables={"peer": cfg})
    try:
        monkeypatch.setenv("CKPTD_FAILPOINTS", "peer.receive@3")  # answers two parts, then never again
        hung.start()
        monkeypatch.delenv("CKPTD_FAILPOINTS")
        nodes[0].start()
        other.start()
        t0 = time.monotonic()
        _save(nodes[0], range(1, 3), nbytes=1 << 20)  # 16 parts a share
        assert time.monotonic() - t0 < 10  # training never waits for a partner
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "re-replicated to the other partner")
        status = _status(nodes[0])["peer"]
        assert status["failures"] >= 1, status
        assert _held(other).get((2, 0)) == "memory"
        assert (1, 0) not in _held(hung) and (2, 0) not in _held(hung)  # half-received: never listed
        assert "did not take run 'job' step 1 rank 0" in nodes[0].log_text()
    finally:
        for n in nodes:
            n.cleanup()


def test_the_memory_budget_and_keep_last_hold_over_a_long_run(tmp_path) -> None:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[0], "peers": listens[1:],
                                                          "memory": "1MiB"}}, metrics="127.0.0.1:0")
    sender = Daemon(tmp_path / "sender", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    pruned = Daemon(tmp_path / "pruned", tables={"peer": {"listen": listens[2], "peers": [listens[0]]},
                                                 "retention": {"keep_last": 2}})
    try:
        for n in (holder, sender, pruned):
            n.start()
        peaks = []
        with sender.producer("job") as p:
            for step in range(1, 21):  # 256 KiB + headers a share: 3 fit in 1 MiB
                p.save({"w": torch.full((65536,), float(step))}, step).wait(30)
                # each step replicated (replication yields to saves: back to back, only the newest would be)
                _wait(lambda: (step, 0) in _held(holder), f"step {step} held")
                if step % 5 == 0:
                    peaks.append(_status(holder)["peer"]["held_bytes"])
        _wait(lambda: _status(sender)["peer"]["under_replicated"] == 0, "replicated")
        status = _status(holder)["peer"]
        assert max(peaks + [status["held_bytes"]]) <= 2**20 and status["evicted"] >= 15, (peaks, status)
        held = _held(holder)
        # the newest steps that fit: three, ending at 20 (a step committed while the one
        # before it was still being sent is skipped for the newer one, so not always 18-20)
        assert len(held) == 3 and (20, 0) in held and min(held)[0] >= 15, held
        with urllib.request.urlopen(_status(holder)["metrics"], timeout=30) as page:  # Prometheus, too
            scraped = page.read().decode()
        assert f"ckptd_peer_held_bytes {float(status['held_bytes'])}" in scraped, scraped
        assert "ckptd_peer_under_replicated 0.0" in scraped
        # a run whose retention keeps 2 steps: its partner drops what retention deleted
        tier = PeerTier(load_config(holder.config))
        tier.discovery.endpoints = [tier.cfg.listen]
        with pruned.producer("kept") as p:
            for step in range(1, 7):
                p.save({"w": torch.full((1024,), float(step))}, step).wait(30)
                _wait(lambda: (step, 0) in tier.discovery.holdings("kept"), f"step {step} held")
        _wait(lambda: sorted(s for s, _ in tier.discovery.holdings("kept")) == [5, 6], "old replicas dropped")
    finally:
        for n in (holder, sender, pruned):
            n.cleanup()


def test_a_partner_list_naming_itself_or_an_unreachable_peer_is_reported_at_start(tmp_path) -> None:
    me = f"tcp://127.0.0.1:{free_port()}"
    alone = Daemon(tmp_path / "alone", tables={"peer": {"listen": me, "peers": [me]}})
    with pytest.raises(RuntimeError, match="names only this daemon's own listen endpoint"):
        alone.start()
    alone.cleanup()
    nobody = f"tcp://127.0.0.1:{free_port()}"
    lonely = Daemon(tmp_path / "lonely", tables={"peer": {"listen": me, "peers": [me, nobody], "timeout": "0.3s"}})
    try:
        lonely.start()
        _wait(lambda: "unreachable at start" in lonely.log_text(), "the unreachable peer reported")
        assert f"peer {nobody} is unreachable at start" in lonely.log_text()
        assert f"names this daemon's own listen endpoint {me}" in lonely.log_text()
    finally:
        lonely.cleanup()
    bad = Daemon(tmp_path / "bad", tables={"peer": {"listen": me, "peers": ["10.0.0.1:7701"]}})
    with pytest.raises(RuntimeError, match="is not a tcp:// endpoint"):
        bad.start()
    bad.cleanup()


def test_a_partner_lost_after_it_took_the_replica_is_replaced(tmp_path) -> None:
    from ckptd.peer import partners

    nodes = _nodes(tmp_path)
    listens = [load_config(n.config).peer.listen for n in nodes]
    cfg = dict(listen=listens[0], peers=listens[1:], memory="64MiB", heartbeat="0.5s", timeout="0.5s")
    nodes[0] = Daemon(tmp_path / "node0b", tables={"peer": cfg})
    first = partners.of(load_config(nodes[0].config).peer, "job", 0)[0]
    holder, other = nodes[listens.index(first)], nodes[3 - listens.index(first)]
    try:
        for n in nodes:
            n.start()
        _save(nodes[0], range(1, 2))
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "replicated")
        assert _held(holder).get((1, 0)) == "memory" and (1, 0) not in _held(other)
        holder.kill()  # it took the replica, then died: its memory is gone
        _wait(lambda: _held(other).get((1, 0)) == "memory", "re-replicated to the next peer")
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "replicated again")
        status = _status(nodes[0])["peer"]
        assert status["replicas_lost"] == 1 and status["holding"] == {first: 0, _listen(other): 1}, status
        assert f"peer {first} held replicas of 1 of this node's newest shares and does not answer" \
            in nodes[0].log_text()
        text = _status_text(nodes[0])
        assert "0 share(s) of this node under-replicated" in text and "1 lost with their holder" in text, text
        assert f"partner {first}: not answering" in text or f"partner {first}: up; holds 0" in text, text
        assert f"partner {_listen(other)}: up; holds 1 of this node's newest shares" in text, text
        assert "holding 1 replica(s) of peers' shares" in _status_text(other)
        # a partner restarted at the same address answers, but its memory is empty
        holder.start()
        other.kill()
        _wait(lambda: _held(holder).get((1, 0)) == "memory", "re-replicated to the restarted peer")
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "replicated once more")
    finally:
        for n in nodes:
            n.cleanup()


def _listen(node: Daemon) -> str:
    return load_config(node.config).peer.listen


def test_a_retry_goes_only_to_the_partners_lacking_the_share(tmp_path) -> None:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]  # the third: nobody listens
    sender = Daemon(tmp_path / "sender", tables={"peer": {
        "listen": listens[0], "peers": listens[1:], "replicas": 2, "heartbeat": "0.3s", "timeout": "0.3s", "stall": "1s"}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    try:
        holder.start()
        sender.start()
        _save(sender, range(1, 2))
        # one of the two replicas it wants: retried every heartbeat, several times over
        _wait(lambda: sender.log_text().count("has 1 of 2 replicas") >= 3, "retried")
        status = _status(sender)["peer"]
        assert status["under_replicated"] == 1 and status["replicated_shares"] == 1, status
        assert _held(holder).get((1, 0)) == "memory"
    finally:
        for n in (sender, holder):
            n.cleanup()


def test_dead_peers_cost_a_reader_one_timeout_together_and_are_then_not_asked(tmp_path, caplog) -> None:
    me = f"tcp://127.0.0.1:{free_port()}"
    dead = [f"tcp://127.0.0.1:{free_port()}" for _ in range(6)]  # nobody listens there
    node = Daemon(tmp_path / "node", tables={"peer": {"listen": me, "peers": dead, "timeout": "1s"}})
    try:
        node.start()
        _save(node, range(1, 3))
        tier = PeerTier(load_config(node.config))
        with caplog.at_level("INFO", logger="ckptd.peer"):
            t0 = time.monotonic()
            held = tier.discovery.holdings("job")
            first = time.monotonic() - t0
            again = tier.discovery.holdings("job")
        assert sorted(held) == sorted(again) == [(1, 0), (2, 0)]  # this node's own disk answered
        assert first < 3.0, f"{first:.1f} s: the dead peers were waited for one after another"
        for e in dead:
            assert f"{e} did not answer within 1 s" in caplog.text
            assert f"{e} not asked: it did not answer" in caplog.text
        assert f"{me} did not answer" not in caplog.text
    finally:
        node.cleanup()


def test_peers_with_curve_keys_replicate_and_serve_only_admitted_keys(tmp_path, keys, monkeypatch) -> None:
    os.link(keys["server"], keys["clients"] / "daemon.key")  # the daemons' shared key pair is admitted
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    curve = {"curve_secret_key": str(keys["server_secret"]), "curve_clients": str(keys["clients"])}

    def node(i: int, secret: str = "alice") -> Daemon:
        peer = {"listen": listens[i], "peers": [listens[1 - i]], "timeout": "1s"}
        producer = {"curve_server_key": str(keys["server"]), "curve_secret_key": str(keys[secret])}
        return Daemon(tmp_path / f"node{i}-{secret}", tables={"peer": peer, "producer": producer}, **curve)

    a, b = node(0), node(1)
    try:
        a.start()
        b.start()
        saved = _save(a, range(1, 2))
        _wait(lambda: _status(a)["peer"]["under_replicated"] == 0, "replicated over CurveZMQ")
        assert "serving peers on %s (CurveZMQ)" % listens[1] in b.log_text()
        a.kill()
        shutil.rmtree(a.root)
        a.start()
        monkeypatch.setenv("CKPTD_CONFIG", str(a.config))  # a reader with admitted keys
        assert torch.equal(ckptd.load("job", 1)["w"], saved[1])
        stranger = Daemon(tmp_path / "mallory", tables={"peer": {"listen": listens[0], "peers": [listens[1]]}},
                          curve_secret_key=str(keys["mallory"]), curve_clients=str(keys["clients"]))
        assert PeerTier(load_config(stranger.config)).discovery.holdings("job") == {}  # valid keys, not admitted
        from ckptd.peer import messages
        from ckptd.transport.curve import ClientKeys, load_public, load_secret

        alice = ClientKeys(load_public(keys["server"], "server"), *load_secret(keys["alice"], "alice"), keys["alice"])
        link = messages.Link(listens[1], alice)  # a producer's key: admitted, not served
        try:
            with pytest.raises(messages.PeerRefused, match="only a peer daemon's key is served here"):
                link.request({"op": "steps", "run": "job", "limit": 1}, timeout=30)
        finally:
            link.close()
        plain = Daemon(tmp_path / "plain", tables={"peer": {"listen": listens[0], "peers": [listens[1]]}})
        assert PeerTier(load_config(plain.config)).discovery.holdings("job") == {}  # no keys: nothing answers
    finally:
        for n in (a, b):
            n.cleanup()


def test_a_lost_node_with_several_ranks_fetches_their_shares_from_several_peers(tmp_path, monkeypatch,
                                                                                caplog) -> None:
    from ckptd.peer import partners

    nodes = _nodes(tmp_path, placement="rendezvous")  # a node's ranks spread over its peers
    listens = [load_config(n.config).peer.listen for n in nodes]
    try:
        for n in nodes:
            n.start()
        saved = {r: _save(nodes[0], range(1, 2), rank=r, world=3) for r in range(3)}  # one node, three ranks
        _wait(lambda: _status(nodes[0])["peer"]["under_replicated"] == 0, "replicated")
        nodes[0].kill()
        shutil.rmtree(nodes[0].root)
        nodes[0].start()
        monkeypatch.setenv("CKPTD_CONFIG", str(nodes[0].config))
        step_dir = nodes[0].root / "job" / "step-000000000001"
        for r in range(3):  # the daemon lands each share as a rank asks for it (its manifest last, behind
            assert torch.equal(ckptd.load("job", 1, rank=r)["w"], saved[r][1])  # the read), and only that one
            want = [f"manifest-r{i:05d}.json" for i in range(r + 1)]
            _wait(lambda want=want: sorted(p.name for p in step_dir.glob("manifest-*")) == want,
                  f"manifests {want} landed, and no other")
        out = torch.empty(65536)
        got = ckptd.load("job", 1, rank=2, out={"w": out})
        assert got["w"].data_ptr() == out.data_ptr() and torch.equal(out, saved[2][1])
        assert torch.equal(ckptd.load("job", 1, rank=2, mmap=True)["w"], saved[2][1])
        assert torch.equal(ckptd.load("job", 1)["w"], saved[0][1])  # a tensor every rank saved: rank 0's
        fetched = [line for line in nodes[0].log_text().splitlines() if "fetched from" in line]
        sources = {line.split(" fetched from ")[1].split()[0] for line in fetched}
        assert len(fetched) == 3, fetched
        # each rank from its own first partner: fanned in from every peer that the ranks' orders start with
        firsts = {partners.order(listens[1:], "job", r, me=listens[0])[0] for r in range(3)}
        assert sources == firsts, (sources, firsts)
        for r in range(3):
            assert (nodes[0].root / "job" / "step-000000000001" / f"manifest-r{r:05d}.json").is_file()
    finally:
        for n in nodes:
            n.cleanup()


def test_the_peer_tier_has_its_own_persist_time_and_interval(tmp_path) -> None:
    """The interval advice (docs/advise.md) gives the peer tier its own persist time: from
    the local commit to every replica held."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sender = Daemon(tmp_path / "sender", tables={"peer": {"listen": listens[0], "peers": [listens[1]]}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    try:
        holder.start()
        sender.start()
        with sender.producer("job") as p:
            for step in (10, 20, 30):
                p.save({"w": torch.full((65536,), float(step))}, step).wait(30)
                _wait(lambda: _status(sender)["peer"]["under_replicated"] == 0, "replicated")
        # the replica's lag is recorded by the peer sender thread as the partner's ack arrives
        _wait(lambda: set(_status(sender)["advice"]["job"]["tiers"]) == {"local", "peer"}, "the peer tier in status")

        def advise() -> dict:
            out = subprocess.run([sys.executable, "-m", "ckptd", "advise", "job", "--root", str(sender.root), "--json"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        # `advise --root` reads the measures file, which the daemon writes at most once a second
        _wait(lambda: "peer" in advise()["tiers"], "the peer tier in the measures file")
        a = advise()
        local, peer = a["tiers"]["local"], a["tiers"]["peer"]
        assert "remote" not in a["tiers"]
        assert peer["persist_s"] > local["persist_s"] > 0  # held by the partner after durable here
        assert peer["interval_seconds"] >= local["interval_seconds"]
    finally:
        for n in (sender, holder):
            n.cleanup()


def test_the_peer_rate_caps_what_replication_sends(tmp_path) -> None:
    """[peer] rate: 2 MiB in 256 KiB parts at 512 KiB/s take at least 2.5 s to send
    (one idle second banked), however fast the link."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sender = Daemon(tmp_path / "sender", tables={"peer": {"listen": listens[0], "peers": [listens[1]],
                                                          "rate": "512KiB", "frame": "256KiB"}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    try:
        holder.start()
        sender.start()
        _save(sender, range(1, 2), nbytes=2 << 20)
        _wait(lambda: _status(sender)["peer"]["under_replicated"] == 0, "replicated")
        status = _status(sender)["peer"]
        assert status["rate"] == 512 * 1024 and status["replicated_bytes"] > 2 << 20, status
        assert status["send_seconds"] >= 2.5 - 0.1, status
    finally:
        for n in (sender, holder):
            n.cleanup()
    slow = Daemon(tmp_path / "slow", tables={"peer": {"listen": listens[0], "peers": [listens[1]], "rate": "64KiB"}})
    with pytest.raises(RuntimeError, match=r"a partner gives a transfer up after 10 s.*raise rate, or lower frame"):
        slow.start()  # a 4 MiB frame at 64 KiB/s: 64 s between parts, and partners give up after 10
    slow.cleanup()
