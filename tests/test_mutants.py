"""Mutation testing of the conformance suite (conformance/mutants.py): the suite must catch a reference
reader with any one refusal check disabled.

The default run takes a sample of mutants over a handful of vectors (a few seconds); the full sweep,
every mutant over every vector (minutes), runs with CKPTFMT_MUTANTS_FULL=1, or as
``python -m conformance.mutants``.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # conformance/ is a top-level directory of the repository

from conformance import VECTORS  # noqa: E402
from conformance.mutants import REDUNDANT, mutated_sources, process_rules, score, sites, sweep  # noqa: E402

SAMPLE = {  # requirement -> an invalid vector that must catch its mutant
    "TEN-17": "invalid/chunks-overlap",  # a computed ID (the layout rule of a coverage problem)
    "MAN-28": "invalid/file-missing",  # a problem verify reports, not raises
    "SAF-13": "invalid/st-key-missing",
    "CTX-12": "invalid/ctx-ndarray-trailing",
    "MAN-25": "invalid/manifest-symlink",  # disabled, the reader crashes instead: strict catches, lenient not
    "REF-7": "invalid/ref-base-replaced",  # a base beside the checkpoint (the vector's directory is its run directory)
}


def subset(tmp_path: Path, *names: str) -> Path:
    out = tmp_path / "vectors"
    for name in names:
        shutil.copytree(VECTORS / name, out / name, symlinks=True)
    return out


def test_a_mutant_disables_only_its_own_requirement() -> None:
    sources = mutated_sources("TEN-7")
    assert set(sources) >= {"ckptfmt.manifest_parse"}
    tree = ast.parse(sources["ckptfmt.manifest_parse"])  # still Python
    text = ast.unparse(tree)
    assert "requirement='TEN-7'" not in text  # its literal refusal is gone ...
    assert "requirement='TEN-15'" in text  # ... the others stay
    computed = mutated_sources("TEN-17")["ckptfmt.manifest_parse"]
    assert "!= 'TEN-17':" in computed  # a computed ID: only that ID's refusal skipped


def test_every_refusal_id_of_the_reader_has_a_mutant() -> None:
    found = sites()
    for rid in (
        "MAN-5",
        "MAN-25",
        "MAN-28",
        "DIG-2",
        "DIG-3",
        "DIG-4",
        "TEN-4",
        "TEN-17",
        "SAF-13",
        "PTH-3",
        "CTX-2",
        "REF-3",
    ):
        assert rid in found, rid


def test_rules_only_tests_can_cover_have_no_mutant() -> None:
    """BLK-5 (a partial read's block checks) and COM-21 are named in the reader's modules, but no reader vector
    makes a reader read part of a chunk or commit: coverage.json names their tests, and the sweep skips them."""
    assert {"BLK-5", "COM-21"} <= process_rules() and {"BLK-5", "COM-21"} <= set(sites())
    assert "BLK-6" not in process_rules()


def test_a_sample_of_mutants_is_caught(tmp_path: Path) -> None:
    root = subset(tmp_path, "valid/weights", *SAMPLE.values())
    base, mutants = sweep(tuple(SAMPLE), root=root, jobs=2)
    assert {kind for kind, _ in base.values()} == {"passed"}
    assert [m.requirement for m in mutants if not m.caught] == []
    for m in mutants:
        assert SAMPLE[m.requirement] in m.killed_by, (m.requirement, m.killed_by)


def test_a_mutant_no_vector_needs_survives_and_a_crash_is_caught_only_by_the_strict_protocol(tmp_path: Path) -> None:
    root = subset(tmp_path, "valid/weights", "invalid/manifest-symlink")
    _, mutants = sweep(("TEN-17", "MAN-25"), root=root, jobs=2)
    assert {m.requirement: m.caught for m in mutants} == {"TEN-17": False, "MAN-25": True}
    assert score(mutants) == (1, 0, 2)
    _, lenient = sweep(("MAN-25",), root=root, lenient=True)
    assert [m.caught for m in lenient] == [False]  # dying on the symlink counted as a refusal before issue 14


@pytest.mark.skipif(not os.environ.get("CKPTFMT_MUTANTS_FULL"), reason="full sweep: set CKPTFMT_MUTANTS_FULL=1")
def test_every_mutant_is_caught_or_provably_redundant() -> None:
    base, mutants = sweep(jobs=os.cpu_count() or 1)
    assert [name for name, (kind, _) in base.items() if kind != "passed"] == []
    survivors = [m.requirement for m in mutants if not m.caught and m.requirement not in REDUNDANT]
    assert survivors == []
    assert all(not m.caught for m in mutants if m.requirement in REDUNDANT)  # else the entry is stale
