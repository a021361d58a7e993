"""Flatten a nested training state into named tensors plus a JSON structure, and back.

``save(state)`` splits ``{"model": sd, "optim": osd, "epoch": 3}`` into tensors named by
their key path (``model.layers.0.weight``, as DCP names them) and a structure of plain
JSON with tagged nodes (``{"dict": ...}``, ``{"tensor": name}``, ``{"bytes": base64}``;
docs/format.md lists them), so loading never executes anything. Start at ``flatten``
and ``unflatten``.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from typing import Any, Callable, Iterator

from . import dtypes


def flatten(state: Any) -> tuple[Any, dict[str, Any]]:
    """Return ``(structure, {name: tensor or ndarray})`` for a nested state."""
    tensors: dict[str, Any] = {}
    structure = encode(state, (), tensors)
    return structure, tensors


def unflatten(structure: Any, lookup: Callable[[str], Any]) -> Any:
    """Rebuild the state; ``lookup(name)`` returns each tensor or array."""
    return _decode(structure, lookup)


def tensor_names(structure: Any) -> Iterator[str]:
    """Names referenced by a structure, in order."""
    if isinstance(structure, dict):
        for tag in ("tensor", "ndarray"):
            if tag in structure:
                yield structure[tag]
                return
        for tag in ("list", "tuple"):
            if tag in structure:
                for item in structure[tag]:
                    yield from tensor_names(item)
                return
        if "dict" in structure:
            for _, item in structure["dict"]:
                yield from tensor_names(item)


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _where(path: tuple[Any, ...]) -> str:
    return f"state[{']['.join(repr(p) for p in path)}]" if path else "the state"


def encode(value: Any, path: tuple[Any, ...], tensors: dict[str, Any]) -> Any:
    """The structure node of ``value`` found at ``path``; its tensors and arrays go into
    ``tensors`` by name (``flatten`` is this from the root; a save plan encodes a
    state's plain values with it, producer/plan.py)."""
    import numpy as np
    import torch

    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_)):
        return _encode_scalar(value, path)  # before float: np.float64 is a float
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.Tensor):
        return {"tensor": _claim(path, value, tensors)}
    if isinstance(value, np.ndarray):
        return {"ndarray": _claim(path, value, tensors)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtypes.torch_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Size):  # before tuple: Size is a tuple
        return {"size": list(value)}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        tag = "list" if type(value) is list else "tuple"
        return {tag: [encode(v, path + (i,), tensors) for i, v in enumerate(value)]}
    if type(value) in (dict, OrderedDict):
        return _encode_dict(value, path, tensors)
    raise TypeError(
        f"{_where(path)} is a {type(value).__module__}.{type(value).__qualname__}, which ckptd "
        "cannot store without pickling; store tensors, numpy arrays, containers "
        "(dict, list, tuple) and plain values (None, bool, int, float, str, bytes)"
    )


def _encode_scalar(value: Any, path: tuple[Any, ...]) -> Any:
    """A numpy scalar (``np.float32(0.5)``, common in metrics) as its dtype and its
    exact bytes, so it loads back as the same type with the same bits."""
    d = dtypes.BY_NUMPY.get(value.dtype.name)
    if d is None or value.dtype.hasobject:
        raise TypeError(f"{_where(path)} is a numpy {value.dtype} scalar, which ckptd cannot store; "
                        "convert it with .item()")
    native = value.astype(value.dtype.newbyteorder("="))
    return {"npscalar": value.dtype.name, "data": base64.b64encode(native.tobytes()).decode("ascii")}


def _encode_dict(value: dict, path: tuple[Any, ...], tensors: dict[str, Any]) -> Any:
    items = []
    for key, item in value.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(
                f"{_where(path)} has a key {key!r} of type {type(key).__name__}; "
                "dict keys must be str or int"
            )
        items.append([key, encode(item, path + (key,), tensors)])
    node: dict[str, Any] = {"dict": items, "ordered": type(value) is OrderedDict}
    # nn.Module.state_dict() carries per-module versions in ._metadata, which
    # load_state_dict uses to upgrade old layouts; keep it when it is plain data.
    meta = getattr(value, "_metadata", None)
    if isinstance(meta, dict):
        try:
            node["meta"] = encode(meta, path + ("_metadata",), {})
        except TypeError:
            pass
    return node


def _claim(path: tuple[Any, ...], value: Any, tensors: dict[str, Any]) -> str:
    from .names import check_name

    name = path_name(path) if path else "tensor"
    check_name(name)
    if name in tensors:
        raise ValueError(
            f"two entries of the state are both named {name!r} once their keys are "
            "joined with '.'; rename one of them"
        )
    tensors[name] = value
    return name


def _decode(node: Any, lookup: Callable[[str], Any]) -> Any:
    if not isinstance(node, (dict, list)):
        return node
    if isinstance(node, list):
        return [_decode(v, lookup) for v in node]
    if "tensor" in node:
        return lookup(node["tensor"])
    if "ndarray" in node:
        return lookup(node["ndarray"])
    if "dict" in node:
        cls = OrderedDict if node.get("ordered") else dict
        out = cls((k, _decode(v, lookup)) for k, v in node["dict"])
        if "meta" in node and cls is OrderedDict:
            out._metadata = _decode(node["meta"], lookup)  # type: ignore[attr-defined]
        return out
    if "list" in node:
        return [_decode(v, lookup) for v in node["list"]]
    if "tuple" in node:
        return tuple(_decode(v, lookup) for v in node["tuple"])
    if "npscalar" in node:
        import numpy as np

        dtype = dtypes.BY_NUMPY.get(node["npscalar"])
        data = base64.b64decode(node["data"])
        if dtype is None or len(data) != np.dtype(node["npscalar"]).itemsize:
            raise ValueError(f"a numpy scalar node holds {len(data)} bytes of dtype {node['npscalar']!r}")
        return np.frombuffer(data, dtype=node["npscalar"])[0]
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    import torch

    if "dtype" in node:
        return dtypes.torch_dtype(node["dtype"])
    if "device" in node:
        return torch.device(node["device"])
    if "size" in node:
        return torch.Size(node["size"])
    raise ValueError(f"unknown node in a saved structure: {sorted(node)}")
