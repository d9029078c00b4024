"""ckptfmt: an open, verifiable checkpoint format for resilient large-model training.

    import ckptfmt
    with ckptfmt.open_writer(url, profile="training") as w:
        w.write_tensor("weights", "layer0.w", array)
        w.write_context("rng", {...})
    ckpt = ckptfmt.open(url)
    ckpt.read_tensor("weights", "layer0.w")

``import ckptfmt`` loads neither click, torch nor s3fs, nor numpy or any module of the library beyond its errors:
each public name is imported on first use, so ``ckpt --help`` and a short-lived tool start fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    BaseCheckpointError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    ChunkLayoutError,
    CollectiveError,
    ConfigHashMismatchError,
    ContextError,
    DigestMismatchError,
    DTypeError,
    FieldNotFoundError,
    HealRefusedError,
    IncompleteCheckpointError,
    IntegrityError,
    MalformedMessageError,
    ManifestError,
    MemoryCapacityError,
    MessageTooLargeError,
    MissingFieldError,
    MissingFileError,
    ReferencedCheckpointError,
    RestoreError,
    ResumeMismatchError,
    SafetensorsHeaderError,
    SizeMismatchError,
    SourceChangedError,
    SourceFormatError,
    StorageError,
    UnsafePathError,
    UnsupportedCodecError,
    UnsupportedExtensionError,
    UnsupportedVersionError,
    UsageError,
)

# public name -> the module that defines it, imported on first access (PEP 562)
_LAZY = {
    "canonical_json": ".canonical",
    "config_hash": ".canonical",
    "Collective": ".collective",
    "ThreadCollective": ".collective",
    "open": ".entry",
    "open_writer": ".entry",
    "verify": ".entry",
    "ChunkRecord": ".manifest",
    "FORMAT_VERSION": ".manifest",
    "FieldRecord": ".manifest",
    "FileRecord": ".manifest",
    "Manifest": ".manifest",
    "TensorRecord": ".manifest",
    "parse_manifest": ".manifest_parse",
    "PROFILES": ".profiles",
    "Checkpoint": ".reader",
    "open_store": ".storage",
    "Problem": ".verify",
    "VerifyReport": ".verify",
    "CheckpointWriter": ".writer",
}

if TYPE_CHECKING:
    from .canonical import canonical_json, config_hash
    from .collective import Collective, ThreadCollective
    from .entry import open, open_writer, verify
    from .manifest import FORMAT_VERSION, ChunkRecord, FieldRecord, FileRecord, Manifest, TensorRecord
    from .manifest_parse import parse_manifest
    from .profiles import PROFILES
    from .reader import Checkpoint
    from .storage import open_store
    from .verify import Problem, VerifyReport
    from .writer import CheckpointWriter


# importable from the package before it was lazy, though not in __all__: kept so
_COMPAT = {
    "DEFAULT_BLOCK_BYTES": ".blocks",
    "DEFAULT_TARGET_FILE_SIZE": ".writer",
    "RawDigests": ".incremental",
    "open_checkpoint": ".reader",
    "verify_url": ".reader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name) or _COMPAT.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # ckptfmt.reader without importing it first, as before
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_COMPAT})


class _Package(types.ModuleType):
    """The package, whose public function ``verify`` shares its name with the submodule ``ckptfmt.verify``: loading
    the submodule (on first use now, not while the package is imported) must not rebind the public name to it."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == ".entry":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "FORMAT_VERSION",
    "PROFILES",
    "BaseCheckpointError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointWriter",
    "ChunkLayoutError",
    "ChunkRecord",
    "Collective",
    "CollectiveError",
    "ConfigHashMismatchError",
    "ContextError",
    "DTypeError",
    "DigestMismatchError",
    "FieldNotFoundError",
    "FieldRecord",
    "FileRecord",
    "IncompleteCheckpointError",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "HealRefusedError",
    "MalformedMessageError",
    "MemoryCapacityError",
    "MessageTooLargeError",
    "MissingFieldError",
    "MissingFileError",
    "Problem",
    "ReferencedCheckpointError",
    "RestoreError",
    "ResumeMismatchError",
    "SafetensorsHeaderError",
    "SizeMismatchError",
    "SourceChangedError",
    "SourceFormatError",
    "StorageError",
    "TensorRecord",
    "ThreadCollective",
    "UnsafePathError",
    "UnsupportedCodecError",
    "UnsupportedExtensionError",
    "UnsupportedVersionError",
    "UsageError",
    "VerifyReport",
    "canonical_json",
    "config_hash",
    "open",
    "open_store",
    "open_writer",
    "parse_manifest",
    "verify",
    "__version__",
]
