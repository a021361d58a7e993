"""The reader's side of the peer tier (docs/tiers.md, "Recovery"): a training process
asks its node's daemon, which alone holds a key to the peers; real daemons on
127.0.0.1 stand for nodes."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import random
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import ckptd
from ckptd.config import load as load_config
from ckptd.errors import CheckpointCorrupt, CheckpointError
from ckptd.layout import is_data_file
from ckptd.peer.backoff import Backoff
from ckptd.peer import messages
from ckptd.tiers import landing, peer_discovery
from ckptd.tiers.peer_reader import PeerTier
from ckptd.transport import wire
from ckptd.transport.oneshot import request
from conftest import Daemon, free_port
from test_peer import _held, _save, _status, _wait
from test_peer_fuzz import node_keys


def _keyed_pair(tmp_path, **producer: object) -> tuple[Daemon, Daemon, dict[str, Path]]:
    """Two nodes, each its own key pair ([peer] curve_peers); ``producer``: a [producer]
    table in both configs besides. Also the secret key file of each node's listen."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    secrets = node_keys(tmp_path / "nodekeys", listens)
    nodes = []
    for i, listen in enumerate(listens):
        peer = {"listen": listen, "peers": [listens[1 - i]], "curve_peers": str(tmp_path / "nodekeys" / "peers")}
        tables = {"peer": peer, **({"producer": producer} if producer else {})}
        nodes.append(Daemon(tmp_path / f"node{i}", tables=tables, curve_secret_key=str(secrets[listen])))
    return nodes[0], nodes[1], {str(n.config): secrets[listen] for n, listen in zip(nodes, listens)}


KEYLESS = textwrap.dedent("""
    import hashlib, json, logging, sys
    import ckptd
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    readable = []
    for path in sys.argv[1:]:
        try:
            open(path, "rb").close()
            readable.append(path)
        except PermissionError:
            pass
    info = ckptd.latest("job")
    w = ckptd.load("job", info.step)["w"]
    print(json.dumps({"readable": readable, "step": info.step, "tiers": list(info.tiers),
                      "sha": hashlib.sha256(w.numpy().tobytes()).hexdigest()}))
""")


def test_a_trainer_holding_no_key_recovers_through_its_daemon_which_refuses_other_users(tmp_path) -> None:
    """A training process that can read no key file at all (root without the capabilities
    that pass file permissions, every key 0000): its node's daemon, restarted on an empty
    root, asks the peer with its own key and lands the share in its root; the process
    reads it there, bit-exact, with no warning. Then ``recover`` on that daemon: a run
    another Unix user owns is refused; a step or rank nobody holds is an error naming
    the peers asked; hostile asks get an error reply each, and the daemon serves on."""
    a, b, _ = _keyed_pair(tmp_path)
    try:
        a.start()
        b.start()
        saved = _replaced_once_held(a, b, 2)
        key_files = sorted(str(p) for p in (tmp_path / "nodekeys").rglob("*") if p.is_file())
        for path in key_files:
            os.chmod(path, 0)  # the daemons read theirs at start
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
        out = subprocess.run(prefix + [sys.executable, "-c", KEYLESS, *key_files], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, CKPTD_CONFIG=str(a.config)))
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        want = hashlib.sha256(saved[2].numpy().tobytes()).hexdigest()
        assert answer == {"readable": [], "step": 2, "tiers": ["peer"], "sha": want}, answer
        assert "WARNING" not in out.stderr, out.stderr
        assert (a.root / "job" / "step-000000000002" / "manifest-r00000.json").exists()
        recovered = _recovered(a)
        assert recovered["fetched_shares"] == 1 and recovered["failed"] == 0, recovered
        _refuses_and_survives(a, [str(load_config(n.config).peer.listen) for n in (a, b)])
    finally:
        for n in (a, b):
            n.cleanup()


def _recovered(d: Daemon) -> dict:
    """What ``d``'s daemon recovered for its readers (status's ``recovered``)."""
    return request(d.endpoint, wire.encode("status", seq=1), 30)["status"]["recovered"]


def _recover(d: Daemon, **fields: object) -> str:
    """"served", or the error ``recover`` with these fields (the rest: rank 0 of step 1) got."""
    header = dict({"seq": 1, "run": "job", "step": 1, "ranks": [0], "root": str(d.root), "memory": None}, **fields)
    try:
        while not request(d.endpoint, wire.encode("recover", **header), 30)["done"]:
            pass  # under way: the daemon answers every few seconds, and is asked again
    except CheckpointError as exc:
        return str(exc)
    return "served"


def _refuses_and_survives(d: Daemon, listens: list[str]) -> None:
    os.chmod(d.sock_dir, 0o750)
    (d.root / "other").mkdir()
    (d.root / "other" / ".owner").write_text("uid:65534\n")
    out = subprocess.run([sys.executable, "-c", AS_OTHER_USER, d.endpoint, str(d.root), "65533"],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    refused = out.stdout.strip()
    assert refused.startswith("refused:") and "run 'other' belongs to Unix user 65534" in refused, refused
    missing = _recover(d, step=9)
    assert "run 'job' step 9 is complete neither in" in missing and all(e in missing for e in listens), missing
    assert "has 1 ranks: no rank [3]" in _recover(d, step=2, ranks=[3])
    assert "lands the peers' shares in its root" in _recover(d, root=str(d.root.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from hostile import recover

    rng = random.Random(5)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        for i in range(150):
            sock.send(recover(rng, i, str(d.root)))
        replies = []
        while len(replies) < 150:
            assert sock.poll(30_000), f"{len(replies)} of 150 hostile asks answered"
            replies.append(msgpack.unpackb(sock.recv(), raw=False)["op"])
    finally:
        sock.close(0)
    assert set(replies) <= {"error", "recovered"} and "error" in replies, set(replies)
    assert _recover(d, step=2) == "served"


AS_OTHER_USER = textwrap.dedent("""
    import os, sys
    from ckptd.transport import wire
    from ckptd.transport.oneshot import request
    from ckptd.errors import CheckpointCorrupt, CheckpointError
    endpoint, root, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.setgroups([0])  # imports first, then become that user (group 0 reaches the socket)
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    try:
        request(endpoint, wire.encode("recover", seq=1, run="other", step=1, ranks=[0], root=root, memory=None), 30)
        print("served")
    except CheckpointError as exc:
        print("refused:", exc)
""")


ASKS_AS = textwrap.dedent("""
    import json, os, sys
    import msgpack, zmq
    endpoint, uid, final, asks = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "final", json.loads(sys.argv[4])
    if uid:
        os.setgroups([0])  # group 0 reaches the socket
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    send = lambda i: sock.send(msgpack.packb(dict(asks[i], op="recover", seq=i + 1), use_bin_type=True))
    for i in range(len(asks)):
        send(i)
    got = {}
    while len(got) < len(asks) and sock.poll(60_000):
        r = msgpack.unpackb(sock.recv(), raw=False)
        if final and r["op"] == "recovered" and not r["done"]:
            send(r["seq"] - 1)  # under way: asked again, as a reader does
        else:
            got[r["seq"]] = r["message"] if r["op"] == "error" else "served" if r["done"] else "waiting"
    print(json.dumps([got.get(i + 1) for i in range(len(asks))]))
""")


def _asks_as(d: Daemon, uid: int, asks: list[dict], *, final: bool = True) -> list[str]:
    """What ``d`` answered ``recover`` asks sent at once by Unix user ``uid``: the error's
    message, "served" or (``final`` False: its first answer) "waiting"."""
    out = subprocess.run([sys.executable, "-c", ASKS_AS, d.endpoint, str(uid), "final" if final else "first",
                          json.dumps(asks)], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _ask(d: Daemon, run: str = "job", step: int = 1, ranks: list[int] | None = None) -> dict:
    return {"run": run, "step": step, "ranks": ranks, "root": str(d.root), "memory": None}


def test_recover_asks_and_recoveries_are_bounded_per_user_and_in_total(tmp_path) -> None:
    """B's recoveries of A's steps are held up (this test holds each share's landing lock
    in B's root). A user's 17th recovery at once is refused naming JOBS_PER_USER, the 33rd
    of all users naming JOBS, a user's 33rd ask waiting naming ASKS_PER_USER; an ask that
    joins a recovery under way is not refused for another user's count; once let go, every
    recovery lands its share."""
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = _node(tmp_path, "a", a_, [b_])
    b = Daemon(tmp_path / "b", tables={"peer": {"listen": b_, "peers": [a_], "timeout": "5s"}}, shared_runs=True)
    locks = []
    try:
        a.start()
        b.start()
        _save(a, range(1, 34), nbytes=4096)
        for step in range(1, 34):
            folder = b.root / "job" / f"step-{step:012d}"
            folder.mkdir(parents=True)
            locks.append(os.open(folder / ".fetch-r00000.lock", os.O_RDWR | os.O_CREAT, 0o644))
            fcntl.flock(locks[-1], fcntl.LOCK_EX)
        os.chmod(b.sock_dir, 0o750)
        first = _asks_as(b, 0, [_ask(b, step=s, ranks=[0]) for s in range(1, 18)], final=False)
        assert first[:16] == ["waiting"] * 16 and "(JOBS_PER_USER = 16)" in first[16], first
        assert "Unix user 0 has 16 recoveries under way" in first[16], first
        assert _asks_as(b, 65533, [_ask(b, step=s, ranks=[0]) for s in range(17, 33)], final=False) == ["waiting"] * 16
        third = _asks_as(b, 65532, [_ask(b, step=33, ranks=[0]), _ask(b, step=1, ranks=[0])], final=False)
        assert "32 recoveries are under way" in third[0] and "(JOBS = 32)" in third[0] and third[1] == "waiting", third
        joined = _asks_as(b, 0, [_ask(b, step=1, ranks=[0])] * 33, final=False)
        assert joined[:32] == ["waiting"] * 32 and "(ASKS_PER_USER = 32)" in joined[32], joined
        assert _recovered(b)["refused"] == 3
        for fd in locks:
            os.close(fd)
        locks = []
        landed = [b.root / "job" / f"step-{s:012d}" / "manifest-r00000.json" for s in range(1, 33)]
        _wait(lambda: all(p.exists() for p in landed) and _recovered(b)["running"] == 0, "every recovery landed",
              timeout=120)
        assert not (b.root / "job" / "step-000000000033" / "manifest-r00000.json").exists()
    finally:
        for fd in locks:
            os.close(fd)
        for n in (a, b):
            n.cleanup()


def test_a_streamed_share_is_readable_file_by_file_and_a_failed_one_leaves_no_temporary_file(tmp_path) -> None:
    """``landing.stream`` (the daemon's landing of a peer's share): a file is in place with
    its bytes once ``done`` names it, before the next is filled, and ``placed`` is told
    (files filled through their mappings and through ``write``, a part at a time);
    a fill that fails after the first file leaves that one (a reader told of it may be
    reading it) and no temporary file."""
    sizes = {"r00000-000000.safetensors": 3 << 20, "r00000-000001.safetensors": 0, "r00000-000002.safetensors": 5000}
    data = {f: os.urandom(n) for f, n in sizes.items()}
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    ok.mkdir()
    bad.mkdir()
    in_place, placed = [], []

    def fill(views: dict, done, write: dict) -> None:
        for i, (file, view) in enumerate(views.items()):
            assert not (ok / file).exists()
            if i % 2:
                view[:] = data[file]
            else:
                for at in range(0, len(view), 1 << 20):
                    write[file](at, memoryview(data[file])[at:at + (1 << 20)])
            done(file)
            in_place.append((ok / file).read_bytes() == data[file])

    landing.stream(ok, sizes, fill, placed.append)
    assert in_place == [True] * 3 and placed == list(sizes)
    assert sorted(p.name for p in ok.iterdir()) == sorted(sizes)
    first = next(iter(sizes))

    def failing(views: dict, done, write: dict) -> None:
        views[first][:] = data[first]
        done(first)
        raise CheckpointCorrupt("the next file's bytes do not match their checksums")

    with pytest.raises(CheckpointCorrupt, match="next file"):
        landing.stream(bad, sizes, failing)
    assert [p.name for p in bad.iterdir()] == [first] and (bad / first).read_bytes() == data[first]


def test_a_run_this_node_has_not_seen_is_recovered_only_by_the_owner_its_manifests_name(tmp_path) -> None:
    """Node B has never seen runs "theirs" (owned by Unix user 65534 where A wrote it) and
    "job" (written by root: no owner recorded). User 65533 recovering either through B is
    refused, naming who wrote it, and claims nothing; user 65534 recovers "theirs" and B
    records it as theirs, after which 65533 is refused as for any owned run."""
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a, b = _node(tmp_path, "a", a_, [b_]), _node(tmp_path, "b", b_, [a_])
    try:
        a.start()
        b.start()
        (a.root / "theirs").mkdir(parents=True)
        (a.root / "theirs" / ".owner").write_text("uid:65534\n")  # as a producer of user 65534 would leave it
        with a.producer("theirs") as p:
            p.save({"w": torch.arange(1024.0)}, 1).wait(30)
        _save(a, range(1, 2), nbytes=4096)
        os.chmod(b.sock_dir, 0o750)
        refused = _asks_as(b, 65533, [_ask(b, "theirs"), _ask(b, "theirs", ranks=[0]), _ask(b, "job", step=None)])
        for why in refused[:2]:
            assert "run 'theirs' has no owner on this node yet" in why, refused
            assert "written by Unix user 65534, not by Unix user 65533" in why, refused
        assert "written by no one recorded" in refused[2], refused
        assert not (b.root / "theirs" / ".owner").exists() and not (b.root / "job" / ".owner").exists()
        assert not (b.root / "theirs" / "step-000000000001" / "manifest-r00000.json").exists()
        assert _asks_as(b, 65534, [_ask(b, "theirs")]) == ["served"]
        assert _asks_as(b, 65534, [_ask(b, "theirs", ranks=[0])]) == ["served"]
        assert (b.root / "theirs" / ".owner").read_text() == "uid:65534\n"
        assert (b.root / "theirs" / "step-000000000001" / "manifest-r00000.json").exists()
        again = _asks_as(b, 65533, [_ask(b, "theirs")])
        assert "run 'theirs' belongs to Unix user 65534" in again[0], again
    finally:
        for n in (a, b):
            n.cleanup()


# -- bounded answers, and what a load costs each peer ---------------------------------------
def _lose_root(node: Daemon) -> None:
    """The node's daemon killed and started again on an empty root: a node replaced."""
    node.kill()
    shutil.rmtree(node.root)
    node.start()


def _replaced_once_held(node: Daemon, holder: Daemon, steps: int) -> dict:
    """Steps 1..``steps`` saved on ``node``; once ``holder`` holds the newest share in
    memory, ``node`` is replaced on an empty root. The tensors saved, by step."""
    saved = _save(node, range(1, steps + 1))
    _wait(lambda: _held(holder).get((steps, 0)) == "memory", f"step {steps}'s share held by its partner")
    _lose_root(node)
    return saved


def _node(tmp_path: Path, name: str, listen: str, peers: list[str], **peer: object) -> Daemon:
    return Daemon(tmp_path / name, tables={"peer": {"listen": listen, "peers": peers, "timeout": "1s", **peer}})


def _served(node: Daemon) -> dict:
    """What node's peer port answered: op -> {requests, bytes}."""
    return _status(node)["peer"]["served"]


def _ask_raw(endpoint: str, header: dict) -> dict:
    from ckptd.transport import sealed_client

    chan = sealed_client.Channel(endpoint, None, max_header=messages.MAX_HEADER_BYTES, max_payload=2**30, hwm=8)
    try:
        deadline = time.monotonic() + 10
        chan.send(msgpack.packb(dict(header, id=1), use_bin_type=True), None, deadline)
        return msgpack.unpackb(bytes(chan.recv(deadline)[0]), raw=False)
    finally:
        chan.close()


def test_a_peer_with_many_steps_answers_within_bounds_and_a_load_asks_each_peer_once(tmp_path, monkeypatch) -> None:
    """B wrote rank 0 of 80 steps, A rank 1 of steps 70-79: a fresh node C finds step 79
    (the newest both hold) and loads it. Each peer answers a bounded summary once, and
    manifests only of the shares C lacks, one holder a rank."""
    a_, b_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    a = _node(tmp_path, "a", a_, [b_])
    b = _node(tmp_path, "b", b_, [a_])
    c = _node(tmp_path, "c", c_, [a_, b_])
    try:
        for n in (a, b, c):
            n.start()
        saved0 = _save(b, range(1, 81), nbytes=4096, rank=0, world=2)
        saved1 = _save(a, range(70, 80), nbytes=4096, rank=1, world=2)
        # A's newest share (step 79 rank 1) replicated to B: then what B answers is settled
        _wait(lambda: {"rank": 1, "attempt": None, "world_size": 2, "where": "memory"} in
              _ask_raw(b_, {"op": "steps", "run": "job", "limit": 1, "step": 79})["steps"][0]["shares"],
              "A's step 79 held by B")
        # the bounds, asked raw: at most MAX_STEPS_ANSWERED steps, newest first; more is an error
        answer = _ask_raw(b_, {"op": "steps", "run": "job", "limit": messages.MAX_STEPS_ANSWERED})
        assert answer["ok"] and answer["more"] is True, answer
        assert [s["step"] for s in answer["steps"]] == list(range(80, 80 - messages.MAX_STEPS_ANSWERED, -1))
        assert answer["steps"][0]["shares"] == [{"rank": 0, "attempt": None, "world_size": 2, "where": "disk"}]
        assert answer["steps"][1]["shares"] == [{"rank": 0, "attempt": None, "world_size": 2, "where": "disk"},
                                                {"rank": 1, "attempt": None, "world_size": 2, "where": "memory"}]
        for bad in ({"limit": messages.MAX_STEPS_ANSWERED + 1}, {"limit": 0}, {"limit": 2**62}):
            refused = _ask_raw(b_, {"op": "steps", "run": "job", **bad})
            assert refused["ok"] is False and "limit" in refused["error"], refused
        one = _ask_raw(b_, {"op": "steps", "run": "job", "limit": 1, "step": 3})
        assert [s["step"] for s in one["steps"]] == [3] and one["more"] is False, one
        refused = _ask_raw(b_, {"op": "manifests", "run": "job", "step": 79,
                                "ranks": list(range(messages.MAX_RANKS_ASKED + 1))})
        assert refused["ok"] is False and f"at most {messages.MAX_RANKS_ASKED}" in refused["error"], refused
        got = _ask_raw(b_, {"op": "manifests", "run": "job", "step": 79, "ranks": [0, 1, 7]})
        assert sorted((m["rank"], m["where"]) for m in got["manifests"]) == [(0, "disk"), (1, "memory")], got
        assert got["left"] == [], got

        before = {n: _served(n) for n in (a, b)}
        monkeypatch.setenv("CKPTD_CONFIG", str(c.config))
        monkeypatch.setenv("RANK", "1")
        info = ckptd.latest("job")
        assert info is not None and info.step == 79 and info.tiers == ("peer",), info
        state = ckptd.load("job")  # latest, then find: what latest learnt serves find
        assert state["step"] == 79 and torch.equal(state["w"], saved1[79])
        assert torch.equal(ckptd.load("job", 79, rank=0)["w"], saved0[79])
        cost = {n: {op: _diff(before[n], _served(n), op) for op in ("steps", "manifests", "read")} for n in (a, b)}
        for n in (a, b):  # latest, latest+find, find: one summary each, manifests only of the lacking ranks
            assert cost[n]["steps"][0] == 3, cost
            assert cost[n]["manifests"][0] <= 3, cost
        # each rank's manifest asked of one holder per call: rank 1 of B (its memory), rank 0 of one of them
        assert 3 <= sum(cost[n]["manifests"][0] for n in (a, b)) <= 6, cost
        assert cost[a]["steps"][1] + cost[b]["steps"][1] < 16 * 1024, cost  # summaries of 16 steps, not manifests
        print("cost per peer of latest + load + load(rank=0):", {str(n.base.name): v for n, v in cost.items()})
    finally:
        for n in (a, b, c):
            n.cleanup()


def _diff(before: dict, after: dict, op: str) -> tuple[int, int]:
    b, a = before.get(op, {"requests": 0, "bytes": 0}), after.get(op, {"requests": 0, "bytes": 0})
    return a["requests"] - b["requests"], a["bytes"] - b["bytes"]


# -- once a node: several local ranks loading the same step ---------------------------------
LOADER = textwrap.dedent("""
    import json, os
    from pathlib import Path
    import torch, torch.distributed as dist
    import ckptd
    rank, n = int(os.environ["RANK"]), int(os.environ["NBYTES"]) // 4
    state = {"w": torch.empty(n)}
    dist.init_process_group("gloo")
    assert ckptd.latest("job").step == 1  # imports and asks the peers: what each does before the fetch
    dist.barrier()  # then every rank fetches at the same moment
    info = ckptd.load_into(state, "job", 1)  # the share this rank reads: rank 0's, the peers' only
    want = torch.arange(n, dtype=torch.float32) + 1000
    Path(os.environ["OUT"], f"r{rank}.json").write_text(json.dumps({"step": info.step,
                                                                     "exact": torch.equal(state["w"], want)}))
    dist.destroy_process_group()
""")


def test_local_ranks_loading_at_once_fetch_the_share_once_a_node(tmp_path) -> None:
    """Three local rank processes (torchrun, gloo's env) on a node whose root lacks the
    share ask their daemon at once: it reads the share from the peers once (asks for
    it join one job), and each process's tensors are bit-exact."""
    a_, b_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    a = _node(tmp_path, "a", a_, [b_], memory="64MiB")
    b = _node(tmp_path, "b", b_, [a_])
    c = _node(tmp_path, "c", c_, [a_, b_])
    nbytes = 16 << 20
    try:
        for n in (a, b, c):
            n.start()
        _save(b, range(1, 2), nbytes=nbytes)
        _wait(lambda: _held(a).get((1, 0)) == "memory", "B's share held by A")
        step_b = b.root / "job" / "step-000000000001"
        share = sum(p.stat().st_size for p in step_b.iterdir() if is_data_file(p.name))
        before = {n: _diff({}, _served(n), "read")[1] for n in (a, b)}
        script, out = tmp_path / "loader.py", tmp_path / "out"
        script.write_text(LOADER)
        out.mkdir()
        env = dict(os.environ, CKPTD_CONFIG=str(c.config), NBYTES=str(nbytes), OUT=str(out), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                               str(script)], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        results = [json.loads((out / f"r{r}.json").read_text()) for r in range(3)]
        assert results == [{"step": 1, "exact": True}] * 3, results
        read = sum(_diff({}, _served(n), "read")[1] - before[n] for n in (a, b))
        assert share <= read < 2 * share, (read, share)  # once, with its answers' headers
        assert not list((c.root / "job" / "step-000000000001").glob(".fetch-*")), "a lock file was left behind"
        recovered = _recovered(c)
        assert recovered["fetched_shares"] == 1 and recovered["failed"] == 0, recovered  # one fetch a node
    finally:
        for n in (a, b, c):
            n.cleanup()


def test_a_daemon_lands_a_recovered_share_without_loading_torch(tmp_path, monkeypatch) -> None:
    """The daemon lands a recovered share without importing torch: the import would hold
    up the recovery that needs it, for memory landing never uses (it writes the files)."""
    a_, b_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = _node(tmp_path, "a", a_, [b_], memory="64MiB")
    b = _node(tmp_path, "b", b_, [a_])
    try:
        a.start()
        b.start()
        saved = _replaced_once_held(b, a, 1)
        monkeypatch.setenv("CKPTD_CONFIG", str(b.config))
        assert torch.equal(ckptd.load("job", 1)["w"], saved[1])
        _wait(lambda: _recovered(b)["fetched_shares"] == 1, "the share landed by B's daemon (behind the read)")
        assert "libtorch" not in Path(f"/proc/{b.pid}/maps").read_text()
    finally:
        for n in (a, b):
            n.cleanup()


# -- dead peers: backed off, never stalling the others ---------------------------------------
def test_a_stopped_and_a_killed_peer_are_backed_off_without_stalling_the_others(tmp_path, monkeypatch,
                                                                                caplog) -> None:
    """Of C's peers, A is stopped (SIGSTOP: its port accepts, nothing answers) and K is
    killed; B holds the share. A read waits ``timeout`` once for both together (4 s here:
    one after the other would take 8, and the slack absorbs a loaded machine); a silent
    peer is then left out for a back-off that doubles while it stays silent (up to the
    cap) and ends when it answers (asked with ``timeout`` 1 s from then on)."""
    silent = Backoff(2.0, 4.0)  # 2 s to ask the others, at once, within the first
    a_, b_, c_, k_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    a = _node(tmp_path, "a", a_, [b_])
    b = _node(tmp_path, "b", b_, [a_])
    k = _node(tmp_path, "k", k_, [b_])
    c = _node(tmp_path, "c", c_, [a_, k_, b_], timeout="4s")
    try:
        for n in (a, b, k, c):
            n.start()
        saved = _save(b, range(1, 2))
        k.kill()
        os.kill(a.pid, signal.SIGSTOP)
        monkeypatch.setenv("CKPTD_CONFIG", str(c.config))
        tier = PeerTier(load_config(c.config), c.root, silent)
        with caplog.at_level("INFO", logger="ckptd.peer"):
            t0 = time.monotonic()
            info = tier.latest("job")
            first = time.monotonic() - t0
            assert {e: silent.period(e) for e in (a_, k_)} == {a_: 2.0, k_: 2.0}
            assert 1 in tier.discovery.summary("job")  # at once: within the back-off, neither is asked
        assert info is not None and info.step == 1
        assert first < 2 * tier.cfg.timeout, f"{first:.1f} s: the silent peers were waited for one after the other"
        tier = PeerTier(dataclasses.replace(tier.config, peer=dataclasses.replace(tier.cfg, timeout=1.0)), c.root, silent)
        assert f"{a_} not asked: it did not answer" in caplog.text and f"{k_} not asked" in caplog.text
        assert silent.period(b_) == silent.period(c_) == 0
        assert torch.equal(ckptd.load("job", 1)["w"], saved[1])
        backs = []
        for _ in range(2):  # silent again each time it is asked: doubled, then the cap
            _wait(lambda: not silent.skipped(a_), "the back-off over", timeout=10)
            tier.discovery.summary("job")
            backs.append(silent.period(a_))
        assert backs == [4.0, 4.0], backs
        os.kill(a.pid, signal.SIGCONT)  # it answers again: asked at once, its back-off ended
        _wait(lambda: not silent.skipped(a_), "the back-off over", timeout=10)
        assert 1 in tier.discovery.summary("job")
        assert silent.period(a_) == 0 and silent.period(k_) == 4.0
    finally:
        if a.alive():
            os.kill(a.pid, signal.SIGCONT)
        for n in (a, b, k, c):
            n.cleanup()


def test_a_peer_silent_once_is_asked_again_before_latest_says_none(tmp_path, monkeypatch, caplog) -> None:
    """C's root is empty; A holds step 1. A stopped (SIGSTOP) through C's first ask: C asks
    it again, waiting longer, and finds step 1 once A goes on (a quick "none" made a
    resumed job start over). A stopped through both asks: none, with a warning naming A,
    and the next ask does not wait for A again."""
    a_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a = _node(tmp_path, "a", a_, [])  # it copies its share to nobody: only A can answer for step 1
    c = _node(tmp_path, "c", c_, [a_])
    try:
        for n in (a, c):
            n.start()
        _save(a, range(1, 2))
        monkeypatch.setenv("CKPTD_CONFIG", str(c.config))
        silent = Backoff(30.0, 60.0)
        os.kill(a.pid, signal.SIGSTOP)

        def go_on() -> None:  # once C's first ask found A silent
            _wait(lambda: silent.failures(a_) == 1, "A found silent", timeout=60)
            os.kill(a.pid, signal.SIGCONT)

        thread = threading.Thread(target=go_on)
        thread.start()
        info = PeerTier(load_config(c.config), c.root, silent).latest("job")
        thread.join()
        assert info is not None and info.step == 1 and silent.failures(a_) == 0
        os.kill(a.pid, signal.SIGSTOP)
        monkeypatch.setattr(peer_discovery, "PATIENT_S", 2.0)
        tier = PeerTier(load_config(c.config), c.root, silent)
        with caplog.at_level("INFO", logger="ckptd.peer"):
            assert tier.latest("job") is None
        assert f"{a_} did not answer within 2 s; what they hold is not counted" in caplog.text
        assert silent.failures(a_) == 2
        caplog.clear()
        with caplog.at_level("INFO", logger="ckptd.peer"):
            assert tier.latest("job") is None
        assert "asked again, waiting" not in caplog.text and f"{a_} not asked" in caplog.text
    finally:
        if a.alive():
            os.kill(a.pid, signal.SIGCONT)
        for n in (a, c):
            n.cleanup()


# -- agreement, and answers split by their size ----------------------------------------------
def test_a_step_whose_peer_shares_disagree_with_the_local_root_is_not_taken(tmp_path, monkeypatch) -> None:
    """C wrote rank 0 of steps 4 and 5 (attempt a1); B holds rank 1 of step 4 of a1 and
    of step 5 of another attempt: step 5 is not complete (the peer's share disagrees
    with the root's), step 4 is."""
    b_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    b = _node(tmp_path, "b", b_, [c_])
    c = _node(tmp_path, "c", c_, [b_])
    try:
        for n in (b, c):
            n.start()
        mine = _save(c, range(4, 6), rank=0, world=2, attempt="a1")
        theirs = _save(b, range(4, 5), rank=1, world=2, attempt="a1")
        _save(b, range(5, 6), rank=1, world=2, attempt="a2")
        monkeypatch.setenv("CKPTD_CONFIG", str(c.config))
        info = ckptd.latest("job")
        assert info is not None and info.step == 4 and set(info.tiers) == {"local", "peer"}, info
        assert torch.equal(ckptd.load("job", rank=1)["w"], theirs[4])
        assert torch.equal(ckptd.load("job", 4, rank=0)["w"], mine[4])
        with pytest.raises(ckptd.CheckpointNotFound):
            ckptd.load("job", 5, rank=1)
    finally:
        for n in (b, c):
            n.cleanup()


def test_manifests_beyond_one_answer_are_asked_again(tmp_path, monkeypatch) -> None:
    """A peer port whose answers hold one manifest each (``MAX_MANIFEST_BYTES`` made
    tiny; the real server, in this process) names the ranks it left out; the reader
    asks again for them and finds the step complete."""
    from ckptd.peer.holder import Holder
    from ckptd.peer.port import PeerServer

    writer = Daemon(tmp_path / "w")
    writer.start()
    saved = {r: _save(writer, range(1, 2), rank=r, world=3) for r in range(3)}
    writer.cleanup()
    listen = f"tcp://127.0.0.1:{free_port()}"
    server = PeerServer(listen, writer.root, Holder(64 << 20, 5.0), None, (4 << 20) + 65536, "n")
    server.start()
    monkeypatch.setattr(messages, "MAX_MANIFEST_BYTES", 1)
    try:
        c = Daemon(tmp_path / "c", tables={"peer": {"listen": listen, "peers": [listen]}})  # its config only
        c.root.mkdir()
        tier = PeerTier(load_config(c.config), c.root)
        info = tier.latest("job")
        assert info is not None and info.step == 1 and info.world_size == 3, info
        assert server.served["manifests"][0] == 3 and server.served["steps"][0] == 1, server.served
        holding = tier.open("job", 1)  # what latest learnt: nothing asked
        assert holding is not None and server.served["steps"][0] == 1, server.served
        holding.materialize([2])
        assert sorted(p.name for p in (c.root / "job" / "step-000000000001").glob("manifest-*")) == [
            "manifest-r00002.json"]
        out = torch.empty(65536)
        share = holding.manifests[2]
        holding.read(share, share.tensors, into={"w": out})
        assert torch.equal(out, saved[2][1])
    finally:
        server.close()


def test_the_port_answers_others_while_a_received_share_is_verified(tmp_path, monkeypatch) -> None:
    """``done`` checksums a whole share (a second for 10 GB) on the verify thread: held
    there (by an event of the test's), the real server still answers ``steps`` and
    ``ping`` at once, the share's room stays taken, and the share is listed only once
    its ``done`` is answered."""
    from ckptd.peer import holder as holding
    from ckptd.peer.holder import Holder
    from ckptd.peer.port import PeerServer

    writer = Daemon(tmp_path / "w")
    writer.start()
    _save(writer, range(1, 2))
    writer.cleanup()
    step = writer.root / "job" / "step-000000000001"
    manifest = (step / "manifest-r00000.json").read_bytes()
    data = {n: (step / n).read_bytes() for n in os.listdir(step) if is_data_file(n)}
    verifying, release = threading.Event(), threading.Event()
    real_verify = holding.verify

    def held_verify(*args):
        verifying.set()
        assert release.wait(60), "the test never released the verification"
        real_verify(*args)

    monkeypatch.setattr(holding, "verify", held_verify)
    listen = f"tcp://127.0.0.1:{free_port()}"
    own_root = tmp_path / "holder"
    own_root.mkdir()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from peer_fuzz import Asker

    holder = Holder(64 << 20, 5.0)
    server = PeerServer(listen, own_root, holder, None, (4 << 20) + 65536, "n")
    server.start()
    sender, asker = Asker(listen), Asker(listen)

    def ask(sock: Asker, header: dict, *payload: bytes) -> dict:
        sock.send_multipart([msgpack.packb(header, use_bin_type=True), *payload])
        assert sock.poll(10000), f"no answer to {header['op']}"
        answer = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        assert answer["ok"] is True and answer["id"] == header["id"], answer
        return answer

    try:
        offer = {"op": "offer", "id": 1, "manifest": manifest, "files": {n: len(b) for n, b in data.items()},
                 "keep_last": 1}
        xfer = ask(sender, offer)["xfer"]
        for n, b in data.items():
            ask(sender, {"op": "part", "id": 2, "xfer": xfer, "file": n, "offset": 0}, b)
        sender.send_multipart([msgpack.packb({"op": "done", "id": 3, "xfer": xfer})])
        assert verifying.wait(10), "done was not verified"
        assert ask(asker, {"op": "steps", "id": 4, "run": "job", "limit": 4})["steps"] == []  # not held yet
        assert ask(asker, {"op": "ping", "id": 5})["node"] == "n"
        assert holder.figures()["receiving_bytes"] == sum(len(b) for b in data.values())
        assert not sender.poll(100), "done answered before its share was verified"
        release.set()
        assert sender.poll(10000), "done never answered"
        assert msgpack.unpackb(sender.recv_multipart()[0], raw=False) == {"ok": True, "id": 3, "v": 2}
        listed = ask(asker, {"op": "steps", "id": 6, "run": "job", "limit": 4})["steps"]
        assert [(s["step"], [h["where"] for h in s["shares"]]) for s in listed] == [(1, ["memory"])], listed
        figures = holder.figures()
        assert figures["held_shares"] == 1 and figures["receiving_bytes"] == 0, figures
        assert server.served["done"][0] == 1, server.served
    finally:
        release.set()
        for sock in (sender, asker):
            sock.close()
        server.close()
