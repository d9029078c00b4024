"""``--report FILE``: a conformance report an implementer can publish, as markdown.

Which requirement IDs pass, fail, were not run, or are untested by vectors (the process-level ones
of conformance/coverage.json, with why and the reference tests that cover them), then every failure.
"""

from __future__ import annotations

from pathlib import Path

from .results import Run

_ORDER = ("fail", "pass", "not run", "untested by vectors")


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("`", "'")


def markdown(run: Run) -> str:
    statuses = run.requirements()
    count = {s: sum(st.status == s for st in statuses.values()) for s in _ORDER}
    lines = [
        "# ckptfmt conformance report",
        "",
        f"- Suite: ckptfmt conformance {run.suite.version}, for format versions 1.0 to {run.suite.spec_version}",
        f"- Vectors: `{run.suite.digest}`",
    ]
    lines += [f"- {direction.capitalize()} under test: `{_cell(cmd)}`" for direction, cmd in run.commands.items()]
    lines += [
        f"- Vectors run: {len(run.results)}, passed {run.passed}, failed {run.failed} ({run.seconds:.0f} s)",
        f"- Requirement IDs: {len(statuses)}; " + ", ".join(f"{count[s]} {s}" for s in _ORDER),
        "",
        "## Requirements",
        "",
        "| Requirement | Status | Vectors passed | Failing vectors |",
        "| --- | --- | --- | --- |",
    ]
    for rid, st in statuses.items():
        status = f"**{st.status}**" if st.status == "fail" else st.status
        ran = f"{len(st.vectors) - len(st.failing)} of {len(st.vectors)}" if st.vectors else ""
        lines.append(f"| {rid} | {status} | {ran} | {_cell(', '.join(st.failing))} |")
    untested = [rid for rid, st in statuses.items() if st.status == "untested by vectors"]
    if untested:
        lines += [
            "",
            "## Untested by vectors",
            "",
            "No black-box vector decides these (mostly steps of a save that leave no trace in its output).",
            "The reference implementation covers them with the tests named; another implementation needs its own.",
            "",
            "| Requirement | Why | Reference tests |",
            "| --- | --- | --- |",
        ]
        for rid in untested:
            entry = run.untested[rid]
            tests = ", ".join(f"`{t}`" for t in entry.get("tests", []))
            lines.append(f"| {rid} | {_cell(str(entry.get('why', '')))} | {tests} |")
    failures = [r for r in run.results if not r.ok]
    if failures:
        lines += [
            "",
            "## Failures",
            "",
            "| Vector | Requirements | Expected | Reason | Detail |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in failures:
            detail = _cell((r.detail or r.got)[:300])
            lines.append(
                f"| {r.direction} {r.vector} | {', '.join(r.requirements)} | {r.expected} | {r.kind.label} | {detail} |"
            )
    return "\n".join(lines) + "\n"


def write_report(run: Run, path: Path) -> None:
    path.write_text(markdown(run), encoding="utf-8")
