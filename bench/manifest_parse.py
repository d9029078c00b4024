"""Parse time of a large manifest: 1,000 tensors sharded over 100 ranks, 100,000 chunks.

    python bench/manifest_parse.py [--tensors 1000] [--ranks 100] [--repeat 3] [--layout rows|columns]

``--layout columns`` is the adversarial case for the chunk-overlap check: one tensor of
``tensors x ranks`` chunks that all span the same rows and tile along dim 1.

Reports the time of ckptfmt.parse_manifest (JSON decoding, duplicate-member check, full validation
incl. chunk coverage) beside plain json.loads of the same bytes, the floor any Python reader pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ckptfmt.canonical import manifest_bytes
from ckptfmt.manifest_parse import parse_manifest


def build(tensors: int, ranks: int, layout: str = "rows") -> bytes:
    if layout == "columns":
        return build_columns(tensors * ranks)
    rows = 64
    files = {f"weights/r{r:05d}-00000.safetensors": 1 << 40 for r in range(ranks)}
    fields: dict[str, object] = {}
    table = {}
    for t in range(tensors):
        chunks = [
            {
                "path": f"weights/r{r:05d}-00000.safetensors",
                "key": f"layers.{t}.w@{r * rows},0",
                "offsets": [r * rows, 0],
                "shape": [rows, 1024],
                "range": [4096 + t * rows * 2048, 4096 + (t + 1) * rows * 2048],
                "digest": "xxh3-128:" + f"{t * ranks + r:032x}",
                "codec": {"name": "raw"},
            }
            for r in range(ranks)
        ]
        table[f"layers.{t}.w"] = {"dtype": "F16", "shape": [rows * ranks, 1024], "chunks": chunks}
    fields["weights"] = {"kind": "tensors", "tensors": table}
    fields["provenance"] = {"kind": "context", "context": {"path": "provenance/context.msgpack"}}
    records = [{"path": p, "size": s, "digest": "xxh3-128:" + "0" * 32} for p, s in files.items()]
    records.append({"path": "provenance/context.msgpack", "size": 64, "digest": "xxh3-128:" + "0" * 32})
    records.sort(key=lambda r: str(r["path"]))
    doc = {"format": "ckptfmt", "format_version": "1.0", "profile": "weights", "files": records, "fields": fields}
    return manifest_bytes(doc)


def build_columns(count: int) -> bytes:
    path = "weights/r00000-00000.safetensors"
    chunks = [
        {
            "path": path,
            "key": f"w@0,{c}",
            "offsets": [0, c],
            "shape": [64, 1],
            "range": [4096 + c * 128, 4096 + (c + 1) * 128],
            "digest": "xxh3-128:" + f"{c:032x}",
            "codec": {"name": "raw"},
        }
        for c in range(count)
    ]
    fields = {
        "weights": {"kind": "tensors", "tensors": {"w": {"dtype": "F16", "shape": [64, count], "chunks": chunks}}},
        "provenance": {"kind": "context", "context": {"path": "provenance/context.msgpack"}},
    }
    records = [
        {"path": path, "size": 1 << 40, "digest": "xxh3-128:" + "0" * 32},
        {"path": "provenance/context.msgpack", "size": 64, "digest": "xxh3-128:" + "0" * 32},
    ]
    records.sort(key=lambda r: str(r["path"]))
    doc = {"format": "ckptfmt", "format_version": "1.0", "profile": "weights", "files": records, "fields": fields}
    return manifest_bytes(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layout", choices=("rows", "columns"), default="rows")
    args = parser.parse_args()
    data = build(args.tensors, args.ranks, args.layout)
    parse, plain = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        manifest = parse_manifest(data)
        parse.append(time.perf_counter() - start)
        start = time.perf_counter()
        json.loads(data)
        plain.append(time.perf_counter() - start)
    chunks = sum(len(t.chunks) for t in manifest.fields["weights"].tensors.values())
    print(
        f"{chunks} chunks, {len(data) / 1e6:.1f} MB of JSON: parse_manifest {statistics.median(parse):.2f} s, "
        f"json.loads alone {statistics.median(plain):.2f} s (median of {args.repeat})"
    )


if __name__ == "__main__":
    main()
