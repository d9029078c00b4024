"""The spec's example manifest and JSON schema are read by tests, so neither can drift from the format.

The example must validate against the schema and be accepted by the reference parser (manifest.md's rules
beyond what a schema can say included); the schema must refuse what the parser refuses for its shape.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ckptfmt.canonical import manifest_bytes
from ckptfmt.errors import ManifestError
from ckptfmt.manifest import checkpoint_id
from ckptfmt.manifest_parse import parse_manifest

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
    elif how.startswith("references-"):  # spec/references.md: REF-1 to REF-5 as far as a schema can say them
        out = _referencing(out)
        ext = out["extensions"][0]
        base = ext["configuration"]["bases"][0]
        if how == "references-twice":
            out["extensions"].append(copy.deepcopy(ext))
        elif how == "references-not-must-understand":
            ext["must_understand"] = False
        elif how == "references-no-bases":
            ext["configuration"] = {}
        elif how == "references-location-up-two":
            base["location"] = "../../step-1"
        elif how == "references-id-uppercase":
            base["checkpoint_id"] = "sha256:" + "A" * 64
        elif how == "references-files-empty":
            base["files"] = []
    return out


def _referencing(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its first chunk referenced in the base ``../step-1`` (which holds the same file)."""
    out = copy.deepcopy(doc)
    chunk = next(t for f in out["fields"].values() for t in f.get("tensors", {}).values())["chunks"][0]
    chunk["base"] = "../step-1"
    record = next(r for r in out["files"] if r["path"] == chunk["path"])
    bases = [{"location": "../step-1", "checkpoint_id": "sha256:" + "0" * 64, "files": [dict(record)]}]
    out["extensions"] = [{"name": "ckptfmt.references", "must_understand": True, "configuration": {"bases": bases}}]
    return out


BROKEN = ["no-files", "version-not-a-string", "bad-digest", "negative-size"]
BROKEN += ["blocks-not-an-object", "blocks-size-below-4096", "blocks-size-above-2^30", "blocks-digests-uppercase"]
BROKEN += ["blocks-no-digests"]
BROKEN += ["references-twice", "references-not-must-understand", "references-no-bases", "references-location-up-two"]
BROKEN += ["references-id-uppercase", "references-files-empty"]


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


@pytest.mark.parametrize("vector", ["ref-weights", "ref-chain", "ref-zstd", "base-member-without-extension"])
def test_the_schema_accepts_the_reference_vectors(vector: str) -> None:
    """The schema's ``ckptfmt.references`` and chunk ``base`` against manifests the parser accepts; without the
    extension, ``base`` is an unknown member (VER-5)."""
    path = SPEC.parent / "conformance" / "vectors" / "valid" / vector / "checkpoint" / "manifest.json"
    jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(path.read_bytes()))
    parse_manifest(path.read_bytes())


def test_the_schema_accepts_a_referencing_example_and_refuses_a_chunk_base_that_is_no_location() -> None:
    doc = _referencing(json.loads(EXAMPLES[0].read_text()))
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    parse_manifest(json.dumps(doc).encode())
    chunk = next(t for f in doc["fields"].values() for t in f.get("tensors", {}).values())["chunks"][0]
    chunk["base"] = "step-1"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(doc).encode())


# ---------------------------------------------------------------- examples inside the spec's prose

JSON_BLOCK = re.compile(r"^```json\n(.*?)^```", re.MULTILINE | re.DOTALL)
STATED_ID = re.compile(r"checkpoint id, computed over the canonical bytes, is `(sha256:[0-9a-f]{64})`")


def _json_blocks() -> list[tuple[str, str]]:
    """Every block fenced as ``json`` in spec/*.md (fragments are fenced as ``text``)."""
    return [
        (f"{md.name}#{n}", block)
        for md in sorted(SPEC.glob("*.md"))
        for n, block in enumerate(JSON_BLOCK.findall(md.read_text()))
    ]


@pytest.mark.parametrize(("where", "block"), _json_blocks(), ids=[w for w, _ in _json_blocks()])
def test_every_json_block_in_the_spec_is_json_and_every_manifest_in_one_is_valid(where: str, block: str) -> None:
    doc = json.loads(block)
    if isinstance(doc, dict) and doc.get("format") == "ckptfmt":
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
        parse_manifest(manifest_bytes(doc))


def test_the_manifest_chapter_states_its_examples_checkpoint_id() -> None:
    text = (SPEC / "manifest.md").read_text()
    example = text.split("## Example", 1)[1]
    stated = STATED_ID.search(example)
    assert stated is not None, "manifest.md's example no longer states its checkpoint id"
    (block,) = JSON_BLOCK.findall(example)
    assert checkpoint_id(manifest_bytes(json.loads(block))) == stated.group(1)
