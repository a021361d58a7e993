"""A job torchrun starts for tests/test_agree.py (gloo, CPU, 2 ranks): in each case each
rank looks for the step to resume from under a root of its own, ``OUT/<case>/r<rank>``,
which the test filled with real steps: the roots hold different newest steps, as they
do for a moment while a copy is in flight. Every lookup a resuming job makes is tried:
``latest(agree=True)``, ``load_into`` without a step, the DCP reader without one, and
``latest`` without agreeing (each rank's own answer, unchanged).

    torchrun --nproc_per_node=2 tests/agree_job.py CASES OUT

Each rank writes OUT/agree-r<rank>.json: per case and lookup, its result or its error.
In case ``failure`` rank 1's config file (CKPTD_CONFIG) is broken.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import ckptd
import ckptd.dcp

RUN = "agree"


def saved(step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s share of ``step``, as the test saves it."""
    return {"w": torch.full((4,), float(step * 10 + rank)), "step": step}


def attempt(lookup: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"value": lookup()}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def step_of(info: Any) -> int | None:
    return None if info is None else info.step


def load_into(root: Path) -> list[Any]:
    target = {"w": torch.zeros(4), "step": -1}
    info = ckptd.load_into(target, RUN, root=root)
    return [info.step, target["step"], float(target["w"][0])]


def resume(root: Path) -> Any:
    """The examples' pattern: agree on the step, then load this rank's share of it."""
    info = ckptd.latest(RUN, root=root, agree=True)
    return None if info is None else ckptd.load(RUN, info.step, root=root)["step"]


def dcp_step(root: Path) -> int | None:
    reader = ckptd.dcp.StorageReader(RUN, root=root)
    reader.read_metadata()
    return step_of(reader.info)


def one_case(out: Path, case: str, rank: int) -> dict[str, Any]:
    root = out / case / f"r{rank}"
    if case == "failure" and rank == 1:
        os.environ["CKPTD_CONFIG"] = str(out / "broken.toml")
    try:
        return {
            "own": attempt(lambda: step_of(ckptd.latest(RUN, root=root))),
            "agreed": attempt(lambda: step_of(ckptd.latest(RUN, root=root, agree=True))),
            "resume": attempt(lambda: resume(root)),
            "load_into": attempt(lambda: load_into(root)),
            "dcp": attempt(lambda: dcp_step(root)),
        }
    finally:
        os.environ.pop("CKPTD_CONFIG", None)


def main(cases: list[str], out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        results = {case: one_case(out, case, rank) for case in cases}
        (out / f"agree-r{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
