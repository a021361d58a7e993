"""The vocabulary on disk: tensor records, manifests, checkpoint info, checksums.

A manifest (``manifest-r<rank>.json``) is written last; its presence commits one
rank's share of a step. Field names are fixed (docs/format.md). A manifest read from
disk is untrusted input: ``Manifest.from_json`` checks every field before anything
is allocated or opened by what it says.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

import xxhash

from . import dtypes, format as formats, layout, names, replicas
from .errors import CheckpointCorrupt
from .format import FORMATS

FORMAT_VERSION = 1  # a manifest without sharded or replicated tensors
SHARDED_FORMAT_VERSION = 2  # one whose records carry "shard" or that lists "replicas"
PIECES_FORMAT_VERSION = 3  # one with several pieces of a tensor: a record's "shard" names its "tensor"
READABLE_VERSIONS = (FORMAT_VERSION, SHARDED_FORMAT_VERSION, PIECES_FORMAT_VERSION)
CHECKSUM_ALGORITHM = "xxh3_64"
# Commit metadata keys that ckptd's own layers write (ckptd.dcp: DCP's Metadata); they stay
# in the manifest and are left out of CheckpointInfo.metadata, which is the user's.
LAYER_METADATA_PREFIX = "ckptd."


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
            raise ValueError(f"shard placements {_short(placements)} must be a list of short strings")
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
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _MAX_INT for n in value):
        raise ValueError(f"{what} {_short(value)} must be a list of at most {MAX_DIMS} sizes")
    return value


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
    shard: Shard | None = None  # None: the record holds the whole tensor

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
        # not asdict(): it deep-copies every field, a cost seen at 10,000 records
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
    # the job's attempt that wrote it (ckptd.attempt); a step is complete out of one attempt's
    attempt: str | None = None
    # replicated tensors this rank's state refers to but another rank wrote: name -> that rank
    replicas: dict[str, int] = field(default_factory=dict)
    # replica comparison (ckptd.replicas, docs/training.md), optional: older readers skip them.
    # piece key -> "<function>:<hex>" of this rank's copy of each replicated piece it holds
    replica_digests: dict[str, str] = field(default_factory=dict)
    host: str | None = None  # the host the rank ran on, to name it when its copy differs
    compare_replicas: str | None = None  # the producer's [producer] compare_replicas, with digests

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> bytes:
        sharded = self.replicas or any(t.shard is not None for t in self.tensors.values())
        pieces = any(t.shard is not None and t.shard.tensor is not None for t in self.tensors.values())
        d = {
            "format_version": PIECES_FORMAT_VERSION if pieces else SHARDED_FORMAT_VERSION if sharded
            else self.format_version,
            "format": self.format,
            "run": self.run, "step": self.step, "rank": self.rank,
            "world_size": self.world_size, "time": self.time, "metadata": self.metadata,
            "state": self.state,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "files": self.files,
        }
        if self.attempt is not None:
            d["attempt"] = self.attempt
        if self.replicas:
            d["replicas"] = self.replicas
        if self.replica_digests:
            d["replica_digests"] = self.replica_digests
        if self.host is not None:
            d["host"] = self.host
        if self.compare_replicas is not None:
            d["compare_replicas"] = self.compare_replicas
        return _dumps_lines(d).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        """Parse and check a manifest. Everything in it is untrusted: each field is
        checked for type and range, and every tensor for a dtype ckptd knows, a size
        that agrees with its shape, a data file inside the step folder, and bytes
        that overlap no other tensor's; anything else is ``CheckpointCorrupt``
        naming ``where`` and what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise CheckpointCorrupt(f"{where}: manifest is {len(data)} bytes, more than the "
                                    f"{MAX_MANIFEST_BYTES} a ckptd manifest may have")
        try:
            d = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{where}: manifest is not valid JSON ({type(exc).__name__}: {exc})") from None
        return _Parser(where).manifest(d)


def _dumps_lines(d: dict[str, Any]) -> str:
    """JSON with one line per top-level field and per tensor record: readable, and made
    by the C encoder (``indent=`` falls back to the pure-Python one, 10x slower)."""
    def dump(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)

    fields_ = []
    for key, value in d.items():
        if key == "tensors" and value:
            body = ",\n".join(f"  {dump(name)}: {dump(rec)}" for name, rec in value.items())
            fields_.append(f' {dump(key)}: {{\n{body}\n }}')
        else:
            fields_.append(f" {dump(key)}: {dump(value)}")
    return "{\n" + ",\n".join(fields_) + "\n}"


MAX_MANIFEST_BYTES = 1 << 30  # far above any real one (64 MiB of state plus ~300 bytes a tensor)
MAX_DIMS = 64
_MAX_INT = (1 << 63) - 1  # offsets and sizes end up in off_t and int64 shapes
_CHECKSUM = re.compile(rf"{CHECKSUM_ALGORITHM}:[0-9a-f]{{16}}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (manifests hold finite numbers only)")


class _Parser:
    """Builds a Manifest from untrusted JSON, checking as it goes."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{self.where}: {what}")

    def typed(self, d: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str = "") -> Any:
        if key not in d:
            raise self.fail(f"{what}field {key!r} is missing")
        value = d[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(f"{what}field {key!r} must be {names}, not {type(value).__name__} {_short(value)}")
        return value

    def int_field(self, d: dict[str, Any], key: str, low: int, high: int, what: str = "") -> int:
        value = self.typed(d, key, int, what)
        if not low <= value <= high:
            raise self.fail(f"{what}field {key!r} is {_short(value)}, out of range {low}..{high}")
        return value

    def manifest(self, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise self.fail(f"manifest must be a JSON object, not {type(d).__name__}")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise self.fail(f"manifest format_version {_short(version)} is not supported by this ckptd "
                            f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade ckptd")
        run = self.typed(d, "run", str)
        if not names.RUN_ID_PATTERN.fullmatch(run):
            raise self.fail(f"run {_short(run)} is not a valid run id")
        step = self.int_field(d, "step", 0, names.MAX_STEP)
        world = self.int_field(d, "world_size", 1, names.MAX_WORLD_SIZE)
        rank = self.int_field(d, "rank", 0, world - 1)
        when = self.typed(d, "time", (int, float))
        try:
            when = float(when)
        except OverflowError:
            raise self.fail(f"time {_short(when)} is not a Unix time") from None
        fmt = d.get("format", "chunk")
        if fmt not in FORMATS:
            raise self.fail(f"format {_short(fmt)} is not one of {', '.join(FORMATS)}")
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise self.fail(f"metadata must be an object, not {type(metadata).__name__}")
        files = d.get("files") or {}
        if not isinstance(files, dict):
            raise self.fail(f"files must be an object, not {type(files).__name__}")
        for file, size in files.items():
            self.data_file(file, rank, fmt, "files: ")
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= _MAX_INT:
                raise self.fail(f"files: the size of {file!r} is {_short(size)}, not a byte count")
        attempt = d.get("attempt")
        if attempt is not None and not (isinstance(attempt, str) and 0 < len(attempt) <= 1024):
            raise self.fail(f"attempt {_short(attempt)} is not a string of 1 to 1024 characters")
        tensors = self.typed(d, "tensors", dict)
        records = {name: self.tensor(name, t, rank, fmt) for name, t in tensors.items()}
        for name, rec in records.items():
            if rec.tensor_name(name) != name and version < PIECES_FORMAT_VERSION:
                raise self.fail(f"tensor {name!r}: its shard names tensor {rec.tensor_name(name)!r}, which "
                                f"format_version {version} does not have (a manifest with it is version "
                                f"{PIECES_FORMAT_VERSION})")
        self.no_overlaps(records)
        replicas = self.replicas(d.get("replicas") or {}, rank, world, records)
        digests, host, policy = self.comparison(d)
        return Manifest(run=run, step=step, rank=rank, world_size=world, time=when,
                        tensors=records, state=d.get("state"), metadata=metadata, format=fmt,
                        files=dict(files), format_version=version, replicas=replicas, attempt=attempt,
                        replica_digests=digests, host=host, compare_replicas=policy)

    def comparison(self, d: dict[str, Any]) -> tuple[dict[str, str], str | None, str | None]:
        """The optional replica comparison fields (ckptd.replicas): digests, host, policy."""
        digests = d.get("replica_digests") or {}
        if not isinstance(digests, dict):
            raise self.fail(f"replica_digests must be an object, not {type(digests).__name__}")
        for key, value in digests.items():
            function, _, hexdigits = value.partition(":") if isinstance(value, str) else ("", "", "")
            if len(key) > 4096 or function not in replicas.FUNCTIONS or not _HEX16.fullmatch(hexdigits):
                raise self.fail(f"replica_digests: {_short(key)}: {_short(value)} is not "
                                f"<{' or '.join(replicas.FUNCTIONS)}>:<16 hex digits>")
        host = d.get("host")
        if host is not None and not (isinstance(host, str) and len(host) <= 255):
            raise self.fail(f"host {_short(host)} is not a host name")
        policy = d.get("compare_replicas")
        if policy is not None and policy not in replicas.POLICIES:
            raise self.fail(f"compare_replicas {_short(policy)} is not one of {', '.join(replicas.POLICIES)}")
        return dict(digests), host, policy

    def replicas(self, d: Any, rank: int, world: int, records: dict[str, TensorRecord]) -> dict[str, int]:
        if not isinstance(d, dict):
            raise self.fail(f"replicas must be an object, not {type(d).__name__}")
        for name, writer in d.items():
            try:
                names.check_name(name)
            except ValueError as exc:
                raise self.fail(f"replicas: tensor name is invalid: {exc}") from None
            if name in records:
                raise self.fail(f"replicas: tensor {name!r} is also one of this rank's own tensors")
            if isinstance(writer, bool) or not isinstance(writer, int) or not 0 <= writer < world or writer == rank:
                raise self.fail(f"replicas: tensor {name!r} names writer rank {_short(writer)}, not another "
                                f"rank of 0..{world - 1}")
        return dict(d)

    def data_file(self, file: Any, rank: int, fmt: str, what: str) -> str:
        # Only the names ckptd writes: no "..", no "/", no absolute path, this rank's own
        if not isinstance(file, str) or not layout.is_data_file(file):
            raise self.fail(f"{what}file {_short(file)} is not a ckptd data file name "
                            "(r<rank>-<seq>.safetensors, r<rank>.h5 or r<rank>-<step>.h5, inside the step folder)")
        if layout.file_rank(file) != rank:
            raise self.fail(f"{what}file {file!r} belongs to another rank than this manifest's ({rank})")
        if not formats.get(fmt).owns(file):
            raise self.fail(f"{what}file {file!r} is not a file of format {fmt!r}")
        return file

    def tensor(self, name: Any, t: Any, rank: int, fmt: str) -> TensorRecord:
        try:
            if name != names.RESERVED_NAME:  # refused when written since; harmless to read (HDF5)
                names.check_name(name)
        except ValueError as exc:
            raise self.fail(f"tensor name is invalid: {exc}") from None
        what = f"tensor {name!r}: "
        if not isinstance(t, dict):
            raise self.fail(f"{what}record must be an object, not {type(t).__name__}")
        dtype = self.typed(t, "dtype", str, what)
        info = dtypes.BY_NAME.get(dtype)
        if info is None:
            raise self.fail(f"{what}dtype {_short(dtype)} is not one ckptd knows")
        shape = self.typed(t, "shape", list, what)
        if len(shape) > MAX_DIMS:
            raise self.fail(f"{what}shape has {len(shape)} dimensions, more than {MAX_DIMS}")
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_INT:
                raise self.fail(f"{what}shape {_short(shape)} holds {_short(n)}, not a size")
        nbytes = self.int_field(t, "nbytes", 0, _MAX_INT, what)
        expected = math.prod(shape) * info.itemsize
        if nbytes != expected:
            raise self.fail(f"{what}nbytes {nbytes} disagrees with shape {shape} of {dtype} "
                            f"({expected} bytes)")
        file = self.data_file(t.get("file"), rank, fmt, what)
        key = self.typed(t, "key", str, what)
        offset = t.get("offset")
        problem = formats.get(fmt).record_problem(name, key, offset)
        if problem is not None:
            raise self.fail(what + problem)
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)
                                   or not 0 <= offset <= _MAX_INT - nbytes):
            raise self.fail(f"{what}offset {_short(offset)} is not a byte offset")
        digest = self.typed(t, "checksum", str, what)
        if not _CHECKSUM.fullmatch(digest):
            raise self.fail(f"{what}checksum {_short(digest)} is not {CHECKSUM_ALGORITHM}:<16 hex digits>")
        numpy = t.get("numpy", False)
        if not isinstance(numpy, bool) or (numpy and info.numpy is None):
            raise self.fail(f"{what}numpy {_short(numpy)} is not possible for dtype {dtype}")
        shard = None
        if t.get("shard") is not None:
            try:
                shard = Shard.parse(t["shard"], shape)
            except ValueError as exc:
                raise self.fail(f"{what}{exc}") from None
        return TensorRecord(dtype=dtype, shape=shape, file=file, key=key, offset=offset,
                            nbytes=nbytes, checksum=digest, numpy=numpy, shard=shard)

    def no_overlaps(self, records: dict[str, TensorRecord]) -> None:
        """No two tensors' bytes share a range of a file: a manifest that aliased them
        could make a small file load as many times its size."""
        spans = sorted((r.file, r.offset, r.offset + r.nbytes, n)
                       for n, r in records.items() if r.offset is not None and r.nbytes)
        for (f1, _, end1, n1), (f2, begin2, _, n2) in zip(spans, spans[1:]):
            if f1 == f2 and begin2 < end1:
                raise self.fail(f"tensors {n1!r} and {n2!r} overlap in {f1} (bytes {begin2}..{end1})")


def _short(value: Any, limit: int = 60) -> str:
    """``repr`` of an untrusted value, cut short: an error message must stay one line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint, as ``latest`` and ``list`` report it: all ranks of a complete
    step. A commit handle of a multi-rank step that other ranks have not completed
    yet reports only its own rank's share: then ``rank`` says whose (else None), and
    ``nbytes``/``ntensors`` count that share alone."""

    run: str
    step: int
    path: str
    time: float
    nbytes: int
    ntensors: int
    format: str
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int | None = None  # None: the whole step; an int: only that rank's share
    # where the step is complete: "local" (this root), "remote" (the [remote] tier), or both
    tiers: tuple[str, ...] = ("local",)
    # replica comparison (docs/training.md): None where no replicas were compared (a share
    # alone, "off", nothing replicated); else {tensor: [ranks whose copy differs from the
    # majority]}, {} when every copy agrees
    diverged: dict[str, list[int]] | None = None
    refused: bool = False  # diverged under compare_replicas = "refuse": never picked without a step

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tiers"] = list(self.tiers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckpointInfo":
        return cls(
            run=str(d["run"]), step=int(d["step"]), path=str(d["path"]),
            time=float(d["time"]), nbytes=int(d["nbytes"]), ntensors=int(d["ntensors"]),
            format=str(d["format"]), metadata=dict(d.get("metadata") or {}),
            world_size=int(d.get("world_size", 1)),
            rank=None if d.get("rank") is None else int(d["rank"]),
            tiers=tuple(str(t) for t in d.get("tiers") or ("local",)),
            diverged=None if d.get("diverged") is None
            else {str(k): [int(r) for r in v] for k, v in d["diverged"].items()},
            refused=bool(d.get("refused", False)),
        )

    @classmethod
    def from_manifests(cls, path: str, manifests: list[Manifest],
                       tiers: tuple[str, ...] = ("local",)) -> "CheckpointInfo":
        """The info of every rank's manifest of a step, or of one rank's share alone."""
        first = manifests[0]
        whole = len(manifests) == first.world_size
        diverged = replicas.diverged(manifests) if whole else None
        return cls(tiers=tiers, diverged=diverged, refused=replicas.refused(manifests, diverged),
            run=first.run, step=first.step, path=path,
            time=max(m.time for m in manifests),
            nbytes=sum(m.nbytes for m in manifests),
            ntensors=sum(len(m.tensors) for m in manifests),
            format=first.format,
            metadata={k: v for k, v in first.metadata.items() if not k.startswith(LAYER_METADATA_PREFIX)},
            world_size=first.world_size, rank=None if whole else first.rank,
        )


def check_json(value: Any, what: str) -> str:
    """Serialise user metadata to JSON text, or raise TypeError naming ``what``."""
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be plain JSON data (dict, list, str, int, finite float, "
                        f"bool, None): {exc}") from None


