"""Snapshots under the cached save plan: successive saves of tensors updated in place
store each save's own values, across plan hits and misses. (In other asynchronous
checkpointers, steps that came out bit-identical to the first one were a real failure:
a reused destination, a copy skipped because nothing "changed" but the values.)"""

from __future__ import annotations

import torch

import ckptd
from ckptd.state import flatten

from test_fastpaths import shm_daemon
from test_plan import assert_loads, optimizer_like


def plan_uses(p: ckptd.Producer) -> int:
    return sum(plan.uses for plan in p._stager.save_plans)


def test_saves_through_the_cached_plan_store_each_saves_values(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(8)}, **optimizer_like(300, 0)}
    saved: dict[int, dict[str, torch.Tensor]] = {}
    by_plan: list[bool] = []
    with d.producer(staging_size="32MiB") as p:
        def save_then_update() -> None:
            step = len(saved) + 1
            saved[step] = {k: v.clone() for k, v in flatten(state)[1].items()}
            uses = plan_uses(p)
            handle = p.save(state, step)
            by_plan.append(plan_uses(p) > uses)
            for t in flatten(state)[1].values():
                t.mul_(1.5).add_(step)  # in place, at once: the next save's values, never this one's
            handle.wait(30)

        for _ in range(3):  # a miss (the first save plans), then hits
            save_then_update()
        state["model"]["extra"] = torch.randn(5)  # a new layout: a miss, then hits of its plan
        for _ in range(3):
            save_then_update()
        del state["model"]["extra"]  # the first layout again: its plan, kept, is hit
        save_then_update()
        assert p.stats()["transport"] == "shm"
    assert by_plan == [False, True, True, False, True, True, True]
    for step, values in saved.items():
        assert_loads(d, step, values)
    w = [ckptd.load("t", step, root=d.root)["model"]["w"] for step in saved]
    for i in range(len(w)):
        for j in range(i + 1, len(w)):
            assert not torch.equal(w[i], w[j]), f"steps {i + 1} and {j + 1} hold the same values"
