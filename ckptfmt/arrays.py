"""Turning what callers pass (numpy arrays, torch tensors) into little-endian C-contiguous numpy views.

No copy is made for an array that is already contiguous and little-endian; torch CPU tensors are
viewed through numpy, bf16/fp8 reinterpreted bit for bit (numpy has no such dtypes without ml_dtypes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes
from .errors import DTypeError

# torch dtype name -> (integer view dtype torch can export to numpy, safetensors name)
_TORCH_BITCAST = {
    "bfloat16": ("int16", "BF16"),
    "float8_e4m3fn": ("uint8", "F8_E4M3"),
    "float8_e5m2": ("uint8", "F8_E5M2"),
    "float8_e4m3fnuz": ("uint8", "F8_E4M3FNUZ"),
    "float8_e5m2fnuz": ("uint8", "F8_E5M2FNUZ"),
    "float8_e8m0fnu": ("uint8", "F8_E8M0"),
}


def is_torch_tensor(value: object) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _from_torch(tensor: Any) -> np.ndarray[Any, Any]:
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name in _TORCH_BITCAST:
        view_name, st_name = _TORCH_BITCAST[name]
        raw = t.view(getattr(torch, view_name)).numpy()
        return raw.view(dtypes.to_numpy(st_name))  # type: ignore[no-any-return]
    try:
        return t.numpy()  # type: ignore[no-any-return]
    except TypeError as exc:
        raise DTypeError(f"torch dtype {t.dtype} has no safetensors equivalent") from exc


def as_array(value: object) -> tuple[np.ndarray[Any, Any], str]:
    """A C-contiguous little-endian array of ``value`` (a copy only when unavoidable) and its dtype name."""
    if is_torch_tensor(value):
        array = _from_torch(value)
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, np.generic):
        array = np.asarray(value)
    else:
        raise DTypeError(f"expected a numpy array or torch tensor, got {type(value).__name__}")
    name = dtypes.from_numpy(array.dtype)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array, name


def byte_view(array: np.ndarray[Any, Any]) -> memoryview:
    """The raw bytes of a C-contiguous array, without a copy."""
    if array.size == 0:
        return memoryview(b"")
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
