"""Checks ``run --writer`` makes on a checkpoint a writer produced, each deciding one writer-side MUST.

The content itself is compared by the runner (reference reader vs the writer input); these checks
look at what content comparison cannot see: bytes, names and inventory. COM-16 (determinism) is
checked by the runner, which calls the writer twice. The reference checks (REF-11, REF-12) compare the
referenced chunks with the manifests of the bases beside the output, where the runner put them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ckptfmt
from ckptfmt.blocks import BlockHasher, Blocks
from ckptfmt.blocks import problem as block_problem
from ckptfmt.canonical import config_hash, manifest_bytes
from ckptfmt.digests import is_tree
from ckptfmt.errors import CheckpointError
from ckptfmt.paths import check_path
from ckptfmt.profiles import PROFILES
from ckptfmt.quarantine import writer_problem
from ckptfmt.tree_digests import chunk_digest_of, file_digest_of

from .msgpack_scan import encoding_problems

DIGEST = re.compile(r"(xxh3-128(-tree)?:[0-9a-f]{32}|sha256(-tree)?:[0-9a-f]{64})")
DATA_NAME = re.compile(r"([a-z][a-z0-9_]{0,63})/r[0-9]{5,}-[0-9]{5,}\.safetensors")
ID_IN_OUTPUT = re.compile(r"sha256:[0-9a-f]{64}")
REFERENCES = "ckptfmt.references"


@dataclass(frozen=True)
class Output:
    """What a writer left in its output directory, and what it printed."""

    root: Path
    stdout: str
    raw: bytes  # manifest.json as stored
    manifest: dict[str, Any]

    def chunks(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, chunk record) of every chunk stored in the checkpoint's own files (not a referenced one)."""
        return [(fname, chunk) for fname, _, chunk in self.all_chunks() if "base" not in chunk]

    def referenced(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(field, tensor, chunk record) of every referenced chunk (spec/references.md)."""
        return [(fname, tname, chunk) for fname, tname, chunk in self.all_chunks() if "base" in chunk]

    def all_chunks(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [
            (fname, tname, chunk)
            for fname, field in self.manifest["fields"].items()
            for tname, tensor in field.get("tensors", {}).items()
            for chunk in tensor["chunks"]
        ]

    def base_records(self) -> list[dict[str, Any]]:
        """The base records of the ``ckptfmt.references`` extension ([] without it)."""
        for ext in self.manifest.get("extensions", []):
            if ext.get("name") == REFERENCES:
                bases: list[dict[str, Any]] = ext.get("configuration", {}).get("bases", [])
                return bases
        return []

    def contexts(self) -> dict[str, str]:
        return {f: rec["context"]["path"] for f, rec in self.manifest["fields"].items() if "context" in rec}


Check = Callable[[Output], list[str]]


def canonical_manifest(out: Output) -> list[str]:
    return [] if manifest_bytes(json.loads(out.raw)) == out.raw else ["manifest.json is not in canonical form"]


def reported_id(out: Output) -> list[str]:
    actual = "sha256:" + hashlib.sha256(out.raw).hexdigest()
    return [f"reported id {cid} is not {actual}" for cid in ID_IN_OUTPUT.findall(out.stdout) if cid != actual]


def inventory(out: Output) -> list[str]:
    listed = {r["path"] for r in out.manifest["files"]}
    referenced = {c["path"] for _, c in out.chunks()} | set(out.contexts().values())
    present = {
        p.relative_to(out.root).as_posix()
        for p in out.root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out.root).parts)
    } - {"manifest.json"}
    problems = [f"{p} is listed but is no data file or context blob" for p in sorted(listed - referenced)]
    return problems + [f"{p} was written but is not listed" for p in sorted(present - listed)]


def paths(out: Output) -> list[str]:
    problems = []
    written = [r["path"] for r in out.manifest["files"]] + [c["path"] for _, _, c in out.all_chunks()]
    for path in written + [f["path"] for b in out.base_records() for f in b.get("files", [])]:
        try:
            check_path(path)
        except CheckpointError as exc:
            problems.append(exc.message)
    return problems


CONTEXT_RANK_NAME = re.compile(r"context\.r\d{5,}\.msgpack")  # LAY-1: a blob written by a rank other than 0


def names(out: Output) -> list[str]:
    problems = [
        f"data file {c['path']} is not {f}/r<RANK>-<SEQ>.safetensors"
        for f, c in out.chunks()
        if (m := DATA_NAME.fullmatch(c["path"])) is None or m.group(1) != f
    ]
    return problems + [
        f"context blob {p} is not {f}/context.msgpack or {f}/context.r<RANK>.msgpack"
        for f, p in out.contexts().items()
        if p != f"{f}/context.msgpack"
        and CONTEXT_RANK_NAME.fullmatch(p[len(f) + 1 :] if p.startswith(f + "/") else "") is None
    ]


def one_field_per_file(out: Output) -> list[str]:
    owners: dict[str, set[str]] = {}
    for fname, chunk in out.chunks():
        owners.setdefault(chunk["path"], set()).add(fname)
    return [f"{p} holds chunks of fields {sorted(f)}" for p, f in owners.items() if len(f) > 1]


def digests(out: Output) -> list[str]:
    values = [r["digest"] for r in out.manifest["files"]] + [c["digest"] for _, _, c in out.all_chunks()]
    values += [f["digest"] for b in out.base_records() for f in b.get("files", [])]
    return [
        f"digest {d!r} is not xxh3-128, sha256 or their tree forms in canonical form"
        for d in values
        if DIGEST.fullmatch(str(d)) is None
    ]


def codecs(out: Output) -> list[str]:
    """The inputs ask for no codec: every chunk the writer stored is raw (a referenced one has the base's, REF-11)."""
    return [
        f"chunk {c['key']!r} has codec {c['codec']!r}" for _, c in out.chunks() if c.get("codec") != {"name": "raw"}
    ]


def data_files(out: Output) -> list[str]:
    report = ckptfmt.verify(out.root)
    return [str(p) for p in report.problems if p.code == "safetensors_header"]


def blob_encoding(requirement: str) -> Check:
    def check(out: Output) -> list[str]:
        problems = []
        for path in out.contexts().values():
            problems += [
                f"{path}: {m}" for rid, m in encoding_problems((out.root / path).read_bytes()) if rid == requirement
            ]
        return problems

    return check


def _types(value: object, spec: dict[str, Callable[[object], bool]], where: str) -> list[str]:
    if not isinstance(value, dict):
        return []  # the required members are the reader's to check
    return [f"{where}.{k} has the wrong type" for k, ok in spec.items() if k in value and not ok(value[k])]


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(v: object) -> bool:
    return isinstance(v, str)


def _map_of(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, dict) and all(ok(x) for x in v.values())


def _array_of(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


def optional_members(out: Output) -> list[str]:
    """FLD-1 for the optional members (readers check the required ones)."""
    with ckptfmt.open(out.root) as ckpt:
        blobs = {
            f: ckpt.read_context(f)
            for f in ("data", "topology", "provenance")
            if ckpt.fields.get(f) and ckpt.fields[f].kind == "context"
        }
    problems = []
    if "data" in blobs:
        data = blobs["data"]
        problems += _types(
            data,
            {
                "dataset": _map_of(_str),
                "sampler": lambda v: isinstance(v, dict),
                "shard_offsets": _map_of(_int),
                "quarantined_shards": _array_of(_str),
            },
            "data",
        )
    if "topology" in blobs:
        topo = blobs["topology"]
        problems += _types(topo, {"rank": _int, "mesh": lambda v: isinstance(v, dict)}, "topology")
        problems += _types(topo.get("mesh"), {"dims": _array_of(_str), "shape": _array_of(_int)}, "topology.mesh")
    if "provenance" in blobs:
        prov = blobs["provenance"]
        problems += _types(
            prov,
            {
                "code": lambda v: isinstance(v, dict),
                "step": _int,
                "parent": _str,
                "host": _str,
                "versions": _map_of(_str),
            },
            "provenance",
        )
        problems += _types(
            prov.get("code"),
            {"commit": _str, "dirty": lambda v: isinstance(v, bool), "repository": _str},
            "provenance.code",
        )
    return problems


def quarantine_record(out: Output) -> list[str]:
    """FLD-13: the data field's quarantine record, when there is one."""
    if "data" not in out.contexts():
        return []
    with ckptfmt.open(out.root) as ckpt:
        data = ckpt.read_context("data")
    if "quarantine" not in data:
        return []
    problem = writer_problem(data["quarantine"], data.get("quarantined_shards", []))
    return [] if problem is None else [problem]


def config_hashes(out: Output) -> list[str]:
    if "config" not in out.contexts():
        return []
    with ckptfmt.open(out.root) as ckpt:
        value = ckpt.read_context("config")
    expected = config_hash(value["config"])
    return [] if value["hash"] == expected else [f"hash {value['hash']} is not {expected}"]


def profile_fields(out: Output) -> list[str]:
    fields = out.manifest["fields"]
    required = PROFILES.get(out.manifest["profile"], {})
    return [
        f"required field {n!r} of kind {k!r} is missing"
        for n, k in required.items()
        if fields.get(n, {}).get("kind") != k
    ]


def expected_version(manifest: dict[str, Any]) -> str:
    """The ``format_version`` VER-1 asks of a writer for this manifest: 1.3 with a tree digest or delta chunks
    (DLT-7), 1.2 with block digests, 1.1 with codecs."""
    chunks = [c for f in manifest["fields"].values() for t in f.get("tensors", {}).values() for c in t["chunks"]]
    written = [r["digest"] for r in manifest["files"]] + [c["digest"] for c in chunks]
    for extension in manifest.get("extensions", []):
        if extension.get("name") == "ckptfmt.references":
            written += [f["digest"] for b in extension["configuration"]["bases"] for f in b["files"]]
    if any(is_tree(str(d).partition(":")[0]) for d in written) or any(
        c.get("codec", {}).get("name") == "xor-zstd" for c in chunks
    ):
        return "1.3"
    if any("blocks" in c for c in chunks):
        return "1.2"
    return "1.1" if any(c.get("codec", {}).get("name") != "raw" for c in chunks) else "1.0"


def version(out: Output) -> list[str]:
    want, got = expected_version(out.manifest), out.manifest["format_version"]
    return [] if got == want else [f"format_version is {got!r}, not {want!r}"]


def block_digests(out: Output) -> list[str]:
    """BLK-4: every block digest written is the digest of that block's bytes (the format version is VER-1's)."""
    problems, files = [], {}
    for _, chunk in out.chunks():
        if "blocks" not in chunk:
            continue
        where = f"chunk {chunk['key']!r} of {chunk['path']}"
        begin, end = chunk["range"]
        algorithm = chunk["digest"].partition(":")[0]
        if (found := block_problem(chunk["blocks"], nbytes=end - begin, algorithm=algorithm)) is not None:
            problems.append(f"{where}: {found[0]}")
            continue
        if chunk["path"] not in files:
            files[chunk["path"]] = (out.root / chunk["path"]).read_bytes()
        hasher = BlockHasher(algorithm, chunk["blocks"]["size"])
        hasher.update(memoryview(files[chunk["path"]])[begin:end])
        actual = hasher.finish()
        written = Blocks(size=chunk["blocks"]["size"], digests=chunk["blocks"]["digests"])
        problems += [
            f"{where}: block {i} hashes to {got}, the manifest says {said}"
            for i in range(actual.count(end - begin))
            if (got := actual.digest(algorithm, i)) != (said := written.digest(algorithm, i))
        ]
    return problems


def tree_digests(out: Output) -> list[str]:
    """TRE-1: every tree digest written is the value spec/tree-digests.md defines (a file's, of a data file)."""
    problems = []
    for record in out.manifest["files"]:
        algorithm = record["digest"].partition(":")[0]
        if (
            is_tree(algorithm)
            and (got := file_digest_of(algorithm, (out.root / record["path"]).read_bytes())) != (record["digest"])
        ):
            problems.append(f"file {record['path']}: its tree digest is {got}, the manifest says {record['digest']}")
    for _, chunk in out.chunks():
        algorithm = chunk["digest"].partition(":")[0]
        if is_tree(algorithm):
            begin, end = chunk["range"]
            got = chunk_digest_of(algorithm, (out.root / chunk["path"]).read_bytes()[begin:end])
            if got != chunk["digest"]:
                problems.append(f"chunk {chunk['key']!r} of {chunk['path']}: its tree digest is {got}")
    return problems


REFERENCED_MEMBERS = ("path", "key", "range", "digest", "codec", "blocks")


@dataclass(frozen=True)
class _Base:
    """A checkpoint beside the output that a base record names: its id and what it stores itself."""

    checkpoint_id: str
    files: dict[str, dict[str, Any]]  # path -> its own file record
    chunks: dict[tuple[str, str], tuple[str, str, dict[str, Any], dict[str, Any]]]  # (path, key) -> field, tensor...


def _base(out: Output, location: str, cache: dict[str, _Base | str]) -> _Base | str:
    """The base at ``location`` (beside the output), or why it cannot be one."""
    if location not in cache:
        name = location.removeprefix("../")
        if not location.startswith("../") or "/" in name or name in ("", ".", ".."):
            cache[location] = f"location {location!r} is not '../<name>'"
        elif not (out.root.parent / name / "manifest.json").is_file():
            cache[location] = f"there is no checkpoint at {location}"
        else:
            raw = (out.root.parent / name / "manifest.json").read_bytes()
            doc = json.loads(raw)
            cache[location] = _Base(
                checkpoint_id="sha256:" + hashlib.sha256(raw).hexdigest(),
                files={r["path"]: r for r in doc["files"]},
                chunks={
                    (c["path"], c["key"]): (fname, tname, tensor, c)
                    for fname, field in doc["fields"].items()
                    for tname, tensor in field.get("tensors", {}).items()
                    for c in tensor["chunks"]
                    if "base" not in c  # what the base stores itself
                },
            )
    return cache[location]


def references_recorded(out: Output) -> list[str]:
    """REF-11: a referenced chunk is a chunk its base stores itself, recorded as the base records it; the base
    record has the base's id and file records; no base record and no base file goes unused."""
    problems: list[str] = []
    records = {b.get("location"): b for b in out.base_records()}
    cache: dict[str, _Base | str] = {}
    used: set[tuple[str, str]] = set()
    for _, _, chunk in out.referenced():
        where = f"referenced chunk {chunk.get('key')!r} of {chunk.get('base')}"
        record = records.get(chunk["base"])
        if record is None:
            problems.append(f"{where}: no base record has that location")
            continue
        base = _base(out, chunk["base"], cache)
        if isinstance(base, str):
            problems.append(f"{where}: {base}")
            continue
        used.add((chunk["base"], chunk["path"]))
        stored = base.chunks.get((chunk["path"], chunk["key"]))
        if stored is None:
            problems.append(f"{where}: the base does not store it itself (reference it where it is stored)")
            continue
        differs = [m for m in REFERENCED_MEMBERS if chunk.get(m) != stored[3].get(m)]
        if differs:
            problems.append(f"{where}: its {', '.join(differs)} differ from the base's record of it")
    for location, record in records.items():
        base = _base(out, str(location), cache)
        if isinstance(base, str):
            problems.append(f"base record {location}: {base}")
            continue
        if record.get("checkpoint_id") != base.checkpoint_id:
            problems.append(f"base record {location}: checkpoint_id is not the id of the checkpoint there")
        for f in record.get("files", []):
            if (location, f.get("path")) not in used:
                problems.append(f"base record {location} lists {f.get('path')}, where no referenced chunk lives")
            elif base.files.get(f["path"]) != f:
                problems.append(f"base record {location}: {f['path']} is not the base's own record of it")
    return problems


def references_match(out: Output) -> list[str]:
    """REF-12: a chunk is referenced only for a chunk of the same tensor (field, name, dtype, shape), at the same
    offsets and of the same shape (its bytes are compared by the reference reader's read-back of the content)."""
    problems: list[str] = []
    cache: dict[str, _Base | str] = {}
    for fname, tname, chunk in out.referenced():
        base = _base(out, chunk["base"], cache)
        stored = None if isinstance(base, str) else base.chunks.get((chunk["path"], chunk["key"]))
        if stored is None:
            continue  # REF-11's to report
        tensor = out.manifest["fields"][fname]["tensors"][tname]
        mine = (fname, tname, tensor["dtype"], tensor["shape"], chunk["offsets"], chunk["shape"])
        field, name, record, found = stored
        theirs = (field, name, record["dtype"], record["shape"], found["offsets"], found["shape"])
        if mine != theirs:
            problems.append(
                f"chunk {chunk['key']!r} of {fname}/{tname} references a chunk of {theirs[0]}/{theirs[1]} "
                f"({theirs[2]} {theirs[3]}, offsets {theirs[4]}, shape {theirs[5]}), not one of {mine[2]} {mine[3]} "
                f"at offsets {mine[4]}, shape {mine[5]}"
            )
    return problems


def lock_removed(out: Output) -> list[str]:
    return [".writer-lock is still there after the save"] if (out.root / ".writer-lock").exists() else []


CHECKS: tuple[tuple[str, Check], ...] = (
    ("MAN-1", canonical_manifest),
    ("MAN-3", reported_id),
    ("MAN-17", inventory),
    ("PTH-1", paths),
    ("LAY-1", names),
    ("LAY-2", one_field_per_file),
    ("DIG-1", digests),
    ("TEN-13", codecs),
    ("SAF-1", data_files),
    ("CTX-8", blob_encoding("CTX-8")),
    ("CTX-10", blob_encoding("CTX-10")),
    ("FLD-1", optional_members),
    ("FLD-13", quarantine_record),
    ("CFG-1", config_hashes),
    ("PRO-2", profile_fields),
    ("VER-1", version),
    ("BLK-4", block_digests),
    ("TRE-1", tree_digests),
    ("REF-11", references_recorded),
    ("REF-12", references_match),
    ("COM-13", lock_removed),
)
DETERMINISM = "COM-16"


def run_checks(root: Path, stdout: str) -> list[tuple[str, str]]:
    """(requirement ID, problem) for every check that fails on the checkpoint at ``root``."""
    raw = (root / "manifest.json").read_bytes()
    out = Output(root=root, stdout=stdout, raw=raw, manifest=json.loads(raw))
    problems = []
    for rid, check in CHECKS:
        try:
            problems += [(rid, p) for p in check(out)]
        except (CheckpointError, ValueError, KeyError, TypeError, OSError) as exc:
            problems.append((rid, f"could not check: {type(exc).__name__}: {exc}"))
    return problems
