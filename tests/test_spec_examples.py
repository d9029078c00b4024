"""The spec's example manifest and JSON schema are read by tests, so neither can drift from the format.

The example must validate against the schema and be accepted by the reference parser (manifest.md's rules
beyond what a schema can say included); the schema must refuse what the parser refuses for its shape.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ckptfmt.errors import ManifestError
from ckptfmt.manifest import parse_manifest

SPEC = Path(__file__).resolve().parent.parent / "spec"
SCHEMA = json.loads((SPEC / "schema" / "manifest.schema.json").read_text())
EXAMPLES = sorted((SPEC / "examples").glob("*.json"))


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_validates_and_parses(path: Path) -> None:
    doc = json.loads(path.read_text())
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    manifest = parse_manifest(path.read_bytes())
    assert set(manifest.fields) == set(doc["fields"])


def _broken(doc: dict[str, Any], how: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    if how == "no-files":
        del out["files"]
    elif how == "version-not-a-string":
        out["format_version"] = 1.0
    elif how == "bad-digest":
        out["files"][0]["digest"] = "md5:00"
    elif how == "negative-size":
        out["files"][0]["size"] = -1
    elif how.startswith("blocks-"):  # spec/blocks.md: BLK-1, BLK-2 as far as a schema can say them
        chunk = next(t for f in out["fields"].values() for t in f.get("tensors", {}).values())["chunks"][0]
        digits = len(chunk["digest"].partition(":")[2])
        chunk["blocks"] = {
            "blocks-not-an-object": "0" * digits,
            "blocks-size-below-4096": {"size": 2048, "digests": "0" * digits},
            "blocks-size-above-2^30": {"size": 1 << 31, "digests": "0" * digits},
            "blocks-digests-uppercase": {"size": 4096, "digests": "A" * digits},
            "blocks-no-digests": {"size": 4096},
        }[how]
    return out


BROKEN = ["no-files", "version-not-a-string", "bad-digest", "negative-size"]
BROKEN += ["blocks-not-an-object", "blocks-size-below-4096", "blocks-size-above-2^30", "blocks-digests-uppercase"]
BROKEN += ["blocks-no-digests"]


@pytest.mark.parametrize("how", BROKEN)
def test_schema_and_parser_refuse_the_same_broken_example(how: str) -> None:
    doc = _broken(json.loads(EXAMPLES[0].read_text()), how)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())


@pytest.mark.parametrize("vector", ["blocks", "blocks-sha256", "blocks-edge-cases"])
def test_the_schema_accepts_the_block_digest_vectors(vector: str) -> None:
    """The schema's ``blocks`` (format 1.2) against manifests the parser accepts (conformance/vectors)."""
    path = SPEC.parent / "conformance" / "vectors" / "valid" / vector / "checkpoint" / "manifest.json"
    jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(path.read_bytes()))
    parse_manifest(path.read_bytes())
