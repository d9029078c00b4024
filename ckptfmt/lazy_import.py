"""numpy on first use, for the modules a reader that touches no array needs (``ckpt verify``, ``ckpt inspect``).

numpy with ml_dtypes is about 60 ms of a short command's 160 here: more than the rest of the package. A module on
that path writes::

    if TYPE_CHECKING:
        import numpy as np
    else:
        from .lazy_import import numpy as np

and uses ``np`` as before inside its functions; nothing at its top level may touch ``np``. tests/test_cli_startup.py
checks that ``ckpt verify`` of a weights checkpoint never imports numpy.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """A module imported by the first attribute read; each attribute read once is kept here afterwards."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads of it never reach __getattr__
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


numpy = LazyModule("numpy")
ml_dtypes = LazyModule("ml_dtypes")
zstandard = LazyModule("zstandard")  # 13 ms, for checkpoints that use a zstd codec
