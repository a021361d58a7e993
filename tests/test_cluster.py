"""The cluster drill at the suite's size (tests/clusterdrill.py; the full one is
benchmarks/cluster_drill.py): two nodes of two ranks, each a network namespace set up by
docs/runbook.md's ``cluster`` blocks with ckptd from its wheel, a tiny FSDP2 job of a few
steps, a node lost and replaced, in each set-up: the bucket as the only survivor of the
lost node's shares (bucket), the peers' memory (peers), either (both). The wheel's venv and
the uninterrupted run are made once, for the three."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import clusterdrill
import netcluster

REASON = netcluster.why_not()
pytestmark = pytest.mark.slow
STEPS, KILL_AT = 7, 4  # more steps before the loss than keep_last (3) + the one in flight
ADDRESS = {"peers": "new", "bucket": "same", "both": "new"}  # the replacement's, each case run once
REF: dict[str, dict[str, str]] = {}  # the uninterrupted run's digests, from the first set-up that runs


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if REASON is not None:
        if os.environ.get("CI") == "true":  # CI runs as root: a machine without netns is its fault
            pytest.fail(f"the cluster drill cannot run: {REASON}")
        pytest.skip(f"the cluster drill needs network namespaces: {REASON}")
    return clusterdrill.wheel_venv(tmp_path_factory.mktemp("wheel"))


@pytest.mark.parametrize("setup", clusterdrill.SETUPS)
def test_a_cluster_set_up_from_the_runbook_stays_bounded_and_resumes_bit_exact(
        setup: str, venv: Path, tmp_path: Path) -> None:
    r = clusterdrill.drill(tmp_path, venv, setup, nodes=2, steps=STEPS, kill_at=KILL_AT, every=1.0,
                           addresses=(ADDRESS[setup],), ref=REF.get("ref"))
    REF["ref"] = r["ref"]
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
