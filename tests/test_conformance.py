"""The conformance suite against the reference implementation, and proof that it can fail.

Both directions run through ``python -m conformance run`` in a subprocess, as another team's CI
would: the reader is ``ckpt dump --canonical``, the writer ``python -m conformance.reference_writer``.
Deliberately broken adapters (a reader that accepts everything, one that misreports a digest, a
writer that writes a non-canonical manifest) must make the runner fail.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptfmt.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # conformance/ is a top-level directory of the repository, not a package of ckptfmt

from ckptfmt.cli import cli  # noqa: E402

from ckptfmt.description import canonical_description, context_json  # noqa: E402
from conformance import VECTORS  # noqa: E402

BIN = Path(sys.executable).parent
READER = f"{BIN / 'ckpt'} dump --canonical"
WRITER = f"{sys.executable} -m conformance.reference_writer"
SUMMARY = r"^(\d+) passed, (\d+) failed$"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def summary(proc: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    import re

    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(SUMMARY, last)
    assert m, last
    return int(m.group(1)), int(m.group(2))


def subset(tmp_path: Path, *names: str) -> Path:
    """A vector tree holding only the named vectors (e.g. 'valid/weights'), for the quick negative runs."""
    out = tmp_path / "vectors"
    for name in names:
        shutil.copytree(VECTORS / name, out / name, symlinks=True)
    return out


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return f"{sys.executable} {path}"


# ---------------------------------------------------------------- the reference passes


# The reference reader and writer pass the whole suite: tests/test_conformance_runner.py runs it, both
# directions, through the installed `ckpt conformance run` (once is enough: it is the costliest test here).


# ---------------------------------------------------------------- the runner can fail


def test_a_reader_that_accepts_everything_fails(tmp_path: Path) -> None:
    cheat = script(
        tmp_path,
        "cheat.py",
        """
        import sys, pathlib
        expected = pathlib.Path(sys.argv[1]).parent / "expected.json"
        print(expected.read_text() if "outcome" not in expected.read_text() else "{}")
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "invalid/chunks-overlap", "invalid/st-trailing-bytes")
    proc = run("run", "--reader", cheat, "--vectors", str(vectors))
    assert summary(proc) == (1, 2) and proc.returncode == 1
    assert "invalid/chunks-overlap" in proc.stdout and "FAIL" in proc.stdout


def test_a_reader_that_misreports_a_digest_fails(tmp_path: Path) -> None:
    liar = script(
        tmp_path,
        "liar.py",
        """
        import json, sys
        from ckptfmt.description import canonical_description, refusal_line
        from ckptfmt.errors import CheckpointError
        try:
            doc = canonical_description(sys.argv[1])
        except CheckpointError as exc:  # refuses as the strict protocol says
            sys.exit(refusal_line(exc))
        tensors = doc["fields"]["weights"]["tensors"]
        first = sorted(tensors)[0]
        tensors[first]["digest"] = "sha256:" + "0" * 64
        print(json.dumps(doc))
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "valid/dtypes-all", "invalid/no-manifest")
    proc = run("run", "--reader", liar, "--vectors", str(vectors))
    assert summary(proc) == (1, 2) and proc.returncode == 1  # it still refuses the incomplete one
    assert "different content: $.fields.weights.tensors.e.digest differs" in proc.stdout


def test_a_writer_with_a_non_canonical_manifest_and_a_leftover_lock_fails(tmp_path: Path) -> None:
    sloppy = script(
        tmp_path,
        "sloppy.py",
        """
        import json, sys, pathlib
        from conformance.reference_writer import main
        code = main(sys.argv[1:])
        root = pathlib.Path(sys.argv[2])
        if code == 0:
            manifest = root / "manifest.json"
            manifest.write_text(json.dumps(json.loads(manifest.read_bytes()), indent=1))
            (root / ".writer-lock").write_text("{}")
        sys.exit(code)
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "writer/foreign-lock")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--writer", sloppy, "--vectors", str(vectors)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert summary(proc) == (1, 1) and proc.returncode == 1, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("valid/weights"))
    assert "MAN-1: manifest.json is not in canonical form" in row and "COM-13" in row and row.endswith("FAIL")


# ---------------------------------------------------------------- traceability and determinism


def test_every_requirement_is_covered_and_every_named_id_exists() -> None:
    from conformance.traceability import trace

    result = trace()
    assert result.problems == []
    assert len(result.spec) == 212  # 202 up to 1.2; of 1.3, TRE-1 to TRE-3 (tree digests), DLT-1 to DLT-7 (delta)
    assert result.by_tests == {
        "BLK-5",
        "DLT-6",
        "DLT-7",
        "FLD-14",
        "REF-13",
        "REF-14",
        "COM-17",
        "COM-18",
        "COM-19",
        "COM-20",
        "COM-21",
        "COM-22",
        "COM-23",
        "COM-24",
        "COM-25",
        "MEM-2",
        "MEM-4",
        "MEM-5",
        "MEM-6",
        "MEM-7",
        "MEM-8",
        "MEM-10",
        "MEM-11",
        "MEM-12",
        "MEM-13",
        "MEM-14",
        "MEM-15",
        "MEM-18",
        "MEM-19",
        "MEM-16",
        "MEM-17",
        "PTH-5",
        "SAF-17",
        "COM-3",
        "COM-4",
        "COM-5",
        "COM-6",
        "COM-7",
        "COM-8",
        "COM-9",
        "COM-10",
        "COM-11",
        "COM-12",
    }


def test_traceability_fails_on_an_uncovered_or_unknown_id(tmp_path: Path) -> None:
    from conformance import COVERAGE
    from conformance.traceability import trace

    vectors = tmp_path / "vectors"
    shutil.copytree(VECTORS, vectors, symlinks=True)
    bad = vectors / "invalid" / "ctx-not-map" / "expected.json"
    doc = json.loads(bad.read_bytes())
    doc["requirements"] = ["TEN-99"]
    bad.write_text(json.dumps(doc))
    coverage = json.loads(COVERAGE.read_bytes())
    del coverage["COM-9"]
    coverage["MAN-5"] = {"tests": ["tests/test_conformance.py::no_such_test"], "why": "?"}
    (tmp_path / "coverage.json").write_text(json.dumps(coverage))
    problems = trace(vectors, tmp_path / "coverage.json").problems
    assert "invalid/ctx-not-map names TEN-99, which the spec does not have" in problems
    assert "CTX-1 has no vector, no writer check and no coverage.json entry" in problems
    assert "COM-9 has no vector, no writer check and no coverage.json entry" in problems
    assert "coverage.json lists MAN-5, but a vector or writer check covers it" in problems
    assert "coverage.json MAN-5: no test tests/test_conformance.py::no_such_test" in problems


def _tree(root: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = b"symlink -> " + str(path.readlink()).encode()
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def test_regenerating_the_vectors_gives_byte_identical_files(tmp_path: Path) -> None:
    proc = run("generate", "--out", str(tmp_path / "vectors"))
    assert proc.returncode == 0, proc.stderr
    fresh, committed = _tree(tmp_path / "vectors"), _tree(VECTORS)
    assert sorted(fresh) == sorted(committed)
    assert [p for p in fresh if fresh[p] != committed[p]] == []


def test_the_vector_set_stays_small() -> None:
    total = sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file() and not p.is_symlink())
    assert total < 3 << 20


# ---------------------------------------------------------------- the adapters


def test_dump_prints_the_expected_description() -> None:
    vector = VECTORS / "valid" / "context-values"
    result = CliRunner().invoke(cli, ["dump", "--canonical", str(vector / "checkpoint")])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n").encode() == (vector / "expected.json").read_bytes()


@pytest.mark.parametrize(
    ("vector", "rid", "code"),
    [
        ("no-manifest", "COM-15", "incomplete"),
        ("chunks-overlap", "TEN-17", "chunk_layout"),
        ("st-trailing-bytes", "SAF-11", "safetensors_header"),
        ("config-hash-mismatch", "FLD-9", "config_hash_mismatch"),
        ("manifest-symlink", "MAN-25", "unsafe_path"),
        ("symlink-file", "PTH-3", "unsafe_path"),
        ("file-missing", "MAN-28", "missing_file"),
        ("ref-base-replaced", "REF-7", "base_checkpoint"),
    ],
)
def test_dump_refuses_under_the_strict_protocol(vector: str, rid: str, code: str) -> None:
    """Exit 1, nothing on stdout, stderr's first line '<ID>: [<code>] ...' (conformance/README.md)."""
    result = CliRunner().invoke(cli, ["dump", "--canonical", str(VECTORS / "invalid" / vector / "checkpoint")])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines()[0].startswith(f"{rid}: [{code}] ")


def test_writer_inputs_round_trip_through_the_description_mapping() -> None:
    from conformance.values import load, to_context

    doc = load((VECTORS / "valid" / "context-values" / "writer-input.json").read_bytes())
    state = doc["fields"]["state"]["context"]
    expected = json.loads((VECTORS / "valid" / "context-values" / "expected.json").read_bytes())
    assert context_json(to_context(state)) == expected["fields"]["state"]["context"]


@pytest.mark.parametrize("vector", sorted(p.name for p in (VECTORS / "invalid").iterdir()))
def test_the_reference_refuses_each_invalid_vector_with_a_checkpoint_error(vector: str) -> None:
    """Not a crash: every refusal is a CheckpointError with a code (the runner only sees the exit status)."""
    with pytest.raises(CheckpointError) as info:
        canonical_description(VECTORS / "invalid" / vector / "checkpoint")
    assert info.value.code not in ("checkpoint_error", "storage", "usage")


INVALID = sorted(p.name for p in (VECTORS / "invalid").iterdir())
REQUIREMENT_LINE = re.compile(r"^([A-Z]+-[0-9]+): \[[a-z_]+\] ")


def test_the_adapter_names_a_requirement_of_the_vector_on_every_invalid_vector() -> None:
    """Issue 43: through the reference adapter (``ckpt dump --canonical``), every invalid vector is refused
    with exit 1, nothing on stdout, and a first stderr line naming one of the requirements the vector lists
    (spec/README.md, "Which ID a refusal names"); a refusal without an ID would be ``refused-valid`` or
    ``crashed`` for the runner, as N17's 'floating-point number' refusal was."""
    wrong = []
    for name in INVALID:
        vector = VECTORS / "invalid" / name
        expected = json.loads((vector / "expected.json").read_bytes())
        allowed = set(expected["requirements"]) | set(expected.get("also", []))
        result = CliRunner().invoke(cli, ["dump", "--canonical", str(vector / "checkpoint")])
        first = (result.stderr.splitlines() or [""])[0]
        named = REQUIREMENT_LINE.match(first)
        if result.exit_code != 1 or result.stdout or named is None or named.group(1) not in allowed:
            wrong.append((name, result.exit_code, first[:120], sorted(allowed)))
    assert len(INVALID) >= 274
    assert wrong == []


def test_the_adapter_accepts_a_fraction_in_an_unknown_member_and_names_blk1_for_a_fractional_size() -> None:
    """N17 both ways: MAN-2 and VER-5 keep a reader from refusing an unknown member's number; a property
    defined as an integer refuses 4096.0 under its own rule."""
    valid = VECTORS / "valid" / "unknown-member-fraction"
    result = CliRunner().invoke(cli, ["dump", "--canonical", str(valid / "checkpoint")])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n").encode() == (valid / "expected.json").read_bytes()
    invalid = VECTORS / "invalid" / "blocks-size-fraction" / "checkpoint"
    result = CliRunner().invoke(cli, ["dump", "--canonical", str(invalid)])
    assert result.exit_code == 1
    assert result.stderr.startswith("BLK-1: [invalid_manifest] ")


def test_the_blob_walk_finds_float32_and_non_canonical_bigints() -> None:
    from conformance.msgpack_scan import encoding_problems

    blob = (VECTORS / "valid" / "context-encodings" / "checkpoint" / "state" / "context.msgpack").read_bytes()
    assert [rid for rid, _ in encoding_problems(blob)] == ["CTX-8", "CTX-8"]
    for name in ("ctx-bigint-not-minimal", "ctx-bigint-in-range"):
        blob = (VECTORS / "invalid" / name / "checkpoint" / "notes" / "context.msgpack").read_bytes()
        assert [rid for rid, _ in encoding_problems(blob)] == ["CTX-10"]
    written = (VECTORS / "valid" / "context-values" / "checkpoint" / "state" / "context.msgpack").read_bytes()
    assert encoding_problems(written) == []


def test_a_requirement_named_by_a_refusal_is_one_the_vector_names() -> None:
    """Every refusal of the reference reader names the rule it refused on (CheckpointError.requirement),
    and that rule is among the vector's requirements or also: what the strict protocol asks of a reader."""
    wrong = []
    for vector in sorted((VECTORS / "invalid").iterdir()):
        expected = json.loads((vector / "expected.json").read_bytes())
        allowed = set(expected["requirements"]) | set(expected.get("also", []))
        with pytest.raises(CheckpointError) as info:
            canonical_description(vector / "checkpoint")
        if info.value.requirement not in allowed:
            wrong.append((vector.name, info.value.requirement, sorted(allowed)))
    assert wrong == []


def test_the_writer_checks_catch_a_wrong_block_digest_and_a_wrong_version(tmp_path: Path) -> None:
    """BLK-4 and VER-1 as writer checks, in process, on the reference writer's blocks vector tampered with."""
    from ckptfmt.canonical import manifest_bytes
    from conformance.writer_checks import run_checks

    root = tmp_path / "out"
    shutil.copytree(VECTORS / "valid" / "blocks" / "checkpoint", root)
    assert run_checks(root, "") == []
    doc = json.loads((root / "manifest.json").read_bytes())
    blocks = doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]["blocks"]
    blocks["digests"] = "0" * 32 + blocks["digests"][32:]
    doc["format_version"] = "1.0"
    (root / "manifest.json").write_bytes(manifest_bytes(doc))
    problems = run_checks(root, "")
    assert [rid for rid, _ in problems] == ["VER-1", "BLK-4"], problems
    assert "block 0" in problems[1][1] and "'1.2'" in problems[0][1]


def test_the_writer_checks_catch_a_chained_an_unused_and_a_mismatched_reference(tmp_path: Path) -> None:
    """REF-11 and REF-12 as writer checks, in process, on the reference writer's chain vector tampered with."""
    from ckptfmt.canonical import manifest_bytes
    from conformance.invalid_references import add_base_file, chain_through_step2
    from conformance.mutations import Tree
    from conformance.writer_checks import run_checks

    run = tmp_path / "run"
    shutil.copytree(VECTORS / "valid" / "ref-chain", run, symlinks=True)  # the checkpoint and its bases
    root = run / "checkpoint"
    assert run_checks(root, "") == []
    chain_through_step2(Tree(root))  # a, stored in step-1, referenced at step-2
    problems = run_checks(root, "")
    assert {rid for rid, _ in problems} == {"REF-11"}, problems
    assert "the base does not store it itself" in problems[0][1]

    shutil.rmtree(run)
    shutil.copytree(VECTORS / "valid" / "ref-chain", run, symlinks=True)
    add_base_file("provenance/context.msgpack")(Tree(root))  # a base file no chunk lives in
    doc = json.loads((root / "manifest.json").read_bytes())
    tensors = doc["fields"]["frozen"]["tensors"]
    tensors["a2"] = tensors.pop("a")  # the base's chunk of tensor a, for a tensor a2
    (root / "manifest.json").write_bytes(manifest_bytes(doc))
    problems = run_checks(root, "")
    assert [rid for rid, _ in problems] == ["REF-11", "REF-12"], problems
    assert "lists provenance/context.msgpack" in problems[0][1] and "of frozen/a2" in problems[1][1]
