"""ckptfmt as torchft's checkpoint transport: a replica group heals from a live peer through a verified checkpoint.

torchft keeps a quorum of replica groups and, when one joins or falls behind, has it take the state of one that is
up to date through a ``CheckpointTransport``. Its own transports send a ``torch.save`` pickle and check nothing.
:class:`CkptfmtTransport` sends a ckptfmt checkpoint instead: no pickle, every byte digest-checked before anything
of it is used, and a refusal that names the sender when something does not check out.

Two kinds of state travel:

- **the training state** (``transport.state_dict`` / ``transport.load_state_dict`` registered with torchft's
  ``Manager``): the sender offers its newest memory snapshot when it holds the step being healed to (the files the
  memory tier already holds, the ones that become the durable save), else a snapshot of the live state taken then.
  The receiver checks the files as MEM-10 asks, then loads all seven fields through the same all-or-nothing
  restore as :meth:`CheckpointManager.restore_latest`, in place: one staging copy, the checked files in its memory
  directory. ``manager.last_restore`` reports ``tier="healed"``, the sender, the bytes and the seconds.
- **any other state dict** (torchft's own tests, a trainer without a :class:`CheckpointManager`): written as a
  checkpoint of its tensors and structure (:mod:`ckptfmt.torch.state_tree`) and returned as a new tree, its
  tensors on the CPU (one staging copy, the checked files, freed once read).

A refused heal raises :class:`~ckptfmt.errors.HealRefusedError`; torchft reports it, the group does not commit the
step, and the next quorum heals it again (from the source torchft assigns). A sender whose own memory snapshot
fails its digest as it is sent stops offering it and offers a snapshot of its live state at the next request.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ImportError as exc:  # pragma: no cover - the extra is installed wherever this module is used
    raise ImportError("ckptfmt.torch.ft_transport needs torchft: pip install 'ckptfmt[torchft]'") from exc

from ..arrays import to_torch
from ..errors import CheckpointError, HealRefusedError, UsageError
from ..manifest import checkpoint_id
from ..paths import MANIFEST_NAME
from ..reader import open_checkpoint
from ..storage.local import LocalStore
from ..storage.slot import SlotStore
from ..tier.heal_fetch import Fetched, fetch
from ..tier.heal_server import HealServer, Offer
from ..writer import CheckpointWriter
from . import state_tree
from .restore_report import RestoreReport
from .write_state import write_snapshot

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .training_state import TrainingState

log = logging.getLogger("ckptfmt")
MAX_TORCHFT_KEYS = 16
TOKEN_ENV = "CKPTFMT_HEAL_TOKEN"  # the default token: the same secret on every replica group of the job


class HealState:
    """What ``transport.state_dict()`` hands torchft: "the training state", offered as a checkpoint to peers."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "HealState()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Healed:
    """A training state received and checked, waiting in ``fetched.directory`` for torchft to apply it."""

    fetched: Fetched
    step: int


class CkptfmtTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """A torchft ``CheckpointTransport`` that moves ckptfmt checkpoints (module doc).

    ``manager`` and ``state``: the training state this replica group offers and heals (both, or neither for state
    dicts of any shape). ``host``: the address peers reach this process at (default: this host's name, as torchft's
    own transport). ``staging_dir``: where received checkpoints wait before they are applied (default: the
    manager's memory directory, else ``/dev/shm``, else the temp directory). ``token``: a secret every group of the
    job shares (default: ``$CKPTFMT_HEAL_TOKEN``): a peer that does not present it is refused the state (the state
    is the whole training state, and torch.distributed authenticates nobody).
    """

    def __init__(
        self,
        *,
        manager: CheckpointManager | None = None,
        state: TrainingState | None = None,
        timeout: timedelta = timedelta(seconds=60),
        host: str | None = None,
        port: int = 0,
        staging_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        if (manager is None) != (state is None):
            raise UsageError("give CkptfmtTransport both manager= and state=, or neither")
        if manager is not None and manager.collective is not None and manager.collective.world_size > 1:
            raise UsageError(
                "healing the training state supports one rank per replica group; with several, register each "
                "rank's state dict with torchft (this transport sends any state dict)"
            )
        self.manager = manager
        self.state = state
        self.timeout = timeout
        base = staging_dir or (manager.memory_root if manager is not None else None) or _default_staging()
        self._staging = os.fspath(base)
        self._token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._server = HealServer(
            host=host or socket.gethostname(), port=port, timeout=timeout.total_seconds(), token=self._token
        )
        self._lock = threading.Lock()
        self._offered: str | None = None  # a directory made for the current offer (a live snapshot), or None
        self._made: set[str] = set()  # every staging directory of ours still present
        self._damaged: set[str] = set()  # memory snapshots (by checkpoint id) that failed their digest as sent
        self.offers_from_memory = 0
        self.offers_from_live = 0
        self.heal_started: float | None = None  # time.time() when the newest receive began (for the figures)
        self.refusals: list[str] = []  # every heal this transport refused, why (torchft logs them and retries)

    # ---------------------------------------------------------------- what torchft's Manager registers

    def state_dict(self) -> HealState:
        """The training state, as torchft's ``Manager(state_dict=...)`` asks for it."""
        if self.manager is None:
            raise UsageError("transport.state_dict() needs a transport made with manager= and state=")
        return HealState()

    def load_state_dict(self, value: object) -> None:
        """Apply a received training state (torchft's ``Manager(load_state_dict=...)``): all seven fields or none."""
        if not isinstance(value, Healed):
            raise UsageError(f"expected what this transport received, got a {type(value).__name__}")
        manager, state = self._training()
        started = time.perf_counter()
        fetched = value.fetched

        def report(applied: float) -> RestoreReport:
            return RestoreReport(
                step=value.step,
                tier="healed",
                url=fetched.sender,
                checkpoint_id=fetched.checkpoint_id,
                seconds=fetched.seconds + applied,
                bytes_read=fetched.nbytes,
                sources={"*": f"replica {fetched.sender} ({fetched.info.get('source')})"},
                phases={"transfer": fetched.seconds, "apply": applied},
            )

        try:
            manager.load_healed(fetched.directory, state, report(0.0))
        finally:
            self._remove(fetched.directory)
        applied = time.perf_counter() - started
        manager.last_restore = report(applied)  # with the apply's time, now that it is known
        log.info(
            "healed to step %d from %s (%s): %d bytes in %.3f s",
            value.step,
            fetched.sender,
            fetched.info.get("source"),
            fetched.nbytes,
            fetched.seconds + applied,
        )

    # ---------------------------------------------------------------- CheckpointTransport

    def metadata(self) -> str:
        return self._server.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        user = state_dict.get("user") if isinstance(state_dict, Mapping) else None
        keys = [k for k, v in user.items() if isinstance(v, HealState)] if isinstance(user, Mapping) else []
        with self._lock:
            self._drop_offer()
            if keys:
                assert isinstance(user, Mapping)
                if len(user) != 1:
                    raise UsageError("the training state must be the only state registered with torchft's Manager")
                offer = self._training_offer(step, str(keys[0]), _torchft_state(state_dict.get("torchft"), step))
            else:
                offer = self._tree_offer(step, state_dict)
            self._server.offer(offer)

    def disallow_checkpoint(self) -> None:
        self._server.withdraw()
        with self._lock:
            self._drop_offer()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        self.heal_started = time.time()
        directory = self._new_dir("recv")
        try:
            fetched = fetch(metadata, step, directory, timeout=timeout.total_seconds(), token=self._token)
        except HealRefusedError as exc:
            self.refusals.append(str(exc))
            self._remove(directory)
            raise
        try:
            kind = fetched.info.get("kind")
            if kind == "training":
                if self.manager is None:
                    raise HealRefusedError(f"{metadata} offers a training state; this transport has none to heal")
                ft_state = _torchft_state(fetched.info.get("torchft"), step)
                self._check_step(fetched, step, "provenance")
                key = fetched.info.get("key")
                if not isinstance(key, str):
                    raise HealRefusedError(f"{metadata} offered a training state without its key")
                return {"user": {key: Healed(fetched=fetched, step=step)}, "torchft": ft_state}
            if kind == "tree":
                return self._read_tree(fetched, step)
            raise HealRefusedError(f"{metadata} offered a state of unknown kind {kind!r:.40}")
        except BaseException as exc:
            if isinstance(exc, HealRefusedError):
                self.refusals.append(str(exc))
            self._remove(directory)
            raise

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        with self._lock:
            for directory in list(self._made):
                self._remove(directory)

    # ---------------------------------------------------------------- the sender

    def _training(self) -> tuple[CheckpointManager, TrainingState]:
        if self.manager is None or self.state is None:
            raise UsageError("this transport was made without manager= and state=")
        return self.manager, self.state

    def _training_offer(self, step: int, key: str, ft_state: dict[str, int]) -> Offer:
        manager, state = self._training()
        info: dict[str, object] = {"kind": "training", "step": step, "key": key, "torchft": ft_state}
        held = manager.newest_snapshot()
        if held is not None and held[1].step == step and held[1].checkpoint_id not in self._damaged:
            slot_dir, newest = held
            source = SlotStore(slot_dir)
            manifest = source.read(MANIFEST_NAME)
            if checkpoint_id(manifest) == newest.checkpoint_id:  # else rewritten since: offer the live state
                self.offers_from_memory += 1
                damaged = newest.checkpoint_id
                return Offer(
                    step=step,
                    source=source,
                    manifest_bytes=manifest,
                    info={**info, "source": "memory"},
                    on_damaged=lambda exc: self._on_damaged(damaged, exc),
                )
        snap = manager.capture(step, state)
        directory = self._new_dir("send")
        self._offered = directory
        store = LocalStore(directory, direct_io=False)
        writer = CheckpointWriter(store)
        try:
            write_snapshot(writer, snap)  # commits: a `with` block would commit it a second time
        except BaseException:
            writer.abort()
            raise
        self.offers_from_live += 1
        return Offer(step=step, source=store, manifest_bytes=store.read(MANIFEST_NAME), info={**info, "source": "live"})

    def _tree_offer(self, step: int, tree: object) -> Offer:
        tensors, root = state_tree.flatten(tree)
        directory = self._new_dir("send")
        self._offered = directory
        store = LocalStore(directory, direct_io=False)
        with CheckpointWriter(store, profile="weights") as writer:
            writer.write_tensors(state_tree.TENSORS, tensors)
            writer.write_context(state_tree.FIELD, {"root": root, "step": step})
        return Offer(
            step=step,
            source=store,
            manifest_bytes=store.read(MANIFEST_NAME),
            info={"kind": "tree", "step": step, "source": "live"},
        )

    def _on_damaged(self, checkpoint_id: str, exc: CheckpointError) -> None:
        log.error("memory snapshot %s is damaged (%s): peers heal from the live state instead", checkpoint_id, exc)
        self._damaged.add(checkpoint_id)

    def _drop_offer(self) -> None:
        if self._offered is not None:
            self._remove(self._offered)
            self._offered = None

    # ---------------------------------------------------------------- the receiver

    def _check_step(self, fetched: Fetched, step: int, field: str) -> None:
        with open_checkpoint(fetched.directory) as ckpt:
            bound = ckpt.read_context(field).get("step")
        if bound != step:
            raise HealRefusedError(f"{fetched.sender} sent a checkpoint of step {bound!r}, not {step}", field=field)

    def _read_tree(self, fetched: Fetched, step: int) -> dict[str, Any]:
        try:
            with open_checkpoint(fetched.directory) as ckpt:
                doc = ckpt.read_context(state_tree.FIELD)
                if doc.get("step") != step:
                    raise HealRefusedError(f"{fetched.sender} sent the state of step {doc.get('step')!r}, not {step}")
                field = state_tree.TENSORS
                tensors = {
                    name: to_torch(ckpt.read_tensor(field, name), ckpt.tensor(field, name).dtype)
                    for name in ckpt.tensor_names(field)
                }
            tree = state_tree.unflatten(doc.get("root"), tensors)
        except HealRefusedError:
            raise
        except CheckpointError as exc:
            raise HealRefusedError(f"the state from {fetched.sender} was refused: {exc}") from exc
        finally:
            self._remove(fetched.directory)
        if not isinstance(tree, dict):
            raise HealRefusedError(f"{fetched.sender} sent a state that is not a dict")
        return tree

    # ---------------------------------------------------------------- staging directories

    def _new_dir(self, what: str) -> str:
        directory = tempfile.mkdtemp(prefix=f"heal-{what}-", dir=self._staging)  # 0700, made by us
        self._made.add(directory)
        return directory

    def _remove(self, directory: str) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        self._made.discard(directory)


def _torchft_state(value: object, step: int) -> dict[str, int]:
    """torchft's own counters (its ``Manager.state_dict()``): a few non-negative integers, ``step`` the one asked."""
    if (
        not isinstance(value, Mapping)
        or len(value) > MAX_TORCHFT_KEYS
        or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items())
    ):
        raise HealRefusedError(f"torchft's state must be a small map of non-negative integers, got {value!r:.200}")
    if value.get("step", step) != step:
        raise HealRefusedError(f"torchft's state is of step {value.get('step')}, not step {step}")
    return dict(value)


def _default_staging() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()
