"""A lying or damaged rank against the restore across nodes: mutated holdings reports and mutated transfers.

Two thread ranks on nodes A and B (each node its own memory directory); only B's memory holds the snapshot of
step 5 (rows 5.0 and 105.0), so every restore moves B's files to A. Per case, rank 1 (B's leader and the only
sender) lies in one of two ways:

- ``report``: its holdings report (the JSON value ``ckptfmt.decide`` frames) is mutated structurally, one to three
  times, or its bytes are mutated on the wire;
- ``wire``: the messages it sends during the transfer (header, manifest, pieces) are mutated: bits flipped, cut
  short, lengthened, replaced by other JSON.

The oracle, per case:

- no rank hangs (every thread ends within ``HANG_S``; a hang is reported, never waited out);
- nothing but a :class:`ckptfmt.CheckpointError` escapes ``options()``, ``fetch()`` or the read;
- ``options()`` has the same outcome on both ranks (the same options, or the same error code);
- a rank that reads rows reads the honest ones: a lie costs a refusal, never a wrong state;
- nothing outside the two memory directories changes, and no symbolic link appears anywhere.

    .venv/bin/python tests/hostile/peer_campaign.py --cases 2000 --seed 1    # the run docs/reliability.md reports
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, when run as a script

from test_agreed_restore import Tampering, agreed_restores, only_b_holds, read_all_rows

from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError
from hostile.mutators import flip_bits, mutate_bytes, mutate_json_value

HANG_S = 60.0
HONEST_ROWS = [5.0, 105.0]
TIMEOUT_S = 20.0  # the thread group's: a refusal must come from the coordinator, long before this


@dataclass
class Tally:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"cases": self.cases, "outcomes": dict(self.outcomes), "violations": self.violations}


class LyingSender(Tampering):
    """Rank 1 whose sends (the transfer's header, manifest and pieces) pass through ``mutate`` when ``rng`` says so."""

    def __init__(self, inner: ThreadCollective, rng: Random) -> None:
        super().__init__(inner, lambda report: report)
        self.alter = None
        self.rng = rng

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        if self.rng.random() < 0.12:  # about one transfer in three arrives whole
            data = _mutate_message(data, self.rng)
        super().send(data, dst=dst, tag=tag)


def _mutate_message(data: bytes, rng: Random) -> bytes:
    choice = rng.randrange(5)
    if choice == 0:
        return flip_bits(data, rng, rng.choice((1, 1, 8)))
    if choice == 1:
        return data[: rng.randrange(len(data) + 1)]
    if choice == 2:
        return data + bytes(rng.randrange(1, 4096))
    if choice == 3:
        try:
            doc = json.loads(data)
        except ValueError:
            return mutate_bytes(data, rng)
        return json.dumps(mutate_json_value(doc, rng), default=str).encode()
    return mutate_bytes(data, rng)


def _mutate_report(report: Any, rng: Random) -> object:
    if rng.random() < 0.15:
        return mutate_bytes(json.dumps({"ok": report}).encode(), rng)
    for _ in range(rng.choice((1, 1, 2, 3))):
        report = mutate_json_value(report, rng)
    try:
        json.dumps(report)
    except (TypeError, ValueError):
        return json.dumps({"ok": report}, default=str).encode()
    return report


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` and what it is (a file's size, "dir" or "link")."""
    out: dict[str, str] = {}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = "link" if p.is_symlink() else "dir" if p.is_dir() else str(p.stat().st_size)
    return out


def run_case(work: Path, mode: str, rng: Random) -> tuple[str, str | None]:
    """One case in the empty directory ``work``: (outcome, violation or None)."""
    tiers, _ = only_b_holds(work)
    outside = {k: v for k, v in _tree(work).items() if not k.startswith(("A", "B"))}
    restores = agreed_restores(tiers, ("A", "B"), {1: lambda r: _mutate_report(r, rng)} if mode == "report" else None)
    if mode == "wire":
        liar = LyingSender(ThreadCollective(1, restores[0].collective._shared), rng)  # type: ignore[union-attr]
        restores[1].collective = restores[1].channel = liar
    for restore in restores:
        restore.collective._shared.timeout = TIMEOUT_S  # type: ignore[union-attr]
    results: list[Any] = [None, None]
    stage: list[str] = ["", ""]

    def body(rank: int) -> None:
        try:
            stage[rank] = "options"
            options = restores[rank].options()
            results[rank] = [("options", [(o.step, o.checkpoint_id) for o in options])]
            if options:
                stage[rank] = "fetch"
                results[rank].append(("rows", read_all_rows(restores[rank], options[0], 2)))
        except CheckpointError as exc:
            results[rank] = (results[rank] or []) + [("error", stage[rank], exc.code, str(exc)[:300])]
        except BaseException as exc:  # what the oracle exists to find
            results[rank] = (results[rank] or []) + [("raw", stage[rank], type(exc).__name__, str(exc)[:300])]

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    if any(t.is_alive() for t in threads):
        return "hang", f"{mode}: a rank still in {stage} after {HANG_S:g} s"
    for rank, result in enumerate(results):
        for item in result:
            if item[0] == "raw":
                return "raw", f"{mode}: rank {rank} raised {item[2]} in {item[1]}: {item[3]}"
            if item[0] == "rows" and item[1] != HONEST_ROWS:
                return "wrong", f"{mode}: rank {rank} read rows {item[1]}"
            if item[0] == "error" and "within" in item[3]:
                return "timeout", f"{mode}: rank {rank} waited out a timeout in {item[1]}: {item[3]}"
    first = [r[0] for r in results]
    if first[0] != first[1] and not (first[0][0] == first[1][0] == "error" and first[0][2] == first[1][2]):
        return "split", f"{mode}: options differ between ranks: {first}"
    after = _tree(work)
    changed = {k: v for k, v in after.items() if not k.startswith(("A", "B"))} != outside
    links = [k for k, v in after.items() if v == "link"]
    if changed or links:
        return "outside", f"{mode}: written outside the memory directories or a link made: {links or 'a change'}"
    kinds = {item[0] for result in results for item in result}
    if "rows" in kinds and "error" not in kinds:
        return "restored", None
    if "rows" in kinds:
        return "restored on one rank, refused on the other (the manager's vote passes over it)", None
    return ("refused at options" if first[0][0] == "error" else "refused at the transfer or read"), None


def run(cases: int, seed: int) -> dict[str, Tally]:
    logging.getLogger("ckptfmt").setLevel(logging.CRITICAL)  # every refusal logs a warning
    tallies = {"report": Tally(), "wire": Tally()}
    with tempfile.TemporaryDirectory(prefix="peer-campaign-") as tmp:
        for i in range(cases):
            mode = "report" if i % 2 == 0 else "wire"
            rng = Random(seed * 1_000_003 + i)
            work = Path(tmp, f"case-{i}")
            work.mkdir()
            outcome, violation = run_case(work, mode, rng)
            tally = tallies[mode]
            tally.cases += 1
            tally.outcomes[outcome] += 1
            if violation is not None:
                tally.violations.append(f"case {i} (seed {seed}): {violation}")
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tallies = run(args.cases, args.seed)
    for mode, tally in tallies.items():
        print(f"{mode}: {tally.cases} cases, {dict(tally.outcomes)}, violations: {len(tally.violations)}")
        for v in tally.violations[:20]:
            print("  " + v)
    if args.json:
        args.json.write_text(json.dumps({m: t.to_dict() for m, t in tallies.items()}, indent=2))
    return 1 if any(t.violations for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
