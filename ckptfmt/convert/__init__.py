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

FORMATS: tuple[str, ...] = ("ckptfmt", "hf", "pt", "dcp", "hf-trainer", "lightning", "accelerate")
ALIASES: dict[str, str] = {"safetensors": "hf", "torch": "pt", "pth": "pt", "bin": "pt", "ckpt": "lightning"}
WRITABLE: tuple[str, ...] = ("ckptfmt", "hf", "dcp", "hf-trainer", "lightning", "accelerate")


def normalize_format(name: str) -> str:
    fmt = ALIASES.get(name.lower(), name.lower())
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return fmt


def detect_format(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """The format of what is at ``url``, from its names alone (nothing is unpickled or parsed)."""
    text = os.fspath(url).rstrip("/")
    if text.endswith(".ckpt") and not list_names(locate(text, storage_options)):
        return "lightning"  # a file; a directory named *.ckpt is what ckptfmt's Lightning plugin writes
    if text.endswith((".pt", ".bin", ".pth")):
        return "pt"
    if text.endswith((".safetensors", ".safetensors.index.json")):
        return "hf"
    loc = locate(text, storage_options)
    names = list_names(loc)
    if not names and not loc.fs.exists(loc.path):
        raise CheckpointNotFoundError("nothing here", path=text)
    if "manifest.json" in names or ".writer-lock" in names:
        return "ckptfmt"
    if ".metadata" in names:
        return "dcp"
    if "trainer_state.json" in names:
        return "hf-trainer"
    if any(n.startswith("random_states_") and n.endswith(".pkl") for n in names):
        return "accelerate"
    if any(n.endswith((".safetensors.index.json", ".safetensors")) for n in names):
        return "hf"
    if any(n.endswith((".pt", ".bin", ".pth")) for n in names):
        return "pt"
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
    to = normalize_format(to)
    if to not in WRITABLE:
        raise UsageError(f"format {to!r} is import only; write one of: {', '.join(WRITABLE)}")
    fmt = normalize_format(source_format) if source_format else detect_format(src, storage_options)
    if fmt != "ckptfmt" and to != "ckptfmt":
        raise UsageError(f"convert {fmt} to ckptfmt first, then ckptfmt to {to}")
    common: dict[str, Any] = {"storage_options": storage_options, "overwrite": overwrite, "progress": progress}
    if to == "ckptfmt":
        common["target_file_size"] = target_file_size
        if fmt == "ckptfmt":
            from .native import reencode

            return reencode(src, dst, **common)
        if fmt == "hf":
            from .hf import import_hf

            return import_hf(src, dst, **common)
        if fmt == "pt":
            from .torch_pt import import_pt

            return import_pt(src, dst, **common)
        if fmt == "hf-trainer":
            from .hf_trainer import import_hf_trainer

            return import_hf_trainer(src, dst, **common)
        if fmt == "lightning":
            from .lightning import import_lightning

            return import_lightning(src, dst, **common)
        if fmt == "accelerate":
            from .accelerate import import_accelerate

            return import_accelerate(src, dst, **common)
        from .dcp import import_dcp

        return import_dcp(src, dst, **common)
    if to == "hf-trainer":
        from .hf_trainer import export_hf_trainer

        return export_hf_trainer(src, dst, **common)
    if to == "lightning":
        from .lightning import export_lightning

        return export_lightning(src, dst, **common)
    if to == "accelerate":
        from .accelerate import export_accelerate

        return export_accelerate(src, dst, **common)
    if to == "hf":
        from .hf import DEFAULT_MAX_SHARD_SIZE, export_hf

        return export_hf(src, dst, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE, field=field, **common)
    from .dcp import export_dcp

    return export_dcp(src, dst, field=field, **common)


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
