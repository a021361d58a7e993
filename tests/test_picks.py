"""Each tier takes the steps its own interval picks (docs/advise.md): rank 0's pick rides
on the commit, the bucket's uploader and the peer sender skip the steps not due for
them, a notice's step goes everywhere, and a commit without a pick goes everywhere.
Real daemons, a real S3 server (SeaweedFS) and a real partner."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ckptd import measures
from ckptd.errors import CheckpointError, ProtocolError
from ckptd.manifest import Manifest
from ckptd.producer.tiering import TierPlan
from ckptd.remote import catalog
from ckptd.remote.store import Store
from ckptd.transport import wire
from conftest import Daemon, cli, free_port

URL = "s3://ckptd/picks"
FUTURE = time.time() + 10 * 365 * 86400.0


def _measured(root: Path, run: str) -> None:
    """A run's measures before its daemon reads them: a save every step of 1 s, durable
    here in 0.01 s, held by the peers 1.5 s and in the bucket 2.5 s after: the advice is
    every step for the root, every 2nd for the peers, every 3rd for the bucket (the
    in-flight floor). Timed in the future, they stay the recent ones the advice reads."""
    m = measures.empty(run)
    m["saves"] = [{"step": s, "rank": 0, "attempt": "measured", "time": FUTURE + s, "stall_s": 0.001,
                   "persist_s": 0.01} for s in range(30)]
    m["uploads"] = [{"rank": 0, "time": FUTURE, "persist_s": p, "tier": t}
                    for _ in range(150) for t, p in (("peer", 1.5), ("remote", 2.5))]
    (root / run).mkdir(parents=True)
    (root / run / measures.file_name()).write_text(json.dumps(m))


def _took(root: Path, run: str, tier: str, n: int) -> list[int]:
    """The steps whose share reached ``tier`` (the daemon's record of each, to its measures file)."""
    deadline = time.monotonic() + 30
    while True:
        m = measures.merge(measures.read(root / run), run)
        steps = sorted({u["step"] for u in m["uploads"] if u.get("tier") == tier and "step" in u})
        if len(steps) >= n or time.monotonic() > deadline:
            return steps
        time.sleep(0.1)


def _status(node: Daemon) -> dict:
    return json.loads(cli("status", "-c", str(node.config), "--json").stdout)


def _replicated(node: Daemon) -> None:
    deadline = time.monotonic() + 30
    while _status(node)["peer"]["under_replicated"]:
        assert time.monotonic() < deadline, "not replicated"
        time.sleep(0.02)


def _wait_gone(path: Path) -> None:
    deadline = time.monotonic() + 30
    while path.exists():
        assert time.monotonic() < deadline, f"{path} was not removed"
        time.sleep(0.05)


def test_the_bucket_and_the_peers_take_the_steps_their_intervals_pick(s3, tmp_path, monkeypatch) -> None:
    listens = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    holder = Daemon(tmp_path / "holder", tables={"peer": {"listen": listens[1], "peers": [listens[0]]}})
    node = Daemon(tmp_path / "node", tables={"peer": {"listen": listens[0], "peers": [listens[1]]},
                                             "remote": {"url": URL}, "advise": {"mtbf": "100s"},
                                             "retention": {"keep_last": 1}})
    _measured(node.root, "job")
    monkeypatch.setenv("CKPTD_CONFIG", str(node.config))  # the notice's save waits for the bucket
    try:
        for n in (holder, node):  # together: a start is mostly imports
            n.start(wait=False)
        for n in (holder, node):
            n.wait_ready(60)
        saved = []
        with node.producer("job") as p:
            for step in range(1, 8):
                if p.should_save(step, max_steps=1):
                    p.save({"w": torch.full((4096,), float(step))}, step).wait(30)
                    saved.append(step)
                    _replicated(node)  # a newer share supersedes one still on its way to a partner
            # retention keeps one step here, and the step the peers hold: they never hold nothing
            _wait_gone(node.root / "job" / "step-000000000005")
            assert (node.root / "job" / "step-000000000006").is_dir()
            assert _status(node)["peer"]["taken_steps"]["job"] == [2, 4, 6]
            newest = node.root / "job" / "step-000000000007" / "manifest-r00000.json"
            assert Manifest.from_json(newest.read_bytes(), str(newest)).due == ("local",)  # due for no copy
            tiers = p.advice()["tiers"]
            assert [tiers[t]["interval_steps"] for t in ("local", "peer", "remote")] == [1, 2, 3]
            p.preempt()
            assert p.should_save(11, max_steps=1000)
            p.save({"w": torch.zeros(4096)}, 11).wait(30)
        assert saved == list(range(2, 8))  # every step after the first call's plan
        want_bucket, want_peers = saved[::3] + [11], saved[::2] + [11]
        assert _took(node.root, "job", "remote", len(want_bucket)) == want_bucket
        assert _took(node.root, "job", "peer", len(want_peers)) == want_peers
        assert sorted(catalog.run_objects(Store(URL), "job")) == want_bucket
        status = _status(node)
        assert status["remote"]["taken_steps"]["job"] == want_bucket[-8:]
        assert status["remote"]["skipped_steps"] == len(saved) + 1 - len(want_bucket)
        assert status["peer"]["taken_steps"]["job"] == want_peers[-8:]
        text = cli("status", "-c", str(node.config)).stdout
        assert f"steps taken lately: job {', '.join(map(str, want_bucket))};" in text
        advise = cli("advise", "job", "--root", str(node.root)).stdout
        assert f"took steps {', '.join(map(str, want_bucket))}" in advise
        # a producer that sends no pick (older than the pick, or saving without should_save):
        # every step goes to every tier, as before, whatever the advice
        _measured(node.root, "old")
        with node.producer("old") as p:
            for step in range(1, 5):
                p.save({"w": torch.ones(1024)}, step).wait(30)
        assert _took(node.root, "old", "remote", 4) == [1, 2, 3, 4]
        assert sorted(catalog.run_objects(Store(URL), "old")) == [1, 2, 3, 4]
        # a commit naming a tier ckptd does not have fails that step, saying which
        with node.producer("bad") as p:
            p._picked = (1, ("local", "bucket"))  # as a producer of another version might send
            p._connection.advice = {"tiers": {}}
            with pytest.raises(CheckpointError, match=r"tiers: \['bucket'\] are not tier names"):
                p.save({"w": torch.ones(4)}, 1).wait(30)
            p.save({"w": torch.ones(4)}, 2).wait(30)  # the next step commits
    finally:
        for n in (node, holder):
            n.cleanup()


def test_rank_0_picks_for_every_rank() -> None:
    """Two ranks' plans with different advice: the tiers rank 0 picks, given to both (as
    the broadcast does), are both ranks' answer; a tier takes a step once its interval
    passed since the last step it took; a notice's step goes to every tier."""
    box: list[float] = []

    def rank0(v: float) -> float:
        box.append(v)
        return v

    advice0 = {"tiers": {"local": {"interval_steps": 1}, "peer": {"interval_steps": 2},
                         "remote": {"interval_steps": 3}}}
    advice1 = {"tiers": {"local": {"interval_steps": 1}, "remote": {"interval_steps": 5}}}
    p0, p1 = TierPlan(), TierPlan()
    picks = [(p0.pick(s, advice0, rank0), p1.pick(s, advice1, lambda v: box[-1])) for s in range(1, 8)]
    assert all(a == b for a, b in picks)
    assert [s for s, (a, _) in enumerate(picks, 1) if "remote" in a] == [1, 4, 7]
    assert [s for s, (a, _) in enumerate(picks, 1) if "peer" in a] == [1, 3, 5, 7]
    assert p0.took(8) == ("local", "peer", "remote") and "remote" not in p0.pick(9, advice0, rank0)
    assert TierPlan().pick(1, None, rank0) is None and TierPlan().pick(1, {"tiers": {}}, rank0) is None
    # a rank without advice per tier still takes part in the broadcast, and rank 0's pick
    assert p1.pick(10, None, rank0) is None and p0.pick(10, advice0, lambda v: box[-1]) is None
    p0.pick(12, advice0, rank0)  # the save at 10 went to every tier: the peers' next is 12
    assert p1.pick(12, None, lambda v: box[-1]) == ("local", "peer")


def test_a_pick_that_is_not_a_list_of_names_is_a_bad_message() -> None:
    for bad in ("remote", [1], ["x" * 65]):
        with pytest.raises(ProtocolError, match="field 'tiers' has a bad value"):
            wire.decode([wire.encode("commit", seq=1, step=1, ntensors=0, state="null", metadata="{}", tiers=bad)])
