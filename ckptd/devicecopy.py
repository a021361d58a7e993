"""``load(..., map_location="cuda")``: tensors onto the GPU as they are read (``DeviceCopier``).

Each tensor the reader yields is copied into one of two pinned buffers (``SLOT`` bytes;
larger ones in pieces) and from there to the device with ``non_blocking=True`` on a
stream of its own, so the copy of one piece overlaps the read of the next and host
memory holds one tensor and two buffers. Needs CUDA: ``benchmarks/cuda_check.py`` runs it.
"""

from __future__ import annotations

from typing import Any

SLOT = 64 * 2**20


def is_cuda(map_location: Any) -> bool:
    import torch

    try:
        return torch.device(map_location).type == "cuda"
    except (TypeError, RuntimeError):
        return False


class DeviceCopier:
    """Host tensors to ``device`` through two pinned buffers, copies overlapped."""

    def __init__(self, device: Any, slot: int | None = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"map_location={device!r}, but this torch has no usable CUDA device "
                             "(torch.cuda.is_available() is False): load to the CPU instead")
        self._torch = torch
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)
        self._slots = [torch.empty(slot or SLOT, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._next = 0

    def to_device(self, t: Any) -> Any:
        """A device copy of CPU tensor ``t`` (its copy may still be in flight: ``finish``)."""
        torch = self._torch
        dst = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if t.numel() == 0:
            return dst
        src = t.contiguous().reshape(-1).view(torch.uint8)
        out = dst.reshape(-1).view(torch.uint8)
        slot_bytes = self._slots[0].numel()
        for start in range(0, src.numel(), slot_bytes):
            n = min(slot_bytes, src.numel() - start)
            i = self._next
            self._next ^= 1
            if self._events[i] is not None:
                self._events[i].synchronize()
            slot = self._slots[i][:n]
            slot.copy_(src[start:start + n])
            with torch.cuda.stream(self._stream):
                out[start:start + n].copy_(slot, non_blocking=True)
                self._events[i] = torch.cuda.Event()
                self._events[i].record(self._stream)
        return dst

    def finish(self) -> None:
        """Wait until every copy has landed: the tensors are ready on any stream."""
        self._stream.synchronize()
