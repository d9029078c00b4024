"""Every single-byte flip and every truncation of every file of a small checkpoint (issue 9), sampled for a
large one: detected by ``ckpt verify``, by reading, and by ``ckpt diff`` against the original.

CI tries a sample of the small checkpoint's cases; ``CKPTFMT_RELIABILITY=full`` (or
scripts/reliability.py) tries all of them. See tests/crash/corruption.py for the oracles.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from crash import corruption, full, size

import ckptfmt


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> corruption.CorruptionFigures:
    root = tmp_path_factory.mktemp("corrupt-small")
    corruption.write_small(str(root / "original"))
    return corruption.corrupt(str(root / "original"), root, "small", sample=None if full() else 200, seed=1)


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> corruption.CorruptionFigures:
    root = tmp_path_factory.mktemp("corrupt-large")
    corruption.write_large(str(root / "original"))
    return corruption.corrupt(str(root / "original"), root, "large", sample=size(30, 1000), seed=2)


def test_small_checkpoint_is_small_and_multi_file(small: corruption.CorruptionFigures) -> None:
    assert small.files == 6 and small.bytes < 4096  # 3 data files, 2 context blobs, the manifest
    if full():
        assert small.tried == 2 * small.bytes  # every flip and every truncation


def test_verify_detects_every_flip_and_truncation(small: corruption.CorruptionFigures) -> None:
    """Except a manifest flip that makes another valid, wholly readable checkpoint (a renamed field or tensor, a
    later minor version: no digest inside a checkpoint covers its manifest; its id does), and D7 below."""
    assert not small.missed_by_verify, "\n".join(small.missed_by_verify[:20])
    excused = len(small.other_valid_manifest) + len(small.missed_by_verify_codec)
    assert small.by_verify + excused == small.tried > 0
    assert all(m.startswith(corruption.MANIFEST) for m in small.other_valid_manifest)


# Defect D7, found by this harness: verify passed a chunk whose codec no reader implements (ckptfmt/verify.py).
def test_verify_refuses_a_chunk_with_an_unknown_codec(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    corruption.write_small(str(url))
    manifest = url / corruption.MANIFEST
    manifest.write_bytes(manifest.read_bytes().replace(b'"name":"raw"', b'"name":"rav"', 1))
    assert not ckptfmt.verify(str(url)).ok


def test_reading_detects_every_flip_and_truncation(small: corruption.CorruptionFigures) -> None:
    assert not small.missed_by_read, "\n".join(small.missed_by_read[:20])
    assert small.by_read == small.tried


# Defect D6, found by this harness: ckpt diff checked chunk digests but not whole-file digests nor the
# format_version (cli/checkpoint_diff.py); it now verifies both sides first.
def test_diff_against_the_original_detects_a_flipped_file_digest(tmp_path: Path) -> None:
    import json
    import shutil

    from ckptfmt.cli import cli
    from click.testing import CliRunner

    corruption.write_small(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    manifest = tmp_path / "b" / corruption.MANIFEST
    doc = json.loads(manifest.read_bytes())
    digest = doc["files"][-1]["digest"]  # a data file's whole-file digest: 0 <-> 1 in its last hex digit
    text = manifest.read_bytes().replace(digest.encode(), (digest[:-1] + "01"[digest[-1] == "0"]).encode())
    manifest.write_bytes(text)
    assert not ckptfmt.verify(str(tmp_path / "b")).ok
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code != 0, result.output


def test_diff_detects_every_damaged_data_file_and_blob(small: corruption.CorruptionFigures) -> None:
    """What diff does catch today: any damage outside the manifest."""
    missed = [m for m in small.missed_by_diff if not m.startswith(corruption.MANIFEST)]
    assert not missed, "\n".join(missed[:20])


def test_large_checkpoint_sampled(large: corruption.CorruptionFigures, tmp_path: Path) -> None:
    for missed in (large.missed_by_verify, large.missed_by_read):
        assert not missed, "\n".join(missed[:20])
    assert not [m for m in large.missed_by_diff if not m.startswith(corruption.MANIFEST)]
    assert large.bytes > 2 << 20 and large.tried == size(30, 1000)
