"""The cluster drill at the suite's size (tests/clusterdrill.py; the full one is
benchmarks/cluster_drill.py): two nodes of two ranks, each a network namespace set up by
docs/runbook.md's ``cluster`` blocks with ckptd from its wheel, a tiny FSDP2 job, a node
lost and replaced, in each set-up: the bucket as the only survivor of the lost node's
shares (bucket), the peers' memory (peers), either (both). Every node's disk and peer
memory is checked against keep_last's bounds at every sample, and the resumed job's last
step against the uninterrupted run's, bit for bit. The wheel's venv (cached for this
source tree), the fork server the jobs fork from and the uninterrupted run are made
once, for the three."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

import clusterdrill
import netcluster

REASON = netcluster.why_not()
pytestmark = pytest.mark.slow
STEPS, KILL_AT = 6, 4  # step 5, the loss's, past keep_last (3) + the one in flight; one step after the resume
ADDRESS = {"peers": "new", "bucket": "same", "both": "new"}  # the replacement's, each case run once
REF: dict[str, dict[str, str]] = {}  # the uninterrupted run's digests, from the first set-up that runs


@pytest.fixture(scope="module")
def drill_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The wheel's venv and the socket of its fork server."""
    if REASON is not None:
        if os.environ.get("CI") == "true":  # CI runs as root: a machine without netns is its fault
            pytest.fail(f"the cluster drill cannot run: {REASON}")
        pytest.skip(f"the cluster drill needs network namespaces: {REASON}")
    base = tmp_path_factory.getbasetemp()
    cache = next((p for p in (base, *base.parents) if p.name.startswith("pytest-of-")), base)
    venv = clusterdrill.cached_wheel_venv(cache)
    folder = Path(tempfile.mkdtemp(prefix="ckdf", dir="/tmp"))  # a socket path holds at most 107 bytes
    server, sock = clusterdrill.fork_server(venv, folder)
    yield venv, sock
    server.terminate()
    server.wait(30)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("setup", clusterdrill.SETUPS)
def test_a_cluster_set_up_from_the_runbook_stays_bounded_and_resumes_bit_exact(
        setup: str, drill_env: tuple[Path, str], tmp_path: Path) -> None:
    venv, forks = drill_env
    r = clusterdrill.drill(tmp_path, venv, setup, nodes=2, steps=STEPS, kill_at=KILL_AT, every=0.5,
                           addresses=(ADDRESS[setup],), ref=REF.get("ref"), forks=forks)
    REF["ref"] = r["ref"]
    print(f"{setup}: {r['seconds']} s, by phase {r['times']}, each launch {r['jobs']}")
    samples = r["samples"]
    nodes = {1, 2} | ({3} if ADDRESS[setup] == "new" else set())
    assert {s.node for s in samples} == nodes, "every node, the replacement too, is sampled"
    (case,) = r["cases"]
    problems = [f"the resumed run differs from the uninterrupted one: {d}" for d in case["differ"]]
    if case["newest_when_lost"] < 1:
        problems.append("`ckptd latest` on the survivor finds no complete step once the node is lost")
    # uploads and copies in flight at the loss may complete a newer step before the relaunch
    newest, handed = case["newest_when_lost"], case["handed_over_when_lost"]
    if len(case["resumed_from"]) != 1 or not newest <= case["resumed_from"][0] <= handed:
        problems.append(f"every rank resumes from one step, at least the survivors' newest ({newest}) and at most "
                        f"the last handed over ({handed}): resumed from {case['resumed_from'] or 'nothing (started over)'}")
    kinds: dict[str, list[str]] = {}  # one line for each bound, with its first sample past it
    for v in r["violations"]:
        kinds.setdefault(re.sub(r"\d+", "N", v), []).append(v)
    problems += [f"past a bound (keep_last = 3) at {len(vs)} sample(s), first: {vs[0]}" for vs in kinds.values()]
    assert problems == [], f"{setup}: {len(r['violations'])} of {len(samples)} samples past a bound\n" \
        + "\n".join(problems)
