"""The manifest parser's fast path for chunks must refuse exactly what the detailed path refuses."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.canonical import manifest_bytes
from ckptfmt.manifest_parse import parse_manifest


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    url = tmp_path_factory.mktemp("m") / "ck"
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "t", np.zeros((4, 2), np.float32)[:2], global_shape=(4, 2), offsets=(0, 0))
        w.write_tensor("weights", "t", np.ones((2, 2), np.float32), global_shape=(4, 2), offsets=(2, 0))
        w.write_context("provenance", {"created_at": "2025-01-01T00:00:00Z"})
    return dict(json.loads((url / "manifest.json").read_bytes()))


def chunk(d: dict[str, Any]) -> dict[str, Any]:
    return d["fields"]["weights"]["tensors"]["t"]["chunks"][0]  # type: ignore[no-any-return]


BAD_CHUNKS = [
    ("path", ["a"]),
    ("path", 3),
    ("path", "weights/other.safetensors"),
    ("key", ""),
    ("key", 7),
    ("offsets", [True, 0]),
    ("offsets", [0]),
    ("offsets", [-1, 0]),
    ("offsets", "00"),
    ("shape", [2, 2.5]),
    ("range", [10]),
    ("range", [10, 5]),
    ("range", [0, 10**12]),
    ("range", "0-8"),
    ("digest", "XXH3-128:" + "0" * 32),
    ("digest", "xxh3-128:" + "0" * 31),
    ("digest", None),
    ("codec", {}),
    ("codec", "raw"),
    ("codec", None),
    ("blocks", None),
    ("blocks", []),
    ("blocks", {"size": 4096}),
    ("blocks", {"size": 4096, "digests": "0" * 31}),
    ("blocks", {"size": 4095, "digests": "0" * 32}),
]


@pytest.mark.parametrize(("key", "value"), BAD_CHUNKS, ids=[f"{k}={v!r}" for k, v in BAD_CHUNKS])
def test_bad_chunk_member_is_a_manifest_error(doc: dict[str, Any], key: str, value: object) -> None:
    bad = copy.deepcopy(doc)
    chunk(bad)[key] = value
    data = json.dumps(bad).encode()
    with pytest.raises(ckptfmt.ManifestError):
        parse_manifest(data)
    with pytest.raises(ckptfmt.ManifestError):
        parse_manifest(manifest_bytes(bad))


def test_missing_chunk_member_is_a_manifest_error(doc: dict[str, Any]) -> None:
    for key in list(chunk(doc)):
        bad = copy.deepcopy(doc)
        del chunk(bad)[key]
        with pytest.raises(ckptfmt.ManifestError):
            parse_manifest(manifest_bytes(bad))


def test_raw_codec_with_configuration_is_accepted(doc: dict[str, Any]) -> None:
    ok = copy.deepcopy(doc)
    chunk(ok)["codec"] = {"name": "raw", "configuration": {}}
    assert parse_manifest(manifest_bytes(ok)).fields["weights"].tensors["t"].chunks[0].codec.name == "raw"


def test_non_canonical_manifest_is_accepted_and_duplicates_refused(doc: dict[str, Any]) -> None:
    pretty = json.dumps(doc, indent=2).encode()
    assert parse_manifest(pretty) == parse_manifest(manifest_bytes(doc))
    dup = pretty.replace(b'"profile": "weights"', b'"profile": "weights", "profile": "weights"')
    with pytest.raises(ckptfmt.ManifestError, match="duplicate"):
        parse_manifest(dup)
