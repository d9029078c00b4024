"""Planning: what to write and what to read, with no I/O (the planner of the plan / execute / commit split).

Write side, per rank: :class:`RankPlanner` turns the caller's ``write_tensor`` calls into
:class:`FilePlan` records (which chunks go into which data file, in which order, with which codec), checking
names, shapes and chunk bounds as they arrive. It cuts an array to encode into chunks of at most
``ENCODED_FILE_BYTES`` and asks the base's index which chunks are stored there already (a reference, not a
write); it never reads array bytes itself. After the executor has written the files, each rank holds a
:class:`RankResult` (its file and chunk records); :func:`merge_results` is the global step that
joins every rank's results, checks that the chunks tile each tensor exactly and builds the manifest.

The read side has its own planner, ``read_plan``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from . import chunks as geometry
from . import layout
from .codecs import WriteCodec, writer_codec
from .codecs.xor_zstd import NAME as XOR_ZSTD
from .codecs.xor_zstd import DeltaSource, XorOptions
from .delta import chain_files
from .digests import algorithm_of, is_tree
from .errors import ChunkLayoutError, ManifestError, MissingFieldError, UsageError
from .manifest import (
    BLOCKS_VERSION,
    DELTA_VERSION,
    ENCODED_VERSION,
    RAW,
    RAW_VERSION,
    TREE_VERSION,
    ChunkDict,
    ChunkRecord,
    FieldRecord,
    FileRecord,
    Manifest,
    TensorRecord,
)
from .manifest_parse import parse_bases
from .paths import check_field_name, tensor_name_problem
from .profiles import PROFILES
from .references import BaseRecord, check_location

Shape = tuple[int, ...]
Array = np.ndarray[Any, Any]
RAW_WRITE = WriteCodec()
ENCODED_FILE_BYTES = 64 << 20  # raw bytes per encoded data file: bounds the memory of one encode


class ReferenceMatcher(Protocol):
    """The chunks of a base checkpoint (``incremental.BaseIndex``): which chunk is stored there already."""

    def match(
        self, field_name: str, name: str, dtype: str, global_shape: Shape, offsets: Shape, data: Array
    ) -> tuple[ChunkRecord, BaseRecord] | None: ...

    def delta(
        self, field_name: str, name: str, dtype: str, global_shape: Shape, offsets: Shape, shape: Shape
    ) -> DeltaSource | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryPlan:
    """One chunk to store as one safetensors entry."""

    field: str
    tensor: str
    key: str
    dtype: str
    shape: Shape
    offsets: Shape
    global_shape: Shape
    nbytes: int
    codec: WriteCodec = RAW_WRITE

    @property
    def encoded(self) -> bool:
        return self.codec.name != RAW


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePlan:
    """One data file: its entries in storage order (the header is built from them when it is written,
    after encoding). Encoded and raw entries never share a file (COD-2)."""

    field: str
    path: str
    entries: tuple[EntryPlan, ...]

    @property
    def encoded(self) -> bool:
        return any(e.encoded for e in self.entries)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """A chunk to write: the files that became full before it (write them first), its entry, its data (a view)."""

    full: tuple[FilePlan, ...]
    entry: EntryPlan
    data: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedChunk:
    """A written chunk with the tensor it belongs to, as a rank reports it to the coordinator."""

    field: str
    tensor: str
    dtype: str
    global_shape: Shape
    chunk: ChunkRecord

    def to_dict(self) -> dict[str, object]:
        return {
            "field": self.field,
            "tensor": self.tensor,
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "chunk": self.chunk.to_dict(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RankResult:
    """Everything one rank wrote: what the coordinator needs to commit. Travels as canonical JSON."""

    rank: int
    files: tuple[FileRecord, ...] = ()
    chunks: tuple[PlacedChunk, ...] = ()
    contexts: Mapping[str, str] = field(default_factory=dict)  # field -> context blob path
    tensor_fields: tuple[str, ...] = ()  # tensor fields this rank declared, possibly with no tensors
    bases: tuple[BaseRecord, ...] = ()  # where this rank's referenced chunks are stored (spec/references.md)

    def to_bytes(self) -> bytes:
        doc = {
            "rank": self.rank,
            "files": [f.to_dict() for f in self.files],
            "chunks": [c.to_dict() for c in self.chunks],
            "contexts": dict(self.contexts),
            "tensor_fields": list(self.tensor_fields),
            "bases": [b.to_dict() for b in self.bases],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> RankResult:
        from .jsonio import load_json

        doc = load_json(data, error=ManifestError, what="a rank's result")
        try:
            return cls(
                rank=int(doc["rank"]),
                files=tuple(
                    FileRecord(path=str(f["path"]), size=int(f["size"]), digest=str(f["digest"])) for f in doc["files"]
                ),
                chunks=tuple(
                    PlacedChunk(
                        field=str(c["field"]),
                        tensor=str(c["tensor"]),
                        dtype=str(c["dtype"]),
                        global_shape=tuple(int(d) for d in c["global_shape"]),
                        chunk=_chunk_from_dict(c["chunk"]),
                    )
                    for c in doc["chunks"]
                ),
                contexts={str(k): str(v) for k, v in doc["contexts"].items()},
                tensor_fields=tuple(str(f) for f in doc["tensor_fields"]),
                bases=parse_bases(True, {"bases": doc["bases"]}) if doc.get("bases") else (),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed rank result: {exc!r}") from exc


def _chunk_from_dict(doc: ChunkDict) -> ChunkRecord:
    chunk = ChunkRecord.from_dict(doc)
    if chunk.base is not None:
        check_location(chunk.base)  # a rank's result names its bases' locations as the manifest will (REF-3)
    return chunk


@dataclass(slots=True)
class _TensorDecl:
    dtype: str
    shape: Shape
    sharded: bool
    chunk_offsets: set[Shape] | None = None  # a sharded tensor's chunks so far (a whole one has only the one)


class RankPlanner:
    """One rank's write plan, built call by call. Pure: it never sees array data, only its geometry.

    Call sequence: :meth:`add_array` (or, geometry only, :meth:`add`) for each tensor or chunk (it returns
    the plans of files that became full), :meth:`declare_field` for an empty tensor field, then :meth:`finish`
    for the rest. With ``base``, :attr:`references` holds the chunks referenced there instead of written.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        target_file_size: int,
        codec: WriteCodec | str | None = None,
        base: ReferenceMatcher | None = None,
    ) -> None:
        if target_file_size <= 0 or rank < 0:
            raise UsageError("target_file_size must be positive and rank non-negative")
        self.rank = rank
        self.target_file_size = target_file_size
        self.codec = WriteCodec.parse(codec)
        self.base = base
        self.references: list[PlacedChunk] = []
        self._split: set[tuple[str, str]] = set()  # tensors cut into chunks for encoding
        self.tensors: dict[str, dict[str, _TensorDecl]] = {}
        # Open files by (field, encoded): encoded and raw chunks never share a data file (COD-2).
        self._pending: dict[tuple[str, bool], list[EntryPlan]] = {}
        self._pending_bytes: dict[tuple[str, bool], int] = {}
        self._pending_keys: dict[tuple[str, bool], set[str]] = {}  # a set: a file of n tensors is O(n), not O(n^2)
        self._seq: dict[str, int] = {}

    def declare_field(self, field_name: str) -> None:
        check_field_name(field_name)
        self.tensors.setdefault(field_name, {})

    def add_array(
        self,
        field_name: str,
        name: str,
        data: Array,
        dtype: str,
        *,
        global_shape: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> list[Placement]:
        """Plan one array (C-contiguous, little-endian): a tensor, or one chunk of a sharded tensor
        (``global_shape`` and ``offsets`` given). Returns, in order, the chunks to write; a chunk the base holds
        is added to :attr:`references` instead."""
        if (field_name, name) in self._split:
            raise UsageError("tensor was already written", field=field_name, tensor=name)
        at = tuple(int(o) for o in offsets) if offsets is not None else (0,) * data.ndim
        whole = self.entry_codec(dtype, data.nbytes).name == RAW or data.nbytes <= ENCODED_FILE_BYTES
        pieces = [(data, at)] if whole else cut(data, at, ENCODED_FILE_BYTES)
        if len(pieces) > 1:
            self._split.add((field_name, name))
            global_shape = data.shape if global_shape is None else global_shape
        out: list[Placement] = []
        for piece, piece_offsets in pieces:
            gshape, offs = self.declare(
                field_name,
                name,
                dtype=dtype,
                shape=piece.shape,
                global_shape=global_shape,
                offsets=offsets if len(pieces) == 1 else piece_offsets,
            )
            found = None if self.base is None else self.base.match(field_name, name, dtype, gshape, offs, piece)
            if found is not None:
                self.references.append(
                    PlacedChunk(field=field_name, tensor=name, dtype=dtype, global_shape=gshape, chunk=found[0])
                )
                continue
            codec = self._delta_codec(field_name, name, dtype, gshape, offs, piece)
            entry, full = self.place(field_name, name, dtype, piece.shape, gshape, offs, piece.nbytes, codec=codec)
            out.append(Placement(full=tuple(full), entry=entry, data=piece))
        return out

    def _delta_codec(
        self, field_name: str, name: str, dtype: str, gshape: Shape, offs: Shape, piece: Array
    ) -> WriteCodec | None:
        """With ``xor-zstd``: the codec of a chunk to write, encoded against the base's chunk when it has one
        (spec/delta.md), else plain ``zstd`` with the same options (a keyframe); None: the usual choice."""
        if self.codec.name != XOR_ZSTD or self.entry_codec(dtype, piece.nbytes).name == RAW:
            return None
        options = self.codec.options if isinstance(self.codec.options, XorOptions) else XorOptions()
        source = None if self.base is None else self.base.delta(field_name, name, dtype, gshape, offs, piece.shape)
        if source is None:
            return WriteCodec(name="zstd", options=options.zstd)
        return WriteCodec(name=XOR_ZSTD, options=replace(options, source=source))

    def entry_codec(self, dtype: str, nbytes: int) -> WriteCodec:
        """The codec a chunk of ``nbytes`` of ``dtype`` is written with (the one place it is chosen)."""
        return writer_codec(self.codec, dtype=dtype, nbytes=nbytes)

    def add(
        self,
        field_name: str,
        name: str,
        *,
        dtype: str,
        shape: Sequence[int],
        nbytes: int,
        global_shape: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> tuple[EntryPlan, list[FilePlan]]:
        """Plan one tensor, or one chunk of a sharded tensor (``global_shape`` and ``offsets`` given)."""
        gshape, offs = self.declare(
            field_name, name, dtype=dtype, shape=shape, global_shape=global_shape, offsets=offsets
        )
        return self.place(field_name, name, dtype, tuple(int(d) for d in shape), gshape, offs, nbytes)

    def declare(
        self,
        field_name: str,
        name: str,
        *,
        dtype: str,
        shape: Sequence[int],
        global_shape: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> tuple[Shape, Shape]:
        """Check and record one chunk without placing it in a file (a referenced chunk is declared only);
        returns its global shape and offsets."""
        check_field_name(field_name)
        problem = tensor_name_problem(name)
        if problem:
            raise UsageError(problem, field=field_name, tensor=name)
        shape = tuple(int(d) for d in shape)
        if (global_shape is None) != (offsets is None):
            raise UsageError(
                "give both global_shape and offsets for a chunk, or neither", field=field_name, tensor=name
            )
        gshape = shape if global_shape is None else tuple(int(d) for d in global_shape)
        offs = (0,) * len(shape) if offsets is None else tuple(int(o) for o in offsets)
        if len(gshape) != len(shape) or len(offs) != len(shape):
            raise UsageError(
                f"chunk of rank {len(shape)} does not match global_shape {list(gshape)} / offsets {list(offs)}",
                field=field_name,
                tensor=name,
            )
        for d in range(len(shape)):
            if offs[d] < 0 or offs[d] + shape[d] > gshape[d]:
                raise ChunkLayoutError(
                    f"chunk of shape {list(shape)} at {list(offs)} lies outside {list(gshape)}",
                    field=field_name,
                    tensor=name,
                )
        sharded = global_shape is not None
        tensors = self.tensors.setdefault(field_name, {})
        decl = tensors.get(name)
        if decl is None:
            decl = tensors[name] = _TensorDecl(dtype=dtype, shape=gshape, sharded=sharded)
        elif not (decl.sharded and sharded):
            raise UsageError("tensor was already written", field=field_name, tensor=name)
        elif decl.dtype != dtype or decl.shape != gshape:
            raise UsageError(
                f"chunk is {dtype}{list(gshape)} but earlier chunks said {decl.dtype}{list(decl.shape)}",
                field=field_name,
                tensor=name,
            )
        if sharded:
            if decl.chunk_offsets is None:
                decl.chunk_offsets = set()
            if offs in decl.chunk_offsets:
                raise UsageError(f"chunk at {list(offs)} was already written", field=field_name, tensor=name)
            decl.chunk_offsets.add(offs)
        return gshape, offs

    def place(
        self,
        field_name: str,
        name: str,
        dtype: str,
        shape: Shape,
        gshape: Shape,
        offs: Shape,
        nbytes: int,
        *,
        codec: WriteCodec | None = None,
    ) -> tuple[EntryPlan, list[FilePlan]]:
        """Put a declared chunk in a data file (``codec``: its codec, when not :meth:`entry_codec`'s); returns its
        entry and the plans of files that became full."""
        whole = offs == (0,) * len(shape) and shape == gshape
        key = name if whole else f"{name}@{','.join(map(str, offs))}"
        entry = EntryPlan(
            field=field_name,
            tensor=name,
            key=key,
            dtype=dtype,
            shape=shape,
            offsets=offs,
            global_shape=gshape,
            nbytes=nbytes,
            codec=self.entry_codec(dtype, nbytes) if codec is None else codec,
        )
        slot = (field_name, entry.encoded)
        # An encoded file is built in memory before it is written (its header needs the stored sizes).
        target = min(self.target_file_size, ENCODED_FILE_BYTES) if entry.encoded else self.target_file_size
        full: list[FilePlan] = []
        pending = self._pending.setdefault(slot, [])
        over = pending and self._pending_bytes[slot] + nbytes > target
        # A tensor named like another's chunk key ("t@0"): keys need only be unique within a file.
        clash = key in self._pending_keys.get(slot, ())
        if over or clash:
            full.append(self._close_file(slot))
        self._pending.setdefault(slot, []).append(entry)
        self._pending_keys.setdefault(slot, set()).add(key)
        self._pending_bytes[slot] = self._pending_bytes.get(slot, 0) + nbytes
        return entry, full

    def finish(self) -> list[FilePlan]:
        """Plans of every file still open."""
        return [self._close_file(slot) for slot in list(self._pending) if self._pending[slot]]

    def _close_file(self, slot: tuple[str, bool]) -> FilePlan:
        field_name = slot[0]
        entries = tuple(self._pending.pop(slot))
        self._pending_keys.pop(slot, None)
        self._pending_bytes[slot] = 0
        seq = self._seq.get(field_name, 0)
        self._seq[field_name] = seq + 1
        return FilePlan(field=field_name, path=layout.data_path(field_name, self.rank, seq), entries=entries)


def cut(data: Array, base: Shape, limit: int) -> list[tuple[Array, Shape]]:
    """Blocks of at most ``limit`` bytes along the first dimension longer than 1 (contiguous views, since
    every earlier dimension is 1), cutting a single slice further when it alone exceeds ``limit``: an array
    to encode is cut so, so that the memory of one encode stays bounded at any tensor size."""
    axis = next((d for d, n in enumerate(data.shape) if n > 1), None)
    if data.nbytes <= limit or axis is None:
        return [(data, base)]
    row = data.nbytes // data.shape[axis]
    step = max(1, limit // max(1, row))
    out: list[tuple[Array, Shape]] = []
    for lo in range(0, data.shape[axis], step):
        index = tuple(slice(lo, lo + step) if d == axis else slice(None) for d in range(data.ndim))
        at = tuple(o + (lo if d == axis else 0) for d, o in enumerate(base))
        out.extend(cut(data[index], at, limit) if row > limit else [(data[index], at)])
    return out


def merge_results(
    results: Iterable[RankResult], *, profile: str, metadata: Mapping[str, str] | None = None
) -> Manifest:
    """The global step: every rank's records joined into one manifest, checked as a reader would.

    Refuses two ranks writing the same file, a tensor whose ranks disagree on dtype or global shape,
    chunks that do not tile a tensor exactly (gap, overlap, out of bounds), two context blobs for one
    field, and a profile's missing field.
    """
    files: dict[str, FileRecord] = {}
    contexts: dict[str, str] = {}
    tensor_fields: set[str] = set()
    bases: dict[str, BaseRecord] = {}
    decls: dict[str, dict[str, tuple[str, Shape, list[ChunkRecord]]]] = {}
    for result in sorted(results, key=lambda r: r.rank):
        for f in result.files:
            if f.path in files:
                raise ChunkLayoutError(f"two ranks wrote the same file (rank {result.rank} among them)", path=f.path)
            files[f.path] = f
        for fname, path in result.contexts.items():
            if fname in contexts:
                raise ChunkLayoutError(f"two ranks wrote a context for this field (rank {result.rank})", field=fname)
            contexts[fname] = path
        tensor_fields.update(result.tensor_fields)
        for base in result.bases:
            bases[base.location] = _join_base(bases.get(base.location), base)
        for placed in result.chunks:
            tensors = decls.setdefault(placed.field, {})
            known = tensors.get(placed.tensor)
            if known is None:
                tensors[placed.tensor] = (placed.dtype, placed.global_shape, [placed.chunk])
            elif (known[0], known[1]) != (placed.dtype, placed.global_shape):
                raise ChunkLayoutError(
                    f"rank {result.rank} wrote {placed.dtype}{list(placed.global_shape)}, another rank "
                    f"{known[0]}{list(known[1])}",
                    field=placed.field,
                    tensor=placed.tensor,
                )
            else:
                known[2].append(placed.chunk)
    fields: dict[str, FieldRecord] = {}
    for name in sorted(tensor_fields | set(decls) | set(contexts)):
        context = contexts.get(name)
        if name not in tensor_fields and name not in decls:
            fields[name] = FieldRecord(kind="context", context=context)
            continue
        records: dict[str, TensorRecord] = {}
        for tname, (dtype, shape, chunk_list) in sorted(decls.get(name, {}).items()):
            ordered = tuple(sorted(chunk_list, key=lambda c: c.offsets))
            problem = geometry.coverage_problem(shape, [(c.offsets, c.shape) for c in ordered])
            if problem:
                raise ChunkLayoutError(f"chunks do not tile shape {list(shape)}: {problem}", field=name, tensor=tname)
            records[tname] = TensorRecord(dtype=dtype, shape=shape, chunks=ordered)
        fields[name] = FieldRecord(kind="tensors", tensors=records, context=context)
    for name, kind in PROFILES[profile].items():
        if name not in fields or fields[name].kind != kind:
            raise MissingFieldError(
                f"profile {profile!r} requires field {name!r} of kind {kind!r}; nothing was committed", field=name
            )
    chunks = [c for f in fields.values() for t in f.tensors.values() for c in t.chunks]
    encoded = any(c.codec.name != RAW for c in chunks)
    digests = [*(c.digest for c in chunks), *(f.digest for f in files.values())]
    digests += [f.digest for b in bases.values() for f in b.files]
    version = (
        TREE_VERSION
        if any(is_tree(algorithm_of(d)) for d in digests)
        else DELTA_VERSION
        if any(c.codec.name == XOR_ZSTD for c in chunks)
        else BLOCKS_VERSION
        if any(c.blocks is not None for c in chunks)
        else ENCODED_VERSION
        if encoded
        else RAW_VERSION
    )
    used = {(c.base, c.stored_path) for c in chunks if c.base is not None}
    used |= {level for c in chunks for level in chain_files(c.codec)}  # a delta's bases, at every depth (DLT-6)
    listed = {(b.location, f.path) for b in bases.values() for f in b.files}
    if used != listed:
        raise ChunkLayoutError(f"referenced files and base records disagree: {sorted(used ^ listed)[:3]}")
    return Manifest(
        format_version=version,  # VER-1: the lowest version whose additions it uses
        profile=profile,
        files=tuple(files[p] for p in sorted(files)),
        fields=fields,
        metadata=dict(metadata or {}),
        bases=tuple(bases[loc] for loc in sorted(bases)),
    )


def _join_base(known: BaseRecord | None, new: BaseRecord) -> BaseRecord:
    """Two ranks' records of one base: the same checkpoint, their files joined (one record per path)."""
    if known is None:
        return new
    if known.checkpoint_id != new.checkpoint_id:
        raise ChunkLayoutError(
            f"ranks reference two checkpoints at {new.location}: {known.checkpoint_id} and {new.checkpoint_id}"
        )
    files = {f.path: f for f in known.files}
    for f in new.files:
        if files.setdefault(f.path, f) != f:
            raise ChunkLayoutError(f"ranks disagree on base file {new.location}/{f.path}")
    return BaseRecord(
        location=known.location, checkpoint_id=known.checkpoint_id, files=tuple(files[p] for p in sorted(files))
    )
