"""What ckptd is measured against: the floors (memcpy, a raw write) and the usual ways
to save a checkpoint (torch.save, safetensors, h5py, DCP's async_save).

Each function does one measurement and returns ``(blocked_s, durable_s)``: how long
the caller could not go on, and how long until the bytes were durable (fsync done).
For the synchronous savers the two are the same. Each file is removed once
measured: the report needs the bytes written, not kept.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from payload import state_bytes

Timing = tuple[float, float]  # (blocked_s, durable_s)


# -- memcpy: the floor of any snapshot ---------------------------------------------------------
class CopyTargets:
    """One preallocated, pre-faulted buffer cut into one destination per tensor, laid out
    back to back like ckptd's staging arena; torch, numpy and raw-pointer views of it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        size = max(mmap.PAGESIZE, state_bytes(state))
        # page-aligned and pre-faulted (MAP_POPULATE), like the staging arena: first-touch
        # faults are not memcpy
        self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.flat.fill_(1)  # where MAP_POPULATE is missing
        self.nbytes = state_bytes(state)
        self.src = list(state.values())
        self.dst: list[torch.Tensor] = []
        offset = 0
        for t in self.src:
            n = t.numel() * t.element_size()
            self.dst.append(self.flat[offset:offset + n].view(t.dtype))
            offset += n
        self.src_np = [t.numpy() for t in self.src]
        self.dst_np = [t.numpy() for t in self.dst]

    def torch_copy(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)

    def numpy_copy(self) -> None:
        for d, s in zip(self.dst_np, self.src_np, strict=True):
            np.copyto(d, s)

    def memmove(self) -> None:
        for d, s in zip(self.dst, self.src, strict=True):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())

    def bytes_view(self) -> memoryview:
        """The copied bytes, page-aligned (valid after any copy above)."""
        return memoryview(self._mm)[: self.nbytes]


def time_call(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def memcpy_three_ways(targets: CopyTargets) -> dict[str, float]:
    """Seconds per way; the report's "memcpy" is the fastest, per repeat."""
    return {"torch_copy": time_call(targets.torch_copy), "numpy_copyto": time_call(targets.numpy_copy),
            "ctypes_memmove": time_call(targets.memmove)}


# -- raw writes: the floor of durable writing ---------------------------------------------------
def raw_write_fsync(data: memoryview, path: Path, block: int) -> float:
    """One file, sequential os.write of ``block`` bytes at a time, then fsync: the disk's floor
    through the page cache."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


class DirectIORefused(OSError):
    """The filesystem does not take O_DIRECT (tmpfs, some network filesystems)."""


def raw_write_direct(data: memoryview, path: Path, block: int) -> float:
    """The same with O_DIRECT: the page cache bypassed, as a database or a daemon with
    ``direct_io`` writes. ``data`` must be page-aligned (an mmap is) and ``block`` a multiple
    of 4096. A tail shorter than the alignment goes through the page cache (O_DIRECT cleared
    with fcntl), as any O_DIRECT writer must. Raises DirectIORefused where the filesystem
    refuses O_DIRECT."""
    align = 4096
    if block % align:
        raise ValueError(f"O_DIRECT needs a block size that is a multiple of {align}, not {block}")
    t0 = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectIORefused(exc.errno, f"O_DIRECT refused by the filesystem of {path.parent}") from exc
        raise
    try:
        aligned = len(data) - len(data) % align
        try:
            write_all(fd, data[:aligned], block)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # some filesystems accept the open, refuse the write
                raise DirectIORefused(exc.errno, f"O_DIRECT write refused in {path.parent}") from exc
            raise
        if aligned < len(data):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            write_all(fd, data[aligned:], block)
        os.fsync(fd)  # O_DIRECT skips the page cache, not the file's metadata or the disk's cache
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def write_all(fd: int, data: memoryview, block: int) -> None:
    for start in range(0, len(data), block):
        view = data[start:start + block]
        while view:  # regular files may write short
            view = view[os.write(fd, view):]


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the usual synchronous savers -----------------------------------------------------------------
def torch_save_fsync(state: dict[str, torch.Tensor], path: Path) -> float:
    """torch.save blocks the caller until the bytes are in the page cache; fsync makes them
    durable, which is what a ckptd commit promises."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def safetensors_fsync(state: dict[str, torch.Tensor], path: Path) -> float:
    """``safetensors.torch.save_file`` (one file, header first), then fsync."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    save_file(state, path)
    fsync_path(path)
    return time.perf_counter() - t0


def naive_h5py_fsync(state: dict[str, torch.Tensor], path: Path) -> float:
    """What a user writes by hand: one ``create_dataset`` per tensor, flush, close, fsync."""
    import h5py

    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:
        for name, t in state.items():
            f.create_dataset(name, data=t.numpy())
        f.flush()
    fsync_path(path)  # after close, which writes the last metadata
    return time.perf_counter() - t0


# -- torch.distributed.checkpoint.async_save ----------------------------------------------------
def init_single_rank_gloo() -> None:
    """A one-rank gloo group on the loopback, as a one-GPU training job would have. DCP's
    process executor needs one (it reads the rank and world size), and its writer process
    joins a group of its own on MASTER_ADDR, which must not depend on resolving the host name."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port; the group's store binds it right after
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class DcpSaver:
    """``dcp.async_save(state, storage_writer=FileSystemWriter(dir), async_checkpointer_type=...)``.

    ``executor``: "thread" (DCP's default: the write runs on a thread of the caller's
    process) or "process" (a writer process that DCP spawns once and keeps, like a
    daemon). ``reuse_stager``: keep one DefaultStager across calls, so staging reuses
    its memory as ckptd's arena does; otherwise each call stages into fresh memory,
    which is what ``async_save`` does when given no stager."""

    def __init__(self, base: Path, executor: str, reuse_stager: bool = False) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        init_single_rank_gloo()
        self.dcp = dcp
        self.base = base
        self.kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}[executor]
        self.stager = DefaultStager(dcp_staging_options(StagingOptions)) if reuse_stager else None
        self.count = 0

    def once(self, state: dict[str, torch.Tensor]) -> Timing:
        from torch.distributed.checkpoint import FileSystemWriter

        self.count += 1
        out = self.base / f"dcp-{self.count}"
        t0 = time.perf_counter()
        response = self.dcp.async_save(state, storage_writer=FileSystemWriter(out),  # sync_files=True: fsync
                                       async_checkpointer_type=self.kind, async_stager=self.stager)
        t1 = time.perf_counter()
        done: Any = getattr(response, "upload_completion", response)  # a Future, or an AsyncSaveResponse
        done.result()
        t2 = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        return t1 - t0, t2 - t0

    @staticmethod
    def writer_pid() -> int | None:
        """The process executor's writer process, once started (a private DCP global)."""
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        return getattr(getattr(proc, "_save_process", None), "pid", None)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        stop_dcp_writer_process()


def dcp_staging_options(options: Any) -> Any:
    """DCP's fastest ``StagingOptions`` on this host: shared memory (the writer process maps
    the staged tensors instead of receiving a copy) works on CPU in torch 2.13; pinned
    memory, async staging and non-blocking copies need CUDA and are on only where it is."""
    cuda = torch.cuda.is_available()
    return options(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda,
                   use_non_blocking_copy=cuda)


def stop_dcp_writer_process() -> None:
    """DCP stops its writer process only when its module global is garbage collected; stop
    it now so that no process outlives the report."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    save_process = proc._save_process
    try:
        proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
        save_process.join(10)
    except (OSError, ValueError):
        pass
    if save_process.is_alive():
        save_process.terminate()
        save_process.join(10)
