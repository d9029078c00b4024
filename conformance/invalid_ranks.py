"""Invalid vectors of multi-rank checkpoints: a real multi-rank save (four ranks, each writing its own data
file and one rank a context blob) with one rank's part broken. Base: ``ranks`` (``ranks_input``)."""

from __future__ import annotations

from typing import Any

from .edits import chunk, manifest, set_
from .inputs import document, provenance, tensor
from .invalid import Invalid
from .mutations import Tree

RANK_CONTEXT = "data/context.r00002.msgpack"  # the context blob written by rank 2 (LAY-1)


def ranks_input() -> dict[str, Any]:
    """Rows of ``emb`` [10, 6] written by four ranks in uneven shards; ``data``'s context by rank 2."""
    rows = [(0, 3), (3, 3), (6, 2), (8, 2)]
    return document(
        "weights",
        {
            "weights": {
                "kind": "tensors",
                "tensors": {
                    "emb": tensor(
                        "F32",
                        [10, 6],
                        chunks=[
                            {"rank": r, "offsets": [start, 0], "shape": [size, 6]}
                            for r, (start, size) in enumerate(rows)
                        ],
                    ),
                    "bias": tensor("F32", [6], seed=1),
                },
            },
            "data": {"kind": "context", "rank": 2, "context": {"epoch": 0, "global_sample_offset": 64}},
            "provenance": provenance(),
        },
    )


def drop_rank_blob(t: Tree) -> None:
    (t.root / RANK_CONTEXT).unlink()


EMB = chunk("weights", "emb", 2)

VECTORS = [
    Invalid(
        "ranks-chunk-missing",
        ("TEN-18",),
        "Rank 2's chunk of emb (rows 6 and 7) is missing from the manifest: the other ranks' chunks leave a gap.",
        manifest(lambda d: d["fields"]["weights"]["tensors"]["emb"]["chunks"].pop(2)),
        base="ranks",
    ),
    Invalid(
        "ranks-overlap",
        ("TEN-17",),
        "Rank 2's chunk of emb claims rows 5 and 6, which rank 1's chunk holds too (volumes still add up).",
        set_((*EMB, "offsets"), [5, 0]),
        base="ranks",
        also=("TEN-18",),
    ),
    Invalid(
        "ranks-context-missing",
        ("MAN-28",),
        f"The context blob rank 2 wrote ({RANK_CONTEXT}) is listed but absent.",
        drop_rank_blob,
        also=("MAN-19",),  # a missing file has no size to match, as in file-missing
        base="ranks",
    ),
]
