"""Delta chunks (spec/delta.md): the base bytes an ``xor-zstd`` chunk is XORed with, found and checked.

Reader side: :func:`xor_base` takes the XORed bytes of a raw range of a delta chunk (decoded by the codec) and
XORs into them the same raw range of its base chunk: the base record named by the configuration (DLT-2), its file
opened through the checkpoint's routed store (REF-7, REF-8, REF-16, REF-17 as for a referenced chunk, DLT-5), the
base chunk's stored bytes checked against the digest the configuration records (DLT-4), decoded by its own codec,
and, when the base chunk is itself a delta, XORed with its base in turn (at most ``MAX_DEPTH`` deep, DLT-3).

Writer side: :func:`chain_files` lists the (location, path) of every base file a chunk's codec names, which the
manifest's base records must list (DLT-6) and retention keeps (REF-13).
"""

from __future__ import annotations

from collections.abc import Iterator

from .codecs import get_codec
from .codecs.xor_zstd import MAX_DEPTH, NAME, XorConfiguration, xor_into
from .digest_checks import Span
from .digests import algorithm_of
from .errors import DigestMismatchError, ManifestError
from .file_checks import FileChecks
from .manifest import RAW, ChunkRecord, Codec
from .references import virtual_path
from .storage import Store
from .tree_digests import chunk_digest_of


def chain_files(codec: Codec) -> Iterator[tuple[str, str]]:
    """(base location, path in that base) of every base chunk an ``xor-zstd`` codec names, at every depth."""
    if codec.name != NAME:
        return
    for _, config in XorConfiguration.from_dict(codec.configuration).chain():
        yield config.base, config.chunk.path


def xor_base(
    store: Store,
    checks: FileChecks,
    config: XorConfiguration,
    raw_begin: int,
    raw_end: int,
    out: memoryview,
    *,
    raw_size: int,
    itemsize: int,
    verify: bool,
    depth: int = 1,
) -> int:
    """XOR into ``out`` the raw bytes ``[raw_begin, raw_end)`` of ``config``'s base chunk (of ``raw_size`` raw bytes
    in all); returns the stored bytes read. Raises before it reads a byte of a base it cannot trust."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"a delta chain deeper than {MAX_DEPTH}", requirement="DLT-3")
    chunk = config.chunk
    record = next((b for b in checks.manifest.bases if b.location == config.base), None)
    if record is None:
        raise ManifestError(f"xor-zstd base {config.base!r} is not the location of a base record", requirement="DLT-2")
    file = next((f for f in record.files if f.path == chunk.path), None)
    if file is None or chunk.end > file.size:
        raise ManifestError(
            f"xor-zstd base chunk {chunk.path!r} [{chunk.begin}, {chunk.end}) is not in a file of base record "
            f"{config.base!r}",
            requirement="DLT-2",
        )
    path = virtual_path(config.base, chunk.path)
    checks.check(path)  # opens the base: its id, its files (REF-7, REF-8), sizes and header
    codec = chunk.codec
    if codec.name == RAW:
        # unverified: the bytes needed; verified: the blocks they touch, or the whole chunk (its digest covers all)
        lo, hi = raw_begin, raw_end
        if verify:
            lo, hi = (0, chunk.nbytes) if chunk.blocks is None else chunk.blocks.covering(chunk.nbytes, lo, hi)
        stored = memoryview(bytearray(hi - lo))
        store.read_into(path, chunk.begin + lo, stored)
        if verify and (lo, hi) == (0, chunk.nbytes):
            _check_digest(chunk.digest, stored, path)
        elif verify and chunk.blocks is not None:
            as_chunk = ChunkRecord(
                path=path,
                key=chunk.key,
                offsets=(),
                shape=(),
                begin=chunk.begin,
                end=chunk.end,
                digest=chunk.digest,
                blocks=chunk.blocks,
            )
            Span(as_chunk, chunk.begin + lo, chunk.begin + hi, first_block=lo // chunk.blocks.size).check(stored)
        xor_into(out, stored[raw_begin - lo : raw_end - lo])
        return len(stored)
    implementation = get_codec(codec.name, path=path)
    span = implementation.plan_frames(
        codec, stored_size=chunk.nbytes, raw_size=raw_size, raw_begin=raw_begin, raw_end=raw_end
    )
    stored = memoryview(bytearray(span.stored_end - span.stored_begin))
    store.read_into(path, chunk.begin + span.stored_begin, stored)
    if verify and len(stored) == chunk.nbytes:  # a part is checked by its frames' checksums (COD-5)
        _check_digest(chunk.digest, stored, path)
    decoded = memoryview(bytearray(span.raw_end - span.raw_begin))
    implementation.decode_into(codec, stored, span, decoded, itemsize=itemsize)
    read = len(stored)
    if isinstance(span.configuration, XorConfiguration):
        read += xor_base(
            store,
            checks,
            span.configuration,
            span.raw_begin,
            span.raw_end,
            decoded,
            raw_size=raw_size,
            itemsize=itemsize,
            verify=verify,
            depth=depth + 1,
        )
    xor_into(out, decoded[raw_begin - span.raw_begin : raw_end - span.raw_begin])
    return read


def _check_digest(digest: str, stored: memoryview, path: str) -> None:
    actual = chunk_digest_of(algorithm_of(digest), stored)  # a tree digest over a chunk of several pieces too
    if actual != digest:
        raise DigestMismatchError(
            f"the base chunk of an xor-zstd chunk hashes to {actual}; its configuration records {digest}",
            path=path,
            requirement="DLT-4",
        )


__all__ = ["chain_files", "xor_base"]
