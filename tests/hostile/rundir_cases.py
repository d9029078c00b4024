"""A run directory's pointer files as a fuzz target (issue 23): ``latest.json`` and ``pins.json``.

Mutants of the run seed (:func:`.seeds._run_dir`: committed ``step-000000001`` pinned, ``step-000000002``
latest) where only the pointer files change: their JSON, documents of the right shape naming odd things, a file
over the size bound, and in their place a symlink (to a sentinel outside, to ``../latest.json`` beside the
root, to a file inside), a FIFO, a socket or a directory. Read by ``RunDirectory`` (``entries``, ``latest``,
``pinned``, ``retention_hold``, ``gc``), ``ckpt ls`` and ``ckpt gc``.

Beyond the oracle's checks (the sandbox sees a read through a symlink out, a FIFO's hang is a timeout):

- listing never depends on a pointer: both committed checkpoints are listed, committed, whatever the files say;
- ``latest()`` is a hint: it never raises;
- gc deletes a committed checkpoint only where an independent reading of the pointer files allows it: outside
  ``keep_last``, not pinned, not latest, and only when both files are absent or readable as their documented
  shape (an unreadable one holds retention). :class:`LostCheckpoint` otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from random import Random
from typing import Any

from .mutators import Fifo, Socket, Symlink, Tree, dumps, json_special, mutate_json
from .oracle import CliResult
from .seeds import seeds
from .sentinel import Sandbox
from .targets import Case

LATEST, PINS = "latest.json", "pins.json"
COMMITTED = ("step-000000001", "step-000000002")  # oldest first: keep_last=1 keeps the second


class LostCheckpoint(AssertionError):
    """gc deleted a committed checkpoint that the pointer files (or their being unreadable) protect."""


def _documents(rng: Random, which: str) -> Any:
    if which == LATEST:
        return rng.choice(
            (
                {"name": "step-000000001", "step": 1},
                {"name": "step-000000001"},
                {"name": "../step-000000001", "step": 1},
                {"name": "step-000000001/", "step": 1},
                {"name": "", "step": 2},
                {"name": ".", "step": 2},
                {"name": "notes", "step": 2},
                {"name": "/step-000000002", "step": 2},
                {"name": "step-000000002", "step": -1},
                {"name": "step-000000002", "step": 2**64},
                {"name": "step-000000002", "step": True},
                {"name": "step-000000002", "step": "2"},
                {"name": ["step-000000002"], "step": 2},
                {"name": "step-000000002", "checkpoint_id": 7},
                {"name": "step-000000002", "step": 2, "checkpoint_id": "sha256:" + "0" * 64},
                {"step": 2},
                ["step-000000002"],
                "step-000000002",
                None,
            )
        )
    return rng.choice(
        (
            {"pinned": []},
            {"pinned": ["step-000000002"]},
            {"pinned": "step-000000001"},
            {"pinned": [["step-000000001"]]},
            {"pinned": ["step-000000001", 1]},
            {"pinned": ["../step-000000001", "step-000000001/"]},
            {"pinned": None},
            {"pinned": {"step-000000001": True}},
            {"pins": ["step-000000001"]},
            {"pinned": ["step-000000001"] * 1000},
            ["step-000000001"],
            {},
        )
    )


def mutate_pointers(tree: Tree, rng: Random) -> Tree:
    out = dict(tree)
    for which in rng.choice(((LATEST,), (PINS,), (LATEST, PINS))):
        op = rng.randrange(10)
        current = out.get(which)
        if op <= 2 and isinstance(current, bytes):
            out[which] = mutate_json(current, rng)
        elif op <= 4:
            out[which] = json.dumps(_documents(rng, which)).encode()
        elif op == 5:
            value = json.dumps(_documents(rng, which)).encode()
            out[which] = rng.choice(
                (
                    b" " * ((1 << 20) + 1) + value,  # over the size bound
                    b"\xef\xbb\xbf" + value,
                    value.decode().encode("utf-16"),
                    value + b"\x00",
                    b"",
                    b"\xff\xfe",
                    dumps({"name": json_special(rng), "pinned": json_special(rng)}).encode("utf-8", "surrogatepass"),
                )
            )
        elif op == 6:
            out.pop(which, None)
        elif op == 7:
            target = rng.choice(
                ("sentinel-file", "sentinel-manifest", "dev-zero", "../" + which, "step-000000001/manifest.json")
            )
            out[which] = Symlink(target)
        elif op == 8:
            out[which] = rng.choice((Fifo(), Socket()))
        else:
            out.pop(which, None)
            out[f"{which}/x"] = b"{}"  # a directory by that name
    return out


def make_pointer_case(rng: Random) -> Case:
    tree = mutate_pointers(dict(seeds()["run"]), rng)
    return Case(tree=tree, args=("run",))


# ---------------------------------------------------------------- the oracle's model of the pointer files


def _read(tree: Tree, name: str) -> tuple[bool, Any]:
    """(readable, document): absent is readable (None); anything but a small JSON file is not."""
    node = tree.get(name)
    if node is None and not any(p.startswith(name + "/") for p in tree):
        return True, None
    if not isinstance(node, bytes) or len(node) > 1 << 20:
        return False, None
    try:
        return True, json.loads(node)
    except (ValueError, RecursionError):
        return False, None


def deletable(tree: Tree, keep_last: int | None) -> set[str]:
    """The committed checkpoints gc may delete, read independently of ckptfmt.run (permissively: a file this
    model reads that the library refuses only makes the library keep more)."""
    if keep_last is None:
        return set()
    ok_latest, latest = _read(tree, LATEST)
    ok_pins, pins = _read(tree, PINS)
    if ok_latest and latest is not None:
        name = latest.get("name") if isinstance(latest, dict) else None
        step = latest.get("step") if isinstance(latest, dict) else None
        ckpt_id = latest.get("checkpoint_id") if isinstance(latest, dict) else None
        ok_latest = (
            isinstance(name, str)
            and (step is None or type(step) is int)
            and (ckpt_id is None or isinstance(ckpt_id, str))
        )
    if ok_pins and pins is not None:
        pinned = pins.get("pinned") if isinstance(pins, dict) else None
        ok_pins = isinstance(pinned, list) and all(isinstance(p, str) for p in pinned)
    if not (ok_latest and ok_pins):
        return set()
    keep = set(COMMITTED[len(COMMITTED) - keep_last :]) if keep_last else set()
    keep |= set(pins["pinned"]) if pins is not None else set()
    keep |= {latest["name"]} if latest is not None else set()
    return set(COMMITTED) - keep


def _committed_now(root: Path) -> set[str]:
    return {name for name in COMMITTED if (root / name / "manifest.json").is_file()}


def _check_gc(case: Case, root: Path, keep_last: int | None) -> None:
    lost = set(COMMITTED) - _committed_now(root) - deletable(case.tree, keep_last)
    if lost:
        raise LostCheckpoint(f"gc deleted committed {sorted(lost)} (keep_last={keep_last})")


def _check_listing(root: Path) -> None:
    from ckptfmt.run import RunDirectory

    run = RunDirectory(str(root))
    listed = {e.name: e.status for e in run.entries()}
    missing = [n for n in COMMITTED if listed.get(n) != "committed"]
    if missing:
        raise AssertionError(f"entries() lost committed {missing} over a pointer file: {listed}")
    run.latest()  # a hint: never raises


def run_directory(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.errors import CheckpointError
    from ckptfmt.run import RunDirectory

    assert box is not None
    _check_listing(box.root)
    run = RunDirectory(str(box.root))
    for call in (run.pinned, run.read_latest):
        try:
            call()
        except CheckpointError:
            pass
    run.retention_hold()
    run.plan_gc(keep_last=1)
    run.gc(keep_last=1)
    _check_gc(case, box.root, 1)


def cli_checked(keep_last: Callable[[Case], int | None] | None) -> Callable[[Case, Sandbox | None], CliResult]:
    """The CLI through CliRunner, then the gc check (``keep_last`` from the case's arguments) or none (ls)."""

    def run(case: Case, box: Sandbox | None) -> CliResult:
        from .targets import _clirunner

        assert box is not None
        result = _clirunner(case, box)
        if keep_last is not None:
            _check_gc(case, box.root, keep_last(case))
        return result

    return run


def keep_last_of(case: Case) -> int | None:
    args = list(case.args)
    if "--dry-run" in args:
        return None
    return int(args[args.index("--keep-last") + 1]) if "--keep-last" in args else None
