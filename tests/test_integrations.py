"""The integrations' packaging: ckptd never imports a framework itself, and a missing one is
named with the extra that installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ckptd import producer

CHECK = """
import sys
import ckptd, ckptd.integrations
loaded = [m for m in ("lightning", "transformers", "accelerate") if m in sys.modules]
assert not loaded, f"import ckptd imported {loaded}"
for framework in ("lightning", "transformers", "accelerate"):
    sys.modules[framework] = None  # as if it were not installed
    try:
        __import__(f"ckptd.integrations.{framework}")
    except ImportError as exc:
        print(exc)
    else:
        raise AssertionError(f"ckptd.integrations.{framework} imported without {framework}")
"""


def test_a_missing_framework_names_the_extra_to_install() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        f"ckptd.integrations.{extra} needs the {module!r} package, which is not installed: "
        f'pip install "ckptd[{extra}]"'
        for module, extra in (("lightning.fabric.plugins.io", "lightning"), ("transformers", "transformers"),
                              ("accelerate", "accelerate"))
    ]


def test_configure_prepare_makes_staging_for_the_loops_state_before_its_first_save(daemon) -> None:
    model = torch.nn.Linear(2048, 2048)  # 16 MiB, and SGD's momentum 16 MiB more after a step
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        p = producer.configure(daemon.endpoint, "loop", rank=0, world_size=1, prepare=state)  # staging "auto"
        assert p.stats()["staging_prepared_bytes"] >= state_bytes
        producer.save(state, step=1).wait(60)
        with pytest.raises(ValueError, match="a size cannot be negative"):
            producer.configure(daemon.endpoint, "loop", rank=0, world_size=1, prepare=-1)
    finally:
        producer.close()
