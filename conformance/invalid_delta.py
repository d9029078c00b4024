"""Vectors about delta chunks (spec/delta.md): the run they are written in, and the invalid vectors.

The ``delta`` run has three checkpoints, each written by the reference writer: ``step-1`` with ``zstd`` (the
keyframe), ``step-2`` with ``xor-zstd`` against step-1, and the vector's checkpoint with ``xor-zstd`` against step-2:
w and h change from step to step, k never does, and every chunk of the checkpoint is a delta of depth 2 whose chain
ends at step-1's zstd chunks (k's XOR is all zeros: its base chunk is encoded, so the writer, which has no raw digest
of it, cannot tell it unchanged without decoding it, REF-12). Each invalid vector edits the checkpoint's manifest
only, so it breaks the one rule it is about.
"""

from __future__ import annotations

import copy
from typing import Any

from .edits import chain
from .inputs import document, provenance, tensor
from .invalid import Invalid
from .invalid_references import STEP1, STEP2, Base, base_record, base_records, edit, referencing
from .mutations import Json, Tree

W = ("fields", "weights", "tensors", "w", "chunks", 0)


def _doc(seeds: tuple[int, int, int], **hints: Any) -> dict[str, Any]:
    """Floating tensors large enough to be encoded (4 KiB and more): w (F32), h (BF16); k (F32) never changes."""
    tensors = {
        "w": tensor("F32", [32, 40], seed=seeds[0]),
        "h": tensor("BF16", [48, 48], seed=seeds[1]),
        "k": tensor("F32", [32, 32], seed=seeds[2]),
    }
    doc = document("weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()})
    if hints:
        doc["hints"] = hints
    return doc


def delta_input() -> dict[str, Any]:
    """w and h changed since step-2: delta chunks against step-2's, which are deltas against step-1's."""
    return referencing(_doc((61, 62, 53), codec="xor-zstd"), STEP2)


DELTA_BASES = (
    Base(STEP1, lambda: _doc((41, 42, 53), codec="zstd")),
    Base(STEP2, lambda: referencing(_doc((51, 52, 53), codec="xor-zstd"), STEP1)),
)


def _at(doc: Json, path: tuple[str | int, ...]) -> Json:
    node: Any = doc
    for key in path:
        node = node[key]
    assert isinstance(node, dict)
    return node


def w_config(doc: Json) -> Json:
    codec = _at(doc, W)["codec"]
    assert codec["name"] == "xor-zstd", codec  # a guard against a changed writer: the vectors edit a delta
    config: Json = codec["configuration"]
    return config


def _check_run(t: Tree) -> None:
    """The delta run must have what the vectors edit: w a delta of depth 2 against step-2, then step-1."""
    doc = t.manifest()
    assert [b["location"] for b in base_records(doc)] == ["../" + STEP1, "../" + STEP2]
    config = w_config(doc)
    assert config["base"] == "../" + STEP2 and config["chunk"]["codec"]["name"] == "xor-zstd"
    assert config["chunk"]["codec"]["configuration"]["chunk"]["codec"]["name"] == "zstd"


def _vector(name: str, requirements: tuple[str, ...], note: str, fn: Any, **kw: Any) -> Invalid:
    return Invalid(name, requirements, note, chain(_check_run, edit(fn)), base="delta", scope="tensor", **kw)


def _replaced(doc: Json) -> None:
    record = base_record(doc, "../" + STEP2)
    record["checkpoint_id"] = "sha256:" + "5" * 64


def _digest(doc: Json) -> None:
    chunk = w_config(doc)["chunk"]
    algorithm, _, hexpart = chunk["digest"].partition(":")
    chunk["digest"] = f"{algorithm}:{hexpart[:-1]}{'0' if hexpart[-1] != '0' else '1'}"


def _no_chunk(doc: Json) -> None:
    del w_config(doc)["chunk"]


def _too_deep(doc: Json) -> None:
    """w's chain made 9 deep: its own configuration (depth 2) wrapped 7 times, every level as consistent as the
    first (the same base record, file, range and digest), so only the depth is wrong."""
    config = w_config(doc)
    original = copy.deepcopy(config)
    inner = copy.deepcopy(config)
    for _ in range(7):
        wrapped = copy.deepcopy(original)
        wrapped["chunk"]["codec"] = {"name": "xor-zstd", "configuration": inner}
        inner = wrapped
    config.clear()
    config.update(inner)


def _unrecorded(doc: Json) -> None:
    w_config(doc)["base"] = "../step-9"


VECTORS: tuple[Invalid, ...] = (
    _vector(
        "delta-base-replaced",
        ("DLT-5",),
        "The base record of step-2, which only delta chunks use, has another checkpoint_id: the base there is not the "
        "checkpoint the deltas were taken against, and is not XORed (REF-7, as for a referenced chunk).",
        _replaced,
        also=("REF-7",),
    ),
    _vector(
        "delta-base-chunk-digest",
        ("DLT-4",),
        "w's configuration records another digest for its base chunk (step-2's w) than its stored bytes hash to; "
        "step-2 itself is intact.",
        _digest,
    ),
    _vector(
        "delta-configuration-malformed",
        ("DLT-1",),
        "w's xor-zstd configuration has no 'chunk': no base chunk to XOR with.",
        _no_chunk,
    ),
    _vector(
        "delta-chain-too-deep",
        ("DLT-3",),
        "w's chain is 9 deltas deep (its configuration nested in itself 7 times), one more than a reader may follow.",
        _too_deep,
    ),
    _vector(
        "delta-base-not-recorded",
        ("DLT-2",),
        "w's configuration names the base '../step-9', which no base record of the manifest has.",
        _unrecorded,
    ),
)
