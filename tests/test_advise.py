"""The checkpoint interval advice (docs/advise.md): the formulas against worked values,
the inputs a real daemon measured from real saves, restarts and resumes (torchrun with a
rank killed), what it says it assumed, and ``should_save`` following the interval and
the user's bounds."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import advise, measures
from ckptd.producer.pacing import Pacer, check_bounds

import advise_agree_job
import advise_job as job
from conftest import cli as ckptd_cli  # ckptd.cli.main in this process

MIN, HOUR = 60.0, 3600.0


def advice_json(root: Path, run: str, *extra: str) -> dict:
    r = ckptd_cli("advise", run, "--root", str(root), "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for_saves(root: Path, run: str, n: int, timeout: float = 20.0) -> dict:
    """The run's measures once the daemon has written ``n`` saves to them (at most a second behind)."""
    deadline = time.monotonic() + timeout
    while True:
        m = measures.merge(measures.read(root / run), run)
        if len(m["saves"]) >= n:
            return m
        assert time.monotonic() < deadline, f"the measures of {run} hold {len(m['saves'])} saves, not {n}"
        time.sleep(0.05)


# -- the formulas ---------------------------------------------------------------------------------
def test_daly_matches_the_worked_values_of_his_paper() -> None:
    # Daly (2006): C = 5 min, R = 10 min; M = 24 h -> about 117 min, M = 6 h -> about 57 min.
    # These are the higher-order estimate's values; Young's sqrt(2CM) gives 120 and 60.
    assert round(advise.daly(5 * MIN, 24 * HOUR) / MIN) == 117
    assert round(advise.daly(5 * MIN, 6 * HOUR) / MIN) == 57
    assert advise.young(5 * MIN, 24 * HOUR) == pytest.approx(120 * MIN)
    assert advise.young(5 * MIN, 6 * HOUR) == pytest.approx(60 * MIN)
    assert advise.daly(3 * HOUR, 1 * HOUR) == 1 * HOUR  # C >= 2M: save every M
    # the restart time enters the waste, not the interval
    w = advise.waste(117 * MIN, 5 * MIN, 0.0, 10 * MIN, 24 * HOUR)
    assert w.stall == pytest.approx(5 / 117) and w.restore == pytest.approx(10 / (24 * 60))
    assert w.rework == pytest.approx((117 / 2) / (24 * 60))
    assert w.total == pytest.approx(w.stall + w.rework + w.restore) and w.dominant == "stall"


def test_the_in_flight_floor_and_what_dominates() -> None:
    assert advise.inflight_floor(persist_s=10.0, stall_s=0.5, step_s=1.0) == 10  # ceil(9.5)
    assert advise.inflight_floor(persist_s=0.1, stall_s=0.5, step_s=1.0) == 1
    # a fast save, a slow persist: the floor, not Daly, sets the interval
    a = advise.recommend(advise.Inputs(stall_s=0.01, persist_s=30.0, step_s=0.5, restore_s=5.0, mtbf_s=HOUR,
                                       failures=3))
    t = advise.daly(0.01, HOUR)
    assert t < 30 and a.interval_steps == 60 and a.interval_seconds == pytest.approx(30.0)
    # a slow resume: restore dominates what is lost
    a = advise.recommend(advise.Inputs(stall_s=0.2, persist_s=2.0, step_s=1.0, restore_s=600.0, mtbf_s=3 * HOUR,
                                       failures=5), current_steps=1000)
    assert a.interval_steps == round(advise.daly(0.2, 3 * HOUR)) and a.dominant == "restore"
    assert a.expected_waste == pytest.approx(0.2 / a.interval_seconds + (a.interval_seconds / 2 + 2.0) / (3 * HOUR)
                                             + 600.0 / (3 * HOUR))
    assert a.current is not None and a.current["interval_steps"] == 1000
    assert a.current["expected_waste"] > a.expected_waste
    # nothing measured: no advice, and no number made up
    a = advise.recommend(advise.Inputs(mtbf_s=HOUR))
    assert a.interval_seconds is None and a.expected_waste is None


def test_inputs_from_the_measures() -> None:
    m = measures.empty("r")
    m["first_seen"] = 1000.0
    # two ranks, saves every 10 steps; step time 1 s, stall 0.5 s (slowest rank) each
    for i, step in enumerate((10, 20, 30, 40)):
        for rank, (stall, persist) in enumerate(((0.5, 4.0), (0.2, 6.0))):
            m["saves"].append({"step": step, "rank": rank, "attempt": "a0", "time": 1000.0 + i * 10.5 + rank * 0.01,
                               "stall_s": stall, "persist_s": persist})
    inputs, current = measures.summarise(m, None)
    assert inputs.step_s == pytest.approx(1.0) and current == 10
    assert inputs.stall_s == 0.5 and inputs.persist_s == 6.0
    assert inputs.failures == 0 and inputs.mtbf_s == measures.DEFAULT_MTBF_S
    assert inputs.assumed == ["restore_s", "mtbf_s"] and inputs.restore_s == 6.0
    # the configured mtbf, while fewer than two failures were seen
    m["failures"].append({"attempt": "a0", "key": None, "time": 1040.0, "why": "died"})
    m["failures"].append({"attempt": "a0", "key": None, "time": 1041.0, "why": "died"})  # the same attempt
    inputs, _ = measures.summarise(m, 3 * HOUR)
    assert inputs.failures == 1 and inputs.mtbf_s == 3 * HOUR and "mtbf_s" in inputs.assumed
    inputs, _ = measures.summarise(m, None)  # no config: one failure is no rate, the built-in prior
    assert inputs.mtbf_s == measures.DEFAULT_MTBF_S and "mtbf_s" in inputs.assumed
    assert any("1 failure seen, fewer than the 2 needed" in n for n in inputs.notes)
    m["failures"].append({"attempt": "a1", "key": None, "time": 1080.0, "why": "died"})
    m["restores"] += [{"attempt": "a1", "rank": 0, "seconds": 3.0}, {"attempt": "a1", "rank": 1, "seconds": 5.0}]
    m["last_seen"] = 1100.0
    inputs, _ = measures.summarise(m, 3 * HOUR)  # two failures: measured, the config no longer used
    assert inputs.failures == 2 and inputs.mtbf_s == pytest.approx(50.0) and inputs.assumed == []
    assert inputs.restore_s == 5.0  # the slowest rank's load


def measured_run(failures: int, span: float) -> dict:
    """A run's measures: saves every 100 steps of 0.8 s (stall 0.5 s, durable in the root
    in 4 s), each share in the peers' memory 10 s and in the bucket 150 s after its commit,
    resumes of 30 s, and ``failures`` attempts that ended over ``span`` seconds."""
    m = measures.empty("r")
    m["first_seen"], m["last_seen"] = 0.0, span
    for i in range(40):
        m["saves"].append({"step": 100 * i, "rank": 0, "attempt": "a0", "time": 80.5 * i,
                           "stall_s": 0.5, "persist_s": 4.0})
        m["uploads"] += [{"step": 100 * i, "rank": 0, "persist_s": 10.0, "tier": "peer"},
                         {"step": 100 * i, "rank": 0, "persist_s": 150.0}]
    m["restores"] = [{"attempt": f"a{k}", "rank": 0, "seconds": 30.0} for k in range(1, failures + 1)]
    m["failures"] = [{"attempt": f"a{k}", "key": None, "time": span * (k + 1) / (failures + 1), "why": "died"}
                     for k in range(failures)]
    return m


def simulate(c: float, p: float, r: float, m: float, t: float, rng: random.Random, lives: int = 40_000) -> float:
    """The fraction of the wall time lost by a job that checkpoints every ``t`` seconds
    (the last ``c`` of them blocked), each checkpoint durable ``p`` after it is taken,
    whose failures come at exponential times of mean ``m`` and each cost ``r`` to
    resume from the last durable checkpoint."""
    wall = useful = 0.0
    for _ in range(lives):
        life = rng.expovariate(1.0 / m)
        wall += life
        work = life - r
        if work > 0:  # checkpoint k is taken at k·t and durable at k·t + p
            useful += max(0, math.floor((work - p) / t)) * (t - c)
    return 1.0 - useful / wall


def test_the_advice_per_tier_against_failures_drawn_from_the_measured_mtbf() -> None:
    """Each tier's interval, from its own persist and resume time: the work a seeded
    simulation of failures at the measured MTBF loses there is the model's, within 10 %."""
    a = measures.advice(measured_run(failures=6, span=6 * 2 * HOUR), None, ("local", "peer", "remote"))
    assert a["inputs"]["mtbf_s"] == pytest.approx(2 * HOUR) and "mtbf_s" not in a["inputs"]["assumed"]
    tiers = a["tiers"]
    assert [tiers[t]["protects"] for t in tiers] == ["a process crash", "a node lost", "a node lost"]
    assert [tiers[t]["persist_s"] for t in tiers] == [4.0, 10.0, 150.0]
    assert [tiers[t]["restore_s"] for t in tiers] == [30.0, 30.0, 150.0]  # a copy back from the bucket: its own
    every = [tiers[t]["interval_seconds"] for t in tiers]
    assert every == sorted(every) and advise.most_frequent(a) == every[0] == a["interval_seconds"]
    rng = random.Random(42)
    for name, t in tiers.items():
        got = simulate(a["inputs"]["stall_s"], t["persist_s"], t["restore_s"], t["mtbf_s"], t["interval_seconds"], rng)
        assert got == pytest.approx(t["expected_waste"], rel=0.10), (name, got, t)
    text = "\n".join(advise.render("r", a))
    assert "tier peer: every 106 steps (against a node lost;" in text and "tier remote: every 187 steps" in text
    # with one failure, the prior: the MTBF is assumed, and said to be
    one = measures.advice(measured_run(failures=1, span=HOUR), 5 * HOUR, ("local", "remote"))
    assert all(t["mtbf_s"] == 5 * HOUR and "mtbf_s" in t["assumed"] for t in one["tiers"].values())


# -- should_save --------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_pacer(pacer: Pacer, clock: Clock, steps: range, interval: float | None, bounds=(None, None, None, None),
              step_s: float = 1.0) -> list[int]:
    saved = []
    for step in steps:
        clock.t += step_s
        if pacer.should_save(step, interval, lambda v: v, bounds):
            saved.append(step)
    return saved


def test_should_save_follows_the_interval_and_the_bounds() -> None:
    clock = Clock()
    p = Pacer(clock)
    # no advice yet: save at once (it measures the stall and persist); then the advice, 10 s
    # at 1 s a step: every 10 steps (the call after a save plans; the one after it has a step time)
    assert run_pacer(p, clock, range(0, 1), None) == [0]
    assert run_pacer(p, clock, range(1, 45), 10.0) == [10, 20, 30, 40]
    clock = Clock()
    assert run_pacer(Pacer(clock), clock, range(0, 45), 10.0, step_s=2.0) == [5, 10, 15, 20, 25, 30, 35, 40]
    # the bounds win over the advice
    for bounds, interval, steps, want in (
            ((None, 4, None, None), 100.0, range(0, 20), [4, 8, 12, 16]),  # max_steps
            ((25, None, None, None), 10.0, range(0, 35), [25]),  # min_steps
            ((None, None, None, 3.0), 100.0, range(0, 20), [3, 6, 9, 12, 15, 18]),  # max_seconds, 1 s a step
            ((None, None, 30.0, None), 10.0, range(0, 35), [30])):  # min_seconds
        clock = Clock()
        assert run_pacer(Pacer(clock), clock, steps, interval, bounds) == want, bounds
    with pytest.raises(ValueError, match="min_steps is above max_steps"):
        check_bounds(10, 5, None, None)
    with pytest.raises(ValueError, match=r"should_save\(max_seconds=-1\): a positive number of seconds"):
        check_bounds(None, None, None, -1)


def test_every_rank_answers_as_rank_0_does() -> None:
    """Two ranks with different advice and step times: the plan that rank 0 makes, given
    to both (as the broadcast does), makes them save the same steps."""
    c0, c1 = Clock(), Clock()
    p0, p1 = Pacer(c0), Pacer(c1)
    box: list[float] = []

    def rank0(v: float) -> float:
        box.append(v)
        return v

    def rank1(v: float) -> float:
        return box[-1]

    saved0, saved1 = [], []
    for step in range(0, 60):
        c0.t += 1.0
        c1.t += 1.7
        if p0.should_save(step, 12.0, rank0, (None, None, None, None)):
            saved0.append(step)
        if p1.should_save(step, 30.0, rank1, (None, None, None, None)):
            saved1.append(step)
    assert saved0 == saved1 == [12, 24, 36, 48]


# -- a real daemon --------------------------------------------------------------------------------------
def test_advice_from_real_saves_says_what_it_assumed(make_daemon) -> None:
    # a load of run "t" by an earlier test in this process would be reported with the
    # first commit, as the resume of this run (docs/advise.md): this run never resumed
    measures.take_restored("t")
    d = make_daemon()
    with d.producer() as p:
        assert p.should_save(1)  # no advice for a new run: the first save measures
        for step in range(1, 41):
            time.sleep(0.02)
            if step % 10 == 0 or step == 1:
                p.save({"w": torch.randn(4096), "step": step}, step).wait(30)
        advice = p.advice()
    assert advice is not None and advice["inputs"]["stall_s"] is not None  # came with the commits' replies
    m = wait_for_saves(d.root, "t", 5)
    a = advice_json(d.root, "t")
    i = a["inputs"]
    assert set(i) >= {"stall_s", "persist_s", "step_s", "restore_s", "mtbf_s", "failures", "assumed"}
    assert i["failures"] == 0 and i["mtbf_s"] == measures.DEFAULT_MTBF_S
    assert i["assumed"] == ["restore_s", "mtbf_s"]  # no failure, no [advise] mtbf, no resume
    assert any("no failure seen and no [advise] mtbf" in n for n in i["notes"])
    # the step time from the saves: the time between them, less the later one's stall, over the steps
    steps = measures.by_step(m["saves"])
    assert [s["step"] for s in steps] == [1, 10, 20, 30, 40]
    want = sum(b["time"] - a_["time"] - b["stall_s"] for a_, b in zip(steps, steps[1:])) / (40 - 1)
    assert i["step_s"] == pytest.approx(want) and i["step_s"] >= 0.02
    assert a["interval_steps"] >= 1 and a["interval_seconds"] == pytest.approx(a["interval_steps"] * i["step_s"])
    assert a["current"]["interval_steps"] == 10 and 0 < a["expected_waste"] <= a["current"]["expected_waste"]
    assert a["dominant"] in ("stall", "rework", "restore") and a["tiers"]["local"]["interval_steps"] == a["interval_steps"]
    text = ckptd_cli("advise", "t", "--root", str(d.root))
    assert text.returncode == 0 and "assumed (not measured): restore_s, mtbf_s" in text.stdout
    assert "checkpoint every" in text.stdout
    # the daemon's status carries the same advice
    s = json.loads(ckptd_cli("status", "--json", "--endpoint", d.endpoint).stdout)
    assert s["advice"]["t"]["interval_steps"] == a["interval_steps"]

    # the configured mtbf is used, and named as assumed
    cfg = d.base / "advise.toml"
    cfg.write_text('[advise]\nmtbf = "3h"\n')
    a = advice_json(d.root, "t", "-c", str(cfg))
    assert a["inputs"]["mtbf_s"] == 3 * HOUR and a["inputs"]["assumed"] == ["restore_s", "mtbf_s"]
    assert ckptd_cli("advise", "nosuch", "--root", str(d.root)).stderr.startswith(
        "ckptd advise: error: no run 'nosuch' under")


def test_measures_survive_a_daemon_crash_and_come_back_with_the_welcome(make_daemon) -> None:
    d = make_daemon(metrics="127.0.0.1:0")
    with d.producer() as p:
        for step in (5, 10):
            p.save({"w": torch.randn(256)}, step).wait(30)
    wait_for_saves(d.root, "t", 2)
    from test_metrics import scrape, status

    url = status(d)["metrics"]
    samples = scrape(url)
    seconds = samples[("ckptd_advice_interval_seconds", (("run", "t"), ("tier", "local")))]
    assert seconds > 0 and samples[("ckptd_advice_failures", (("run", "t"),))] == 0
    assert ("ckptd_advice_expected_waste_ratio", (("run", "t"), ("tier", "local"))) in samples
    d.kill()  # kill -9
    assert advice_json(d.root, "t")["inputs"]["stall_s"] is not None  # offline, from the root
    d.start()
    with d.producer() as p:
        deadline = time.monotonic() + 10
        while p.advice() is None:  # the welcome (the producer connects in the background)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert p.advice()["inputs"]["stall_s"] is not None  # what the crashed daemon measured
        p.save({"w": torch.randn(256)}, 15).wait(30)
    assert [s["step"] for s in wait_for_saves(d.root, "t", 3)["saves"]] == [5, 10, 15]


@pytest.mark.slow
def test_torchrun_restarts_are_counted_and_resumes_timed(daemon, tmp_path) -> None:
    """Rank 1 is killed twice under torchrun --max-restarts=2: the advice counts 2
    failures (one per failed attempt, however many ranks died), measures the MTBF from
    them, and the restore time is the resumes' loads; should_save made both ranks save
    the same steps (rank 0's plan, broadcast over gloo)."""
    flags = tmp_path / "flags"
    flags.mkdir()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "--max-restarts=2", "--monitor-interval=0.1", str(Path(job.__file__)), daemon.endpoint,
             str(daemon.root), str(flags), "25"],
            capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:  # say where it hung: the job's output, the flags it left
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (exc.stdout, exc.stderr))[-9000:]
        pytest.fail(f"the torchrun job ran past 300 s; flags: {sorted(f.name for f in flags.iterdir())}\n{out}\n"
                    f"daemon log:\n{daemon.log_tail(60)}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert daemon.stop() == 0  # the measures are written before it exits
    # every 5 steps from the start and from each resume (should_save's min_steps and
    # max_steps, which win over the advice); the failed attempts' last steps never became complete
    assert [i.step for i in ckptd.list_checkpoints(job.RUN, root=daemon.root)] == [6, 11, 17, 23]
    assert (flags / "saves-a2-r0").read_text() == (flags / "saves-a2-r1").read_text() == "23\n"
    a = advice_json(daemon.root, job.RUN)
    i = a["inputs"]
    assert i["failures"] == 2 and "mtbf_s" not in i["assumed"] and "restore_s" not in i["assumed"]
    m = measures.merge(measures.read(daemon.root / job.RUN), job.RUN)
    assert i["mtbf_s"] == pytest.approx((m["last_seen"] - m["first_seen"]) / 2)
    assert len({f["attempt"] for f in m["failures"]}) == 2
    # R: what the resumes' loads took, as the job measured them around ckptd.load
    loads = {(a_, r): float((flags / f"load-a{a_}-r{r}").read_text()) for a_ in (1, 2) for r in (0, 1)}
    recorded = {}
    for r in m["restores"]:
        recorded.setdefault(r["attempt"], []).append(r)
    assert sorted(len(v) for v in recorded.values()) == [2, 2]  # both ranks of attempts 1 and 2
    by_attempt = sorted(recorded.values(), key=lambda v: v[0]["time"])
    for n, rs in zip((1, 2), by_attempt):
        for r in rs:
            outer = loads[(n, r["rank"])]
            assert 0 < r["seconds"] <= outer and outer - r["seconds"] < 0.25
    assert i["restore_s"] == pytest.approx(sum(max(r["seconds"] for r in rs) for rs in by_attempt) / 2)
    assert math.isfinite(a["expected_waste"]) and a["interval_steps"] >= 1


@pytest.mark.slow
def test_every_rank_of_a_gloo_group_saves_the_steps_rank_0_decides(daemon, tmp_path) -> None:
    """Two ranks, each with its own step time and (against the advice of the docs) its
    own bound: they are told to save the same steps, rank 0's, by one broadcast per plan."""
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(advise_agree_job.__file__)), daemon.endpoint, str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    told = [(tmp_path / f"saves-r{rank}").read_text() for rank in (0, 1)]
    assert told[0] == told[1]
    steps = list(map(int, told[0].split()))
    assert steps[0] == 1 and all(b - a <= 4 for a, b in zip(steps, steps[1:])) and len(steps) >= 7
    assert [i.step for i in ckptd.list_checkpoints("agreed", root=daemon.root)] == steps


def test_the_remote_tier_has_its_own_persist_time_and_interval(s3, make_daemon) -> None:
    """With [remote] (a real S3 server), the remote tier's persist time runs to each
    share's upload, and its interval and waste are its own."""
    d = make_daemon(tables={"remote": {"url": "s3://ckptd/advise"}})
    with d.producer() as p:
        for step in (10, 20, 30):
            time.sleep(0.1)
            p.save({"w": torch.randn(4096)}, step).wait(30)
    deadline = time.monotonic() + 20
    while len(measures.merge(measures.read(d.root / "t"), "t")["uploads"]) < 3:
        assert time.monotonic() < deadline, "the uploads were not recorded"
        time.sleep(0.05)
    a = advice_json(d.root, "t")
    local, remote = a["tiers"]["local"], a["tiers"]["remote"]
    assert remote["persist_s"] > local["persist_s"] == a["inputs"]["persist_s"]  # uploaded after durable here
    assert remote["interval_seconds"] >= local["interval_seconds"] and remote["expected_waste"] > a["expected_waste"]
    assert "tier remote: every" in ckptd_cli("advise", "t", "--root", str(d.root)).stdout


BYE_JOB = """
import os, sys, torch
from ckptd import Producer
p = Producer(sys.argv[1], sys.argv[2], staging_size="8MiB", timeout=10)
p.save({"w": torch.ones(8)}, 1).wait(30)
p.close()
os._exit(0)  # at once, as a process whose last line closed the producer
"""


@pytest.mark.slow
def test_a_producer_that_closes_then_exits_at_once_is_not_a_failure(daemon) -> None:
    """close() sends the bye: it was lost half the time when the process exited right
    after (taken from the queue too late, or left in libzmq's queue), and the daemon
    counted a clean end as a failure."""
    runs = [f"byes{i}" for i in range(10)]
    for five in (runs[:5], runs[5:]):  # five at once, each its own run
        jobs = [subprocess.Popen([sys.executable, "-c", BYE_JOB, daemon.endpoint, run]) for run in five]
        assert [j.wait(60) for j in jobs] == [0] * 5
    for run in runs:
        wait_for_saves(daemon.root, run, 1)
    assert daemon.stop() == 0
    log = daemon.log_text()
    assert log.count("said bye") == 10 and "died (process" not in log
    assert {advice_json(daemon.root, run)["inputs"]["failures"] for run in runs} == {0}
