"""Structure-aware mutations of valid artefacts: JSON documents, safetensors files, msgpack blobs, pickles (DCP
``.metadata``), ``.pt`` zip archives, and whole checkpoint trees.

Each mutator takes valid bytes and a ``random.Random`` and returns hostile bytes. Structure first (parse the
artefact, change one value, re-emit), bytes second (bit flips, truncations, splices), because a parser spends
most of its checks on well-formed input with one wrong value, which random bytes almost never reach.
Everything is driven by the ``random.Random`` passed in, so a seed reproduces an input exactly.
"""

from __future__ import annotations

import copy
import io
import json
import math
import pickletools
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import Any

import msgpack

# ---------------------------------------------------------------- bytes


BOUNDARY_INTS = (0, 1, -1, 2, 7, 8, 255, 256, 65535, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)


def flip_bits(data: bytes, rng: Random, count: int = 1) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    for _ in range(count):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutate_bytes(data: bytes, rng: Random, donor: bytes = b"") -> bytes:
    """One byte-level mutation: bit flips, byte set, truncation, deletion, duplication, insertion, splice."""
    op = rng.randrange(9)
    n = len(data)
    if op == 0 or n == 0:
        return flip_bits(data, rng, rng.choice((1, 1, 2, 8)))
    i = rng.randrange(n)
    if op == 1:
        return data[:i] + bytes([rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))]) + data[i + 1 :]
    if op == 2:
        return data[:i]  # truncation
    if op == 3:
        j = min(n, i + rng.choice((1, 2, 4, 8, 64)))
        return data[:i] + data[j:]
    if op == 4:
        j = min(n, i + rng.choice((1, 4, 16, 256)))
        return data[:j] + data[i:j] * rng.choice((1, 2, 16)) + data[j:]
    if op == 5:
        return data[:i] + rng.randbytes(rng.choice((1, 4, 16))) + data[i:]
    if op == 6 and donor:
        j = rng.randrange(len(donor))
        return data[:i] + donor[j : j + rng.choice((8, 64, 512))] + data[i:]
    if op == 7:
        return data + rng.choice((b"\x00", b" ", b"{}", rng.randbytes(16)))  # trailing data
    value = rng.choice(BOUNDARY_INTS) & 0xFFFFFFFF
    j = i - i % 4
    return data[:j] + struct.pack("<I", value) + data[j + 4 :]


# ---------------------------------------------------------------- JSON


@dataclass(frozen=True)
class Raw:
    """Text emitted verbatim: what json.dumps will not write (NaN, a 5,000-digit integer, 10,000 brackets)."""

    text: str


@dataclass
class Dup:
    """An object emitted with its members in this order, duplicates included."""

    pairs: list[tuple[str, Any]] = field(default_factory=list)


def dumps(value: Any) -> str:
    """JSON text of ``value``, with Raw and Dup honoured and floats kept as Python writes them (NaN included)."""
    try:
        return json.dumps(value)  # fast path: no Raw or Dup inside (json.dumps refuses them)
    except (TypeError, ValueError, RecursionError):
        return _dumps(value)


def _dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Dup):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value)


def _deep(depth: int, kind: str) -> Raw:
    return Raw("[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "0" + "}" * depth)


def json_special(rng: Random) -> Any:
    """A value of another JSON type, or one at a boundary, or one no strict parser should accept."""
    choices: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice((True, False)),
        lambda: rng.choice(BOUNDARY_INTS) * rng.choice((1, -1)),
        lambda: 2 ** rng.choice((64, 65, 128, 1000)),
        lambda: Raw("9" * rng.choice((21, 400, 5000))),
        lambda: Raw(rng.choice(("NaN", "Infinity", "-Infinity", "1e999", "-0", "0.0", "1.5", "1E2", "-1e-999"))),
        lambda: rng.choice((0.5, -0.0, 1e308, float("nan"))),
        lambda: rng.choice(("", "x", "..", "../../outside", "/etc/passwd", "a/../../b", "C:\\x", "\x00", "é" * 3)),
        lambda: "a" * rng.choice((256, 70_000)),
        lambda: rng.choice(([], {}, [0], [None], {"": None}, [[]], [-1, -1], [0, 2**62])),
        lambda: _deep(rng.choice((65, 200, 3000)), rng.choice(("list", "dict"))),
        lambda: Raw('"\\ud800"'),
        lambda: Raw('"\\u0000"'),
    ]
    return rng.choice(choices)()


Path_ = tuple[Any, ...]


def json_paths(value: Any, path: Path_ = (), out: list[Path_] | None = None, limit: int = 4000) -> list[Path_]:
    """Paths of every node (the root included), depth first, at most ``limit`` of them."""
    if len(path) > 100:  # a mutant nested deeper than any seed: its top is mutation enough
        return out if out is not None else []
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    out.append(path)
    if isinstance(value, dict):
        for k, v in value.items():
            json_paths(v, (*path, k), out, limit)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            json_paths(v, (*path, i), out, limit)
    return out


def _get(value: Any, path: Path_) -> Any:
    for key in path:
        value = value[key]
    return value


def _set(root: Any, path: Path_, new: Any) -> Any:
    if not path:
        return new
    _get(root, path[:-1])[path[-1]] = new
    return root


def _mutate_int(value: int, rng: Random) -> Any:
    return rng.choice(
        (
            value + 1,
            value - 1,
            -value - 1,
            value * 2 ** rng.randrange(1, 70),
            rng.choice(BOUNDARY_INTS),
            -rng.choice(BOUNDARY_INTS),
            float(value),
            str(value),
            [value],
            bool(value % 2),
        )
    )


def _mutate_str(value: str, rng: Random) -> Any:
    return rng.choice(
        (
            "",
            value + value,
            value[: len(value) // 2],
            value.upper(),
            "../" + value,
            "/" + value,
            value + "/../..",
            value.replace("/", "/./"),
            value + "\x00",
            value + "é",
            value.replace(":", ":0"),
            "sha256:" + "0" * 64,
            value.encode("utf-8", "surrogatepass").hex(),
        )
    )


def mutate_json_value(doc: Any, rng: Random, *, donor: Any = None) -> Any:
    """One structural mutation anywhere in a parsed JSON document; returns the new document (maybe the same object)."""
    paths = json_paths(doc, limit=1000)
    path = rng.choice(paths)
    node = _get(doc, path)
    op = rng.randrange(10)
    if op == 0:
        return _set(doc, path, json_special(rng))
    if op == 1 and type(node) is int:
        return _set(doc, path, _mutate_int(node, rng))
    if op == 2 and isinstance(node, str):
        return _set(doc, path, _mutate_str(node, rng))
    if op == 3 and isinstance(node, dict) and node:
        key = rng.choice(list(node))
        action = rng.randrange(4)
        if action == 0:
            del node[key]
            return doc
        if action == 1:  # a duplicate member name, the second one different
            pairs = [*node.items(), (key, json_special(rng))]
            return _set(doc, path, Dup(pairs))
        if action == 2:
            node[_mutate_str(key, rng) if rng.random() < 0.5 else "extra"] = json_special(rng)
            return doc
        node[key] = copy.deepcopy(node[rng.choice(list(node))])  # a sibling's value
        return doc
    if op == 4 and isinstance(node, list):
        action = rng.randrange(4)
        if action == 0 and node:
            del node[rng.randrange(len(node))]
        elif action == 1 and node:
            node.append(copy.deepcopy(node[rng.randrange(len(node))]))
        elif action == 2 and node and rng.random() < 0.2:  # many copies: quadratic checks and per-item costs show
            item = dumps(node[rng.randrange(len(node))])
            return _set(doc, path, Raw("[" + ",".join([item] * rng.choice((20, 200, 1000))) + "]"))
        else:
            node.reverse()
        return doc
    if op == 5:  # wrap: a value where the same value one level deeper was expected
        return _set(doc, path, rng.choice(([node], {"value": node})))
    if op == 6 and donor is not None:  # splice a subtree of another document
        donor_path = rng.choice(json_paths(donor))
        return _set(doc, path, copy.deepcopy(_get(donor, donor_path)))
    if op == 7 and len(paths) > 1:  # swap in the value of another node of the same document
        other = copy.deepcopy(_get(doc, rng.choice(paths)))
        return _set(doc, path, other)
    if op == 8 and isinstance(node, (int, float)) and not isinstance(node, bool):
        return _set(doc, path, Raw(rng.choice(("NaN", "Infinity", "1e400", "-0.0", "9" * 30))))
    return _set(doc, path, json_special(rng))


def mutate_json(data: bytes, rng: Random, *, donor: Any = None, structural: float = 0.85) -> bytes:
    """Parse valid JSON bytes, apply one to three structural mutations, re-emit; or mutate the bytes."""
    doc = _json_or_none(data)
    if doc is None or rng.random() >= structural:
        return mutate_bytes(data, rng)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if isinstance(doc, (Raw, Dup)):
            break
        doc = mutate_json_value(doc, rng, donor=donor)
    return dumps(doc).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------- manifests


def _json_or_none(data: bytes) -> Any:
    """The parsed document, or None when ``data`` (a mutant of a mutant, say) is no longer JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _tensors(doc: Any) -> list[dict[str, Any]]:
    out = []
    fields = doc.get("fields") if isinstance(doc, dict) else None
    for f in fields.values() if isinstance(fields, dict) else ():
        tensors = f.get("tensors") if isinstance(f, dict) else None
        out += [t for t in tensors.values() if isinstance(t, dict)] if isinstance(tensors, dict) else []
    return out


def mutate_manifest(data: bytes, rng: Random) -> bytes:
    """Manifest-specific mutations (empty tensors with huge dimensions, chunk geometry, range boundaries,
    thousands of chunks) on top of the generic JSON ones."""
    doc = _json_or_none(data)
    if doc is None:
        return mutate_bytes(data, rng)
    tensors = [t for t in _tensors(doc) if isinstance(t.get("chunks"), list) and t["chunks"]]
    tensors = [t for t in tensors if any(isinstance(c, dict) for c in t["chunks"])]
    op = rng.randrange(100)
    if op >= 3 or not tensors:
        return mutate_json(data, rng)
    tensor = rng.choice(tensors)
    chunk = rng.choice([c for c in tensor["chunks"] if isinstance(c, dict)])
    if op == 0:  # empty tensor with an astronomically large other dimension, consistently everywhere
        big = rng.choice((2**31, 2**40, 2**62, 2**63 - 1))
        shape = [0, big] if rng.random() < 0.5 else [big, 0, big]
        tensor["shape"] = shape
        tensor["chunks"] = [{**chunk, "offsets": [0] * len(shape), "shape": shape}]
        begin = chunk.get("range", [0, 0])[0] if isinstance(chunk.get("range"), list) else 0
        tensor["chunks"][0]["range"] = [begin, begin]
    elif op == 1:  # range boundaries
        r = chunk.get("range")
        if isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r):
            b, e = r
            chunk["range"] = rng.choice(([e, b], [b, b], [b - 1, e - 1], [b, e + 1], [0, e], [b, 2**63], [-8, e]))
    else:  # many chunks: the overlap and coverage checks meet thousands of entries
        copies = rng.choice((300, 1500))
        tensor["chunks"] = [dict(chunk) for _ in range(copies)]
    return dumps(doc).encode()


# ---------------------------------------------------------------- safetensors


def split_safetensors(data: bytes) -> tuple[int, bytes, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n], data[8 + n :]


def mutate_safetensors(data: bytes, rng: Random) -> bytes:
    """Mutate a safetensors file: its header as JSON (offsets, shapes, dtypes, __metadata__), its length prefix,
    its data section, or its bytes."""
    try:
        n, header, body = split_safetensors(data)
        doc = json.loads(header)
        assert isinstance(doc, dict)
    except (struct.error, ValueError, RecursionError, AssertionError):
        return mutate_bytes(data, rng)
    op = rng.randrange(8)
    if op <= 2:
        new_header = mutate_json(header, rng, structural=0.95)
        prefix = len(new_header) if rng.random() < 0.85 else n
        return struct.pack("<Q", prefix) + new_header + body
    if op == 3:  # offsets at the edges of the data section
        entries = [k for k, v in doc.items() if isinstance(v, dict) and "data_offsets" in v]
        e = doc[rng.choice(entries)] if entries else None
        offsets = e.get("data_offsets") if e is not None else None
        if e is not None and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
            b, end = offsets
            e["data_offsets"] = rng.choice(
                ([end, b], [b, len(body) + 1], [b - 1, end - 1], [0, 0], [2**63, 2**63], [b, end + 8])
            )
            if rng.random() < 0.5:  # an empty tensor with a huge other dimension, offsets consistent
                e["shape"] = [0, 2 ** rng.choice((40, 62))]
                e["data_offsets"] = [b, b]
        text = dumps(doc).encode()
        return struct.pack("<Q", len(text)) + text + body
    if op == 4:
        prefix = rng.choice((0, 1, 2, n - 1, n + 1, len(data) - 8, len(data), 100_000_001, 2**63, 2**64 - 1))
        return struct.pack("<Q", prefix % 2**64) + header + body
    if op == 5:
        return data[:8] + header + flip_bits(body, rng) if body else data + b"\x00"
    if op == 6:  # NaN and other non-JSON inside an otherwise valid header (SAF-4)
        value = rng.choice(("NaN", "Infinity", "-Infinity", "1e999"))
        key = rng.choice(list(doc)) if doc else "x"
        text = header.rstrip(b" ")[:-1] + f',"{key}x":{{"dtype":"F32","shape":[],"nan":{value}}}}}'.encode()
        return struct.pack("<Q", len(text)) + text + body
    return mutate_bytes(data, rng)


# ---------------------------------------------------------------- msgpack


def _msgpack_special(rng: Random) -> Any:
    choices: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice((True, False, 0.5, float("nan"), float("inf"), -0.0)),
        lambda: rng.choice((2**64 - 1, -(2**63), 2**63, -1, 0)),
        lambda: rng.choice((b"", b"\x00" * 9, "", "x" * 1000)),
        lambda: rng.choice(([], {}, [[]], {"": None})),
        lambda: msgpack.ExtType(1, rng.choice((b"", b"\x00", b"\x00\x01", b"\xff\xff", b"\x01" + b"\x00" * 8))),
        lambda: msgpack.ExtType(
            2,
            msgpack.packb(
                rng.choice(
                    (
                        ["float32", [2**40, 0], b""],
                        ["float32", [0, 2**62], b""],
                        ["float32", [2, 2], b"\x00" * 15],
                        ["nope", [1], b"\x00"],
                        ["float32", [-1], b""],
                        ["float32", "x", b""],
                        ["int64", [2**62, 2**62], b""],
                        [1, 2],
                    )
                ),
                use_bin_type=True,
            ),
        ),
        lambda: msgpack.ExtType(2, rng.randbytes(rng.choice((0, 1, 8)))),
        lambda: msgpack.ExtType(rng.choice((0, 3, 127)), rng.choice((b"", b"\x00" * 4, b"\x00" * 8))),
        lambda: msgpack.Timestamp(0, 0),
    ]
    return rng.choice(choices)()


def _raw_msgpack(rng: Random) -> bytes:
    """Encodings a structural emitter never writes: deep nesting, lying container headers, dup/int keys."""
    return rng.choice(
        (
            b"\x91" * rng.choice((65, 1000, 100_000)) + b"\xc0",
            b"\x81\xa1a" * rng.choice((65, 3000)) + b"\xc0",
            b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
            b"\xdd\xff\xff\xff\xff",  # array32 likewise
            b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
            b"\xdb\x7f\xff\xff\xff",  # str32 of 2 GiB
            b"\x82\xa1a\x01\xa1a\x02",  # duplicate key
            b"\x81\x01\x02",  # int key
            b"\x81\xc0\x02",  # nil key
            b"\xc7\x00\x01",  # empty ext 1
            b"\xd7\xff" + b"\x00" * 8,  # timestamp
            b"\xc1",  # never-used byte
        )
    )


def mutate_msgpack(data: bytes, rng: Random) -> bytes:
    """Mutate a msgpack blob: a value replaced inside the decoded structure (ext types, huge ints, odd keys), a raw
    encoding spliced in, or bytes."""
    op = rng.randrange(6)
    if op <= 2:
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType, timestamp=0)
        except Exception:  # the seed may itself be a mutant
            return mutate_bytes(data, rng)
        paths = json_paths(doc, limit=300)  # an RNG state holds thousands of integers: the first few hundred will do
        path = rng.choice(paths)
        node = _get(doc, path)
        if isinstance(node, dict) and node and rng.random() < 0.3:
            del node[rng.choice(list(node))]
        elif type(node) is int and rng.random() < 0.5:
            doc = _set(doc, path, rng.choice((node + 1, -node - 1, 2**64 - 1, -(2**63), node * 2**40)))
        else:
            doc = _set(doc, path, _msgpack_special(rng))
        try:
            return bytes(msgpack.packb(doc, use_bin_type=True, datetime=False))
        except (ValueError, TypeError, OverflowError):
            return mutate_bytes(data, rng)
    if op == 3:  # replace the first map value with a raw encoding: {"k": <raw>}
        if data[:1] and 0x81 <= data[0] <= 0x8F:
            return b"\x81\xa1k" + _raw_msgpack(rng)
        return _raw_msgpack(rng)
    if op == 4:
        return b"\x81\xa1k" + _raw_msgpack(rng)
    return mutate_bytes(data, rng)


# ---------------------------------------------------------------- pickles (DCP .metadata, .pt data.pkl)

# A pickle that reaches an admitted class and then sets attributes on the class itself with BUILD: no code
# runs, but every later user of the class in this process sees the change (issue 9).
_BUILD_ON_CLASS = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x0b\x00\x00\x00hostile_tagK\x01s\x86b."
)
_SETITEM_ON_ENUM = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    b"X\x08\x00\x00\x00__doc__X\x07\x00\x00\x00hostiles."
)
_FOREIGN = (
    b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
    b"\x80\x02cbuiltins\neval\nX\x01\x00\x00\x001\x85R.",
    b"\x80\x02cpathlib\nPath\nX\x02\x00\x00\x00..\x85R.",
    b"\x80\x02ctorch\nSize\n]K\x01a\x85R.",
    b"\x80\x02ctorch\nfloat32\n.",
    b"\x80\x02(" * 2000 + b".",
    b"\x80\x02" + b"]" * 10_000 + b".",
)


def pickle_ops(data: bytes) -> list[tuple[str, Any, int]]:
    try:
        return [(op.name, arg, pos or 0) for op, arg, pos in pickletools.genops(data)]
    except Exception:
        return []


def mutate_pickle(data: bytes, rng: Random) -> bytes:
    """Mutate a pickle at opcode granularity (truncate at or delete an opcode, change an integer or string
    argument), splice in crafted payloads (globals outside the allowlist, BUILD/SETITEM on an admitted class),
    or mutate bytes."""
    ops = pickle_ops(data)
    op = rng.randrange(8)
    if op == 0 and ops:
        _, _, pos = rng.choice(ops)
        return data[:pos]
    if op == 1 and len(ops) > 1:
        i = rng.randrange(len(ops) - 1)
        return data[: ops[i][2]] + data[ops[i + 1][2] :]
    if op == 2 and ops:
        ints = [(name, arg, pos) for name, arg, pos in ops if name in ("BININT1", "BININT2", "BININT")]
        if ints:
            name, _, pos = rng.choice(ints)
            value = rng.choice((*BOUNDARY_INTS, -1, -(2**31)))
            if rng.random() < 0.5:  # as LONG1: any size
                raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
                new = b"\x8a" + bytes([len(raw)]) + raw
            else:
                new = b"J" + struct.pack("<i", max(-(2**31), min(2**31 - 1, value)))
            width = {"BININT1": 2, "BININT2": 3, "BININT": 5}[name]
            return data[:pos] + new + data[pos + width :]
    if op == 3 and ops:
        strs = [(arg, pos) for name, arg, pos in ops if name in ("SHORT_BINUNICODE", "BINUNICODE") and arg]
        if strs:
            arg, pos = rng.choice(strs)
            new_text = rng.choice(("..", "/etc/passwd", "", "a/b", "__class__", str(arg) * 2, "\x00"))
            encoded = new_text.encode("utf-8", "surrogatepass")
            old_len = len(str(arg).encode("utf-8", "surrogatepass"))
            head = data[pos : pos + 1]
            width = 2 if head == b"\x8c" else 5
            if head == b"\x8c" and len(encoded) < 256:
                new = b"\x8c" + bytes([len(encoded)]) + encoded
            else:
                new = b"X" + struct.pack("<I", len(encoded)) + encoded
            return data[:pos] + new + data[pos + width + old_len :]
    if op == 4:
        return rng.choice((_BUILD_ON_CLASS, _SETITEM_ON_ENUM, *_FOREIGN))
    if op == 5 and ops:  # a crafted payload in place of the tail: after some valid prefix
        _, _, pos = rng.choice(ops)
        payload = rng.choice((_BUILD_ON_CLASS, _SETITEM_ON_ENUM, *_FOREIGN))
        return data[:pos] + payload[2:]
    return mutate_bytes(data, rng)


# ---------------------------------------------------------------- .pt zip archives


def mutate_pt(data: bytes, rng: Random) -> bytes:
    """Mutate a torch.save zip archive: its pickle, a storage record, an entry's name or presence, the zip
    structure itself; or bytes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            entries = [(info.filename, z.read(info.filename)) for info in z.infolist()]
    except Exception:
        return mutate_bytes(data, rng)
    op = rng.randrange(7)
    i = rng.randrange(len(entries))
    name, payload = entries[i]
    if op <= 2:
        pkl = [j for j, (n, _) in enumerate(entries) if n.endswith(".pkl")]
        if pkl:
            i = rng.choice(pkl)
            name, payload = entries[i]
        entries[i] = (name, mutate_pickle(payload, rng))
    elif op == 3:
        entries[i] = (
            name,
            rng.choice((payload[: len(payload) // 2], b"", payload + b"\x00" * 8, flip_bits(payload, rng))),
        )
    elif op == 4:
        if rng.random() < 0.5:
            del entries[i]
        else:
            entries.append((name, payload))  # a duplicate entry name
    elif op == 5:
        entries[i] = (rng.choice(("../../evil", "/abs/path", name + "x", name.upper())), payload)
    else:
        return mutate_bytes(data, rng)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # duplicate names are the point
            for entry_name, entry_data in entries:
                z.writestr(entry_name, entry_data)
    return out.getvalue()


# ---------------------------------------------------------------- files by kind, and trees


def kind_of(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    if base == "manifest.json":
        return "manifest"
    if base.endswith(".safetensors"):
        return "safetensors"
    if ".msgpack" in base:
        return "msgpack"
    if base == ".metadata":
        return "pickle"
    if base.endswith((".pt", ".bin", ".pth")):
        return "pt"
    if base.endswith(".json") or base == ".writer-lock":
        return "json"
    return "bytes"


MUTATORS: dict[str, Callable[[bytes, Random], bytes]] = {
    "manifest": mutate_manifest,
    "safetensors": mutate_safetensors,
    "msgpack": mutate_msgpack,
    "pickle": mutate_pickle,
    "pt": mutate_pt,
    "json": lambda data, rng: mutate_json(data, rng) if _is_json(data) else mutate_bytes(data, rng),
    "bytes": mutate_bytes,
}


def _is_json(data: bytes) -> bool:
    return _json_or_none(data) is not None


def mutate_file(path: str, data: bytes, rng: Random) -> bytes:
    return guarded(MUTATORS[kind_of(path)], data, rng)


def guarded(mutate: Callable[[bytes, Random], bytes], data: bytes, rng: Random) -> bytes:
    """A structural mutator meeting a mutant it did not foresee falls back to a byte mutation (still determined by
    the seed), rather than ending a long run."""
    try:
        return mutate(data, rng)
    except Exception:
        return mutate_bytes(data, rng)


@dataclass(frozen=True)
class Symlink:
    """A symlink in the tree; ``target`` is a sentinel name (see sentinel.SYMLINK_TARGETS) or a relative path."""

    target: str


@dataclass(frozen=True)
class Fifo:
    pass


@dataclass(frozen=True)
class Socket:
    pass


Node = bytes | Symlink | Fifo | Socket
Tree = dict[str, Node]


def tree_files(tree: Tree) -> list[str]:
    return sorted(p for p, v in tree.items() if isinstance(v, bytes))


def mutate_tree(tree: Tree, rng: Random, *, special: bool = True) -> Tree:
    """One mutation of a tree of files: one file's content by its kind (mostly), or the tree's shape (a file
    deleted, added, replaced by a symlink to a sentinel outside, by a FIFO or a socket; a directory replaced by
    a symlink to a directory outside)."""
    out = dict(tree)
    files = tree_files(out)
    op = rng.random()
    if op < 0.8 and files:
        path = rng.choice(files)
        data = out[path]
        assert isinstance(data, bytes)
        out[path] = mutate_file(path, data, rng)
        return out
    if not files:
        return out
    path = rng.choice(files)
    action = rng.randrange(6 if special else 3)
    if action == 0:
        del out[path]
    elif action == 1:
        head = path.rpartition("/")[0]
        extra = rng.choice(("stray.bin", "r00000-00099.safetensors", "context.msgpack.bak", ".hidden", "manifest.json"))
        out[f"{head}/{extra}" if head else extra] = rng.choice((b"", b"{}", rng.randbytes(32)))
    elif action == 2:
        out[path] = b""
    elif action == 3:
        out[path] = Symlink(rng.choice(("sentinel-file", "sentinel-manifest", "dev-zero")))
    elif action == 4:
        head = path.rpartition("/")[0]
        if head:  # the whole directory becomes a symlink to a directory outside
            for p in [p for p in out if p.startswith(head + "/")]:
                del out[p]
            out[head] = Symlink("sentinel-dir")
        else:
            out[path] = Symlink("sentinel-file")
    else:
        out[path] = rng.choice((Fifo(), Socket()))
    return out
