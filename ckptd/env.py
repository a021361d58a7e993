"""The process environment ckptd reads, in one place and with one rule; every other
module asks here instead of reading ``os.environ``.

What a launcher sets (torchrun, Slurm's wrappers): ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, torchelastic's restart identity; what a user sets:
the ``CKPTD_*`` variables (docs/configuration.md). A number unset or empty is None; a
whole number >= 0 is that number; anything else is a ValueError naming the variable.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping


def _whole(name: str, environ: Mapping[str, str]) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"${name}={value!r} is not a whole number >= 0; unset it, or set it as "
                         "torchrun does (RANK 0..WORLD_SIZE-1, WORLD_SIZE >= 1)")
    return int(value)


def rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$RANK``, or None when unset."""
    return _whole("RANK", environ)


def world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$WORLD_SIZE``, or None when unset."""
    return _whole("WORLD_SIZE", environ)


def local_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$LOCAL_RANK`` (this rank's index on its node), or None when unset."""
    return _whole("LOCAL_RANK", environ)


def local_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$LOCAL_WORLD_SIZE`` (ranks on this node), or None when unset."""
    return _whole("LOCAL_WORLD_SIZE", environ)


def _process_group() -> object | None:
    """``torch.distributed`` when a process group is up. Looked up only if the program
    already imported it: reading the environment never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def group_rank() -> int:
    """This process's rank: the process group's when one is up, else ``$RANK``, else 0."""
    dist = _process_group()
    if dist is not None:
        return int(dist.get_rank())  # type: ignore[attr-defined]
    given = rank()
    return 0 if given is None else given


def group_world_size() -> int:
    """The job's size: the process group's when one is up, else ``$WORLD_SIZE``, else 1."""
    dist = _process_group()
    if dist is not None:
        return int(dist.get_world_size())  # type: ignore[attr-defined]
    given = world_size()
    return 1 if given is None else given


@dataclass(frozen=True)
class Elastic:
    """torchelastic's identity of this attempt of a job (docs/training.md, restarts)."""

    restart_count: str
    run_id: str
    one_node: bool  # GROUP_WORLD_SIZE is 1: every worker shares one agent process


def elastic(environ: Mapping[str, str] = os.environ) -> Elastic | None:
    """The attempt torchrun set, or None outside torchrun."""
    restart = environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    return Elastic(restart, environ.get("TORCHELASTIC_RUN_ID", "none"),
                   environ.get("GROUP_WORLD_SIZE", "1") == "1")


def _text(name: str, environ: Mapping[str, str]) -> str | None:
    return environ.get(name) or None


def run(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CKPTD_RUN``: the run id when the code names none."""
    return _text("CKPTD_RUN", environ)


def endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CKPTD_ENDPOINT``: the daemon to reach instead of the config's."""
    return _text("CKPTD_ENDPOINT", environ)


def s3_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """The S3 endpoint the remote tier uses (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``;
    "" for AWS's own), as ``ckptd install-systemd`` finds the addresses to allow."""
    return environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or ""


def config_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CKPTD_CONFIG``: the config file (``none``: built-in defaults)."""
    return _text("CKPTD_CONFIG", environ)


def root(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CKPTD_ROOT``: the checkpoint root instead of the config's."""
    return _text("CKPTD_ROOT", environ)


def failpoints(environ: Mapping[str, str] = os.environ) -> str:
    """``$CKPTD_FAILPOINTS``: faults the daemon injects, for tests (failpoints.py)."""
    return environ.get("CKPTD_FAILPOINTS", "")


def under_systemd(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a systemd service manager started this process (it sets ``INVOCATION_ID``)."""
    return bool(environ.get("INVOCATION_ID"))


def xdg(name: str, fallback: str, environ: Mapping[str, str] = os.environ) -> str:
    """An XDG base directory (``XDG_CONFIG_HOME``, ``XDG_STATE_HOME``, ``XDG_RUNTIME_DIR``),
    or ``fallback`` when unset or empty, as the XDG base directory specification says."""
    return environ.get(name) or fallback
