"""Where things live under the checkpoint root (DESIGN §4)."""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"step-(\d{12})")
MANIFEST = re.compile(r"manifest-r(\d{5})\.json")
CHUNK = re.compile(r"r(\d{5})-(\d{6})\.safetensors")
H5 = re.compile(r"r(\d{5})\.h5")  # format = "hdf5": one file per rank and step
WRITING = re.compile(r"r(\d{5})\.writing")  # "this host is writing rank N here"


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def manifest_name(rank: int) -> str:
    return f"manifest-r{rank:05d}.json"


def chunk_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}.safetensors"


def h5_name(rank: int) -> str:
    return f"r{rank:05d}.h5"


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
    if name.startswith(".") and name.endswith(".tmp"):  # .<name>~<host>-<pid>.tmp (durable.replacing)
        return is_ckptd_file(name[1:-4].split("~", 1)[0])
    return file_rank(name) is not None


def ensure_real_dir(path: Path, root: Path) -> None:
    """Create ``path`` (and parents up to ``root``) refusing to pass through a symlink,
    so that nothing is ever written outside the root (DESIGN §7.4)."""
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


def read_latest_pointer(run_dir: Path, default: int) -> int:
    """The step named by ``<run>/latest``, or ``default`` when it is missing or invalid."""
    try:
        text = (run_dir / "latest").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return default
    step = parse_step_dir(text)
    return default if step is None else step
