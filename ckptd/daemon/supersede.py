"""A share left behind by an abandoned attempt at a step, and saving that step again.

With many nodes, a node that dies mid-step leaves the other nodes' shares of that
step committed, and the step never complete. The job resumes from the previous
complete step and saves the lost step again: each surviving rank then finds its own
old share in the way. Such a share is superseded, not refused, when it was
committed before the producer saving it now connected (a new process, so not a
duplicate save) and the step is not complete here. Its manifest is removed first
(made durable), so that the old share stops counting before any new file is
written; the new share's files then replace its files of the same name, and the
uploader replaces the bucket's copy the same way (``ckptd.remote.uploader``). A
step complete here is never superseded: a complete checkpoint is never overwritten.
"""

from __future__ import annotations

import logging
import os

from .. import index, layout
from ..durable import fsync_dir
from ..errors import CheckpointCorrupt
from .writer import Share

log = logging.getLogger("ckptd.daemon")


def supersede(share: Share, session_started: float) -> bool:
    """Retract ``share``'s old committed copy if it may be superseded (see above); False
    when it may not be (the caller refuses the step as already committed)."""
    try:
        old = index.read_share(share.dir, share.rank)
        complete = index.read_manifests(share.dir) is not None
    except (CheckpointCorrupt, OSError):
        return False
    if old is None or complete or old.time >= session_started:
        return False
    try:
        dir_fd = layout.open_step_dir(share.dir)
    except OSError:
        return False
    try:
        os.unlink(layout.manifest_name(share.rank), dir_fd=dir_fd)
        os.fsync(dir_fd)
        for file in set(old.files) | {t.file for t in old.tensors.values()}:
            try:
                os.unlink(file, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dir_fd)
    fsync_dir(share.dir)
    log.warning("run=%s step=%d rank=%d: superseding the share committed at %.3f by an earlier attempt "
                "(the step never became complete); saving it again", share.run, share.step, share.rank, old.time)
    return True
