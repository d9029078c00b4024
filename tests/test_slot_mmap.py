"""A mapped array never sees a memory slot rewritten in place (storage/slot.py; red-team 3, finding 06).

A slot's data files keep their inodes from one snapshot to the next, so a shared map of one would show the
next snapshot's bytes after their digest check, and fault with SIGBUS once the file is cut shorter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import ckptfmt
from ckptfmt.storage.local import IN_PLACE_MARKER, LocalStore
from ckptfmt.storage.slot import SlotStore
from ckptfmt.writer import CheckpointWriter

N = 64 * 1024  # float32s: 256 KiB, many pages


def write_snapshot(slot: Path, value: float, n: int = N) -> None:
    """One snapshot of ``weights/w`` into the slot, as the memory tier writes one (in place, overwriting)."""
    writer = CheckpointWriter(SlotStore(slot), profile="weights", overwrite=True)
    writer.write_tensor("weights", "w", np.full(n, value, dtype=np.float32))
    writer.commit()


def data_files(slot: Path) -> dict[str, int]:
    return {str(p.relative_to(slot)): p.stat().st_ino for p in slot.rglob("*.safetensors")}


def test_a_verified_mapped_read_keeps_its_bytes_when_the_slot_is_rewritten(tmp_path: Path) -> None:
    slot = tmp_path / "slot-0"
    write_snapshot(slot, 1.0)
    inodes = data_files(slot)
    array = ckptfmt.open(slot).read_tensor("weights", "w", mmap=True, verify=True)  # a plain LocalStore
    write_snapshot(slot, 2.0)
    assert data_files(slot) == inodes  # still rewritten in place: the pages are reused
    assert ckptfmt.open(slot).read_tensor("weights", "w")[0] == 2.0
    assert np.all(array == 1.0)


def test_a_slot_store_maps_nothing(tmp_path: Path) -> None:
    slot = tmp_path / "slot-0"
    write_snapshot(slot, 1.0)
    store = SlotStore(slot)
    assert all(store.mapping(path) is None for path in store.list())


def test_a_file_older_than_the_marker_gets_a_fresh_inode_not_a_rewrite(tmp_path: Path) -> None:
    """A slot left by a version without the marker: a reader maps its file, then a writer marks the slot."""
    slot = tmp_path / "slot-0"
    write_snapshot(slot, 1.0)
    (slot / IN_PLACE_MARKER).unlink()
    array = ckptfmt.open(slot).read_tensor("weights", "w", mmap=True, verify=True)
    assert not array.flags.writeable  # mapped: no marker to see
    inodes = data_files(slot)
    write_snapshot(slot, 2.0)
    assert np.all(array == 1.0)
    assert set(data_files(slot).values()).isdisjoint(inodes.values())
    renewed = data_files(slot)
    write_snapshot(slot, 3.0)  # newer than the marker now: in place again
    assert data_files(slot) == renewed


def test_the_marker_survives_commits_and_no_listing_of_the_slot_shows_it(tmp_path: Path) -> None:
    slot = tmp_path / "slot-0"
    for value in (1.0, 2.0, 3.0):
        write_snapshot(slot, value)
    assert (slot / IN_PLACE_MARKER).is_file()
    assert IN_PLACE_MARKER not in SlotStore(slot).list()
    assert IN_PLACE_MARKER not in SlotStore(slot).list_detail()
    opened = ckptfmt.open(slot)
    assert opened.verify().ok  # readers ignore dot-names (LAY-4)
    assert opened.read_tensor("weights", "w", mmap=True)[0] == 3.0


def test_a_durable_checkpoint_is_still_mapped(tmp_path: Path) -> None:
    with CheckpointWriter(LocalStore(tmp_path / "step-1"), profile="weights") as writer:
        writer.write_tensor("weights", "w", np.full(N, 1.0, dtype=np.float32))
    array = ckptfmt.open(tmp_path / "step-1").read_tensor("weights", "w", mmap=True, verify=True)
    assert not array.flags.writeable and np.all(array == 1.0)  # a read-only map, zero-copy


CHILD = """
    import sys
    from pathlib import Path
    import numpy as np
    import ckptfmt
    sys.path.insert(0, {tests!r})
    from test_slot_mmap import N, write_snapshot

    slot = Path({slot!r})
    write_snapshot(slot, 1.0)
    array = ckptfmt.open(slot).read_tensor("weights", "w", mmap=True, verify=True)
    write_snapshot(slot, 2.0, n=16)  # the data file is cut from 256 KiB to a few hundred bytes, under the array
    total = float(array.sum())  # touches every page
    assert total == float(N), total
"""


def test_a_shrinking_rewrite_under_a_mapped_read_does_not_kill_the_reader(tmp_path: Path) -> None:
    code = textwrap.dedent(CHILD).format(tests=str(Path(__file__).parent), slot=str(tmp_path / "slot-0"))
    # subprocess.run waits for the child (and kills it first on a timeout): nothing is left behind
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"child exited {done.returncode} (-7 is SIGBUS): {done.stderr[-2000:]}"
