"""``python -m conformance generate``: write every vector from the declarative tables, deterministically.

Valid vectors come from conformance/valid.py, invalid ones from conformance/invalid_*.py, writer
scenarios from conformance/scenarios.py. Everything written is canonical JSON or the reference
writer's (deterministic) output, so generating twice gives byte-identical trees.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ckptfmt.canonical import canonical_json
from ckptfmt.description import canonical_description

from .inputs import training_base, weights_base
from .invalid import Invalid
from .invalid_blocks import VECTORS as BLOCK_VECTORS
from .invalid_blocks import blocks_input
from .invalid_codecs import VECTORS as CODEC_VECTORS
from .invalid_codecs import zstd_input
from .invalid_context import VECTORS as CONTEXT_VECTORS
from .invalid_delta import DELTA_BASES, delta_input
from .invalid_delta import VECTORS as DELTA_VECTORS
from .invalid_manifest import VECTORS as MANIFEST_VECTORS
from .invalid_ranks import VECTORS as RANK_VECTORS
from .invalid_ranks import ranks_input
from .invalid_references import RUNS, Base, chain_input, ref_weights_input
from .invalid_references import VECTORS as REFERENCE_VECTORS
from .invalid_tensors import VECTORS as TENSOR_VECTORS
from .invalid_tree import VECTORS as TREE_VECTORS
from .invalid_tree import tree_input, weights_tree
from .mutations import Tree
from .reference_writer import write
from .scenarios import SCENARIOS
from .valid import VALID
from .values import expected_description, load

INVALID = (
    *MANIFEST_VECTORS,
    *TENSOR_VECTORS,
    *CONTEXT_VECTORS,
    *CODEC_VECTORS,
    *RANK_VECTORS,
    *BLOCK_VECTORS,
    *REFERENCE_VECTORS,
    *DELTA_VECTORS,
    *TREE_VECTORS,
)
BASES = {
    "weights": weights_base,
    "training-minimal": training_base,
    "zstd": zstd_input,
    "ranks": ranks_input,
    "blocks": blocks_input,
    "ref-weights": ref_weights_input,
    "ref-chain": chain_input,
    "delta": delta_input,
    "tree": tree_input,
    "weights-tree": weights_tree,
}
RUNS_OF = {**RUNS, "delta": DELTA_BASES}  # the checkpoints each base's run writes first


def _normalized(doc: dict[str, Any]) -> dict[str, Any]:
    """The input as a writer reads it back from its canonical JSON file."""
    return load(canonical_json(doc))


def _json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canonical_json(value))


def _write_bases(bases: tuple[Base, ...], target: Path) -> None:
    """The checkpoints a vector's checkpoint references, written beside it (``<vector>/<name>``), in order."""
    for base in bases:
        write(_normalized(base.input()), target / base.name)
        if base.post is not None:
            base.post(Tree(target / base.name))


def generate(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    for spec in VALID:
        target = out / "valid" / spec.name
        doc = _normalized(spec.input())
        _write_bases(spec.bases, target)
        write(doc, target / "checkpoint")
        if spec.post is not None:
            spec.post(Tree(target / "checkpoint"))
        got = canonical_description(target / "checkpoint")
        want = expected_description(doc)
        if spec.expect is not None:
            spec.expect(want)
        if canonical_json(got) != canonical_json(want):
            raise AssertionError(f"valid vector {spec.name}: the reference reader returns other content")
        _json(target / "expected.json", got)
        _json(
            target / "about.json", {"note": spec.note, "outcome": "accepted", "requirements": list(spec.requirements)}
        )
        if spec.writer:
            _json(target / "writer-input.json", doc)
    for inv in INVALID:
        write_invalid(inv, out / "invalid" / inv.name)
    for sc in SCENARIOS:
        target = out / "writer" / sc.name
        if sc.setup is not None:
            sc.setup(target / "setup")
        _json(target / "writer-input.json", _normalized(sc.input()))
        _json(
            target / "expected.json",
            {"after": sc.after, "note": sc.note, "outcome": "refused", "requirements": list(sc.requirements)},
        )


def write_invalid(inv: Invalid, target: Path) -> None:
    """An invalid vector: its base checkpoint (beside the bases it references), mutated, and its expected.json."""
    _write_bases(RUNS_OF.get(inv.base, ()), target)
    write(_normalized(BASES[inv.base]()), target / "checkpoint")
    inv.mutate(Tree(target / "checkpoint"))
    expected: dict[str, Any] = {
        "base": inv.base,
        "note": inv.note,
        "outcome": "rejected",
        "requirements": list(inv.requirements),
        "scope": inv.scope,
    }
    if inv.also:
        expected["also"] = list(inv.also)
    _json(target / "expected.json", expected)
