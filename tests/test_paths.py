"""The path grammar of manifest paths and the name grammars of fields and tensors: tables of examples."""

from __future__ import annotations

import pytest

from ckptfmt.errors import UnsafePathError, UsageError
from ckptfmt.paths import check_field_name, check_path, is_field_name, tensor_name_problem

VALID_PATHS = [
    "a",
    "weights/r00000-00000.safetensors",
    "rng/context.msgpack",
    "a/b/c/d",
    "A-Z_a-z.0-9",
    "x..y",  # dots inside a segment are fine
    "a/b.",
    "-leading-dash",
    "_leading_underscore",
    "sub/manifest.json",  # only the root manifest is reserved
    "manifest.json.bak",
    "a" * 255,
    "/".join(["b" * 255] * 4),  # 1023 bytes
]

INVALID_PATHS = [
    "",
    ".",
    "..",
    "../x",
    "a/../b",
    "a/..",
    "./a",
    "a/./b",
    "/etc/passwd",
    "/a",
    "a/",
    "a//b",
    ".hidden",
    "a/.hidden",
    ".writer-lock",
    "a\\b",
    "..\\x",
    "C:\\windows",
    "C:",
    "a b",
    "é",
    "a\x00b",
    "a\nb",
    "a\n",
    "a*",
    "a?b",
    "~user",
    "manifest.json",
    "a" * 256,
    "/".join(["b" * 255] * 4) + "/c",  # 1025 bytes
    "s3://bucket/key",
    "file:///etc/passwd",
]


@pytest.mark.parametrize("path", VALID_PATHS, ids=lambda p: repr(p[:40]))
def test_valid_paths(path: str) -> None:
    assert check_path(path) == path


@pytest.mark.parametrize("path", INVALID_PATHS, ids=lambda p: repr(p[:40]))
def test_invalid_paths(path: str) -> None:
    with pytest.raises(UnsafePathError):
        check_path(path)


@pytest.mark.parametrize("path", [None, 3, b"a", ["a"]], ids=repr)
def test_non_string_paths(path: object) -> None:
    with pytest.raises(UnsafePathError):
        check_path(path)


def test_unsafe_path_error_names_the_path() -> None:
    with pytest.raises(UnsafePathError) as info:
        check_path("../x", where="files")
    assert info.value.path == "../x"
    assert info.value.code == "unsafe_path"


VALID_FIELDS = ["weights", "a", "lr_scheduler", "ema2", "x_", "a" + "b" * 63]
INVALID_FIELDS = ["", "Weights", "2x", "_x", "a-b", "a.b", "a b", "a/b", "é", "a" * 65, "weights\n"]


@pytest.mark.parametrize("name", VALID_FIELDS)
def test_valid_field_names(name: str) -> None:
    assert check_field_name(name) == name
    assert is_field_name(name)


@pytest.mark.parametrize("name", [*INVALID_FIELDS, None, 1], ids=repr)
def test_invalid_field_names(name: object) -> None:
    assert not is_field_name(name)
    with pytest.raises(UsageError):
        check_field_name(name)


VALID_TENSORS = [
    "w",
    "model.layers.0.self_attn.q_proj.weight",
    "with space",
    "slash/and\\backslash",
    "t@0,0",
    "../not-a-path",
    "ünïcödé 😀",
    "x" * 1024,
    "é" * 512,  # 1024 bytes
    "__metadata",
    "__metadata__x",
]
INVALID_TENSORS = ["", "__metadata__", "a\x00", "a\tb", "a\nb", "\x1f", "a\x7f", "x" * 1025, "é" * 513, "\ud800"]


@pytest.mark.parametrize("name", VALID_TENSORS, ids=lambda n: repr(n[:30]))
def test_valid_tensor_names(name: str) -> None:
    assert tensor_name_problem(name) is None


@pytest.mark.parametrize("name", [*INVALID_TENSORS, None, 1, b"w"], ids=lambda n: repr(n)[:30])
def test_invalid_tensor_names(name: object) -> None:
    problem = tensor_name_problem(name)
    assert isinstance(problem, str) and problem
