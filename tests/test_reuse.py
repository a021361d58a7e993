"""A checkpoint costs what changed (docs/performance.md): frozen and unchanged tensors
are not written again; the new step hard-links the stored copy (ckptd.daemon.reuse).

Real daemons, real files: what is checked is what a user sees (bit-exact loads,
verify, export, safetensors and h5py reading the files) and what the disk holds
(which files share an inode, what the daemon says it wrote)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CheckpointError, cli

from test_metrics import scrape, status


def lora_state(step: int, base: dict[str, torch.Tensor]) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {"model": {**base, "lora.a": torch.randn(4096, generator=g), "lora.b": torch.randn(64, 64, generator=g)},
            "optim": {"lr": 0.1 * step}, "step": step}


def make_base(n: int = 6, numel: int = 2**18) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"base.layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def record(root: Path, step: int, name: str, rank: int = 0) -> dict:
    manifest = json.loads((root / "t" / f"step-{step:012d}" / f"manifest-r{rank:05d}.json").read_text())
    return manifest["tensors"][name]


def inode(root: Path, step: int, name: str, rank: int = 0) -> int:
    return os.stat(root / "t" / f"step-{step:012d}" / record(root, step, name, rank)["file"]).st_ino


def assert_loads(root: Path, step: int, expected: dict) -> None:
    out = ckptd.load("t", step=step, root=root, verify=True)
    for k, v in expected["model"].items():
        assert torch.equal(out["model"][k], v), (step, k)
    assert out["optim"] == expected["optim"] and out["step"] == expected["step"]


def test_frozen_base_is_linked_not_copied_and_every_step_loads(make_daemon) -> None:
    d = make_daemon(metrics="127.0.0.1:0")
    base = make_base()
    base_bytes = sum(t.nbytes for t in base.values())
    states = {}
    with d.producer() as p:
        for step in (1, 2, 3):
            states[step] = lora_state(step, base)
            p.save(states[step], step, frozen=["model.base.*"]).wait(30)
    for step in (1, 2, 3):
        assert_loads(d.root, step, states[step])
    for name in base:
        # one copy on disk: the later steps' files are links to step 1's
        assert inode(d.root, 1, f"model.{name}") == inode(d.root, 2, f"model.{name}") \
            == inode(d.root, 3, f"model.{name}")
    assert inode(d.root, 1, "model.lora.a") != inode(d.root, 2, "model.lora.a")
    figures = status(d)
    assert figures["bytes_reused"] == 2 * base_bytes
    lora_bytes = 4096 * 4 + 64 * 64 * 4
    assert figures["bytes_written"] == base_bytes + 3 * lora_bytes
    assert scrape(figures["metrics"])[("ckptd_bytes_reused_total", ())] == 2 * base_bytes
    # the step's info still counts every tensor it holds
    assert ckptd.latest("t", root=d.root).nbytes == base_bytes + lora_bytes
    _, problems = ckptd.reader.verify("t", root=d.root)
    assert problems == []


def test_frozen_tensors_are_not_even_sent(make_daemon) -> None:
    """The producer sends descriptions, not bytes: the daemon receives only the adapter."""
    d = make_daemon()
    base = make_base(numel=2**20)  # 4 MiB each: streamed tensors, which recognition cannot skip
    with d.producer() as p:
        p.save(lora_state(1, base), 1, frozen=["model.base.*"]).wait(30)
        before = status(d)["bytes_written"]
        p.save(lora_state(2, base), 2, frozen=["model.base.*"]).wait(30)
        after = status(d)
    assert after["bytes_written"] - before == 4096 * 4 + 64 * 64 * 4
    assert after["bytes_reused"] == sum(t.nbytes for t in base.values())
    assert_loads(d.root, 2, lora_state(2, base))


def test_unchanged_tensors_are_recognised_without_a_declaration(make_daemon) -> None:
    d = make_daemon(chunk_size="64MiB")
    base = make_base(n=4, numel=2**16)
    with d.producer() as p:
        for step in (1, 2, 3):
            p.save(lora_state(step, base), step).wait(30)
    name = "model.base.layer0.weight"
    # step 1's one chunk also holds the adapter, which changed: step 2 copies the unchanged
    # tensors into a file of its own, holding only them, which step 3 links whole
    assert inode(d.root, 1, name) != inode(d.root, 2, name)
    assert inode(d.root, 2, name) == inode(d.root, 3, name)
    for step in (2, 3):
        for layer in base:
            assert record(d.root, step, f"model.{layer}")["file"] == record(d.root, step, name)["file"]
        assert record(d.root, step, "model.lora.a")["file"] != record(d.root, step, name)["file"]
    base_bytes = sum(t.nbytes for t in base.values())
    assert status(d)["bytes_reused"] == base_bytes  # step 3's link; step 2's copy is written
    # a changed tensor in the same chunk is written anew, bit-exact
    for step in (1, 2, 3):
        assert_loads(d.root, step, lora_state(step, base))


def test_a_tensor_that_stops_changing_is_written_once_more_then_recognised(make_daemon) -> None:
    """A tensor that changed at its last comparison is written while its checksum is
    computed, not after (reuse.Changing): once it stops changing, it is written once
    more, found unchanged, and recognised from the next save on."""
    d = make_daemon(chunk_size="64MiB")
    base = make_base(n=2, numel=2**16)
    w = torch.zeros(2**16)
    saved = {}
    with d.producer() as p:
        for step in range(1, 7):
            if step in (2, 3):
                w.add_(1)
            state = {"model": {**base, "w": w}, "optim": {"lr": 0.1}, "step": step}
            saved[step] = {"model": {k: v.clone() for k, v in state["model"].items()}, "optim": {"lr": 0.1},
                           "step": step}
            p.save(state, step).wait(30)
    written = [inode(d.root, s, "model.w") != inode(d.root, s - 1, "model.w") for s in range(2, 7)]
    #           step 2: changed  3: changed  4: unchanged, written once more  5, 6: recognised
    assert written == [True, True, True, False, False], written
    for step in (3, 4, 5, 6):  # the base is recognised throughout
        assert inode(d.root, step, "model.base.layer0.weight") == inode(d.root, 2, "model.base.layer0.weight")
    for step in saved:
        assert_loads(d.root, step, saved[step])


def test_reuse_unchanged_off_writes_everything(make_daemon) -> None:
    d = make_daemon(chunk_size="64MiB", reuse_unchanged=False)
    base = make_base(n=2, numel=2**16)
    with d.producer() as p:
        for step in (1, 2):
            p.save(lora_state(step, base), step).wait(30)
    assert inode(d.root, 1, "model.base.layer0.weight") != inode(d.root, 2, "model.base.layer0.weight")
    assert status(d)["bytes_reused"] == 0


def test_a_frozen_tensor_changed_in_place_still_reaches_the_checkpoint(daemon) -> None:
    """frozen= is trusted only as far as torch's version counter allows."""
    base = make_base(n=2, numel=2**16)
    with daemon.producer() as p:
        p.save(lora_state(1, base), 1, frozen=["model.base.*"]).wait(30)
        saved1 = {k: v.clone() for k, v in _flat(lora_state(1, base)).items()}
        with torch.no_grad():
            base["base.layer1.weight"].mul_(2)  # declared frozen by mistake: an optimizer step
        s2 = lora_state(2, base)
        p.save(s2, 2, frozen=["model.base.*"]).wait(30)
        # a state_dict()-style detached view shares the counter, and is seen unchanged
        s3 = lora_state(3, {k: v.detach() for k, v in base.items()})
        p.save(s3, 3, frozen=["model.base.*"]).wait(30)
    assert_loads(daemon.root, 2, s2)
    assert_loads(daemon.root, 3, s3)
    assert inode(daemon.root, 1, "model.base.layer1.weight") != inode(daemon.root, 2, "model.base.layer1.weight")
    # step 1's file held both layers: step 2 holds layer0 in a file of its own (copied),
    # never a link to a file that also holds the old layer1; step 3 links both files
    assert inode(daemon.root, 1, "model.base.layer0.weight") != inode(daemon.root, 2, "model.base.layer0.weight")
    assert record(daemon.root, 2, "model.base.layer0.weight")["file"] != \
        record(daemon.root, 2, "model.base.layer1.weight")["file"]
    assert inode(daemon.root, 2, "model.base.layer0.weight") == inode(daemon.root, 3, "model.base.layer0.weight")
    assert inode(daemon.root, 2, "model.base.layer1.weight") == inode(daemon.root, 3, "model.base.layer1.weight")
    for step in (1, 2, 3):
        assert_chunk_files_hold_exactly_the_step(daemon.root, step, {1: saved1, 2: _flat(s2), 3: _flat(s3)}[step])


def test_retention_deletes_the_base_and_keeps_what_newer_steps_use(make_daemon) -> None:
    d = make_daemon()
    base = make_base()
    with d.producer(retention={"keep_last": 1}) as p:
        for step in range(1, 6):
            p.save(lora_state(step, base), step, frozen=["model.base.*"]).wait(30)
    steps = [i.step for i in ckptd.list_checkpoints("t", root=d.root)]
    assert steps == [5]
    assert not (d.root / "t" / "step-000000000001").exists()  # the step whose files held the base
    assert_loads(d.root, 5, lora_state(5, base))
    _, problems = ckptd.reader.verify("t", root=d.root)
    assert problems == []
    # pruned steps are renamed to trash at once and removed by the reaper thread at leisure
    deadline = time.monotonic() + 30
    while any(e.name.startswith(".trash-") for e in (d.root / "t").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = os.stat(d.root / "t" / "step-000000000005" / record(d.root, 5, "model.base.layer0.weight")["file"])
    assert st.st_nlink == 1  # the last name of the data; nothing else keeps it


def test_a_base_step_gone_fails_that_save_clearly_and_the_next_one_sends_again(daemon) -> None:
    base = make_base(n=2, numel=2**16)
    with daemon.producer() as p:
        p.save(lora_state(1, base), 1, frozen=["model.base.*"]).wait(30)
        shutil.rmtree(daemon.root / "t" / "step-000000000001")  # a user removes it by hand
        with pytest.raises(CheckpointError, match=r"frozen tensors cannot refer to their stored copy.*step 1"):
            p.save(lora_state(2, base), 2, frozen=["model.base.*"]).wait(30)
        p.save(lora_state(3, base), 3, frozen=["model.base.*"]).wait(30)  # sent whole again
        p.save(lora_state(4, base), 4, frozen=["model.base.*"]).wait(30)  # and linked from 3
    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [3, 4]
    assert_loads(daemon.root, 4, lora_state(4, base))
    assert inode(daemon.root, 3, "model.base.layer0.weight") == inode(daemon.root, 4, "model.base.layer0.weight")


def test_linked_chunk_files_stay_plain_safetensors_and_export(daemon, tmp_path: Path) -> None:
    from safetensors import safe_open

    base = make_base(n=2, numel=2**16)
    with daemon.producer() as p:
        for step in (1, 2):
            p.save(lora_state(step, base), step, frozen=["model.base.*"]).wait(30)
    rec = record(daemon.root, 2, "model.base.layer1.weight")
    with safe_open(str(daemon.root / "t" / "step-000000000002" / rec["file"]), "pt") as f:
        assert torch.equal(f.get_tensor("model.base.layer1.weight"), base["base.layer1.weight"])
    out = tmp_path / "x.safetensors"
    assert cli.main(["export", "t", "2", "-o", str(out), "--root", str(daemon.root)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out))
    assert torch.equal(exported["model.base.layer0.weight"], base["base.layer0.weight"])
    assert torch.equal(exported["model.lora.a"], lora_state(2, base)["model"]["lora.a"])


def test_hdf5_steps_link_the_earlier_file_and_plain_h5py_sees_every_tensor(make_daemon) -> None:
    import h5py

    d = make_daemon(format="hdf5", chunk_size="64MiB")
    base = make_base(n=3, numel=2**16)
    with d.producer() as p:
        for step in (1, 2, 3):  # layer0 declared; layers 1 and 2 unchanged, recognised
            p.save(lora_state(step, base), step, frozen=["model.base.layer0.*"]).wait(30)
    for step in (1, 2, 3):
        assert_loads(d.root, step, lora_state(step, base))
    # the HDF5 file written at step 1 has one name in every folder that links it
    for step in (2, 3):
        assert record(d.root, step, "model.base.layer2.weight")["file"] == "r00000-000000000001.h5"
        assert inode(d.root, 1, "model.base.layer2.weight") == inode(d.root, step, "model.base.layer2.weight")
        with h5py.File(d.root / "t" / f"step-{step:012d}" / "r00000.h5", "r") as f:  # the whole share, as before
            for name, t in base.items():
                assert torch.equal(torch.from_numpy(f[f"model.{name}"][...]), t)
            want = lora_state(step, base)["model"]["lora.a"]
            assert torch.equal(torch.from_numpy(f["model.lora.a"][...]), want)
    _, problems = ckptd.reader.verify("t", root=d.root)
    assert problems == []


def test_sharded_ranks_each_link_their_own_share(daemon) -> None:
    base = make_base(n=2, numel=2**16)
    producers = [daemon.producer(rank=r, world_size=2) for r in (0, 1)]
    try:
        for step in (1, 2):
            handles = [p.save(lora_state(step, base), step, frozen=["model.base.*"], replicated=True)
                       for p in producers]
            for h in handles:
                h.wait(30)
    finally:
        for p in producers:
            p.close()
    for rank in (0, 1):
        out = ckptd.load("t", step=2, root=daemon.root, rank=rank, verify=True)
        for k, v in base.items():
            assert torch.equal(out["model"][k], v)
    writers = {}
    for rank in (0, 1):
        m = json.loads((daemon.root / "t" / "step-000000000002" / f"manifest-r{rank:05d}.json").read_text())
        for name in m["tensors"]:
            writers[name] = rank
    for name in base:
        r = writers[f"model.{name}"]
        assert inode(daemon.root, 1, f"model.{name}", r) == inode(daemon.root, 2, f"model.{name}", r)


KILLER = textwrap.dedent("""
    import sys, torch
    from ckptd import Producer, CheckpointError
    endpoint, first, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    g = torch.Generator().manual_seed(7)
    base = {f"base.{i}": torch.randn(2**18, generator=g) for i in range(8)}
    p = Producer(endpoint, "t", staging_size="64MiB", timeout=60, heartbeat=0.2, retention={"keep_last": 1})
    for step in range(first, first + 1000):
        if mode == "frozen":
            state = {"base": base, "lora": torch.full((1000,), float(step))}
            kwargs = {"frozen": ["base.*"]}
        else:  # one base tensor changes at each step: its chunk's others are copied
            state = {"base": {k: v + changed(int(k[5:]), step) for k, v in base.items()},
                     "lora": torch.full((1000,), float(step))}
            kwargs = {}
        try:
            p.save(state, step, **kwargs).wait(10)
        except CheckpointError:
            break
        print(step, flush=True)
""")


KILL_ROUNDS = 4  # each costs a Python + torch start-up (the killer) and a daemon start-up


def changed(i: int, step: int) -> float:
    """The last step, up to ``step``, at which base tensor ``i`` of KILLER's "recognised" run changed."""
    return 0.0 if step < i else float(step - (step - i) % 8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen", "recognised"])
def test_kill_9_during_linked_writes_and_retention_leaves_every_listed_step_loadable(make_daemon, tmp_path: Path,
                                                                                     mode: str) -> None:
    """keep_last=1 prunes the base of each step right after the next one commits:
    kill -9 at random instants of that, again and again; with frozen= (files linked) and
    with a base that changes a tensor at each step (its chunk's other tensors copied)."""
    d = make_daemon()
    script = tmp_path / "killer.py"
    script.write_text(KILLER.replace("import sys, torch", "import sys, torch\n" + _source(changed), 1))
    g = torch.Generator().manual_seed(7)
    base = {f"base.{i}": torch.randn(2**18, generator=g) for i in range(8)}
    rng = random.Random(15)
    first = 1
    for _ in range(KILL_ROUNDS):
        child = subprocess.Popen([sys.executable, str(script), d.endpoint, str(first), mode], stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout is not None
        assert child.stdout.readline()  # one step committed in this round
        time.sleep(rng.uniform(0.0, 0.6))
        d.kill()
        child.kill()  # with it, as on a node that crashed (its own exit, once it notices, takes ~3 s)
        child.wait(30)
        d.start()  # start-up removes what the crash left
        infos = ckptd.list_checkpoints("t", root=d.root)
        assert infos, "the newest complete step is never deleted"
        for info in infos:
            out = ckptd.load("t", step=info.step, root=d.root, verify=True)
            for k, v in base.items():
                want = v if mode == "frozen" else v + changed(int(k[5:]), info.step)
                assert torch.equal(out["base"][k], want), (info.step, k)
            assert torch.equal(out["lora"], torch.full((1000,), float(info.step)))
            saved = {f"base.{k}": t for k, t in out["base"].items()} | {"lora": out["lora"]}
            assert_chunk_files_hold_exactly_the_step(d.root, info.step, saved)
        first = infos[-1].step + 1
    assert first > KILL_ROUNDS  # every round committed a step


def _source(fn: object) -> str:
    import inspect

    return inspect.getsource(fn)  # type: ignore[arg-type]


def test_a_base_file_gone_is_written_again_not_a_failed_step(make_daemon) -> None:
    """Recognition links what the base still holds; a file missing there (removed by
    hand, a disk error) means the bytes the daemon has are written after all."""
    d = make_daemon(chunk_size="64MiB")
    base = make_base(n=2, numel=2**16)
    with d.producer() as p:
        p.save(lora_state(1, base), 1).wait(30)
        step1 = d.root / "t" / "step-000000000001"
        (step1 / record(d.root, 1, "model.base.layer0.weight")["file"]).unlink()
        p.save(lora_state(2, base), 2).wait(30)
    assert_loads(d.root, 2, lora_state(2, base))
    assert "writing 'model.base.layer0.weight' again" in d.log_text()


def test_frozen_saves_and_planned_saves_of_the_same_state_mix(daemon) -> None:
    """A state saved again goes through a cached plan (producer/plan.py) that copies
    every tensor; with frozen= it goes the general way, and back."""
    base = make_base(n=3, numel=2**10)
    with daemon.producer() as p:
        for step, frozen in ((1, None), (2, None), (3, ["model.base.*"]), (4, ["model.base.*"]), (5, None),
                             (6, None)):
            p.save(lora_state(step, base), step, frozen=frozen).wait(30)
    for step in range(1, 7):
        assert_loads(daemon.root, step, lora_state(step, base))
    assert inode(daemon.root, 3, "model.base.layer0.weight") == inode(daemon.root, 4, "model.base.layer0.weight")


def test_a_bad_frozen_argument_is_a_type_error_and_nothing_is_lost(daemon) -> None:
    base = make_base(n=1, numel=2**10)
    with daemon.producer() as p:
        p.save(lora_state(1, base), 1, frozen=["model.base.*"]).wait(30)
        for bad in (5, [b"model.base.*"], {"model.base.*": True}):
            with pytest.raises(TypeError, match=r"frozen must be True or a list of fnmatch globs"):
                p.save(lora_state(2, base), 2, frozen=bad)
        p.save(lora_state(2, base), 2, frozen="model.base.*").wait(30)  # one glob as a string
    assert [i.step for i in ckptd.list_checkpoints("t", root=daemon.root)] == [1, 2]
    assert_loads(daemon.root, 1, lora_state(1, base))
    assert_loads(daemon.root, 2, lora_state(2, base))


# -- every data file of a step folder holds that step's tensors, and nothing else ----------

def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def step_manifests(root: Path, step: int, run: str = "t") -> list[dict]:
    folder = root / run / f"step-{step:012d}"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("manifest-r*.json"))]


def assert_chunk_files_hold_exactly_the_step(root: Path, step: int, expected: dict[str, torch.Tensor],
                                              run: str = "t") -> None:
    """Opened with safetensors alone, the step folder's chunk files hold every tensor of
    the step once, under its manifest key, with the value saved in that step, and nothing
    else; numpy's loader reads each file whole where no tensor is bfloat16."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    folder = root / run / f"step-{step:012d}"
    manifests = step_manifests(root, step, run)
    assert manifests, f"step {step} has no manifest"
    want = {rec["key"]: name for m in manifests for name, rec in m["tensors"].items()}
    assert set(want.values()) == set(expected), step
    seen: dict[str, str] = {}
    files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")
    assert files
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                assert key not in seen, f"step {step}: {key!r} is in {seen.get(key)} and in {path.name}"
                seen[key] = path.name
                assert key in want, f"step {step}: {path.name} holds {key!r}, which is not a tensor of the step"
                got = f.get_tensor(key)
                assert got.dtype == expected[want[key]].dtype and raw(got) == raw(expected[want[key]]), \
                    f"step {step}: {path.name} holds another value of {key!r}"
        if not any(t.dtype == torch.bfloat16 for t in expected.values()):
            assert set(load_file(str(path))) == {k for k, n in seen.items() if n == path.name}
    assert set(seen) == set(want), f"step {step}: tensors in no file: {sorted(set(want) - set(seen))}"


def assert_h5_entry_holds_exactly_the_step(root: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    """r<rank>.h5 opened with plain h5py (its external links followed) shows exactly the
    step's tensors, each with the value saved in that step."""
    import h5py

    folder = root / "t" / f"step-{step:012d}"
    (m,) = step_manifests(root, step)
    want = {rec["key"].lstrip("/"): name for name, rec in m["tensors"].items()}
    assert set(want.values()) == set(expected)
    found: dict[str, bytes] = {}
    with h5py.File(folder / "r00000.h5", "r") as f:
        def walk(group: "h5py.Group", prefix: str) -> None:
            for k in group:
                obj = group[k]  # follows an external link
                if isinstance(obj, h5py.Group):
                    walk(obj, f"{prefix}{k}/")
                else:
                    found[f"{prefix}{k}"] = obj[...].tobytes()
        walk(f, "")
    assert set(found) == set(want), step
    for key, data in found.items():
        assert data == raw(expected[want[key]]), f"step {step}: r00000.h5 shows another value of {key!r}"


def _flat(state: dict) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in state["model"].items()}


def _mixed_state(step: int, base: dict[str, torch.Tensor], with_bf16: bool) -> dict:
    """A base that does not change, small and large tensors that do, interleaved as a
    state_dict() has them; a bfloat16 tensor at step 1 only."""
    g = torch.Generator().manual_seed(2000 + step)
    model: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(base.items()):
        model[k] = v
        model[f"adapter{i}.a"] = torch.randn(100 + i, generator=g)  # changes at every step
    model["head.weight"] = torch.randn(2**17, generator=g)
    if with_bf16:
        model["bf"] = torch.randn(33, generator=g).to(torch.bfloat16)
    return {"model": model, "step": step}


@pytest.mark.parametrize("how", ["recognised", "recognised, pooled writers", "frozen, reuse off",
                                 "frozen and recognised"])
def test_every_chunk_file_of_a_step_holds_only_that_steps_tensors(make_daemon, how: str) -> None:
    d = make_daemon(chunk_size="1MiB", reuse_unchanged=how != "frozen, reuse off",
                    writer_threads=2 if "pooled" in how else 1)
    base = make_base(n=6, numel=2**16)
    frozen = None if how.startswith("recognised") else (["model.base.*"] if how == "frozen, reuse off"
                                                 else ["model.base.layer0.*", "model.base.layer1.*"])
    saved = {}
    with d.producer() as p:
        for step in (1, 2, 3, 4):
            if step == 3:
                with torch.no_grad():
                    base["base.layer0.weight"].add_(1)  # declared frozen by mistake, or just changed
                    base["base.layer4.weight"].add_(1)
            state = _mixed_state(step, base, with_bf16=step == 1)
            saved[step] = {k: v.clone() for k, v in _flat(state).items()}
            p.save(state, step, frozen=frozen).wait(30)
    for step in saved:
        assert_chunk_files_hold_exactly_the_step(d.root, step, saved[step])
        out = ckptd.load("t", step=step, root=d.root, verify=True)
        for k, v in saved[step].items():
            assert raw(out["model"][k[len("model."):]]) == raw(v), (step, k)
    # the unchanged base is still stored once, not once per step
    assert inode(d.root, 3, "model.base.layer2.weight") == inode(d.root, 4, "model.base.layer2.weight")


def test_hdf5_entry_file_shows_exactly_each_step(make_daemon) -> None:
    d = make_daemon(format="hdf5", chunk_size="1MiB")
    base = make_base(n=4, numel=2**16)
    saved = {}
    with d.producer() as p:
        for step in (1, 2, 3, 4):
            if step == 3:
                with torch.no_grad():
                    base["base.layer0.weight"].add_(1)
                    base["base.layer3.weight"].add_(1)
            state = _mixed_state(step, base, with_bf16=step == 1)
            saved[step] = {k: v.clone() for k, v in _flat(state).items()}
            p.save(state, step, frozen=["model.base.layer0.*", "model.base.layer1.*"]).wait(30)
    for step in saved:
        assert_h5_entry_holds_exactly_the_step(d.root, step, saved[step])
        out = ckptd.load("t", step=step, root=d.root, verify=True)
        for k, v in saved[step].items():
            assert raw(out["model"][k[len("model."):]]) == raw(v), (step, k)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_frozen_tensors_interleaved_with_adapters_fill_files_of_their_own(make_daemon, transport: str) -> None:
    """A state_dict() has each frozen weight beside its adapters; frozen= sends the frozen
    ones first, in chunks of their own (batched small ones too), so that every later
    step links those files whole and writes only the adapters."""
    d = make_daemon(chunk_size="1MiB", reuse_unchanged=False)
    g = torch.Generator().manual_seed(3)
    base = {f"layer{i}.{kind}": torch.randn(n, generator=g)
            for i in range(5) for kind, n in (("weight", 2**16), ("norm", 2**10))}  # 256 KiB, 4 KiB
    saved, adapter_bytes = {}, 0
    with d.producer(transport=transport) as p:
        for step in (1, 2, 3):
            gs = torch.Generator().manual_seed(step)
            model = {}
            for i in range(5):
                model[f"layer{i}.weight"], model[f"layer{i}.norm"] = base[f"layer{i}.weight"], base[f"layer{i}.norm"]
                model[f"layer{i}.lora_a"] = torch.randn(8, 64, generator=gs)
                model[f"layer{i}.lora_b"] = torch.randn(64, 8, generator=gs)
            adapter_bytes = sum(t.nbytes for k, t in model.items() if "lora" in k)
            saved[step] = {f"model.{k}": v for k, v in model.items()}
            p.save({"model": model}, step, frozen=["model.*.weight", "model.*.norm"]).wait(30)
    base_bytes = sum(t.nbytes for t in base.values())
    figures = status(d)
    assert figures["bytes_written"] == base_bytes + 3 * adapter_bytes
    assert figures["bytes_reused"] == 2 * base_bytes
    for name in base:
        assert inode(d.root, 1, f"model.{name}") == inode(d.root, 2, f"model.{name}") \
            == inode(d.root, 3, f"model.{name}")
    for step in saved:
        assert_chunk_files_hold_exactly_the_step(d.root, step, saved[step])
