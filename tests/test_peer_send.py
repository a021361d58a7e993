"""The sending side of the peer tier (docs/tiers.md, "Sending copies"): real daemons on
127.0.0.1 stand for nodes. A hung partner and a dead one never hold up the share's
way to a healthy one, and are backed off; retention's drops reach only the partners
that were sent replicas, batched."""

from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import safetensors.torch
import torch

from ckptd.config import load as load_config
from ckptd.peer import partners
from ckptd.peer.backoff import CAP_HEARTBEATS
from ckptd.tiers.peer_reader import PeerTier
from conftest import Daemon, free_port
from test_peer import _held, _status, _status_text, _wait


def test_a_hung_partner_and_a_dead_one_never_hold_up_the_healthy_one(tmp_path: Path) -> None:
    """Of the three partners of the share's order, the first is SIGSTOPped (its socket
    still accepts, nothing answers) and the second killed: each new step reaches the
    third within a few ``timeout``s, never one ``stall`` (20 s) per share, and the two
    are tried again only as their back-off lets them (heartbeat 0.5 s, doubling); the
    hung one, woken, is found back by a ping."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(4)]
    cfg = {"listen": listens[0], "peers": listens[1:], "stall": "20s", "timeout": "0.5s", "heartbeat": "0.5s",
           "memory": "64MiB"}
    sender = Daemon(tmp_path / "sender", tables={"peer": cfg})
    order = partners.of(load_config(sender.config).peer, "job", 0)
    hung, dead, healthy = (Daemon(tmp_path / f"p{i}", tables={"peer": {"listen": e, "peers": [listens[0]]}})
                           for i, e in enumerate(order))
    nodes = [sender, hung, dead, healthy]
    try:
        for n in (hung, dead, healthy, sender):
            n.start()
        _wait(lambda: f"peer {order[0]} answers" in sender.log_text(), "the first partner connected")
        assert hung.pid is not None
        os.kill(hung.pid, signal.SIGSTOP)  # connected, and silent from now on
        dead.kill()
        t0 = time.monotonic()
        waits = []
        with sender.producer("job", staging_size="8MiB") as p:
            for step in range(1, 9):
                p.save({"w": torch.full((65536,), float(step))}, step).wait(30)
                began = time.monotonic()  # committed: from here on, replication's time
                _wait(lambda: _held(healthy).get((step, 0)) == "memory", f"step {step} held by the healthy partner")
                waits.append(time.monotonic() - began)
        # at worst both back-offs ended together: two timeouts, then the transfer
        assert max(waits) < 10, waits
        status = _status(sender)["peer"]
        elapsed = time.monotonic() - t0  # the failures counted so far (pings once backed off, too)
        assert status["under_replicated"] == 0 and status["holding"][order[2]] == 1, status
        # each silent partner was tried (a share offered, or a ping once backed off) at most once
        # per back-off period: heartbeat, 2x, 4x ... up to CAP_HEARTBEATS x; the n-th failure in
        # a row comes at the earliest the sum of the n-1 skips before it after the first
        skips = itertools.accumulate(0.5 * min(2 ** i, CAP_HEARTBEATS) for i in range(1000))
        most = 1 + sum(1 for s in skips if s <= elapsed)
        for peer in order[:2]:
            tried = status["backoff"][peer]["failures"]
            assert 1 <= tried <= most, (peer, tried, most, elapsed, status)
        assert 2 <= status["failures"] <= sum(status["backoff"][p]["failures"] for p in order[:2]), status
        text = _status_text(sender)
        for peer in order[:2]:
            assert f"partner {peer}: not answering (" in text and " time(s) in a row)" in text, text
        assert f"partner {order[2]}: up; holds 1 of this node's newest shares" in text, text
        # the hung partner wakes up: pinged once its back-off runs out, it is up again
        os.kill(hung.pid, signal.SIGCONT)  # type: ignore[arg-type]
        _wait(lambda: order[0] not in _status(sender)["peer"]["backoff"], "the woken partner back", timeout=60)
        assert f"partner {order[0]}: up" in _status_text(sender)
        assert f"peer {order[0]} answers again" in sender.log_text()
    finally:
        if hung.alive():
            os.kill(hung.pid, signal.SIGCONT)  # type: ignore[arg-type]
        for n in nodes:
            n.cleanup()


def test_drops_are_batched_and_go_only_to_the_partners_that_were_sent_replicas(tmp_path: Path) -> None:
    """Two runs whose retention keeps one step, 12 saves each: their deleted steps reach
    the holder in at most one drop message per heartbeat (2 s), and the third daemon,
    never sent a replica, gets none; the holder forgets the replicas of deleted steps."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    cfg = {"listen": listens[0], "peers": listens[1:], "heartbeat": "2s", "memory": "64MiB"}
    sender = Daemon(tmp_path / "sender", tables={"peer": cfg, "retention": {"keep_last": 1}}, metrics="127.0.0.1:0")
    order = partners.of(load_config(sender.config).peer, "a", 0)
    assert order == partners.of(load_config(sender.config).peer, "b", 0)  # the ring: one order per node
    holder, bystander = (Daemon(tmp_path / f"p{i}", tables={"peer": {"listen": e, "peers": [listens[0]]}})
                         for i, e in enumerate(order))
    nodes = [sender, holder, bystander]
    try:
        for n in nodes:
            n.start()
        with sender.producer("a", staging_size="4MiB") as pa, sender.producer("b", staging_size="4MiB") as pb:
            for p in (pa, pb):
                p.save({"w": torch.full((4096,), 1.0)}, 1).wait(30)
            # the holder has a replica of each run: from now on every step retention deletes is
            # dropped there (saves back to back supersede their replicas before they are sent)
            _wait(lambda: _held_run(holder, "a") == _held_run(holder, "b") == {(1, 0): "memory"},
                  "step 1 of both runs held")
            t0 = time.monotonic()
            for step in range(2, 13):
                for p in (pa, pb):
                    p.save({"w": torch.full((4096,), float(step))}, step).wait(30)
        # only the newest step of each run stays held: the one before it went by its owner's
        # drop, not by keep_last (the holder keeps at least two steps of a rank otherwise)
        _wait(lambda: _held_run(holder, "a") == _held_run(holder, "b") == {(12, 0): "memory"},
              "the deleted steps dropped at the holder")
        elapsed = time.monotonic() - t0
        # the holder counts a drop as it arrives, the sender once its answer is back: equal once
        # the last exchange is over
        _wait(lambda: _status(sender)["peer"]["drop_messages"] == _status(holder)["peer"]["drop_requests"],
              "the sender counted every drop the holder took")
        sent, held, other = _status(sender)["peer"], _status(holder)["peer"], _status(bystander)["peer"]
        assert other["drop_requests"] == 0 and other["held_shares"] == 0, other
        # 22 retention passes (11 per run): one message per heartbeat at most, both runs in each
        assert 1 <= held["drop_requests"] <= math.ceil(elapsed / 2) + 1, (held, elapsed)
        assert held["drop_requests"] < 11 and held["held_shares"] == 2, held
        assert sent["drop_messages"] == held["drop_requests"] and sent["dropped_steps"] >= 11, sent
        with urllib.request.urlopen(_status(sender)["metrics"], timeout=30) as page:
            assert f"ckptd_peer_drop_messages_total {float(sent['drop_messages'])}" in page.read().decode()
    finally:
        for n in nodes:
            n.cleanup()


def _held_run(node: Daemon, run: str) -> dict:
    tier = PeerTier(load_config(node.config))
    tier.discovery.endpoints = [tier.cfg.listen]
    return {k: c[0][1] for k, c in tier.discovery.holdings(run).items() if c[0][1] == "memory"}


def _resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (util-linux ``fincore``)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout.split()[0])


def _direct_io_works(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def test_a_share_is_replicated_from_its_producer_s_staging_not_read_back(tmp_path: Path) -> None:
    """A share whose producer keeps its staging free goes to the partner out of that
    staging: of the bytes replicated, at most 5 % are read from the files (the chunk
    files' headers), the replica is held bit-exact, and with [daemon] direct_io (the
    default) the files, written past the page cache, are still not in it."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sender = Daemon(tmp_path / "sender", tables={"peer": {"listen": listens[0], "peers": [listens[1]],
                                                          "frame": "1MiB", "window": 2}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    try:
        holder.start()
        sender.start()
        w = torch.randn(6 * 2**20 + 12345)  # ~24 MiB: 24 parts through 3 slots, and a short tail
        with sender.producer("job", staging_size="64MiB") as p:
            p.save({"w": w}, 1).wait(30)
        _wait(lambda: _held(holder).get((1, 0)) == "memory", "held")
        files = [f for f in (sender.root / "job" / "step-000000000001").iterdir() if f.suffix == ".safetensors"]
        size = sum(f.stat().st_size for f in files)
        assert size > w.nbytes, files
        if _direct_io_works(sender.root):
            assert sum(_resident(f) for f in files) < size // 8, [(f.name, _resident(f)) for f in files]
        tier = PeerTier(load_config(holder.config))
        tier.discovery.endpoints = [tier.cfg.listen]
        endpoint, where, m = tier.discovery.holdings("job")[(1, 0)][0]
        assert where == "memory"
        got = tier.transfer.read_files(endpoint, m)
        assert all(bytes(got[f.name]) == f.read_bytes() for f in files)  # the holder's copy, byte for byte
        peer = _status(sender)["peer"]
        assert peer["replicated_bytes"] == size, peer
        assert peer["file_bytes_read"] <= 0.05 * size and peer["staged_bytes"] >= 0.95 * size, peer
        assert peer["staged_bytes"] + peer["file_bytes_read"] >= size, peer
    finally:
        for n in (sender, holder):
            n.cleanup()


def test_staging_goes_back_when_the_producer_needs_it_and_the_share_is_sent_from_its_files(
        tmp_path: Path) -> None:
    """The partner is stopped, so step 1 waits, under-replicated, in the producer's staging;
    step 2 needs that room: the daemon gives it back at once (the emit does not wait out
    its 10 s emit_timeout), and once the partner is back step 1 goes to it from its files,
    read with O_DIRECT (they stay out of the page cache), held bit-exact."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sender = Daemon(tmp_path / "sender", tables={"peer": {
        "listen": listens[0], "peers": [listens[1]], "frame": "1MiB", "window": 2, "timeout": "0.5s",
        "heartbeat": "0.5s"}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    try:
        holder.start()
        sender.start()
        _wait(lambda: f"peer {listens[1]} answers" in sender.log_text(), "the partner connected")
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGSTOP)
        state = {"w": torch.randn(3 * 2**19 + 77), "b": torch.randn(1000), "c": torch.arange(300)}
        with sender.producer("job", staging_size="8MiB", emit_timeout="10s") as p:
            p.save(state, 1).wait(30)
            _wait(lambda: _status(sender)["peer"]["failures"] >= 1, "the stopped partner tried")
            try:
                with p.checkpoint(2):
                    p.emit("w", torch.randn(3 * 2**19))  # 6 MiB of the 8: only with step 1's room
                    raise KeyboardInterrupt  # aborted: step 1 stays the newest, to send
            except KeyboardInterrupt:
                pass
            os.kill(holder.pid, signal.SIGCONT)
            _wait(lambda: _held(holder).get((1, 0)) == "memory", "step 1 held", timeout=60)
        files = [f for f in (sender.root / "job" / "step-000000000001").iterdir() if f.suffix == ".safetensors"]
        size = sum(f.stat().st_size for f in files)
        peer = _status(sender)["peer"]
        assert peer["staged_bytes"] == 0 and peer["file_bytes_read"] >= size, peer
        if _direct_io_works(sender.root):
            assert sum(_resident(f) for f in files) < size // 8, [(f.name, _resident(f)) for f in files]
        tier = PeerTier(load_config(holder.config))
        tier.discovery.endpoints = [tier.cfg.listen]
        endpoint, _, m = tier.discovery.holdings("job")[(1, 0)][0]
        got = tier.transfer.read_files(endpoint, m)
        assert all(bytes(got[f.name]) == f.read_bytes() for f in files)
        held = {k: v for f in files for k, v in safetensors.torch.load(bytes(got[f.name])).items()}
        assert held.keys() == state.keys() and all(torch.equal(held[k], v) for k, v in state.items())
    finally:
        if holder.alive() and holder.pid is not None:
            os.kill(holder.pid, signal.SIGCONT)
        for n in (sender, holder):
            n.cleanup()


def test_a_drop_message_carries_at_most_the_bound_of_steps_over_all_its_runs() -> None:
    from ckptd.peer import messages
    from ckptd.peer.copier import _add_steps

    bound = messages.MAX_STEPS_DROPPED
    batches: list[dict[str, list[int]]] = [{}]
    _add_steps(batches, "a", list(range(bound - 2)))
    _add_steps(batches, "b", list(range(bound + 5)))
    assert [sum(map(len, b.values())) for b in batches] == [bound, bound, 3]
    assert batches[0]["a"] == list(range(bound - 2)) and batches[0]["b"] == [0, 1]
    assert sum((b.get("b", []) for b in batches), []) == list(range(bound + 5))  # each step once, in order


def test_a_superseded_transfer_is_cancelled_rather_than_read_from_its_files_but_never_twice_in_a_row(
        tmp_path: Path) -> None:
    """Saves back to back, each needing the staging of the one before (4 MiB shares in 6
    MiB), sent at 512 KiB/s: step 2, superseded by step 3 while under way and given back
    from staging, is cancelled (its room freed at the holder, which keeps step 1, the
    rank's newest copy); step 3, superseded by step 4 in the same way, runs to its end
    from its files, as the transfer after a cancelled one always does; steps 3 and 4 are
    held bit-exact."""
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sender = Daemon(tmp_path / "sender", tables={"peer": {"listen": listens[0], "peers": [listens[1]],
                                                          "frame": "128KiB", "window": 2, "rate": "512KiB"}})
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]],
                                                          "memory": "256MiB"}})
    states = {step: {"w": torch.randn(2**20 if step > 1 else 4096)} for step in range(1, 5)}

    def receiving() -> bool:
        return holder.status()["peer"]["receiving_bytes"] > 0

    try:
        holder.start()
        sender.start()
        with sender.producer("job", staging_size="6MiB", emit_timeout="60s") as p:
            p.save(states[1], 1).wait(60)
            _wait(lambda: _held(holder).get((1, 0)) == "memory", "step 1 held", timeout=120)
            p.save(states[2], 2).wait(60)
            _wait(receiving, "step 2 under way", timeout=120)
            p.save(states[3], 3).wait(60)  # takes step 2's staging back
            _wait(lambda: sender.status()["peer"]["cancelled_transfers"] == 1, "step 2 cancelled", timeout=120)
            held = _held(holder)
            assert held.get((1, 0)) == "memory" and (2, 0) not in held, held
            _wait(receiving, "step 3 under way", timeout=120)
            p.save(states[4], 4).wait(60)  # takes step 3's staging back: step 3 goes on from its files
            _wait(lambda: _held(holder).get((4, 0)) == "memory", "step 4 held", timeout=120)
        held = _held(holder)
        assert held.get((3, 0)) == "memory" and (2, 0) not in held, held
        peer, kept = sender.status()["peer"], holder.status()["peer"]
        assert peer["cancelled_transfers"] == 1 and peer["file_bytes_read"] > 0, peer
        assert kept["cancelled"] == 1 and kept["receiving_bytes"] == 0, kept
        tier = PeerTier(load_config(holder.config))
        tier.discovery.endpoints = [tier.cfg.listen]
        for step in (3, 4):
            endpoint, _, m = tier.discovery.holdings("job")[(step, 0)][0]
            got = tier.transfer.read_files(endpoint, m)
            folder = sender.root / "job" / f"step-{step:012d}"
            files = [f for f in folder.iterdir() if f.suffix == ".safetensors"]
            assert all(bytes(got[f.name]) == f.read_bytes() for f in files)
            copy = {k: v for f in files for k, v in safetensors.torch.load(bytes(got[f.name])).items()}
            assert torch.equal(copy["w"], states[step]["w"]), step
    finally:
        for n in (sender, holder):
            n.cleanup()
