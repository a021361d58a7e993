"""The dtypes ckptd stores, and how each maps to safetensors and numpy.

Plain data, no torch import: the daemon uses this table to write chunk headers
without loading torch. Names are torch's (``torch.bfloat16`` -> ``"bfloat16"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Dtype:
    """A tensor element type as ckptd stores it.

    ``name``: torch's name without "torch."
    ``st_code``: safetensors dtype of the stored elements
    ``st_pairs``: >1: stored as that many st_code elements (a trailing dimension)
    ``numpy``: numpy's name, when numpy has the type"""

    name: str
    itemsize: int
    st_code: str
    st_pairs: int = 1
    numpy: str | None = None

    def stored_shape(self, shape: list[int]) -> list[int]:
        """Shape of the tensor as a safetensors reader sees it."""
        return [*shape, self.st_pairs] if self.st_pairs > 1 else list(shape)


_TABLE = [
    Dtype("float64", 8, "F64", numpy="float64"),
    Dtype("float32", 4, "F32", numpy="float32"),
    Dtype("float16", 2, "F16", numpy="float16"),
    Dtype("bfloat16", 2, "BF16"),
    Dtype("float8_e4m3fn", 1, "F8_E4M3"),
    Dtype("float8_e5m2", 1, "F8_E5M2"),
    Dtype("float8_e4m3fnuz", 1, "F8_E4M3FNUZ"),
    Dtype("float8_e5m2fnuz", 1, "F8_E5M2FNUZ"),
    Dtype("float8_e8m0fnu", 1, "U8"),  # no safetensors type: same-width unsigned
    Dtype("int8", 1, "I8", numpy="int8"),
    Dtype("int16", 2, "I16", numpy="int16"),
    Dtype("int32", 4, "I32", numpy="int32"),
    Dtype("int64", 8, "I64", numpy="int64"),
    Dtype("uint8", 1, "U8", numpy="uint8"),
    Dtype("uint16", 2, "U16", numpy="uint16"),
    Dtype("uint32", 4, "U32", numpy="uint32"),
    Dtype("uint64", 8, "U64", numpy="uint64"),
    Dtype("bool", 1, "BOOL", numpy="bool"),
    Dtype("complex32", 4, "F16", st_pairs=2),
    Dtype("complex64", 8, "C64", numpy="complex64"),
    Dtype("complex128", 16, "F64", st_pairs=2, numpy="complex128"),
]

BY_NAME: dict[str, Dtype] = {d.name: d for d in _TABLE}
BY_NUMPY: dict[str, Dtype] = {d.numpy: d for d in _TABLE if d.numpy}


def lookup(name: str) -> Dtype:
    try:
        return BY_NAME[name]
    except KeyError:
        raise TypeError(f"dtype {name!r} is not one ckptd can store") from None


def torch_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


_BY_TORCH: dict[Any, Dtype] = {}


def by_torch(dtype: Any) -> Dtype:
    """The Dtype of a ``torch.dtype`` (cached: the producer asks once per tensor)."""
    d = _BY_TORCH.get(dtype)
    if d is None:
        d = _BY_TORCH[dtype] = lookup(torch_name(dtype))
    return d


@lru_cache(maxsize=None)
def torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, lookup(name).name, None)
    if dtype is None:
        raise TypeError(f"dtype {name!r} does not exist in torch {torch.__version__}")
    return dtype
