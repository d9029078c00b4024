"""Safetensors dtype names, their item sizes, and their numpy equivalents (bf16/fp8 via ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import DTypeError

# name -> numpy dtype (always little-endian on disk)
_NUMPY: dict[str, np.dtype[np.generic]] = {
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

DTYPES: tuple[str, ...] = tuple(_NUMPY)
ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in _NUMPY.items()}
_BY_NUMPY: dict[np.dtype[np.generic], str] = {dt.newbyteorder("<"): name for name, dt in _NUMPY.items()}


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def to_numpy(name: str) -> np.dtype[np.generic]:
    try:
        return _NUMPY[name]
    except KeyError:
        raise DTypeError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    """The safetensors name of a numpy dtype, whatever its byte order."""
    try:
        return _BY_NUMPY[dtype.newbyteorder("<")]
    except KeyError:
        raise DTypeError(f"numpy dtype {dtype} has no safetensors equivalent") from None
