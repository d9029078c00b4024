"""The memory directory: this user's own where others may write beside it, per user by default, and the peer
copies it holds counted and, where no restore would take them, reclaimed (tier/ring.py; red-team 3, finding 03).

A sticky world-writable temporary directory stands for ``/dev/shm``; another user is uid 65534 (``os.chown``,
which needs root: those tests are skipped, with the reason, where it is refused).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from ckptfmt.errors import MemoryCapacityError, UnsafePathError
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier import ring as ring_module
from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity
from ckptfmt.tier.ring import DEFAULT_MEMORY_DIR, MEMORY_DIR_ENV, MemoryTier, default_memory_dir
from ckptfmt.writer import CheckpointWriter

RUN = "/tmp/ckptfmt-memory-dir-test-run"
OTHER_UID = 65534  # nobody


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A directory every user may write, sticky: as /dev/shm is."""
    path = tmp_path / "shm"
    path.mkdir()
    path.chmod(0o1777)
    return path


def give_to_another_user(path: Path) -> None:
    try:
        os.chown(path, OTHER_UID, OTHER_UID)
    except PermissionError as exc:
        pytest.skip(f"cannot give a directory to uid {OTHER_UID} here (not root: {exc})")


def test_a_memory_dir_that_is_a_symlink_in_a_shared_directory_is_refused(shm: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (shm / "ckptfmt").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePathError) as refused:
        MemoryTier(shm / "ckptfmt", RUN).ensure()
    assert refused.value.problem == "symlink" and refused.value.path == str(shm / "ckptfmt")
    assert "is a symlink" in str(refused.value) and "other users may write" in str(refused.value)
    assert list(elsewhere.iterdir()) == []  # nothing written where the link leads


def test_a_memory_dir_of_another_user_is_refused_before_anything_is_made_in_it(shm: Path) -> None:
    theirs = shm / "ckptfmt"
    theirs.mkdir()
    theirs.chmod(0o777)  # "another user got there first", and lets everyone in
    give_to_another_user(theirs)
    tier = MemoryTier(theirs, RUN)
    with pytest.raises(UnsafePathError) as refused:
        tier.ensure()
    assert refused.value.path == str(theirs)
    assert f"owned by uid {OTHER_UID}" in str(refused.value) and "other users may write" in str(refused.value)
    assert not tier.root.exists()  # the run's slots never go where their owner could rename them away


def test_a_parent_of_another_user_is_refused(shm: Path) -> None:
    theirs = shm / "shared"
    theirs.mkdir()
    theirs.chmod(0o777)
    give_to_another_user(theirs)
    with pytest.raises(UnsafePathError, match=rf"{theirs} is owned by uid {OTHER_UID}"):
        MemoryTier(theirs / "mine", RUN).ensure()
    assert not (theirs / "mine").exists()


def test_a_link_of_ours_to_another_users_shared_directory_is_refused(shm: Path, tmp_path: Path) -> None:
    theirs = shm / "ckptfmt"
    theirs.mkdir()
    give_to_another_user(theirs)
    link = tmp_path / "mem"  # in a directory only we write: the link is ours, where it leads is not
    link.symlink_to(theirs, target_is_directory=True)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
        MemoryTier(link, RUN).ensure()


def test_the_red_team_job_refuses_at_construction(shm: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager

    theirs = shm / "ckptfmt"
    theirs.mkdir()
    theirs.chmod(0o777)
    give_to_another_user(theirs)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
        CheckpointManager(tmp_path / "run", memory_every=1, memory_dir=theirs)
    assert list(theirs.iterdir()) == []


def test_a_memory_dir_of_ours_in_a_shared_directory_is_made_0700(shm: Path) -> None:
    tier = MemoryTier(shm / "mine" / "node-a", RUN)
    tier.ensure()
    for made in (shm / "mine", shm / "mine" / "node-a", tier.root):
        st = made.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), made
    tier.ensure()  # and accepted when found again


def test_a_symlink_in_a_directory_only_we_write_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    tier = MemoryTier(tmp_path / "link", RUN)
    tier.ensure()  # the caller's own choice, as a checkpoint root's symlink is
    assert (real / tier.root.name).is_dir()


def test_the_default_memory_dir_is_per_user_and_made_0700(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert f"/dev/shm/ckptfmt-{os.geteuid()}" == DEFAULT_MEMORY_DIR
    monkeypatch.delenv(MEMORY_DIR_ENV, raising=False)
    monkeypatch.setattr(ring_module, "SHM_DIR", str(shm))
    tier = MemoryTier(None, RUN)
    assert tier.memory_dir == shm / f"ckptfmt-{os.geteuid()}"
    tier.ensure()
    st = tier.memory_dir.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    monkeypatch.setenv(MEMORY_DIR_ENV, str(shm / "chosen"))
    assert default_memory_dir() == str(shm / "chosen")
    monkeypatch.delenv(MEMORY_DIR_ENV)
    monkeypatch.setattr(ring_module.os, "geteuid", lambda: OTHER_UID)
    assert default_memory_dir() == str(shm / f"ckptfmt-{OTHER_UID}")  # another user, another directory


# ---------------------------------------------------------------- peer copies in the capacity check

COPY = 256 * 1024  # float32s per copy: 1 MiB


def peer_copy(tier: MemoryTier, source: int, k: int, *, run_dir: str = RUN, torn: bool = False) -> Path:
    """A replica of ``source``'s file, as a round commits one into ``peer-<source>-<k>``."""
    path = tier.root / f"peer-{source:05d}-{k}"
    binding = SlotBinding(run_id=run_identity(RUN), run_dir=normalize_run_url(run_dir), node="B", world_size=8, step=3)
    writer = CheckpointWriter(
        SlotStore(path), profile="weights", overwrite=True, rank=source, metadata=binding.to_metadata()
    )
    writer.write_tensor("weights", "w", np.full(COPY, source, dtype=np.float32))
    writer.commit()
    if torn:
        (path / "manifest.json").unlink()  # a round interrupted after it un-committed the copy
    return path


@pytest.fixture
def copies(tmp_path: Path) -> tuple[MemoryTier, dict[str, Path]]:
    tier = MemoryTier(tmp_path / "shm", RUN)
    tier.ensure()
    made = {
        "current": peer_copy(tier, 4, 1),  # a rank that sends here in this job
        "stale": peer_copy(tier, 1, 0),  # a rank that no longer does (another world or placement)
        "torn": peer_copy(tier, 2, 0, torn=True),
        "foreign": peer_copy(tier, 3, 0, run_dir="/elsewhere/run"),
    }
    return tier, made


def with_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(ring_module.shutil, "disk_usage", lambda _: usage._replace(free=free, total=64 << 20))


def test_copies_that_no_restore_would_take_are_reclaimed_and_the_others_kept(
    copies: tuple[MemoryTier, dict[str, Path]],
) -> None:
    tier, made = copies
    tier.check_capacity(1 << 20, peer_sources={4})
    assert {name for name, path in made.items() if path.exists()} == {"current", "stale"}
    assert {c.source for c in tier.peer_copies()} == {1, 4}


def test_without_the_jobs_sources_no_copy_is_removed(copies: tuple[MemoryTier, dict[str, Path]]) -> None:
    tier, made = copies
    tier.check_capacity(1 << 20)
    assert all(path.exists() for path in made.values())


def test_copies_the_job_rewrites_count_as_free_and_the_refusal_names_the_rest(
    copies: tuple[MemoryTier, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, made = copies
    current = next(c.slot.size for c in tier.peer_copies() if c.source == 4)
    per_slot = 1 << 20
    need = tier.slot_count * (per_slot + ring_module.SLOT_OVERHEAD)
    with_free(monkeypatch, need - current // 2)  # fits only with the current copy's bytes reused
    with pytest.raises(MemoryCapacityError) as refused:
        tier.check_capacity(per_slot, peer_sources={7})  # rank 4 sends here no more
    message = str(refused.value)
    assert "this run's slots hold 0.0 MiB, its peer copies" in message
    assert "of ranks that send none here now: kept, a restore may need them" in message
    assert "of copies no restore would take were removed" in message
    assert made["current"].exists() and made["stale"].exists()
    tier.check_capacity(per_slot, peer_sources={4})  # rank 4's copy is rewritten in place by the rounds


def test_one_run_directory_named_through_a_link_or_dots_has_one_run_key(tmp_path: Path) -> None:
    """spec/memory.md (N16): the normalized run directory URL is the path the OS resolves, so every process
    that names one directory computes one run-key and one run_dir (MEM-4 then never passes over a good slot)."""
    from ckptfmt.tier.binding import run_dir_key

    real = tmp_path / "runs" / "job"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    names = [str(real), str(tmp_path / "link"), str(real / ".." / "job") + "/", "file://" + str(tmp_path / "link")]
    assert {normalize_run_url(n) for n in names} == {os.path.realpath(real)}
    assert len({run_dir_key(n) for n in names}) == 1


def test_a_run_directory_with_a_nul_byte_names_no_directory_and_raises_nothing(tmp_path: Path) -> None:
    # a hostile slot's binding may say so (found by tests/test_fuzz.py, cli_rescue): it is another run's, not a crash
    hostile = str(tmp_path) + "\x00/run"
    assert normalize_run_url(hostile) == hostile
    assert normalize_run_url(hostile) != normalize_run_url(str(tmp_path))
