"""The cached save plan (ckptd/producer/plan.py), for correctness: a state saved again
with the same layout takes the plan's way, and whatever changes between saves (values,
shapes, dtypes, keys, plain values, a tensor replaced) reaches the checkpoint exactly.
Real daemons, real files; speed is measured by benchmarks/limits.py, never here."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import ckptd
from ckptd.transport import wire
from ckptd.state import flatten

from test_fastpaths import shm_daemon


def optimizer_like(n: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {f"optim.state.{i}.exp_avg": torch.rand(i % 97 + 1, generator=g) for i in range(n)}


def used_plan(p: ckptd.Producer) -> bool:
    """Whether the newest plan served a save."""
    return bool(p._stager.save_plans) and p._stager.save_plans[-1].uses > 0


def assert_loads(d, step: int, expected: dict[str, object]) -> None:
    got = flatten(ckptd.load("t", step, root=d.root, verify=True))[1]  # the nested state, by name
    assert set(got) == set(expected)
    for name, want in expected.items():
        if isinstance(want, np.ndarray):
            assert isinstance(got[name], np.ndarray) and got[name].dtype == want.dtype
            np.testing.assert_array_equal(got[name], want)
        else:
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert torch.equal(got[name], want), name


def test_many_small_tensors_round_trip_through_the_plan(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state = optimizer_like(10_000, 0)
    with d.producer(staging_size="32MiB") as p:
        for step in range(1, 5):
            for i, t in enumerate(state.values()):
                t.fill_(step * 10_000 + i)  # new values every step, in place, as training does
            expected = {k: v.clone() for k, v in state.items()}
            p.save(state, step).wait(30)
            assert_loads(d, step, expected)
        assert used_plan(p)
        assert p.stats()["transport"] == "shm"


def test_an_update_right_after_save_never_reaches_the_checkpoint(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state = {"model": {"w": torch.randn(300, 300), "b": torch.randn(7)}, **optimizer_like(500, 1)}
    with d.producer() as p:
        p.save(state, 1).wait(30)
        p.save(state, 2).wait(30)
        assert used_plan(p)
        before = {k: v.clone() for k, v in flatten(state)[1].items()}
        handle = p.save(state, 3)  # by the plan
        for t in flatten(state)[1].values():
            t.add_(1.0)  # at once, before the daemon could have read a byte
        handle.wait(30)
        assert_loads(d, 3, before)


def test_shapes_dtypes_and_tensors_that_change_between_saves(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state: dict[str, object] = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(3.0).reshape(1, 3),
                                "c": torch.ones(4), "d": torch.randn(2**18), **optimizer_like(100, 2)}
    with d.producer() as p:
        p.save(state, 1).wait(30)
        p.save(state, 2).wait(30)
        assert used_plan(p)
        state["a"] = torch.arange(6.0).reshape(3, 2) + 100  # same size and rank, another shape
        state["b"] = torch.arange(3.0) + 200  # (1, 3) -> (3,): a copy would broadcast it silently
        state["c"] = torch.ones(4, dtype=torch.float64)  # another dtype
        state["d"] = torch.randn(2**18)  # replaced by another tensor of the same shape
        p.save(state, 3).wait(30)
        assert_loads(d, 3, flatten(state)[1])
        state["b"] = torch.arange(3.0).reshape(1, 3) + 300  # and back
        p.save(state, 4).wait(30)
        p.save(state, 5).wait(30)
        assert used_plan(p)
        assert_loads(d, 5, flatten(state)[1])


def test_plain_values_keys_and_metadata_follow_the_state(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with d.producer() as p:
        for step in range(1, 5):
            for group in opt.param_groups:
                group["lr"] = 0.1 / step  # a schedule: plain values change every save
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": step, "note": f"s{step}"}
            p.save(state, step).wait(30)
            loaded = ckptd.load("t", step, root=d.root)
            assert loaded["epoch"] == step and loaded["note"] == f"s{step}"
            assert loaded["optim"]["param_groups"][0]["lr"] == 0.1 / step
            assert loaded["model"]._metadata == state["model"]._metadata
            for k, v in state["model"].items():
                assert torch.equal(loaded["model"][k], v)
            for k, v in state["optim"]["state"][0].items():
                assert torch.equal(loaded["optim"]["state"][0][k], v)
        assert used_plan(p)
        state = {"model": model.state_dict(), "extra": torch.ones(2), "epoch": 9}  # a key added
        p.save(state, 9).wait(30)
        assert torch.equal(ckptd.load("t", 9, root=d.root)["extra"], torch.ones(2))
        state = {"model": model.state_dict(), "extra": 3, "epoch": 10}  # a tensor become a plain value
        p.save(state, 10).wait(30)
        assert ckptd.load("t", 10, root=d.root)["extra"] == 3


def test_numpy_arrays_and_the_inline_transport(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state: dict[str, object] = {"n": np.arange(10, dtype=np.int32), **optimizer_like(300, 3)}
    with d.producer() as p, d.producer(run="i", transport="inline") as q:
        for step in range(1, 4):
            state["n"] = np.arange(10, dtype=np.int32) * step
            for t in list(state.values())[1:]:
                t.mul_(2)
            p.save(state, step).wait(30)
            assert_loads(d, step, state)
            q.save(state, step).wait(30)
            got = ckptd.load("i", step, root=d.root)
            assert all(np.array_equal(np.asarray(got[k]), np.asarray(v)) for k, v in state.items())
        assert not used_plan(p)  # a numpy array: the general way every time
        assert q.stats()["transport"] == "inline" and not q._stager.save_plans


def test_saves_in_flight_and_a_small_arena_take_the_general_way(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state = optimizer_like(2000, 4)
    with d.producer(staging_size="2MiB") as p:  # the plan's region does not fit twice
        handles = []
        for step in range(1, 6):  # without waiting: a later save may find staging busy
            for t in state.values():
                t.add_(1)
            handles.append((p.save(state, step), {k: v.clone() for k, v in state.items()}))
        for step, (h, expected) in enumerate(handles, 1):
            h.wait(30)
            assert_loads(d, step, expected)


def test_the_plan_checks_names_as_the_general_way_does(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state = optimizer_like(50, 5)
    with d.producer() as p:
        p.save(state, 1).wait(30)
        p.save(state, 2).wait(30)
        assert used_plan(p)
        with p.checkpoint(3):
            p.emit("optim.state.0.exp_avg", torch.ones(1))
            with pytest.raises(ValueError, match="already emitted"):
                p.save(state, 3)
        p.save(state, 4).wait(30)
        assert_loads(d, 4, state)


def test_prepacked_messages_decode_as_plain_ones() -> None:
    items = [["a", "float32", [3], 12, False, 64], ["b", "int8", [], 1, False, 128]]
    plain = wire.encode("tensors", seq=5, step=7, items=items)
    packed = wire.encode_packed("tensors", wire.pack_fields(items=items), seq=5, step=7)
    assert wire.decode([packed])[0] == wire.decode([plain])[0]
    fields = dict(name="w", dtype="float32", shape=[2], nbytes=8, numpy=False, start=0, offset=4096, length=8)
    packed = wire.encode_packed("tensor", wire.pack_fields(**fields), seq=1, step=2)
    assert wire.decode([packed])[0] == wire.decode([wire.encode("tensor", seq=1, step=2, **fields)])[0]


# -- emit_many: the plan for blocks that emit the same tensors --------------------------------
def test_emit_many_reuses_a_blocks_layout_and_falls_back_when_it_changes(make_daemon) -> None:
    d = shm_daemon(make_daemon)
    state: dict[str, object] = {"a": torch.arange(6.0).reshape(2, 3), "d": torch.randn(2**18), **optimizer_like(300, 3)}
    with d.producer() as p:
        expected = {}
        for step in range(1, 9):
            if step == 4:
                state["a"] = torch.arange(6.0).reshape(3, 2)  # same bytes, another shape
            if step == 5:
                state["d"] = torch.randn(2**18).double()  # another dtype
            if step == 6:
                state["new"] = torch.ones(5)  # a name added
            if step == 7:
                del state["new"], state["optim.state.0.exp_avg"]  # names removed
            expected[step] = {**{k: v.clone() for k, v in state.items()}, "extra": torch.full((3,), float(step))}
            with p.checkpoint(step):
                assert p.emit_many(state) == list(state)
                p.emit("extra", torch.full((3,), float(step)))  # a plain emit in the same block
                for t in state.values():
                    if isinstance(t, torch.Tensor):
                        t.add_(1)  # right after emit_many: must not reach the checkpoint
            if step == 3:
                assert p._stager.many_plans[-1].uses == 2  # steps 2 and 3 by step 1's layout
        p.flush(60)
        assert p._stager.many_plans[-1].uses == 1  # step 8 by step 7's layout
        with pytest.raises(ValueError, match="already emitted in step 9"):
            with p.checkpoint(9):
                p.emit("a", torch.ones(1))
                p.emit_many(state)  # by the plan: the clash is found, the region given back
        with p.checkpoint(10):
            p.emit_many(state)  # the arena is consistent after the refusal
        with pytest.raises(TypeError, match="dict of"):
            p.emit_many([("a", torch.ones(1))], step=11)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'bad' is a object, not a torch.Tensor"):
            p.emit_many({"ok": torch.ones(2), "bad": object()}, step=11)
        p.commit(11).wait(30)
    for step in range(1, 9):
        got = ckptd.load("t", step, root=d.root, verify=True)
        assert got.keys() == expected[step].keys()
        for k, v in expected[step].items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), (step, k)
    assert ckptd.load("t", 11, root=d.root) == {}
