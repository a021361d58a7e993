"""Retention: each rule alone and combined, through the pure planner and a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ckptd
from ckptd import CheckpointError, retention
from ckptd.config import RetentionConfig
from ckptd.manifest import CheckpointInfo
from conftest import cli  # ckptd.cli.main in this process

NOW = 1_000_000.0


def infos(steps, *, nbytes=10, metric=None, age=None):
    return [CheckpointInfo("r", s, f"/x/{s}", NOW - (age(s) if age else 0), nbytes, 1, "chunk",
                           {} if metric is None else {"metric": metric(s)}) for s in steps]


def kept(decisions):
    return [d.step for d in decisions if d.keep]


def test_no_rule_keeps_everything() -> None:
    assert kept(retention.plan(infos(range(1, 8)), RetentionConfig(), pinned=set(), now=NOW)) == list(range(1, 8))


def test_each_rule_alone() -> None:
    steps = list(range(10, 110, 10))  # 10..100
    p = lambda **kw: kept(retention.plan(infos(steps, metric=lambda s: abs(s - 42), age=lambda s: (100 - s) * 60),
                                        RetentionConfig(**kw), pinned=set(), now=NOW))
    assert p(keep_last=3) == [80, 90, 100]
    assert p(keep_every=30) == [30, 60, 90, 100]  # 100: the newest is always kept
    assert p(keep_best=2) == [40, 50, 100]  # |s-42| smallest: 40, 50
    assert p(keep_best=2, mode="max") == [90, 100]  # largest: 100 (58), 90 (48)
    assert p(keep_within=25 * 60) == [80, 90, 100]  # committed within 25 minutes
    assert p(max_bytes=35) == [80, 90, 100]  # 10 bytes each: the oldest go first


def test_rules_combine_and_pins_win() -> None:
    steps = list(range(1, 21))
    d = retention.plan(infos(steps), RetentionConfig(keep_last=2, keep_every=5), pinned={3}, now=NOW)
    assert kept(d) == [3, 5, 10, 15, 19, 20]
    reasons = {x.step: x.reasons for x in d}
    assert "pinned" in reasons[3] and "keep_every=5" in reasons[15] and "newest" in reasons[20]
    assert reasons[4] == ["no rule keeps it"]
    # max_bytes overrides the keep rules, but never a pin or the newest
    d = retention.plan(infos(steps), RetentionConfig(keep_last=5, max_bytes=25), pinned={3}, now=NOW)
    assert kept(d) == [3, 20]
    assert all("max_bytes=25" in x.reasons[0] for x in d if not x.keep and x.step >= 16)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.sets(st.integers(0, 200), min_size=1, max_size=40),
    keep_last=st.integers(0, 5), keep_every=st.integers(0, 12), keep_best=st.integers(0, 3),
    keep_within=st.sampled_from([0, 600, 3600]), max_bytes=st.sampled_from([0, 1, 50, 200]),
    pins=st.sets(st.integers(0, 200), max_size=4), mode=st.sampled_from(["min", "max"]),
)
def test_invariants_over_random_runs(steps, keep_last, keep_every, keep_best, keep_within, max_bytes, pins, mode) -> None:
    policy = RetentionConfig(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                             keep_within=keep_within, max_bytes=max_bytes, mode=mode)
    steps = sorted(steps)
    run = infos(steps, metric=lambda s: (s * 7919) % 101, age=lambda s: (max(steps) - s) * 97)
    d = {x.step: x for x in retention.plan(run, policy, pinned=pins, now=NOW)}
    assert sorted(d) == steps
    assert d[steps[-1]].keep  # the newest complete checkpoint, always
    assert all(d[s].keep for s in pins & set(steps))
    if not max_bytes:
        if policy.keeps_all:
            assert all(x.keep for x in d.values())
        for s in steps[-keep_last:] if keep_last else []:
            assert d[s].keep
        for s in steps:
            if keep_every and s % keep_every == 0:
                assert d[s].keep
            if keep_within and run[steps.index(s)].time >= NOW - keep_within:
                assert d[s].keep
    else:
        protected = sum(10 for s in steps if d[s].keep and (s == steps[-1] or s in pins))
        assert sum(10 for x in d.values() if x.keep) <= max(max_bytes, protected)
    for x in d.values():
        assert x.reasons  # every decision says why


# -- through a real daemon -------------------------------------------------------------------
def state(step):
    return {"w": torch.full((256,), float(step)), "step": step}


def test_sequence_of_commits_with_out_of_order_and_repeated_steps(make_daemon) -> None:
    d = make_daemon()
    policy = {"keep_last": 3, "keep_every": 10}
    other_policy = {"keep_last": 1}
    expected: set[int] = set()
    sequence = list(range(1, 26)) + [18, 40, 25, 12, 41]  # 18, 25, 12: out of order; 25: repeated
    with d.producer("main", retention=policy) as p, d.producer("beside", retention=other_policy) as q:
        for step in sequence:
            handle = p.save(state(step), step)
            try:
                handle.wait(30)
            except CheckpointError as exc:
                assert step in expected and "already committed" in str(exc)  # repeated: refused
            else:
                expected.add(step)
                decisions = retention.plan(
                    [CheckpointInfo("main", s, "", 0, 1, 1, "chunk") for s in expected],
                    RetentionConfig(**policy), pinned=set(), now=time.time())
                expected = set(kept(decisions))
            assert [i.step for i in ckptd.list_checkpoints("main", root=d.root)] == sorted(expected), step
            q.save(state(step), 1000 + len(expected) * 100 + step).wait(30)
            assert len(ckptd.list_checkpoints("beside", root=d.root)) == 1  # its own policy
    assert ckptd.latest("main", root=d.root).step == 41
    assert ckptd.load("main", 20, root=d.root)["step"] == 20  # a milestone
    assert "retention: removed run=main" in d.log_text()


def test_failed_commit_deletes_nothing(make_daemon) -> None:
    d = make_daemon()
    with d.producer(retention={"keep_last": 1}) as p:
        p.save(state(5), 5).wait(30)
        # an old checkpoint appears (copied in): the next successful commit's pass
        # would remove it, a failed one must not
        shutil.copytree(d.root / "t" / "step-000000000005", d.root / "t" / ".copy")
        manifest = d.root / "t" / ".copy" / "manifest-r00000.json"
        m = json.loads(manifest.read_text())
        m["step"] = 2
        manifest.write_text(json.dumps(m))
        os.rename(d.root / "t" / ".copy", d.root / "t" / "step-000000000002")
        time.sleep(1.0)  # the daemon's index sees it within a second
        with pytest.raises(CheckpointError):
            p.save(state(5), 5).wait(30)  # already committed: fails
        assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [2, 5]
        p.save(state(6), 6).wait(30)
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [6]


def test_pin_prune_and_dry_run(make_daemon, tmp_path) -> None:
    d = make_daemon()
    root = str(d.root)
    with d.producer() as p:  # no retention: everything is kept
        for step in range(1, 7):
            p.save(state(step), step).wait(30)
    assert cli("pin", "t", "2", "--root", root).returncode == 0
    conf = tmp_path / "keep2.toml"
    conf.write_text("[retention]\nkeep_last = 2\n")
    r = cli("prune", "t", "--root", root, "-c", str(conf), "--dry-run", "--json")
    plan = {x["step"]: x for x in json.loads(r.stdout)}
    assert [s for s, x in plan.items() if x["keep"]] == [2, 5, 6] and plan[2]["reasons"] == ["pinned"]
    assert [i.step for i in ckptd.list_checkpoints("t", root=root)] == [1, 2, 3, 4, 5, 6]  # dry run
    r = cli("prune", "t", "--root", root, "-c", str(conf))
    assert r.returncode == 0 and "removed" in r.stdout and "no rule keeps it" in r.stdout
    assert [i.step for i in ckptd.list_checkpoints("t", root=root)] == [2, 5, 6]
    assert not [n for n in os.listdir(d.root / "t") if n.startswith(".trash")]
    assert cli("unpin", "t", "2", "--root", root).returncode == 0
    cli("prune", "t", "--root", root, "-c", str(conf))
    assert [i.step for i in ckptd.list_checkpoints("t", root=root)] == [5, 6]
    r = cli("pin", "t", "3", "--root", root)
    assert r.returncode == 1 and "complete steps: 5, 6" in r.stderr


def test_kill_9_during_deletion_leaves_nothing_listed_and_broken(make_daemon, tmp_path) -> None:
    d = make_daemon(chunk_size="64KiB")
    big = {f"w{i}": torch.randn(2**14) for i in range(16)}  # 16 chunk files per step
    with d.producer() as p:
        for step in range(1, 41):
            p.save(big, step).wait(30)
    d.stop()
    conf = tmp_path / "keep1.toml"
    conf.write_text("[retention]\nkeep_last = 1\n")
    for delay in (0.3, 0.5, 0.7, 0.9, 1.2):
        prune = subprocess.Popen([sys.executable, "-m", "ckptd", "prune", "t", "--root", str(d.root), "-c", str(conf)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        prune.send_signal(signal.SIGKILL)
        prune.wait()
        for info in ckptd.list_checkpoints("t", root=d.root):  # listed => loads and verifies
            assert ckptd.load("t", info.step, root=d.root, verify=True).keys() == big.keys()
    assert ckptd.latest("t", root=d.root).step == 40
    d.start()  # start-up removes the trash of interrupted deletions
    assert not [n for n in os.listdir(d.root / "t") if n.startswith(".trash")]
    assert ckptd.load("t", root=d.root, verify=True).keys() == big.keys()


def test_bad_retention_override_is_refused(daemon) -> None:
    with pytest.raises(ValueError, match="keep_lats"):
        daemon.producer(retention={"keep_lats": 3})
    with pytest.raises(ValueError, match="keep_last"):
        daemon.producer(retention={"keep_last": -1})


def test_sighup_reloads_the_retention_policy(make_daemon) -> None:
    d = make_daemon()
    with d.producer() as p:
        for step in (1, 2, 3):
            p.save(state(step), step).wait(30)
        assert len(ckptd.list_checkpoints("t", root=d.root)) == 3  # no rule: all kept
        d.config.write_text(d.config.read_text() + "\n[retention]\nkeep_last = 2\n")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "retention settings reloaded" not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        p.save(state(4), 4).wait(30)
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [3, 4]
    assert d.proc.poll() is None


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.06])
def test_kill_9_of_the_daemon_during_its_retention_pass(make_daemon, delay) -> None:
    d = make_daemon(chunk_size="64KiB")
    big = {f"w{i}": torch.randn(2**14) for i in range(16)}  # 16 chunk files per step
    p = d.producer()
    for step in range(1, 13):
        p.save(big, step).wait(30)
    (d.root / "t" / "retention.json").write_text('{"keep_last": 1}')  # the next pass removes 11
    p.save(big, 13)  # commit, then kill while the pass may be running
    time.sleep(delay)
    d.kill()
    listed = ckptd.list_checkpoints("t", root=d.root)
    for info in listed:  # listed => loads and verifies
        assert ckptd.load("t", info.step, root=d.root, verify=True).keys() == big.keys()
    assert listed and listed[-1].step in (12, 13)
    d.start()
    assert not [n for n in os.listdir(d.root / "t") if n.startswith(".trash")]
    with d.producer() as q:  # (p's connection died with the daemon)
        q.save(big, 14).wait(30)  # the next pass finishes the job
    assert [i.step for i in ckptd.list_checkpoints("t", root=d.root)] == [14]
    try:
        p.close()
    except CheckpointError:
        pass  # step 13, if the kill came before its commit was acknowledged
