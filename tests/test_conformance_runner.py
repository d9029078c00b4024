"""The installed ``ckpt conformance run``: the reference passes through it, broken adapters fail it, and
its outputs (table, --json, --junit-xml, --report) say which vector and requirement failed, and why.

The reference passes every vector with its adapters answering in-process (4 s), and a selection through the
installed command with a process per call (20 s on 2 cores; every vector with ``CKPTFMT_LONG=1``, 70 s).

The judge (conformance/classify.py), the selection and the renderers are also tested directly on
hand-made results, so the failure paths are checked without running a whole suite.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from ckptfmt.cli import cli
from ckptfmt.conformance import VECTORS as PACKAGE_VECTORS
from ckptfmt.conformance import reference_writer, runner, session
from ckptfmt.conformance.classify import Exchange, Refusal, judge_invalid, judge_valid
from ckptfmt.conformance.junit import junit_xml
from ckptfmt.conformance.report import markdown
from ckptfmt.conformance.results import Kind, Result, Run, Suite
from ckptfmt.conformance.runner import TIMEOUT
from ckptfmt.conformance.suite import Vector, cached_vectors, select, tree_digest, vectors
from click.testing import CliRunner

import ckptfmt

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "conformance" / "vectors"  # the committed tree (an installed package has none)
BIN = Path(sys.executable).parent
READER = f"{BIN / 'ckpt'} dump --canonical"
WRITER = f"{sys.executable} -m ckptfmt.conformance.reference_writer"
SUITE = Suite(version="0.1.0", spec_version="1.0", vectors="/v", digest="sha256:" + "0" * 64)


def ckpt(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed command, in a process of its own, outside the repository."""
    return subprocess.run(
        [str(BIN / "ckpt"), "conformance", *args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )


def subset(tmp_path: Path, *names: str) -> Path:
    out = tmp_path / "vectors"
    for name in names:
        shutil.copytree(VECTORS / name, out / name, symlinks=True)
    return out


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return f"{sys.executable} {path}"


def counts() -> tuple[int, int]:
    """(reader vectors, writer runs) of the committed tree."""
    reader = len(list(VECTORS.glob("valid/*/about.json"))) + len(list(VECTORS.glob("invalid/*/expected.json")))
    writer = len(list(VECTORS.glob("valid/*/writer-input.json"))) + len(list(VECTORS.glob("writer/*/expected.json")))
    return reader, writer


# ---------------------------------------------------------------- the reference passes the whole suite


def in_process(cmd: list[str], *args: Path, timeout: float = TIMEOUT) -> Exchange:
    """The runner's adapter call, answered in this process by the reference reader (``ckpt dump --canonical``
    through click's runner) or writer: every vector judged without starting 300 interpreters (0.35 CPU-s each)."""
    start = time.monotonic()
    if cmd == shlex.split(READER):
        result = CliRunner().invoke(cli, ["dump", "--canonical", str(args[0])])
        status, stdout, stderr = result.exit_code, result.stdout, result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            status = 70  # an exception escaped the command: a crash to the judge, as a traceback's exit would be
    else:
        assert cmd == shlex.split(WRITER), cmd
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = reference_writer.main([str(a) for a in args])
        stdout, stderr = out.getvalue(), err.getvalue()
    argv = (*cmd, *map(str, args))
    return Exchange(argv=argv, status=status, stdout=stdout, stderr=stderr, seconds=time.monotonic() - start,
                    timeout=timeout)  # fmt: skip


def test_the_reference_reader_and_writer_pass_every_vector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every vector, both directions, judged and reported exactly as ``ckpt conformance run`` does; only the
    adapters answer in this process (``in_process``). The installed command runs a selection below."""
    monkeypatch.setattr(runner, "call", in_process)
    files = {name: tmp_path / name for name in ("results.json", "junit.xml", "report.md")}
    out, err = io.StringIO(), io.StringIO()
    options = session.Options(
        reader=READER, writer=WRITER, vectors=VECTORS, jobs=1, json_path=files["results.json"],
        junit_xml=files["junit.xml"], report=files["report.md"],
    )  # fmt: skip
    status = session.run(options, out, err)
    lines = out.getvalue().splitlines()
    reader, writer = counts()
    assert (status, lines[-1]) == (0, f"{reader + writer} passed, 0 failed"), out.getvalue() + err.getvalue()

    doc = json.loads(files["results.json"].read_text())
    assert doc["suite"]["vectors_digest"] == tree_digest(VECTORS)
    assert [r["direction"] for r in doc["results"]].count("writer") == writer
    assert {r["kind"] for r in doc["results"]} == {"passed"}
    statuses = {rid: entry["status"] for rid, entry in doc["requirements"].items()}
    coverage = json.loads((ROOT / "conformance" / "coverage.json").read_bytes())
    assert {rid for rid, s in statuses.items() if s == "untested by vectors"} == set(coverage)
    assert {s for rid, s in statuses.items() if rid not in coverage} == {"pass"}  # both directions: all decided

    cases = ET.parse(files["junit.xml"]).getroot().findall("./testsuite/testcase")
    assert len(cases) == reader + writer and not ET.parse(files["junit.xml"]).getroot().findall(".//failure")
    assert any(c.get("name") == "invalid/chunks-overlap [TEN-17]" for c in cases)

    report = files["report.md"].read_text()
    assert f"passed {reader + writer}, failed 0" in report and "**fail**" not in report
    assert "| TEN-17 | pass |" in report and "| COM-9 | untested by vectors |" in report


def through_the_command() -> list[str]:
    """What the installed command runs here: every valid vector and writer scenario, and every eighth invalid
    vector by name (34 of 268; ``tests/test_conformance.py`` refuses each in-process too). ``CKPTFMT_LONG=1``:
    every vector, about 115 CPU-seconds of adapter processes more."""
    if os.environ.get("CKPTFMT_LONG") == "1":
        return []
    invalid = sorted(p.name for p in (VECTORS / "invalid").iterdir())[::8]
    return ["valid/*", "writer/*", *(f"invalid/{name}" for name in invalid)]


@pytest.mark.slow
def test_the_reference_passes_through_the_installed_ckpt_conformance_run(tmp_path: Path) -> None:
    """The same verdicts from the installed command, each adapter call a process of its own."""
    files = {name: tmp_path / name for name in ("results.json", "junit.xml", "report.md")}
    selection = [arg for pattern in through_the_command() for arg in ("--only", pattern)]
    proc = ckpt(
        "run", "--reader", READER, "--writer", WRITER, "--vectors", str(VECTORS), *selection,
        "--json", str(files["results.json"]), "--junit-xml", str(files["junit.xml"]),
        "--report", str(files["report.md"]), cwd=tmp_path,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    first = (
        f"ckptfmt conformance suite {ckptfmt.__version__}, "
        f"for ckptfmt format versions 1.0 to {ckptfmt.FORMAT_VERSION}; vectors"
    )
    assert lines[0].startswith(first), proc.stdout[:500] + proc.stderr
    chosen = select(vectors(VECTORS), tuple(through_the_command()))
    reader = sum(v.kind != "writer" for v in chosen)
    writer = sum(bool(v.writes) for v in chosen)
    assert reader >= 37 + 34 and writer == counts()[1]
    assert (proc.returncode, lines[-1]) == (0, f"{reader + writer} passed, 0 failed"), proc.stdout + proc.stderr

    doc = json.loads(files["results.json"].read_text())
    assert {r["kind"] for r in doc["results"]} == {"passed"} and len(doc["results"]) == reader + writer
    cases = ET.parse(files["junit.xml"]).getroot().findall("./testsuite/testcase")
    assert len(cases) == reader + writer and not ET.parse(files["junit.xml"]).getroot().findall(".//failure")
    report = files["report.md"].read_text()
    assert f"passed {reader + writer}, failed 0" in report and "**fail**" not in report


# ---------------------------------------------------------------- broken adapters fail, and say why


def test_a_reader_that_accepts_everything_fails_with_a_junit_failure_per_vector(tmp_path: Path) -> None:
    cheat = script(
        tmp_path,
        "cheat.py",
        """
        import pathlib, sys
        print("looked at it", file=sys.stderr)
        expected = pathlib.Path(sys.argv[1]).parent / "expected.json"
        print(expected.read_text() if "outcome" not in expected.read_text() else "{}")
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "invalid/chunks-overlap", "invalid/symlink-file")
    proc = ckpt(
        "run", "--reader", cheat, "--vectors", str(vectors), "--junit-xml", "j.xml", "--json", "r.json",
        "--report", "r.md", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == "1 passed, 2 failed", proc.stdout + proc.stderr
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")}
    assert set(cases) == {"valid/weights [PRO-1, PRO-4, TEN-19]", "invalid/chunks-overlap [TEN-17]",
                          "invalid/symlink-file [PTH-3; also PTH-4]"}  # fmt: skip
    failure = cases["invalid/chunks-overlap [TEN-17]"].find("failure")
    assert failure is not None and failure.get("type") == "accepted-invalid"
    assert cases["invalid/chunks-overlap [TEN-17]"].findtext("system-err") == "looked at it\n"
    assert cases["valid/weights [PRO-1, PRO-4, TEN-19]"].find("failure") is None
    results = {r["vector"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results["invalid/symlink-file"]["kind"] == "accepted-invalid"
    assert results["invalid/symlink-file"]["exit_status"] == 0
    report = (tmp_path / "r.md").read_text()
    assert "| TEN-17 | **fail** | 0 of 1 | invalid/chunks-overlap |" in report
    assert "| PRO-1 | pass | 1 of 1 |  |" in report
    assert "| reader invalid/symlink-file | PTH-3 | rejected | accepted an invalid checkpoint |" in report


def test_a_writer_that_leaves_a_lock_fails_the_checks_it_breaks(tmp_path: Path) -> None:
    sloppy = script(
        tmp_path,
        "sloppy.py",
        """
        import pathlib, sys
        from ckptfmt.conformance.reference_writer import main
        code = main(sys.argv[1:])
        if code == 0:
            (pathlib.Path(sys.argv[2]) / ".writer-lock").write_text("{}")
        sys.exit(code)
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "writer/foreign-lock")
    proc = ckpt("run", "--writer", sloppy, "--vectors", str(vectors), "--json", "r.json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = {r["vector"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results["valid/weights"]["kind"] == "check-failed" and results["valid/weights"]["failed"] == ["COM-13"]
    assert results["writer/foreign-lock"]["kind"] == "passed"
    statuses = {rid: e["status"] for rid, e in json.loads((tmp_path / "r.json").read_text())["requirements"].items()}
    assert statuses["COM-13"] == "fail" and statuses["MAN-1"] == "pass" and statuses["COM-1"] == "pass"
    assert statuses["PRO-1"] == "pass"  # the vector's own IDs: its content came back right


def test_a_writer_that_crashes_on_an_input_it_must_refuse_fails_that_scenario(tmp_path: Path) -> None:
    """Writer scenarios are as strict as reader vectors: only exit status 1 is a refusal, a crash is not."""
    crash = script(
        tmp_path,
        "crash.py",
        """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    vectors = subset(tmp_path, "writer/foreign-lock")
    proc = ckpt("run", "--writer", crash, "--vectors", str(vectors), "--json", "r.json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = {r["vector"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results["writer/foreign-lock"]["kind"] == "crashed"


def test_only_and_skip_select_by_name_and_requirement_id(tmp_path: Path) -> None:
    vectors = subset(tmp_path, "valid/weights", "invalid/chunks-overlap", "invalid/symlink-file", "invalid/no-manifest")
    proc = ckpt("run", "--reader", READER, "--vectors", str(vectors), "--only", "PTH", "--only", "chunks-*",
                "--skip", "TEN-17", cwd=tmp_path)  # fmt: skip
    rows = [line.split()[0] for line in proc.stdout.splitlines()[2:-1]]
    assert (proc.returncode, rows) == (0, ["invalid/symlink-file"]), proc.stdout + proc.stderr
    nothing = ckpt("run", "--reader", READER, "--vectors", str(vectors), "--only", "XYZ-1", cwd=tmp_path)
    assert nothing.returncode == 2 and "no vector" in nothing.stderr


def test_an_adapter_that_cannot_start_or_none_at_all_is_a_usage_error(tmp_path: Path) -> None:
    vectors = subset(tmp_path, "valid/weights")
    missing = ckpt("run", "--reader", str(tmp_path / "no-such-reader"), "--vectors", str(vectors), cwd=tmp_path)
    assert missing.returncode == 2 and "cannot run" in missing.stderr
    assert ckpt("run", "--vectors", str(vectors), cwd=tmp_path).returncode == 2


def test_a_crashing_reader_with_binary_stderr_does_not_break_the_runner(tmp_path: Path) -> None:
    """A signal is a crash, not a refusal (strict protocol); the outputs show it, whatever bytes it printed."""
    crash = script(
        tmp_path,
        "crash.py",
        """
        import os, signal, sys
        sys.stderr.buffer.write(b"\\xff\\xfe\\x00\\x1b[31m boom\\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    vectors = subset(tmp_path, "valid/weights", "invalid/chunks-overlap")
    proc = ckpt("run", "--reader", crash, "--vectors", str(vectors), "--junit-xml", "j.xml", "--json", "r.json",
                cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == "0 passed, 2 failed", proc.stdout + proc.stderr
    results = {r["vector"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results["invalid/chunks-overlap"]["exit_status"] == -9
    assert results["invalid/chunks-overlap"]["kind"] == "crashed"
    assert "killed by SIGKILL" in results["invalid/chunks-overlap"]["detail"]
    assert results["valid/weights"]["kind"] == "refused-valid"
    err = ET.parse(tmp_path / "j.xml").getroot().find(".//testcase[failure]/system-err")
    assert err is not None and err.text is not None and "boom" in err.text  # control bytes replaced, XML well-formed


# ---------------------------------------------------------------- the judge, the selection, the renderers


def exchange(status: int | None, stdout: str = "", stderr: str = "") -> Exchange:
    return Exchange(argv=("r",), status=status, stdout=stdout, stderr=stderr, seconds=0.1, timeout=5)


def test_the_judge_of_invalid_vectors() -> None:
    assert judge_invalid(exchange(0, "{}"), ("TEN-17",), ()).kind is Kind.ACCEPTED_INVALID
    assert judge_invalid(exchange(None), ("TEN-17",), ()).kind is Kind.NO_ANSWER
    refused = judge_invalid(exchange(1, stderr="TEN-17: chunks overlap\nmore"), ("TEN-17",), ())
    assert refused.kind is Kind.PASSED and refused.detail == "exit status 1; stderr: 'TEN-17: chunks overlap'"
    refusal = Refusal.of(exchange(1, stderr="TEN-17: chunks overlap\r\n"))
    assert (refusal.refused_on, refusal.first_line, refusal.stdout_empty) == ("TEN-17", "TEN-17: chunks overlap", True)
    assert Refusal.of(exchange(1, stderr="\nTEN-17: chunks overlap\n")).refused_on is None  # not the first line
    assert Refusal.of(exchange(1, stderr="TEN-170x: no")).refused_on is None
    assert Refusal.of(exchange(1, stderr="error [chunk_layout]: overlap")).refused_on is None


@pytest.mark.parametrize(
    ("status", "stdout", "stderr", "kind"),
    [
        (1, "", "TEN-16: chunk outside the tensor", Kind.PASSED),  # an ID the vector names in also
        (2, "", "TEN-17: chunks overlap", Kind.CRASHED),  # right ID, wrong exit status
        (-11, "", "TEN-17: chunks overlap", Kind.CRASHED),  # a signal
        (134, "", "", Kind.CRASHED),
        (1, "", "Traceback (most recent call last):", Kind.WRONG_REASON),  # no ID
        (1, "", "error: TEN-17: chunks overlap", Kind.WRONG_REASON),  # the ID must start the line
        (1, "", "TEN-18: chunks leave a gap", Kind.WRONG_REASON),  # an ID the vector does not name
        (1, "", "TEN-1: chunks overlap", Kind.WRONG_REASON),  # TEN-1 is not TEN-17
        (1, "partial output", "TEN-17: chunks overlap", Kind.WRONG_REASON),  # stdout must be empty
        (0, "{}", "", Kind.ACCEPTED_INVALID),
    ],
)
def test_the_strict_judge(status: int, stdout: str, stderr: str, kind: Kind) -> None:
    assert judge_invalid(exchange(status, stdout, stderr), ("TEN-17",), ("TEN-16",)).kind is kind


def test_the_judge_of_valid_vectors() -> None:
    want = {"a": [1, {"b": 2}]}
    assert judge_valid(exchange(0, '{"a": [1, {"b": 2}]}'), want).kind is Kind.PASSED
    wrong = judge_valid(exchange(0, '{"a": [1, {"b": 3}]}'), want)
    assert (wrong.kind, wrong.got) == (Kind.WRONG_CONTENT, "different content: $.a[1].b differs")
    assert judge_valid(exchange(0, "not json"), want).kind is Kind.NOT_A_DESCRIPTION
    assert judge_valid(exchange(0, '{"a": 1.5}'), want).kind is Kind.NOT_A_DESCRIPTION  # floats are tagged
    assert judge_valid(exchange(2, stderr="boom"), want).kind is Kind.REFUSED_VALID
    assert judge_valid(exchange(None), want).kind is Kind.NO_ANSWER


def vector(name: str, *requirements: str) -> Vector:
    return Vector(name=name, path=Path("/nowhere") / name, requirements=requirements, also=(), doc={})


def test_selection_by_name_glob_exact_id_and_id_prefix() -> None:
    vs = [vector("valid/weights", "PRO-1"), vector("invalid/chunks-overlap", "TEN-17"), vector("invalid/x", "TEN-1")]
    names = lambda only=(), skip=(): [v.name for v in select(vs, tuple(only), tuple(skip))]  # noqa: E731
    assert names(["weights"]) == names(["valid/weights"]) == names(["valid/*"]) == ["valid/weights"]
    assert names(["TEN-1"]) == ["invalid/x"]  # a whole ID is that ID, not a prefix of TEN-17
    assert names(["TEN"]) == names(["TEN-"]) == ["invalid/chunks-overlap", "invalid/x"]
    assert names(skip=["TEN"]) == ["valid/weights"]
    assert names(["ten"]) == []  # IDs are upper case; names are not


def result(vector: str, kind: Kind, requirements: tuple[str, ...], **kw: object) -> Result:
    return Result(
        vector=vector, direction="reader", requirements=requirements, expected="rejected", got=kind.label,
        kind=kind, checked=requirements, failed=() if kind is Kind.PASSED else requirements, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_junit_json_and_report_render_the_kind_and_clean_what_xml_cannot_hold() -> None:
    run = Run(
        suite=SUITE,
        commands={"reader": "my-reader --canonical"},
        results=[
            result("invalid/a", Kind.PASSED, ("TEN-1",)),
            result(
                "invalid/b", Kind.WRONG_REASON, ("TEN-1", "TEN-2"), stderr="bad \x00\x1b byte | pipe", exit_status=1
            ),
            result("valid/c", Kind.NO_ANSWER, ("MAN-5",), detail="no answer in 5 s"),
        ],
        untested={"COM-9": {"why": "fsync | fault", "tests": ["tests/t.py::t"]}},
        known=frozenset({"TEN-1", "TEN-2", "MAN-5", "MAN-6"}),
    )
    root = ET.fromstring(junit_xml(run))
    assert (root.get("tests"), root.get("failures")) == ("3", "2")
    case = root.find(".//testcase[@name='invalid/b [TEN-1, TEN-2]']")
    assert case is not None and case.find("failure").get("type") == "refused-for-the-wrong-reason"  # type: ignore[union-attr]
    assert case.findtext("system-err") == "bad \ufffd\ufffd byte | pipe"
    assert {p.get("name"): p.get("value") for p in root.iter("property")}["command"] == "my-reader --canonical"

    doc = run.to_dict()
    assert {r["vector"]: r["kind"] for r in doc["results"]} == {
        "invalid/a": "passed", "invalid/b": "refused-for-the-wrong-reason", "valid/c": "no-answer"
    }  # fmt: skip
    assert {rid: e["status"] for rid, e in doc["requirements"].items()} == {
        "COM-9": "untested by vectors", "MAN-5": "fail", "MAN-6": "not run", "TEN-1": "fail", "TEN-2": "fail"
    }  # fmt: skip
    json.dumps(doc)

    report = markdown(run)
    assert "| TEN-1 | **fail** | 1 of 2 | invalid/b |" in report
    assert "| MAN-6 | not run |  |  |" in report
    assert "| COM-9 | fsync \\| fault | `tests/t.py::t` |" in report
    assert "| reader invalid/b | TEN-1, TEN-2 | rejected | refused for the wrong reason |" in report


# ---------------------------------------------------------------- the vectors of an installed suite


def test_an_installed_suite_generates_its_vectors_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def fake_generate(out: Path) -> None:  # the real one takes ~10 s: tests/test_conformance_install.py runs it
        calls.append(out)
        (out / "valid" / "v").mkdir(parents=True)
        (out / "valid" / "v" / ".hidden").write_text("x")

    monkeypatch.setattr("ckptfmt.conformance.generate.generate", fake_generate)
    fake_digest = "sha256:" + hashlib.sha256(b"Fvalid/v/.hidden\x001\x00x").hexdigest()  # what tree_digest gives
    monkeypatch.setattr("ckptfmt.conformance.suite.shipped_digest", lambda: fake_digest)
    first = cached_vectors(tmp_path)
    assert cached_vectors(tmp_path) == first and len(calls) == 1
    assert calls[0].parent == first.parent and calls[0] != first  # written aside, then renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    assert first.name.startswith(f"vectors-{ckptfmt.__version__}-")


def test_the_tree_digest_sees_link_targets_and_hidden_files(tmp_path: Path) -> None:
    a = subset(tmp_path / "a", "invalid/symlink-file", "valid/stray-files")
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    assert tree_digest(a) == tree_digest(b)
    link = b / "invalid" / "symlink-file" / "checkpoint" / "weights" / "r00000-00000.safetensors"
    target = link.readlink()
    link.unlink()
    link.symlink_to(str(target).replace("data", "other"))
    assert tree_digest(a) != tree_digest(b)
    shutil.rmtree(b)
    shutil.copytree(a, b, symlinks=True)
    (b / "valid" / "stray-files" / "checkpoint" / ".writer-lock").write_bytes(b"changed")
    assert tree_digest(a) != tree_digest(b)


def test_from_a_checkout_the_committed_vectors_are_used() -> None:
    from ckptfmt.conformance.suite import vectors_root

    if PACKAGE_VECTORS.is_dir():  # editable install: ckptfmt.conformance is conformance/
        assert vectors_root() == PACKAGE_VECTORS
    assert vectors_root(VECTORS) == VECTORS


# ---------------------------------------------------------------- docs


def test_every_option_of_ckpt_conformance_is_documented() -> None:
    import click

    doc = (ROOT / "docs" / "cli.md").read_text()
    group = cli.commands["conformance"]
    assert isinstance(group, click.Group)
    for name, command in group.commands.items():
        assert re.search(rf"^### `ckpt conformance {name}\b", doc, re.MULTILINE), name
        for param in command.params:
            if isinstance(param, click.Option):
                assert all(f"`{opt}" in doc for opt in param.opts if opt.startswith("--")), (name, param.opts)
