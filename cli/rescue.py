"""``ckpt rescue MEMORY_DIR RUN_URL``: persist what dead workers left in node memory (ckptfmt.tier.rescue)."""

from __future__ import annotations

import os
from typing import Any

import click

from ckptfmt.errors import UsageError
from ckptfmt.tier import rescue
from ckptfmt.tier.rescue import NOT_RESCUED

from .errors import reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, info


@click.command("rescue")
@click.argument("memory_dir", type=click.Path(file_okay=False))
@click.argument("run_url")
@storage_options
@json_output
@reports_errors
def rescue_cmd(memory_dir: str, run_url: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """Persist the memory snapshots of RUN_URL found under MEMORY_DIR as ordinary checkpoints of RUN_URL.

    Each committed slot of that run directory is read with the peer copies beside it (the files other nodes
    replicated here), verified whole, then copied byte for byte (same checkpoint id) as step-<STEP>, unless
    the run directory already has it. A snapshot whose files are partly on other nodes only is partial; a
    destination that is a symlink is refused; torn, corrupt and other runs' slots are reported and left
    alone; nothing in MEMORY_DIR is deleted. Exits 1 when a committed slot was partial, corrupt, refused or
    could not be written.
    """
    if not os.path.isdir(memory_dir):
        raise UsageError("is not a directory", path=memory_dir)
    outcomes = rescue(memory_dir, run_url, storage_options)
    ok = not any(o.status in NOT_RESCUED for o in outcomes)
    if as_json:
        emit_json({"memory_dir": memory_dir, "run": run_url, "ok": ok, "slots": [o.to_dict() for o in outcomes]})
    else:
        for o in outcomes:
            where = o.slot.path
            if o.copies:
                where += f" + {len(o.copies)} peer cop{'y' if len(o.copies) == 1 else 'ies'}"
            if o.persisted is not None:
                size = human_bytes(o.persisted.bytes)
                click.echo(f"{o.status} step {o.persisted.step} from {where} -> {o.persisted.destination} ({size})")
            else:
                click.echo(f"{o.status} {where}: {o.detail}")
        info(f"{sum(o.status == 'persisted' for o in outcomes)} persisted, {len(outcomes)} slot(s) found")
    if not ok:
        raise SystemExit(1)
