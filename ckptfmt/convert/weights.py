"""The import driver of the weights formats (Hugging Face safetensors, PyTorch ``.pt``, DCP).

A format's reader turns its source into a :class:`WeightsSource`: the fields to write, each its
tensors (every one a sequence of :class:`Chunk`, read only when written, so memory stays at one
chunk) and its context, and what the provenance records about the source. :func:`import_weights`
does the rest, the same for every format: a ``weights``-profile checkpoint, each field's tensors
then its context, then the provenance, progress counted in the source's bytes.

The trainer formats have a driver of their own (:mod:`.training`): theirs is a training-profile
checkpoint whose every field is read before anything is written, with notes on what the source
lacked; here tensors stream from the source one chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import ConvertResult, Location, Progress, converted_from, nbytes, writer_options
from .base import importer as base_importer


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One stored piece of a tensor: ``read()`` gives it (a numpy array or torch tensor, checked by the
    reader), ``size`` is its bytes in the source (what progress counts) and ``offsets`` where it lies in
    the tensor (None: it is the whole tensor)."""

    read: Callable[[], Any]
    size: int
    offsets: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceTensor:
    """A tensor of the source: its name, its chunks in write order, and (chunked) its whole shape."""

    name: str
    chunks: Sequence[Chunk]
    shape: tuple[int, ...] | None = None


def loaded(name: str, tensor: Any) -> SourceTensor:
    """A tensor already in memory (a torch tensor ``torch.load`` gave) as one whole chunk."""
    return SourceTensor(name=name, chunks=(Chunk(read=lambda: tensor, size=nbytes(tensor)),))


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceField:
    """A tensor field to write: its tensors in order, then its context (none, or empty: not written)."""

    tensors: Sequence[SourceTensor]
    context: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsSource:
    """What a weights format's source holds, as its reader found it.

    ``url`` is the source as the result names it; ``fields`` are written in their order; ``provenance``
    is what ``converted_from`` records beyond the format and the URL.
    """

    url: str
    fields: Mapping[str, SourceField]
    provenance: Mapping[str, object] = field(default_factory=dict)


def import_weights(
    fmt: str,
    source: WeightsSource,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    target_file_size: int | None,
    progress: Progress,
) -> ConvertResult:
    """Write what a ``fmt`` source holds as a weights-profile checkpoint at ``dst``."""
    import ckptfmt

    progress.start(sum(c.size for f in source.fields.values() for t in f.tensors for c in t.chunks))
    result = ConvertResult(source=source.url, source_format=fmt, destination=dst, destination_format="ckptfmt")
    options = writer_options(storage_options, overwrite, target_file_size)
    with ckptfmt.open_writer(dst, profile="weights", **options) as writer:
        for name, part in source.fields.items():
            writer.write_tensors(name, {})
            for tensor in part.tensors:
                for chunk in tensor.chunks:
                    value = chunk.read()
                    if chunk.offsets is None:
                        writer.write_tensor(name, tensor.name, value)
                    else:
                        writer.write_tensor(name, tensor.name, value, global_shape=tensor.shape, offsets=chunk.offsets)
                    result.bytes += nbytes(value)
                    progress.advance(chunk.size)
                result.tensors += 1
            if part.context:
                writer.write_context(name, part.context)
        writer.write_context("provenance", converted_from(fmt, source.url, **source.provenance))
    result.checkpoint_id = writer.checkpoint_id
    return result


def importer(fmt: str, read: Callable[[Location], WeightsSource]) -> Callable[..., ConvertResult]:
    """The import of ``fmt`` (its :class:`~ckptfmt.convert.formats.Format` reader): ``read`` the source
    located at ``src``, then :func:`import_weights` (:func:`~ckptfmt.convert.base.importer`)."""

    def convert(loc: Location, dst: str, **options: Any) -> ConvertResult:
        return import_weights(fmt, read(loc), dst, **options)

    return base_importer(fmt, convert)
