"""The errors a user meets: each raised with a message that says what and how to fix."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
import torch
import zmq

import ckptd
from ckptd import CheckpointError, CheckpointNotFound, Producer
from ckptd.transport import wire


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for the module; each test writes the run ``own_run`` names."""
    return shared_daemon


@pytest.fixture
def own_run(request) -> str:
    """A run of this test's own on the shared daemon."""
    return "e-" + re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:100]


def test_daemon_not_running_times_out_naming_the_endpoint(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    p = Producer(endpoint, "t", staging_size="1MiB", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="no ckptd daemon answered at ipc://.*nobody.sock within"):
        p.emit("w", torch.ones(3), step=1)
    assert time.monotonic() - t0 < 3  # the connect at start and the emit's own: 0.5 s each, no linger after
    with pytest.raises(CheckpointError, match="nobody.sock"):
        p.commit(1)
    with pytest.raises(CheckpointError, match="nobody.sock"):
        p.latest()
    p.close()


def test_emit_without_a_step(daemon, own_run) -> None:
    with daemon.producer(own_run) as p:
        with pytest.raises(ValueError, match=r"emit\(\) needs a step"):
            p.emit("w", torch.ones(3))


def test_duplicate_name_in_one_step(daemon, own_run) -> None:
    with daemon.producer(own_run) as p:
        with p.checkpoint(1) as h:
            p.emit("w", torch.ones(3))
            with pytest.raises(ValueError, match="'w' was already emitted in step 1"):
                p.emit("w", torch.zeros(3))
        assert h.wait(30).ntensors == 1  # the step itself is fine
    assert torch.equal(ckptd.load(own_run, root=daemon.root)["w"], torch.ones(3))


@pytest.mark.parametrize("run", ["", "../x", "a/b", ".hidden", "-x", "x" * 129, "nul\0", "é", "a b"])
def test_invalid_run_id(run) -> None:
    with pytest.raises(ValueError, match="run id"):
        Producer("ipc:///tmp/x.sock", run)
    with pytest.raises(ValueError, match="run id"):
        ckptd.load(run, root="/tmp")


@pytest.mark.parametrize(
    "name, message",
    [("", "empty"), ("x" * 1025, "longer than 1024 bytes"), ("a\0b", "control character"),
     ("tab\there", "control character"), ("bell\x07", "control character"), (42, "must be a str")],
)
def test_bad_tensor_names(daemon, own_run, name, message) -> None:
    with daemon.producer(own_run) as p:
        with pytest.raises(ValueError, match=message):
            p.emit(name, torch.ones(1), step=1)


def test_unicode_and_dotted_names_are_fine(daemon, own_run) -> None:
    names = ["layers.0.weight", "päth/with/slashes", "名前", "x" * 1024, "../../etc/passwd"]
    with daemon.producer(own_run) as p:
        with p.checkpoint(1) as h:
            for i, n in enumerate(names):
                p.emit(n, torch.full((2,), i))
        h.wait(30)
    out = ckptd.load(own_run, root=daemon.root)
    assert sorted(out) == sorted(names)
    assert not (daemon.root.parent / "etc").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.eye(3).to_sparse(), "is sparse"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "is quantized"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
        (lambda: torch.empty(3, device="meta"), "meta device"),
        (lambda: np.array(["a", "b"]), "numpy dtype <U1"),
        (lambda: np.array([1, None], dtype=object), "numpy dtype object"),
        (lambda: np.arange(3, dtype=">i4"), "big-endian"),
        (lambda: [1, 2, 3], "is a list, not a torch.Tensor"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and nested tensors are deprecated/prototype
def test_unsupported_tensors_get_a_type_error_naming_them(daemon, own_run, make, message) -> None:
    with daemon.producer(own_run) as p:
        with pytest.raises(TypeError, match=message) as info:
            p.emit("the_tensor", make(), step=1)
        assert "the_tensor" in str(info.value)


def test_unstorable_value_in_state_names_its_path(daemon, own_run) -> None:
    with daemon.producer(own_run) as p:
        with pytest.raises(TypeError, match=r"state\['optim'\]\['param_groups'\]\[0\]\['fn'\] is a builtins.function"):
            p.save({"optim": {"param_groups": [{"fn": lambda: 0}]}}, 1)
        with pytest.raises(TypeError, match="dict keys must be str or int"):
            p.save({(1, 2): torch.ones(1)}, 1)
        with pytest.raises(ValueError, match="both named 'a.0'"):
            p.save({"a": {0: torch.ones(1), "0": torch.ones(1)}}, 1)
        with pytest.raises(TypeError, match="metadata"):
            p.save({"w": torch.ones(1)}, 1, metadata={"obj": object()})
        # nothing was sent for step 1, so it can still be saved
        p.save({"w": torch.ones(1)}, 1).wait(30)


def test_load_missing_run_or_step_says_what_exists(daemon, own_run) -> None:
    with pytest.raises(CheckpointNotFound, match="run 'nope' has no checkpoints under"):
        ckptd.load("nope", root=daemon.root)
    with daemon.producer(own_run) as p:
        for step in (10, 20):
            p.save({"w": torch.ones(1)}, step).wait(30)
    with pytest.raises(CheckpointNotFound, match="no complete checkpoint at step 15; complete steps: 10, 20"):
        ckptd.load(own_run, 15, root=daemon.root)
    with pytest.raises(LookupError):  # CheckpointNotFound is also a LookupError
        ckptd.load(own_run, 15, root=daemon.root)
    with pytest.raises(CheckpointNotFound, match="no tensor named 'nope'"):
        ckptd.load(own_run, root=daemon.root, names=["nope"])
    assert ckptd.latest("nope", root=daemon.root) is None
    assert ckptd.list_checkpoints("nope", root=daemon.root) == []


def test_committed_step_is_never_overwritten(daemon, own_run) -> None:
    with daemon.producer(own_run) as p:
        p.save({"w": torch.ones(2)}, 5).wait(30)
    with daemon.producer(own_run) as p:  # a new producer (a restarted job) tries step 5 again
        handle = p.save({"w": torch.zeros(2)}, 5)
        with pytest.raises(CheckpointError, match=f"step 5 of run '{own_run}' is already committed"):
            handle.wait(30)
        p.flush()  # raised by wait() already
        p.save({"w": torch.zeros(2)}, 5)  # nobody waits on this one: flush() tells
        with pytest.raises(CheckpointError, match=f"step 5 of run '{own_run}' is already committed"):
            p.flush()
        p.flush()  # once
    assert torch.equal(ckptd.load(own_run, 5, root=daemon.root)["w"], torch.ones(2))


def test_garbage_on_the_socket_gets_errors_and_the_daemon_keeps_serving(daemon, own_run) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(daemon.endpoint)
    bad = [
        [b"\xc1"],  # never valid msgpack
        [b"not msgpack at all"],
        [wire.encode("hello", v=999, run="t", rank=0, world_size=1, pid=1, host="h")],
        [wire.encode("hello", v=1, run="../etc", rank=0, world_size=1, pid=1, host="h")],
        [wire.encode("nonsense")],
        [wire.encode("hello", v=1, run="g", rank=5, world_size=2, pid=1, host="h")],
    ]
    for frames in bad:
        s.send_multipart(frames)
        reply, _ = wire.decode(s.recv_multipart())
        assert reply["op"] == "error" and reply["message"], frames
    # a good session, then malformed tensor messages: each gets an error, then a real checkpoint works
    s.send_multipart([wire.encode("hello", v=1, run="g", rank=0, world_size=1, pid=1, host="h")])
    assert wire.decode(s.recv_multipart())[0]["op"] == "welcome"
    lying = wire.encode("tensor", seq=1, step=1, name="w", dtype="float32", shape=[1000], nbytes=4000,
                        start=0, numpy=False)
    s.send_multipart([lying, b"\0" * 8000])  # more bytes than declared
    replies = [wire.decode(s.recv_multipart())[0] for _ in range(2)]
    assert any(r["op"] == "error" and "does not fit" in r["message"] for r in replies)
    s.close(0)
    with daemon.producer(own_run) as p:
        assert p.save({"w": torch.ones(4)}, 1).wait(30).step == 1
    assert daemon.proc.poll() is None


def test_unknown_producer_option(daemon, own_run) -> None:
    with pytest.raises(ValueError, match="unknown key 'stagin_size' in Producer options"):
        daemon.producer(own_run, stagin_size="1MiB")


def test_staging_full_with_on_full_raise(daemon, own_run) -> None:
    p = daemon.producer(own_run, staging_size="1MiB", on_full="raise", timeout=30)
    assert p.latest() is None  # connected
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # a daemon that drains nothing
    try:
        p.emit("a", torch.ones(2**18 - 16), step=1)  # nearly fills staging
        with pytest.raises(CheckpointError, match=r"staging memory is full.*raise \[producer\] staging_size"):
            p.emit("b", torch.ones(2**18), step=1)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert p.commit(1).wait(30).ntensors == 1
    p.close()


def test_a_piece_that_found_no_staging_may_be_emitted_again(daemon, own_run) -> None:
    """A failed emit leaves nothing of itself in its step: neither its name nor its piece's place."""
    p = daemon.producer(own_run, staging_size="1MiB", on_full="raise", timeout=30)
    w = torch.arange(64.0)
    assert p.latest() is None  # connected
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # a daemon that drains nothing
    try:
        p.emit("a", torch.ones(2**18 - 16), step=1)  # nearly fills staging
        with pytest.raises(CheckpointError, match="staging memory is full"):
            p.emit("w", w[:32], step=2, global_shape=[64], offset=[0])
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    p.commit(1).wait(30)  # staging is free again
    assert p.emit("w", w[:32], step=2, global_shape=[64], offset=[0]) == "w"
    assert p.emit("w", w[32:], step=2, global_shape=[64], offset=[32]) != "w"  # its second piece
    assert p.commit(2).wait(30).ntensors == 2
    p.close()
    assert torch.equal(ckptd.load(own_run, 2, root=daemon.root, verify=True)["w"], w)


def test_staging_full_with_on_full_block_waits_then_times_out(daemon, own_run) -> None:
    p = daemon.producer(own_run, staging_size="1MiB", emit_timeout=0.5, timeout=30)
    assert p.latest() is None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        p.emit("a", torch.ones(2**18 - 16), step=1)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"waited 0.5 s for staging memory.*emit_timeout"):
            p.emit("b", torch.ones(2**18), step=1)
        assert 0.4 < time.monotonic() - t0 < 5
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # space frees once the daemon drains; on a loaded machine that may take longer than
    # emit_timeout, and an emit that timed out may be made again
    deadline = time.monotonic() + 30
    while True:
        try:
            p.emit("b", torch.ones(2**18), step=1)
            break
        except CheckpointError as exc:
            assert "waited 0.5 s for staging memory" in str(exc) and time.monotonic() < deadline
    assert p.commit(1).wait(30).ntensors == 2
    p.close()
