"""A manifest's plain records: ``TensorRecord`` (where one tensor's bytes are stored)
and ``Shard`` (where a piece sits in its whole tensor), with the checks of their fields.

They import nothing of ckptd but ``dtypes`` and ``names``, so that the formats
(``format/``) and replica comparison use them below the manifest's parser;
``manifest`` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from . import dtypes, names

MAX_DIMS = 64
MAX_INT = (1 << 63) - 1  # offsets and sizes end up in off_t and int64 shapes


@dataclass(frozen=True)
class Shard:
    """Where a stored piece sits in its whole tensor (docs/format.md): the record's
    ``shape`` is the piece's own; ``placements`` and ``mesh_shape`` are for people.
    ``tensor``: the name of the tensor the piece belongs to, where the record is kept
    under another key (a rank's second and later pieces of one tensor,
    ``sharding.piece_name``); None: the record's key is the tensor's name."""

    global_shape: list[int]
    offsets: list[int]
    placements: list[str] | None = None
    mesh_shape: list[int] | None = None
    tensor: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"global_shape": self.global_shape, "offsets": self.offsets}
        if self.tensor is not None:
            d["tensor"] = self.tensor
        if self.placements is not None:
            d["placements"] = self.placements
        if self.mesh_shape is not None:
            d["mesh_shape"] = self.mesh_shape
        return d

    @classmethod
    def parse(cls, d: Any, shape: list[int]) -> "Shard":
        """Check an untrusted shard object against its piece's ``shape``; ValueError
        saying what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"shard must be an object, not {type(d).__name__}")
        extra = set(d) - {"global_shape", "offsets", "placements", "mesh_shape", "tensor"}
        if extra:
            raise ValueError(f"shard has unknown fields {sorted(extra)}")
        global_shape = _sizes(d.get("global_shape"), "shard global_shape")
        offsets = _sizes(d.get("offsets"), "shard offsets")
        if not len(global_shape) == len(offsets) == len(shape):
            raise ValueError(f"shard global_shape {global_shape} and offsets {offsets} must have one entry "
                             f"per dimension of the piece's shape {shape}")
        for dim, (o, n, g) in enumerate(zip(offsets, shape, global_shape)):
            if o + n > g:
                raise ValueError(f"a piece of shape {shape} at offsets {offsets} does not fit global_shape "
                                 f"{global_shape} (dimension {dim})")
        placements = d.get("placements")
        if placements is not None and (not isinstance(placements, list) or len(placements) > MAX_DIMS
                                       or not all(isinstance(p, str) and len(p) <= 200 for p in placements)):
            raise ValueError(f"shard placements {short_repr(placements)} must be a list of short strings")
        mesh_shape = d.get("mesh_shape")
        if mesh_shape is not None:
            mesh_shape = _sizes(mesh_shape, "shard mesh_shape")
        tensor = d.get("tensor")
        if tensor is not None:
            try:
                names.check_name(tensor)
            except ValueError as exc:
                raise ValueError(f"shard tensor: {exc}") from None
        return cls(global_shape, offsets, placements, mesh_shape, tensor)


def _sizes(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DIMS or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_INT for n in value):
        raise ValueError(f"{what} {short_repr(value)} must be a list of at most {MAX_DIMS} sizes")
    return value


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor (or piece) is stored, and what it is.

    ``file``: relative to the step folder
    ``offset``: absolute offset of the data in the file; None where the data has no one place (a
        chunked or empty HDF5 dataset): read it by ``key`` then
    ``numpy``: emitted as a numpy array; loads back as one
    ``shard``: None: the record holds the whole tensor"""

    dtype: str
    shape: list[int]
    file: str
    key: str
    offset: int | None
    nbytes: int
    checksum: str
    numpy: bool = False
    shard: Shard | None = None

    @property
    def global_shape(self) -> list[int]:
        return self.shard.global_shape if self.shard is not None else self.shape

    @property
    def offsets(self) -> list[int]:
        return self.shard.offsets if self.shard is not None else [0] * len(self.shape)

    def as_tensor(self, raw: Any) -> Any:
        """Its bytes, ``raw`` (a torch uint8 tensor), viewed as its dtype and shape."""
        return raw.view(dtypes.torch_dtype(self.dtype)).reshape(self.shape)

    def tensor_name(self, key: str) -> str:
        """The name of the tensor this record (kept under ``key`` in its manifest) holds
        all or a piece of."""
        return self.shard.tensor if self.shard is not None and self.shard.tensor is not None else key

    def to_dict(self) -> dict[str, Any]:
        # not asdict(): it deep-copies every field
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}
        if not self.numpy:
            del d["numpy"]
        if self.shard is None:
            del d["shard"]
        else:
            d["shard"] = self.shard.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorRecord":
        """A record as it stands, unchecked; ``Manifest.from_json`` checks each one."""
        return cls(
            dtype=d["dtype"], shape=[int(x) for x in d["shape"]], file=d["file"], key=d["key"],
            offset=None if d["offset"] is None else int(d["offset"]), nbytes=int(d["nbytes"]),
            checksum=d["checksum"],
            numpy=bool(d.get("numpy", False)),
            shard=None if d.get("shard") is None else Shard.parse(d["shard"], [int(x) for x in d["shape"]]),
        )


_RECORD_FIELDS = tuple(f.name for f in fields(TensorRecord))


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr`` of an untrusted value, cut short: an error message must stay one line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


CODECS = ("shuffle-zstd",)  # what ckptd.remote.codec encodes and decodes
MAX_FRAME_BYTES = 1 << 30


@dataclass(frozen=True)
class Packed:
    """How a data file is stored compressed in the bucket (manifest ``compression``):
    ``codec``, the object's ``size``, and its ``frames`` in file order, each
    ``(raw bytes, stored bytes, element size)``; a frame decodes on its own."""

    codec: str
    size: int
    frames: tuple[tuple[int, int, int], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "size": self.size, "frames": [list(f) for f in self.frames]}

    @classmethod
    def parse(cls, d: Any, raw_size: int | None) -> "Packed":
        """A ``compression`` entry checked; ValueError says what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"must be an object, not {type(d).__name__}")
        codec = d.get("codec")
        if codec not in CODECS:
            raise ValueError(f"codec {short_repr(codec)} is not one this ckptd decodes ({', '.join(CODECS)}); "
                             "upgrade ckptd to read it")
        frames, stored, raw = [], 0, 0
        listed = d.get("frames")
        for f in listed if isinstance(listed, list) else [None]:
            if (not isinstance(f, list) or len(f) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in f)
                    or not (0 < f[0] <= MAX_FRAME_BYTES and 0 < f[1] <= MAX_FRAME_BYTES + 1024 and 1 <= f[2] <= 16)):
                raise ValueError(f"frame {short_repr(f)} is not [raw bytes, stored bytes, element size]")
            frames.append((f[0], f[1], f[2]))
            raw, stored = raw + f[0], stored + f[1]
        if d.get("size") != stored or (raw_size is not None and raw != raw_size):
            raise ValueError(f"its frames hold {stored} stored and {raw} raw bytes, not the {short_repr(d.get('size'))} "
                             f"stored and {raw_size} raw bytes it names")
        return cls(codec=codec, size=stored, frames=tuple(frames))

    def spans(self) -> list[tuple[int, int, int, int, int]]:
        """Each frame as (raw start, raw end, stored start, stored end, element size)."""
        out, raw, stored = [], 0, 0
        for r, s, e in self.frames:
            out.append((raw, raw + r, stored, stored + s, e))
            raw, stored = raw + r, stored + s
        return out
