"""Checkpoint files crafted to attack the reader, torn files, and symlinks planted in
the root (docs/format.md, docs/reliability.md). Every checkpoint here was written by a real
daemon; the tests then damage copies of it, as a person or a crash could."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch
import xxhash
from conftest import Daemon

import ckptd
from ckptd import CheckpointCorrupt, CheckpointError, cli, layout, reader
from ckptd.reader.export import export

STEP1, STEP2 = layout.step_dir_name(1), layout.step_dir_name(2)
M0 = layout.manifest_name(0)
CHUNK0 = layout.chunk_name(0, 0)
H5 = layout.h5_name(0)


def chunk_state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(1000.0) + step, "b": torch.full((10,), float(step))}, "epoch": step}


def h5_state(step: int) -> dict[str, Any]:
    return {"s": torch.tensor(1.5 + step), "v": torch.arange(1000.0) * step}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root written once by a real daemon: run "c" (chunk files) and run "h" (HDF5,
    with a compressed, chunked dataset), steps 1 and 2 each."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("CKPTD_CONFIG", "CKPTD_ENDPOINT", "CKPTD_RUN", "CKPTD_ROOT", "RANK", "WORLD_SIZE"):
            mp.delenv(var, raising=False)
        d = Daemon(tmp_path_factory.mktemp("pristine"), {"hdf5": {"compression": "gzip", "chunk_shape": "auto"}})
        try:
            d.start()
            with d.producer("c") as p:
                for step in (1, 2):
                    p.save(chunk_state(step), step).wait(30)
            with d.producer("h", format="hdf5") as p:
                for step in (1, 2):
                    p.save(h5_state(step), step).wait(30)
            assert d.stop() == 0
        finally:
            d.cleanup()
    return d.root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine root, to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt", symlinks=True))


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """The real command line, in this process (a subprocess per case would be slow)."""
    capsys.readouterr()
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def edit_manifest(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    m = json.loads(path.read_bytes())
    change(m)
    path.write_text(json.dumps(m))


def tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under ``path``: file contents, symlink targets, folders."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


# -- manifests that lie ----------------------------------------------------------------------
def _tensor(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        m["tensors"][name].update(fields)
    return change


def _overlap(m: dict[str, Any]) -> None:
    m["tensors"]["model.b"]["offset"] = m["tensors"]["model.w"]["offset"] + 8


def _rename_tensor(m: dict[str, Any]) -> None:
    m["tensors"]["bad\nname"] = m["tensors"].pop("model.b")


# (id, change to the manifest of run "c" step 2 (a function, or the new raw bytes), what the error says)
MANIFEST_LIES: list[tuple[str, Any, str]] = [
    ("negative shape", _tensor("model.w", shape=[-1, 1000]), r"shape \[-1, 1000\] holds -1, not a size"),
    ("shape beyond int64", _tensor("model.w", shape=[2**64], nbytes=2**66), r"holds 18446744073709551616, not a size"),
    ("nbytes beyond int64", _tensor("model.w", shape=[2**62, 4], nbytes=2**66), r"'nbytes' is 7378.*out of range"),
    ("float in shape", _tensor("model.w", shape=[1000.0]), r"holds 1000.0, not a size"),
    ("nbytes disagrees with shape", _tensor("model.w", nbytes=4004), r"nbytes 4004 disagrees with shape \[1000\]"),
    ("overlapping offsets", _overlap, r"tensors 'model.\w' and 'model.\w' overlap in r00000-000000.safetensors"),
    ("unknown dtype", _tensor("model.w", dtype="float99"), r"dtype 'float99' is not one ckptd knows"),
    ("file with ..", _tensor("model.w", file=f"../{STEP1}/{CHUNK0}"), r"file '\.\./step-.*' is not a ckptd data file"),
    ("absolute file", _tensor("model.w", file="/etc/passwd"), r"file '/etc/passwd' is not a ckptd data file"),
    ("another rank's file", _tensor("model.w", file=layout.chunk_name(3, 0)), r"belongs to another rank"),
    ("negative offset", _tensor("model.w", offset=-8), r"offset -8 is not a byte offset"),
    ("no offset in a chunk file", _tensor("model.w", offset=None), r"has no offset in its chunk file"),
    ("other checksum", _tensor("model.w", checksum="md5:00"), r"checksum 'md5:00' is not xxh3_64"),
    ("control character in a name", _rename_tensor, r"tensor name is invalid: .*control character"),
    ("run of another", lambda m: m.update(run="other"), r"manifests are those of run 'other' step 2"),
    ("format version", lambda m: m.update(format_version=99), r"format_version 99 is not supported"),
    ("not JSON", b'{"format_version": 1, "run": ', r"manifest is not valid JSON"),
    ("deeply nested JSON", b"[" * 200_000 + b"]" * 200_000, r"manifest is not valid JSON \(RecursionError"),
    ("NaN", None, r"NaN is not JSON"),  # filled in below: the real manifest with "time": NaN
    ("not an object", b"[1, 2, 3]", r"manifest must be a JSON object, not list"),
    ("invalid UTF-8", b'{"run": "\xff\xfe"}', r"manifest is not valid JSON"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in MANIFEST_LIES], ids=[c[0] for c in MANIFEST_LIES])
def test_a_lying_manifest_is_a_clear_error_everywhere(root: Path, tmp_path: Path, capsys, change, message) -> None:
    path = root / "c" / STEP2 / M0
    if change is None:
        path.write_text(path.read_text().replace('"time": ', '"time": NaN, "t0": ', 1))
    elif isinstance(change, bytes):
        path.write_bytes(change)
    else:
        edit_manifest(path, change)

    # not a complete checkpoint: listing and resuming pass it over for step 1
    assert [i.step for i in ckptd.list_checkpoints("c", root=root)] == [1]
    assert ckptd.latest("c", root=root).step == 1
    assert ckptd.latest("c", root=root, verify=True).step == 1
    assert torch.equal(ckptd.load("c", root=root)["model"]["w"], chunk_state(1)["model"]["w"])
    # asking for it by name: CheckpointCorrupt naming the manifest and what is wrong
    with pytest.raises(CheckpointCorrupt, match=message) as err:
        ckptd.load("c", 2, root=root)
    assert str(root / "c" / STEP2) in str(err.value)
    with pytest.raises(CheckpointCorrupt, match=message):
        export("c", 2, tmp_path / "out.safetensors", root=root)
    assert not (tmp_path / "out.safetensors").exists()
    for command in ("show", "verify", "export"):
        extra = ["-o", str(tmp_path / "out.h5")] if command == "export" else []
        rc, out, err_text = run_cli(capsys, command, "c", "2", "--root", str(root), *extra)
        assert rc == 1 and out == "", (command, out)
        assert len(err_text.strip().splitlines()) == 1, err_text
        assert f"ckptd {command}: error: " in err_text and str(root / "c" / STEP2) in err_text, err_text


def test_a_huge_manifest_is_refused_without_reading_it(root: Path) -> None:
    path = root / "c" / STEP2 / M0
    with open(path, "r+b") as f:
        f.truncate(3 << 30)  # sparse: claims 3 GiB, costs nothing
    assert [i.step for i in ckptd.list_checkpoints("c", root=root)] == [1]
    with pytest.raises(CheckpointCorrupt, match=r"manifest-r00000.json is 3221225472 bytes, more than"):
        ckptd.load("c", 2, root=root)


def test_a_manifest_that_is_a_fifo_or_a_device_does_not_hang_the_reader(root: Path) -> None:
    """A FIFO in a manifest's place blocked a plain open() forever; a symlink to
    /dev/zero read without end."""
    for run in ("c", "h"):
        os.unlink(root / run / STEP2 / M0)
    os.mkfifo(root / "c" / STEP2 / M0)
    os.symlink("/dev/zero", root / "h" / STEP2 / M0)
    for run, what in (("c", "is a FIFO"), ("h", "is a symlink")):
        for args in (["list", run], ["verify", run, "2"]):
            r = subprocess.run([sys.executable, "-m", "ckptd", *args, "--root", str(root), "--json"],
                               capture_output=True, text=True, timeout=60)
            if args[0] == "list":
                assert r.returncode == 0 and [i["step"] for i in json.loads(r.stdout)] == [1], r.stderr
                assert what in r.stderr  # the warning says why step 2 is left out
            else:
                assert r.returncode == 1 and what in r.stderr and M0 in r.stderr, r.stderr


# -- data that does not match its manifest ---------------------------------------------------------
def _header_dtype_lies(step: Path) -> None:
    data = bytearray((step / CHUNK0).read_bytes())
    head_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + head_len])
    header["model.w"]["dtype"] = "I32"  # same width: a reader without ckptd gets integers
    text = json.dumps(header, separators=(",", ":")).encode()
    data[8:8 + head_len] = text.ljust(head_len)
    (step / CHUNK0).write_bytes(bytes(data))


def _header_length_lies(step: Path) -> None:
    with open(step / CHUNK0, "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))


def _chunk_symlink(step: Path) -> None:
    # the outside copy holds exactly the right bytes: only the symlink is wrong
    outside = step.parent.parent.parent / "outside-chunk"
    shutil.copyfile(step / CHUNK0, outside)
    os.unlink(step / CHUNK0)
    os.symlink(outside, step / CHUNK0)


def _past_the_end(step: Path) -> None:
    edit_manifest(step / M0, _tensor("model.w", offset=(step / CHUNK0).stat().st_size + 100))


def _grow_w(shape: list[int], nbytes: int) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        b = m["tensors"]["model.b"]  # model.w moves past it (the file's end): they must not overlap
        m["tensors"]["model.w"].update(shape=shape, nbytes=nbytes, offset=b["offset"] + b["nbytes"])
    return change


def _enormous(step: Path) -> None:
    edit_manifest(step / M0, _grow_w([2**40, 2**20], 2**62))


def _state_lies(step: Path) -> None:
    edit_manifest(step / M0, lambda m: m.update(state={"dict": [["model", {"tensor": "nope"}]], "ordered": False}))


# (id, damage to run "c" step 2, listed steps after it, what the error says, whether load without verify sees it)
DATA_LIES: list[tuple[str, Callable[[Path], None], list[int], str, bool]] = [
    ("offset past the end of the file", _past_the_end, [1], r"'model.w': is truncated: the manifest puts it at bytes", True),
    ("enormous shape", _enormous, [1], r"'model.w': is truncated: .* but the file has \d+ bytes", True),
    ("chunk file is a symlink", _chunk_symlink, [1], r"'model.[wb]': cannot open a file .*is a symlink", True),
    ("safetensors header dtype lies", _header_dtype_lies, [1, 2], r"'model.w': the file's safetensors header says", False),
    ("safetensors header length lies", _header_length_lies, [1, 2], r"header claims 1099511627776 bytes", False),
    ("saved structure lies", _state_lies, [1, 2], r"saved structure \(\"state\"\) is malformed: .*'nope'", True),
]


@pytest.mark.parametrize("damage, listed, message, plain_load_fails", [c[1:] for c in DATA_LIES],
                         ids=[c[0] for c in DATA_LIES])
def test_data_that_disagrees_with_its_manifest(root: Path, tmp_path: Path, capsys, damage, listed, message,
                                               plain_load_fails) -> None:
    step = root / "c" / STEP2
    damage(step)
    assert [i.step for i in ckptd.list_checkpoints("c", root=root)] == listed
    with pytest.raises(CheckpointCorrupt, match=message):
        ckptd.load("c", 2, root=root, verify=True)
    if plain_load_fails:
        with pytest.raises(CheckpointCorrupt, match=message):
            ckptd.load("c", 2, root=root)
    else:  # the manifest governs what ckptd reads; only verification looks at the file's own header
        assert torch.equal(ckptd.load("c", 2, root=root)["model"]["w"], chunk_state(2)["model"]["w"])
    with pytest.raises(CheckpointCorrupt, match=message):
        export("c", 2, tmp_path / "out.pt", root=root)
    rc, _, err = run_cli(capsys, "verify", "c", "2", "--root", str(root))
    assert rc == 1 and "damaged: rank 0: " in err and str(step) in err, err
    assert ckptd.latest("c", root=root, verify=True).step == 1


HUGE_SCRIPT = textwrap.dedent("""
    import resource, sys
    import h5py, torch, ckptd
    from ckptd import CheckpointCorrupt

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    # Address space for what is loaded now plus 1 GiB: allocating any declared size
    # (8 GiB and more below) fails, so only a check made before allocating can pass.
    limit = vm_bytes() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for arg in sys.argv[2:]:
        run, name = arg.split(":")
        try:
            ckptd.load(run, 2, root=sys.argv[1], names=[name], verify=True)
            print(run, "loaded")
        except CheckpointCorrupt as exc:
            print(run, "CheckpointCorrupt", exc)
        except BaseException as exc:
            print(run, "other", type(exc).__name__, exc)
""")


def test_declared_sizes_are_checked_against_the_file_before_allocating(root: Path) -> None:
    # a chunk file's tensor declared at 8 GiB
    shutil.copytree(root / "c", root / "big")
    edit_manifest(root / "big" / STEP2 / M0, lambda m: (m.update(run="big"), _grow_w([2**31], 2**33)(m)))
    # an HDF5 dataset of 8 GiB that stores nothing (unwritten chunks read as fill values)
    shutil.copytree(root / "h", root / "h5big")
    step = root / "h5big" / STEP2
    with h5py.File(step / H5, "a") as f:
        del f["v"]
        f.create_dataset("v", shape=(2**31,), dtype="<f4", chunks=(2**20,), compression="gzip")
    edit_manifest(step / M0, lambda m: (m.update(run="h5big"), m["files"].update({H5: (step / H5).stat().st_size}),
                  m["tensors"]["v"].update(shape=[2**31], nbytes=2**33)))
    # a safetensors header that claims 1 TiB (read when verifying)
    shutil.copytree(root / "c", root / "head")
    edit_manifest(root / "head" / STEP2 / M0, lambda m: m.update(run="head"))
    _header_length_lies(root / "head" / STEP2)

    r = subprocess.run([sys.executable, "-c", HUGE_SCRIPT, str(root), "big:model.w", "h5big:v", "head:model.w"],
                       capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert set(lines) == {"big", "h5big", "head"}, r.stdout + r.stderr
    assert lines["big"].startswith("CheckpointCorrupt") and "is truncated" in lines["big"], lines
    assert lines["h5big"].startswith("CheckpointCorrupt") and "declares 8589934592 bytes" in lines["h5big"], lines
    assert lines["head"].startswith("CheckpointCorrupt") and "header claims" in lines["head"], lines


# -- HDF5 files that reach outside themselves ---------------------------------------------------
def _h5_replace_v(step: Path, secret: Path, how: str) -> None:
    """Rewrite dataset "v" of the step's HDF5 file so that its bytes come from ``secret``
    (outside the root), and make the manifest agree, checksum included: only the
    reader's refusal to leave the file can stop it."""
    data = secret.read_bytes()[:4000]
    with h5py.File(step / H5, "a") as f:
        del f["v"]
        if how == "external storage":
            f.create_dataset("v", shape=(1000,), dtype="<f4", external=[(str(secret), 0, 4000)])
        elif how == "external link":
            with h5py.File(secret.with_suffix(".h5"), "w") as g:
                g.create_dataset("v", data=np.frombuffer(data, dtype="<f4"))
            f["v"] = h5py.ExternalLink(str(secret.with_suffix(".h5")), "/v")
        else:  # a soft link to another dataset of the file: still not a dataset of its own
            f.create_dataset("elsewhere", data=np.frombuffer(data, dtype="<f4"))
            f["v"] = h5py.SoftLink("/elsewhere")
    digest = f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"
    edit_manifest(step / M0, lambda m: (m["files"].update({H5: (step / H5).stat().st_size}),
                                        m["tensors"]["v"].update(offset=None, checksum=digest)))


@pytest.mark.parametrize("how, message", [("external storage", "keeps its data outside this file"),
                                          ("external link", r"link elsewhere \(h5py.ExternalLink\)"),
                                          ("soft link", r"link elsewhere \(h5py.SoftLink\)")])
def test_an_hdf5_file_never_makes_the_reader_leave_it(root: Path, tmp_path: Path, capsys, how, message) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(np.arange(1000, dtype="<f4").tobytes() * 2)
    _h5_replace_v(root / "h" / STEP2, secret, how)
    with pytest.raises(CheckpointCorrupt, match=rf"r00000.h5: tensor 'v': .*{message}"):
        ckptd.load("h", 2, root=root)
    rc, _, err = run_cli(capsys, "verify", "h", "2", "--root", str(root))
    assert rc == 1 and "'v'" in err and H5 in err, err
    edit_manifest(root / "h" / STEP2 / M0, _tensor("v", key="x/../v"))
    with pytest.raises(CheckpointCorrupt, match=r"its dataset key 'x/../v' is not the one its name maps to"):
        ckptd.load("h", 2, root=root)


# -- torn files: a crash, a bad disk, a careless person -------------------------------------
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_torn_chunk_files(root: Path, capsys) -> None:
    step = root / "c" / STEP2
    rec = json.loads((step / M0).read_bytes())["tensors"]["model.w"]

    _flip(step / CHUNK0, rec["offset"] + 123)  # a flipped bit: the step still looks complete
    assert ckptd.latest("c", root=root).step == 2
    assert ckptd.latest("c", root=root, verify=True).step == 1  # the newest that passes
    with pytest.raises(CheckpointCorrupt, match=rf"{CHUNK0}: tensor 'model.w': does not match its checksum"):
        ckptd.load("c", root=root, verify=True)
    rc, out, err = run_cli(capsys, "verify", "c", "--root", str(root))
    assert rc == 1 and err.count("damaged: ") == 1 and "'model.w'" in err and CHUNK0 in err, err
    rc, out, err = run_cli(capsys, "latest", "c", "--verify", "--root", str(root), "--json")
    assert rc == 0 and json.loads(out)["step"] == 1, err
    rc, out, _ = run_cli(capsys, "latest", "c", "--root", str(root), "--json")
    assert rc == 0 and json.loads(out)["step"] == 2

    with open(step / CHUNK0, "r+b") as f:  # torn mid-tensor
        f.truncate(rec["offset"] + 1000)
    assert ckptd.latest("c", root=root).step == 1  # no longer complete
    with pytest.raises(CheckpointCorrupt, match=r"'model.w': is truncated"):
        ckptd.load("c", 2, root=root)
    (step / CHUNK0).unlink()
    rc, _, err = run_cli(capsys, "verify", "c", "2", "--root", str(root))
    assert rc == 1 and err.count("damaged: ") == 2 and "'model.b'" in err and "'model.w'" in err, err
    assert "cannot open a file the manifest names" in err and CHUNK0 in err

    for s in (1, 2):  # nothing passes any more
        (root / "c" / layout.step_dir_name(s) / CHUNK0).write_bytes(b"")
    assert ckptd.latest("c", root=root, verify=True) is None
    rc, _, err = run_cli(capsys, "latest", "c", "--verify", "--root", str(root))
    assert rc == 1 and "no complete checkpoint" in err and "passes verification" in err


def test_torn_hdf5_files(root: Path, capsys) -> None:
    step = root / "h" / STEP2
    recs = json.loads((step / M0).read_bytes())["tensors"]
    assert recs["s"]["offset"] is not None and recs["v"]["offset"] is None  # contiguous and chunked
    with h5py.File(step / H5, "r") as f:
        chunk = f["v"].id.get_chunk_info(0)
    pristine = (step / H5).read_bytes()

    _flip(step / H5, recs["s"]["offset"])
    _flip(step / H5, chunk.byte_offset + chunk.size // 2)  # inside v's compressed bytes
    rc, _, err = run_cli(capsys, "verify", "h", "--root", str(root))
    assert rc == 1 and err.count("damaged: ") == 2, err
    assert f"{H5}: tensor 's': does not match its checksum" in err
    assert f"{H5}: tensor 'v': " in err
    for name in ("s", "v"):
        with pytest.raises(CheckpointCorrupt, match=rf"{H5}: tensor '{name}'"):
            ckptd.load("h", 2, root=root, names=[name], verify=True)
    assert ckptd.latest("h", root=root, verify=True).step == 1

    (step / H5).write_bytes(b"\0" * 8 + pristine[8:])  # HDF5's own signature gone
    rc, _, err = run_cli(capsys, "verify", "h", "2", "--root", str(root))
    assert rc == 1 and err.count("not a readable HDF5 file") == 2 and "'s'" in err and "'v'" in err, err
    (step / H5).unlink()
    rc, _, err = run_cli(capsys, "verify", "h", "2", "--root", str(root))
    assert rc == 1 and err.count("cannot open a file the manifest names") == 2, err

    (step / H5).write_bytes(pristine)  # whole again
    rc, out, err = run_cli(capsys, "verify", "h", "2", "--root", str(root))
    assert rc == 0 and "every tensor matches" in out, err


def test_a_damaged_manifest_of_another_rank_does_not_stop_a_commit(daemon) -> None:
    """The writer reads the step's manifests after committing its own; a damaged one
    (another rank's, crafted) used to escape its error handling: the commit was
    never acknowledged."""
    step = daemon.root / "t" / layout.step_dir_name(5)
    step.mkdir(parents=True)
    (step / layout.manifest_name(1)).write_text('{"format_version": 1, "tensors": 7}')
    p = daemon.producer("t", rank=0, world_size=2)
    try:
        assert p.save(chunk_state(5), 5).wait(60).step == 5
        assert p.save(chunk_state(6), 6).wait(60).step == 6  # and it serves on
    except BaseException:
        daemon.kill()  # a commit never answered would keep close() waiting
        raise
    finally:
        try:
            p.close()
        except CheckpointError:
            pass
    assert ckptd.list_checkpoints("t", root=daemon.root) == []  # rank 1 has not committed
    with pytest.raises(CheckpointCorrupt, match=r"manifest-r00001.json: field 'run' is missing"):
        ckptd.load("t", 5, root=daemon.root, rank=0)


# -- symlinks planted below the root ------------------------------------------------------------
def test_a_symlinked_run_folder_is_never_written_read_or_pruned_through(make_daemon, pristine: Path,
                                                                         tmp_path: Path, capsys) -> None:
    outside = tmp_path / "etc"  # stands in for /etc: a valid-looking run, and an empty step folder
    shutil.copytree(pristine / "c", outside)
    (outside / layout.step_dir_name(5)).mkdir()
    (outside / "passwd").write_text("root:x:0:0\n")
    d = make_daemon(start=False, tables={"retention": {"keep_last": 1}})
    d.root.mkdir(parents=True)
    os.symlink(outside, d.root / "c")
    before = tree(outside)
    d.start()

    with d.producer("c") as p:  # the daemon refuses to write there; the producer is told
        with pytest.raises(CheckpointError, match=r"not a real directory|symlink"):
            p.save(chunk_state(5), 5).wait(30)
    with pytest.raises(CheckpointError, match="symlink"):
        with d.producer("c", retention={"keep_last": 1}) as p:
            p.save(chunk_state(6), 6).wait(30)
    with d.producer("ok") as p:  # and serves on
        assert p.save(chunk_state(1), 1).wait(30).step == 1
        # a symlink planted while it runs: its index follows the event, never the link
        shutil.copytree(pristine / "c", tmp_path / "c2")
        for m in (tmp_path / "c2").glob("step-*/" + M0):
            edit_manifest(m, lambda m: m.update(run="c2"))
        os.symlink(tmp_path / "c2", d.root / "c2")
        time.sleep(1.0)  # the index reacts to an event within ~0.1 s
        assert p.latest("c2") is None and p.latest("c") is None

    for call in (ckptd.list_checkpoints, ckptd.latest, ckptd.load):
        with pytest.raises(CheckpointCorrupt, match=r"/c is a symlink; ckptd never reads through symlinks"):
            call("c", root=d.root)
    for args in (["prune", "c"], ["list", "c"], ["verify", "c", "1"], ["latest", "c"]):
        rc, _, err = run_cli(capsys, *args, "--root", str(d.root))
        assert rc == 1 and "is a symlink" in err, (args, err)
    assert d.stop() == 0
    d.start()  # start-up clean-up passes it by
    assert d.stop() == 0
    assert tree(outside) == before
    assert d.proc.returncode == 0


def test_symlinked_step_folders_and_files(make_daemon, pristine: Path, tmp_path: Path) -> None:
    d = make_daemon(tables={"retention": {"keep_last": 1}})
    run = d.root / "t"
    with d.producer("t") as p:
        p.save(chunk_state(1), 1).wait(30)
    outside = tmp_path / "etc"
    outside.mkdir()
    # step 9: a complete, valid checkpoint of run t, but outside the root
    shutil.copytree(pristine / "c" / STEP2, outside / "s9")
    edit_manifest(outside / "s9" / M0, lambda m: m.update(run="t", step=9))
    os.symlink(outside / "s9", run / layout.step_dir_name(9))
    # step 4: a real folder whose manifest and chunk are symlinks to valid files outside
    shutil.copytree(pristine / "c" / STEP2, outside / "s4")
    edit_manifest(outside / "s4" / M0, lambda m: m.update(run="t", step=4))
    (run / layout.step_dir_name(4)).mkdir()
    for name in (M0, CHUNK0):
        os.symlink(outside / "s4" / name, run / layout.step_dir_name(4) / name)
    # step 6 (to be written): a symlink to an empty folder outside
    (outside / "s6").mkdir()
    os.symlink(outside / "s6", run / layout.step_dir_name(6))
    # step 7 (to be written): a real folder with a symlink where its first chunk goes
    (outside / "victim").write_bytes(b"precious")
    (run / layout.step_dir_name(7)).mkdir()
    os.symlink(outside / "victim", run / layout.step_dir_name(7) / CHUNK0)
    # an interrupted deletion (trash) that is a symlink, and orphan-looking files outside
    (outside / "trash").mkdir()
    (outside / "trash" / "keep").write_bytes(b"keep")
    os.symlink(outside / "trash", run / ".trash-step-000000000003-deadbeef")
    (outside / "s9" / layout.chunk_name(0, 77)).write_bytes(b"looks like an orphan")
    before = tree(outside)

    # the reader: never lists, loads or resumes from them
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [1]
    for step, where in ((9, "step-000000000009 is a symlink"), (4, "manifest-r00000.json is a symlink")):
        with pytest.raises(CheckpointCorrupt, match=where):
            ckptd.load("t", step, root=d.root)
        with pytest.raises(CheckpointCorrupt, match=where):
            reader.verify("t", step, root=d.root)

    with d.producer("t") as p:
        for step in (6, 7):  # nothing is written through a symlink: the step fails
            with pytest.raises(CheckpointError):
                p.save(chunk_state(step), step).wait(30)
        for step in (10, 11):  # retention (keep_last=1) deletes real steps only
            p.save(chunk_state(step), step).wait(30)
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [11]
    assert d.stop() == 0
    (run / "latest").write_text(layout.step_dir_name(9) + "\n")  # a pointer to the symlink
    assert ckptd.latest("t", root=d.root).step == 11
    d.start()  # start-up clean-up: orphans and trash, never through a symlink
    assert d.stop() == 0

    after = tree(outside)
    assert after == before
    assert (run / layout.step_dir_name(9)).is_symlink()  # left alone, not deleted through
    assert not (run / layout.step_dir_name(7) / CHUNK0).exists()  # the link itself may go


def test_symlinks_in_place_of_small_files_are_not_followed(make_daemon, tmp_path: Path) -> None:
    """The latest pointer, retention.json and a writing marker planted as symlinks:
    the daemon replaces or ignores the link, and what it points to is unchanged."""
    outside = tmp_path / "etc"
    outside.mkdir()
    for name in ("pointer", "policy", "marker"):
        (outside / name).write_text("precious\n")
    d = make_daemon(start=False)
    run = d.root / "t"
    run.mkdir(parents=True)
    os.symlink(outside / "pointer", run / "latest")
    os.symlink(outside / "policy", run / "retention.json")
    (run / layout.step_dir_name(3)).mkdir()
    os.symlink(outside / "marker", run / layout.step_dir_name(3) / layout.writing_marker(0))
    before = tree(outside)
    d.start()
    with d.producer("t", retention={"keep_last": 2}) as p:
        p.save(chunk_state(1), 1).wait(30)
    assert (run / "latest").read_text() == f"{STEP1}\n" and not (run / "latest").is_symlink()
    assert json.loads((run / "retention.json").read_text()) == {"keep_last": 2}
    assert tree(outside) == before
    assert ckptd.latest("t", root=d.root).step == 1


@pytest.mark.parametrize("fmt", ["chunk", "hdf5"])
def test_a_step_folder_swapped_for_a_symlink_while_written_redirects_nothing(make_daemon, tmp_path: Path,
                                                                              fmt: str) -> None:
    """The writer checks the step folder once, then makes every file through the folder's
    open descriptor: a folder renamed away and replaced by a symlink mid-step (someone
    who may write the root) gets nothing written through the link."""
    d = make_daemon(write_rate="4MiB", chunk_size="1MiB")
    outside = tmp_path / "outside"
    outside.mkdir()
    step = d.root / "swap" / "step-000000000001"
    with d.producer("swap", format=fmt, staging_size="16MiB") as p:
        with p.checkpoint(1) as handle:
            for i in range(8):
                p.emit(f"t{i}", torch.full((2**18,), float(i)))  # 1 MiB each, written over ~2 s
            deadline = time.monotonic() + 30
            while not (step.is_dir() and any(n.endswith((".safetensors", ".h5")) for n in os.listdir(step))):
                assert time.monotonic() < deadline, d.log_text()
                time.sleep(0.01)
            os.rename(step, step.with_name("moved"))
            os.symlink(outside, step)
        try:
            handle.wait(60)
        except CheckpointError:
            pass  # either outcome is fine here: what matters is where the bytes went
    assert os.listdir(outside) == []  # nothing was written through the link
    moved = sorted(os.listdir(step.with_name("moved")))
    assert "manifest-r00000.json" in moved and any(n.endswith((".safetensors", ".h5")) for n in moved), moved
    assert d.proc.poll() is None
