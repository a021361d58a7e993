"""Replica comparison: every rank holding a copy of a replicated piece digests it, and
where a step's shares meet, the digests of one piece are compared across ranks; a copy
that differs was corrupted silently (docs/reliability.md).

One rank writes a replicated piece; the others record a digest of their own copy in
their manifests (``replica_digests``). Digests are ``xxh3_64`` on the CPU or
``words64``, an exact integer kernel run where the tensor lives (``digest_function``).
Start at ``start`` (the producer's side) and ``mismatches`` (the reader's).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Protocol, Sequence

import xxhash

if TYPE_CHECKING:
    from .records import Shard, TensorRecord

log = logging.getLogger("ckptd.replicas")

POLICIES = ("off", "warn", "refuse")
XXH3 = "xxh3_64"
WORDS64 = "words64"
FUNCTIONS = (XXH3, WORDS64)
K = 0x9E3779B97F4A7C15  # the golden ratio's 64 bits: odd
_MASK = (1 << 64) - 1
_BLOCK = 1 << 20
_DEVICE_BACKENDS = ("nccl", "xccl", "hccl", "mccl", "cncl", "ucc")


def digest_function() -> str:
    """The function this run's replicas are digested with, the same on every rank
    without communicating: ``words64`` where the default process group's backend is an
    accelerator's (NCCL and its kind: the state lives on devices, which digest it in
    place), else ``xxh3_64`` (gloo, or no process group: the state is in host memory)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend()).lower()
        if any(b in backend for b in _DEVICE_BACKENDS):
            return WORDS64
    return XXH3


def digest(value: Any, function: str) -> Any:
    """The digest of ``value``'s bytes (a torch tensor or numpy array) under
    ``function``: an int for ``xxh3_64``; for ``words64``, a 0-dim int64 tensor on the
    tensor's device (``finish`` turns it into an int once read, so that a GPU's kernels
    run on without a host sync per tensor)."""
    if function == XXH3:
        return xxhash.xxh3_64_intdigest(_host_bytes(value))
    if function == WORDS64:
        return words64_sum(_torch_bytes(value))
    raise ValueError(f"unknown replica digest function {function!r}; one of {', '.join(FUNCTIONS)}")


def finish(function: str, raw: int, nbytes: int) -> str:
    """``"<function>:<16 hex>"`` of a digest ``digest`` gave (read back to an int)."""
    value = raw & _MASK
    if function == WORDS64:
        value = _splitmix64(value ^ nbytes)
    return f"{function}:{value:016x}"


def words64_sum(b: Any) -> Any:
    """``sum(s_i * (2i+1) * K) mod 2**64`` over ``b`` (a flat uint8 torch tensor) read as
    little-endian signed 32-bit words ``s_i``, the last zero-padded: a 0-dim int64
    tensor on ``b``'s device. Integer ops only (exact, wrapping): the same value on every
    device. 32-bit words in 64-bit sums: a flip of bit k < 32 of word i adds ``±2**k * C_i``,
    never 0 (C_i odd), and two flips cancel only in words 2**32 apart (16 GiB)."""
    import torch

    n = b.numel()
    whole = n - n % 4
    if n % 4:
        tail = torch.zeros(4, dtype=torch.uint8, device=b.device)
        tail[: n - whole] = b[whole:]
        b = torch.cat((b[:whole], tail))
    elif b.storage_offset() % 4:
        b = b.clone()  # int32 words must start at a multiple of 4 bytes
    words = b.view(torch.int32)
    base = _multipliers(b.device, min(_BLOCK, words.numel()))
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, words.numel(), _BLOCK):
        block = words[start:start + _BLOCK].to(torch.int64)
        # word start+j's multiplier (2(start+j)+1)K = base_j + 2*start*K: one product, two sums
        total += (block * base[: block.numel()]).sum()
        if start:
            total += block.sum() * _signed((2 * start * K) & _MASK)
    return total


_MULTIPLIERS: dict[Any, Any] = {}


def _multipliers(device: Any, n: int) -> Any:
    """``(2j+1) * K mod 2**64`` for j < n, as int64 on ``device`` (kept per device)."""
    import torch

    have = _MULTIPLIERS.get(device)
    if have is None or have.numel() < n:
        j = torch.arange(max(n, 1), dtype=torch.int64, device=device)
        have = (j * 2 + 1) * _signed(K)
        _MULTIPLIERS[device] = have
    return have


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _splitmix64(x: int) -> int:
    x = (x + K) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _host_bytes(value: Any) -> Any:
    """A buffer of ``value``'s bytes in host memory, without a copy where it is one
    already (a CPU tensor or numpy array in C order)."""
    if hasattr(value, "detach"):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # xxh3 on a device tensor: a run on gloo with a GPU tensor (docs/training.md)
        t = t.contiguous().reshape(-1)
        import torch

        return memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""
    import numpy as np

    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


def _torch_bytes(value: Any) -> Any:
    import torch

    if not hasattr(value, "detach"):
        value = torch.from_numpy(__import__("numpy").ascontiguousarray(value))
    t = value.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8, device=t.device)


def piece_key(name: str, shard: "Shard | None") -> str:
    """The key a holder's digest of a piece is kept under: the tensor's name, with the
    piece's offsets where it is a piece of a sharded tensor (HSDP: each replicate group
    holds another piece of one parameter)."""
    if shard is None:
        return name
    return f"{name}@{','.join(str(int(o)) for o in shard.offsets)}"


def tensor_of(key: str) -> str:
    """The tensor name of a ``piece_key``."""
    head, at, tail = key.rpartition("@")
    return head if at and all(p.isdigit() for p in tail.split(",")) else key


def digest_pieces(pieces: Iterable[tuple[str, Any, "Shard | None"]], function: str) -> dict[str, str]:
    """``{piece_key: "<function>:<hex>"}`` of ``(name, local tensor, shard)``: the
    replicated pieces a rank holds, as they are now."""
    return read_back(launch(pieces, function), function)


def launch(pieces: Iterable[tuple[str, Any, "Shard | None"]], function: str) -> dict[str, tuple[Any, int]]:
    """Digest each piece: ``{piece_key: (raw digest, nbytes)}``; a words64 digest is a
    device tensor still being computed, read by ``read_back``."""
    return {piece_key(name, shard): (digest(value, function), _nbytes(value)) for name, value, shard in pieces}


def read_back(raw: dict[str, tuple[Any, int]], function: str) -> dict[str, str]:
    """``launch``'s digests as ``"<function>:<hex>"``: words64's read to the host once per
    device, all at once (8 bytes a piece)."""
    values = {key: v for key, (v, _) in raw.items()}
    if function == WORDS64 and raw:
        import torch

        by_device: dict[Any, list[str]] = {}
        for key, t in values.items():
            by_device.setdefault(t.device, []).append(key)
        for keys in by_device.values():
            values.update(zip(keys, torch.stack([values[k] for k in keys]).cpu().tolist()))
    return {key: finish(function, int(values[key]), nbytes) for key, (_, nbytes) in raw.items()}


class Pending:
    """The digests of a save: ``result()`` waits for them. Digests that ``save`` started
    before its copies (``future``, ``launched``) are taken at its commit, before it
    returns; ``later`` ones (``start``) are taken by ``then`` after it returned."""

    def __init__(self, future: Future | None = None, launched: dict[str, tuple[Any, int]] | None = None,
                 later: "tuple[list[Any], list[int], str] | None" = None) -> None:
        self._future, self._launched, self._later = future, launched, later

    @property
    def later(self) -> bool:
        return self._later is not None

    def result(self) -> dict[str, str]:
        """The digests; none (the step is then not compared, and a warning says why) if
        they could not be taken: a save is never failed for its comparison."""
        try:
            if self._later is not None:
                return _unchanged(*self._later)
            if self._future is not None:
                return self._future.result()
            return read_back(self._launched or {}, WORDS64)
        except Exception as exc:
            log.warning("replica digests not taken, this step's replicas will not be compared: %s: %s",
                        type(exc).__name__, exc)
            return {}

    def then(self, send: Callable[[dict[str, str]], None]) -> Future:
        """Take the digests on the digest thread and hand them to ``send`` there; the
        next optimizer step of this process waits until they have been read
        (``settle``). The Future is done once ``send`` returned."""
        global _reading
        _hook_optimizers()
        with _idle:
            _reading += 1

        def job() -> None:
            global _reading
            try:
                found = self.result()
            finally:
                with _idle:
                    _reading -= 1
                    _idle.notify_all()
            send(found)
        return _executor().submit(job)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_idle = threading.Condition()
_reading = 0
_hooked = False


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-digest")
        return _pool


def settle() -> None:
    """Wait until no digest ``then`` took over is still reading a caller's tensors."""
    with _idle:
        _idle.wait_for(lambda: _reading == 0)


def _hook_optimizers() -> None:
    """Every torch optimizer's ``step`` first waits for ``settle``: the step changes the
    parameters and optimizer state in place that a digest may still be reading."""
    global _hooked
    with _pool_lock:
        if _hooked:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: settle())
        _hooked = True


def start(shared: "dict[str, tuple[Any, Shard | None]]", policy: str,
          written: Container[str] = ()) -> Pending | None:
    """The digests ``save`` sends with its commit: of the replicated pieces this rank
    holds (``producer.sharded.Plan.shared``) and, under words64, also of those it
    writes (``written``: their names); None ("off", or nothing to digest).

    Under xxh3 the pieces this rank writes are not digested: the daemon's checksum of
    each tensor it writes is the xxh3_64 of exactly the staged bytes, the same function
    over the same bytes, and ``mismatches`` takes the writer's digest from its record.
    The others' copies are digested after ``save`` returned (``Pending.then``), beside
    the training steps that follow, never on the training thread; a piece changed in
    place before it was read (its version counter moved) is left out of the step's
    comparison. Where a piece has no version counter (a numpy array, an inference
    tensor) they are digested during ``save`` instead, which waits for them. words64
    is another function than the checksum, so every holder, the writer too, launches
    it here, on the caller's thread and stream, in order with its work, and reads it
    back at the commit, after the copies were queued: the device computes it meanwhile."""
    if policy == "off" or not shared:
        return None
    function = digest_function()
    pieces = [(name, value, shard) for name, (value, shard) in shared.items()
              if function == WORDS64 or name not in written]
    if not pieces:
        return None
    if function == WORDS64:
        try:
            return Pending(launched=launch(pieces, function))
        except Exception as exc:  # as Pending.result: the save goes on, uncompared, and says so
            log.warning("replica digests not taken, this step's replicas will not be compared: %s: %s",
                        type(exc).__name__, exc)
            return None
    versions = _versions(pieces)
    if versions is not None:
        return Pending(later=(pieces, versions, function))
    return Pending(future=_executor().submit(digest_pieces, pieces, function))


def _versions(pieces: list[Any]) -> list[int] | None:
    """Each piece's in-place version counter; None where one has none."""
    try:
        return [int(value._version) for _, value, _ in pieces]
    except (AttributeError, RuntimeError):  # numpy arrays; inference tensors track no versions
        return None


def _unchanged(pieces: list[Any], versions: list[int], function: str) -> dict[str, str]:
    """``digest_pieces`` of the pieces still at ``versions``; one changed in place since
    its save is left out (its copy is no longer the one saved), and a warning says so."""
    out, moved = {}, []
    for (name, value, shard), version in zip(pieces, versions):
        raw = digest(value, function)
        if value._version != version:
            moved.append(name)
            continue
        out[piece_key(name, shard)] = finish(function, raw, _nbytes(value))
    if moved:
        log.warning("replicated tensors changed in place after save returned, before their digest was taken: "
                    "%s; not compared this step (change them only in an optimizer's step, which waits for "
                    "the digests, or once the save's handle is done)", ", ".join(moved[:5]))
    return out


def _nbytes(value: Any) -> int:
    if hasattr(value, "element_size"):
        return int(value.numel() * value.element_size())
    return int(value.nbytes)


@dataclass(frozen=True)
class Mismatch:
    """One piece whose copies disagree: ``ranks`` differ from the majority (every
    holder where there is none, e.g. two copies).

    ``holders``: rank -> its digest"""

    key: str
    ranks: list[int]
    holders: dict[int, str]

    @property
    def tensor(self) -> str:
        return tensor_of(self.key)


class ManifestView(Protocol):
    """What the comparison reads of one rank's ``manifest.Manifest``."""

    @property
    def run(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def host(self) -> str | None: ...

    @property
    def tensors(self) -> dict[str, TensorRecord]: ...

    @property
    def replica_digests(self) -> dict[str, str]: ...

    @property
    def compare_replicas(self) -> str | None: ...


def mismatches(manifests: "Sequence[ManifestView]") -> list[Mismatch] | None:
    """The pieces of a complete step whose copies disagree, across the ranks' manifests;
    None where no two ranks digested a piece (nothing was compared)."""
    holders: dict[str, dict[int, str]] = {}
    for m in manifests:
        for key, value in m.replica_digests.items():
            holders.setdefault(key, {})[m.rank] = value
    _add_writers(manifests, holders)
    out: list[Mismatch] = []
    compared = False
    for key, by_rank in holders.items():
        if len(by_rank) < 2:
            continue
        compared = True
        found = _odd_ones(by_rank)
        if found:
            out.append(Mismatch(key, found, by_rank))
    return out if compared else None


def _add_writers(manifests: "Sequence[ManifestView]", holders: dict[str, dict[int, str]]) -> None:
    """Add to ``holders`` the digest of each xxh3-digested piece's writer, which digests
    none of the pieces it writes (``start``): its record's checksum, the xxh3_64 of
    exactly the bytes it wrote, in the same ``"xxh3_64:<16 hex>"``. Only where every
    other holder's digest is xxh3's too: a words64 run's writer digests its pieces
    itself, and one whose digests failed is left out rather than miscompared."""
    prefix = XXH3 + ":"
    for m in manifests:
        for name, record in m.tensors.items():
            by_rank = holders.get(piece_key(record.tensor_name(name), record.shard))
            if by_rank is None or m.rank in by_rank or not record.checksum.startswith(prefix):
                continue
            if all(v.startswith(prefix) for v in by_rank.values()):
                by_rank[m.rank] = record.checksum


def _odd_ones(by_rank: dict[int, str]) -> list[int]:
    """The ranks whose digest differs from the majority's; every rank when there is no
    single most common digest (two copies that differ, or a tie)."""
    counts = Counter(by_rank.values()).most_common()
    if len(counts) == 1:
        return []
    if counts[0][1] == counts[1][1]:
        return sorted(by_rank)
    return sorted(r for r, d in by_rank.items() if d != counts[0][0])


def diverged(manifests: "Sequence[ManifestView]") -> dict[str, list[int]] | None:
    """``CheckpointInfo.diverged`` of a step: ``{tensor: [ranks differing from the
    majority]}``, ``{}`` when every compared copy agrees, None when none was compared."""
    found = mismatches(manifests)
    if found is None:
        return None
    out: dict[str, set[int]] = {}
    for mm in found:
        out.setdefault(mm.tensor, set()).update(mm.ranks)
    return {name: sorted(ranks) for name, ranks in sorted(out.items())}


def refused(manifests: "Sequence[ManifestView]", diverged_: dict[str, list[int]] | None) -> bool:
    """A step saved under ``compare_replicas = "refuse"`` whose replicas disagree: kept,
    never picked without an explicit step."""
    return bool(diverged_) and any(m.compare_replicas == "refuse" for m in manifests)


def describe(manifests: "Sequence[ManifestView]") -> list[str]:
    """One line per piece whose copies disagree, naming the tensor, the ranks that
    differ and the hosts they ran on, and the ranks that agree (for a log and ``verify``)."""
    found = mismatches(manifests) or []
    hosts = {m.rank: m.host or "?" for m in manifests}
    lines = []
    for mm in found:
        others = sorted(set(mm.holders) - set(mm.ranks))

        def who(ranks: list[int]) -> str:
            return ", ".join(f"rank {r} (host {hosts.get(r, '?')}, {mm.holders[r]})" for r in ranks)

        against = f" differ from {who(others)}" if others else " all differ (no majority)"
        piece = f" (its piece at offsets [{mm.key[len(mm.tensor) + 1:]}])" if mm.key != mm.tensor else ""
        lines.append(f"replicas of tensor {mm.tensor!r}{piece} disagree: {who(mm.ranks)}{against}")
    return lines


def report(manifests: "Sequence[ManifestView]", info: Any) -> int:
    """Log a completed step's disagreeing replicas at ERROR, one line each (``info``: its
    CheckpointInfo, with ``diverged`` set); return how many tensors disagree."""
    first = manifests[0]
    what = ("refused: kept, never the latest nor loaded without its step" if info.refused
            else "kept as any other step (compare_replicas = \"warn\")")
    for line in describe(manifests):
        log.error("run=%s step=%d: %s", first.run, first.step, line)
    log.error("run=%s step=%d: replicated tensors differ across ranks (silent data corruption on the ranks "
              "named?): %s; the step is %s", first.run, first.step,
              ", ".join(f"{name} on ranks {ranks}" for name, ranks in info.diverged.items()), what)
    return len(info.diverged)
