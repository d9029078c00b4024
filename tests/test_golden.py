"""Golden checkpoints of every released format version keep loading, with the same contents (issue 9).

See conformance/golden/README.md. The files there were written once and are never rewritten.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from crash.golden import GOLDEN, expected_of

import ckptfmt

CASES = sorted(GOLDEN.glob("*/*.expected.json"))


def test_current_format_version_has_golden_checkpoints() -> None:
    assert (GOLDEN / ckptfmt.FORMAT_VERSION).is_dir(), "a release adds its golden checkpoints (see the README)"
    assert len(CASES) >= 2


@pytest.mark.parametrize("expected_file", CASES, ids=lambda p: f"{p.parent.name}/{p.name.split('.')[0]}")
def test_golden_checkpoint_loads_verifies_and_holds_what_was_recorded(expected_file: Path, tmp_path: Path) -> None:
    expected = json.loads(expected_file.read_text())
    version = expected_file.parent.name
    url = expected_file.parent / expected_file.name.removesuffix(".expected.json")
    # A copy of the version's directory (a 1.3 delta's base is its sibling): nothing the reader does may depend on
    # (or touch) the committed files' location.
    shutil.copytree(expected_file.parent, tmp_path / version)
    copy = tmp_path / version / url.name
    report = ckptfmt.verify(str(copy))
    assert report.ok, [str(p) for p in report.problems]
    assert expected["format_version"] == version
    actual = expected_of(str(copy))
    assert actual == expected
    assert report.checkpoint_id == expected["checkpoint_id"]
