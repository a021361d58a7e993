"""Where things live under the checkpoint root (docs/format.md), and how to reach them
without ever following a symlink planted below the root (docs/reliability.md).

The root itself may be a symlink (``/ckpt -> /mnt/nvme``): the configuration
names it. Below it, run folders, step folders and every file ckptd reads or
removes are opened with ``O_NOFOLLOW``, relative to their parent's descriptor,
so a symlink in their place is refused rather than followed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

STEP_DIR = re.compile(r"step-(\d{12})")
MANIFEST = re.compile(r"manifest-r(\d{5})\.json")
# each format's data file names: one place, read by manifests, clean-up and export
CHUNK_SUFFIX = ".safetensors"
H5_SUFFIX = ".h5"
CHUNK = re.compile(r"r(\d{5})-(\d{6})" + re.escape(CHUNK_SUFFIX))
# hdf5: r<rank>-<step>.h5 is the r<rank>.h5 of an earlier step, linked here under one name so its external links resolve
H5 = re.compile(r"r(\d{5})(?:-\d{12})?" + re.escape(H5_SUFFIX))
WRITING = re.compile(r"r(\d{5})\.writing")


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def manifest_name(rank: int) -> str:
    return f"manifest-r{rank:05d}.json"


def chunk_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}{CHUNK_SUFFIX}"


def h5_name(rank: int) -> str:
    return f"r{rank:05d}{H5_SUFFIX}"


def h5_link_name(rank: int, step: int) -> str:
    """The r<rank>.h5 written at ``step``, linked into a later step folder (daemon.reuse)."""
    return f"r{rank:05d}-{step:012d}{H5_SUFFIX}"


def is_data_file(name: str) -> bool:
    """A file a manifest may name: a chunk file or an HDF5 file."""
    return bool(CHUNK.fullmatch(name) or H5.fullmatch(name))


def writing_marker(rank: int) -> str:
    return f"r{rank:05d}.writing"


def file_rank(name: str) -> int | None:
    """The rank a ckptd file in a step folder belongs to."""
    m = MANIFEST.fullmatch(name) or CHUNK.fullmatch(name) or H5.fullmatch(name) or WRITING.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dir(root: Path, run: str, step: int) -> Path:
    return root / run / step_dir_name(step)


def parse_step_dir(name: str) -> int | None:
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def is_ckptd_file(name: str) -> bool:
    """A name ckptd itself writes inside a step folder (manifests, chunks, temp files)."""
    if name.startswith(".") and name.endswith(".tmp"):
        return is_ckptd_file(name[1:-4].split("~", 1)[0])
    return file_rank(name) is not None


def ensure_real_dir(path: Path, root: Path) -> None:
    """Create ``path`` (and parents up to ``root``) refusing to pass through a symlink,
    so that nothing is ever written outside the root (docs/reliability.md)."""
    rel = path.relative_to(root)
    current = root
    for part in rel.parts:
        current = current / part
        try:
            os.mkdir(current, 0o755)
        except FileExistsError:
            pass
        if current.is_symlink() or not current.is_dir():
            raise OSError(f"{current} is not a real directory (a symlink or a file); refusing to write there")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in a file's place must not hang the reader
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_real_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of folder ``path`` (relative to ``dir_fd`` if given), for
    ``dir_fd``-relative use; a symlink or a file in its place is an ``OSError``
    that says so. Only the last component is checked: open a chain one by one."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _not_real(path, dir_fd, exc, "folder") from None


def open_step_dir(step_path: Path) -> int:
    """A descriptor of ``<root>/<run>/<step>``, refusing a symlink at the run or the
    step level (the root itself may be one)."""
    run_fd = open_real_dir(step_path.parent)
    try:
        return open_real_dir(step_path.name, dir_fd=run_fd)
    except OSError as exc:
        raise OSError(exc.errno, f"{step_path}: {exc.strerror}") from None
    finally:
        os.close(run_fd)


def open_regular(name: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``name``; a symlink, FIFO, device or
    folder in its place is an ``OSError`` that says what it is."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _not_real(name, dir_fd, exc, "file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{name} is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(name: str | os.PathLike[str], limit: int, *, dir_fd: int | None = None) -> bytes:
    """The whole of a regular file no larger than ``limit`` bytes; nothing is read
    or allocated beyond ``limit`` (a sparse file may claim terabytes)."""
    fd = open_regular(name, dir_fd=dir_fd)
    try:
        return read_limited(fd, name, limit)
    finally:
        os.close(fd)


def read_limited(fd: int, name: str | os.PathLike[str], limit: int) -> bytes:
    """``read_small`` of a file already open (``name`` only for messages)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise OSError(errno.EFBIG, f"{name} is {size} bytes, more than the {limit} allowed")
    chunks = []
    total = 0
    while total <= limit:
        data = os.read(fd, min(limit + 1 - total, 1 << 20))
        if not data:
            break
        chunks.append(data)
        total += len(data)
    if total > limit:
        raise OSError(errno.EFBIG, f"{name} is more than the {limit} bytes allowed")
    return b"".join(chunks)


def _not_real(path: str | os.PathLike[str], dir_fd: int | None, exc: OSError, what: str) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
        try:
            mode = os.lstat(path, dir_fd=dir_fd).st_mode
        except OSError:
            mode = None
        if mode is not None and stat.S_ISLNK(mode):
            return OSError(errno.ELOOP, f"{path} is a symlink; ckptd never follows symlinks below "
                                        "the checkpoint root (docs/reliability.md)")
        if mode is not None:
            return OSError(exc.errno, f"{path} is {_kind(mode)}, not a {what}")
    return OSError(exc.errno, f"{path}: {exc.strerror}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


LATEST = "latest"
_POINTER_LIMIT = 4096


def read_latest_pointer(run_dir: Path, default: int) -> int:
    """The step named by ``<run>/latest``, or ``default`` when it is missing or invalid
    (or not a regular file: a symlink or FIFO there is ignored, never followed)."""
    try:
        text = read_small(run_dir / LATEST, _POINTER_LIMIT).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return default
    step = parse_step_dir(text)
    return default if step is None else step
