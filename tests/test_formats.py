"""Every storage format meets one protocol (``ckptd.format``; docs/format.md): the same
cases run over each, through the daemon's real writer (its threads, queues and
commit, real files) and the real reader.

- a share written as batches of small tensors and a tensor streamed in pieces reads
  back bit-exact, into fresh memory, into the caller's tensors and mapped;
- the next step's unchanged tensors (recognised by checksum, or declared frozen)
  refer to the stored copies, linked or copied into the new step's folder, and still
  read back once the earlier step is deleted;
- a damaged file structure (a chunk file's header, an HDF5 file's superblock) is
  caught by the format's structure check, naming the file and the tensor;
- a discarded share leaves nothing behind.
"""

from __future__ import annotations

import os
import queue
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import dtypes, format as formats, layout
from ckptd.daemon.share import Result, Share, ShareId
from ckptd.daemon.writer import Writer
from ckptd.errors import CheckpointCorrupt
from ckptd.format import Entry
from ckptd.index import read_manifests

RUN = "t"


@pytest.fixture(params=formats.FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return request.param


def small(step: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes (a 0-d one, an empty one); ``b.*`` changes
    with the step, the others do not."""
    g = torch.Generator().manual_seed(7)
    return {
        "a.w": torch.randn(4, 5, generator=g),
        "a.bf": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "a.i": torch.arange(11, dtype=torch.int64),
        "a.scalar": torch.tensor(2.5, dtype=torch.float64),
        "a.empty": torch.zeros(0, 3),
        "b.x": torch.full((6,), float(step)),
    }


def big() -> torch.Tensor:
    """A tensor streamed in pieces, of an odd size (pieces need not be whole rows)."""
    return torch.arange(3 * 4099, dtype=torch.int16).reshape(3, 4099)


def entry(name: str, t: torch.Tensor, *, buffers: bool = True) -> Entry:
    raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    return Entry(name, dtypes.by_torch(t.dtype), list(t.shape), t.numel() * t.element_size(),
                 [raw] if buffers and len(raw) else [])


class Step:
    """A real writer writing one share of ``RUN``; its results, waited for."""

    def __init__(self, root: Path, fmt: str, step: int, threads: int = 1) -> None:
        self.results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.writer = Writer(self.results.put, fsync=False, threads=threads)
        self.share = Share(ShareId(root, RUN, 0, 1, step, format=fmt))

    def batch(self, tensors: dict[str, torch.Tensor]) -> None:
        self.writer.write_chunk(self.share, [entry(n, t) for n, t in tensors.items()], 0, [])

    def stream(self, name: str, t: torch.Tensor, pieces: int) -> None:
        s = self.writer.open_stream(self.share, entry(name, t, buffers=False))
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        cuts = [len(raw) * i // pieces for i in range(pieces + 1)]
        for i in range(pieces):
            self.writer.stream_piece(s, memoryview(raw)[cuts[i]:cuts[i + 1]], i == pieces - 1, 0, [])

    def frozen(self, base_step: int, tensors: dict[str, torch.Tensor]) -> None:
        self.writer.link_same(self.share, base_step, [entry(n, t, buffers=False) for n, t in tensors.items()])

    def finish(self, kind: str) -> Result:
        """Commit (``kind`` "committed") or discard ("discarded"); the result of it."""
        if kind == "discarded":
            self.writer.discard(self.share)
        else:
            self.writer.commit(self.share, None, {}, None)
        self.writer.close()
        while True:
            r = self.results.get(timeout=60)
            assert r.kind != "failed", r.message
            if r.kind not in ("freed",):
                assert r.kind == kind, r.message
                return r


def same_bits(a: Any, b: torch.Tensor) -> bool:
    a = torch.as_tensor(a)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def expected(step: int) -> dict[str, torch.Tensor]:
    return small(step) | {"big": big()}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_share_of_batches_and_a_streamed_tensor_reads_back_bit_exact(tmp_path: Path, fmt: str,
                                                                        threads: int) -> None:
    step = Step(tmp_path, fmt, 1, threads)
    tensors = small(1)
    step.batch({k: v for k, v in tensors.items() if k.startswith("a.")})
    step.stream("big", big(), pieces=5)
    step.batch({k: v for k, v in tensors.items() if k.startswith("b.")})
    step.finish("committed")

    [manifest] = read_manifests(layout.step_dir(tmp_path, RUN, 1))
    assert manifest.format == fmt
    for rec in manifest.tensors.values():  # every file it names is the share's format's
        assert formats.for_file(rec.file) is formats.get(fmt)
    want = expected(1)
    loaded = ckptd.load(RUN, 1, root=tmp_path, verify=True)
    assert loaded.keys() == want.keys()
    assert all(same_bits(loaded[n], t) for n, t in want.items())
    mapped = ckptd.load(RUN, 1, root=tmp_path, mmap=True)
    assert all(same_bits(mapped[n], t) for n, t in want.items())
    out = {n: torch.empty_like(t) for n, t in want.items()}
    got = ckptd.load(RUN, 1, root=tmp_path, out=out, verify=True)
    assert all(got[n] is out[n] and same_bits(out[n], t) for n, t in want.items())
    assert ckptd.reader.verify(RUN, 1, root=tmp_path)[1] == []


def test_unchanged_tensors_refer_to_the_earlier_steps_copies(tmp_path: Path, fmt: str) -> None:
    first = Step(tmp_path, fmt, 1)
    first.batch(small(1))
    first.stream("big", big(), pieces=3)
    first.finish("committed")

    second = Step(tmp_path, fmt, 2)
    second.batch(small(2))  # all but b.x unchanged: recognised by their checksums
    second.frozen(1, {"big": big()})  # declared unchanged: never sent again
    second.finish("committed")

    unchanged = sum(t.numel() * t.element_size() for n, t in expected(2).items() if n != "b.x")
    assert second.share.written.recognised == unchanged - big().numel() * 2
    assert second.share.written.reused + second.share.written.copied == unchanged
    shutil.rmtree(layout.step_dir(tmp_path, RUN, 1))  # what step 2 needs is in its own folder
    loaded = ckptd.load(RUN, 2, root=tmp_path, verify=True)
    assert all(same_bits(loaded[n], t) for n, t in expected(2).items())


def damage_start(path: Path) -> None:
    """Garbage over the first bytes of a data file: its own structure (a chunk file's
    header length, an HDF5 superblock), never a tensor's bytes."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * 64)


def test_the_structure_check_catches_a_damaged_file(tmp_path: Path, fmt: str) -> None:
    step = Step(tmp_path, fmt, 1)
    step.batch(small(1))
    step.finish("committed")
    path = layout.step_dir(tmp_path, RUN, 1)
    [manifest] = read_manifests(path)
    name, rec = next((n, r) for n, r in manifest.tensors.items() if r.nbytes)
    fd = os.open(path / rec.file, os.O_RDONLY)
    try:  # through the protocol: an intact file passes
        reader = formats.for_file(rec.file).open(fd, os.fstat(fd).st_size)
        reader.check(name, rec)
        reader.close()
        damage_start(path / rec.file)
        reader = formats.for_file(rec.file).open(fd, os.fstat(fd).st_size)
        with pytest.raises(CheckpointCorrupt):
            reader.check(name, rec)
        reader.close()
    finally:
        os.close(fd)
    # and through the reader: verify names the file and the tensor; the checksums alone
    # would not have caught it (the tensors' bytes are intact)
    problems = ckptd.reader.verify(RUN, 1, root=tmp_path)[1]
    assert problems and all(rec.file in p for p in problems), problems
    assert any(repr(name) in p for p in problems), problems
    with pytest.raises(CheckpointCorrupt, match=rec.file):
        ckptd.load(RUN, 1, root=tmp_path, verify=True)


def test_a_discarded_share_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    step = Step(tmp_path, fmt, 1)
    step.batch(small(1))
    s = step.writer.open_stream(step.share, entry("big", big(), buffers=False))
    raw = bytes(big().reshape(-1).view(torch.uint8).numpy())
    step.writer.stream_piece(s, memoryview(raw)[:1000], False, 0, [])  # half written
    step.finish("discarded")
    assert not layout.step_dir(tmp_path, RUN, 1).exists()
    assert os.listdir(tmp_path / RUN) == []


def test_a_format_is_found_by_name_and_by_file() -> None:
    assert formats.FORMATS == ("chunk", "hdf5")
    assert formats.for_file(layout.chunk_name(3, 7)) is formats.get("chunk")
    assert formats.for_file(layout.h5_name(3)) is formats.get("hdf5")
    assert formats.for_file(layout.h5_link_name(3, 12)) is formats.get("hdf5")
    assert formats.for_file(layout.manifest_name(3)) is None
    with pytest.raises(ValueError, match=r"'zip' is not one of 'chunk', 'hdf5'"):
        formats.get("zip")


def test_the_registry_loads_neither_h5py_nor_numpy() -> None:
    import subprocess
    import sys

    code = "import sys, ckptd.format, ckptd.manifest; print('h5py' in sys.modules, 'numpy' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TESTS_FORKSERVER"}  # a fresh interpreter (tests/forkserver.py)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=env | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr
