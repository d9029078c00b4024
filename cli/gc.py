"""``ckpt gc RUN_URL``: delete what falls out of retention and what crashed writers left, by RunDirectory's rules."""

from __future__ import annotations

from typing import Any

import click

from ckptfmt.run import RunDirectory

from .errors import reports_errors
from .ls import check_run_dir, strays
from .options import json_output, storage_options
from .output import emit_json, human_bytes, info


@click.command("gc")
@click.argument("run_url")
@click.option(
    "--keep-last", type=click.IntRange(min=1), metavar="N", help="Keep the N committed checkpoints of highest step."
)
@click.option(
    "--keep-every",
    type=click.IntRange(min=1),
    metavar="N",
    help="Also keep every committed checkpoint whose step is a multiple of N.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@storage_options
@json_output
@reports_errors
def gc_cmd(
    run_url: str,
    keep_last: int | None,
    keep_every: int | None,
    dry_run: bool,
    storage_options: dict[str, Any],
    as_json: bool,
) -> None:
    """Delete checkpoints of the run directory RUN_URL that retention no longer keeps.

    Always deleted: incomplete checkpoints whose writer is gone. With --keep-last, also committed
    checkpoints beyond the N newest (by step), except multiples of --keep-every, pinned ones and the
    one `latest` points to. Never deleted: a checkpoint a live writer holds, one whose manifest is
    invalid, or one that a kept checkpoint or a live writer references (an incremental checkpoint's
    base). The same rules as `ckpt ls` and the trainer's CheckpointManager.
    """
    run = RunDirectory(run_url, storage_options)
    files = check_run_dir(run)
    plan = run.plan_retention(keep_last=keep_last, keep_every=keep_every)
    hold = plan.hold
    doomed = list(plan.doomed) if dry_run else run.collect(plan)
    kept = [e for e in run.entries() if e.name not in {d.name for d in doomed}]
    # kept only because a kept checkpoint or a live writer references them (spec/references.md REF-13)
    referenced = {name: users for name, users in plan.referenced.items() if name in {e.name for e in kept}}
    # Only what a ckptfmt writer made is deleted: an uncommitted directory holding anything else stays whole,
    # and other files in a deleted checkpoint's directory stay where they are.
    left_alone = [e for e in kept if e.status == "incomplete" and e.foreign]
    skipped = strays(files)
    if as_json:
        emit_json(
            {
                "url": run_url,
                "dry_run": dry_run,
                "deleted": [
                    {"name": e.name, "step": e.step, "status": e.status, "size": e.size, "left": list(e.foreign)}
                    for e in doomed
                ],
                "kept": [{"name": e.name, "step": e.step, "status": e.status} for e in kept],
                "left_alone": [
                    {"name": e.name, "reason": "foreign files", "foreign": list(e.foreign)} for e in left_alone
                ],
                "kept_referenced": [
                    {"name": name, "referenced_by": list(users)} for name, users in sorted(referenced.items())
                ],
                "not_followed": skipped,
                "retention_hold": hold,
            }
        )
        return
    if hold is not None:
        info(f"retention suspended: {hold}")
    verb = "would delete" if dry_run else "deleted"
    for e in doomed:
        left = f"; {len(e.foreign)} file(s) no ckptfmt writer made left in place" if e.foreign else ""
        click.echo(f"{verb} {e.name} ({e.status}, {human_bytes(e.size)}){left}")
    for e in left_alone:
        click.echo(f"left alone {e.name} (foreign files, e.g. {e.foreign[0]})")
    for name, users in sorted(referenced.items()):
        click.echo(f"kept {name} (referenced by {', '.join(users)})")
    for stray in skipped:
        info(f"not followed: {stray}")
    freed = sum(e.size for e in doomed)
    info(f"{len(doomed)} checkpoint(s) {verb}, {human_bytes(freed)}; {len(kept)} kept")
