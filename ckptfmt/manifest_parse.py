"""Parsing and validating manifest bytes (spec/manifest.md): :func:`parse_manifest`.

It checks everything the spec makes checkable without touching data files, and raises an error naming
the field, tensor or path at fault. It stays lean because a manifest of a large sharded run holds
100,000+ chunks: :func:`_parse_chunk` takes one cheap pass for the common valid chunk and the detailed
one only otherwise. The records it builds are :mod:`ckptfmt.manifest`'s.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from . import chunks as geometry
from . import dtypes, paths
from .blocks import Blocks
from .blocks import problem as block_problem
from .canonical import manifest_bytes
from .digests import ALGORITHMS, is_tree, parse_digest
from .errors import (
    ChunkLayoutError,
    ManifestError,
    MissingFieldError,
    UnsupportedExtensionError,
    UnsupportedVersionError,
)
from .manifest import (
    CHUNK_MEMBERS,
    FORMAT_MAJOR,
    FORMAT_NAME,
    MAX_MANIFEST_BYTES,
    RAW,
    RAW_CODEC,
    ChunkRecord,
    Codec,
    Extension,
    FieldRecord,
    FileRecord,
    Manifest,
    TensorRecord,
)
from .profiles import PROFILES
from .references import EXTENSION as REFERENCES
from .references import BaseFile, BaseRecord, check_location, referenced_sizes, virtual_path

MAX_JSON_DEPTH = 64  # MAN-26: the top-level object is level 1
MAX_INT_DIGITS = 20  # MAN-26: enough for any 64-bit integer, signed or unsigned (as ckptfmt.jsonio)
_INT_BOUND = 10**MAX_INT_DIGITS  # JSON integers have no leading zeros: |v| < 10**20 <=> at most 20 digits
KNOWN_EXTENSIONS: frozenset[str] = frozenset({REFERENCES})

_VERSION = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")


def _fail(message: str, **where: Any) -> ManifestError:
    return ManifestError(message, **where)


def _rule(value: object, rule: str | None) -> str | None:
    """The requirement a value of the wrong shape breaks: its own rule when absent, MAN-7 when of another type."""
    return rule if value is None else "MAN-7"


def _int(value: object, what: str, rule: str | None = None, **where: Any) -> int:
    if type(value) is not int:
        raise _fail(
            f"{what} must be a non-negative integer, got {_show(value)}", requirement=_rule(value, rule), **where
        )
    if value < 0:
        raise _fail(f"{what} must be a non-negative integer, got {_show(value)}", requirement=rule, **where)
    if value >= _INT_BOUND:
        raise ManifestError(f"{what} is an integer of more than {MAX_INT_DIGITS} digits", requirement="MAN-26", **where)
    return value


def _show(value: object) -> str:
    """A value from the file for an error message: short, and never a deep repr()."""
    if type(value) in (dict, list):
        return f"a JSON {'object' if type(value) is dict else 'array'}"
    if type(value) is int and value.bit_length() > 128:
        return "a very long integer"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ints(value: object, what: str, rule: str | None = None, **where: Any) -> tuple[int, ...]:
    if type(value) is not list:
        raise _fail(
            f"{what} must be an array of non-negative integers, got {_show(value)}",
            requirement=_rule(value, rule),
            **where,
        )
    for v in value:
        _int(v, f"each of {what}", rule, **where)
    return tuple(value)


def _obj(value: object, what: str, rule: str | None = None, **where: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail(
            f"{what} must be a JSON object, got {type(value).__name__}", requirement=_rule(value, rule), **where
        )
    return value


def _digest(value: object, what: str, rule: str | None = None, **where: Any) -> str:
    if parse_digest(value) is None:
        if isinstance(value, str):  # DIG-2 an unknown algorithm, DIG-3 a known one's digits malformed
            rule = "DIG-3" if value.partition(":")[0] in ALGORITHMS and ":" in value else "DIG-2"
        else:
            rule = _rule(value, rule)
        raise _fail(f"{what} {_show(value)} is not '<algorithm>:<hex>' of a known algorithm", requirement=rule, **where)
    assert isinstance(value, str)
    return value


def _free_problem(value: object, level: int) -> str | None:
    """Why a value the schema does not walk (an unknown member, a configuration) breaks MAN-26, or None.

    ``level`` is the nesting level of ``value`` itself (the manifest's top-level object is level 1).
    Iterative, so no nesting the JSON parser let through can exhaust the stack here.
    """
    stack = [(value, level)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict or type(item) is list:
            if depth > MAX_JSON_DEPTH:
                return f"JSON nests deeper than {MAX_JSON_DEPTH} levels"
            children = item.values() if type(item) is dict else item
            stack.extend((child, depth + 1) for child in children)
        elif type(item) is int and not -_INT_BOUND < item < _INT_BOUND:
            return f"JSON integer of more than {MAX_INT_DIGITS} digits"
    return None


def _extras(raw: dict[str, Any], known: frozenset[str], level: int, **where: Any) -> None:
    """Check the members of ``raw`` (an object at ``level``) that the schema does not define (MAN-26)."""
    for key in raw.keys() - known:
        problem = _free_problem(raw[key], level + 1)
        if problem:
            raise ManifestError(f"member {key!r}: {problem}", requirement="MAN-26", **where)


_TOP = frozenset({"format", "format_version", "profile", "files", "fields", "extensions", "metadata"})
_FILE = frozenset({"path", "size", "digest"})
_FIELD = frozenset({"kind", "tensors", "context"})
_REF = frozenset({"path"})
_TENSOR = frozenset({"dtype", "shape", "chunks"})
# A chunk's "base" is taken off before its other members are checked (_parse_ref_chunk); in a manifest without
# the references extension it is a member like any unknown one.
_CHUNK = CHUNK_MEMBERS | {"blocks"}
_CODEC = frozenset({"name", "configuration"})
_EXTENSION = frozenset({"name", "must_understand", "configuration"})


def _codec(value: object, **where: Any) -> Codec:
    if value is None:
        raise _fail("chunk has no 'codec'", requirement="TEN-12", **where)
    raw = _obj(value, "chunk 'codec'", **where)
    _extras(raw, _CODEC - {"configuration"}, 8, **where)  # the chunk's codec object is at level 8
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("codec 'name' must be a non-empty string", requirement="TEN-12", **where)
    if name == RAW and "configuration" not in raw:
        return RAW_CODEC
    config = raw.get("configuration")
    if config is not None:
        config = _obj(config, "codec 'configuration'", **where)
    return Codec(name=name, configuration=config)


def _parse_version(doc: dict[str, Any]) -> str:
    if doc.get("format") != FORMAT_NAME:
        raise ManifestError(f"'format' must be {FORMAT_NAME!r}, got {_show(doc.get('format'))}", requirement="MAN-8")
    version = doc.get("format_version")
    if not isinstance(version, str):
        raise ManifestError(
            f"'format_version' must be a 'MAJOR.MINOR' string, got {_show(version)}",
            requirement=_rule(version, "MAN-9"),
        )
    if _VERSION.fullmatch(version) is None:
        raise ManifestError(
            f"'format_version' must be 'MAJOR.MINOR' without leading zeros, got {_show(version)}", requirement="VER-2"
        )
    major = version.partition(".")[0]
    if len(major) > 18 or int(major) != FORMAT_MAJOR:  # (int() of thousands of digits is refused or slow)
        raise UnsupportedVersionError(
            f"format version {_show(version)} is not of major {FORMAT_MAJOR}, the one this reader implements",
            requirement="VER-3",
        )
    return version


def _parse_extensions(value: object) -> tuple[Extension, ...]:
    if value is None:
        return ()
    if type(value) is not list:
        raise ManifestError("'extensions' must be an array", requirement="MAN-7")
    out = []
    for raw in value:
        raw = _obj(raw, "an extension")
        _extras(raw, _EXTENSION - {"configuration"}, 3)
        name = raw.get("name")
        must = raw.get("must_understand")
        if not isinstance(name, str) or type(must) is not bool:
            raise ManifestError(
                "an extension needs a string 'name' and a boolean 'must_understand'",
                requirement="VER-6" if not isinstance(name, str) else "VER-7",
            )
        if must and name not in KNOWN_EXTENSIONS:
            raise UnsupportedExtensionError(
                f"extension {name!r} is marked must_understand and this reader does not implement it",
                requirement="VER-8",
            )
        config = raw.get("configuration")
        if config is not None:
            config = _obj(config, "extension 'configuration'")  # MAN-7: its type is object
        out.append(Extension(name=name, must_understand=must, configuration=config))
    return tuple(out)


def _parse_files(value: object) -> tuple[FileRecord, ...]:
    """An array of file records (MAN-13..16): ``files``, and a base's files (spec/references.md)."""
    if type(value) is not list:
        raise ManifestError("'files' must be an array", requirement=_rule(value, "MAN-11"))
    out = []
    previous = ""
    for raw in value:
        raw = _obj(raw, "a file record")
        if len(raw) != len(_FILE):
            _extras(raw, _FILE, 3)
        path = paths.check_path(raw.get("path"), where="files", absent="MAN-13")
        if path <= previous:
            raise ManifestError("'files' must be sorted by path with no duplicates", path=path, requirement="MAN-16")
        previous = path
        size = _int(raw.get("size"), "file 'size'", "MAN-14", path=path)
        digest = _digest(raw.get("digest"), "file 'digest'", "MAN-15", path=path)
        out.append(FileRecord(path=path, size=size, digest=digest))
    return tuple(out)


_CHECKPOINT_ID = re.compile(r"sha256:[0-9a-f]{64}")


def parse_bases(must_understand: bool, configuration: Mapping[str, object] | None) -> tuple[BaseRecord, ...]:
    """The ``ckptfmt.references`` extension's bases, checked as REF-1..REF-5 require."""
    if not must_understand:
        raise ManifestError(f"extension {REFERENCES!r} must be marked must_understand", requirement="REF-1")
    bases = (configuration or {}).get("bases")
    if type(bases) is not list or not bases:
        raise ManifestError(f"extension {REFERENCES!r} needs a non-empty array 'bases'", requirement="REF-2")
    out: list[BaseRecord] = []
    seen: set[str] = set()
    for raw in bases:
        if type(raw) is not dict:
            raise ManifestError("a base record must be an object", requirement="REF-2")
        location = check_location(raw.get("location"))
        if location in seen:
            raise ManifestError(f"base {location!r} is listed twice", requirement="REF-3")
        seen.add(location)
        ckpt_id = raw.get("checkpoint_id")
        if not isinstance(ckpt_id, str) or _CHECKPOINT_ID.fullmatch(ckpt_id) is None:
            raise ManifestError(
                f"base {location!r}: 'checkpoint_id' must be 'sha256:' and 64 lowercase hex digits",
                requirement="REF-4",
            )
        out.append(BaseRecord(location=location, checkpoint_id=ckpt_id, files=_base_files(location, raw.get("files"))))
    return tuple(out)


def _base_files(location: str, value: object) -> tuple[BaseFile, ...]:
    if type(value) is not list or not value:
        raise ManifestError(f"base {location!r}: 'files' must be a non-empty array", requirement="REF-5")
    try:
        records = _parse_files(value)  # the file records' own rules (MAN-13..16)
    except ManifestError as exc:
        raise ManifestError(f"base {location!r}: {exc.message}", path=exc.path, requirement=exc.requirement) from exc
    return tuple(BaseFile(path=r.path, size=r.size, digest=r.digest) for r in records)


_DIGEST = re.compile(r"xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64}")
_RAW_DICT = RAW_CODEC.to_dict()


_JUST_INT = {int}


def _counts(values: object, rank: int) -> bool:
    """A list of ``rank`` non-negative ints (bools excluded); C-level checks, as this runs per chunk."""
    return (
        type(values) is list
        and len(values) == rank
        and (not values or (set(map(type, values)) == _JUST_INT and min(values) >= 0))
    )


def _parse_ref_chunk(
    raw: dict[str, Any], refs: Mapping[str, int], dtype_size: int, rank: int, where: dict[str, Any]
) -> ChunkRecord:
    """A chunk with ``base``: its path is looked up among that base's files (REF-6), under its virtual path."""
    location = raw["base"]
    path = paths.check_path(raw.get("path"), where="chunk", absent="TEN-6")
    if not isinstance(location, str) or virtual_path(location, path) not in refs:
        raise ManifestError(
            f"chunk names file {path!r} of base {_show(location)}, which the references extension does not list",
            requirement="REF-6",
            **where,
        )
    inner = {k: v for k, v in raw.items() if k != "base"}
    inner["path"] = virtual_path(location, path)
    return dataclasses.replace(_parse_chunk(inner, refs, dtype_size, rank, where), base=location)


def _parse_chunk(
    raw: Any, sizes: Mapping[str, int], dtype_size: int, rank: int, where: dict[str, Any], refs: Mapping[str, int] = {}
) -> ChunkRecord:
    """The hot loop of a large manifest: one cheap pass for the common valid chunk, the detailed one otherwise."""
    if refs and type(raw) is dict and "base" in raw:
        return _parse_ref_chunk(raw, refs, dtype_size, rank, where)
    try:
        path, key, offsets, shape = raw["path"], raw["key"], raw["offsets"], raw["shape"]
        begin, end = raw["range"]
        digest, codec = raw["digest"], raw["codec"]
        blocks = raw.get("blocks")
        if (
            len(raw) == len(CHUNK_MEMBERS) + (blocks is not None)
            and type(key) is str
            and key
            and type(begin) is int
            and type(end) is int
            and 0 <= begin <= end <= sizes[path]
            and codec == _RAW_DICT
            and type(digest) is str
            and _DIGEST.fullmatch(digest)
            and _counts(offsets, rank)
            and _counts(shape, rank)
        ):
            count = dtype_size
            for d in shape:
                count *= d
            if (not dtype_size or end - begin == count) and (
                blocks is None
                or (
                    type(blocks) is dict
                    and len(blocks) == 2
                    and block_problem(blocks, nbytes=end - begin, algorithm=digest.partition(":")[0]) is None
                )
            ):
                return ChunkRecord.from_dict(raw)
    except (KeyError, TypeError, ValueError):
        pass
    return _parse_chunk_slow(raw, sizes, dtype_size, rank, where)


def _parse_chunk_slow(
    raw: object, sizes: Mapping[str, int], dtype_size: int, rank: int, where: dict[str, Any]
) -> ChunkRecord:
    if type(raw) is not dict:
        raise _fail("a chunk must be a JSON object", requirement="MAN-7", **where)
    _extras(raw, _CHUNK, 7, **where)
    path = raw.get("path")
    if not isinstance(path, str) or path not in sizes:
        if isinstance(path, str):
            paths.check_path(path, where="chunk")
        raise ManifestError(
            f"chunk names file {_show(path)}, which 'files' does not list",
            requirement="MAN-18" if isinstance(path, str) else "TEN-6" if path is None else "MAN-7",
            **where,
        )
    key = raw.get("key")
    if not isinstance(key, str) or not key:
        raise ManifestError("chunk 'key' must be a non-empty string", requirement="TEN-7", **where)
    offsets = _ints(raw.get("offsets"), "chunk 'offsets'", "TEN-8", **where)
    shape = _ints(raw.get("shape"), "chunk 'shape'", "TEN-9", **where)
    if len(offsets) != rank or len(shape) != rank:
        raise ChunkLayoutError(f"chunk offsets/shape must have the tensor's rank {rank}", requirement="TEN-15", **where)
    rng = raw.get("range")
    if type(rng) is not list or len(rng) != 2:
        raise ManifestError("chunk 'range' must be [begin, end]", requirement=_rule(rng, "TEN-10"), **where)
    begin = _int(rng[0], "chunk range begin", "TEN-20", **where)
    end = _int(rng[1], "chunk range end", "TEN-20", **where)
    if begin > end or end > sizes[path]:
        raise ManifestError(
            f"chunk range [{begin}, {end}] does not fit in file {path!r} of {sizes[path]} bytes",
            requirement="TEN-20",
            **where,
        )
    codec = _codec(raw.get("codec"), **where)
    if dtype_size and codec.name == RAW:
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * dtype_size:
            raise _fail(
                f"chunk of shape {list(shape)} needs {count * dtype_size} bytes, range holds {end - begin}",
                requirement="TEN-21",
                **where,
            )
    digest = _digest(raw.get("digest"), "chunk 'digest'", "TEN-11", **where)
    return ChunkRecord(
        path=path,
        key=key,
        offsets=offsets,
        shape=shape,
        begin=begin,
        end=end,
        digest=digest,
        codec=codec,
        blocks=_blocks(raw["blocks"], codec, end - begin, digest, **where) if "blocks" in raw else None,
    )


def _blocks(value: object, codec: Codec, nbytes: int, digest: str, **where: Any) -> Blocks:
    """A present ``blocks`` member (spec/blocks.md): well-formed, on a raw chunk. ``null`` is no object (BLK-1)."""
    if codec.name != RAW:
        raise _fail(f"a chunk of codec {codec.name!r} has 'blocks'", requirement="BLK-3", **where)
    found = block_problem(value, nbytes=nbytes, algorithm=digest.partition(":")[0])
    if found is not None:
        raise _fail(found[0], requirement=found[1], **where)
    assert isinstance(value, dict)
    _extras(value, frozenset({"size", "digests"}), 8, **where)
    return Blocks.from_dict(value)  # type: ignore[arg-type]  # checked by block_problem


def _parse_tensor(
    name: str, raw: object, sizes: Mapping[str, int], fname: str, refs: Mapping[str, int]
) -> TensorRecord:
    where: dict[str, Any] = {"field": fname, "tensor": name}
    problem = paths.tensor_name_problem(name)
    if problem:
        raise _fail(problem, requirement="TEN-2", **where)
    raw = _obj(raw, "a tensor record", **where)
    if len(raw) != len(_TENSOR):
        _extras(raw, _TENSOR, 5, **where)
    dtype = raw.get("dtype")
    if not isinstance(dtype, str):
        raise ManifestError(f"tensor 'dtype' must be a string, got {_show(dtype)}", requirement="TEN-3", **where)
    shape = _ints(raw.get("shape"), "tensor 'shape'", "TEN-4", **where)
    problem = dtypes.shape_size_problem(shape, dtypes.ITEMSIZE.get(dtype, 1))
    if problem:
        raise ManifestError(f"tensor {problem}", requirement="TEN-23", **where)
    chunk_list = raw.get("chunks")
    if type(chunk_list) is not list:
        raise ManifestError("tensor 'chunks' must be an array", requirement="TEN-5", **where)
    size = dtypes.ITEMSIZE.get(dtype, 0)  # an unknown dtype makes only this tensor unreadable (TEN-1)
    parsed = tuple(_parse_chunk(c, sizes, size, len(shape), where, refs) for c in chunk_list)
    if len(parsed) == 1 and parsed[0].shape == shape and not any(parsed[0].offsets):
        return TensorRecord(dtype=dtype, shape=shape, chunks=parsed)  # the common case: whole tensor
    problem = geometry.coverage_problem(shape, [(c.offsets, c.shape) for c in parsed])
    if problem:
        raise ChunkLayoutError(
            f"chunks do not tile shape {list(shape)}: {problem}", requirement=_layout_rule(problem), **where
        )
    return TensorRecord(dtype=dtype, shape=shape, chunks=parsed)


def _layout_rule(problem: str) -> str:
    """The TEN rule a chunks.coverage_problem message is about."""
    for words, rule in (("rank", "TEN-15"), ("outside", "TEN-16"), ("overlap", "TEN-17"), ("exactly one", "TEN-19")):
        if words in problem:
            return rule
    return "TEN-18"  # a gap, or no chunks at all


def _parse_field(name: str, raw: object, sizes: Mapping[str, int], refs: Mapping[str, int]) -> FieldRecord:
    if not paths.is_field_name(name):
        raise ManifestError(f"field name {name!r} must match [a-z][a-z0-9_]{{0,63}}", field=name, requirement="MAN-20")
    raw = _obj(raw, "a field record", field=name)
    _extras(raw, _FIELD, 3, field=name)
    kind = raw.get("kind")
    context = None
    if "context" in raw:
        ref = _obj(raw["context"], "field 'context'", field=name)
        _extras(ref, _REF, 4, field=name)
        context = ref.get("path")
        if type(context) is not str or context not in sizes:
            if isinstance(context, str):
                paths.check_path(context, where="context")
            raise ManifestError(
                f"context names file {_show(context)}, which 'files' does not list",
                field=name,
                requirement="MAN-18" if isinstance(context, str) else "MAN-24" if context is None else "MAN-7",
            )
    if kind == "context":
        if "tensors" in raw:
            raise ManifestError("a context field must not have 'tensors'", field=name, requirement="MAN-22")
        if context is None:
            raise ManifestError("a context field needs 'context'", field=name, requirement="MAN-23")
        return FieldRecord(kind="context", context=context)
    if kind == "tensors":
        tensors = _obj(raw.get("tensors"), "field 'tensors'", "MAN-22", field=name)
        parsed = {t: _parse_tensor(t, rec, sizes, name, refs) for t, rec in tensors.items()}
        return FieldRecord(kind="tensors", tensors=parsed, context=context)
    raise ManifestError(
        f"field 'kind' must be 'tensors' or 'context', got {_show(kind)}", field=name, requirement="MAN-21"
    )


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ManifestError(f"duplicate JSON key {key!r}", requirement="MAN-5")
            seen.add(key)
    return out


class JsonFraction(float):
    """A JSON number with a fraction or an exponent part. It is no integer, so a property defined as one
    refuses it under that property's own rule (MAN-7, BLK-1, ...), while an unknown member holding it is
    ignored (VER-5, spec/notes/gaps-1.2.md N17). A float subclass, so the canonical and MAN-27 checks,
    which re-serialize the document, see a number."""

    __slots__ = ()


def _fraction(text: str) -> object:
    return JsonFraction(text)


def _no_constant(text: str) -> object:
    # NaN, Infinity and -Infinity are not JSON (RFC 8259): Python's parser accepts them unless told not to
    raise ManifestError(f"manifest holds {text}, which is not JSON", requirement="MAN-4")


_BOM = b"\xef\xbb\xbf"


def _load(data: bytes) -> tuple[Any, bool]:
    """The manifest's JSON value, and whether its bytes were canonical (MAN-1)."""
    if data.startswith(_BOM):
        raise ManifestError("manifest begins with a UTF-8 byte order mark", requirement="MAN-27")
    try:
        text = data.decode("utf-8")
        # Fast path: a canonical manifest (as writers must write, MAN-1) re-serializes to its own bytes,
        # which proves no member name was duplicated; anything else is parsed again, checking each object.
        doc = json.loads(text, parse_float=_fraction, parse_constant=_no_constant)
        try:
            canonical = type(doc) is dict and manifest_bytes(doc) == data
        except UnicodeEncodeError:  # a "\ud800" escape decodes to a lone surrogate, which is no canonical text
            canonical = False
        if not canonical:
            doc = json.loads(
                text, object_pairs_hook=_reject_duplicate_keys, parse_float=_fraction, parse_constant=_no_constant
            )
    except UnicodeDecodeError as exc:
        raise ManifestError(f"manifest is not valid UTF-8: {exc}", requirement="MAN-4") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"manifest is not valid JSON: {exc}", requirement="MAN-4") from exc
    except RecursionError:
        # the parser recurses per level: JSON nested this deep never reaches the MAN-26 walk
        raise ManifestError(f"manifest JSON nests deeper than {MAX_JSON_DEPTH} levels", requirement="MAN-26") from None
    except ValueError as exc:
        if isinstance(exc, ManifestError):
            raise
        # Python refuses integer literals of more than 4300 digits (int_max_str_digits)
        raise ManifestError(f"manifest holds an over-long JSON number: {exc}", requirement="MAN-26") from None
    return doc, canonical


def _check_unicode(doc: object) -> None:
    """MAN-27: no string or member name may hold a lone surrogate (a "\ud800" escape without its pair)."""
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestError(
            "manifest holds a \\u escape of a lone surrogate (not a Unicode character)", requirement="MAN-27"
        ) from None


def parse_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes. Raises a ManifestError subclass naming what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    doc, canonical = _load(data)
    if not canonical:  # (canonical bytes are UTF-8 throughout: no lone surrogate can hide in them)
        _check_unicode(doc)
    if type(doc) is not dict:
        raise ManifestError(f"the manifest must be a JSON object, got {type(doc).__name__}", requirement="MAN-4")
    _extras(doc, _TOP - {"extensions", "metadata"}, 1)
    version = _parse_version(doc)
    extensions = _parse_extensions(doc.get("extensions"))
    references = [e for e in extensions if e.name == REFERENCES]
    if len(references) > 1:
        raise ManifestError(f"extension {REFERENCES!r} is listed {len(references)} times", requirement="REF-1")
    bases = parse_bases(references[0].must_understand, references[0].configuration) if references else ()
    profile = doc.get("profile")
    if type(profile) is not str or profile not in PROFILES:
        raise ManifestError(
            f"unknown profile {_show(profile)}; known: {', '.join(PROFILES)}",
            requirement="PRO-1" if type(profile) is str else _rule(profile, "MAN-10"),
        )
    metadata = doc.get("metadata", {})
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise ManifestError("'metadata' must map strings to strings", requirement="MAN-7")
    files = _parse_files(doc.get("files"))
    sizes = {f.path: f.size for f in files}
    raw_fields = _obj(doc.get("fields"), "'fields'", "MAN-12")
    refs = referenced_sizes(bases)
    fields = {name: _parse_field(name, raw, sizes, refs) for name, raw in raw_fields.items()}
    _check_profile(profile, fields)
    _check_chunk_keys(fields)
    _check_tree_files(
        (*files, *(FileRecord(path=b.virtual(f.path), size=0, digest=f.digest) for b in bases for f in b.files)), fields
    )
    return Manifest(
        profile=profile,
        files=files,
        fields=fields,
        format_version=version,
        extensions=tuple(e for e in extensions if e.name != REFERENCES),
        metadata=metadata,
        bases=bases,
    )


def _check_profile(profile: str, fields: Mapping[str, FieldRecord]) -> None:
    for name, kind in PROFILES[profile].items():
        record = fields.get(name)
        if record is None:
            raise MissingFieldError(
                f"profile {profile!r} requires field {name!r}, which is absent", field=name, requirement="PRO-3"
            )
        if record.kind != kind:
            raise MissingFieldError(
                f"profile {profile!r} requires field {name!r} of kind {kind!r}, found kind {record.kind!r}",
                field=name,
                requirement="PRO-3",
            )


def _check_tree_files(files: tuple[FileRecord, ...], fields: Mapping[str, FieldRecord]) -> None:
    """A file tree digest's segments are the entries of a data file: a file without chunks has none (TRE-2)."""
    chunks = [c for f in fields.values() for t in f.tensors.values() for c in t.chunks]
    holding = {c.path for c in chunks} | {path for c in chunks for path in _delta_base_paths(c.codec)}
    for record in files:
        if is_tree(record.digest.partition(":")[0]) and record.path not in holding:
            raise ManifestError(
                f"file digest {record.digest.partition(':')[0]!r} is a tree digest, but no chunk is placed in the file"
                " (a tree digest is a data file's)",
                path=record.path,
                requirement="TRE-2",
            )


def _delta_base_paths(codec: Codec) -> Iterator[str]:
    """The base files an ``xor-zstd`` chunk's configuration names, at every depth (spec/delta.md), read leniently:
    a malformed configuration refuses its tensor when read (DLT-1), not the checkpoint here."""
    config = codec.configuration if codec.name == "xor-zstd" else None
    for _ in range(16):  # deeper than DLT-3 allows: that chain is refused when read
        chunk = config.get("chunk") if isinstance(config, Mapping) else None
        base = config.get("base") if isinstance(config, Mapping) else None
        if not isinstance(base, str) or not isinstance(chunk, Mapping):
            return
        if isinstance(chunk.get("path"), str):
            yield virtual_path(base, chunk["path"])
        inner = chunk.get("codec")
        config = inner.get("configuration") if isinstance(inner, Mapping) and inner.get("name") == "xor-zstd" else None


def _check_chunk_keys(fields: Mapping[str, FieldRecord]) -> None:
    """No two chunks may claim the same entry of a data file (TEN-22)."""
    seen: set[tuple[str, str]] = set()
    for fname, record in fields.items():
        for tname, tensor in record.tensors.items():
            for chunk in tensor.chunks:
                entry = (chunk.path, chunk.key)
                if entry in seen:
                    raise ManifestError(
                        f"entry {chunk.key!r} of file {chunk.path!r} is claimed by two chunks",
                        field=fname,
                        tensor=tname,
                        requirement="TEN-22",
                    )
                seen.add(entry)
