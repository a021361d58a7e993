"""The tier contract (``ckptd.tiers.base``): every tier answers the same verbs the same
way: the local root, the bucket (a real SeaweedFS), the peers (real daemons) and a
folder tier of this file (``FolderTier``, a second implementation in a few lines)."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ckptd import index, layout
from ckptd.config import load as load_config
from ckptd.manifest import CheckpointInfo
from ckptd.tiers import bucket, landing
from ckptd.errors import TierUnavailable
from ckptd.tiers.base import Tier
from ckptd.tiers.files import read_tensors
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer_reader import PeerTier
from conftest import Daemon, free_port
from test_peer import _held, _save, _wait

RUN = "job"


class FolderTier:
    """Steps in another folder laid out as a root; ``reachable`` False: out of reach."""

    name, where, durable, poll_interval = "folder", "in a folder", True, 0.1

    def __init__(self, source: Path, base: Path) -> None:
        self.source, self.base, self.reachable = source, base, True

    def _folder(self, run: str, step: int) -> Path:
        if not self.reachable:
            raise TierUnavailable(f"{self.source} is out of reach")
        return layout.step_dir(self.source, run, step)

    def steps(self, run: str) -> list[CheckpointInfo]:
        found = index.scan_run(self._folder(run, 0).parent)
        return [dataclasses.replace(found[s], tiers=(self.name,)) for s in sorted(found)]

    def latest(self, run: str) -> CheckpointInfo | None:
        return (self.steps(run) or [None])[-1]

    def open(self, run: str, step: int) -> Any:
        manifests = index.read_manifests(self._folder(run, step))
        return None if manifests is None else FolderHolding(self._folder(run, step), self.base, manifests)

    def completion(self, run: str, step: int, world_size: int | None) -> tuple[Any, Callable[[float], str]]:
        return index.step_info(self._folder(run, step)), lambda s: f"step {step} not complete {self.where}"


class FolderHolding:
    where = "in a folder"

    def __init__(self, source: Path, base: Path, manifests: list) -> None:
        self.source, self.base, self.manifests = source, base, manifests
        self.path = layout.step_dir(base, manifests[0].run, manifests[0].step)

    def read(self, manifest: Any, records: dict, into: Any = None, **opts: Any) -> dict:
        return read_tensors(self.source, records, verify=True, into=into)

    def materialize(self, ranks: Any = None) -> None:
        for m in [self.manifests[r] for r in (range(len(self.manifests)) if ranks is None else ranks)]:
            def files(folder: Path, m: Any = m) -> Any:
                for f in m.files:
                    landing.write_file(folder / f, functools.partial(shutil.copyfile, self.source / f))
                return m
            landing.land(self.base, m.run, m.step, m.rank, files)


@dataclass
class Case:
    tier: Tier
    base: Path  # the reading node's root
    saved: dict[int, torch.Tensor]  # step -> rank 0's "w"
    out_of_reach: Callable[[], Tier]


def _folder_case(tmp_path: Path) -> Case:
    d = Daemon(tmp_path / "writer").start()
    try:
        saved = _save(d, range(1, 3))
    finally:
        d.cleanup()
    (tmp_path / "node").mkdir()
    tier = FolderTier(d.root, tmp_path / "node")

    def away() -> Tier:
        tier.reachable = False
        return tier
    return Case(tier, tmp_path / "node", saved, away)


def _local_case(tmp_path: Path) -> Case:
    d = Daemon(tmp_path / "writer").start()
    try:
        saved = _save(d, range(1, 3))
    finally:
        d.cleanup()
    return Case(LocalTier(d.root), d.root, saved, lambda: LocalTier(tmp_path / "unmounted"))


def _bucket_case(tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Case:
    request.getfixturevalue("s3")
    url = "s3://ckptd/contract"
    d = Daemon(tmp_path / "writer", tables={"remote": {"url": url}}).start()
    try:
        saved = _save(d, range(1, 3))
        monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
        cfg = load_config(d.config)
        _wait(lambda: [i.step for i in bucket.open_tier(cfg, d.root, None).steps(RUN)] == [1, 2], "uploaded", 60)
    finally:
        d.cleanup()
    (tmp_path / "node").mkdir()

    def away() -> Tier:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens there
        return bucket.open_tier(cfg, tmp_path / "node", None)  # type: ignore[return-value]
    return Case(bucket.open_tier(cfg, tmp_path / "node", None), tmp_path / "node", saved, away)  # type: ignore[arg-type]


def _peer_case(tmp_path: Path, request: pytest.FixtureRequest) -> Case:
    a_, b_, c_ = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    a = Daemon(tmp_path / "a", tables={"peer": {"listen": a_, "peers": [b_], "timeout": "1s"}})
    b = Daemon(tmp_path / "b", tables={"peer": {"listen": b_, "peers": [a_], "timeout": "1s"}})
    c = Daemon(tmp_path / "c", tables={"peer": {"listen": c_, "peers": [a_, b_], "timeout": "1s"}})
    request.addfinalizer(lambda: [n.cleanup() for n in (a, b)])
    a.start()
    b.start()
    saved = _save(a, range(1, 3))
    _wait(lambda: _held(b).get((2, 0)) == "memory", "A's newest share held by B")
    c.root.mkdir()
    dead = Daemon(tmp_path / "d", tables={"peer": {"listen": c_, "peers": [f"tcp://127.0.0.1:{free_port()}"],
                                                   "timeout": "1s"}})
    return Case(PeerTier(load_config(c.config), c.root), c.root, saved,
                lambda: PeerTier(load_config(dead.config), c.root))


@pytest.fixture(params=["folder", "local", "bucket", "peer"])
def case(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    if request.param == "folder":
        return _folder_case(tmp_path)
    if request.param == "local":
        return _local_case(tmp_path)
    if request.param == "bucket":
        return _bucket_case(tmp_path, request, monkeypatch)
    return _peer_case(tmp_path, request)


def test_latest_steps_open_and_completion_agree_on_what_is_complete(case: Case) -> None:
    tier = case.tier
    info = tier.latest(RUN)
    assert info is not None and info.step == 2 and tier.name in info.tiers, info
    listed = tier.steps(RUN)
    assert listed == sorted(listed, key=lambda i: i.step)
    if listed:  # a tier that lists steps lists the newest it holds (the peers list none: they hold only the newest)
        assert listed[-1].step == info.step and {i.step for i in listed} <= {1, 2}
    for step in {info.step, *(i.step for i in listed)}:
        holding = tier.open(RUN, step)
        assert holding is not None and [m.step for m in holding.manifests] == [step]
        assert holding.path == layout.step_dir(case.base, RUN, step)
    deadline = time.monotonic() + 30
    while (done := tier.completion(RUN, info.step, 1))[0] is None:  # a copy lands after the commit
        assert time.monotonic() < deadline, done[1](30)
        time.sleep(tier.poll_interval)
    assert done[0].step == info.step and done[0].world_size == 1


def test_a_missing_step_opens_as_none_and_is_not_complete(case: Case) -> None:
    assert case.tier.open(RUN, 99) is None
    assert case.tier.open("nothing", 1) is None
    info, missing = case.tier.completion(RUN, 99, 1)
    assert info is None and "99" in missing(0.5)


def test_a_holding_reads_bit_exact_and_lands_its_shares_in_the_root(case: Case) -> None:
    holding = case.tier.open(RUN, 2)
    assert holding is not None
    m = holding.manifests[0]
    got = holding.read(m, m.tensors, verify=True)
    assert torch.equal(got["w"], case.saved[2])
    into = {"w": torch.zeros_like(case.saved[2])}
    assert holding.read(m, {"w": m.tensors["w"]}, into)["w"] is into["w"] and torch.equal(into["w"], case.saved[2])
    holding.materialize([0])
    here = LocalTier(case.base).open(RUN, 2)
    assert here is not None and here.manifests[0].tensors == m.tensors
    assert torch.equal(here.read(m, {"w": m.tensors["w"]}, verify=True)["w"], case.saved[2])
    assert not list(here.path.glob(".fetch-*")), "a lock file was left behind"


def test_a_tier_out_of_reach_raises_tier_unavailable_or_holds_nothing(case: Case) -> None:
    """Never another error: the reader catches only ``TierUnavailable``. The root and the
    peers hold nothing they cannot read; the others say they are out of reach."""
    away = case.out_of_reach()
    for verb, nothing in ((lambda: away.latest(RUN), None), (lambda: away.steps(RUN), []),
                          (lambda: away.open(RUN, 2), None)):
        try:
            assert verb() == nothing
        except TierUnavailable as exc:
            assert str(exc)


def test_copy_targets_have_the_abilities_they_use_and_no_others() -> None:
    """The daemon asks a copy target for an optional ability by its protocol: a target
    has only the methods it does something in."""
    from ckptd.tiers import base
    from ckptd.tiers.bucket import BucketTarget
    from ckptd.tiers.peer import PeerTarget

    abilities = (base.Forgets, base.Pending, base.Receives, base.Yields, base.Reports)
    has = {t: {a.__name__ for a in abilities if issubclass(t, a)} for t in (BucketTarget, PeerTarget)}
    assert has == {BucketTarget: {"Forgets", "Pending", "Receives", "Reports"}, PeerTarget: {"Forgets", "Pending", "Yields", "Reports"}}


def test_latest_over_a_chain_leaves_a_tier_out_of_reach_out_only_when_two_others_answered(tmp_path: Path) -> None:
    """Wherever the tier out of reach stands in the chain (the peers before the bucket):
    with two others answering, the newest of theirs; with one, its error."""
    from ckptd.reader.finding import _latest

    d = Daemon(tmp_path / "writer").start()
    try:
        _save(d, range(1, 3))
    finally:
        d.cleanup()
    empty, away = LocalTier(tmp_path / "empty"), FolderTier(d.root, tmp_path / "node")
    away.reachable = False
    there = FolderTier(d.root, tmp_path / "node")
    info = _latest([empty, away, there], RUN)
    assert info is not None and info.step == 2
    with pytest.raises(TierUnavailable, match="out of reach"):
        _latest([empty, away], RUN)
