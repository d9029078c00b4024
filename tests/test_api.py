"""The public surface: small, light to import, one exception hierarchy with distinct codes."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfmt
from ckptfmt import errors


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # -I would drop the editable install's finder hook from site-packages; -P keeps cwd off sys.path.
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_import_does_not_load_click_torch_or_s3fs(tmp_path: Path) -> None:
    code = (
        "import sys, json, ckptfmt\n"
        "heavy = ('click', 'torch', 's3fs', 'botocore', 'aiobotocore')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_writing_and_reading_numpy_does_not_load_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, ckptfmt\n"
        f"url = {str(tmp_path / 'c')!r}\n"
        "with ckptfmt.open_writer(url, profile='weights') as w:\n"
        "    w.write_tensors('weights', {'a': np.arange(3)})\n"
        "ckptfmt.open(url).read_tensor('weights', 'a')\n"
        "assert ckptfmt.verify(url).ok\n"
        "print('torch' in sys.modules, 'click' in sys.modules)\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_no_top_level_cli_module_is_importable(tmp_path: Path) -> None:
    result = run_python("import cli", tmp_path)
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr
    # while the packaged CLI is importable under the library's name
    result = run_python("import ckptfmt.cli; print(callable(ckptfmt.cli.main))", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_every_name_in_all_exists() -> None:
    assert len(set(ckptfmt.__all__)) == len(ckptfmt.__all__)
    for name in ckptfmt.__all__:
        assert hasattr(ckptfmt, name), name


def test_the_documented_api_is_exported() -> None:
    for name in ("open_writer", "open", "verify", "CheckpointError", "Checkpoint", "CheckpointWriter"):
        assert name in ckptfmt.__all__
    assert callable(ckptfmt.open_writer) and callable(ckptfmt.open) and callable(ckptfmt.verify)


def exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def test_every_exception_derives_from_checkpoint_error() -> None:
    classes = exception_classes()
    assert len(classes) >= 20
    for cls in classes:
        assert issubclass(cls, errors.CheckpointError), cls
        assert issubclass(cls, Exception)  # never BaseException alone
    assert errors.CheckpointError.__bases__ == (Exception,)


def test_every_exception_has_a_distinct_code() -> None:
    codes = {}
    for cls in exception_classes():
        code = cls.__dict__.get("code")
        assert isinstance(code, str) and code, f"{cls.__name__} defines no code of its own"
        assert code not in codes, f"{cls.__name__} and {codes[code]} share code {code!r}"
        codes[code] = cls.__name__


def test_every_exception_is_exported() -> None:
    for cls in exception_classes():
        assert cls.__name__ in ckptfmt.__all__
        assert cls.__name__ in errors.__all__
        assert getattr(ckptfmt, cls.__name__) is cls


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.CheckpointNotFoundError, FileNotFoundError),
        (errors.MissingFileError, FileNotFoundError),
        (errors.CheckpointExistsError, FileExistsError),
        (errors.CheckpointLockedError, FileExistsError),
        (errors.ManifestError, ValueError),
        (errors.UsageError, ValueError),
        (errors.ContextError, ValueError),
        (errors.DTypeError, TypeError),
        (errors.StorageError, OSError),
        (errors.FieldNotFoundError, KeyError),
    ],
)
def test_builtin_meanings_are_inherited(cls: type[BaseException], builtin: type[BaseException]) -> None:
    assert issubclass(cls, builtin)


def test_errors_render_where_and_serialize() -> None:
    err = errors.DigestMismatchError("bytes differ", path="w/r.safetensors", field="weights", tensor="a")
    assert str(err) == "file 'w/r.safetensors', field 'weights', tensor 'a': bytes differ"
    assert err.to_dict() == {
        "code": "digest_mismatch",
        "message": "bytes differ",
        "path": "w/r.safetensors",
        "field": "weights",
        "tensor": "a",
    }
    located = errors.StorageError("boom").locate(path="p", field="f")
    assert (located.path, located.field, located.tensor) == ("p", "f", None)
    assert str(errors.FieldNotFoundError("no such field", field="x")) == "field 'x': no such field"


def test_format_version() -> None:
    assert ckptfmt.FORMAT_VERSION == "1.3"
    assert set(ckptfmt.PROFILES) == {"training", "weights"}
