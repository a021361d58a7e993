"""The chunk format: each chunk file is a complete, valid safetensors file.

A safetensors file cannot be appended to (its header, with every offset, comes
first), so a chunk is written whole once its tensors are known: the header, padded
with spaces so the data starts page-aligned, then every tensor's bytes in order,
with no holes between them, as safetensors requires.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from .dtypes import Dtype

ALIGN = 4096
_IOV_MAX = 1024
_METADATA = {"format": "pt", "writer": "ckptd"}


@dataclass
class Entry:
    """One tensor as the chunk writer sees it: a name, a type and its bytes."""

    name: str
    dtype: Dtype
    shape: list[int]
    nbytes: int
    buffers: list[Any]  # bytes-like pieces, in order, adding up to nbytes
    numpy: bool = False  # emitted as a numpy array
    shard: Any = None  # a manifest.Shard: the piece of a larger tensor this is


def header(entries: Sequence[Entry]) -> bytes:
    """The safetensors header (8-byte length + JSON) for ``entries`` in order."""
    body: dict[str, Any] = {"__metadata__": _METADATA}
    begin = 0
    for e in entries:
        body[e.name] = {
            "dtype": e.dtype.st_code,
            "shape": e.dtype.stored_shape(e.shape),
            "data_offsets": [begin, begin + e.nbytes],
        }
        begin += e.nbytes
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    size = len(text)
    padded = -(-(8 + size) // ALIGN) * ALIGN - 8  # data then starts on an ALIGN boundary
    return padded.to_bytes(8, "little") + text + b" " * (padded - size)


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (O_DIRECT wants it page-aligned)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def write_buffers(fd: int, buffers: Sequence[Any]) -> None:
    """Write every buffer in order with as few syscalls as the kernel allows."""
    pending = deque(v for b in buffers if len(v := memoryview(b).cast("B")))
    while pending:
        batch = [pending[i] for i in range(min(len(pending), _IOV_MAX))]
        n = os.writev(fd, batch)
        # drop what was fully written; trim a partly written buffer
        while n and pending:
            head = pending[0]
            if n >= len(head):
                n -= len(head)
                pending.popleft()
            else:
                pending[0] = head[n:]
                n = 0
