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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable

import xxhash

from . import dtypes, format as formats, layout, names, replicas
from .errors import CheckpointCorrupt
from .format import FORMATS
from .records import MAX_DIMS, MAX_INT, Packed, Shard, TensorRecord, short_repr

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
PIECES_FORMAT_VERSION = 3
COMPRESSED_FORMAT_VERSION = 4
READABLE_VERSIONS = (FORMAT_VERSION, SHARDED_FORMAT_VERSION, PIECES_FORMAT_VERSION, COMPRESSED_FORMAT_VERSION)
CHECKSUM_ALGORITHM = "xxh3_64"
# keys ckptd's own layers write (ckptd.dcp): kept in the manifest, left out of the user's CheckpointInfo.metadata
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
class Manifest:
    """One rank's share of a step, as its ``manifest-r<rank>.json`` says (docs/format.md).

    ``state``: the saved structure (ckptd.state), None for emit-built steps
    ``files``: data file -> its size when committed; lets the completeness check see a file
        that is still being copied in where offsets say nothing (chunked HDF5 datasets)
    ``attempt``: the job's attempt that wrote it (ckptd.attempt); a step is complete out of
        one attempt's
    ``written_by``: replicated tensors this rank's state refers to but another rank wrote
        (JSON ``"replicas"``): name -> that rank
    ``replica_digests``, ``host``, ``compare_replicas``: replica comparison (ckptd.replicas),
        optional, older readers skip them: piece key -> ``"<function>:<hex>"`` of this rank's
        copy of each replicated piece it holds; the host it ran on, to name it when its copy
        differs; the producer's ``[producer] compare_replicas``
    ``due``: the tiers the producer's pick named this step due for (docs/advise.md),
        optional; None: every tier
    ``compression``: data file -> how the bucket stores it compressed (ckptd.remote.codec);
        only in the bucket's copy of a manifest, which then has format_version 4
    ``owner``: who owned the run where it was written (``"uid:N"`` or ``"key:Z85"``,
        daemon/owners.py), optional: a node that has not seen the run lets only them recover it"""

    run: str
    step: int
    rank: int
    world_size: int
    time: float
    tensors: dict[str, TensorRecord]
    state: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = "chunk"
    format_version: int = FORMAT_VERSION
    files: dict[str, int] = field(default_factory=dict)
    attempt: str | None = None
    written_by: dict[str, int] = field(default_factory=dict)
    replica_digests: dict[str, str] = field(default_factory=dict)
    host: str | None = None
    compare_replicas: str | None = None
    due: tuple[str, ...] | None = None
    compression: dict[str, Packed] = field(default_factory=dict)
    owner: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def unpacked(self) -> "Manifest":
        """This share as its uncompressed files hold it (a root's copy of a bucket's manifest)."""
        return replace(self, compression={}, format_version=FORMAT_VERSION) if self.compression else self

    def to_json(self) -> bytes:
        sharded = self.written_by or any(t.shard is not None for t in self.tensors.values())
        pieces = any(t.shard is not None and t.shard.tensor is not None for t in self.tensors.values())
        d = {
            "format_version": COMPRESSED_FORMAT_VERSION if self.compression else PIECES_FORMAT_VERSION if pieces else SHARDED_FORMAT_VERSION if sharded
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
        if self.written_by:
            d["replicas"] = self.written_by
        if self.replica_digests:
            d["replica_digests"] = self.replica_digests
        if self.host is not None:
            d["host"] = self.host
        if self.compare_replicas is not None:
            d["compare_replicas"] = self.compare_replicas
        if self.due is not None:
            d["due"] = list(self.due)
        if self.compression:
            d["compression"] = {file: p.to_dict() for file, p in self.compression.items()}
        if self.owner is not None:
            d["owner"] = self.owner
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
    by the C encoder (``indent=`` falls back to the slower pure-Python one)."""
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


MAX_MANIFEST_BYTES = 1 << 30
TIERS = ("local", "peer", "remote")  # the names a commit's pick may give (ckptd.tiers' NAME)
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
            raise self.fail(f"{what}field {key!r} must be {names}, not {type(value).__name__} {short_repr(value)}")
        return value

    def int_field(self, d: dict[str, Any], key: str, low: int, high: int, what: str = "") -> int:
        value = self.typed(d, key, int, what)
        if not low <= value <= high:
            raise self.fail(f"{what}field {key!r} is {short_repr(value)}, out of range {low}..{high}")
        return value

    def manifest(self, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise self.fail(f"manifest must be a JSON object, not {type(d).__name__}")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise self.fail(f"manifest format_version {short_repr(version)} is not supported by this ckptd "
                            f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade ckptd")
        run = self.typed(d, "run", str)
        if not names.RUN_ID_PATTERN.fullmatch(run):
            raise self.fail(f"run {short_repr(run)} is not a valid run id")
        step = self.int_field(d, "step", 0, names.MAX_STEP)
        world = self.int_field(d, "world_size", 1, names.MAX_WORLD_SIZE)
        rank = self.int_field(d, "rank", 0, world - 1)
        when = self.typed(d, "time", (int, float))
        try:
            when = float(when)
        except OverflowError:
            raise self.fail(f"time {short_repr(when)} is not a Unix time") from None
        fmt = d.get("format", "chunk")
        if fmt not in FORMATS:
            raise self.fail(f"format {short_repr(fmt)} is not one of {', '.join(FORMATS)}")
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise self.fail(f"metadata must be an object, not {type(metadata).__name__}")
        files = d.get("files") or {}
        if not isinstance(files, dict):
            raise self.fail(f"files must be an object, not {type(files).__name__}")
        for file, size in files.items():
            self.data_file(file, rank, fmt, "files: ")
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_INT:
                raise self.fail(f"files: the size of {file!r} is {short_repr(size)}, not a byte count")
        attempt = d.get("attempt")
        if attempt is not None and not (isinstance(attempt, str) and 0 < len(attempt) <= 1024):
            raise self.fail(f"attempt {short_repr(attempt)} is not a string of 1 to 1024 characters")
        owner = d.get("owner")
        if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= 1024):
            raise self.fail(f"owner {short_repr(owner)} is not a string of 1 to 1024 characters")
        tensors = self.typed(d, "tensors", dict)
        records = {name: self.tensor(name, t, rank, fmt) for name, t in tensors.items()}
        for name, rec in records.items():
            if rec.tensor_name(name) != name and version < PIECES_FORMAT_VERSION:
                raise self.fail(f"tensor {name!r}: its shard names tensor {rec.tensor_name(name)!r}, which "
                                f"format_version {version} does not have (a manifest with it is version "
                                f"{PIECES_FORMAT_VERSION})")
        self.no_overlaps(records)
        written_by = self.written_by(d.get("replicas") or {}, rank, world, records)
        digests, host, policy = self.comparison(d)
        packed = self.compression(d.get("compression") or {}, files)
        return Manifest(compression=packed,
                        run=run, step=step, rank=rank, world_size=world, time=when,
                        tensors=records, state=d.get("state"), metadata=metadata, format=fmt,
                        files=dict(files), format_version=version, written_by=written_by, attempt=attempt,
                        replica_digests=digests, host=host, compare_replicas=policy, due=self.due(d.get("due")),
                        owner=owner)

    def due(self, value: Any) -> tuple[str, ...] | None:
        """The optional ``due`` field: tier names, or None (every tier)."""
        if value is None:
            return None
        if not isinstance(value, list) or not all(t in TIERS for t in value):
            raise self.fail(f"due {short_repr(value)} is not a list of tier names ({', '.join(TIERS)})")
        return tuple(value)

    def compression(self, d: Any, files: dict[str, int]) -> dict[str, Packed]:
        """The bucket's compressed data files: each one of ``files``, its frames adding up."""
        if not isinstance(d, dict):
            raise self.fail(f"compression must be an object, not {type(d).__name__}")
        out = {}
        for file, entry in d.items():
            if file not in files:
                raise self.fail(f"compression: {short_repr(file)} is not one of the manifest's files")
            try:
                out[file] = Packed.parse(entry, files[file])
            except ValueError as exc:
                raise self.fail(f"compression: {file}: {exc}") from None
        return out

    def comparison(self, d: dict[str, Any]) -> tuple[dict[str, str], str | None, str | None]:
        """The optional replica comparison fields (ckptd.replicas): digests, host, policy."""
        digests = d.get("replica_digests") or {}
        if not isinstance(digests, dict):
            raise self.fail(f"replica_digests must be an object, not {type(digests).__name__}")
        for key, value in digests.items():
            function, _, hexdigits = value.partition(":") if isinstance(value, str) else ("", "", "")
            if len(key) > 4096 or function not in replicas.FUNCTIONS or not _HEX16.fullmatch(hexdigits):
                raise self.fail(f"replica_digests: {short_repr(key)}: {short_repr(value)} is not "
                                f"<{' or '.join(replicas.FUNCTIONS)}>:<16 hex digits>")
        host = d.get("host")
        if host is not None and not (isinstance(host, str) and len(host) <= 255):
            raise self.fail(f"host {short_repr(host)} is not a host name")
        policy = d.get("compare_replicas")
        if policy is not None and policy not in replicas.POLICIES:
            raise self.fail(f"compare_replicas {short_repr(policy)} is not one of {', '.join(replicas.POLICIES)}")
        return dict(digests), host, policy

    def written_by(self, d: Any, rank: int, world: int, records: dict[str, TensorRecord]) -> dict[str, int]:
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
                raise self.fail(f"replicas: tensor {name!r} names writer rank {short_repr(writer)}, not another "
                                f"rank of 0..{world - 1}")
        return dict(d)

    def data_file(self, file: Any, rank: int, fmt: str, what: str) -> str:
        # Only the names ckptd writes: no "..", no "/", no absolute path, this rank's own
        if not isinstance(file, str) or not layout.is_data_file(file):
            raise self.fail(f"{what}file {short_repr(file)} is not a ckptd data file name "
                            "(r<rank>-<seq>.safetensors, r<rank>.h5 or r<rank>-<step>.h5, inside the step folder)")
        if layout.file_rank(file) != rank:
            raise self.fail(f"{what}file {file!r} belongs to another rank than this manifest's ({rank})")
        if not formats.get(fmt).owns(file):
            raise self.fail(f"{what}file {file!r} is not a file of format {fmt!r}")
        return file

    def tensor(self, name: Any, t: Any, rank: int, fmt: str) -> TensorRecord:
        try:
            if name != names.RESERVED_NAME:  # refused when written; harmless to read (HDF5)
                names.check_name(name)
        except ValueError as exc:
            raise self.fail(f"tensor name is invalid: {exc}") from None
        what = f"tensor {name!r}: "
        if not isinstance(t, dict):
            raise self.fail(f"{what}record must be an object, not {type(t).__name__}")
        dtype = self.typed(t, "dtype", str, what)
        info = dtypes.BY_NAME.get(dtype)
        if info is None:
            raise self.fail(f"{what}dtype {short_repr(dtype)} is not one ckptd knows")
        shape = self.typed(t, "shape", list, what)
        if len(shape) > MAX_DIMS:
            raise self.fail(f"{what}shape has {len(shape)} dimensions, more than {MAX_DIMS}")
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_INT:
                raise self.fail(f"{what}shape {short_repr(shape)} holds {short_repr(n)}, not a size")
        nbytes = self.int_field(t, "nbytes", 0, MAX_INT, what)
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
                                   or not 0 <= offset <= MAX_INT - nbytes):
            raise self.fail(f"{what}offset {short_repr(offset)} is not a byte offset")
        digest = self.typed(t, "checksum", str, what)
        if not _CHECKSUM.fullmatch(digest):
            raise self.fail(f"{what}checksum {short_repr(digest)} is not {CHECKSUM_ALGORITHM}:<16 hex digits>")
        numpy = t.get("numpy", False)
        if not isinstance(numpy, bool) or (numpy and info.numpy is None):
            raise self.fail(f"{what}numpy {short_repr(numpy)} is not possible for dtype {dtype}")
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


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint, as ``latest`` and ``list`` report it: all ranks of a complete
    step. A commit handle of a multi-rank step that other ranks have not completed
    yet reports only its own rank's share: then ``rank`` says whose (else None), and
    ``nbytes``/``ntensors`` count that share alone.

    ``refused``: diverged under compare_replicas = "refuse": never picked without a step

    ``tiers``: where the step is complete: "local" (this root), "remote" (the [remote] tier), or
        both
    ``diverged``: replica comparison (docs/training.md): None where no replicas were compared (a
        share alone, "off", nothing replicated); else {tensor: [ranks whose copy differs from the
        majority]}, {} when every copy agrees"""

    run: str
    step: int
    path: str
    time: float
    nbytes: int
    ntensors: int
    format: str
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    rank: int | None = None
    tiers: tuple[str, ...] = ("local",)
    diverged: dict[str, list[int]] | None = None
    refused: bool = False

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


