"""The data path (docs/training.md): shared-memory staging (``transport = "shm"``), inline frames
over ipc:// and tcp://, backpressure, and O_DIRECT chunk files. Real daemons, real
sockets, real memfds, real files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptd
from ckptd import CheckpointError, Producer
from ckptd.transport import handoff, wire
from ckptd.daemon.datafile import BLOCK, Bounce, DataFile

from conftest import start_tcp

ARENA = "8MiB"


def state(seed: int) -> dict[str, torch.Tensor]:
    """Small tensors that batch into chunks, one larger than the arena, odd sizes and dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        **{f"w{i}": torch.randn(1000 * i + 7, generator=g) for i in range(1, 9)},
        "big": torch.randn(3 * 2**20, generator=g),  # 12 MiB: more than the 8 MiB arena
        "page": torch.randn(2**18, generator=g),  # exactly 1 MiB: page-aligned, O_DIRECT as it is
        "half": torch.randn(33, 17, generator=g).half(),
        "ints": torch.randint(-2**40, 2**40, (5000,), generator=g),
        "flags": torch.rand(999, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "strided": torch.randn(300, 200, generator=g).t(),
    }


def maps_of(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def round_trip(p: Producer, run: str, root: Path) -> None:
    originals = {}
    for step in range(3):
        s = state(step)
        originals[step] = {k: v.clone() for k, v in s.items()}
        with p.checkpoint(step):
            for name, t in s.items():
                p.emit(name, t)
                t.add_(1) if t.dtype != torch.bool else t.logical_not_()  # the snapshot was taken
    p.flush(60)
    for step, want in originals.items():
        got = ckptd.load(run, step, root=root, verify=True)
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k].contiguous()), (step, k)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_round_trip_over_ipc_is_bit_exact_and_a_snapshot(daemon, transport: str) -> None:
    with daemon.producer("r", transport=transport, staging_size=ARENA) as p:
        round_trip(p, "r", daemon.root)
        assert p.stats()["transport"] == transport
        mapped = "memfd:ckptd-staging" in maps_of(daemon.proc.pid)
        assert mapped == (transport == "shm")  # only the shm daemon maps the producer's arena
    assert f"transport={transport}" in daemon.log_text()


def test_round_trip_over_tcp_is_inline_and_bit_exact(make_daemon, keys) -> None:
    d, endpoint = start_tcp(make_daemon, keys)
    with Producer(endpoint, "tcp", staging_size=ARENA, timeout=10, curve_server_key=keys["server"],
                  curve_secret_key=keys["alice"]) as p:
        round_trip(p, "tcp", d.root)
        assert p.stats()["transport"] == "inline"  # auto: a tcp:// daemon may be on another host
    with Producer(endpoint, "tcp", transport="shm", staging_size=ARENA, curve_server_key=keys["server"],
                  curve_secret_key=keys["alice"]) as p:
        with pytest.raises(CheckpointError, match=r'transport = "shm".*not an ipc:// socket'):
            p.save({"x": torch.ones(1)}, 9)


def test_hdf5_over_shm_round_trips(daemon) -> None:
    with daemon.producer("h5", transport="shm", staging_size=ARENA, format="hdf5") as p:
        round_trip(p, "h5", daemon.root)
    assert (daemon.root / "h5" / "step-000000000002" / "r00000.h5").exists()


def test_snapshot_holds_while_the_writer_is_slow(make_daemon) -> None:
    """The daemon writes long after emit returned (2 MiB/s): mutations in between must
    not reach the checkpoint, through either transport."""
    d = make_daemon(write_rate="2MiB")
    for transport in ("shm", "inline"):
        with d.producer(transport, transport=transport, staging_size=ARENA) as p:
            t = torch.arange(2**20, dtype=torch.float32)  # 4 MiB
            handle = p.save({"t": t, "u": t[:1000]}, 1)
            want = t.clone()
            t.mul_(-1)  # in place, right after save returned
            handle.wait(60)
        got = ckptd.load(transport, 1, root=d.root, verify=True)
        assert torch.equal(got["t"], want) and torch.equal(got["u"], want[:1000])


def test_emit_blocks_on_a_full_arena_then_proceeds(make_daemon) -> None:
    d = make_daemon(write_rate="8MiB")
    data = {f"t{i}": torch.full((2**20,), float(i)) for i in range(6)}  # 24 MiB through an 8 MiB arena
    with d.producer("bp", transport="shm", staging_size=ARENA) as p:
        p.save(data, 1).wait(60)
        assert p.stats()["blocked_seconds"] > 0.2  # it waited for the writer, it did not fail
    got = ckptd.load("bp", 1, root=d.root, verify=True)
    assert all(torch.equal(got[k], v) for k, v in data.items())


def test_on_full_raise_names_the_setting(make_daemon) -> None:
    d = make_daemon(write_rate="1MiB")
    with d.producer("bp", transport="shm", staging_size=ARENA, on_full="raise") as p:
        with pytest.raises(CheckpointError, match=r"staging memory is full.*staging_size.*on_full"):
            with p.checkpoint(1):
                for i in range(8):
                    p.emit(f"t{i}", torch.zeros(2**20))  # 4 MiB each
        deadline = time.monotonic() + 30
        while True:  # the aborted step's bytes are dropped, not written: the arena empties soon
            try:
                p.save({"small": torch.ones(10)}, 2).wait(60)  # and the producer carries on
                break
            except CheckpointError as exc:
                assert "staging memory is full" in str(exc) and time.monotonic() < deadline
                time.sleep(0.2)
    assert ckptd.latest("bp", root=d.root).step == 2


def test_emit_timeout_names_the_setting(make_daemon) -> None:
    d = make_daemon(write_rate="256KiB")
    with d.producer("bp", transport="shm", staging_size=ARENA, emit_timeout=0.5) as p:
        with pytest.raises(CheckpointError, match=r"waited 0.5 s for staging memory.*emit_timeout"):
            p.save({f"t{i}": torch.zeros(2**20) for i in range(4)}, 1)


PRODUCER = textwrap.dedent("""
    import sys, torch
    from ckptd import Producer
    p = Producer(sys.argv[1], "victim", transport="shm", staging_size="8MiB", timeout=5)
    p.save({"a": torch.ones(1000)}, 1).wait(30)
    with p.checkpoint(2):
        p.emit("b", torch.ones(2**20))
        print("emitted", flush=True)
        sys.stdin.readline()  # killed here, mid-step
""")


def test_kill_9_of_a_producer_leaves_no_shared_memory(make_daemon) -> None:
    d = make_daemon()  # the producer's death is noticed through its pidfd (ckptd.daemon.liveness)
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, d.endpoint], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "emitted"
    assert "memfd:ckptd-staging" in maps_of(d.proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while "memfd:ckptd-staging" in maps_of(d.proc.pid):  # the session expires, the mapping goes
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    assert set(os.listdir("/dev/shm")) == before  # a memfd never had a name there
    assert [i.step for i in ckptd.list_checkpoints("victim", root=d.root)] == [1]  # step 2 never completes
    with d.producer("other", transport="shm", staging_size=ARENA) as p:  # the daemon serves on
        p.save({"x": torch.ones(3)}, 1).wait(30)


def test_kill_9_of_the_daemon_then_the_producer_reconnects(make_daemon) -> None:
    d = make_daemon()
    with d.producer("k", transport="shm", staging_size=ARENA, timeout=60, heartbeat=0.2) as p:
        p.save({"a": torch.ones(10)}, 1).wait(30)
        d.kill()
        with p.checkpoint(2) as h:
            p.emit("a", torch.ones(10))
        with pytest.raises(CheckpointError):
            h.wait(10)  # in flight when the daemon died: it fails, never hangs
        d.start()
        p.save({"a": torch.full((10,), 3.0)}, 3).wait(30)  # the next call reconnects, arena and all
        assert p.stats()["transport"] == "shm" and "memfd:ckptd-staging" in maps_of(d.proc.pid)
    assert [i.step for i in ckptd.list_checkpoints("k", root=d.root)] == [1, 3]


def test_transport_shm_without_a_handoff_socket_is_a_clear_error(daemon) -> None:
    os.unlink(daemon.sock_dir / "d.sock.shm")
    with pytest.raises(CheckpointError, match=r'transport = "shm".*d\.sock\.shm'):
        daemon.producer("s", transport="shm").save({"x": torch.ones(1)}, 1)
    with daemon.producer("s", staging_size=ARENA) as p:  # auto falls back to inline
        p.save({"x": torch.ones(1)}, 1).wait(30)
        assert p.stats()["transport"] == "inline"


def offer_raw(path: str, token: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(path)
        socket.send_fds(s, [token], fds) if fds else s.send(token)
        return s.recv(512)


def test_the_handoff_socket_refuses_what_it_cannot_trust(daemon) -> None:
    path = str(daemon.sock_dir / "d.sock.shm")
    unsealed = os.memfd_create("x")
    os.ftruncate(unsealed, 4096)
    assert b"F_SEAL_SHRINK" in offer_raw(path, os.urandom(16), [unsealed])  # could shrink under the daemon
    assert b"descriptor" in offer_raw(path, os.urandom(16), [])
    assert b"16-byte token" in offer_raw(path, b"short", [unsealed])
    with open(daemon.base / "config.toml", "rb") as f:  # a plain file cannot be sealed
        assert b"F_SEAL_SHRINK" in offer_raw(path, os.urandom(16), [f.fileno()])
    os.close(unsealed)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:  # connects, says nothing
        s.connect(path)
        with daemon.producer("fine", staging_size=ARENA) as p:  # nobody waits for it
            p.save({"x": torch.ones(1)}, 1).wait(30)
            assert p.stats()["transport"] == "shm"
    assert "refused a handoff" in daemon.log_text()


def test_a_tensor_outside_the_arena_fails_its_step_only(daemon) -> None:
    import zmq

    from ckptd.producer.staging import Arena

    def reply() -> dict:
        while True:  # acknowledgements come in between
            header, _ = wire.decode(sock.recv_multipart())
            if header["op"] != "ack":
                return header

    arena = Arena(4096)
    token = handoff.offer(str(daemon.sock_dir / "d.sock"), arena.fd, 5)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(daemon.endpoint)
    sock.send(wire.encode("hello", v=wire.VERSION, run="evil", rank=0, world_size=1, pid=1, host="h",
                          shm_token=token, shm_size=4096))
    welcome = reply()
    assert welcome["op"] == "welcome" and welcome["shm"] is True
    sock.send(wire.encode("tensor", seq=1, step=1, name="t", dtype="uint8", shape=[64], nbytes=64, start=0,
                          numpy=False, offset=4090, length=64))
    error = reply()
    assert error["op"] == "error" and "outside the 4096 bytes" in error["message"]
    sock.send(wire.encode("hello", v=wire.VERSION, run="evil", rank=1, world_size=2, pid=1, host="h",
                          shm_token=os.urandom(16), shm_size=4096))  # a token nobody handed over
    welcome = reply()
    assert welcome["op"] == "welcome" and welcome["shm"] is False
    sock.close(0)
    arena.close()
    with daemon.producer("good", staging_size=ARENA) as p:
        p.save({"x": torch.ones(5)}, 1).wait(30)


@pytest.mark.parametrize("direct", [True, False])
def test_data_files_hold_exactly_the_bytes_written(tmp_path: Path, direct: bool) -> None:
    """Aligned and unaligned buffers, tails, an empty one: what O_DIRECT (or its fallback)
    wrote is byte for byte what was given, and the file has exactly that length."""
    rng = np.random.default_rng(0)
    import mmap

    aligned = memoryview(mmap.mmap(-1, 4 * 2**20))  # page-aligned, as a large shared region
    aligned[:] = rng.integers(0, 256, len(aligned), dtype=np.uint8).tobytes()
    pieces = [b"h" * BLOCK, aligned[:2**20], aligned[2**20 + 1:2**21], b"", aligned[:BLOCK * 3],
              rng.integers(0, 256, 10_000_001, dtype=np.uint8).tobytes(), aligned[:2**20], b"tail"]
    out = DataFile.create(tmp_path / "f", direct=direct, bounce=Bounce(2**20))
    for piece in pieces:
        out.write([piece])
    os.close(out.finish())
    want = b"".join(bytes(p) for p in pieces)
    assert (tmp_path / "f").read_bytes() == want


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("most", [None, 2 * BLOCK])
def test_a_data_file_written_in_one_call_holds_its_bytes_in_order(tmp_path: Path, monkeypatch, direct: bool,
                                                                  most: int | None) -> None:
    """A chunk file's header and tensors are handed over in one call and gathered into
    as few writev calls as the kernel takes (datafile.DataFile.write): aligned buffers
    queued behind the bounce buffer's bytes, unaligned ones that refill it meanwhile, a
    call cut at ``_DIRECT_MAX`` (``most``) all land in order, and the next call's too."""
    from ckptd.daemon import datafile

    if most is not None:
        monkeypatch.setattr(datafile, "_DIRECT_MAX", most)
    rng = np.random.default_rng(1)
    import mmap

    aligned = memoryview(mmap.mmap(-1, 4 * 2**20))
    aligned[:] = rng.integers(0, 256, len(aligned), dtype=np.uint8).tobytes()
    first = [b"h" * BLOCK, aligned[:2**20], aligned[BLOCK:2 * BLOCK], b"odd", aligned[2**20:2**21],
             rng.integers(0, 256, 3 * 2**20 + 5, dtype=np.uint8).tobytes(), aligned[:BLOCK * 5], b"",
             aligned[2**21:2**21 + 7]]
    then = [aligned[3 * 2**20:], b"tail"]
    out = DataFile.create(tmp_path / "f", direct=direct, bounce=Bounce(2**20))
    out.write(first)
    out.write(then)
    os.close(out.finish())
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in first + then)


def test_o_direct_refused_midway_carries_on_buffered(tmp_path: Path, monkeypatch) -> None:
    from ckptd.daemon import datafile

    monkeypatch.setattr(datafile, "_no_direct", set())  # the refusal is remembered for this test only
    out = DataFile.create(tmp_path / "f", direct=True, bounce=Bounce(2**20))
    if not out.direct:
        pytest.fail("this filesystem refuses O_DIRECT at open; the test needs one that allows it")
    out.write([b"x" * BLOCK])
    out._drain()
    out._write_all(memoryview(b"y" * 100))  # misaligned: the kernel answers EINVAL, as a refusing fs does
    assert not out.direct
    out.write([b"z" * 5])
    os.close(out.finish())
    assert (tmp_path / "f").read_bytes() == b"x" * BLOCK + b"y" * 100 + b"z" * 5


def test_chunk_files_written_with_o_direct_are_valid_safetensors(daemon) -> None:
    with daemon.producer("st", transport="shm", staging_size=ARENA) as p:
        p.save(state(0), 1).wait(30)
    step = daemon.root / "st" / "step-000000000001"
    files = sorted(step.glob("*.safetensors"))
    assert len(files) >= 2
    seen = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                seen[k] = st.get_tensor(k)
    want = state(0)
    assert torch.equal(seen["big"], want["big"]) and torch.equal(seen["page"], want["page"])


def test_a_reconnect_with_the_same_arena_never_completes_a_step_from_reused_memory(make_daemon) -> None:
    """A producer that lost contact reconnects with the same arena and reuses it. A commit
    of its old session still being written from that arena must fail, not complete with
    bytes overwritten under it (the checksum would even match them)."""
    import zmq

    from ckptd.producer.staging import Arena

    d = make_daemon(write_rate="1MiB")  # the 4 MiB step takes ~4 s to write
    arena = Arena(8 * 2**20)
    size = 4 * 2**20
    arena.view(arena.alloc(size, timeout=1, block=False, what="t"))[:] = b"A" * size
    ipc = str(d.sock_dir / "d.sock")
    ctx = zmq.Context.instance()

    def hello(sock: zmq.Socket) -> dict:
        sock.connect(d.endpoint)
        sock.send(wire.encode("hello", v=wire.VERSION, run="re", rank=0, world_size=1, pid=os.getpid(), host="h",
                              shm_token=handoff.offer(ipc, arena.fd, 5), shm_size=arena.capacity))
        return wire.decode(sock.recv_multipart())[0]

    old, new = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    assert hello(old)["shm"] is True
    old.send(wire.encode("tensor", seq=1, step=1, name="t", dtype="uint8", shape=[size], nbytes=size, start=0,
                         numpy=False, offset=0, length=size))
    old.send(wire.encode("commit", seq=2, step=1, ntensors=1, state="null", metadata="{}"))
    time.sleep(0.3)  # the writer is under way
    assert hello(new)["shm"] is True  # the same arena, under a new session: about to be reused
    arena._mm[:size] = b"B" * size
    deadline = time.monotonic() + 30
    while True:
        assert old.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "the old commit was never answered"
        reply = wire.decode(old.recv_multipart())[0]
        if reply["op"] in ("committed", "error"):
            break
    assert reply["op"] == "error" and "reconnected" in reply["message"], reply
    assert ckptd.list_checkpoints("re", root=d.root) == []
    old.close(0)
    new.close(0)
    arena.close()


def test_a_file_opened_after_a_refusal_midway_is_written_buffered(tmp_path: Path, monkeypatch) -> None:
    """Once a filesystem refused O_DIRECT midway, later files there are written buffered,
    unaligned bytes included (they were opened with O_DIRECT and failed with EINVAL)."""
    from ckptd.daemon import datafile

    monkeypatch.setattr(datafile, "_no_direct", set())  # this process's memory of refusals
    first = DataFile.create(tmp_path / "f", direct=True, bounce=Bounce(2**20))
    if not first.direct:
        pytest.fail("this filesystem refuses O_DIRECT at open; the test needs one that allows it")
    first._write_all(memoryview(b"y" * 100))  # misaligned: the kernel answers EINVAL
    assert not first.direct
    os.close(first.finish())
    later = DataFile.create(tmp_path / "g", direct=True, bounce=Bounce(2**20))
    later.write([b"h" * 10, b"i" * (BLOCK + 3)])
    os.close(later.finish())
    assert (tmp_path / "g").read_bytes() == b"h" * 10 + b"i" * (BLOCK + 3)
