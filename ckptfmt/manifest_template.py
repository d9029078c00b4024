"""A manifest's canonical bytes with holes where one save differs from the next of the same tensors: digests, file
sizes, metadata values. A writer that writes the same layout again and again (a memory snapshot every step, with a
:class:`~ckptfmt.plan_cache.PlanCache`) fills the holes instead of merging its records into a manifest and encoding
it as JSON: at 680 tensors that is 1-2 ms of Python under the GIL in place of 6-7.

The template is made from a manifest the ordinary path built (:func:`~ckptfmt.plan.merge_results`), with every value
that may change replaced by a sentinel, rendered by the same encoder, then cut at the sentinels. A rank's records fill
it only when everything else is what that manifest held: the profile, the fields and context files, the metadata's
keys, and per chunk its tensor's dtype and shape, its file, key, offsets, shape, byte range, codec, block size and
digest algorithm, and the same files. Anything else (a new tensor, a file cut elsewhere, a base) returns None, and the
caller builds the manifest as always. The bytes are the ones the ordinary path gives (tests/test_manifest_template.py).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import replace

from .blocks import Blocks
from .canonical import manifest_bytes
from .digests import algorithm_of
from .manifest import ChunkRecord, FieldRecord, FileRecord, Manifest, TensorRecord
from .plan import RankResult

ChunkKey = tuple[str, str, tuple[int, ...]]  # field, tensor, offsets
# what a chunk keeps for its manifest to fit: dtype, global shape, path, key, shape, range, codec, block size, algorithm
ChunkFrame = tuple[object, ...]
# A value that goes into a JSON string as it is: no quote, backslash or control character (our digests: hex and ':')
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')


class ManifestTemplate:
    """The canonical bytes of one manifest, cut where its per-save values go; :meth:`render` fills them."""

    def __init__(
        self,
        *,
        profile: str,
        pieces: tuple[str, ...],
        holes: tuple[tuple[str, object], ...],
        chunks: dict[ChunkKey, ChunkFrame],
        files: dict[str, str],
        contexts: dict[str, str],
        tensor_fields: tuple[str, ...],
        metadata_keys: frozenset[str],
    ) -> None:
        self.profile = profile
        self._pieces = pieces  # len(holes) + 1 texts, a hole between each two
        self._holes = holes  # (kind, key): "digest"/"blocks" of a chunk, "size"/"file" of a file, "metadata"
        self._chunks = chunks
        self._files = files  # path -> digest algorithm
        self._contexts = contexts
        self._tensor_fields = tensor_fields
        self._metadata_keys = metadata_keys

    @classmethod
    def of(cls, manifest: Manifest, result: RankResult) -> ManifestTemplate | None:
        """The template of ``manifest``, merged from ``result`` alone; None when it has nothing to gain or cannot
        be cut (references to a base, an extension)."""
        if manifest.bases or manifest.extensions or result.bases:
            return None
        nonce = secrets.token_hex(8)
        holes: list[tuple[str, object]] = []

        def hole(kind: str, key: object) -> str:
            holes.append((kind, key))
            return f"\ue000{nonce}:{len(holes) - 1}\ue001"

        chunks: dict[ChunkKey, ChunkFrame] = {}
        fields: dict[str, FieldRecord] = {}
        for fname, record in manifest.fields.items():
            tensors: dict[str, TensorRecord] = {}
            for tname, tensor in record.tensors.items():
                cut: list[ChunkRecord] = []
                for chunk in tensor.chunks:
                    key = (fname, tname, chunk.offsets)
                    chunks[key] = _frame(tensor.dtype, tensor.shape, chunk)
                    blocks = (
                        None if chunk.blocks is None else Blocks(size=chunk.blocks.size, digests=hole("blocks", key))
                    )
                    cut.append(replace(chunk, digest=hole("digest", key), blocks=blocks))
                tensors[tname] = replace(tensor, chunks=tuple(cut))
            fields[fname] = replace(record, tensors=tensors)
        files = tuple(
            FileRecord(path=f.path, size=hole("size", f.path), digest=hole("file", f.path))  # type: ignore[arg-type]
            for f in manifest.files
        )
        metadata = {k: hole("metadata", k) for k in manifest.metadata}
        text = manifest_bytes(replace(manifest, fields=fields, files=files, metadata=metadata).to_dict()).decode()
        cuts = re.split(f'"\ue000{nonce}:([0-9]+)\ue001"', text)
        pieces, found = tuple(cuts[0::2]), [int(i) for i in cuts[1::2]]
        if sorted(found) != list(range(len(holes))):
            return None  # each hole once: anything else is not cut safely
        return cls(
            profile=manifest.profile,
            pieces=pieces,
            holes=tuple(holes[i] for i in found),  # in the text's order
            chunks=chunks,
            files={f.path: algorithm_of(f.digest) for f in manifest.files},
            contexts=dict(result.contexts),
            tensor_fields=tuple(result.tensor_fields),
            metadata_keys=frozenset(manifest.metadata),
        )

    def render(self, result: RankResult, *, profile: str, metadata: Mapping[str, str]) -> bytes | None:
        """The manifest :func:`~ckptfmt.plan.merge_results` would build from ``result`` alone, as canonical bytes;
        None when ``result`` does not fit the template (then build it so)."""
        if (
            profile != self.profile
            or result.bases
            or dict(result.contexts) != self._contexts
            or tuple(result.tensor_fields) != self._tensor_fields
            or frozenset(metadata) != self._metadata_keys
            or len(result.chunks) != len(self._chunks)
            or len(result.files) != len(self._files)
        ):
            return None
        known = self._chunks
        chunks: dict[ChunkKey, ChunkRecord] = {}
        for placed in result.chunks:
            chunk = placed.chunk
            at = (placed.field, placed.tensor, chunk.offsets)
            if known.get(at) != _frame(placed.dtype, placed.global_shape, chunk):
                return None
            chunks[at] = chunk
        files = {f.path: f for f in result.files}
        if len(chunks) != len(known) or any(algorithm_of(f.digest) != self._files.get(p) for p, f in files.items()):
            return None
        values: list[str] = []
        plain: list[str] = []  # the string values spliced as they are
        for kind, key in self._holes:
            if kind == "size":
                values.append(str(int(files[key].size)))  # type: ignore[index]
                continue
            if kind == "metadata":
                values.append(json.dumps(metadata[key], ensure_ascii=False))  # type: ignore[index]
                continue
            if kind == "digest":
                value = chunks[key].digest  # type: ignore[index]
            elif kind == "blocks":
                blocks = chunks[key].blocks  # type: ignore[index]
                assert blocks is not None  # the frame holds a block size: the blocks are there
                value = blocks.digests
            else:
                value = files[key].digest  # type: ignore[index]
            plain.append(value)
            values.append(f'"{value}"')
        if not _PLAIN.fullmatch("".join(plain)):
            return None  # a value the encoder would escape: not for splicing
        out = [self._pieces[0]]
        for value, piece in zip(values, self._pieces[1:], strict=True):
            out.append(value)
            out.append(piece)
        return "".join(out).encode()


def _frame(dtype: str, global_shape: tuple[int, ...], chunk: ChunkRecord) -> ChunkFrame:
    return (
        dtype,
        global_shape,
        chunk.path,
        chunk.key,
        chunk.shape,
        chunk.begin,
        chunk.end,
        chunk.codec,
        None if chunk.blocks is None else chunk.blocks.size,
        chunk.base,
        algorithm_of(chunk.digest),
    )


__all__ = ["ManifestTemplate"]
