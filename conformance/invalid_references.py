"""Vectors about references (spec/references.md): the runs they are written in, and the invalid vectors.

A referencing checkpoint needs its bases beside it, so the vector's directory is a small run directory:
the checkpoint under test is ``<vector>/checkpoint`` as in every vector, and each base is a sibling,
``<vector>/step-1`` (location ``../step-1``), written first by the reference writer (:class:`Base`). The
checkpoint itself is the reference writer's output for an input whose hints name the base
(conformance/reference_writer.py): the writer decides what it references, as it does in a real run.

Each invalid vector starts from one of two such runs, both also valid vectors: ``ref-weights`` (the
``weights`` vector with tensor w changed: s and e referenced in ``step-1``, w stored) and ``ref-chain``
(``step-2`` references ``step-1``; the checkpoint references chunks stored in both). A mutation that edits a
base keeps it consistent and then rebinds the referencing record to it (:func:`rebind`: the base's new id, its
file records), so that the vector breaks the one rule it is about and is not caught by REF-7 or REF-8 first.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfmt.canonical import canonical_json

from .edits import DATA, Mutation, chain, set_file
from .inputs import document, provenance, tensor, weights_base
from .invalid import Invalid, symlink_file
from .mutations import Json, Tree
from .reference_writer import write
from .values import load

STEP1, STEP2 = "step-1", "step-2"
PROV = "provenance/context.msgpack"


@dataclass(frozen=True)
class Base:
    """A checkpoint written beside the one under test, before it: ``<vector>/<name>``."""

    name: str
    input: Callable[[], dict[str, Any]]
    post: Callable[[Tree], None] | None = None


def referencing(doc: dict[str, Any], base: str, frozen: tuple[str, ...] = ()) -> dict[str, Any]:
    """``doc`` with the hints that make the reference writer reference the checkpoint ``../<base>``."""
    hints: dict[str, Any] = {**doc.get("hints", {}), "base": base}
    if frozen:
        hints["frozen"] = list(frozen)
    return {**doc, "hints": hints}


def changed(doc: dict[str, Any], name: str, entry: dict[str, Any], field: str = "weights") -> dict[str, Any]:
    """``doc`` with tensor ``name`` of ``field`` replaced by ``entry`` (new bytes: it is stored, not referenced)."""
    out = copy.deepcopy(doc)
    out["fields"][field]["tensors"][name] = entry
    return out


# ---------------------------------------------------------------- the runs


def ref_weights_input() -> dict[str, Any]:
    """The ``weights`` vector with w changed, written beside ``step-1`` (the ``weights`` vector itself)."""
    return referencing(changed(weights_base(), "w", tensor("F32", [2, 3], seed=9)), STEP1)


REF_WEIGHTS_BASES = (Base(STEP1, weights_base),)


def _chain_doc(seeds: tuple[int, int, int]) -> dict[str, Any]:
    """Tensor a in a field of its own (frozen/, never changes), b and c in weights/, from the seeds given."""
    return document(
        "weights",
        {
            "frozen": {"kind": "tensors", "tensors": {"a": tensor("F32", [4, 4], seed=seeds[0])}},
            "weights": {
                "kind": "tensors",
                "tensors": {"b": tensor("F32", [4, 4], seed=seeds[1]), "c": tensor("F32", [4, 4], seed=seeds[2])},
            },
            "provenance": provenance(),
        },
    )


def chain_input() -> dict[str, Any]:
    """c changed since step-2: a is stored in step-1 (which step-2 references), b in step-2, c here."""
    return referencing(_chain_doc((21, 32, 43)), STEP2)


CHAIN_BASES = (
    Base(STEP1, lambda: _chain_doc((21, 22, 23))),
    Base(STEP2, lambda: referencing(_chain_doc((21, 32, 23)), STEP1)),  # b changed; a and c referenced
)

RUNS: dict[str, tuple[Base, ...]] = {"ref-weights": REF_WEIGHTS_BASES, "ref-chain": CHAIN_BASES}


# ---------------------------------------------------------------- edits


def extension(doc: Json) -> Json:
    record: Json = next(e for e in doc["extensions"] if e["name"] == "ckptfmt.references")
    return record


def base_records(doc: Json) -> list[Json]:
    bases: list[Json] = extension(doc)["configuration"]["bases"]
    return bases


def base_record(doc: Json, location: str = "../" + STEP1) -> Json:
    return next(b for b in base_records(doc) if b["location"] == location)


def referenced(doc: Json) -> Iterator[Json]:
    for field in doc["fields"].values():
        for record in field.get("tensors", {}).values():
            yield from (c for c in record["chunks"] if "base" in c)


def ref_chunk(doc: Json, name: str = "s", index: int = 0, field: str = "weights") -> Json:
    chunk: Json = doc["fields"][field]["tensors"][name]["chunks"][index]
    assert "base" in chunk, chunk  # a guard against a changed writer: the vectors edit a reference
    return chunk


def edit(fn: Callable[[Json], object]) -> Mutation:
    return lambda t: t.edit(fn)


def on_extension(fn: Callable[[Json], object]) -> Mutation:
    return edit(lambda doc: fn(extension(doc)))


def relocate(location: str) -> Mutation:
    """The base is at ``location``: its record and every chunk referencing it say so."""

    def fn(doc: Json) -> None:
        base_record(doc)["location"] = location
        for chunk in referenced(doc):
            chunk["base"] = location

    return edit(fn)


def base_tree(t: Tree, name: str = STEP1) -> Tree:
    return Tree(t.root.parent / name)


def manifest_id(tree: Tree) -> str:
    return "sha256:" + hashlib.sha256(tree.raw_manifest()).hexdigest()


def rebind(t: Tree, name: str = STEP1) -> None:
    """Make the record of base ``name`` what a writer referencing it now would write: its id and file records."""
    base = base_tree(t, name)
    own = {r["path"]: r for r in base.manifest()["files"]}

    def fn(doc: Json) -> None:
        record = base_record(doc, "../" + name)
        record["checkpoint_id"] = manifest_id(base)
        record["files"] = [dict(own[f["path"]]) for f in record["files"]]

    t.edit(fn)


def in_base(mutation: Mutation, name: str = STEP1) -> Mutation:
    """Apply ``mutation`` to base ``name`` (its own manifest follows, as for any checkpoint), then rebind to it."""

    def run(t: Tree) -> None:
        mutation(base_tree(t, name))
        rebind(t, name)

    return run


def base_only(mutation: Mutation, name: str = STEP1) -> Mutation:
    """Apply ``mutation`` to base ``name`` and leave the referencing record as it was."""
    return lambda t: mutation(base_tree(t, name))


def flip_referenced_byte(t: Tree) -> None:
    """A byte of chunk s@0's bytes in the base flipped; the base's file record follows, its chunk record does not."""
    begin = t.manifest()["fields"]["weights"]["tensors"]["s"]["chunks"][0]["range"][0]  # the base's own record
    data = bytearray(t.read(DATA))
    data[begin] ^= 0x01
    t.write(DATA, bytes(data))


def rename_entry(old: str, new: str) -> Mutation:
    """Rename a header entry of the data file (same length: no range moves); the file record follows."""
    assert len(old) == len(new)

    def fn(h: dict[str, Any]) -> None:
        h[new] = h.pop(old)

    return lambda t: t.rewrite_data_file(DATA, header=fn)


def move_base(t: Tree, where: str) -> None:
    """Move ``step-1`` to ``<vector>/<where>`` (made relative to the vector directory)."""
    target = t.root.parent / where
    target.parent.mkdir(parents=True, exist_ok=True)
    (t.root.parent / STEP1).rename(target)


def _symlinked_base(t: Tree) -> None:
    """Move step-1 to ``elsewhere/step-1`` and leave a relative symbolic link to it in its place."""
    move_base(t, "elsewhere/" + STEP1)
    (t.root.parent / STEP1).symlink_to(Path("elsewhere") / STEP1, target_is_directory=True)


def replaced_base(t: Tree) -> None:
    """step-1 written again with another provenance: the same data file, byte for byte, another checkpoint."""
    before = base_tree(t).read(DATA)
    shutil.rmtree(base_tree(t).root)
    doc = weights_base()
    doc["fields"]["provenance"] = provenance(created_at="2025-01-02T00:00:00Z")
    write(load(canonical_json(doc)), base_tree(t).root)  # as generate.py writes every input
    assert base_tree(t).read(DATA) == before


def add_base_file(path: str) -> Mutation:
    """List the base's own record of ``path`` in the base record too (sorted), though no chunk lives in it."""

    def run(t: Tree) -> None:
        own = next(r for r in base_tree(t).manifest()["files"] if r["path"] == path)

        def fn(doc: Json) -> None:
            files = base_record(doc)["files"]
            files.append(dict(own))
            files.sort(key=lambda r: r["path"])

        t.edit(fn)

    return run


def upper_hex_id(doc: Json) -> None:
    record = base_record(doc)
    algorithm, _, hex_digits = record["checkpoint_id"].partition(":")
    record["checkpoint_id"] = f"{algorithm}:{hex_digits.upper()}"


def chain_through_step2(t: Tree) -> None:
    """Chunk a, stored in step-1, is referenced at step-2, which only references it (step-1's record goes)."""

    def fn(doc: Json) -> None:
        chunk = ref_chunk(doc, "a", field="frozen")
        assert chunk["base"] == "../" + STEP1
        step1, step2 = base_record(doc, "../" + STEP1), base_record(doc, "../" + STEP2)
        moved = next(f for f in step1["files"] if f["path"] == chunk["path"])
        step1["files"].remove(moved)
        if not step1["files"]:
            base_records(doc).remove(step1)
        step2["files"] = sorted([*step2["files"], moved], key=lambda r: r["path"])
        chunk["base"] = "../" + STEP2

    t.edit(fn)


def _check_run(t: Tree) -> None:
    """The ref-weights run must have what the vectors edit: s and e referenced in step-1, w stored."""
    doc = t.manifest()
    assert [b["location"] for b in base_records(doc)] == ["../" + STEP1]
    assert {c["key"] for c in referenced(doc)} == {"s@0", "s@2", "e"}, sorted(c["key"] for c in referenced(doc))
    assert [f["path"] for f in base_record(doc)["files"]] == [DATA]


def _ref(name: str, requirements: tuple[str, ...], note: str, mutate: Mutation, **kw: Any) -> Invalid:
    return Invalid(name, requirements, note, chain(_check_run, mutate), base="ref-weights", **kw)


S0 = ("fields", "weights", "tensors", "s", "chunks", 0)

VECTORS: tuple[Invalid, ...] = (
    # ---- REF-1: the extension record
    _ref(
        "ref-listed-twice",
        ("REF-1",),
        "The ckptfmt.references record is listed twice in 'extensions' (the same record).",
        edit(lambda d: d["extensions"].append(copy.deepcopy(extension(d)))),
    ),
    _ref(
        "ref-not-must-understand",
        ("REF-1",),
        "The ckptfmt.references record has must_understand false.",
        on_extension(lambda e: e.__setitem__("must_understand", False)),
    ),
    # ---- REF-2: configuration and bases
    _ref(
        "ref-no-configuration",
        ("REF-2",),
        "The ckptfmt.references record has no 'configuration'.",
        on_extension(lambda e: e.pop("configuration")),
    ),
    _ref(
        "ref-no-bases",
        ("REF-2",),
        "The configuration is {}: no 'bases'.",
        on_extension(lambda e: e.__setitem__("configuration", {})),
    ),
    _ref(
        "ref-bases-empty",
        ("REF-2",),
        "'bases' is [].",
        on_extension(lambda e: e["configuration"].__setitem__("bases", [])),
    ),
    _ref(
        "ref-bases-not-array",
        ("REF-2",),
        "'bases' is the one base record itself, not an array of it.",
        on_extension(lambda e: e["configuration"].__setitem__("bases", e["configuration"]["bases"][0])),
    ),
    _ref(
        "ref-base-not-object",
        ("REF-2",),
        "'bases' is ['../step-1']: a location, not a base record.",
        on_extension(lambda e: e["configuration"].__setitem__("bases", ["../" + STEP1])),
    ),
    # ---- REF-3: locations
    _ref(
        "ref-location-absolute",
        ("REF-3",),
        "The base's location (and every chunk's 'base') is '/step-1', an absolute path.",
        relocate("/" + STEP1),
    ),
    _ref(
        "ref-location-grandparent",
        ("REF-3",),
        "The base's location is '../..', the run directory's parent.",
        relocate("../.."),
    ),
    _ref(
        "ref-location-nested",
        ("REF-3",),
        "The base is at <vector>/runs/step-1 and its location is '../runs/step-1' (two segments): a reader that "
        "resolved it would find a valid base there.",
        chain(lambda t: move_base(t, "runs/" + STEP1), relocate("../runs/" + STEP1)),
    ),
    _ref(
        "ref-location-dot",
        ("REF-3",),
        "The base is at checkpoint/step-1 (an unlisted directory of the checkpoint) and its location is "
        "'./step-1': a reader that resolved it would find a valid base there.",
        chain(lambda t: move_base(t, "checkpoint/" + STEP1), relocate("./" + STEP1)),
    ),
    _ref(
        "ref-location-trailing-slash",
        ("REF-3",),
        "The base's location is '../step-1/', which a lax reader would resolve to the valid base.",
        relocate("../" + STEP1 + "/"),
    ),
    _ref(
        "ref-location-duplicate",
        ("REF-3",),
        "Two base records (the same record twice) have the location '../step-1'.",
        on_extension(lambda e: e["configuration"]["bases"].append(copy.deepcopy(e["configuration"]["bases"][0]))),
    ),
    _ref(
        "ref-location-absent",
        ("REF-3",),
        "The base record has no location (errata of 1.2: an absent location does not match the grammar).",
        edit(lambda d: base_record(d).pop("location")),
        also=("REF-6",),  # the referenced chunks' base is then the location of no record
    ),
    _ref(
        "ref-location-not-string",
        ("REF-3",),
        "The base record's location is the number 7.",
        edit(lambda d: base_record(d).__setitem__("location", 7)),
        also=("MAN-7", "REF-6"),
    ),
    _ref(
        "ref-chunk-base-null",
        ("REF-6",),
        "Referenced chunk s@0 has 'base': null (not the location of a base record, errata of 1.2).",
        edit(lambda d: ref_chunk(d).__setitem__("base", None)),
        also=("MAN-7",),
    ),
    # ---- REF-4: checkpoint ids
    _ref(
        "ref-id-uppercase",
        ("REF-4",),
        "The base record's checkpoint_id is the base's id with its hex digits in uppercase.",
        edit(upper_hex_id),
        also=("REF-7",),  # no such id is the id of a checkpoint (a sha256 in lowercase hex)
    ),
    _ref(
        "ref-id-xxh3",
        ("REF-4",),
        "The base record's checkpoint_id is 'xxh3-128:' and 32 hex digits.",
        edit(lambda d: base_record(d).__setitem__("checkpoint_id", "xxh3-128:" + "0" * 32)),
        also=("REF-7",),  # no such id is the id of a checkpoint (a sha256 in lowercase hex)
    ),
    _ref(
        "ref-id-absent",
        ("REF-4",),
        "The base record has no checkpoint_id.",
        edit(lambda d: base_record(d).pop("checkpoint_id")),
        also=("REF-7",),  # no such id is the id of a checkpoint (a sha256 in lowercase hex)
    ),
    # ---- REF-5: the base's files
    _ref(
        "ref-files-absent",
        ("REF-5",),
        "The base record has no 'files'.",
        edit(lambda d: base_record(d).pop("files")),
        also=("REF-6",),  # the referenced chunks' path is then in no record of the base
    ),
    _ref(
        "ref-files-empty",
        ("REF-5",),
        "The base record's 'files' is [].",
        edit(lambda d: base_record(d).__setitem__("files", [])),
        also=("REF-6",),
    ),
    _ref(
        "ref-files-unsorted",
        ("REF-5",),
        "The base record lists the base's weights/ data file, then its provenance blob (its true record): not in "
        "ascending order of path.",
        chain(add_base_file(PROV), edit(lambda d: base_record(d)["files"].reverse())),
        also=("MAN-16",),  # REF-5: the rules of files, read as rules of that array
    ),
    _ref(
        "ref-files-path-unsafe",
        ("REF-5",),
        "The base's data file is listed (and referenced) as 'weights/../weights/r00000-00000.safetensors', which "
        "resolves to the real file.",
        edit(
            lambda d: [r.__setitem__("path", "weights/../" + DATA) for r in [*base_record(d)["files"], *referenced(d)]]
        ),
        also=("PTH-2",),
    ),
    _ref(
        "ref-files-no-digest",
        ("REF-5",),
        "The base record's file record has no 'digest'.",
        edit(lambda d: base_record(d)["files"][0].pop("digest")),
        also=("MAN-15",),
    ),
    # ---- REF-6: referenced chunks
    _ref(
        "ref-chunk-base-unlisted",
        ("REF-6",),
        "Chunk s@0 has base '../step-2', which no base record has (step-2 does not exist either).",
        edit(lambda d: ref_chunk(d).__setitem__("base", "../" + STEP2)),
    ),
    _ref(
        "ref-chunk-path-only-in-own-files",
        ("REF-6",),
        "The base record lists only the base's provenance blob (its true record); the referenced chunks' path "
        "weights/r00000-00000.safetensors is in the checkpoint's own files, not in the base record's.",
        chain(add_base_file(PROV), edit(lambda d: base_record(d)["files"].pop(1))),
    ),
    _ref(
        "ref-chunk-range-past-base-file",
        ("REF-6", "TEN-20"),
        "Referenced chunk s@0 (8 bytes) ends 8 bytes after the end of the base's file (TEN-20 with the base "
        "record's size).",
        edit(
            lambda d: ref_chunk(d).__setitem__(
                "range", [base_record(d)["files"][0]["size"], base_record(d)["files"][0]["size"] + 8]
            )
        ),
        also=("SAF-13",),
    ),
    _ref(
        "ref-chunk-key-reused",
        ("REF-6", "TEN-22"),
        "Tensor s2 has the same referenced chunks (base, path and key) as s.",
        edit(lambda d: d["fields"]["weights"]["tensors"].__setitem__("s2", d["fields"]["weights"]["tensors"]["s"])),
    ),
    # ---- REF-7: the base's identity
    _ref(
        "ref-base-missing",
        ("REF-7",),
        "There is no step-1 beside the checkpoint.",
        lambda t: shutil.rmtree(base_tree(t).root),
        scope="tensor",
    ),
    _ref(
        "ref-base-replaced",
        ("REF-7",),
        "step-1 was written again with another provenance: its data file is byte for byte the one referenced "
        "(same size and digest), its manifest and so its checkpoint id are not.",
        replaced_base,
        scope="tensor",
    ),
    _ref(
        "ref-base-manifest-edited",
        ("REF-7",),
        "step-1's manifest was edited after the reference was made (metadata added): another checkpoint id, the "
        "same files.",
        base_only(lambda b: b.edit(lambda d: d.__setitem__("metadata", {"edited": "after the reference"}))),
        scope="tensor",
    ),
    _ref(
        "ref-base-symlink",
        ("REF-16",),
        "step-1 beside the checkpoint is a symbolic link to elsewhere/step-1, the intact base (its id and files "
        "match): a reader that follows it opens a directory outside the run directory.",
        lambda t: _symlinked_base(t),
        also=("REF-7",),
        scope="tensor",
    ),
    _ref(
        "ref-base-manifest-refused",
        ("REF-17",),
        "step-1's manifest says format_version 2.0 (VER-3) and the base record was made from it: its checkpoint id "
        "and file records match, and a reader must still refuse the base's manifest.",
        in_base(lambda b: b.edit(lambda d: d.__setitem__("format_version", "2.0"))),
        also=("REF-7", "VER-3"),
        scope="tensor",
    ),
    # ---- REF-8: the base stores what is referenced
    _ref(
        "ref-base-file-size-differs",
        ("REF-8",),
        "The base record gives the base's data file 8 bytes more than the base's own record (and the file) has.",
        edit(lambda d: base_record(d)["files"][0].__setitem__("size", base_record(d)["files"][0]["size"] + 8)),
        also=("REF-9", "MAN-19"),  # the file's size is not the base record's either
        scope="tensor",
    ),
    _ref(
        "ref-base-file-digest-differs",
        ("REF-8",),
        "step-1's own manifest gives its data file another digest; the base record has the true one (and step-1's "
        "id): every byte read matches this manifest, but the base does not store that file as recorded.",
        chain(
            base_only(set_file(DATA, "digest", "xxh3-128:" + "0" * 32)),
            lambda t: t.edit(lambda d: base_record(d).__setitem__("checkpoint_id", manifest_id(base_tree(t)))),
        ),
        scope="tensor",
    ),
    Invalid(
        "ref-chain-through-reference",
        ("REF-8",),
        "Chunk a, stored in step-1, is referenced at step-2, which only references it (as a chain would): step-2's "
        "base record lists step-1's file frozen/r00000-00000.safetensors, which step-2 does not store.",
        chain_through_step2,
        base="ref-chain",
        also=("REF-9", "MAN-28"),  # the file is not in step-2 either
        scope="tensor",
    ),
    # ---- REF-9: the base's files, checked as the checkpoint's own
    _ref(
        "ref-base-file-truncated",
        ("REF-9",),
        "step-1's data file lost its last byte (step-1's manifest unchanged).",
        base_only(lambda b: b.write(DATA, b.read(DATA)[:-1], refresh=False)),
        also=("MAN-19",),
        scope="file",
    ),
    _ref(
        "ref-base-chunk-flipped",
        ("REF-9",),
        "A byte of referenced chunk s@0 is flipped in step-1, whose manifest gives the file's new digest (not the "
        "chunk's); the base record follows step-1 (its new id and file record): only the chunk digest of this "
        "checkpoint's record disagrees.",
        in_base(flip_referenced_byte),
        also=("DIG-4",),
        scope="tensor",
    ),
    _ref(
        "ref-base-header-mismatch",
        ("REF-9",),
        "step-1's data file has its entry s@0 renamed s@9 (its own manifest follows its file; the base record "
        "follows step-1): the header has no entry for referenced chunk s@0.",
        in_base(rename_entry("s@0", "s@9")),
        also=("SAF-13",),
        scope="file",
    ),
    _ref(
        "ref-base-file-symlink",
        ("REF-9",),
        "step-1's data file is a symbolic link to a copy of it (step-1/real/data.safetensors).",
        base_only(symlink_file),
        also=("PTH-3",),
        scope="file",
    ),
    # ---- REF-10: verification covers the bases
    _ref(
        "ref-verify-base-incomplete",
        ("REF-10",),
        "step-1's manifest is gone (its data files are there): a verifying reader reports the base, naming both.",
        base_only(lambda b: (b.root / "manifest.json").unlink()),
        also=("REF-7",),
        scope="tensor",
    ),
    _ref(
        "ref-verify-unused-base-file-damaged",
        ("REF-10",),
        "The base record also lists step-1's provenance blob (its true record), where no referenced chunk lives; "
        "a byte of that blob is flipped in step-1: verification checks every file of every base record.",
        chain(
            add_base_file(PROV),
            base_only(lambda b: b.write(PROV, bytes([b.read(PROV)[0] ^ 0x01]) + b.read(PROV)[1:], refresh=False)),
        ),
        also=("DIG-4",),
        scope="file",
    ),
    _ref(
        "ref-base-self",
        ("REF-7",),
        "The base's location is '../checkpoint': the checkpoint's own root.",
        relocate("../checkpoint"),
        scope="tensor",
    ),
)


# ---------------------------------------------------------------- the valid vectors' inputs


def ref_blocks_input() -> dict[str, Any]:
    """The blocks vector with steps changed, beside the blocks vector: w, s, x and e referenced, with their blocks."""
    from .invalid_blocks import blocks_input

    return referencing(changed(blocks_input(), "steps", tensor("I64", [4], seed=40)), STEP1)


def _rows_changed(entry: dict[str, Any], rows: tuple[int, ...], row_bytes: int) -> dict[str, Any]:
    """``entry`` with the first byte of each of ``rows`` flipped (its digest follows)."""
    data = bytearray(bytes.fromhex(entry["data"]))
    for row in rows:
        data[row * row_bytes] ^= 0x01
    return {**entry, "data": data.hex(), "digest": "sha256:" + hashlib.sha256(data).hexdigest()}


SHARDS = [{"rank": 0, "offsets": [2 * i, 0], "shape": [2, 4]} for i in range(4)]


def shards_doc(rows: tuple[int, ...] = ()) -> dict[str, Any]:
    """Tensor s F32 [8, 4] in four chunks of two rows; ``rows`` changed."""
    s = _rows_changed(tensor("F32", [8, 4], seed=11, chunks=SHARDS), rows, 16)
    return document("weights", {"weights": {"kind": "tensors", "tensors": {"s": s}}, "provenance": provenance()})


def ref_shards_input() -> dict[str, Any]:
    """Chunks 0 and 2 of s changed (stored), 1 and 3 not (referenced): one tensor of own and referenced chunks."""
    return referencing(shards_doc((0, 4)), STEP1)


ZSTD_FLOATS = ("d", "f", "h", "s", "tiny", "w")


def ref_zstd_input() -> dict[str, Any]:
    """The zstd vector's tensors with steps changed, beside the zstd vector, its floating tensors declared frozen."""
    from .invalid_codecs import zstd_input

    return referencing(changed(zstd_input(), "steps", tensor("I64", [4], seed=40)), STEP1, frozen=ZSTD_FLOATS)


def flattened(t: Tree) -> None:
    """The chain vector as the writer must write it: a at step-1 (where step-2 references it), b at step-2."""
    doc = t.manifest()
    fields = doc["fields"].values()
    where = {c["key"]: c.get("base") for f in fields for r in f.get("tensors", {}).values() for c in r["chunks"]}
    assert where == {"a": "../" + STEP1, "b": "../" + STEP2, "c": None}, where


def same_key(t: Tree) -> None:
    """Own chunk w takes the key s@0 of referenced chunk s@0, whose base path is the own data file's path."""
    t.rewrite_data_file(DATA, header=lambda h: h.__setitem__("s@0", h.pop("w")))
    t.edit(lambda d: d["fields"]["weights"]["tensors"]["w"]["chunks"][0].__setitem__("key", "s@0"))
    doc = t.manifest()
    assert ref_chunk(doc)["path"] == DATA and ref_chunk(doc)["key"] == "s@0"


def base_members(t: Tree) -> None:
    """Every chunk gets 'base': '../step-1', without the extension: an unknown member (VER-5)."""

    def fn(doc: Json) -> None:
        for field in doc["fields"].values():
            for record in field.get("tensors", {}).values():
                for c in record["chunks"]:
                    c["base"] = "../" + STEP1

    t.edit(fn)


def other_weights() -> dict[str, Any]:
    return changed(weights_base(), "w", tensor("F32", [2, 3], seed=9))
