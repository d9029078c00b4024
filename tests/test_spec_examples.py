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
    return out


@pytest.mark.parametrize("how", ["no-files", "version-not-a-string", "bad-digest", "negative-size"])
def test_schema_and_parser_refuse_the_same_broken_example(how: str) -> None:
    doc = _broken(json.loads(EXAMPLES[0].read_text()), how)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())
