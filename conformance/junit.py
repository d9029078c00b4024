"""``--junit-xml FILE``: one JUnit test case per vector, for CI systems that show per-test results.

One ``<testsuite>`` per direction (reader, writer); each case is named by its vector and requirement
IDs; a failed case has a ``<failure>`` whose type is the outcome kind, and the adapter's stdout and
stderr as ``<system-out>`` / ``<system-err>``. Text is cleaned of what XML 1.0 cannot hold.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from .results import Result, Run

# characters XML 1.0 does not allow, even escaped (control characters other than tab, LF, CR; lone surrogates)
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _text(value: str) -> str:
    return _NOT_XML.sub("\ufffd", value)


def _case(parent: ET.Element, r: Result) -> None:
    kind = r.vector.split("/", 1)[0]
    case = ET.SubElement(
        parent,
        "testcase",
        classname=f"ckptfmt-conformance.{r.direction}.{kind}",
        name=_text(r.title),
        time=f"{r.seconds:.3f}",
    )
    if r.ok:
        return
    failure = ET.SubElement(case, "failure", type=r.kind.value, message=_text(f"{r.kind.label}: {r.got}"[:500]))
    failure.text = _text(
        f"{r.vector}: expected {r.expected}, got: {r.got}\nreason: {r.kind.label}\n{r.detail}\n"
        f"exit status: {'none (no answer in time)' if r.exit_status is None else r.exit_status}"
    )
    if r.stdout:
        ET.SubElement(case, "system-out").text = _text(r.stdout)
    ET.SubElement(case, "system-err").text = _text(r.stderr)


def junit_xml(run: Run) -> bytes:
    root = ET.Element(
        "testsuites",
        name="ckptfmt-conformance",
        tests=str(len(run.results)),
        failures=str(run.failed),
        errors="0",
        time=f"{run.seconds:.3f}",
    )
    for direction, command in run.commands.items():
        results = [r for r in run.results if r.direction == direction]
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"ckptfmt-conformance.{direction}",
            tests=str(len(results)),
            failures=str(sum(not r.ok for r in results)),
            errors="0",
            skipped="0",
            time=f"{sum(r.seconds for r in results):.3f}",
        )
        props = ET.SubElement(suite, "properties")
        for key, value in [*run.suite.to_dict().items(), ("command", command)]:
            ET.SubElement(props, "property", name=key, value=_text(value))
        for r in results:
            _case(suite, r)
    ET.indent(root)
    data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data + b"\n"


def write_junit_xml(run: Run, path: Path) -> None:
    path.write_bytes(junit_xml(run))
