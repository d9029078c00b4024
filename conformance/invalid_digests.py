"""Invalid vectors about digests beyond xxh3-128 mismatches (spec/digests.md), part of invalid_manifest.py's table.

- ``DIGEST_SHA256``: each digest-mismatch vector again with every digest of the checkpoint in
  ``sha256``, so that a reader that never checks sha256 digests fails (DIG-4).
- ``DIGEST_SYNTAX``: digests that are malformed (DIG-2, DIG-3) yet spell the right value, so that a
  reader without the syntax check computes a matching digest and accepts; only the syntax check
  refuses them, and a reader that answers with DIG-4 refuses for the wrong reason.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptfmt.digests import digest_of

from .edits import DATA, Mutation, chain, set_file
from .invalid import PROV, Invalid, flip_blob_text, flip_chunk_byte
from .mutations import Json, Tree


def all_sha256(t: Tree) -> None:
    """Rewrite every file and chunk digest of the checkpoint as sha256 (the bytes stay)."""

    def fn(doc: Json) -> None:
        for record in doc["files"]:
            record["digest"] = digest_of("sha256", t.read(record["path"]))
        for field in doc["fields"].values():
            for tensor in field.get("tensors", {}).values():
                for chunk in tensor["chunks"]:
                    begin, end = chunk["range"]
                    chunk["digest"] = digest_of("sha256", t.read(chunk["path"])[begin:end])

    t.edit(fn)


def _chunk_w(doc: Json) -> Json:
    chunk: Json = doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]
    return chunk


def _data_record(doc: Json) -> Json:
    record: Json = next(r for r in doc["files"] if r["path"] == DATA)
    return record


def respell(where: str, fn: Callable[[str], str]) -> Mutation:
    """A mutation that rewrites the digest of chunk w (``where="chunk"``) or of the data file's record."""

    def run(t: Tree) -> None:
        def edit(doc: Json) -> None:
            record = _chunk_w(doc) if where == "chunk" else _data_record(doc)
            record["digest"] = fn(record["digest"])

        t.edit(edit)

    return run


DIGEST_SHA256: tuple[Invalid, ...] = (
    Invalid(
        "chunk-digest-mismatch-sha256",
        ("DIG-4",),
        "Every digest in sha256; one bit of chunk w flipped, the file's size and digest updated, the chunk digest not.",
        chain(all_sha256, flip_chunk_byte),
        scope="tensor",
    ),
    Invalid(
        "file-digest-mismatch-sha256",
        ("DIG-4",),
        "Every digest in sha256; the data file's digest is that of other bytes, every chunk digest matches.",
        chain(all_sha256, set_file(DATA, "digest", digest_of("sha256", b"other"))),
        scope="file",
    ),
    Invalid(
        "blob-digest-mismatch-sha256",
        ("DIG-4",),
        "Every digest in sha256; a character of the provenance blob changed, the manifest was not updated.",
        chain(all_sha256, flip_blob_text),
        scope="blob",
    ),
)

DIGEST_SYNTAX: tuple[Invalid, ...] = (
    Invalid(
        "digest-uppercase-sha256",
        ("DIG-3",),
        "Every digest in sha256; chunk w's is its right value in uppercase hex.",
        chain(all_sha256, respell("chunk", lambda d: "sha256:" + d.partition(":")[2].upper())),
    ),
    Invalid(
        "digest-algorithm-uppercase",
        ("DIG-2",),
        "Every digest in sha256; the data file's is 'SHA256:' and its right value (names are case-sensitive).",
        chain(all_sha256, respell("file", lambda d: "SHA256:" + d.partition(":")[2])),
    ),
    Invalid(
        "digest-trailing-newline",
        ("DIG-3",),
        "The data file's digest is its right xxh3-128 value followed by a newline.",
        respell("file", lambda d: d + "\n"),
    ),
    Invalid(
        "digest-hex-prefix",
        ("DIG-3",),
        "Chunk w's digest is its right xxh3-128 value written with a 0x prefix.",
        respell("chunk", lambda d: "xxh3-128:0x" + d.partition(":")[2]),
    ),
    Invalid(
        "digest-no-algorithm",
        ("DIG-2",),
        "The provenance blob's digest is its right xxh3-128 hex value without the 'xxh3-128:' prefix.",
        lambda t: t.edit(
            lambda doc: next(r for r in doc["files"] if r["path"] == PROV).update(
                digest=digest_of("xxh3-128", t.read(PROV)).partition(":")[2]
            )
        ),
        scope="blob",
    ),
)
