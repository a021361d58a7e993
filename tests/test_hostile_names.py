"""Hostile run ids and tensor names, through the real daemon and the read APIs
(docs/format.md: run ids become folder names, tensor names never become paths; docs/reliability.md:
nothing is written outside the root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import zmq

import ckptd
from ckptd import CheckpointError, Producer, cli, layout, reader
from ckptd.transport import wire

BAD_RUNS = [
    "", ".", "..", "../x", "x/..", "a/b", "/abs", "a\\b", "nul\0x", "x" * 129, "x" * 100_000,
    ".hidden", "-rf", "_x", "x\n", " x", "a b", "é",
    "a\uff0fb",  # fullwidth solidus: looks like "/"
    "\u0430dmin",  # Cyrillic "а"
    "\u2024\u2024",  # one-dot leaders: look like ".."
    "x\u200b",  # zero-width space
    "\udc80",  # a lone surrogate (not text at all)
]


def snapshot(base: Path, root: Path) -> set[str]:
    """Every path under ``base`` outside ``root`` (``root`` itself included), with its kind."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        if here == root or root in here.parents:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
            out.add(f"{kind} {p.relative_to(base)}")
    return out


@pytest.mark.parametrize("run", BAD_RUNS, ids=[ascii(r)[:24] for r in BAD_RUNS])
def test_a_bad_run_id_is_a_value_error_naming_it(run: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match="invalid run id") as err:
        Producer("ipc:///tmp/ckptd-nobody.sock", run)
    assert repr(run)[:30] in str(err.value)  # named, escapes and all (cut short when long)
    for call in (ckptd.latest, ckptd.list_checkpoints, ckptd.load, reader.verify):
        with pytest.raises(ValueError, match="invalid run id"):
            call(run, root=tmp_path)
    for command in ("latest", "list", "show", "verify", "prune"):
        capsys.readouterr()
        assert cli.main([command, "--root", str(tmp_path), "--", run]) == 1
        err_text = capsys.readouterr().err
        assert len(err_text.strip().splitlines()) == 1 and "invalid run id" in err_text, err_text
    assert os.listdir(tmp_path) == []


def test_the_daemon_refuses_bad_run_ids_and_creates_nothing(daemon, tmp_path: Path) -> None:
    with daemon.producer("good") as p:
        p.save({"w": torch.ones(3)}, 1).wait(30)
    before = snapshot(tmp_path, daemon.root)
    root_before = sorted(os.listdir(daemon.root))
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    try:
        for run in [r for r in BAD_RUNS if "\udc80" not in r]:  # msgpack cannot carry a lone surrogate
            for retention in (None, {"keep_last": 1}):
                s.send_multipart([wire.encode("hello", v=wire.VERSION, run=run, rank=0, world_size=1, pid=1,
                                              host="h", retention=retention, format=None, shm_token=None,
                                              shm_size=None)])
                reply, _ = wire.decode(s.recv_multipart())
                assert reply["op"] == "error" and "invalid run id" in reply["message"], (run, reply)
                assert len(reply["message"]) < 400  # a 100,000-character id is not echoed whole
            s.send_multipart([wire.encode("latest", seq=1, run=run)])
            reply, _ = wire.decode(s.recv_multipart())
            assert reply["op"] == "error" and "invalid run id" in reply["message"], (run, reply)
        # a run id that is not UTF-8 at all: bytes where msgpack says "str"
        raw = wire.encode("latest", seq=2, run="XXXX").replace(b"XXXX", b"\xff\xfe/.")
        s.send_multipart([raw])
        reply, _ = wire.decode(s.recv_multipart())
        assert reply["op"] == "error" and "not valid msgpack" in reply["message"], reply
    finally:
        s.close()
    with daemon.producer("good") as p:  # it serves on
        assert p.save({"w": torch.ones(3)}, 2).wait(30).step == 2
    assert sorted(os.listdir(daemon.root)) == root_before
    assert snapshot(tmp_path, daemon.root) == before
    assert daemon.proc.poll() is None


NASTY_NAMES = [
    "../../escape", "/abs/olute", "a/b/../../c", "..", ".", "./x", "~", "$HOME", "`id`", "*", "a\\..\\b",
    "C:\\x", "%", "%2F", "a%2Fb", "a/b", "%25", "%2E", "%2e", "名前/データ", "a\u2215b", "a\uff0fb",
    "\u202eevil", "\u0430", "x" * 1024, "é" * 512, "manifest-r00000.json", "r00000-000000.safetensors",
    "r00000.h5", "r00000.writing", "latest", "pinned", "retention.json", " ", "-", "--rf", "\u2400",
]
BAD_NAMES = [
    ("a\0b", "control character"), ("a\nb", "control character"), ("\r", "control character"),
    ("a\x7fb", "control character"), ("\x85", "control character"), ("x" * 1025, "longer than 1024 bytes"),
    ("é" * 513, "longer than 1024 bytes"), ("\udc80", "not valid unicode"), ("a\ud800b", "not valid unicode"),
    ("", "empty"), ("__metadata__", "reserved"), (b"bytes", "must be a str"), (7, "must be a str"),
]


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_any_tensor_name_round_trips_and_never_becomes_a_path(make_daemon, tmp_path: Path, fmt: str) -> None:
    d = make_daemon()
    before = snapshot(tmp_path, d.root)
    values = {name: torch.full((3,), float(i)) for i, name in enumerate(NASTY_NAMES)}
    with d.producer("n", format=fmt) as p:
        with p.checkpoint(1) as h:
            for name, t in values.items():
                p.emit(name, t)
        assert h.wait(30).ntensors == len(NASTY_NAMES)
        for name, message in BAD_NAMES:  # refused at emit and at save, before anything is sent
            with pytest.raises(ValueError, match=message):
                p.emit(name, torch.ones(1), step=2)  # type: ignore[arg-type]
            if isinstance(name, str):
                with pytest.raises(ValueError, match=message):
                    p.save({name: torch.ones(1)}, 3)
        # names made of state keys with slashes and dots are fine too
        p.save({"..": {"/etc": torch.ones(2)}, "a/b": [torch.zeros(1)]}, 4).wait(30)

    loaded = ckptd.load("n", 1, root=d.root, verify=True)
    assert loaded.keys() == values.keys()
    assert all(torch.equal(loaded[k], v) for k, v in values.items())
    assert torch.equal(ckptd.load("n", 1, root=d.root, names=["../../escape"])["../../escape"], values["../../escape"])
    state = ckptd.load("n", 4, root=d.root, verify=True)
    assert torch.equal(state[".."]["/etc"], torch.ones(2)) and torch.equal(state["a/b"][0], torch.zeros(1))
    assert not reader.verify("n", 1, root=d.root)[1]
    # inside the root: only the run's own folders (and ckptd's dotfiles, such as a run's
    # owner record), and in them only ckptd's own files
    run_entries = sorted(n for n in os.listdir(d.root / "n") if not n.startswith("."))
    assert run_entries == ["latest", layout.step_dir_name(1), layout.step_dir_name(4)]
    for step in (1, 4):
        files = os.listdir(d.root / "n" / layout.step_dir_name(step))
        assert all(layout.is_ckptd_file(f) and "/" not in f for f in files), files
        assert all(os.path.isfile(d.root / "n" / layout.step_dir_name(step) / f) for f in files)
    assert snapshot(tmp_path, d.root) == before  # nothing outside the root
    d.stop()


def test_bad_names_on_the_wire_fail_the_step_and_the_daemon_serves_on(daemon, tmp_path: Path) -> None:
    """A producer that skips its own checks: the daemon checks every name again."""
    before = snapshot(tmp_path, daemon.root)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    try:
        s.send_multipart([wire.encode("hello", v=wire.VERSION, run="w", rank=0, world_size=1, pid=1, host="h",
                                      retention=None, format=None, shm_token=None, shm_size=None)])
        assert wire.decode(s.recv_multipart())[0]["op"] == "welcome"
        for step, (name, message) in enumerate(BAD_NAMES, start=1):
            if not isinstance(name, str) or "\udc80" in name or "\ud800" in name:
                continue  # msgpack cannot carry them as str; the raw case below covers it
            s.send_multipart([wire.encode("tensor", seq=step, step=step, name=name, dtype="float32", shape=[1],
                                          nbytes=4, start=0, numpy=False, offset=None, length=None), b"\0" * 4])
            reply = wire.decode(s.recv_multipart())[0]
            while reply["op"] == "ack":
                reply = wire.decode(s.recv_multipart())[0]
            assert reply["op"] == "error" and message in reply["message"], (name, reply)
        raw = wire.encode("tensor", seq=99, step=99, name="XXXX", dtype="float32", shape=[1], nbytes=4, start=0,
                          numpy=False, offset=None, length=None).replace(b"XXXX", b"\xed\xb2\x80/")
        s.send_multipart([raw, b"\0" * 4])
        reply = wire.decode(s.recv_multipart())[0]
        while reply["op"] == "ack":  # an ack of the last step may follow its error
            reply = wire.decode(s.recv_multipart())[0]
        assert reply["op"] == "error" and "not valid msgpack" in reply["message"], reply
    finally:
        s.close()
    with daemon.producer("w") as p:
        assert p.save({"w": torch.ones(3)}, 1).wait(30).step == 1
    assert snapshot(tmp_path, daemon.root) == before
    assert [i.step for i in ckptd.list_checkpoints("w", root=daemon.root)] == [1]
    assert daemon.proc.poll() is None


def test_a_run_folder_that_is_a_file_or_symlink_fails_the_step_not_the_daemon(daemon, tmp_path: Path) -> None:
    (daemon.root / "f").write_text("a file where a run folder goes\n")
    os.symlink(tmp_path / "nowhere", daemon.root / "dangling")
    before = snapshot(tmp_path, daemon.root)
    for run in ("f", "dangling"):
        with pytest.raises(CheckpointError):
            with daemon.producer(run, retention={"keep_last": 2}) as p:
                p.save({"w": torch.ones(3)}, 1).wait(30)
        with daemon.producer(run) as p:
            with pytest.raises(CheckpointError, match="not a real directory"):
                p.save({"w": torch.ones(3)}, 1).wait(30)
    assert snapshot(tmp_path, daemon.root) == before  # "nowhere" was not created
    assert (daemon.root / "f").read_text() == "a file where a run folder goes\n"
    with daemon.producer("ok") as p:
        assert p.save({"w": torch.ones(3)}, 1).wait(30).step == 1
    assert daemon.proc.poll() is None
