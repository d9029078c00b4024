"""Reading a trainer's own files: ``torch.save``'d state (weights_only) and small JSON documents.

Torch files load with ``torch.load(weights_only=True)``; the RNG files hold numpy's legacy state,
so they load under the allow-list the Trainer itself uses (numpy's array reconstructor, ndarray and
dtypes, which build arrays and nothing else), for that load only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import SourceFormatError
from ..jsonio import load_json
from . import torch_pt
from .base import Location, read_file

MAX_JSON_BYTES = 64 << 20  # a trainer_state.json with a long log history stays far below this


def load_torch_file(loc: Location, *, numpy_arrays: bool = False) -> Any:
    """``torch.load(weights_only=True)``; with ``numpy_arrays``, numpy arrays are allowed too (RNG states),
    for this load only (other threads' loads and the user's own allow-list are left as they are)."""
    return torch_pt.load(loc, allow=numpy_globals() if numpy_arrays else ())


def numpy_globals() -> list[Any]:
    """The numpy names an array pickles through: the reconstructor, ndarray, dtype and the uint32 dtype class."""
    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_json(loc: Location, what: str) -> dict[str, Any]:
    # read_file: no symlink followed below the source, regular files only, bounded before reading
    doc = load_json(read_file(loc, MAX_JSON_BYTES), error=SourceFormatError, what=what, path=loc.url, allow_float=True)
    if not isinstance(doc, dict):
        raise SourceFormatError(f"{what} must be a JSON object", path=loc.url)
    return doc


def plain(value: Any, where: str) -> Any:
    """A loaded torch value as a context value, tensors as numpy arrays (RNG and loop states hold some)."""
    from .torch_bridge import context_value, is_tensor

    if is_tensor(value):
        return np.array(value.detach().cpu().numpy(), copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}.{i}") for i, v in enumerate(value)]
    return context_value(value, where)


def save_torch(obj: object) -> bytes:
    """``torch.save`` of a state (tensors, containers, plain values) as the bytes of a file."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
