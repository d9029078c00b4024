"""Tree digests (spec/tree-digests.md, format 1.3): chunk and file digests derived from the digests of 64 KiB
pieces, so that a writer, a snapshot, a persist and a verification hash each byte once.

- A **piece** is ``LEAF_BYTES`` bytes of a segment (the last one shorter); its digest is the flat digest (the
  base algorithm: ``xxh3-128`` for ``xxh3-128-tree``) of its bytes. Pieces of a chunk are its blocks when the
  chunk has ``blocks`` of that size (spec/blocks.md), so block digests cost nothing more.
- A **chunk tree** digest hashes ``CHUNK_DOMAIN`` and, per piece, its length (u64 LE) and its raw digest.
- A segment's **entry digest** is its flat digest when it is at most one piece long, else its chunk tree digest:
  what the reference writer writes as the chunk digest, both computed from the same pieces.
- A **file tree** digest (of a safetensors data file) hashes ``FILE_DOMAIN`` and, per segment (the header with
  its length prefix and padding, then every non-empty entry in offset order), its length (u64 LE) and its raw
  entry digest. The segments come from the file's own header, so the digest is a function of the file's bytes
  alone: a persist, a peer copy or a heal checks it without the manifest.
"""

from __future__ import annotations

import struct

from .blocks import BlockHasher
from .digests import Hasher, base_algorithm, digest_of, format_digest, is_tree, new_hasher
from .errors import SafetensorsHeaderError
from .safetensors_io import MAX_HEADER_BYTES, header_entries

LEAF_BYTES = 1 << 16  # the default block size: a raw chunk's blocks are its pieces (spec/blocks.md)
CHUNK_DOMAIN = b"ckptfmt/tree/chunk"
FILE_DOMAIN = b"ckptfmt/tree/file"


def _combine(base: str, domain: bytes, leaves: list[tuple[int, bytes]]) -> str:
    hasher = new_hasher(base)
    hasher.update(domain + b"".join(struct.pack("<Q", nbytes) + raw for nbytes, raw in leaves))
    return hasher.hexdigest()


_WHOLE_LEAF = struct.pack("<Q", LEAF_BYTES)


def _piece_records(nbytes: int, pieces_hex: str) -> bytes:
    """Every piece's record (its length, u64 LE, then its raw digest) of a segment of ``nbytes`` bytes whose pieces
    hash to ``pieces_hex``, back to back: built by joins, not a Python step per piece (4096 pieces a 256 MiB
    snapshot hashes on the trainer's spare core, under the GIL)."""
    count = -(-nbytes // LEAF_BYTES)
    if not count:
        return b""
    raw = bytes.fromhex(pieces_hex)
    width = len(raw) // count
    pieces = [raw[i : i + width] for i in range(0, count * width, width)]
    last = struct.pack("<Q", nbytes - (count - 1) * LEAF_BYTES) + pieces[-1]
    if count == 1:
        return last
    return _WHOLE_LEAF + _WHOLE_LEAF.join(pieces[:-1]) + last


def chunk_tree_hex(base: str, nbytes: int, pieces_hex: str) -> str:
    """The hex of the chunk tree digest of ``nbytes`` bytes whose pieces hash to ``pieces_hex`` (back to back)."""
    hasher = new_hasher(base)
    hasher.update(CHUNK_DOMAIN + _piece_records(nbytes, pieces_hex))
    return hasher.hexdigest()


def entry_digest(algorithm: str, nbytes: int, pieces_hex: str) -> str:
    """The digest a writer under ``algorithm`` (a tree one) gives a segment of ``nbytes`` bytes: flat when it is
    one piece or none (that piece's digest: no second hash), else its chunk tree digest."""
    base = base_algorithm(algorithm)
    if nbytes > LEAF_BYTES:
        return f"{base}-tree:{chunk_tree_hex(base, nbytes, pieces_hex)}"
    return f"{base}:{pieces_hex}" if nbytes else digest_of(base, b"")


def file_tree_hex(algorithm: str, leaves: list[tuple[int, str]]) -> str:
    """The hex of a file tree digest from its segments' (length, entry digest), in order, empty ones left out."""
    return _combine(
        base_algorithm(algorithm), FILE_DOMAIN, [(n, bytes.fromhex(d.partition(":")[2])) for n, d in leaves]
    )


def chunk_digest_from_pieces(algorithm: str, nbytes: int, pieces_hex: str) -> str | None:
    """The digest under ``algorithm`` of a chunk whose pieces hash to ``pieces_hex``, or None when the pieces do
    not give it (a flat digest of more than one piece)."""
    base = base_algorithm(algorithm)
    if is_tree(algorithm):
        return f"{algorithm}:{chunk_tree_hex(base, nbytes, pieces_hex)}"
    return entry_digest(algorithm, nbytes, pieces_hex) if nbytes <= LEAF_BYTES else None


def chunk_digest_of(algorithm: str, data: bytes | memoryview) -> str:
    """The digest of a chunk's stored bytes under ``algorithm``, flat or tree (TEN-11, TRE-1)."""
    if not is_tree(algorithm):
        return digest_of(algorithm, data)
    pieces = BlockHasher(base_algorithm(algorithm), LEAF_BYTES)
    pieces.update(memoryview(data))
    result = chunk_digest_from_pieces(algorithm, len(data), pieces.finish().digests)
    assert result is not None
    return result


def file_hasher(algorithm: str) -> Hasher:
    """A hasher of a whole file's bytes, in order, under ``algorithm``: flat, or a data file's file tree digest."""
    return FileTreeHasher(algorithm) if is_tree(algorithm) else new_hasher(algorithm)


def file_digest_of(algorithm: str, data: bytes | memoryview) -> str:
    """The digest of a whole file's bytes under ``algorithm`` (a file record's, DIG-4, TRE-1)."""
    hasher = file_hasher(algorithm)
    hasher.update(data)
    return format_digest(algorithm, hasher)


class FileTreeHasher:
    """A file's bytes in order in, its file tree digest out (the :class:`~ckptfmt.digests.Hasher` protocol).

    The header is held until it is whole (at most ``MAX_HEADER_BYTES``, SAF-2) to find the segments. A file that
    is not a data file (its header refused, bytes missing or left over) has no file tree digest: ``hexdigest``
    then returns a text that is no digest, so it differs from every manifest's, and ``problem`` says why.
    ``keep_pieces``: remember every segment's piece digests (``pieces``: begin -> (end, hex)), from which a
    verification derives chunk and block digests without hashing the bytes again (1/4096 of the file for
    xxh3-128)."""

    def __init__(self, algorithm: str, *, keep_pieces: bool = False) -> None:
        self._base = base_algorithm(algorithm)
        self._keep = keep_pieces
        self._head: bytearray | None = bytearray()
        self._segments: list[tuple[int, int]] = []
        self._index = 0
        self._position = 0
        self._hasher: BlockHasher | None = None
        self._tree = new_hasher(self._base)
        self._tree.update(FILE_DOMAIN)
        self.pieces: dict[int, tuple[int, str]] = {}
        self.problem: str | None = None

    def update(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data)
        if self.problem is not None:
            return
        head = self._head
        if head is not None:
            if len(head) < 8:
                take = min(len(view), 8 - len(head))
                head += view[:take]
                view = view[take:]
                if len(head) < 8:
                    return
                (length,) = struct.unpack_from("<Q", head)
                if length > MAX_HEADER_BYTES:
                    self.problem = f"not a data file: header length {length} exceeds {MAX_HEADER_BYTES} (SAF-2)"
                    return
            want = 8 + struct.unpack_from("<Q", head)[0]
            take = min(len(view), want - len(head))
            head += view[:take]
            view = view[take:]
            if len(head) < want:
                return
            self._start(bytes(head))
            if self.problem is not None:
                return
        self._feed(view)

    def _start(self, head: bytes) -> None:
        """The whole header is in: find the segments, then hash the header as the first of them."""
        self._head = None
        try:
            entries, end = header_entries(head[8:], path="")
        except SafetensorsHeaderError as exc:
            self.problem = f"not a data file: {exc.message} ({exc.requirement})"
            return
        spans = sorted((e.begin, e.end) for e in entries.values() if e.end > e.begin)
        self._segments = [(0, len(head)), *spans]
        assert self._segments[-1][1] == end
        self._feed(memoryview(head))

    def _feed(self, view: memoryview) -> None:
        while len(view):
            if self._index == len(self._segments):
                self.problem = "not a data file: bytes after the end of its data section (SAF-11)"
                return
            begin, end = self._segments[self._index]
            if self._hasher is None:
                self._hasher = BlockHasher(self._base, LEAF_BYTES)
            take = min(end - self._position, len(view))
            self._hasher.update(view[:take])
            self._position += take
            view = view[take:]
            if self._position == end:
                pieces = self._hasher.finish().digests
                digest = entry_digest(self._base, end - begin, pieces).partition(":")[2]
                self._tree.update(struct.pack("<Q", end - begin) + bytes.fromhex(digest))
                if self._keep:
                    self.pieces[begin] = (end, pieces)
                self._index += 1
                self._hasher = None

    def hexdigest(self) -> str:
        if self.problem is None and (self._head is not None or self._index < len(self._segments)):
            self.problem = "not a data file: shorter than its header says (SAF-3, SAF-11)"
        if self.problem is not None:
            return f"none ({self.problem})"
        return self._tree.hexdigest()


__all__ = [
    "CHUNK_DOMAIN",
    "FILE_DOMAIN",
    "LEAF_BYTES",
    "FileTreeHasher",
    "chunk_digest_from_pieces",
    "chunk_digest_of",
    "chunk_tree_hex",
    "entry_digest",
    "file_digest_of",
    "file_hasher",
    "file_tree_hex",
]
