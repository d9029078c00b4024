"""Memory-tier slots as a fuzz target (issue 23, spec/memory.md): ``read_slot``, ``find_slots``, ``rescue`` and
``ckpt rescue MEMORY_DIR RUN_URL --json``.

The memory seed (:func:`.seeds._memory`) is a memory directory holding one run's ring of two committed slots
(steps 6 and 5). The sandbox's root is the memory directory and ``dest/run`` the run directory; the seed's run
key directory and the run directory in the slots' binding are placeholders, filled in when a case runs
(:func:`materialize`). Mutants: a slot manifest's ``ckptfmt.memory.*`` metadata (absent, empty, not a string,
odd counts, another run directory, another run id or node), a torn slot (no manifest, a lock left), a slot or
the run key directory replaced by a symlink (outside, or to the other slot), a file or FIFO where a slot should
be, a foreign slot (another run directory's, under this run's key), slots swapped or at the same step, a
flipped data byte; and a hostile run directory (a symlink outside, a conflicting checkpoint at a slot's step).

Beyond the oracle's checks: ``read_slot`` never raises; rescue changes nothing under the memory directory
(every path's type and content, symlinks included), writes nothing in ``dest`` outside ``run/``, and every
checkpoint it leaves in the run directory verifies and is byte for byte a slot that verifies
(:class:`RescueBroke`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from random import Random
from typing import Any

from .mutators import Fifo, Symlink, Tree, dumps, flip_bits, json_special, mutate_tree
from .oracle import CliResult
from .seeds import RUN_DIR, RUN_KEY, seeds
from .sentinel import Sandbox, _fingerprint
from .targets import Case

PREFIX = "ckptfmt.memory."
SLOTS = ("slot-0", "slot-1")


class RescueBroke(AssertionError):
    """Rescue changed the memory directory, wrote outside the run directory, or persisted a bad slot."""


def _slot_files(tree: Tree, slot: str) -> dict[str, Any]:
    head = f"{RUN_KEY}/{slot}/"
    return {p[len(head) :]: v for p, v in tree.items() if p.startswith(head)}


def _metadata_value(rng: Random, key: str) -> Any:
    if key in ("step", "world_size"):
        return rng.choice(("", "-1", "0", "\u0663", "1e3", " 6", "6\n", "9" * 19, "9" * 20, "0" * 30 + "6", "0x6"))
    if key == "run_dir":
        return rng.choice(
            (
                RUN_DIR + "/",
                RUN_DIR + "/../run",
                RUN_DIR + "/.",
                "file://" + RUN_DIR,
                "run",
                "/elsewhere/run",
                "s3://bucket/run",
                RUN_DIR.upper(),
                "",
                RUN_DIR + "\x00",
            )
        )
    return rng.choice(("", "other", "x" * 70_000, "run-dir:/elsewhere", "node-b", "\ud800"))


def _mutate_metadata(data: bytes, rng: Random) -> bytes:
    try:
        doc = json.loads(data)
    except ValueError:  # an earlier round of mutate_memory damaged its bytes: nothing left to bind
        return data
    if not isinstance(doc, dict):
        return data
    metadata = doc.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        return data
    key = rng.choice(("run_id", "run_dir", "node", "world_size", "step"))
    op = rng.randrange(5)
    if op <= 2:
        metadata[PREFIX + key] = _metadata_value(rng, key)
    elif op == 3:
        metadata.pop(PREFIX + key, None) if rng.random() < 0.7 else doc.pop("metadata")
    else:
        metadata[PREFIX + key] = json_special(rng)
    return dumps(doc).encode("utf-8", "surrogatepass")


def mutate_memory(tree: Tree, rng: Random) -> Tree:
    out = dict(tree)
    slot = rng.choice(SLOTS)
    other = SLOTS[1 - SLOTS.index(slot)]
    head = f"{RUN_KEY}/{slot}"
    op = rng.randrange(12)
    if op <= 3:  # the binding
        manifest = out.get(f"{head}/manifest.json")
        if isinstance(manifest, bytes):
            out[f"{head}/manifest.json"] = _mutate_metadata(manifest, rng)
    elif op == 4:  # torn: no manifest, perhaps a writer's lock left
        out.pop(f"{head}/manifest.json", None)
        if rng.random() < 0.5:
            out[f"{head}/.writer-lock"] = b'{"host": "h", "nonce": "00", "pid": 999999999, "started_at": "x"}'
    elif op == 5:  # a slot, or the run key directory, as a symlink
        victim = head if rng.random() < 0.7 else RUN_KEY
        for p in [p for p in out if p.startswith(victim + "/")]:
            del out[p]
        out[victim] = Symlink(rng.choice(("sentinel-dir", other, "../" + other, "/dev/shm")))
    elif op == 6:  # something that is not a slot directory where one may be
        name = rng.choice(("slot-2", "slot-00", "slot-", "slot-x", "slot-99999999999999999999999"))
        out[f"{RUN_KEY}/{name}"] = rng.choice((b"", Fifo(), Symlink("sentinel-dir")))
        if name == "slot-00" and rng.random() < 0.5:  # or a copy of a slot under that name
            del out[f"{RUN_KEY}/{name}"]
            out.update({f"{RUN_KEY}/{name}/{p}": v for p, v in _slot_files(tree, slot).items()})
    elif op == 7:  # a foreign slot: another run directory's, under this run's key
        files = _slot_files(tree, slot)
        manifest = files.get("manifest.json")
        if isinstance(manifest, bytes):
            files["manifest.json"] = manifest.replace(RUN_DIR.encode(), b"/elsewhere/run")
        out.update({f"{RUN_KEY}/slot-3/{p}": v for p, v in files.items()})
    elif op == 8:  # the two slots' manifests swapped, or both at one step
        a, b = out.get(f"{head}/manifest.json"), out.get(f"{RUN_KEY}/{other}/manifest.json")
        if isinstance(a, bytes) and isinstance(b, bytes):
            if rng.random() < 0.5:
                out[f"{head}/manifest.json"], out[f"{RUN_KEY}/{other}/manifest.json"] = b, a
            else:
                try:  # an earlier round may have damaged either manifest: then nothing to copy
                    doc = json.loads(a)
                    doc["metadata"][PREFIX + "step"] = json.loads(b)["metadata"][PREFIX + "step"]
                except (ValueError, TypeError, KeyError):
                    return out
                out[f"{head}/manifest.json"] = json.dumps(doc).encode()
    elif op == 9:  # a data byte rotted after the commit
        path = f"{head}/weights/r00000-00000.safetensors"
        data = out.get(path)
        if isinstance(data, bytes):
            out[path] = flip_bits(data, rng)
    elif op == 10:
        out[f"{head}/manifest.json"] = rng.choice((Fifo(), Symlink("sentinel-manifest"), b""))
    else:
        out = mutate_tree(out, rng)
    return out


def make_memory_case(rng: Random) -> Case:
    tree = dict(seeds()["memory"])
    for _ in range(rng.choice((1, 1, 2))):
        tree = mutate_memory(tree, rng)
    # a later mutation may add files below a directory an earlier one made a symlink: loading them would write
    # through it into the sentinel (the harness's doing, not the code under test's)
    links = [p for p, v in tree.items() if not isinstance(v, bytes)]
    tree = {p: v for p, v in tree.items() if not any(p.startswith(link + "/") for link in links)}
    dest: Tree = {}
    roll = rng.random()
    if roll < 0.1:  # a slot's step in the run directory is a symlink outside: rescue must not write through it
        dest = {f"run/step-00000000{rng.choice('56')}": Symlink("sentinel-dir")}
    elif roll < 0.2:  # another checkpoint already at slot-0's step: a conflict, left alone
        other = seeds()["memory"]
        dest = {f"run/step-000000006/{p}": v for p, v in _slot_files(other, "slot-1").items()}
    elif roll < 0.25:
        dest = {"run/latest.json": rng.choice((Fifo(), Symlink("sentinel-file"), b"{"))}
    return Case(tree=tree, dest=dest, args=("memory",))


# ---------------------------------------------------------------- running


def run_url(box: Sandbox) -> str:
    return str(box.dest / "run")


def materialize(box: Sandbox) -> Path:
    """Fill in the placeholders: the run key directory's name and the run directory in every binding (regular
    files only, no symlink followed). Returns the run key directory."""
    from ckptfmt.tier.binding import normalize_run_url, run_dir_key

    with box.unwatched():
        return _materialize(box, run_dir_key(run_url(box)), normalize_run_url(run_url(box)).encode())


def _materialize(box: Sandbox, key_name: str, real: bytes) -> Path:
    key = box.root / key_name
    placeholder = box.root / RUN_KEY
    if placeholder.is_symlink() or placeholder.exists():
        os.rename(placeholder, key)
    for dirpath, _, filenames in os.walk(box.root):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if RUN_DIR.encode() in data:
                    path.write_bytes(data.replace(RUN_DIR.encode(), real))
    return key


def _canonical(manifest: bytes) -> str:
    """A manifest as a persist writes it (parsed and re-emitted): compare these, not the bytes."""
    return json.dumps(json.loads(manifest), sort_keys=True)


def _good_slots(key: Path) -> set[str]:
    """The manifests of the slots under ``key`` that verify where they are (real directories only)."""
    import ckptfmt

    good: set[str] = set()
    if key.is_symlink() or not key.is_dir():
        return good
    for child in key.iterdir():
        manifest = child / "manifest.json"
        if child.is_symlink() or not child.is_dir() or manifest.is_symlink() or not manifest.is_file():
            continue
        if ckptfmt.verify(str(child)).ok:
            good.add(_canonical(manifest.read_bytes()))
    return good


def _check_rescue(box: Sandbox, key: Path, before: dict[str, str], dest_before: set[str]) -> None:
    import ckptfmt

    problems = []
    after = _fingerprint(box.root)
    if after != before:
        changed = sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))
        problems.append(f"changed the memory directory: {changed[:5]}")
    outside = sorted(p for p in _fingerprint(box.dest) if p != "run" and not p.startswith("run/"))
    if outside:
        problems.append(f"wrote outside the run directory: {outside[:5]}")
    run = box.dest / "run"
    if not run.is_symlink() and run.is_dir():
        good = _good_slots(key)
        for child in sorted(run.iterdir()):
            manifest = child / "manifest.json"
            if child.name in dest_before or child.is_symlink() or not manifest.is_file():
                continue
            if not ckptfmt.verify(str(child)).ok:
                problems.append(f"persisted {child.name}, which does not verify")
            elif _canonical(manifest.read_bytes()) not in good:
                problems.append(f"persisted {child.name}, which is no slot that verifies")
    if problems:
        raise RescueBroke("; ".join(problems))


def _dest_names(box: Sandbox) -> set[str]:
    run = box.dest / "run"
    return {c.name for c in run.iterdir()} if not run.is_symlink() and run.is_dir() else set()


def rescue_api(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.tier import rescue

    assert box is not None
    key = materialize(box)
    before, dest_before = _fingerprint(box.root), _dest_names(box)
    try:
        rescue(str(box.root), run_url(box))
    finally:
        _check_rescue(box, key, before, dest_before)


def rescue_cli(case: Case, box: Sandbox | None) -> CliResult:
    from .targets import _clirunner

    assert box is not None
    key = materialize(box)
    before, dest_before = _fingerprint(box.root), _dest_names(box)
    result = _clirunner(case, box)
    _check_rescue(box, key, before, dest_before)
    return result


def slots_api(case: Case, box: Sandbox | None) -> None:
    """``find_slots`` and ``read_slot`` of every child of the run key directory: read_slot never raises."""
    from ckptfmt.errors import CheckpointError
    from ckptfmt.tier import find_slots, read_slot

    assert box is not None
    key = materialize(box)
    before = _fingerprint(box.root)
    find_slots(str(box.root), run_url(box))
    if not key.is_symlink() and key.is_dir():
        for index, child in enumerate(sorted(key.iterdir())):
            try:
                read_slot(child, index)
            except CheckpointError as exc:
                raise AssertionError(f"read_slot raised {exc!r} (it never raises for what it finds)") from exc
    if _fingerprint(box.root) != before:
        raise RescueBroke("reading slots changed the memory directory")
