"""ckptfmt to ckptfmt: re-encode a checkpoint (another target file size; later, another codec).

Every field is copied: tensors chunk by chunk with their geometry kept (each chunk is read, digest
checked, and written once, so memory stays at one file's worth of pending chunks), context blobs
by value. Profile, metadata, digest algorithm and provenance are kept; provenance gains
``converted_from`` naming the source and its checkpoint id.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._version import __version__
from .base import ConvertResult, NoProgress, Progress

if TYPE_CHECKING:
    from ..reader import Checkpoint


def reencode(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int | None = None,
    codec: str | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    import ckptfmt

    progress = progress or NoProgress()
    result = ConvertResult(source=src, source_format="ckptfmt", destination=dst, destination_format="ckptfmt")
    with ckptfmt.open(src, storage_options) as ckpt:
        manifest = ckpt.manifest
        progress.start(sum(t.nbytes for f in manifest.fields.values() for t in f.tensors.values()))
        options: dict[str, Any] = {
            "storage_options": storage_options,
            "overwrite": overwrite,
            "metadata": dict(manifest.metadata),
        }
        if manifest.files:
            options["digest"] = manifest.digest_algorithm
        if target_file_size is not None:
            options["target_file_size"] = target_file_size
        if codec is not None:
            options["codec"] = codec
        with ckptfmt.open_writer(dst, profile=ckpt.profile, **options) as writer:
            for fname, record in manifest.fields.items():
                if record.kind == "tensors":
                    writer.write_tensors(fname, {})
                for tname, tensor in record.tensors.items():
                    if len(tensor.chunks) == 1:
                        writer.write_tensor(fname, tname, ckpt.read_tensor(fname, tname))
                    for chunk in tensor.chunks if len(tensor.chunks) > 1 else ():
                        data = ckpt.read_slice(fname, tname, chunk.offsets, chunk.shape)
                        writer.write_tensor(fname, tname, data, global_shape=tensor.shape, offsets=chunk.offsets)
                    result.tensors += 1
                    result.bytes += tensor.nbytes
                    progress.advance(tensor.nbytes)
                if record.context is not None and fname != "provenance":
                    writer.write_context(fname, ckpt.read_context(fname))
            writer.write_context("provenance", reencoded_provenance(ckpt))
    result.checkpoint_id = writer.checkpoint_id
    return result


def reencoded_provenance(ckpt: Checkpoint) -> dict[str, Any]:
    """The provenance of a re-encoding of ``ckpt``: its own, with ``converted_from`` naming it and its checkpoint id."""
    provenance = dict(ckpt.read_context("provenance")) if "provenance" in ckpt.manifest.fields else {}
    provenance["converted_from"] = {
        "format": "ckptfmt",
        "url": ckpt.url,
        "checkpoint_id": ckpt.id,
        "converted_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "converter": {"name": "ckptfmt", "version": __version__},
    }
    return provenance
