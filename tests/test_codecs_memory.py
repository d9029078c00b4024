"""The writer's memory bound with a codec, measured as peak RSS in a subprocess on a state far larger than it.

Bound (ckptfmt/write_executor.py): besides the caller's arrays, per worker one encoded data file (at most
``plan.ENCODED_FILE_BYTES`` of raw data, a tensor larger than that is cut into chunks) and one frame's
byte planes, and (local disks) two staging buffers of ``storage.direct.BUFFER_BYTES``. The subprocess
shrinks the first two (4 MiB files, 1 MiB frames) so that a 160 MiB state
is 40 times the file bound and the test stays fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from ckptfmt.storage import direct

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ckptfmt, ckptfmt.plan as plan, ckptfmt.codecs.zstd as zstd
    from ckptfmt.storage import open_store
    from ckptfmt.writer import CheckpointWriter

    plan.ENCODED_FILE_BYTES = 4 << 20
    zstd.FRAME_BYTES = 1 << 20
    rng = np.random.default_rng(0)
    state = {f"layer{i}": (rng.standard_normal((768, 8192), dtype=np.float32) * 0.02) for i in range(6)}
    state["big"] = rng.standard_normal((2, 2, 2 << 20), dtype=np.float32)  # 32 MiB: cut into chunks

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    out = {}
    for codec in ("zstd", None):
        open("/proc/self/clear_refs", "w").write("5")
        before = status("VmRSS")
        url = sys.argv[1] + "/" + str(codec)
        with CheckpointWriter(open_store(url), profile="weights", codec=codec, workers=2) as w:
            for name, a in state.items():
                w.write_tensor("weights", name, a)
        out[str(codec)] = (status("VmHWM") - before) / (1 << 20)
    ckpt = ckptfmt.open(sys.argv[1] + "/zstd")
    big = ckpt.tensor("weights", "big")
    out["big_chunks"] = [list(c.offsets) for c in big.chunks]
    out["same"] = all(ckpt.read_tensor("weights", n).tobytes() == a.tobytes() for n, a in state.items())
    print(json.dumps(out))
    print(out, file=sys.stderr)
    """
)


def test_writer_memory_stays_bounded_with_zstd(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["same"]
    # the 32 MiB tensor [2, 2, 2**21] is cut into 4 MiB chunks, contiguous views: rows of dim 0 and 1, halves of dim 2
    assert out["big_chunks"] == [[i, j, k] for i in range(2) for j in range(2) for k in (0, 1 << 20)]
    # 2 workers x (4 MiB file + 1 MiB planes) plus contexts and slack, for a 160 MiB state
    assert out["zstd"] < 32, out  # measured: 19 MiB
    # raw chunks are streamed from the caller's arrays through each worker's two O_DIRECT staging buffers (one
    # written while the other fills): 2 workers x 2 x 32 MiB at most, below the 176 MiB a copy of the state needs
    staging = 2 * 2 * direct.BUFFER_BYTES / (1 << 20)
    assert out["None"] < staging + 8, out  # measured: 57 MiB
