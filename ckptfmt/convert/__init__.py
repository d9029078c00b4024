"""Converting between ckptfmt and other checkpoint formats, one module per format.

==============  ==================================================  ===========
format          what                                                directions
==============  ==================================================  ===========
``ckptfmt``     this format (re-encode: another target size)        both
``hf``          Hugging Face safetensors, single or sharded         both
``pt``          PyTorch state-dict files .pt/.bin/.pth              import only
``dcp``         PyTorch Distributed Checkpoint directories          both
``hf-trainer``  Hugging Face Trainer ``checkpoint-N/`` directories  both
``lightning``   PyTorch Lightning ``.ckpt`` files                   both
``accelerate``  Accelerate ``save_state`` directories               both
==============  ==================================================  ===========

Every conversion goes to or from ckptfmt. Importing this package loads neither torch nor click;
the converters that need torch import it when called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointNotFoundError, UsageError
from .base import ConvertResult, NoProgress, Progress, list_names, locate, parse_size
from .formats import ALIASES, BY_LISTING, BY_URL, FORMATS, WRITABLE, Options, find


def normalize_format(name: str) -> str:
    return find(name).name


def detect_format(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """The format of what is at ``url``, from its names alone (nothing is unpickled or parsed)."""
    text = os.fspath(url).rstrip("/")
    for fmt in BY_URL:
        if fmt.claims_name(text, lambda: bool(list_names(locate(text, storage_options)))):
            return fmt.name
    loc = locate(text, storage_options)
    names = list_names(loc)
    if not names and not loc.fs.exists(loc.path):
        raise CheckpointNotFoundError("nothing here", path=text)
    for fmt in BY_LISTING:
        if fmt.detect(names):
            return fmt.name
    what = "an empty or missing directory" if not names else f"a directory of {len(names)} unrecognized entries"
    raise UsageError(f"cannot tell the format of {text!r} ({what}); pass --from")


def _with_files(result: ConvertResult, storage_options: Mapping[str, Any] | None) -> ConvertResult:
    """List a ckptfmt destination's files, as committed."""
    if result.destination_format == "ckptfmt" and not result.files:
        import ckptfmt

        with ckptfmt.open(result.destination, storage_options) as ckpt:
            result.destination = ckpt.url
            result.files = [f.path for f in ckpt.manifest.files]
    return result


def convert(
    src: str,
    dst: str,
    *,
    to: str,
    source_format: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int | None = None,
    max_shard_size: int | None = None,
    field: str = "weights",
    progress: Progress | None = None,
    codec: str | None = None,
) -> ConvertResult:
    """Convert ``src`` to format ``to`` at ``dst``; one side must be ckptfmt.

    ``codec`` re-encodes a ckptfmt checkpoint (ckptfmt to ckptfmt) with that codec ("raw", "zstd", "zstd:N").
    """
    if codec is not None:
        from .native import reencode

        fmt = normalize_format(source_format) if source_format else detect_format(src, storage_options)
        if fmt != "ckptfmt" or normalize_format(to) != "ckptfmt":
            raise UsageError("--codec re-encodes a ckptfmt checkpoint: import first, then convert ckptfmt to ckptfmt")

        result = reencode(
            src,
            dst,
            storage_options=storage_options,
            overwrite=overwrite,
            target_file_size=target_file_size,
            codec=codec,
            progress=progress,
        )
        return _with_files(result, storage_options)
    return _with_files(
        _convert(
            src, dst, to, source_format, storage_options, overwrite, target_file_size, max_shard_size, field, progress
        ),
        storage_options,
    )


def _convert(
    src: str,
    dst: str,
    to: str,
    source_format: str | None,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    target_file_size: int | None,
    max_shard_size: int | None,
    field: str,
    progress: Progress | None,
) -> ConvertResult:
    target = find(to)
    if target.writer is None:
        raise UsageError(f"format {target.name!r} is import only; write one of: {', '.join(WRITABLE)}")
    source = find(source_format) if source_format else find(detect_format(src, storage_options))
    if source.name != "ckptfmt" and target.name != "ckptfmt":
        raise UsageError(f"convert {source.name} to ckptfmt first, then ckptfmt to {target.name}")
    options = Options(
        storage_options=storage_options,
        overwrite=overwrite,
        target_file_size=target_file_size,
        max_shard_size=max_shard_size or None,  # the writer's default (hf: 5GB)
        field=field,
        progress=progress,
    )
    return source.read(src, dst, options) if target.name == "ckptfmt" else target.write(src, dst, options)


__all__ = [
    "ALIASES",
    "FORMATS",
    "ConvertResult",
    "NoProgress",
    "Progress",
    "convert",
    "detect_format",
    "normalize_format",
    "parse_size",
]
