"""Safetensors dtype names, their item sizes, and their numpy equivalents (bf16/fp8 via ml_dtypes)."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from .errors import DTypeError

if TYPE_CHECKING:
    import ml_dtypes
    import numpy as np
else:
    from .lazy_import import ml_dtypes
    from .lazy_import import numpy as np

# name -> item size: all that a reader that touches no array needs (numpy is imported on first use of the rest)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "U64": 8,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
}
DTYPES: tuple[str, ...] = tuple(ITEMSIZE)


@cache
def _numpy() -> dict[str, np.dtype[np.generic]]:
    """name -> numpy dtype (always little-endian on disk)."""
    return {
        "BOOL": np.dtype(np.bool_),
        "U8": np.dtype("<u1"),
        "I8": np.dtype("<i1"),
        "U16": np.dtype("<u2"),
        "I16": np.dtype("<i2"),
        "U32": np.dtype("<u4"),
        "I32": np.dtype("<i4"),
        "U64": np.dtype("<u8"),
        "I64": np.dtype("<i8"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F32": np.dtype("<f4"),
        "F64": np.dtype("<f8"),
        "C64": np.dtype("<c8"),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
        "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
        "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    }


@cache
def _by_numpy() -> dict[np.dtype[np.generic], str]:
    return {dt.newbyteorder("<"): name for name, dt in _numpy().items()}


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def to_numpy(name: str) -> np.dtype[np.generic]:
    try:
        return _numpy()[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    """The safetensors name of a numpy dtype, whatever its byte order."""
    try:
        return _by_numpy()[dtype.newbyteorder("<")]
    except KeyError:
        raise DTypeError(f"numpy dtype {dtype} has no safetensors equivalent") from None


MAX_DIMS = 64  # numpy's NPY_MAXDIMS (2.x): an empty tensor of more dimensions passes every size check, then fails
MAX_EXTENT = 1 << 63  # numpy's limit (ssize_t): no dimension, and no array's byte size, may reach it


def shape_size_problem(shape: tuple[int, ...] | list[int], item: int) -> str | None:
    """Why an array of ``shape`` and item size ``item`` cannot exist in memory (TEN-23, SAF-14), or None:
    more than :data:`MAX_DIMS` dimensions, a dimension of 2**63 or more, or 2**63 bytes or more.

    Zero dimensions are left out of the product: numpy refuses ``np.empty((0, 2**62, 2**62))`` too, so an
    empty tensor with astronomically large other dimensions would pass every size check and then fail
    (or spin) in whoever reads it.
    """
    if len(shape) > MAX_DIMS:
        return f"shape has {len(shape)} dimensions, more than the {MAX_DIMS} an array may have"
    count = item
    for d in shape:
        if d >= MAX_EXTENT:
            return f"shape {list(shape)} has a dimension of 2**63 or more"
        if d:
            count *= d
            if count >= MAX_EXTENT:
                return f"shape {list(shape)} x {item}-byte items is 2**63 bytes or more (zero dimensions aside)"
    return None
