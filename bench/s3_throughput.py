"""S3 upload and download throughput of ckptfmt beside s3fs's own pipe/cat, and the bytes a one-tensor read moves.

    python bench/s3_throughput.py [--size-mib 256] [--files 8] [--repeat 3] [--json out.json]

Starts moto's S3 server on 127.0.0.1 itself (tests/s3_server.py), so it needs nothing but the test
extras. The same bytes go both ways, and both ratios come from the same run against the same server.

Upload: ckptfmt writes --size-mib of float32 tensors into --files data files (two files at a time; a
file of more than one 16 MiB part is a multipart upload with up to four parts in flight, a smaller one
a single PUT) and commits; s3fs uploads blobs of the same sizes with one ``fs.pipe({path: bytes})``
(all files at once; a single PUT each below 100 MiB).

Download: ckptfmt opens the checkpoint and ``read_tensors`` every tensor (each data file's size and
header checked first; the neighbouring chunks of a file share one ranged GET, cut into 64 MiB pieces,
streamed into the arrays; four files at a time) against ``fs.cat([paths])`` (all files at once),
``fs.cat_file`` one file after another, and ``fs.cat_file(start=, end=)`` of each chunk's byte range,
one after another (moto serves any GET by reading the whole object, so many ranged reads are slower
there than whole files; on S3 they are not). Reported: MB/s, median of --repeat runs, and the ratio
ckptfmt/s3fs (>1 means ckptfmt is faster).

Then, through a byte-counting TCP proxy in front of the server: the bytes received for opening the
checkpoint (manifest) and for reading one 16 KiB tensor from a data file of many MiB, beside the
tensor's size.

moto is a Python server: absolute figures say more about it than about S3; the ratios, measured
in the same run against the same server, and the byte counts, are the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import ckptfmt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from s3_server import CountingProxy, MotoServer  # type: ignore[import-not-found]  # tests/, on sys.path above

MiB = 1 << 20
SMALL = "small.probe"


def make_tensors(total_mib: int, files: int) -> dict[str, np.ndarray[Any, Any]]:
    """Four tensors per file; the first file also holds a 16 KiB tensor, for the single-tensor read."""
    rng = np.random.default_rng(0)
    per = total_mib * MiB // (files * 4)
    tensors = {SMALL: rng.standard_normal(4096, dtype=np.float32)}
    tensors.update({f"layers.{i}.weight": rng.standard_normal(per // 4, dtype=np.float32) for i in range(files * 4)})
    return tensors


def timed(func: Callable[[], object]) -> float:
    start = time.perf_counter()
    func()
    return time.perf_counter() - start


def options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import fsspec

    server = MotoServer()
    server.start()
    try:
        bucket = server.create_bucket()
        opts = options(server.endpoint)
        fs = fsspec.filesystem("s3", **opts)
        tensors = make_tensors(args.size_mib, args.files)
        nbytes = sum(a.nbytes for a in tensors.values())
        file_size = (nbytes - tensors[SMALL].nbytes) // args.files + 64 * 1024

        times: dict[str, list[float]] = {
            "ckptfmt write": [],
            "ckptfmt read": [],
            "s3fs pipe": [],
            "s3fs cat": [],
            "s3fs cat_file": [],
            "s3fs ranges": [],
        }
        for run in range(args.repeat):
            url = f"s3://{bucket}/ckptfmt-{run}"

            def write(url: str = url) -> None:
                with ckptfmt.open_writer(url, profile="weights", storage_options=opts, target_file_size=file_size) as w:
                    w.write_tensors("weights", tensors)
                    w.write_context("provenance", {"step": run})

            times["ckptfmt write"].append(timed(write))

            def read(url: str = url) -> None:
                with ckptfmt.open(url, storage_options=opts) as ckpt:
                    ckpt.read_tensors("weights")

            times["ckptfmt read"].append(timed(read))
            with ckptfmt.open(url, storage_options=opts) as ckpt:
                sizes = [ckpt.store.size(f.path) for f in ckpt.manifest.files]
                ranges = [
                    (f"{ckpt.store.root}/{c.path}", c.begin, c.end)  # type: ignore[attr-defined]
                    for name in tensors
                    for c in ckpt.tensor("weights", name).chunks
                ]
            times["s3fs ranges"].append(timed(lambda: [fs.cat_file(p, start=b, end=e) for p, b, e in ranges]))
            blobs = {f"{bucket}/s3fs-{run}/f{i}": np.random.bytes(size) for i, size in enumerate(sizes)}
            times["s3fs pipe"].append(timed(lambda: fs.pipe(blobs)))
            times["s3fs cat"].append(timed(lambda: fs.cat(list(blobs))))
            times["s3fs cat_file"].append(timed(lambda: [fs.cat_file(p) for p in blobs]))
            if run:  # keep the server's memory bounded; the first run's checkpoint stays for the probe
                fs.rm(url.removeprefix("s3://"), recursive=True)
            fs.rm(f"{bucket}/s3fs-{run}", recursive=True)

        with CountingProxy(server.port).running() as proxy:
            proxied = options(proxy.endpoint)
            proxy.reset()
            with ckptfmt.open(f"s3://{bucket}/ckptfmt-0", storage_options=proxied) as ckpt:
                open_bytes = proxy.received_from_server
                record = ckpt.tensor("weights", SMALL)
                data_file = record.chunks[0].path
                data_file_size = ckpt.store.size(data_file)
                proxy.reset()
                ckpt.read_tensor("weights", SMALL)
                read_bytes = proxy.received_from_server
                read_sent = proxy.sent_to_server
    finally:
        server.kill()

    mbps = {k: nbytes / statistics.median(v) / 1e6 for k, v in times.items()}
    result = {
        "bytes": nbytes,
        "files": args.files,
        "repeat": args.repeat,
        "mb_per_s": mbps,
        "ratio_write": mbps["ckptfmt write"] / mbps["s3fs pipe"],
        "ratio_read": mbps["ckptfmt read"] / mbps["s3fs cat"],
        "ratio_read_sequential": mbps["ckptfmt read"] / mbps["s3fs cat_file"],
        "ratio_read_ranges": mbps["ckptfmt read"] / mbps["s3fs ranges"],
        "single_tensor": {
            "tensor_bytes": int(tensors[SMALL].nbytes),
            "data_file_bytes": data_file_size,
            "received_bytes": read_bytes,
            "sent_bytes": read_sent,
            "open_received_bytes": open_bytes,
        },
    }
    print(f"{nbytes / MiB:.0f} MiB in {args.files} files, moto on 127.0.0.1, median of {args.repeat} runs")
    print(f"{'':16}{'upload MB/s':>14}{'download MB/s':>16}")
    print(f"{'ckptfmt':16}{mbps['ckptfmt write']:>14.0f}{mbps['ckptfmt read']:>16.0f}")
    print(f"{'s3fs pipe/cat':16}{mbps['s3fs pipe']:>14.0f}{mbps['s3fs cat']:>16.0f}")
    print(f"{'s3fs cat_file':16}{'':>14}{mbps['s3fs cat_file']:>16.0f}  (one file at a time)")
    print(f"{'s3fs ranges':16}{'':>14}{mbps['s3fs ranges']:>16.0f}  (ckptfmt's ranges, one at a time)")
    print(f"{'ckptfmt/s3fs':16}{result['ratio_write']:>14.2f}{result['ratio_read']:>16.2f}  (pipe, cat)")
    print(f"{'':16}{'':>14}{result['ratio_read_sequential']:>16.2f}  (cat_file)")
    print(f"{'':16}{'':>14}{result['ratio_read_ranges']:>16.2f}  (ranges)")
    s = result["single_tensor"]
    print(
        f"one tensor of {s['tensor_bytes']} B from a {s['data_file_bytes'] / MiB:.1f} MiB file: "
        f"{s['received_bytes']} B received ({s['received_bytes'] - s['tensor_bytes']} B over the tensor), "
        f"{s['sent_bytes']} B sent; opening the checkpoint: {s['open_received_bytes']} B received"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
