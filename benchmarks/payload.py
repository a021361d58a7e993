"""The synthetic state every measurement saves: N float32 tensors of random values.

The report's processes (the baseline and DCP workers, every ckptd producer) must
save the same bytes without each holding its own copy: at 1 GiB and a dozen
processes that would not fit a 24 GiB machine. So the parent builds the state
once in a memfd (anonymous shared memory), and every worker maps it and views
the same pages as its tensors. A worker's RSS thus counts the payload as shared
memory (``RssShmem``), as it counts a training job's parameters as its own.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 4096  # every tensor starts on a page: O_DIRECT can write any of them, and the whole buffer


def make_state(nbytes: int, ntensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``ntensors`` float32 tensors of equal size, ``nbytes`` in all (rounded down to 4 bytes
    per element), in ordinary process memory. Random values, so that nothing on the path
    can shortcut zeros. (benchmarks/hdf5_bench.py uses this one.)"""
    numel = max(1, nbytes // (4 * ntensors))
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(numel, generator=gen) for name in tensor_names(ntensors)}


def tensor_names(ntensors: int) -> list[str]:
    width = len(str(ntensors - 1))
    return [f"layers.{i:0{width}d}.weight" for i in range(ntensors)]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in the shared buffer; travels to workers as JSON."""

    names: list[str]
    numel: int  # elements per tensor (float32)
    offsets: list[int]
    size: int  # bytes of the buffer (page multiple)

    @property
    def nbytes(self) -> int:
        """Tensor bytes, without the alignment padding."""
        return 4 * self.numel * len(self.names)

    @classmethod
    def plan(cls, nbytes: int, ntensors: int) -> "Layout":
        numel = max(1, nbytes // (4 * ntensors))
        step = -(-4 * numel // ALIGN) * ALIGN
        return cls(tensor_names(ntensors), numel, [i * step for i in range(ntensors)], step * ntensors)

    def to_dict(self) -> dict[str, Any]:
        return {"names": self.names, "numel": self.numel, "offsets": self.offsets, "size": self.size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        return cls(list(d["names"]), int(d["numel"]), [int(x) for x in d["offsets"]], int(d["size"]))


class SharedPayload:
    """The state in a memfd. ``create`` fills it (the parent); ``attach`` maps a descriptor
    inherited from the parent (a worker). ``state`` holds one tensor per name, each with a
    storage of its own: safetensors refuses tensors that share one, and torch.save would
    write a shared storage once instead of once per tensor."""

    def __init__(self, fd: int, layout: Layout) -> None:
        self.fd = fd
        self.layout = layout
        self.mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.state: dict[str, torch.Tensor] = {
            name: torch.frombuffer(self.mm, dtype=torch.float32, count=layout.numel, offset=off)
            for name, off in zip(layout.names, layout.offsets, strict=True)
        }

    @classmethod
    def create(cls, nbytes: int, ntensors: int, seed: int = 0) -> "SharedPayload":
        layout = Layout.plan(nbytes, ntensors)
        fd = os.memfd_create("ckptd-bench-payload", 0)  # inheritable: workers get it via pass_fds
        os.ftruncate(fd, layout.size)
        payload = cls(fd, layout)
        gen = torch.Generator().manual_seed(seed)
        for t in payload.state.values():
            torch.rand(t.shape, generator=gen, out=t)
        return payload

    @classmethod
    def attach(cls, fd: int, layout: Layout) -> "SharedPayload":
        return cls(fd, layout)

    def contiguous_bytes(self) -> memoryview:
        """The whole buffer, page-aligned, for the raw-write baselines. With padding between
        tensors (a size that is not a page multiple) it also holds those few zero bytes."""
        return memoryview(self.mm)[: self.layout.size]

    def close(self) -> None:
        self.state.clear()
        try:
            self.mm.close()
        except BufferError:
            pass  # a tensor view still exists; the mapping goes with it
        os.close(self.fd)
