"""Invalid vectors about the manifest: parsing, properties, versions, paths and digests (spec/manifest.md,
versioning.md, paths.md, digests.md, commit.md). Helpers and the record type are in conformance/invalid.py.
"""

from __future__ import annotations

import shutil

from ckptfmt.digests import digest_of

from .edits import (
    DATA,
    add_field,
    chain,
    delete,
    delete_file_member,
    manifest,
    raw_manifest,
    replace_in_manifest,
    set_,
    set_file,
)
from .invalid import (
    EXTRA_CTX,
    PROV,
    PROV_REF,
    C,
    Invalid,
    directory_blob,
    dup_member,
    flip_blob_text,
    flip_chunk_byte,
    long_path,
    symlink_dir,
    symlink_file,
    truncate,
)
from .invalid_digests import DIGEST_SHA256, DIGEST_SYNTAX
from .mutations import Tree


def manifest_symlink(t: Tree) -> None:
    (t.root / "manifest.json").rename(t.root / "manifest-target.json")
    (t.root / "manifest.json").symlink_to("manifest-target.json")


def _weights_dir_is_a_file(t: Tree) -> None:
    shutil.rmtree(t.root / "weights")
    (t.root / "weights").write_bytes(b"not a directory")


def _dangling_data_file(t: Tree) -> None:
    (t.root / DATA).unlink()
    (t.root / DATA).symlink_to("gone.safetensors")


VECTORS: tuple[Invalid, ...] = (
    # ---- commit, manifest parsing
    Invalid(
        "no-manifest",
        ("COM-15",),
        "Files but no manifest.json: an incomplete checkpoint.",
        lambda t: (t.root / "manifest.json").unlink(),
    ),
    Invalid(
        "manifest-not-utf8",
        ("MAN-4",),
        "An unknown member's string holds the byte ff.",
        replace_in_manifest('"fields"', '"x":"\udcff","fields"'),
    ),
    Invalid(
        "manifest-not-json",
        ("MAN-4",),
        "The closing brace is missing.",
        lambda t: t.set_raw_manifest(t.raw_manifest()[:-1]),
    ),
    Invalid(
        "manifest-not-object",
        ("MAN-4",),
        "The manifest is a JSON array holding the manifest object.",
        lambda t: t.set_raw_manifest(b"[" + t.raw_manifest() + b"]"),
    ),
    Invalid(
        "manifest-duplicate-member",
        ("MAN-5",),
        "The top-level member format appears twice, with the same value.",
        dup_member,
    ),
    Invalid(
        "manifest-duplicate-member-deep",
        ("MAN-5",),
        "A chunk record has its key member twice, with the same value.",
        replace_in_manifest('"key":"w",', '"key":"w","key":"w",'),
    ),
    Invalid(
        "manifest-duplicate-member-escaped",
        ("MAN-5",),
        'The top-level member format appears twice, once spelled "form\\u0061t" (the same name after unescaping).',
        raw_manifest(lambda b: b[:-1] + b',"form\\u0061t":"ckptfmt"}'),
    ),
    Invalid(
        "manifest-symlink",
        ("MAN-25",),
        "manifest.json is a symbolic link to manifest-target.json, a regular file holding the manifest.",
        manifest_symlink,
    ),
    Invalid(
        "manifest-nesting-65",
        ("MAN-26",),
        "An unknown top-level member holds arrays nested 64 deep: level 65 counting the manifest object.",
        raw_manifest(lambda b: b[:-1] + b',"x":' + b"[" * 64 + b"]" * 64 + b"}"),
    ),
    Invalid(
        "manifest-nesting-10000",
        ("MAN-26",),
        "An unknown top-level member holds arrays nested 10,000 deep (recursive parsers overflow).",
        raw_manifest(lambda b: b[:-1] + b',"x":' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    ),
    Invalid(
        "manifest-integer-21-digits",
        ("MAN-26",),
        "An unknown top-level member is the integer 100000000000000000000 (21 digits).",
        raw_manifest(lambda b: b[:-1] + b',"x":100000000000000000000}'),
    ),
    Invalid(
        "manifest-integer-5000-digits",
        ("MAN-26",),
        "An unknown top-level member is an integer of 5,000 digits.",
        raw_manifest(lambda b: b[:-1] + b',"x":' + b"9" * 5000 + b"}"),
    ),
    Invalid(
        "manifest-bom",
        ("MAN-27",),
        "The manifest begins with a UTF-8 byte order mark (ef bb bf).",
        raw_manifest(lambda b: b"\xef\xbb\xbf" + b),
        also=("MAN-4",),  # RFC 8259 lets a parser refuse a BOM as no JSON text
    ),
    Invalid(
        "manifest-lone-surrogate",
        ("MAN-27",),
        'An unknown top-level member is the string "\\ud800" (a lone high surrogate escape).',
        raw_manifest(lambda b: b[:-1] + b',"x":"\\ud800"}'),
    ),
    Invalid(
        "manifest-lone-low-surrogate-name",
        ("MAN-27",),
        'An unknown top-level member is named "\\udc00x" (a lone low surrogate escape).',
        raw_manifest(lambda b: b[:-1] + b',"\\udc00x":1}'),
    ),
    Invalid("manifest-size-string", ("MAN-7",), "A file record's size is a string.", set_file(DATA, "size", "1")),
    Invalid("manifest-metadata-int", ("MAN-7",), "A metadata value is an integer.", set_(("metadata",), {"k": 1})),
    Invalid(
        "manifest-extension-configuration-string",
        ("MAN-7",),
        "A must_understand=false extension whose configuration is a string, not an object.",
        set_(("extensions",), [{"configuration": "x", "must_understand": False, "name": "org.example.x"}]),
    ),
    Invalid(
        "manifest-format-version-number",
        ("MAN-7",),
        "format_version is the JSON integer 1.",
        set_(("format_version",), 1),
    ),
    Invalid("format-missing", ("MAN-8",), "No format member.", delete(("format",))),
    Invalid("format-wrong", ("MAN-8",), "format is 'ckptfmt2'.", set_(("format",), "ckptfmt2")),
    Invalid("format-version-missing", ("MAN-9",), "No format_version member.", delete(("format_version",))),
    Invalid("profile-missing", ("MAN-10",), "No profile member.", delete(("profile",))),
    Invalid("files-missing", ("MAN-11",), "No files member.", delete(("files",))),
    Invalid("fields-missing", ("MAN-12",), "No fields member.", delete(("fields",))),
    Invalid(
        "file-path-missing", ("MAN-13",), "A file record without path.", manifest(lambda d: d["files"][-1].pop("path"))
    ),
    Invalid("file-size-missing", ("MAN-14",), "A file record without size.", delete_file_member(DATA, "size")),
    Invalid(
        "file-size-negative",
        ("MAN-14",),
        "The provenance blob's file record has size -1 (a blob: no chunk range to fall outside it).",
        set_file(PROV, "size", -1),
        also=("MAN-19",),  # no file has -1 bytes
    ),
    Invalid("file-digest-missing", ("MAN-15",), "A file record without digest.", delete_file_member(DATA, "digest")),
    Invalid("files-unsorted", ("MAN-16",), "files in descending path order.", manifest(lambda d: d["files"].reverse())),
    Invalid(
        "files-duplicate",
        ("MAN-16",),
        "One file record listed twice, identically.",
        manifest(lambda d: d["files"].append(d["files"][-1])),
    ),
    Invalid(
        "chunk-file-unlisted",
        ("MAN-18",),
        "The data file is present but not listed in files.",
        manifest(lambda d: d["files"].pop()),
    ),
    Invalid(
        "context-file-unlisted",
        ("MAN-18",),
        "The notes blob is present but not listed in files.",
        manifest(lambda d: d["files"].pop(0)),
    ),
    Invalid(
        "file-size-wrong",
        ("MAN-19",),
        "The manifest gives the data file one byte more than it has; its digest is right.",
        manifest(lambda d: d["files"][-1].update(size=d["files"][-1]["size"] + 1)),
    ),
    Invalid(
        "file-truncated",
        ("MAN-19",),
        "The data file lost its last byte.",
        truncate(DATA, 1),
        also=("DIG-4", "SAF-11"),
        scope="file",
    ),
    Invalid(
        "file-missing",
        ("MAN-28",),
        "The data file is absent (a missing file has no size to match).",
        lambda t: (t.root / DATA).unlink(),
        also=("MAN-19",),
        scope="file",
    ),
    Invalid(
        "file-directory-missing",
        ("MAN-28",),
        "The data file's directory weights/ is absent (gap A12: a missing intermediate directory is a file that "
        "does not exist).",
        lambda t: shutil.rmtree(t.root / "weights"),
        also=("MAN-19",),
        scope="file",
    ),
    Invalid(
        "file-directory-is-a-file",
        ("MAN-28",),
        "weights/ is a regular file, so the data file under it does not exist (gap A12: ENOTDIR); a directory "
        "of the path is not a directory either (PTH-4).",
        _weights_dir_is_a_file,
        also=("MAN-19", "PTH-4"),
        scope="file",
    ),
    Invalid(
        "file-dangling-symlink",
        ("PTH-3",),
        "The data file is a symbolic link to a file that does not exist (gap A12: an entry exists, and it is a link).",
        _dangling_data_file,
        also=("PTH-4",),  # as symlink-file: a link, not followed, is not a regular file
        scope="file",
    ),
    Invalid(
        "blob-missing",
        ("MAN-28",),
        "The provenance context blob is absent.",
        lambda t: (t.root / PROV).unlink(),
        also=("MAN-19",),
        scope="blob",
    ),
    Invalid("field-name-invalid", ("MAN-20",), "An extra field named 'Extra'.", add_field("Extra", EXTRA_CTX)),
    Invalid(
        "field-name-too-long", ("MAN-20",), "An extra field with a 65-character name.", add_field("f" * 65, EXTRA_CTX)
    ),
    Invalid("field-kind-missing", ("MAN-21",), "An extra field record without kind.", add_field("extra", PROV_REF)),
    Invalid(
        "field-kind-unknown",
        ("MAN-21",),
        "An extra field of kind 'blob'.",
        add_field("extra", {"kind": "blob", **PROV_REF}),
    ),
    Invalid(
        "tensors-field-without-tensors",
        ("MAN-22",),
        "An extra field of kind tensors with no tensors member.",
        add_field("extra", {"kind": "tensors"}),
    ),
    Invalid(
        "context-field-with-tensors",
        ("MAN-22",),
        "An extra context field with a tensors member.",
        add_field("extra", {**EXTRA_CTX, "tensors": {}}),
    ),
    Invalid(
        "context-field-without-context",
        ("MAN-23",),
        "An extra field of kind context with no context member.",
        add_field("extra", {"kind": "context"}),
    ),
    Invalid(
        "context-without-path", ("MAN-24",), "A context object with no path.", set_(("fields", "notes", "context"), {})
    ),
    # ---- versioning
    Invalid("version-leading-zero", ("VER-2",), "format_version '1.00'.", set_(("format_version",), "1.00")),
    Invalid("version-no-minor", ("VER-2",), "format_version '1'.", set_(("format_version",), "1")),
    Invalid("version-major-2", ("VER-3",), "format_version '2.0'.", set_(("format_version",), "2.0")),
    Invalid("version-major-0", ("VER-3",), "format_version '0.9'.", set_(("format_version",), "0.9")),
    Invalid(
        "extension-without-name",
        ("VER-6",),
        "An extension record with no name.",
        set_(("extensions",), [{"must_understand": False}]),
    ),
    Invalid(
        "extension-without-must-understand",
        ("VER-7",),
        "An extension record with no must_understand.",
        set_(("extensions",), [{"name": "org.example.x"}]),
    ),
    Invalid(
        "extension-must-understand",
        ("VER-8",),
        "An unknown extension marked must_understand.",
        set_(("extensions",), [{"must_understand": True, "name": "org.example.x"}]),
    ),
    # ---- paths
    Invalid(
        "path-dotdot",
        ("PTH-2",),
        "The data file's path is 'weights/../weights/r00000-00000.safetensors' (it resolves to the real file).",
        replace_in_manifest(DATA, "weights/../" + DATA, -1),
    ),
    Invalid(
        "path-absolute",
        ("PTH-2",),
        "The provenance blob's path is '/provenance/context.msgpack' (a naive join reaches the real file).",
        chain(replace_in_manifest(PROV, "/" + PROV, -1), manifest(lambda d: d["files"].sort(key=lambda r: r["path"]))),
    ),
    Invalid(
        "path-hidden-segment",
        ("PTH-2",),
        "The data file is named 'weights/.r00000-00000.safetensors'.",
        lambda t: t.move(DATA, "weights/." + DATA.split("/")[1]),
    ),
    Invalid(
        "path-space",
        ("PTH-2",),
        "The data file is named 'weights/r 0.safetensors'.",
        lambda t: t.move(DATA, "weights/r 0.safetensors"),
    ),
    Invalid("path-too-long", ("PTH-2",), "The data file's path has 1025 octets.", long_path),
    Invalid(
        "path-manifest",
        ("PTH-2",),
        "files lists 'manifest.json' (no chunk references it; its size and digest cannot match).",
        manifest(
            lambda d: d["files"].insert(0, {"digest": digest_of("xxh3-128", b""), "path": "manifest.json", "size": 0})
        ),
        also=("MAN-19", "DIG-4"),
    ),
    Invalid(
        "symlink-file",
        ("PTH-3",),
        "The data file is a symbolic link to a copy elsewhere under the root.",
        symlink_file,
        also=("PTH-4",),  # a symlink, not followed, is not a regular file
        scope="file",
    ),
    Invalid(
        "symlink-directory",
        ("PTH-3",),
        "The directory weights is a symbolic link to another directory under the root.",
        symlink_dir,
        scope="file",
    ),
    Invalid("not-regular-file", ("PTH-4",), "The notes blob is a directory.", directory_blob, scope="file"),
    # ---- digests
    Invalid("digest-unknown-algorithm", ("DIG-2",), "A chunk digest 'md5:…'.", set_((*C, "digest"), "md5:" + "0" * 32)),
    Invalid(
        "digest-uppercase",
        ("DIG-3",),
        "A file digest in uppercase hex.",
        manifest(
            lambda d: d["files"][-1].update(digest=d["files"][-1]["digest"].upper().replace("XXH3-128", "xxh3-128"))
        ),
    ),
    Invalid(
        "digest-short",
        ("DIG-3",),
        "A chunk digest with 31 hex digits.",
        manifest(
            lambda d: d["fields"]["weights"]["tensors"]["w"]["chunks"][0].update(
                digest=d["fields"]["weights"]["tensors"]["w"]["chunks"][0]["digest"][:-1]
            )
        ),
        also=("DIG-4",),  # 31 digits cannot be the chunk's digest: DIG-3 alone is in the syntax-only vectors
    ),
    *DIGEST_SYNTAX,
    Invalid(
        "chunk-digest-mismatch",
        ("DIG-4",),
        "One bit of chunk w flipped; the file's size and digest were updated, the chunk digest was not.",
        flip_chunk_byte,
        scope="tensor",
    ),
    Invalid(
        "file-digest-mismatch",
        ("DIG-4",),
        "The data file's digest is that of other bytes; every chunk digest matches.",
        set_file(DATA, "digest", digest_of("xxh3-128", b"other")),
        scope="file",
    ),
    Invalid(
        "blob-digest-mismatch",
        ("DIG-4",),
        "A character of the provenance blob changed (still valid msgpack); the manifest was not updated.",
        flip_blob_text,
        scope="blob",
    ),
    *DIGEST_SHA256,
)
