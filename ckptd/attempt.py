"""Which attempt of a job a producer belongs to (elastic restarts): ``current``.

A step is complete only out of manifests of one attempt (``ckptd.index``), and a new
attempt's share may replace an earlier one's of a step that never became complete. The
attempt is ``[producer] attempt`` where given; under torchrun, the run id and restart
count (with the agent's identity on one node); a one-rank job's own process; else none.
"""

from __future__ import annotations

import os
import re

from . import env

MAX_LENGTH = 200
_PATTERN = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_LENGTH)  # printable ASCII, no spaces


def check_attempt(value: str) -> str:
    """``value`` if it is a valid attempt, else ValueError saying what one looks like."""
    if not isinstance(value, str) or not _PATTERN.fullmatch(value):
        raise ValueError(f"attempt {value!r} is not 1 to {MAX_LENGTH} printable ASCII characters without spaces")
    return value


def current(explicit: str, world_size: int, elastic: env.Elastic | None) -> str | None:
    """This process's attempt (see the module's docstring); ``explicit``: the configured one,
    or ""; ``elastic``: torchrun's identity, ``env.elastic()``."""
    if explicit:
        return check_attempt(explicit)
    if elastic is not None:
        attempt = f"torchelastic:{elastic.run_id}:{elastic.restart_count}"
        if elastic.one_node:
            agent = _process(os.getppid())
            if agent is not None:
                attempt += f":agent-{agent}"
        return check_attempt(attempt[:MAX_LENGTH])
    if world_size == 1:
        me = _process(os.getpid())
        return check_attempt(f"process-{me}") if me is not None else None
    return None


def _process(pid: int) -> str | None:
    """``<boot id prefix>-<pid>-<start time>``: a process, unique across pid reuse and reboots."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return f"{boot}-{pid}-{fields[19]}" if len(fields) > 19 else None
