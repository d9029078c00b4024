"""Opening and reading: what a reader refuses (incomplete, invalid, unknown major, unsafe paths,
tampered bytes) and what it must tolerate (unknown keys, skippable extensions, new minors)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

import ckptfmt
from ckptfmt.canonical import config_hash
from ckptfmt.context import encode
from ckptfmt.errors import (
    CheckpointNotFoundError,
    ChunkLayoutError,
    ConfigHashMismatchError,
    ContextError,
    DigestMismatchError,
    DTypeError,
    FieldNotFoundError,
    IncompleteCheckpointError,
    ManifestError,
    MissingFieldError,
    SizeMismatchError,
    UnsafePathError,
    UnsupportedCodecError,
    UnsupportedExtensionError,
    UnsupportedVersionError,
)
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.profiles import PROFILES

Raw = Any  # the conftest ``raw`` helper bundle


@pytest.fixture
def training(store_url: str, write_training: Callable[..., str]) -> str:
    write_training(store_url)
    return store_url


# ---------------------------------------------------------------- nothing, or not committed


def test_missing_manifest_with_files_present_is_incomplete(training: str, raw: Raw) -> None:
    raw.delete(training, "manifest.json")
    with pytest.raises(IncompleteCheckpointError) as info:
        ckptfmt.open(training)
    assert "no manifest" in str(info.value)


def test_only_a_lock_is_incomplete(store_url: str) -> None:
    writer = ckptfmt.open_writer(store_url, profile="weights")
    try:
        with pytest.raises(IncompleteCheckpointError):
            ckptfmt.open(store_url)
    finally:
        writer.abort()


def test_empty_location_is_not_found(store_url: str) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptfmt.open(store_url)
    assert isinstance(info.value, FileNotFoundError)


def test_empty_existing_directory_is_not_found(local_url: str) -> None:
    os.makedirs(local_url)
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.open(local_url)
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.open(f"file://{local_url}")


def test_a_good_checkpoint_reads_back(training: str) -> None:
    ckpt = ckptfmt.open(training)
    assert ckpt.profile == "training" and ckpt.format_version == "1.3"  # tree digests (the default)
    assert set(ckpt.fields) == set(PROFILES["training"])
    assert ckpt.read_context("data")["global_sample_offset"] == 4096
    assert ckpt.read_context("optimizer") == {"param_groups": [{"lr": 0.001, "params": ["layer0.w", "layer0.b"]}]}
    assert int(ckpt.read_tensor("optimizer", "step")) == 7
    with pytest.raises(FieldNotFoundError):
        ckpt.read_tensor("weights", "nope")
    with pytest.raises(FieldNotFoundError):
        ckpt.field("nope")
    with pytest.raises(FieldNotFoundError):
        ckpt.read_context("weights")


# ---------------------------------------------------------------- versions and extensions


@pytest.mark.parametrize("version", ["2.0", "0.9", "10.0"])
def test_unknown_major_is_refused(training: str, raw: Raw, version: str) -> None:
    raw.edit_manifest(training, lambda d: d.update(format_version=version))
    with pytest.raises(UnsupportedVersionError):
        ckptfmt.open(training)


@pytest.mark.parametrize("version", ["1.1", "1.99"])
def test_any_minor_of_major_one_is_read(training: str, raw: Raw, version: str) -> None:
    raw.edit_manifest(training, lambda d: d.update(format_version=version))
    ckpt = ckptfmt.open(training)
    assert ckpt.format_version == version
    assert ckpt.read_tensor("weights", "layer0.w").shape == (4, 3)


@pytest.mark.parametrize("version", ["1", "1.0.0", "v1.0", "1.x", "01.0", "1.00", "1.0 ", "\uff11.0", "", 1, None])
def test_malformed_version_is_refused(training: str, raw: Raw, version: object) -> None:
    raw.edit_manifest(training, lambda d: d.update(format_version=version))
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def test_wrong_format_name_is_refused(training: str, raw: Raw) -> None:
    raw.edit_manifest(training, lambda d: d.update(format="safetensors-index"))
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def test_unknown_profile_is_refused(training: str, raw: Raw) -> None:
    raw.edit_manifest(training, lambda d: d.update(profile="inference"))
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def test_unknown_must_understand_extension_is_refused(training: str, raw: Raw) -> None:
    ext = {"name": "org.example.sparse", "must_understand": True}
    raw.edit_manifest(training, lambda d: d.update(extensions=[ext]))
    with pytest.raises(UnsupportedExtensionError) as info:
        ckptfmt.open(training)
    assert "org.example.sparse" in str(info.value)


def test_unknown_skippable_extension_is_ignored(training: str, raw: Raw) -> None:
    ext = {"name": "org.example.notes", "must_understand": False, "configuration": {"x": [1, 2]}}
    raw.edit_manifest(training, lambda d: d.update(extensions=[ext]))
    ckpt = ckptfmt.open(training)
    assert [e.name for e in ckpt.manifest.extensions] == ["org.example.notes"]
    assert ckpt.read_tensor("weights", "layer0.b").shape == (3,)


@pytest.mark.parametrize("ext", [{"name": "x"}, {"must_understand": False}, {"name": 1, "must_understand": False}])
def test_malformed_extension_is_refused(training: str, raw: Raw, ext: dict[str, Any]) -> None:
    raw.edit_manifest(training, lambda d: d.update(extensions=[ext]))
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def add_unknown_keys(doc: dict[str, Any]) -> None:
    doc["future_top_level"] = {"anything": [1, "two"]}
    doc["files"][0]["future_file_key"] = True
    for field in doc["fields"].values():
        field["future_field_key"] = "x"
        if "context" in field:
            field["context"]["future_context_key"] = 1
        for tensor in field.get("tensors", {}).values():
            tensor["future_tensor_key"] = [1]
            for chunk in tensor["chunks"]:
                chunk["future_chunk_key"] = {}
                chunk["codec"]["future_codec_key"] = "y"


def test_unknown_keys_anywhere_are_ignored(training: str, raw: Raw) -> None:
    expected = ckptfmt.open(training).read_tensors("weights")
    raw.edit_manifest(training, add_unknown_keys)
    ckpt = ckptfmt.open(training)
    for name, array in expected.items():
        np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)
    assert ckpt.read_context("topology") == {"world_size": 1, "rank": 0}
    assert ckptfmt.verify(training).ok


def test_non_canonical_manifest_is_accepted(training: str, raw: Raw) -> None:
    doc = raw.manifest(training)
    raw.write_manifest(training, doc, canonical=False)
    assert ckptfmt.open(training).read_tensor("weights", "layer0.w").shape == (4, 3)


# ---------------------------------------------------------------- required fields


def drop_field(doc: dict[str, Any], name: str) -> None:
    """Remove a field and the files only it used, so the field's absence is the one defect."""
    record = doc["fields"].pop(name)
    used = {c["path"] for t in record.get("tensors", {}).values() for c in t["chunks"]}
    if "context" in record:
        used.add(record["context"]["path"])
    doc["files"] = [f for f in doc["files"] if f["path"] not in used]


@pytest.mark.parametrize("missing", list(PROFILES["training"]))
def test_each_required_training_field_removed_is_refused(training: str, raw: Raw, missing: str) -> None:
    raw.edit_manifest(training, lambda d: drop_field(d, missing))
    with pytest.raises(MissingFieldError) as info:
        ckptfmt.open(training)
    assert info.value.field == missing


@pytest.mark.parametrize("missing", list(PROFILES["weights"]))
def test_each_required_weights_field_removed_is_refused(
    store_url: str, write_weights: Callable[..., str], raw: Raw, missing: str
) -> None:
    write_weights(store_url)
    raw.edit_manifest(store_url, lambda d: drop_field(d, missing))
    with pytest.raises(MissingFieldError) as info:
        ckptfmt.open(store_url)
    assert info.value.field == missing


def test_a_required_field_of_the_wrong_kind_is_refused(training: str, raw: Raw) -> None:
    def retype(doc: dict[str, Any]) -> None:
        doc["fields"]["topology"] = {"kind": "tensors", "tensors": {}, "context": doc["fields"]["topology"]["context"]}

    raw.edit_manifest(training, retype)
    with pytest.raises(MissingFieldError):
        ckptfmt.open(training)


def test_a_weights_checkpoint_relabelled_training_is_refused(
    store_url: str, write_weights: Callable[..., str], raw: Raw
) -> None:
    write_weights(store_url)
    raw.edit_manifest(store_url, lambda d: d.update(profile="training"))
    with pytest.raises(MissingFieldError):
        ckptfmt.open(store_url)


@pytest.mark.parametrize("key", ["format", "format_version", "profile", "files", "fields"])
def test_each_required_top_level_key_removed_is_refused(training: str, raw: Raw, key: str) -> None:
    raw.edit_manifest(training, lambda d: d.pop(key))
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


# ---------------------------------------------------------------- manifest schema


def first_chunk(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["fields"]["weights"]["tensors"]["layer0.w"]["chunks"][0]  # type: ignore[no-any-return]


SCHEMA_BREAKS: dict[str, Callable[[dict[str, Any]], object]] = {
    "files unsorted": lambda d: d["files"].reverse(),
    "file listed twice": lambda d: d["files"].insert(0, dict(d["files"][0])),
    "negative size": lambda d: d["files"][0].update(size=-1),
    "unknown digest algorithm": lambda d: d["files"][0].update(digest="md5:" + "0" * 32),
    "short digest": lambda d: d["files"][0].update(digest="xxh3-128:abc"),
    "uppercase digest": lambda d: d["files"][0].update(digest=d["files"][0]["digest"].upper()),
    "chunk range too long": lambda d: first_chunk(d).update(range=[first_chunk(d)["range"][0], 10**9]),
    "chunk bytes != shape": lambda d: first_chunk(d).update(shape=[4, 2]),
    "chunk without codec": lambda d: first_chunk(d).pop("codec"),
    "chunk in unlisted file": lambda d: first_chunk(d).update(path="weights/other.safetensors"),
    "unknown field kind": lambda d: d["fields"]["data"].update(kind="blob"),
    "bad field name": lambda d: d["fields"].update(BadName=d["fields"].pop("data")),
    "metadata not strings": lambda d: d.update(metadata={"a": 1}),
    "tensors not an object": lambda d: d["fields"]["weights"].update(tensors=[]),
    "bool as size": lambda d: d["files"][0].update(size=True),
    "dtype not a string": lambda d: d["fields"]["weights"]["tensors"]["layer0.w"].update(dtype=4),
    "context field with tensors": lambda d: d["fields"]["data"].update(tensors={}),
    "two chunks claim one entry": lambda d: d["fields"]["weights"]["tensors"]["layer0.b"]["chunks"][0].update(
        key=first_chunk(d)["key"], path=first_chunk(d)["path"]
    ),
}


@pytest.mark.parametrize("name", SCHEMA_BREAKS)
def test_schema_breaks_are_refused(training: str, raw: Raw, name: str) -> None:
    raw.edit_manifest(training, SCHEMA_BREAKS[name])
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", b"[]", b"not json", b'{"format":"ckptfmt","format":"ckptfmt"}', b'{"x":1.5}'],
    ids=["empty", "not utf-8", "array", "garbage", "duplicate key", "float"],
)
def test_unparseable_manifests_are_refused(training: str, raw: Raw, data: bytes) -> None:
    raw.write_manifest(training, data)
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def test_duplicate_key_deep_in_the_manifest_is_refused(training: str, raw: Raw) -> None:
    text = ckptfmt.open_store(training).read("manifest.json").decode()
    text = text.replace('"kind":"context"', '"kind":"context","kind":"tensors"', 1)
    raw.write_manifest(training, text.encode())
    with pytest.raises(ManifestError):
        ckptfmt.open(training)


def test_unknown_dtype_refuses_only_that_tensor(training: str, raw: Raw) -> None:
    raw.edit_manifest(training, lambda d: d["fields"]["weights"]["tensors"]["layer0.w"].update(dtype="F4"))
    ckpt = ckptfmt.open(training)
    with pytest.raises(DTypeError) as info:
        ckpt.read_tensor("weights", "layer0.w")
    assert (info.value.field, info.value.tensor) == ("weights", "layer0.w")
    # other data files stay readable (TEN-1); the edited file itself now contradicts its header (SAF-13)
    assert ckpt.read_tensor("optimizer", "layer0.w.exp_avg").shape == (4, 3)
    with pytest.raises(ckptfmt.SafetensorsHeaderError, match="F4"):
        ckpt.read_tensor("weights", "layer0.b")


def test_a_listed_file_no_field_uses_is_tolerated(training: str, raw: Raw) -> None:
    raw.put(training, "zzz/unused.bin", b"later minor versions may reference this")
    raw.edit_manifest(
        training,
        lambda d: d["files"].append({"path": "zzz/unused.bin", "size": 40, "digest": d["files"][0]["digest"]}),
    )
    assert ckptfmt.open(training).read_tensor("weights", "layer0.w").shape == (4, 3)


def test_unknown_codec_refuses_only_that_tensor(training: str, raw: Raw) -> None:
    raw.edit_manifest(
        training, lambda d: first_chunk(d).update(codec={"name": "org.example.unknown", "configuration": {"level": 3}})
    )
    ckpt = ckptfmt.open(training)
    with pytest.raises(UnsupportedCodecError) as info:
        ckpt.read_tensor("weights", "layer0.w")
    assert info.value.tensor == "layer0.w"
    assert ckpt.read_tensor("weights", "layer0.b").shape == (3,)


# ---------------------------------------------------------------- unsafe paths

UNSAFE_PATHS = [
    "../x",
    "weights/../../x",
    "/etc/passwd",
    "a//b",
    ".hidden",
    "weights/.hidden",
    "weights\\r00000-00000.safetensors",
    "..\\x",
    "C:\\x",
    "./x",
    "x/",
    "manifest.json",
    "a/b\x00c",
    "é/x",
]


def rename_path(doc: dict[str, Any], old: str, new: str) -> None:
    for record in doc["files"]:
        if record["path"] == old:
            record["path"] = new
    for field in doc["fields"].values():
        if field.get("context", {}).get("path") == old:
            field["context"]["path"] = new
        for tensor in field.get("tensors", {}).values():
            for chunk in tensor["chunks"]:
                if chunk["path"] == old:
                    chunk["path"] = new
    doc["files"].sort(key=lambda f: f["path"])


@pytest.mark.parametrize("bad", UNSAFE_PATHS, ids=repr)
@pytest.mark.parametrize("where", ["data file", "context blob"])
def test_unsafe_manifest_paths_are_refused(training: str, raw: Raw, bad: str, where: str) -> None:
    old = "weights/r00000-00000.safetensors" if where == "data file" else "rng/context.msgpack"
    raw.edit_manifest(training, lambda d: rename_path(d, old, bad))
    with pytest.raises(UnsafePathError):
        ckptfmt.open(training)


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a//b", ".hidden", "a\\b"], ids=repr)
def test_unsafe_paths_only_in_a_chunk_or_context_reference_are_refused(training: str, raw: Raw, bad: str) -> None:
    raw.edit_manifest(training, lambda d: first_chunk(d).update(path=bad))
    with pytest.raises(UnsafePathError):
        ckptfmt.open(training)
    raw.edit_manifest(training, lambda d: first_chunk(d).update(path="weights/r00000-00000.safetensors"))
    raw.edit_manifest(training, lambda d: d["fields"]["rng"]["context"].update(path=bad))
    with pytest.raises(UnsafePathError):
        ckptfmt.open(training)


def test_a_valid_path_off_the_reference_layout_is_read(training: str, raw: Raw) -> None:
    store = ckptfmt.open_store(training)
    store_bytes = store.read("weights/r00000-00000.safetensors")
    raw.put(training, "elsewhere/deep/w-1.safetensors", store_bytes)
    raw.edit_manifest(
        training, lambda d: rename_path(d, "weights/r00000-00000.safetensors", "elsewhere/deep/w-1.safetensors")
    )
    raw.delete(training, "weights/r00000-00000.safetensors")
    ckpt = ckptfmt.open(training)
    assert ckpt.read_tensor("weights", "layer0.w").shape == (4, 3)


def test_a_data_file_replaced_by_a_symlink_is_refused(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url)
    path = os.path.join(local_url, "weights", "r00000-00000.safetensors")
    outside = os.path.join(os.path.dirname(local_url), "outside.safetensors")
    os.rename(path, outside)
    os.symlink(outside, path)
    ckpt = ckptfmt.open(local_url)
    with pytest.raises(UnsafePathError) as info:
        ckpt.read_tensor("weights", "layer0.w")
    assert info.value.path == "weights/r00000-00000.safetensors"
    report = ckptfmt.verify(local_url)
    assert not report.ok
    assert any(p.path == "weights/r00000-00000.safetensors" for p in report.problems)


def test_a_symlinked_directory_is_refused(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url)
    real = os.path.join(local_url, "weights")
    outside = os.path.join(os.path.dirname(local_url), "weights-outside")
    os.rename(real, outside)
    os.symlink(outside, real)
    ckpt = ckptfmt.open(local_url)
    with pytest.raises(UnsafePathError):
        ckpt.read_tensor("weights", "layer0.w")
    assert not ckptfmt.verify(local_url).ok


def test_a_symlinked_context_blob_is_refused(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url)
    path = os.path.join(local_url, "rng", "context.msgpack")
    outside = os.path.join(os.path.dirname(local_url), "rng.msgpack")
    os.rename(path, outside)
    os.symlink(outside, path)
    with pytest.raises(UnsafePathError):
        ckptfmt.open(local_url).read_context("rng")


def test_a_symlinked_manifest_is_refused(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url)
    path = os.path.join(local_url, "manifest.json")
    outside = os.path.join(os.path.dirname(local_url), "manifest.json")
    os.rename(path, outside)
    os.symlink(outside, path)
    with pytest.raises(UnsafePathError):
        ckptfmt.open(local_url)


def test_a_directory_where_a_file_should_be_is_refused(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url)
    path = os.path.join(local_url, "weights", "r00000-00000.safetensors")
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(UnsafePathError):
        ckptfmt.open(local_url).read_tensor("weights", "layer0.w")


def test_hidden_and_unlisted_files_are_ignored(training: str, raw: Raw) -> None:
    raw.put(training, ".writer-lock", b"{}")
    raw.put(training, "weights/.r00000-00000.safetensors.tmp-abc", b"junk")
    raw.put(training, "notes.txt", b"unlisted")
    ckpt = ckptfmt.open(training)
    assert ckpt.read_tensor("weights", "layer0.w").shape == (4, 3)


# ---------------------------------------------------------------- tampered data


def test_tampered_bytes_raise_digest_mismatch_naming_file_field_and_tensor(training: str, raw: Raw) -> None:
    ckpt = ckptfmt.open(training)
    chunk = ckpt.tensor("weights", "layer0.w").chunks[0]
    data = bytearray(ckpt.store.read(chunk.path))
    data[chunk.begin + 5] ^= 0x01
    raw.put(training, chunk.path, bytes(data))
    with pytest.raises(DigestMismatchError) as info:
        ckptfmt.open(training).read_tensor("weights", "layer0.w")
    err = info.value
    assert (err.path, err.field, err.tensor) == (chunk.path, "weights", "layer0.w")
    message = str(err)
    assert chunk.path in message and "weights" in message and "layer0.w" in message
    # the other tensor of the same file is intact and still reads (a partial read checks what it read)
    ckptfmt.open(training).read_tensor("weights", "layer0.b")
    # and verify=False returns the bytes as stored
    ckptfmt.open(training).read_tensor("weights", "layer0.w", verify=False)


def test_tampered_chunk_is_caught_by_read_slice(store_url: str, raw: Raw) -> None:
    full = np.arange(20, dtype=np.float32).reshape(4, 5)
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "t", full[:2], global_shape=(4, 5), offsets=(0, 0))
        w.write_tensor("weights", "t", full[2:], global_shape=(4, 5), offsets=(2, 0))
    ckpt = ckptfmt.open(store_url)
    chunk = next(c for c in ckpt.tensor("weights", "t").chunks if c.offsets == (2, 0))
    data = bytearray(ckpt.store.read(chunk.path))
    data[chunk.end - 1] ^= 0x80
    raw.put(store_url, chunk.path, bytes(data))
    ckpt = ckptfmt.open(store_url)
    np.testing.assert_array_equal(ckpt.read_slice("weights", "t", (0, 0), (2, 5)), full[:2])
    with pytest.raises(DigestMismatchError):
        ckpt.read_slice("weights", "t", (1, 0), (2, 5))


def test_a_truncated_data_file_is_refused_on_read(training: str, raw: Raw) -> None:
    ckpt = ckptfmt.open(training)
    chunk = ckpt.tensor("weights", "layer0.w").chunks[0]
    raw.put(training, chunk.path, ckpt.store.read(chunk.path)[: chunk.begin + 4])
    with pytest.raises((SizeMismatchError, DigestMismatchError)) as info:
        ckptfmt.open(training).read_tensor("weights", "layer0.w")
    assert info.value.field == "weights" and info.value.tensor == "layer0.w"


def test_a_data_file_with_bytes_appended_is_refused_on_read(training: str, raw: Raw) -> None:
    ckpt = ckptfmt.open(training)
    chunk = ckpt.tensor("weights", "layer0.w").chunks[0]
    raw.put(training, chunk.path, ckpt.store.read(chunk.path) + b"polyglot tail")
    with pytest.raises(SizeMismatchError) as info:
        ckptfmt.open(training).read_tensor("weights", "layer0.w")
    assert (info.value.path, info.value.tensor) == (chunk.path, "layer0.w")


def test_a_tampered_context_blob_is_refused(training: str, raw: Raw) -> None:
    data = bytearray(ckptfmt.open_store(training).read("data/context.msgpack"))
    data[-1] ^= 0x01
    raw.put(training, "data/context.msgpack", bytes(data))
    with pytest.raises(DigestMismatchError) as info:
        ckptfmt.open(training).read_context("data")
    assert info.value.path == "data/context.msgpack" and info.value.field == "data"


def test_config_hash_mismatch(training: str, raw: Raw) -> None:
    config = {"lr": 0.5, "layers": 2}
    blob = encode({"config": config, "hash": config_hash({"lr": 0.25, "layers": 2})})
    raw.forge(training, "config/context.msgpack", blob)
    ckpt = ckptfmt.open(training)  # opening does not read blobs
    with pytest.raises(ConfigHashMismatchError) as info:
        ckpt.read_context("config")
    assert info.value.field == "config"
    assert isinstance(info.value, ContextError)


def test_a_config_with_a_matching_hash_reads(training: str, raw: Raw) -> None:
    config = {"lr": 0.5, "layers": 2, "name": "ünïcode"}
    raw.forge(training, "config/context.msgpack", encode({"config": config, "hash": config_hash(config)}))
    assert ckptfmt.open(training).read_context("config")["config"] == config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data", {"epoch": -1, "global_sample_offset": 0}),
        ("data", {"epoch": 0}),
        ("topology", {"world_size": 0}),
        ("rng", {"generators": {"g": {"state": 1}}}),
        ("provenance", {"writer": {"name": "x", "version": "1"}, "created_at": "yesterday"}),
        ("provenance", {"writer": {"name": "x", "version": "1"}, "created_at": "2026-01-01T00:00:00+01:00"}),
        ("provenance", {"writer": {"name": "x", "version": "1"}, "created_at": "2026-13-01T00:00:00Z"}),
    ],
)
def test_standard_field_rules_are_checked_on_read(training: str, raw: Raw, field: str, value: dict[str, Any]) -> None:
    raw.forge(training, f"{field}/context.msgpack", msgpack.packb(value))
    with pytest.raises(ContextError) as info:
        ckptfmt.open(training).read_context(field)
    assert info.value.field == field


def test_unknown_rng_kinds_are_preserved(store_url: str, write_training: Callable[..., str], raw: Raw) -> None:
    write_training(store_url)
    value = {"generators": {"jax": {"kind": "jax.prng_key", "state": [1, 2], "impl": "threefry"}}}
    raw.forge(store_url, "rng/context.msgpack", encode(value))
    assert ckptfmt.open(store_url).read_context("rng") == value


# ---------------------------------------------------------------- scale


def synthetic_manifest(tensors: int, chunks_per_tensor: int, chunks_per_file: int) -> dict[str, Any]:
    """A weights-profile manifest of tensors (rows x 8, F32) each split into one-row chunks."""
    digest = "xxh3-128:" + "0" * 32
    row_bytes = 8 * 4
    files: dict[str, int] = {}
    records: dict[str, Any] = {}
    n = 0
    for t in range(tensors):
        chunks = []
        for r in range(chunks_per_tensor):
            path = f"weights/r{n // chunks_per_file:05d}-00000.safetensors"
            begin = 8 + (n % chunks_per_file) * row_bytes
            files[path] = begin + row_bytes
            chunks.append(
                {
                    "path": path,
                    "key": f"layers.{t}.w@{r},0",
                    "offsets": [r, 0],
                    "shape": [1, 8],
                    "range": [begin, begin + row_bytes],
                    "digest": digest,
                    "codec": {"name": "raw"},
                }
            )
            n += 1
        records[f"layers.{t}.w"] = {"dtype": "F32", "shape": [chunks_per_tensor, 8], "chunks": chunks}
    files["provenance/context.msgpack"] = 10
    return {
        "format": "ckptfmt",
        "format_version": "1.0",
        "profile": "weights",
        "files": [{"path": p, "size": s, "digest": digest} for p, s in sorted(files.items())],
        "fields": {
            "weights": {"kind": "tensors", "tensors": records},
            "provenance": {"kind": "context", "context": {"path": "provenance/context.msgpack"}},
        },
    }


@pytest.fixture(scope="module")
def manifest_100k() -> dict[str, Any]:
    return synthetic_manifest(tensors=100, chunks_per_tensor=1000, chunks_per_file=500)


def test_a_100k_chunk_manifest_parses(manifest_100k: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    data = json.dumps(manifest_100k, sort_keys=True, separators=(",", ":")).encode()
    start = time.perf_counter()
    manifest = parse_manifest(data)
    elapsed = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n[manifest scale] {len(data) / 1e6:.1f} MB, 100,000 chunks parsed in {elapsed:.2f} s")
    weights = manifest.fields["weights"]
    assert len(weights.tensors) == 100
    assert sum(len(t.chunks) for t in weights.tensors.values()) == 100_000
    assert len(manifest.files) == 201
    chunk = weights.tensors["layers.57.w"].chunks[999]
    assert (chunk.offsets, chunk.shape, chunk.key) == ((999, 0), (1, 8), "layers.57.w@999,0")
    assert chunk.path == f"weights/r{(57 * 1000 + 999) // 500:05d}-00000.safetensors"
    assert (chunk.begin, chunk.end) == (8 + ((57 * 1000 + 999) % 500) * 32, 8 + ((57 * 1000 + 999) % 500) * 32 + 32)
    # canonical input: re-serializing the parsed records reproduces the bytes
    assert manifest.to_bytes() == data


def test_a_100k_chunk_manifest_with_one_overlap_is_refused(manifest_100k: dict[str, Any]) -> None:
    chunk = manifest_100k["fields"]["weights"]["tensors"]["layers.99.w"]["chunks"][500]
    saved, chunk["offsets"] = chunk["offsets"], [501, 0]  # for the dump only: a deep copy of 100k chunks is seconds
    try:
        data = json.dumps(manifest_100k).encode()
    finally:
        chunk["offsets"] = saved
    with pytest.raises(ChunkLayoutError) as info:
        parse_manifest(data)
    assert info.value.tensor == "layers.99.w"


def test_read_refuses_a_polyglot_data_file_without_verify(training: str, raw: Raw) -> None:
    """Bytes after the last tensor, with size and digest forged to match: read_tensor refuses (SAF-11)."""
    path = next(p for p in raw.files(training) if p.startswith("weights/") and p.endswith(".safetensors"))
    raw.forge(training, path, raw.files(training)[path] + b"<html>polyglot</html>")
    ckpt = ckptfmt.open(training)
    with pytest.raises(ckptfmt.SafetensorsHeaderError, match="after the last tensor") as info:
        ckpt.read_tensor("weights", "layer0.w")
    assert info.value.path == path


def test_read_refuses_a_header_that_disagrees_with_the_manifest(training: str, raw: Raw) -> None:
    """The header moved a tensor's shape; digests forged to match: read_tensor refuses (SAF-13)."""
    path = next(p for p in raw.files(training) if p.startswith("weights/") and p.endswith(".safetensors"))
    data = raw.files(training)[path]
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"shape":[4,3]', b'"shape":[3,4]')
    assert header != data[8 : 8 + n]
    raw.forge(training, path, data[:8] + header + data[8 + n :])
    with pytest.raises(ckptfmt.SafetensorsHeaderError, match="manifest says"):
        ckptfmt.open(training).read_tensor("weights", "layer0.b")
