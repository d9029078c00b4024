"""ckptfmt -> ckptfmt re-encoding: another target file size, everything kept, nothing corrupt copied."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import data_file, flip_byte, run_cli, write_training


def test_reencode_with_smaller_files(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_training(src)
    result = run_cli("convert", src, dst, "--to", "ckptfmt", "--target-file-size", "40", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["source"]["format"] == doc["destination"]["format"] == "ckptfmt"
    with ckptfmt.open(src) as a, ckptfmt.open(dst) as b:
        assert b.profile == a.profile == "training"
        assert len([p for p in doc["files"] if p.startswith("weights/")]) > len(
            {c.path for t in a.fields["weights"].tensors.values() for c in t.chunks}
        )
        for field, record in a.fields.items():
            for name, tensor in record.tensors.items():
                assert a.read_tensor(field, name).tobytes() == b.read_tensor(field, name).tobytes()
                assert b.tensor(field, name).dtype == tensor.dtype
                assert sorted(c.offsets for c in b.tensor(field, name).chunks) == sorted(
                    c.offsets for c in tensor.chunks
                )
        converted = b.read_context("provenance")
        original = a.read_context("provenance")
        assert converted["converted_from"]["checkpoint_id"] == a.id
        assert {k: v for k, v in converted.items() if k != "converted_from"} == original
    assert run_cli("diff", src, dst, "--ignore", "provenance.converted_from*").exit_code == 0
    assert run_cli("verify", dst).exit_code == 0


def test_corrupt_source_is_not_copied(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_training(src)
    flip_byte(data_file(src, "weights"))
    result = run_cli("convert", src, dst, "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and result.json()["error"]["code"] == "digest_mismatch"
    assert not Path(dst, "manifest.json").exists()


def test_sha256_digests_are_kept(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_training(src, digest="sha256")
    assert run_cli("convert", src, dst, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(dst) as b:
        assert all(f.digest.startswith("sha256:") for f in b.manifest.files)


def test_importing_the_library_and_converters_loads_neither_torch_nor_click() -> None:
    code = "import sys, ckptfmt, ckptfmt.convert; print('torch' in sys.modules, 'click' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
