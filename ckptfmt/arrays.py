"""Turning what callers pass (numpy arrays, torch tensors) into little-endian C-contiguous numpy views, and back.

No copy is made for an array that is already contiguous and little-endian; torch CPU tensors are
viewed through numpy, bf16/fp8 reinterpreted bit for bit (numpy has no such dtypes without ml_dtypes).
:func:`to_torch` is the way back, bit for bit too; torch is imported only when a tensor is seen or made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

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

# safetensors dtype name -> torch dtype attribute
TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
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


def to_torch(array: np.ndarray[Any, Any], dtype: str | None = None) -> Any:
    """A torch tensor sharing ``array``'s bytes, of the torch dtype matching safetensors ``dtype``
    (by default the one :func:`as_array` names for the array: numpy has no bf16/fp8 of its own)."""
    import torch

    name = dtype if dtype is not None else as_array(array)[1]
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    flat = torch.from_numpy(raw).view(getattr(torch, TORCH_DTYPES[name]))
    return flat.reshape(tuple(array.shape))


def torchify(value: Any) -> Any:
    """Context values back into what torch state dicts hold: numpy arrays become tensors of their own."""
    if isinstance(value, np.ndarray):
        return to_torch(value).clone()
    if isinstance(value, dict):
        return {k: torchify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [torchify(v) for v in value]
    return value
