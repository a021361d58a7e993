"""The public names (docs/training.md) exist, with the documented shapes."""

from __future__ import annotations

import inspect
import subprocess
import sys

import ckptd
from ckptd import producer


def test_public_surface_is_pinned() -> None:
    assert sorted(ckptd.__all__) == sorted([
        "CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointNotFound",
        "CommitHandle", "Producer", "latest", "list_checkpoints", "load", "load_into", "producer",
    ])
    for name in ("configure", "emit", "commit", "checkpoint", "save", "flush", "latest", "wait_complete", "close"):
        assert callable(getattr(producer, name)), name
        if name != "configure":  # an instance is configured by its constructor
            assert callable(getattr(ckptd.Producer, name)), name
    assert issubclass(ckptd.CheckpointNotFound, ckptd.CheckpointError)
    assert issubclass(ckptd.CheckpointNotFound, LookupError)
    assert issubclass(ckptd.CheckpointCorrupt, ckptd.CheckpointError)
    assert list(inspect.signature(ckptd.load).parameters)[:6] == ["run", "step", "root", "names", "map_location", "verify"]
    # the manifest's fixed fields (docs/format.md) first, in order; then what tells a rank's share from the whole step
    assert [f for f in ckptd.CheckpointInfo.__dataclass_fields__] == [
        "run", "step", "path", "time", "nbytes", "ntensors", "format", "metadata", "world_size", "rank",
        "tiers",  # which tiers ("local", "remote") hold the step
        "diverged", "refused"]  # replicated tensors whose copies differ across ranks (docs/training.md)


def test_python_dash_m_is_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "ckptd", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "serve" in r.stdout


def test_module_level_producer_uses_the_environment(daemon, monkeypatch) -> None:
    import torch

    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    monkeypatch.setenv("CKPTD_RUN", "envrun")
    producer.configure(staging_size="8MiB")
    try:
        producer.save({"w": torch.ones(2)}, step=1).wait(30)
        assert producer.latest().step == 1
        with producer.checkpoint(2) as h:
            producer.emit("v", torch.zeros(3))
        producer.flush()
        assert h.done() and h.wait().step == 2
    finally:
        producer.close()
    assert [i.step for i in ckptd.list_checkpoints("envrun", root=daemon.root)] == [1, 2]
