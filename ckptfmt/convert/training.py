"""The import and export driver of the trainer formats (Trainer, Lightning, Accelerate).

A format's reader turns its source into a :class:`TrainingSource`: what it found for each field of
the training profile (weights, optimizer, rng, data, config, topology, and fields of its own), where
each came from, and what the source lacked. :func:`import_training` does the rest, the same for every
format: the provenance (what came from where), the notes, and the write (:func:`write_training`).
On export, :func:`read_contexts` and :func:`optimizer_states` give a format's writer the checkpoint's
fields, and :func:`write_files` writes what it made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SourceFormatError
from .base import ConvertResult, Location, Progress, converted_from, importer, nbytes, read_range, writer_options
from .destination import write_output
from .optimizer import join_optimizers


def field_source(file: str, key: str | None = None, **extra: object) -> dict[str, object]:
    """Where a field came from: the source file(s), and the key(s) in them."""
    return {"file": file, **({"key": key} if key is not None else {}), **extra}


def missing_note(fmt: str, missing: Mapping[str, str]) -> str:
    return f"the {fmt} source lacks " + "; ".join(f"{name} ({why})" for name, why in missing.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSource:
    """What a trainer format's source holds for the training profile, as its reader found it.

    ``contexts`` are written in their order (``rng``, ``data``, ``config``, ``topology``, then the
    format's own fields); ``provenance`` is not among them: :func:`import_training` makes it from
    ``sources`` (field -> :func:`field_source`), ``missing`` (field -> why), ``skipped`` and ``step``.
    ``notes`` come after the note on what is missing and before those on what was skipped.
    """

    weights: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    optimizer_context: Mapping[str, Any]
    contexts: Mapping[str, Mapping[str, object]]
    extra_tensors: Mapping[str, Mapping[str, Any]] | None = None
    sources: dict[str, object] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step: int | None = None


def import_training(
    fmt: str,
    label: str,
    url: str,
    source: TrainingSource,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    target_file_size: int | None,
    progress: Progress,
) -> ConvertResult:
    """Write what a ``fmt`` source at ``url`` holds as a training-profile checkpoint at ``dst``.

    ``label`` names the format in the notes ("the Trainer source lacks ...").
    """
    result = ConvertResult(source=url, source_format=fmt, destination=dst, destination_format="ckptfmt")
    result.notes = [missing_note(label, source.missing)] if source.missing else []
    result.notes += [*source.notes, *(f"skipped {s}" for s in source.skipped)]
    provenance = converted_from(fmt, url, fields=source.sources, missing=source.missing, skipped=source.skipped)
    if source.step is not None:
        provenance["step"] = source.step
    write_training(
        dst,
        weights=source.weights,
        optimizer=(source.optimizer, source.optimizer_context),
        contexts={**source.contexts, "provenance": provenance},
        extra_tensors=source.extra_tensors,
        result=result,
        progress=progress,
        storage_options=storage_options,
        overwrite=overwrite,
        target_file_size=target_file_size,
    )
    return result


def training_importer(fmt: str, label: str, read: Callable[[Location], TrainingSource]) -> Callable[..., ConvertResult]:
    """The import of ``fmt`` (its :class:`~ckptfmt.convert.formats.Format` reader): ``read`` the source located at
    ``src``, then :func:`import_training` (``label`` names the format in the notes)."""

    def convert(loc: Location, dst: str, **options: Any) -> ConvertResult:
        return import_training(fmt, label, loc.url, read(loc), dst, **options)

    return importer(fmt, convert)


class LazySafetensors(Mapping[str, Any]):
    """Safetensors tensors by name, each read (its byte range only) when asked for, so memory stays at one
    tensor; ``loaded`` adds tensors already at hand (memory-mapped torch files)."""

    def __init__(self, items: list[tuple[Location, Any, str]], loaded: Mapping[str, Any] | None = None) -> None:
        self._items = {name: (shard, entry) for shard, entry, name in items}
        self._loaded = dict(loaded or {})
        if set(self._items) & set(self._loaded):
            raise SourceFormatError(f"tensor {sorted(set(self._items) & set(self._loaded))[0]!r} appears twice")

    def __getitem__(self, name: str) -> Any:
        from .. import dtypes

        if name in self._loaded:
            return self._loaded[name]
        shard, entry = self._items[name]
        data = bytearray(read_range(shard, entry.begin, entry.end - entry.begin))
        return np.frombuffer(data, dtype=dtypes.to_numpy(entry.dtype)).reshape(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._items, *self._loaded])

    def __len__(self) -> int:
        return len(self._items) + len(self._loaded)

    @property
    def loaded(self) -> Mapping[str, Any]:
        """The tensors given already loaded (not read lazily)."""
        return self._loaded

    def nbytes(self, name: str) -> int:
        if name in self._loaded:
            return nbytes(self._loaded[name])
        _, entry = self._items[name]
        return int(entry.end - entry.begin)


def _loaded(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """The tensors of a field already in memory (a lazy mapping's safetensors are read only when written)."""
    return tensors.loaded if isinstance(tensors, LazySafetensors) else tensors


def _size(tensors: Mapping[str, Any], name: str) -> int:
    """A tensor's size in bytes without reading it when the mapping is lazy."""
    return tensors.nbytes(name) if isinstance(tensors, LazySafetensors) else nbytes(tensors[name])


def write_training(
    dst: str,
    *,
    weights: Mapping[str, Any],
    optimizer: tuple[Mapping[str, Any], Mapping[str, Any]],
    contexts: Mapping[str, Mapping[str, object]],
    result: ConvertResult,
    progress: Progress,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    target_file_size: int | None,
    extra_tensors: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write a training-profile checkpoint: tensor fields one tensor at a time, then the contexts, then commit."""
    import ckptfmt

    from .bounded import check_expansion, dedupe

    # a torch tensor loaded under several names (tied weights, or a hostile file's thousand references to
    # one tensor) is stored once, the other names recorded as aliases the way ckptfmt.torch records them
    _, aliases = dedupe(weights.loaded if isinstance(weights, LazySafetensors) else weights)
    contexts = dict(contexts)
    if aliases:
        contexts["weights"] = {**contexts.get("weights", {}), "aliases": aliases}
    tensor_fields = {"weights": weights, "optimizer": optimizer[0], **dict(extra_tensors or {})}
    names = {
        field: [name for name in tensors if not (field == "weights" and name in aliases)]
        for field, tensors in tensor_fields.items()
    }
    check_expansion(
        (
            _loaded(tensors)[name]
            for field, tensors in tensor_fields.items()
            for name in names[field]
            if name in _loaded(tensors)
        ),
        result.source,
    )
    progress.start(sum(_size(tensors, name) for field, tensors in tensor_fields.items() for name in names[field]))
    options = writer_options(storage_options, overwrite, target_file_size)
    with ckptfmt.open_writer(dst, profile="training", **options) as writer:
        for field, tensors in tensor_fields.items():
            writer.write_tensors(field, {})
            for name in names[field]:
                tensor = tensors[name]
                writer.write_tensor(field, name, tensor)
                result.tensors += 1
                result.bytes += nbytes(tensor)
                progress.advance(nbytes(tensor))
        writer.write_context("optimizer", optimizer[1])
        for field, value in contexts.items():
            writer.write_context(field, value)
    result.checkpoint_id = writer.checkpoint_id


def read_contexts(ckpt: Any) -> dict[str, dict[str, Any]]:
    """Every context of an open checkpoint, by field (each read and verified)."""
    return {n: ckpt.read_context(n) for n, rec in ckpt.fields.items() if rec.context is not None}


def optimizer_states(ckpt: Any, contexts: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The state dict of each optimizer the checkpoint's ``optimizer`` field holds (none: an empty list)."""
    if "optimizer" not in ckpt.fields or ckpt.field("optimizer").kind != "tensors":
        return []
    # an earlier .pt import (before optimizer_layout) keyed several optimizers by their path, which its
    # provenance lists in order
    source = contexts.get("provenance", {}).get("converted_from")
    order = source.get("optimizer_keys") if isinstance(source, Mapping) else None
    order = [str(p) for p in order] if isinstance(order, list) else []
    return join_optimizers(ckpt.read_tensors("optimizer"), contexts.get("optimizer", {}), order)


def write_files(out: Location, files: Mapping[str, bytes], result: ConvertResult, progress: Progress | None) -> None:
    """Write an export's files into ``out``, each a new file renamed over its name (through no symlink or hard
    link), listing each in ``result``."""
    if progress is not None:
        progress.start(sum(len(b) for b in files.values()))
    for name, data in files.items():
        write_output(out, name, data)
        result.files.append(name)
        if progress is not None:
            progress.advance(len(data))
