"""Where exporters write (issue 23): names taken from a checkpoint are held to the path rule of reads, and no
exporter writes through a symlink placed in its destination (ckptfmt/convert/destination.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt.convert import convert
from ckptfmt.convert.base import ConvertResult, NoProgress
from ckptfmt.convert.training import write_training
from ckptfmt.errors import UnsafePathError

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli


def training_checkpoint(url: Path, files: dict[str, object] | None = None) -> None:
    """A minimal training-profile checkpoint, with an ``accelerate`` context naming ``files``."""
    weights = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    contexts: dict[str, dict[str, object]] = {
        "rng": {"generators": {}},
        "data": {"epoch": 0, "global_sample_offset": 0},
        "config": {"config": {}, "hash": ckptfmt.canonical.config_hash({})},
        "topology": {"world_size": 1},
        "accelerate": {"files": files or {}, "step": {}, "models": 1},
        "trainer_state": {"state": {"global_step": 3, "epoch": 0.0, "log_history": []}},
        "lightning": {"checkpoint": {"epoch": 0, "global_step": 3}},
        "provenance": {"step": 3},
    }
    result = ConvertResult(source="", source_format="x", destination=str(url), destination_format="ckptfmt")
    write_training(
        str(url),
        weights=weights,
        optimizer=({}, {}),
        contexts=contexts,
        result=result,
        progress=NoProgress(),
        storage_options=None,
        overwrite=False,
        target_file_size=None,
    )


@pytest.mark.parametrize("name", ["../../../escaped.pkl", "/tmp/ckptfmt-absolute-escape.pkl", "a/../../up.pkl"])
def test_an_accelerate_export_refuses_a_file_name_leaving_its_destination(tmp_path: Path, name: str) -> None:
    src = tmp_path / "src"
    training_checkpoint(src, {name: {"epoch": 1}})
    dst = tmp_path / "a" / "b" / "c" / "out"
    result = run_cli("convert", str(src), str(dst), "--to", "accelerate")
    assert result.exit_code == 1 and "unsafe_path" in result.stderr, result.stderr
    assert name in result.stderr
    assert not (tmp_path / "escaped.pkl").exists() and not (tmp_path / "a" / "up.pkl").exists()
    assert not Path("/tmp/ckptfmt-absolute-escape.pkl").exists()
    assert not dst.exists()  # refused before anything was written


def test_an_accelerate_export_name_may_not_replace_a_file_it_writes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    training_checkpoint(src, {"model.safetensors": {"epoch": 1}})
    with pytest.raises(UnsafePathError):
        convert(str(src), str(tmp_path / "out"), to="accelerate")


def test_a_plain_accelerate_file_name_still_exports(tmp_path: Path) -> None:
    src = tmp_path / "src"
    training_checkpoint(src, {"custom_checkpoint_0.pkl": {"epoch": 1}})
    convert(str(src), str(tmp_path / "out"), to="accelerate")
    assert {"model.safetensors", "custom_checkpoint_0.pkl"} <= set(os.listdir(tmp_path / "out"))


@pytest.mark.parametrize(
    ("to", "target"),
    [
        ("accelerate", "model.safetensors"),
        ("hf", "model.safetensors"),
        ("hf-trainer", "trainer_state.json"),
        ("dcp", ".metadata"),
    ],
)
def test_no_exporter_writes_through_a_symlink_in_its_destination(tmp_path: Path, to: str, target: str) -> None:
    src = tmp_path / "src"
    training_checkpoint(src)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / target).symlink_to(victim)
    result = run_cli("convert", str(src), str(dst), "--to", to, "--overwrite")
    assert result.exit_code == 1 and "unsafe_path" in result.stderr, result.stderr
    assert victim.read_bytes() == b"precious"


def test_a_lightning_export_does_not_write_through_a_symlinked_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    training_checkpoint(src)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "out.ckpt").symlink_to(victim)
    result = run_cli("convert", str(src), str(tmp_path / "out.ckpt"), "--to", "lightning", "--overwrite")
    assert result.exit_code == 1 and "unsafe_path" in result.stderr, result.stderr
    assert victim.read_bytes() == b"precious"
    convert(str(src), str(tmp_path / "plain.ckpt"), to="lightning")  # a plain file is written as before
    assert (tmp_path / "plain.ckpt").stat().st_size > 0


def test_a_symlink_placed_after_the_check_is_not_written_through(tmp_path: Path) -> None:
    from ckptfmt.convert.base import locate
    from ckptfmt.convert.destination import prepare_directory, write_output

    out = locate(str(tmp_path / "out"))
    prepare_directory(out, ["model.safetensors"], overwrite=False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "out" / "model.safetensors").symlink_to(victim)  # raced in after the check
    with pytest.raises(UnsafePathError):
        write_output(out, "model.safetensors", b"data")
    assert victim.read_bytes() == b"precious"


# ---------------------------------------------------------------- hard links (redteam-3 finding 08)


def _precious_link(tmp_path: Path, link: Path) -> Path:
    """``precious.bin`` outside the destination, and ``link`` another name of its inode (as ``cp -al`` or
    ``rsync --link-dest`` snapshot trees and dedup tools leave them)."""
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"precious")
    link.parent.mkdir(parents=True, exist_ok=True)
    os.link(precious, link)
    return precious


def _imported_weights(tmp_path: Path, exported: Path, fmt: str) -> np.ndarray:
    """The ``w`` an export holds, read back through its importer."""
    back = tmp_path / "back"
    convert(str(exported), str(back), to="ckptfmt", source_format=fmt)
    with ckptfmt.open(str(back)) as ckpt:
        return np.asarray(ckpt.read_tensor("weights", "w"))


@pytest.mark.parametrize(
    ("to", "target"),
    [
        ("accelerate", "model.safetensors"),
        ("hf", "model.safetensors"),
        ("hf-trainer", "trainer_state.json"),
        ("hf-trainer", "model.safetensors"),
        ("dcp", "__0_0.distcp"),
        ("dcp", ".metadata"),
    ],
)
def test_an_overwrite_replaces_a_hard_linked_name_not_its_inode(tmp_path: Path, to: str, target: str) -> None:
    src = tmp_path / "src"
    training_checkpoint(src)
    dst = tmp_path / "out"
    precious = _precious_link(tmp_path, dst / target)
    result = run_cli("convert", str(src), str(dst), "--to", to, "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert precious.read_bytes() == b"precious"  # the other name of the old inode keeps its bytes
    assert os.stat(dst / target).st_nlink == 1 and os.stat(precious).st_nlink == 1
    assert not [
        n for n in os.listdir(dst) if ".tmp-" in n or n.startswith(".export-staging-")
    ]  # no temp file left behind
    expected = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_imported_weights(tmp_path, dst, to), expected)


def test_a_lightning_overwrite_replaces_a_hard_linked_file_not_its_inode(tmp_path: Path) -> None:
    src = tmp_path / "src"
    training_checkpoint(src)
    out = tmp_path / "out" / "last.ckpt"
    precious = _precious_link(tmp_path, out)
    result = run_cli("convert", str(src), str(out), "--to", "lightning", "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert precious.read_bytes() == b"precious"
    assert os.stat(out).st_nlink == 1 and out.stat().st_size > len(b"precious")
    assert not [n for n in os.listdir(out.parent) if ".tmp-" in n]
    np.testing.assert_array_equal(
        _imported_weights(tmp_path, out, "lightning"), np.arange(6, dtype=np.float32).reshape(2, 3)
    )
