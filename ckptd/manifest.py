"""The vocabulary on disk: tensor records, manifests, checkpoint info, checksums.

A manifest (``manifest-r<rank>.json``) is written last; its presence commits one
rank's share of a step. Field names are fixed by DESIGN §9.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import xxhash

from .errors import CheckpointCorrupt

FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_64"


class Checksum:
    """A tensor's checksum, fed its bytes piece by piece (xxh3 releases the GIL)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, buf: Any) -> None:
        self._h.update(buf)

    def text(self) -> str:
        """``"xxh3_64:<hex>"``, as manifests record it."""
        return f"{CHECKSUM_ALGORITHM}:{self._h.hexdigest()}"


def checksum(buffers: Iterable[Any]) -> str:
    """The checksum of the concatenation of ``buffers``."""
    c = Checksum()
    for buf in buffers:
        c.update(buf)
    return c.text()


@dataclass(frozen=True)
class TensorRecord:
    dtype: str
    shape: list[int]
    file: str  # relative to the step folder
    key: str  # safetensors key or HDF5 dataset path
    # absolute offset of the data in the file; None where the data has no one place
    # (a chunked or empty HDF5 dataset): read it by ``key`` then
    offset: int | None
    nbytes: int
    checksum: str
    numpy: bool = False  # emitted as a numpy array; loads back as one

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.numpy:
            del d["numpy"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorRecord":
        return cls(
            dtype=d["dtype"], shape=[int(x) for x in d["shape"]], file=d["file"], key=d["key"],
            offset=None if d["offset"] is None else int(d["offset"]), nbytes=int(d["nbytes"]),
            checksum=d["checksum"],
            numpy=bool(d.get("numpy", False)),
        )


@dataclass(frozen=True)
class Manifest:
    run: str
    step: int
    rank: int
    world_size: int
    time: float
    tensors: dict[str, TensorRecord]
    state: Any = None  # the saved structure (ckptd.state), None for emit-built steps
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = "chunk"
    format_version: int = FORMAT_VERSION
    # data file -> its size when committed; lets the completeness check see a file that
    # is still being copied in where offsets say nothing (chunked HDF5 datasets)
    files: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> bytes:
        d = {
            "format_version": self.format_version, "format": self.format,
            "run": self.run, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "time": self.time, "metadata": self.metadata,
            "state": self.state,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "files": self.files,
        }
        return json.dumps(d, ensure_ascii=False, allow_nan=False, indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        try:
            d = json.loads(data)
            version = d["format_version"]
            if version != FORMAT_VERSION:
                raise CheckpointCorrupt(
                    f"{where}: manifest format_version {version!r} is not supported by "
                    f"this ckptd (it reads version {FORMAT_VERSION}); upgrade ckptd"
                )
            return cls(
                run=d["run"], step=int(d["step"]), rank=int(d["rank"]),
                world_size=int(d["world_size"]), time=float(d["time"]),
                tensors={n: TensorRecord.from_dict(t) for n, t in d["tensors"].items()},
                state=d.get("state"), metadata=d.get("metadata") or {},
                format=d.get("format", "chunk"),
                files={str(f): int(n) for f, n in (d.get("files") or {}).items()},
            )
        except CheckpointCorrupt:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{where}: manifest is malformed ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint (all ranks of a step), as ``latest`` and ``list`` report it."""

    run: str
    step: int
    path: str
    time: float
    nbytes: int
    ntensors: int
    format: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckpointInfo":
        return cls(
            run=str(d["run"]), step=int(d["step"]), path=str(d["path"]),
            time=float(d["time"]), nbytes=int(d["nbytes"]), ntensors=int(d["ntensors"]),
            format=str(d["format"]), metadata=dict(d.get("metadata") or {}),
        )

    @classmethod
    def from_manifests(cls, path: str, manifests: list[Manifest]) -> "CheckpointInfo":
        first = manifests[0]
        return cls(
            run=first.run, step=first.step, path=path,
            time=max(m.time for m in manifests),
            nbytes=sum(m.nbytes for m in manifests),
            ntensors=sum(len(m.tensors) for m in manifests),
            format=first.format, metadata=first.metadata,
        )


def check_json(value: Any, what: str) -> str:
    """Serialise user metadata to JSON text, or raise TypeError naming ``what``."""
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be plain JSON data (dict, list, str, int, finite float, "
                        f"bool, None): {exc}") from None


