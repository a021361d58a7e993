"""Parsed manifests, kept by the identity of the file they were read from.

A daemon reads each manifest it writes several times (completeness, the index, its
watcher, retention). A manifest is never rewritten in place (a commit renames a new
file over it), so a file whose device, inode, size, mtime and ctime are unchanged holds
the manifest parsed before. The writer seeds its own; the newest ``LIMIT`` are kept.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from . import layout
from .manifest import MAX_MANIFEST_BYTES, Manifest

LIMIT = 64
_cache: OrderedDict[tuple[int, ...], Manifest] = OrderedDict()
_lock = threading.Lock()


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read(name: str, dir_fd: int, where: str) -> Manifest:
    """The manifest in file ``name`` of the folder ``dir_fd`` (a regular file, never
    through a symlink: ``layout.open_regular``), parsed and checked unless the same
    file was parsed before. Raises what ``open_regular`` and ``Manifest.from_json`` do."""
    fd = layout.open_regular(name, dir_fd=dir_fd)
    try:
        key = _key(os.fstat(fd))
        with _lock:
            found = _cache.get(key)
            if found is not None:
                _cache.move_to_end(key)
                return found
        data = layout.read_limited(fd, name, MAX_MANIFEST_BYTES)
    finally:
        os.close(fd)
    manifest = Manifest.from_json(data, where)
    _store(key, manifest)
    return manifest


def remember(path: str, manifest: Manifest) -> None:
    """``manifest`` is what the file at ``path`` holds (its writer just committed it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return
    _store(_key(st), manifest)


def _store(key: tuple[int, ...], manifest: Manifest) -> None:
    with _lock:
        _cache[key] = manifest
        _cache.move_to_end(key)
        while len(_cache) > LIMIT:
            _cache.popitem(last=False)
