"""``ckptd export``: one checkpoint as one file the ecosystem reads without ckptd:
``.safetensors`` (tensors flat, the structure and metadata as JSON under the header's
``ckptd`` key), ``.h5`` (one dataset per tensor, the JSON in the root attribute) or
``.pt`` (``torch.save`` of the restored state). Every checksum is verified on the way;
the file appears whole or not at all. Start at ``export``.
"""

from __future__ import annotations

import dataclasses

import json
import os
from pathlib import Path
from typing import Any, Callable

from .. import dtypes, layout, state as state_mod
from ..config import Hdf5Config
from ..durable import replacing
from ..manifest import Manifest
from ..progress import bytes_bar
from .checks import check_structure, share_records
from ..tiers.files import read_tensors
from .finding import find, pick_rank

PT_SUFFIX = ".pt"


def export(run: str, step: int | None, out: str | os.PathLike[str], *,
           root: str | os.PathLike[str] | None = None, rank: int | None = None,
           progress: bool = False) -> Path:
    """Write checkpoint ``step`` of ``run`` (None: the newest) to ``out``; the suffix
    of ``out`` picks the format. Returns the path written. ``progress``: a bar on a
    terminal while the tensors are read. The file's mode is what the umask gives a
    new file (0644 under the usual 022), whatever the format's library would make."""
    out = Path(out)
    write = _WRITERS.get(out.suffix.lower())
    if write is None:
        raise ValueError(f"cannot export to {out}: unknown suffix {out.suffix!r}; "
                         f"name the file with one of {', '.join(SUFFIXES)}")
    if not out.parent.is_dir():
        raise ValueError(f"cannot export to {out}: folder {out.parent} does not exist")
    path, manifests = find(run, step, root)
    manifest = pick_rank(manifests, rank)
    manifest = dataclasses.replace(manifest, tensors=share_records(path, manifests, manifest), written_by={})
    check_structure(path, manifest)
    if write is _pt:  # refuse before reading gigabytes
        _check_pt(manifest)
    with bytes_bar(manifest.nbytes, f"export step {manifest.step}", enabled=progress) as advance:
        tensors = read_tensors(path, manifest.tensors, verify=True, progress=advance)
    with replacing(out) as tmp:
        write(tmp, manifest, tensors)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors makes 0600, h5py and torch.save 0644
    return out


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for a moment, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _about(manifest: Manifest) -> str:
    """What a file holds besides its tensors, as JSON (the state's structure names
    every tensor by its key in the file)."""
    return json.dumps({
        "run": manifest.run, "step": manifest.step, "rank": manifest.rank,
        "world_size": manifest.world_size, "time": manifest.time, "metadata": manifest.metadata,
        "state": manifest.state, "numpy": sorted(n for n, t in manifest.tensors.items() if t.numpy),
    }, ensure_ascii=False, allow_nan=False)


def _safetensors(tmp: Path, manifest: Manifest, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save, save_file

    refused = {}
    for t in {t.dtype for t in tensors.values()}:
        try:
            save({"probe": _empty(t)})
        except Exception:  # it raises several types for an unknown dtype
            refused[t] = [n for n, v in tensors.items() if v.dtype == t]
    if refused:
        what = "; ".join(f"{dtypes.torch_name(t)}: {', '.join(map(repr, names[:3]))}"
                         + (" ..." if len(names) > 3 else "") for t, names in refused.items())
        raise ValueError(f"safetensors cannot hold these tensors' dtypes ({what}); "
                         "export to .h5 or .pt instead")
    save_file(tensors, str(tmp), metadata={"format": "pt", "ckptd": _about(manifest)})


def _h5(tmp: Path, manifest: Manifest, tensors: dict[str, Any]) -> None:
    from ..format.hdf5 import H5Writer

    h5 = H5Writer(tmp, Hdf5Config(), attrs={"ckptd": _about(manifest)})
    try:
        for name, t in tensors.items():
            ds = h5.add(name, dtypes.lookup(manifest.tensors[name].dtype), list(t.shape))
            h5.write(ds, [_bytes(t)])
        fd = h5.close()
    except BaseException:
        h5.abort()
        raise
    os.close(fd)


def _pt(tmp: Path, manifest: Manifest, tensors: dict[str, Any]) -> None:
    import torch

    values: dict[str, Any] = dict(tensors)
    state = values if manifest.state is None else state_mod.unflatten(manifest.state, values.__getitem__)
    try:
        torch.save(state, tmp)
    except RuntimeError as exc:  # torch's writer reports a failed write (a full disk) so
        raise OSError(f"torch.save to {tmp} failed: {exc}") from None


def _check_pt(manifest: Manifest) -> None:
    arrays = sorted(n for n, t in manifest.tensors.items() if t.numpy)
    if '"npscalar"' in json.dumps(manifest.state):
        raise ValueError("the state holds numpy scalars, which torch.load(weights_only=True) refuses to load; "
                         "export to .safetensors or .h5, or store them as Python numbers (.item())")
    if arrays:
        raise ValueError(
            f"the state holds numpy arrays ({', '.join(map(repr, arrays[:3]))}{' ...' if len(arrays) > 3 else ''}), "
            "which torch.load(weights_only=True) refuses to load; export to .safetensors or .h5, "
            "or save them as torch tensors"
        )


def _empty(dtype: Any) -> Any:
    import torch

    return torch.empty(0, dtype=dtype)


def _bytes(t: Any) -> memoryview:
    """A tensor's bytes (read_tensors gives contiguous tensors over their own buffers)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_WRITERS: dict[str, Callable[[Path, Manifest, dict[str, Any]], None]] = {
    layout.CHUNK_SUFFIX: _safetensors, layout.H5_SUFFIX: _h5, PT_SUFFIX: _pt,
}
SUFFIXES = tuple(_WRITERS)
