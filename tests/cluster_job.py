"""examples/fsdp2_torchrun.py as the cluster drill runs it: the same job (its arguments,
its output), with ``DRILL_PACE`` seconds before each step, the time a real step takes,
in which the daemons copy the step before to their peers (tests/clusterdrill.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fsdp2_torchrun as example  # noqa: E402  (examples/ is on sys.path above)

PACE = float(os.environ.get("DRILL_PACE", "0"))
unpaced = example.batch


def paced(step: int):  # type: ignore[no-untyped-def]
    time.sleep(PACE)
    return unpaced(step)


if __name__ == "__main__":
    example.batch = paced
    example.main()
