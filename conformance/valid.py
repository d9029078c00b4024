"""The valid vectors: writer inputs and the post-processing that turns a written checkpoint into each vector.

A valid vector is the reference writer's output for its input, optionally transformed by ``post``
in a way that keeps it valid (renamed files, extra keys, a re-serialized manifest...). Vectors
with ``writer=True`` also ship their writer input, for ``run --writer``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.digests import digest_of

from . import edits
from .edits import DATA, NOTES, packb
from .inputs import (
    config_blob,
    document,
    f,
    integer,
    ndarray,
    provenance,
    rng_states,
    tensor,
    training_base,
    weights_base,
)
from .invalid_blocks import block_digests, blocks_input, chunk_of
from .invalid_codecs import to_zstd, zstd_input
from .invalid_delta import DELTA_BASES, delta_input
from .invalid_ranks import ranks_input
from .invalid_references import (
    CHAIN_BASES,
    REF_WEIGHTS_BASES,
    STEP1,
    Base,
    base_members,
    chain_input,
    flattened,
    other_weights,
    ref_blocks_input,
    ref_shards_input,
    ref_weights_input,
    ref_zstd_input,
    same_key,
    shards_doc,
)
from .invalid_tree import tree_input
from .mutations import Json, Tree


def block_edge_cases(t: Tree, doc: Json) -> None:
    for name, size in (("steps", 4096), ("x", 1 << 30), ("e", 4096)):
        chunk = chunk_of(doc, name)
        chunk["blocks"] = {"size": size, "digests": block_digests(t, chunk, size)}
    assert chunk_of(doc, "e")["blocks"]["digests"] == ""
    chunk_of(doc, "w")["blocks"]["x-note"] = "readers ignore unknown members (VER-5)"


@dataclass(frozen=True)
class Valid:
    name: str
    requirements: tuple[str, ...]
    note: str
    input: Callable[[], dict[str, Any]]
    post: Callable[[Tree], None] | None = None
    writer: bool = True
    expect: Callable[[dict[str, Any]], None] | None = None  # how ``post`` changes the description
    bases: tuple[Base, ...] = ()  # checkpoints written beside it first, in order (spec/references.md)


def _rows(n_rows: int, sizes: list[int], width: int) -> list[dict[str, Any]]:
    out, start = [], 0
    for rank, size in enumerate(sizes):
        out.append({"rank": rank, "offsets": [start, 0], "shape": [size, width]})
        start += size
    assert start == n_rows
    return out


def dtypes_all() -> dict[str, Any]:
    from ckptfmt.dtypes import DTYPES

    tensors = {f"t_{name.lower()}": tensor(name, [2, 3], seed=i) for i, name in enumerate(DTYPES)}
    tensors |= {
        "scalar_f64": tensor("F64", [], seed=50),
        "scalar_bool": tensor("BOOL", [], seed=51),
        "empty_i32": tensor("I32", [0], seed=52),
        "empty_bf16": tensor("BF16", [3, 0, 2], seed=53),
        "vector_c64": tensor("C64", [5], seed=54),
    }
    return document("weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()})


def training_full() -> dict[str, Any]:
    return document(
        "training",
        {
            "weights": {
                "kind": "tensors",
                "tensors": {"embed": tensor("BF16", [4, 3]), "layer0.w": tensor("F32", [3, 3], seed=1)},
            },
            "optimizer": {
                "kind": "tensors",
                "tensors": {"layer0.w.exp_avg": tensor("F32", [3, 3], seed=2), "step": tensor("I64", [], seed=3)},
                "context": {"param_groups": [{"betas": [f(0.9), f(0.95)], "lr": f(0.0003), "weight_decay": f(0.1)}]},
            },
            "rng": {"kind": "context", "context": rng_states()},
            "data": {
                "kind": "context",
                "context": {
                    "dataset": {"name": "toy", "version": "1"},
                    "epoch": 1,
                    "global_sample_offset": 12345,
                    "quarantined_shards": ["shard-9"],
                    "sampler": {"seed": 0},
                    "shard_offsets": {"shard-0": 10},
                },
            },
            "config": {
                "kind": "context",
                "context": config_blob(
                    {
                        "model": {"d_model": 2, "n_layers": 1, "vocab": 4},
                        "optim": {"lr": f(0.0003), "name": "adamw"},
                        "seed": 0,
                    }
                ),
            },
            "topology": {
                "kind": "context",
                "context": {"mesh": {"dims": ["dp", "tp"], "shape": [2, 2]}, "rank": 0, "world_size": 4},
            },
            "provenance": provenance(
                code={"commit": "0" * 40, "dirty": False, "repository": "https://example.org/run"},
                step=100,
                versions={"numpy": "2"},
            ),
        },
    )


def training_quarantine() -> dict[str, Any]:
    """A data field with a quarantine record (spec/fields.md): samples with NaN and infinite values and the position
    they are left out from, a shard entry, an entry still waiting for the next pass (no ``from``)."""
    doc = training_base()
    doc["fields"]["data"]["context"] = {
        "epoch": 0,
        "global_sample_offset": 40,
        "quarantined_shards": ["3"],
        "quarantine": [
            {
                "from": {"epoch": 0, "position": 96},
                "reason": "nonfinite",
                "samples": [5, 17, 90],
                "step": 12,
                "values": {"grad_norm": f(float("inf")), "loss": f(float("nan"))},
            },
            {"reason": "spike", "samples": [], "shard": "3", "step": 30, "values": {"loss": f(9.5), "mean": f(2.25)}},
            {"reason": "manual", "samples": [0], "step": 31, "values": {}},
        ],
    }
    return doc


def multi_file() -> dict[str, Any]:
    tensors = {f"layer{i}.w": tensor("F32", [4, 4], seed=i) for i in range(5)}
    return document(
        "weights",
        {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()},
        target_file_size=64,
    )


def sharded_even() -> dict[str, Any]:
    cols = [{"rank": r, "offsets": [0, 2 * r], "shape": [4, 2]} for r in range(4)]
    return document(
        "weights",
        {
            "weights": {
                "kind": "tensors",
                "tensors": {
                    "rows": tensor("F32", [8, 4], chunks=_rows(8, [2, 2, 2, 2], 4)),
                    "cols": tensor("I32", [4, 8], seed=1, chunks=cols),
                },
            },
            "provenance": provenance(),
        },
    )


def sharded_uneven() -> dict[str, Any]:
    grid = [
        {"rank": 0, "offsets": [0, 0], "shape": [3, 4]},
        {"rank": 1, "offsets": [0, 4], "shape": [3, 3]},
        {"rank": 2, "offsets": [3, 0], "shape": [2, 4]},
        {"rank": 3, "offsets": [3, 4], "shape": [2, 3]},
    ]
    partial = [{"rank": 0, "offsets": [0], "shape": [5]}, {"rank": 2, "offsets": [5], "shape": [2]}]
    return document(
        "weights",
        {
            "weights": {
                "kind": "tensors",
                "tensors": {
                    "rows": tensor("F32", [10, 3], chunks=_rows(10, [4, 3, 3], 3)),
                    "grid": tensor("F16", [5, 7], seed=1, chunks=grid),
                    "two_ranks": tensor("U8", [7], seed=2, chunks=partial),
                    "replica": tensor("BF16", [2, 2], seed=3),
                },
            },
            "provenance": provenance(),
        },
    )


def extra_fields() -> dict[str, Any]:
    return document(
        "weights",
        {
            "weights": {"kind": "tensors", "tensors": {"w": tensor("F32", [2, 2])}, "context": {"note": "tied"}},
            "ema": {"kind": "tensors", "tensors": {"w": tensor("F32", [2, 2], seed=1)}},
            "empty": {"kind": "tensors", "tensors": {}},
            "tokenizer": {"kind": "tensors", "tensors": {}, "context": {"vocab": ["a", "b"]}},
            "scheduler": {"kind": "context", "context": {"last_lr": f(0.5), "step": 10}},
            "provenance": provenance(),
        },
        metadata={"run": "conformance", "ünï": "ç✓"},
    )


def memory_snapshot() -> dict[str, Any]:
    """A training checkpoint as the memory tier writes it into a slot: its binding in the metadata (MEM-3)."""
    doc = training_base()
    doc["metadata"] = {
        "ckptfmt.memory.run_id": "3f2c9e1a-elastic-run",
        "ckptfmt.memory.run_dir": "/data/runs/gpt",
        "ckptfmt.memory.node": "node-07/7d1c2f4e-5a9b-4c1e-9f3a-2b6d8e0c1a47",
        "ckptfmt.memory.world_size": "8",
        "ckptfmt.memory.step": "1200",
    }
    return doc


def memory_snapshot_nodes() -> dict[str, Any]:
    """The manifest of a memory snapshot of a job on two nodes (MEM-9): the same bytes are in every node's slot,
    each slot holding its own ranks' files; this vector holds them all, as a union of the slots does."""
    doc = memory_snapshot()
    doc["metadata"] = {
        **doc["metadata"],
        "ckptfmt.memory.world_size": "4",
        "ckptfmt.memory.nodes": '["node-07/7d1c","node-07/7d1c","node-12/0b9e","node-12/0b9e"]',
    }
    return doc


def _deep(levels: int) -> object:
    value: object = 0
    for _ in range(levels):
        value = [value]
    return value


def context_values() -> dict[str, Any]:
    state = {
        "nil": None,
        "bools": [True, False],
        "ints": [0, -1, 127, -32, 255, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1],
        "bigints": [integer(v) for v in (1 << 64, -(1 << 63) - 1, (1 << 127) + 1, -(1 << 127))],
        "floats": [f(v) for v in (0.1, -0.0, 1.0, 1e21, 5e-324, float("nan"), float("inf"), float("-inf"))],
        "strs": ["", "é\u2028", "\U0001f600", "tab\there"],
        "bins": [{"$bin": ""}, {"$bin": "00ff10"}],
        "arrays": {
            "mask": ndarray(np.array([1, 2, 0xDEADBEEF], dtype=np.uint32)),
            "scalar": ndarray(np.array(2.5, dtype=np.float64)),
            "bool": ndarray(np.array([True, False, True])),
            "empty": ndarray(np.zeros((0, 2), dtype=np.int8)),
        },
        "maps": {"": {}, "nested": {"a": {"b": []}}, "tagged": {"$map": {"$bin": "not a bin"}}},
        "deep": _deep(62),  # its innermost value has depth 64, the deepest allowed (CTX-7)
    }
    return document(
        "weights",
        {
            "weights": {"kind": "tensors", "tensors": {}},
            "state": {"kind": "context", "context": state},
            "provenance": provenance(),
        },
    )


def config_hash_examples() -> dict[str, Any]:
    floats = [1.0, 2.5, -1.5, -0.0, 0.1, 0.30000000000000004, 0.0003, 1.5e-06, 1e-06, 1e-07, 1.23e-18, 5e-324]
    floats += [1e20, 1e21, 1.7976931348623157e308, 9.223372036854776e18]
    config = {
        "floats": [f(v) for v in floats],
        "ints": [9223372036854775808, 18446744073709551615, -9223372036854775808, 9007199254740993],
        "strings": ["tab\there", 'q"b\\/', "\x01\x1f\x7f", "é\u2028"],
        "order": {"\ue000": 1, "\U0001f600": 2, "b": 1, "a": 2},
        "mixed": [1, f(2.5), None, True],
        "empty": {},
    }
    return document(
        "weights",
        {
            "weights": {"kind": "tensors", "tensors": {}},
            "config": {"kind": "context", "context": config_blob(config)},
            "provenance": provenance(),
        },
    )


def tensor_names() -> dict[str, Any]:
    halves = [{"rank": 0, "offsets": [0], "shape": [2]}, {"rank": 0, "offsets": [2], "shape": [2]}]
    names = {"layer.0/w": 0, "ünïcödé ✓": 1, "t@0": 2, "sp ace": 3, "__metadata": 4, "x" * 1024: 5}
    tensors = {name: tensor("F32", [2], seed=seed) for name, seed in names.items()}
    tensors["t"] = tensor("F32", [4], seed=6, chunks=halves)  # its first chunk's key is "t@0", like the tensor above
    return document("weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()})


def context_encodings() -> dict[str, Any]:
    return document(
        "weights",
        {
            "weights": {"kind": "tensors", "tensors": {}},
            "state": {"kind": "context", "context": {}},
            "provenance": provenance(),
        },
    )


# ---------------------------------------------------------------- post-processing


def unknown_keys(doc: Json) -> None:
    doc["x-top"] = {"a": [1, {"b": True}]}
    doc["extensions"] = [{"name": "org.example.note", "must_understand": False, "configuration": {"a": 1}, "x-ext": 1}]
    for record in doc["files"]:
        record["x-file"] = 1
    doc["fields"]["notes"]["context"]["x-context"] = "c"
    weights = doc["fields"]["weights"]
    weights["x-field"] = True
    for tensor_record in weights["tensors"].values():
        tensor_record["x-tensor"] = "t"
        for chunk in tensor_record["chunks"]:
            chunk["x-chunk"] = {}
            chunk["codec"]["configuration"] = {"ignored": 1}  # raw takes none; readers ignore it
            chunk["codec"]["x-codec"] = 1


def _reverse_keys(value: Json) -> Json:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in sorted(value, reverse=True)}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


def noncanonical(tree: Tree) -> None:
    text = json.dumps(_reverse_keys(tree.manifest()), indent=2, ensure_ascii=True) + "\n"
    tree.set_raw_manifest(text.encode())


def large_manifest(tree: Tree) -> None:
    data = tree.raw_manifest()
    tree.set_raw_manifest(b"{" + b" " * ((1 << 20) + 1 - len(data)) + data[1:])


def custom_paths(tree: Tree) -> None:
    tree.move(DATA, "blobs/W-0.st")
    tree.move("provenance/context.msgpack", "meta/prov")
    tree.move(NOTES, "n")


def stray_files(tree: Tree) -> None:
    lock = {"host": "elsewhere.invalid", "nonce": "0", "pid": 1, "started_at": "2025-01-01T00:00:00Z"}
    for path, data in {
        ".writer-lock": json.dumps(lock, sort_keys=True).encode(),
        "weights/.r00000-00000.safetensors.tmp-0123456789ab": b"partial",
        "weights/r00001-00000.safetensors": b"not listed, not read",
        ".hidden/x": b"x",
        "README.txt": b"unlisted",
    }.items():
        (tree.root / path).parent.mkdir(parents=True, exist_ok=True)
        (tree.root / path).write_bytes(data)


def ref_unknown_members(doc: Json) -> None:
    (record,) = [e for e in doc["extensions"] if e["name"] == "ckptfmt.references"]
    record["configuration"]["org.example.note"] = {"kept": False}
    record["configuration"]["bases"][0]["org.example.note"] = 1


def root_through_symlink(tree: Tree) -> None:
    """Move the checkpoint and its base into ``run/`` and leave the checkpoint's name as a link to it."""
    vector = tree.root.parent
    (vector / "run").mkdir()
    for base in REF_WEIGHTS_BASES:
        (vector / base.name).rename(vector / "run" / base.name)
    tree.root.rename(vector / "run" / "step-2")
    tree.root.symlink_to(Path("run") / "step-2", target_is_directory=True)


def safetensors_extras(tree: Tree) -> None:
    end = tree.data_end(DATA)

    def fn(h: dict[str, Any]) -> None:
        h["__metadata__"] = {"format": "pt"}
        h["w"]["x-note"] = "ignored"
        h["unreferenced"] = {"dtype": "U8", "shape": [3], "data_offsets": [end, end + 3]}

    tree.rewrite_data_file(DATA, header=fn, append=b"\x01\x02\x03", pad=16)


def mixed_digests(tree: Tree) -> None:
    def fn(doc: Json) -> None:
        for record in doc["files"]:
            record["digest"] = digest_of("sha256", tree.read(record["path"]))

    tree.edit(fn)


def encodings(tree: Tree) -> None:
    """Hand-made msgpack: keys out of order (CTX-9), float 32, ints and strs in longer encodings than needed."""
    value = edits.fixmap(
        (packb("z"), b"\xca\x3f\xc0\x00\x00"),  # float 32: 1.5
        (packb("a"), b"\xca\x3d\xcc\xcc\xcd"),  # float 32 nearest 0.1
        (packb("m"), b"\xd3" + (1).to_bytes(8, "big")),  # int 64 holding 1
        (b"\xd9\x01k", b"\xda\x00\x03abc"),  # str 8 key, str 16 value
    )
    tree.write("state/context.msgpack", value)


def encodings_expected(description: dict[str, Any]) -> None:
    value = {"z": f(1.5), "a": f(float(np.float32(0.1))), "m": 1, "k": "abc"}
    description["fields"]["state"]["context"] = value


def created_at(value: str) -> Callable[[], dict[str, Any]]:
    """A small weights checkpoint whose provenance was written at ``value`` (a date-time FLD-12 admits)."""

    def build() -> dict[str, Any]:
        tensors = {"w": tensor("F32", [2], seed=60)}
        return document(
            "weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance(created_at=value)}
        )

    return build


VALID: tuple[Valid, ...] = (
    Valid(
        "weights",
        ("PRO-1", "PRO-4", "TEN-19"),
        "Base of most invalid vectors: weights profile; a whole tensor, one in 2 chunks, an empty one; a context.",
        weights_base,
    ),
    Valid(
        "training-minimal",
        ("PRO-1", "PRO-3"),
        "The smallest training checkpoint: the base of the invalid vectors about standard fields.",
        training_base,
    ),
    Valid(
        "training-full",
        (
            "FLD-2",
            "FLD-3",
            "FLD-4",
            "FLD-5",
            "FLD-6",
            "FLD-7",
            "FLD-8",
            "FLD-10",
            "FLD-11",
            "FLD-12",
            "RNG-1",
            "RNG-2",
            "RNG-3",
            "RNG-4",
            "RNG-5",
            "RNG-6",
        ),
        "Every standard field with optional members; a generator of every kind, and one of an unknown kind.",
        training_full,
    ),
    Valid(
        "dtypes-all",
        ("TEN-1", "TEN-19", "TEN-21", "SAF-6", "SAF-9"),
        "Every dtype of the table, 0-d and empty tensors.",
        dtypes_all,
    ),
    Valid(
        "training-quarantine",
        ("FLD-13",),
        "A data field whose quarantine record has sample entries (values NaN and Infinity: allowed outside config) "
        "and a shard entry, the shard also in quarantined_shards.",
        training_quarantine,
    ),
    Valid("multi-file", ("MAN-16",), "A field spread over several data files.", multi_file),
    Valid(
        "sharded-even",
        ("TEN-15", "TEN-16", "TEN-17", "TEN-18"),
        "Tensors in even chunks written by four ranks (a real multi-rank save), one data file per rank.",
        sharded_even,
    ),
    Valid(
        "sharded-uneven",
        ("TEN-15", "TEN-16", "TEN-17", "TEN-18", "TEN-22"),
        "Uneven row chunks, an uneven 2-D grid, a tensor held by two of four ranks (a real multi-rank save).",
        sharded_uneven,
    ),
    Valid(
        "multi-rank",
        ("TEN-15", "TEN-18", "LAY-3"),
        "A real multi-rank save: uneven row shards from four ranks, each its own data file; the data field's "
        "context written by rank 2 (data/context.r00002.msgpack); a replicated tensor written once, by rank 0.",
        ranks_input,
    ),
    Valid(
        "memory-snapshot",
        ("MEM-1", "MEM-3"),
        "A memory snapshot (spec/memory.md): a training checkpoint whose metadata binds it to its run, node and step; "
        "a reader reads it as any checkpoint.",
        memory_snapshot,
    ),
    Valid(
        "memory-snapshot-nodes",
        ("MEM-1", "MEM-3", "MEM-9"),
        "A memory snapshot of a job on two nodes: its metadata names the node of each saving rank "
        "(ckptfmt.memory.nodes); the same manifest is in each node's slot.",
        memory_snapshot_nodes,
    ),
    Valid(
        "extra-fields",
        ("PRO-4", "MAN-22", "MAN-23"),
        "Fields beyond the profile, of both kinds; empty tensor fields; tensor fields with a context blob; metadata.",
        extra_fields,
    ),
    Valid(
        "context-values",
        ("CTX-7", "CTX-10", "CTX-11", "CTX-12"),
        "All msgpack types of the subset: int bounds, bigints, special floats, bin, ndarrays, depth 64, tag-like map.",
        context_values,
    ),
    Valid(
        "context-encodings",
        ("CTX-9",),
        "A blob with keys out of order, float 32 values and longer-than-needed encodings.",
        context_encodings,
        post=encodings,
        writer=False,
        expect=encodings_expected,
    ),
    Valid(
        "config-hash",
        ("CFG-2", "FLD-7", "FLD-8", "FLD-9"),
        "A config holding every example of spec/config-hash.md: a reader must compute the same hash.",
        config_hash_examples,
    ),
    Valid(
        "tensor-names",
        ("TEN-2", "TEN-7"),
        "Unusual valid tensor names: '/', '@', spaces, non-ASCII, 1024 bytes; a tensor named like another's chunk key.",
        tensor_names,
    ),
    Valid(
        "unknown-keys",
        ("VER-5", "VER-9", "TEN-12"),
        "Unknown members at every depth, a must_understand=false extension, a raw codec with a configuration.",
        weights_base,
        post=lambda t: t.edit(unknown_keys),
        writer=False,
    ),
    Valid(
        "unknown-member-fraction",
        ("VER-5", "MAN-2"),
        "An unknown top-level member holding numbers with a fraction and an exponent part, which only writers "
        "are kept from writing (MAN-1): a reader ignores it.",
        weights_base,
        post=edits.replace_in_manifest('"format":"ckptfmt",', '"format":"ckptfmt","org.example.ratio":[1.5,2e3],'),
        writer=False,
    ),
    Valid(
        "zstd",
        ("COD-1", "COD-2", "COD-3", "COD-4", "COD-5", "SAF-13", "VER-1"),
        "Floating tensors of every width compressed with zstd (sign rotated last, byte planes, frames of 4096 raw "
        "bytes, one tensor in three frames, one in two zstd chunks); integer and tiny tensors raw, in a data file "
        "of their own; format_version 1.1.",
        zstd_input,
        post=to_zstd,
        writer=False,
        expect=lambda d: d.update(format_version="1.1"),
    ),
    Valid(
        "zstd-bytegroup",
        ("COD-4", "COD-5"),
        "The tensors of the zstd vector in byte planes without 'sign_last' (absent): each element's bytes as stored.",
        zstd_input,
        post=lambda t: to_zstd(t, sign_last=False),
        writer=False,
        expect=lambda d: d.update(format_version="1.1"),
    ),
    Valid(
        "blocks",
        ("BLK-1", "BLK-2", "BLK-6", "VER-1"),
        "Block digests of 4096 bytes (hint block_bytes): a chunk of a full and a short block, a tensor in two chunks "
        "of two blocks each; a chunk of exactly one block's size, a small and an empty one without; format_version "
        "1.2.",
        blocks_input,
        expect=lambda d: d.update(format_version="1.2"),
    ),
    Valid(
        "blocks-sha256",
        ("BLK-2", "BLK-6"),
        "The blocks vector with every digest, block digests included, in sha256 (64 digits per block).",
        lambda: blocks_input("sha256"),
        writer=False,
        expect=lambda d: d.update(format_version="1.2"),
    ),
    Valid(
        "blocks-edge-cases",
        ("BLK-1", "BLK-2", "VER-5"),
        "Blocks a reader must accept though the reference writer writes none such: one block longer than its chunk "
        "(32 bytes), blocks of 2^30 bytes (the largest size), none on an empty chunk (digests ''), and an unknown "
        "member inside 'blocks'.",
        blocks_input,
        post=lambda t: t.edit(lambda d: block_edge_cases(t, d)),
        writer=False,
        expect=lambda d: d.update(format_version="1.2"),
    ),
    Valid(
        "tree",
        ("TRE-1", "TRE-3", "DIG-1", "BLK-6", "VER-1"),
        "Tree digests (hint digest xxh3-128-tree, blocks of the default 64 KiB): a chunk of a full and a short "
        "piece with block digests and a chunk tree digest, small and empty chunks with flat digests; the data file's "
        "file tree digest, the provenance blob's flat one; format_version 1.3.",
        tree_input,
        expect=lambda d: d.update(format_version="1.3"),
    ),
    Valid(
        "tree-sha256-small-blocks",
        ("TRE-1", "TRE-3", "BLK-2", "BLK-6"),
        "The tree vector under sha256-tree with block digests of 4096 bytes (not the pieces' size): block digests of "
        "64 sha256 digits beside sha256-tree chunk and file digests.",
        lambda: tree_input("sha256-tree", 4096),
        writer=False,
        expect=lambda d: d.update(format_version="1.3"),
    ),
    Valid(
        "ref-weights",
        ("REF-6", "REF-7", "REF-8", "REF-9", "REF-10"),
        "The weights vector with w changed, written beside step-1 (the weights vector): chunks of s and e are "
        "referenced in step-1, w is stored; both data files are weights/r00000-00000.safetensors. The base of the "
        "invalid REF vectors.",
        ref_weights_input,
        bases=REF_WEIGHTS_BASES,
    ),
    Valid(
        "ref-root-through-symlink",
        ("REF-15",),
        "The ref-weights run moved to run/ (run/step-1, run/step-2), the vector's checkpoint a symbolic link to "
        "run/step-2: the base ../step-1 is the sibling of the directory the root is, run/step-1; beside the link "
        "there is none.",
        ref_weights_input,
        post=root_through_symlink,
        writer=False,
        bases=REF_WEIGHTS_BASES,
    ),
    Valid(
        "ref-unknown-members",
        ("VER-5", "REF-6"),
        "The ref-weights vector with an unknown member beside 'bases' in the configuration and one in its base "
        "record: properties this version does not define, which a reader ignores (errata of 1.2).",
        ref_weights_input,
        post=lambda t: t.edit(ref_unknown_members),
        writer=False,
        bases=REF_WEIGHTS_BASES,
    ),
    Valid(
        "ref-blocks",
        ("REF-6", "REF-9", "BLK-6", "VER-1"),
        "The blocks vector with steps changed, beside step-1 (the blocks vector): its chunks with blocks referenced, "
        "at ranges past the end of the checkpoint's own file of the same name (TEN-20 takes the base's size); "
        "format_version 1.2.",
        ref_blocks_input,
        bases=(Base(STEP1, blocks_input),),
        expect=lambda d: d.update(format_version="1.2"),
    ),
    Valid(
        "ref-mixed-shards",
        ("REF-6", "TEN-17", "TEN-18"),
        "A tensor in four row chunks, two changed since step-1 (stored here) and two not (referenced in step-1).",
        ref_shards_input,
        bases=(Base(STEP1, shards_doc),),
    ),
    Valid(
        "ref-zstd",
        ("REF-6", "REF-9", "VER-1"),
        "The zstd vector's tensors with steps changed, beside step-1 (the zstd vector), its floating tensors declared "
        "frozen (hint 'frozen'): the zstd chunks are referenced with the base's codec; format_version 1.1 (VER-1 "
        "counts referenced chunks).",
        ref_zstd_input,
        bases=(Base(STEP1, zstd_input, post=to_zstd),),
        expect=lambda d: d.update(format_version="1.1"),
    ),
    Valid(
        "delta",
        ("DLT-1", "DLT-2", "DLT-4", "DLT-5"),
        "Three checkpoints: step-1 in zstd, step-2 with xor-zstd against step-1, this one with xor-zstd against "
        "step-2 (hint codec): w (F32) and h (BF16) are delta chunks of depth 2 (XOR with step-2's chunks, themselves "
        "XORs with step-1's zstd chunks), k unchanged (a delta of zeros); format_version 1.3.",
        delta_input,
        bases=DELTA_BASES,
        writer=False,
        expect=lambda d: d.update(format_version="1.3"),
    ),
    Valid(
        "ref-chain",
        ("REF-6", "REF-8"),
        "Three checkpoints: step-2 references step-1; this one changed c only, and references a where it is stored, "
        "in step-1 (through no chain: step-2 only references it), and b in step-2.",
        chain_input,
        post=flattened,
        bases=CHAIN_BASES,
    ),
    Valid(
        "ref-same-key",
        ("REF-6", "TEN-22"),
        "The ref-weights vector with its own chunk w keyed s@0, as referenced chunk s@0: the same path and key, "
        "another base, so not the same chunk (TEN-22 compares base, path and key).",
        ref_weights_input,
        post=same_key,
        writer=False,
        bases=REF_WEIGHTS_BASES,
    ),
    Valid(
        "base-member-without-extension",
        ("VER-5",),
        "The weights vector with 'base': '../step-1' in every chunk but no ckptfmt.references extension: an unknown "
        "member; step-1 beside it holds other bytes for w.",
        weights_base,
        post=base_members,
        writer=False,
        bases=(Base(STEP1, other_weights),),
    ),
    Valid(
        "minor-version",
        ("VER-4",),
        "format_version 1.42.",
        weights_base,
        post=lambda t: t.edit(lambda d: d.update(format_version="1.42")),
        writer=False,
        expect=lambda d: d.update(format_version="1.42"),
    ),
    Valid(
        "noncanonical-manifest",
        ("MAN-2",),
        "An indented manifest with members in reverse order and \\u escapes.",
        weights_base,
        post=noncanonical,
        writer=False,
    ),
    Valid(
        "large-manifest",
        ("MAN-6", "MAN-2"),
        "A manifest of 1 MiB + 1 byte (whitespace): above common parser limits, within the 256 MiB readers accept.",
        weights_base,
        post=large_manifest,
        writer=False,
    ),
    Valid(
        "custom-paths",
        ("LAY-3",),
        "Valid paths off the reference layout.",
        weights_base,
        post=custom_paths,
        writer=False,
    ),
    Valid(
        "stray-files",
        ("LAY-4",),
        "A lock, a temporary file, hidden and unlisted files beside the checkpoint.",
        weights_base,
        post=stray_files,
        writer=False,
    ),
    Valid(
        "safetensors-extras",
        ("SAF-11", "SAF-12", "SAF-13"),
        "A data file with __metadata__, an unknown entry member, an entry no chunk references, extra padding.",
        weights_base,
        post=safetensors_extras,
        writer=False,
    ),
    Valid(
        "mixed-digests",
        ("DIG-2", "DIG-3"),
        "sha256 file digests beside xxh3-128 chunk digests.",
        weights_base,
        post=mixed_digests,
        writer=False,
    ),
    Valid(
        "created-at-leap-day-2000",
        ("FLD-12",),
        "Provenance written at 2000-02-29T23:59:59.123456789Z: a leap day (year divisible by 400), 9 fraction digits.",
        created_at("2000-02-29T23:59:59.123456789Z"),
    ),
    Valid(
        "created-at-year-0000",
        ("FLD-12",),
        "Provenance written at 0000-02-29T00:00:00Z: year 0000 is a leap year (RFC 3339 appendix C).",
        created_at("0000-02-29T00:00:00Z"),
    ),
)
