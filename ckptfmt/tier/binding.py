"""Who a memory snapshot belongs to: the run, the node and the step, as the slot manifest's metadata.

A memory slot outlives the process that wrote it (that is its purpose), so the next process that finds
it must be able to tell whose it is before using it: a restore takes a slot only when its run identity
and node are this process's own (spec/memory.md MEM-5). The binding is written in the manifest's
``metadata`` (strings), so it is covered by the checkpoint id, and a persisted copy carries it along.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ManifestError

PREFIX = "ckptfmt.memory."
NODE_KEY_ENV = "CKPTFMT_NODE_KEY"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_key() -> str:
    """This node: ``$CKPTFMT_NODE_KEY`` when set, else the host name and boot id (a rebooted host is
    another node: its memory is gone), never a rank number."""
    explicit = os.environ.get(NODE_KEY_ENV)
    if explicit:
        return explicit
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def run_dir_key(run_url: str) -> str:
    """The run directory as one path component: the name of its directory under the memory directory."""
    return "run-" + hashlib.sha256(normalize_run_url(run_url).encode("utf-8")).hexdigest()[:16]


def normalize_run_url(run_url: str) -> str:
    """spec/memory.md: a local run directory is named by its path as the OS resolves it (symbolic links and
    ``..`` resolved, MEM-3), so every process that names one directory computes one run-key and run_dir."""
    text = os.fspath(run_url).rstrip("/")
    if "\x00" in text:  # no path holds a NUL byte: it names no directory, so it equals no resolved one
        return text
    if "://" not in text:
        return os.path.realpath(text)
    return os.path.realpath(text.removeprefix("file://")) if text.startswith("file://") else text


def run_identity(run_url: str) -> str:
    """The run a snapshot belongs to: torchrun's ``$TORCHELASTIC_RUN_ID`` where set (the same across the
    restarts of one job), else the run directory."""
    return os.environ.get(RUN_ID_ENV) or "run-dir:" + normalize_run_url(run_url)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotBinding:
    """The metadata every memory snapshot carries (``ckptfmt.memory.*``)."""

    run_id: str
    run_dir: str
    node: str
    world_size: int
    step: int
    nodes: tuple[str, ...] = ()  # several nodes: the node of each saving rank, by rank (MEM-9)

    def to_metadata(self) -> dict[str, str]:
        out = {
            f"{PREFIX}run_id": self.run_id,
            f"{PREFIX}run_dir": self.run_dir,
            f"{PREFIX}node": self.node,
            f"{PREFIX}world_size": str(self.world_size),
            f"{PREFIX}step": str(self.step),
        }
        if self.nodes:
            out[f"{PREFIX}nodes"] = json.dumps(list(self.nodes), separators=(",", ":"))
        return out

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> SlotBinding:
        """Parse a slot manifest's binding; ManifestError naming the key that is absent or malformed."""
        values: dict[str, str] = {}
        for key in ("run_id", "run_dir", "node", "world_size", "step"):
            value = metadata.get(PREFIX + key)
            if not isinstance(value, str) or not value:
                raise ManifestError(f"metadata {PREFIX + key!r} is missing: not a memory snapshot", requirement="MEM-3")
            values[key] = value
        numbers: dict[str, int] = {}
        for key in ("world_size", "step"):
            text = values[key]
            if not text.isascii() or not text.isdigit() or len(text) > 19 or (key == "world_size" and int(text) < 1):
                raise ManifestError(f"metadata {PREFIX + key!r} is not a count: {text[:40]!r}", requirement="MEM-3")
            numbers[key] = int(text)
        return cls(
            run_id=values["run_id"],
            run_dir=values["run_dir"],
            node=values["node"],
            world_size=numbers["world_size"],
            step=numbers["step"],
            nodes=_nodes(metadata.get(PREFIX + "nodes"), numbers["world_size"]),
        )

    def foreign_to(self, *, run_id: str, node: str | None) -> str | None:
        """Why this slot is not the given run's (and, unless ``node`` is None, node's) to restore from, or None."""
        if self.run_id != run_id:
            return f"written by run {self.run_id!r}, this is run {run_id!r}"
        if node is not None and node != self.node and node not in self.nodes:
            return f"written on node {self.node!r}, this is node {node!r}"
        return None


def _nodes(text: str | None, world_size: int) -> tuple[str, ...]:
    """``ckptfmt.memory.nodes``: absent (one node), or a JSON array of one non-empty string per saving rank."""
    if text is None:
        return ()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or len(value) != world_size or not all(isinstance(v, str) and v for v in value):
        raise ManifestError(
            f"metadata {PREFIX + 'nodes'!r} is not a JSON array of {world_size} node keys", requirement="MEM-9"
        )
    return tuple(value)
