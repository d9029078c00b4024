"""ckptfmt: an open, verifiable checkpoint format for resilient large-model training.

    import ckptfmt
    with ckptfmt.open_writer(url, profile="training") as w:
        w.write_tensor("weights", "layer0.w", array)
        w.write_context("rng", {...})
    ckpt = ckptfmt.open(url)
    ckpt.read_tensor("weights", "layer0.w")

``import ckptfmt`` loads neither click, torch nor s3fs.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from ._version import __version__
from .blocks import DEFAULT_BLOCK_BYTES
from .canonical import canonical_json, config_hash
from .collective import Collective, ThreadCollective
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
from .incremental import RawDigests
from .manifest import (
    FORMAT_VERSION,
    ChunkRecord,
    FieldRecord,
    FileRecord,
    Manifest,
    TensorRecord,
)
from .manifest_parse import parse_manifest
from .profiles import PROFILES
from .reader import Checkpoint, open_checkpoint, verify_url
from .storage import open_store
from .verify import Problem, VerifyReport
from .writer import DEFAULT_TARGET_FILE_SIZE, CheckpointWriter


def open_writer(
    url: str | os.PathLike[str],
    profile: str = "training",
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
    digest: str = "xxh3-128",
    rank: int = 0,
    workers: int = 2,
    metadata: Mapping[str, str] | None = None,
    collective: Collective | None = None,
    codec: str | None = None,
    block_bytes: int | None = DEFAULT_BLOCK_BYTES,
    base: Checkpoint | str | os.PathLike[str] | None = None,
    frozen: Collection[str] = (),
    base_content: RawDigests | None = None,
) -> CheckpointWriter:
    """Start writing a checkpoint at ``url`` (a path or any fsspec URL). Leaving the ``with`` block commits.

    With ``collective``, every rank of the group calls this with the same ``url`` and writes its own
    tensors or chunks; rank 0 holds the lock and commits one manifest for all (a collective call).
    ``codec``: None or ``"raw"`` stores raw chunks; ``"zstd"`` or ``"zstd:LEVEL"`` compresses floating-point
    chunks losslessly (spec/codecs.md; such a checkpoint is format 1.1). ``block_bytes``: raw chunks larger than
    this also get a digest per block, so a partial read checks exactly the blocks it reads (spec/blocks.md,
    format 1.2); None writes none.

    ``base``: an earlier checkpoint beside ``url`` (the same run directory; a URL or an open checkpoint): a chunk
    whose bytes equal the base's chunk of the same tensor, offsets and shape is recorded as a reference to it,
    hashed but not written (spec/references.md). ``frozen``: names of tensors the caller declares unchanged
    since the base (a LoRA base model), referenced without being hashed. ``base_content``: ``(checkpoint id,
    writer.raw_digests)`` of the writer that wrote the base, so that its encoded chunks are compared too.
    """
    return CheckpointWriter(
        open_store(url, storage_options),
        profile=profile,
        overwrite=overwrite,
        target_file_size=target_file_size,
        digest=digest,
        rank=rank,
        workers=workers,
        metadata=metadata,
        collective=collective,
        codec=codec,
        block_bytes=block_bytes,
        base=base,
        frozen=frozen,
        base_content=base_content,
    )


def open(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed checkpoint; refuses an incomplete, invalid or unknown-major one."""
    return open_checkpoint(url, storage_options)


def verify(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, quick: bool = False
) -> VerifyReport:
    """Verify the checkpoint at ``url``; a report listing every problem (an unopenable one included)."""
    return verify_url(url, storage_options, quick=quick)


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
