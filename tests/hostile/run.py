"""Run the hostile-input harness outside pytest, for a time or for the default counts, and report per target.

    .venv/bin/python tests/hostile/run.py --seconds 3600 --json fuzz.json      # the documented longer run
    .venv/bin/python tests/hostile/run.py --json fuzz.json                     # the CI run's counts
    .venv/bin/python tests/hostile/run.py --seconds 60 --targets parse_manifest,cli_diff --seed 7
    .venv/bin/python tests/hostile/run.py --replay parse_manifest:0:1234        # one example: target:seed:example
    .venv/bin/python tests/hostile/run.py --seconds 600 --save /tmp/violations  # keep every sampled input
    .venv/bin/python tests/hostile/run.py --seconds 600 --even                  # each target the same time

Prints a table (examples, ok, library errors, violations per target) and each distinct violation with how to
replay it; ``--json`` writes the same as a document for docs/reliability.md. Exit 1 when a violation was found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, so that `hostile` imports

from hostile.campaign import DEFAULT_SEED, Campaign, dump_json, replay
from hostile.targets import all_targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, help="run for this long (default: the CI run's example counts)")
    parser.add_argument("--even", action="store_true", help="with --seconds: the same time for every target")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the default counts (without --seconds)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--targets", help="comma-separated target names (default: all)")
    parser.add_argument("--json", type=Path, help="write the per-target figures here")
    parser.add_argument("--save", type=Path, help="write each sampled violation's input under this directory")
    parser.add_argument("--replay", metavar="TARGET:SEED:EXAMPLE", help="re-run one example and print its outcome")
    args = parser.parse_args(argv)
    if args.replay:
        name, seed, example = args.replay.rsplit(":", 2)
        outcome, case = replay(name, int(seed), int(example))
        print(f"{outcome.status} {outcome.reason} {outcome.detail}\ninput: {case.summary()}")
        if case.data:
            print(f"bytes: {case.data[:2000]!r}")
        return 1 if outcome.status == "violation" else 0
    targets = all_targets()
    if args.targets:
        wanted = set(args.targets.split(","))
        unknown = wanted - {t.name for t in targets}
        if unknown:
            parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
        targets = [t for t in targets if t.name in wanted]
    campaign = Campaign(targets, seed=args.seed)
    started = time.monotonic()
    try:
        if args.seconds and args.even:
            campaign.run_each_for(args.seconds)
        elif args.seconds:
            campaign.run_for(args.seconds)
        else:
            campaign.run_counts({t.name: max(1, round(t.count * args.scale)) for t in targets})
    finally:
        summary = campaign.summary()
        summary["wall_seconds"] = round(time.monotonic() - started, 1)
        print(campaign.table())
        for stats in campaign.stats.values():
            for v in stats.samples:
                print(f"VIOLATION {v.target}: {v.outcome.detail}\n    input: {v.case.summary()}\n    {v.reproduce()}")
                if args.save:
                    print(f"    saved in {v.save(args.save)}")
        if args.json:
            dump_json(summary, args.json)
        campaign.close()
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
