"""The library's front door: :func:`open_writer`, :func:`open` and :func:`verify` (``ckptfmt.open_writer`` and so
on; the package imports this module on first use, so ``import ckptfmt`` stays cheap)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from .blocks import DEFAULT_BLOCK_BYTES
from .collective import Collective
from .digests import DEFAULT_ALGORITHM
from .incremental import RawDigests
from .reader import Checkpoint, open_checkpoint, verify_url
from .storage import open_store
from .verify import VerifyReport
from .writer import DEFAULT_TARGET_FILE_SIZE, CheckpointWriter


def open_writer(
    url: str | os.PathLike[str],
    profile: str = "training",
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
    digest: str = DEFAULT_ALGORITHM,
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
    format 1.2); None writes none. ``digest``: ``xxh3-128-tree`` (default: each byte hashed once, format 1.3,
    spec/tree-digests.md), ``sha256-tree``, or the flat ``xxh3-128`` / ``sha256`` that readers of 1.0 to 1.2 check.

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
