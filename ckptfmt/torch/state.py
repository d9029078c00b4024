"""Turning PyTorch training objects into ckptfmt fields and back.

A training state is captured into a :class:`Snapshot` (host-memory tensors plus context maps),
written by :func:`write_snapshot`, read back whole by :func:`ckptfmt.torch.read_state.read_snapshot` — every
byte read and verified before anything is applied — and only then applied to the live objects by
:func:`apply_model`, :func:`apply_optimizer` and :func:`apply_stateful` (:func:`ckptfmt.torch.api.apply` calls
them). So a corrupt checkpoint is refused before the model is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import optimizer_layout
from ..arrays import as_array, to_torch, torchify
from ..canonical import config_hash, config_to_dict
from ..collective import Collective
from ..context import decode, encode
from ..errors import ContextError, SourceChangedError, UsageError
from ..writer import COORDINATOR, CheckpointWriter
from . import rng
from .in_place import Checked
from .sharding import (
    LocalShard,
    TargetShard,
    is_dtensor,
    owners,
    replicated_sizes,
    shard_of,
    to_target,
)

# a whole tensor, this rank's piece, a loaded region, a region checked for a live tensor (in_place.py)
Stored = np.ndarray[Any, Any] | LocalShard | TargetShard | Checked


class Source(NamedTuple):
    """A deferred tensor's live tensor as capture found it: what tells that it changed before its copy was done.
    (A tuple: one is made per tensor on the trainer's thread, and a tuple is made fastest.)"""

    field: str
    name: str
    live: torch.Tensor  # a parameter (whose ``.data`` a trainer may replace) or an optimizer state tensor
    captured: torch.Tensor  # what the snapshot copies: a detached alias of ``live`` at capture
    versions: tuple[int, ...]  # _versions(live) at capture

    def changed(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(versions at capture, now) when the captured data was changed in place since; else None."""
        now = _versions(self.live)
        if now == self.versions:
            return None
        if _local(self.live).data_ptr() != _local(self.captured).data_ptr():
            # ``p.data = x`` gave the parameter other storage, which took over its version counter: what moved is
            # the new storage's, while the snapshot holds the captured one, as it was at capture
            return None
        return self.versions, now


def _source(field: str, name: str, live: torch.Tensor, captured: torch.Tensor) -> Source:
    return Source(field, name, live, captured, _versions(live))


def _versions(tensor: torch.Tensor) -> tuple[int, ...]:
    """The version counters that an in-place change of ``tensor`` bumps (views share their base's).

    A DTensor's own counter moves with ops on the DTensor, its local tensor's with ops on ``to_local()``: neither
    sees the other's. An inference tensor has none: it is not checked. Nor is a change made through ``.data``,
    which by design bumps no counter."""
    if tensor.is_inference():
        return ()
    if is_dtensor(tensor):
        with torch.no_grad():  # to_local() is then an alias of the live local tensor, sharing its counter
            return (tensor._version, _local(tensor)._version)
    return (tensor._version,)


@dataclass(slots=True)
class Snapshot:
    """Everything one checkpoint holds, in host memory: field -> tensors, field -> context.

    ``deferred`` lists tensors not copied yet (field, name, live tensor): parameters and optimizer
    state, which only ``optimizer.step()`` changes, so an async save may copy them while the next
    forward and backward run. :meth:`materialize` copies them.

    ``sources`` records their version counters at capture. Once their bytes are taken (copied, or, as views,
    written), :meth:`check_sources` refuses a snapshot of which one changed in place meanwhile (an EMA update or a
    schedule-free ``optimizer.eval()`` between a save and the next step): a torn snapshot is never committed.
    """

    tensors: dict[str, dict[str, Stored]] = field(default_factory=dict)
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    deferred: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)  # the deferred tensors' live tensors, not checked yet
    copy_in: Callable[[], None] | None = None  # fills the Checked tensors: the last step of applying a load
    forget: Callable[[], None] | None = None  # drops what was checked for copy_in from the page cache

    def discard(self) -> None:
        """A load that will not be applied: what its check left in the page cache for :attr:`copy_in` leaves it
        (a checkpoint read once does not stay cached, as after the copy-in)."""
        if self.forget is not None:
            self.forget()

    def materialize(self, buffers: HostBuffers | None) -> None:
        """Take the deferred tensors: copies into ``buffers``, or (None) views of CPU tensors as they are,
        which the caller must then write before the next ``optimizer.step()`` changes them.

        With ``buffers``, raises :class:`~ckptfmt.errors.SourceChangedError` when a tensor changed in place since
        capture; views are checked by :func:`stage_snapshot`, once written."""
        for fname, name, tensor in self.deferred:
            self.tensors[fname][name] = _host(f"{fname}/{name}", tensor, buffers)
        self.deferred.clear()
        if buffers is not None:
            buffers.synchronize()
            # After the copies landed: a change made while one ran has bumped its counter by now. (On CUDA the
            # counter moves when the op is queued, and the copies wait for everything queued before them.)
            self.check_sources()

    def check_sources(self) -> None:
        """Raise :class:`~ckptfmt.errors.SourceChangedError` naming the first tensor (and how many) that changed in
        place since capture; call it once the deferred tensors' bytes are taken, before the next step may run."""
        changed = [(source, moved) for source in self.sources if (moved := source.changed()) is not None]
        self.sources.clear()
        if not changed:
            return
        source, (then, now) = changed[0]
        others = f"; {len(changed) - 1} more tensors changed too" if len(changed) > 1 else ""
        raise SourceChangedError(
            f"changed in place while the snapshot was copied (version {_counter(then)} at capture, {_counter(now)} "
            f"after{others}): the snapshot would mix two training states, so it is refused, not committed. Between a "
            "save or memory snapshot and the next optimizer.step(), change parameters and optimizer state only in "
            "step(), or wait for the save first (CheckpointManager.wait, wait_memory)",
            field=source.field,
            tensor=source.name,
        )


class HostBuffers:
    """Reusable host copies of tensors, so repeated snapshots allocate nothing new.

    With ``pinned`` (device tensors, CUDA), buffers are page-locked and the copies are issued on a side
    stream that first waits for the training stream's work (``source_stream``, captured by the trainer's
    thread): the training stream never waits on a copy, and :meth:`synchronize` (called by the thread that
    writes the snapshot) waits for the copies' event, not for the device.
    """

    def __init__(self, *, pinned: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.pinned = pinned
        self._stream: Any = None
        self._event: Any = None
        self.source_stream: Any = None

    def copy(self, key: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        t = _local(tensor.detach())
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned and t.is_cuda)
            self._buffers[key] = buf
        if t.is_cuda and self.pinned:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]
            if self._event is None:  # first device copy of this round: order it after the training stream's work
                self._stream.wait_stream(self.source_stream or torch.cuda.current_stream(t.device))
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(self._stream):
                buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        return as_array(buf)[0]

    def synchronize(self) -> None:
        """Wait until every copy issued since the last call has landed in host memory."""
        if self._event is not None:
            self._event.record(self._stream)
            self._event.synchronize()
            self._event = None


def _counter(versions: tuple[int, ...]) -> str:
    return "/".join(str(v) for v in versions)


def _host(key: str, tensor: torch.Tensor, buffers: HostBuffers | None) -> Stored:
    """A host copy (or a view, for CPU tensors without ``buffers``); a DTensor becomes its :class:`LocalShard`."""
    host = buffers.copy(key, tensor) if buffers is not None else None
    if is_dtensor(tensor):
        return shard_of(key, tensor, host)
    return host if host is not None else as_array(tensor)[0]


def _to_torch(value: Stored) -> Any:
    """A stored value as what ``load_state_dict`` takes: a tensor, or a DTensor placed like its target."""
    if isinstance(value, TargetShard):
        return to_target(to_torch(value.array), value.like)
    if isinstance(value, Checked):
        return value.live  # loaded into itself (nothing copied); its bytes arrive with Snapshot.copy_in
    if isinstance(value, LocalShard):
        raise UsageError("a rank's own shard cannot be applied without its target placement")
    return to_torch(value)


def _plain(value: Any, where: str) -> Any:
    """A context-safe copy of a non-tensor value (tensors become numpy arrays)."""
    if isinstance(value, torch.Tensor):
        return as_array(value)[0].copy()
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ContextError(f"{where}: a {type(value).__name__} cannot be stored in a checkpoint")


# ------------------------------------------------------------------ model


_NOT_YET: np.ndarray[Any, Any] = np.empty(0)  # the place of a deferred tensor, keeping write order


def capture_model(
    model: torch.nn.Module, snap: Snapshot, buffers: HostBuffers | None = None, *, defer: bool = False
) -> None:
    """Model state into ``weights``; a tensor shared under several names (tied weights) is stored once.

    With ``defer``, parameters are left for :meth:`Snapshot.materialize`; buffers (e.g. batch-norm
    statistics, which the next forward pass updates) are copied now.
    """
    params = {_local(p).data_ptr(): p for p in model.parameters()} if defer else {}
    tensors: dict[str, Stored] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        ident = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(tensor.shape),
            local.stride(),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        if local.data_ptr() in params and local.numel():
            snap.deferred.append(("weights", name, tensor))
            snap.sources.append(_source("weights", name, params[local.data_ptr()], tensor))
            tensors[name] = _NOT_YET
        else:
            tensors[name] = _host(f"weights/{name}", tensor, buffers)
    snap.tensors["weights"] = tensors
    snap.contexts["weights"] = {"aliases": aliases}


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[no-any-return]


def apply_model(model: torch.nn.Module, snap: Snapshot, strict: bool = True) -> None:
    tensors = snap.tensors["weights"]
    aliases = snap.contexts.get("weights", {}).get("aliases", {})
    state: dict[str, torch.Tensor] = {name: _to_torch(value) for name, value in tensors.items()}
    live = model.state_dict(keep_vars=True)
    for alias, target in aliases.items():
        # a stored tensor filled in place fills its aliases' own tensors too (read_snapshot): each loads into itself
        checked = isinstance(tensors.get(target), Checked) and alias in live
        state[alias] = live[alias] if checked else state[target]
    model.load_state_dict(state, strict=strict)


# ------------------------------------------------------------------ optimizer


def capture_optimizer(
    optimizer: torch.optim.Optimizer,
    snap: Snapshot,
    buffers: HostBuffers | None = None,
    *,
    defer: bool = False,
    model: torch.nn.Module | None = None,
) -> None:
    """Per-parameter state tensors as ``<parameter name>/<key>`` (``state.<index>.<key>`` without ``model``);
    everything else as the field's context.

    Keyed by parameter name (FQN), optimizer state survives a change of parallelism: FSDP or tensor
    parallel moments are DTensors sharded like their parameters, saved as this rank's shards.
    With ``defer``, the state tensors are left for :meth:`Snapshot.materialize`.
    """
    if model is None:
        state_dict: dict[str, Any] = optimizer.state_dict()
        keyed = optimizer_layout.INDEX
    elif any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state_dict = dict(get_optimizer_state_dict(model, optimizer))  # FQN-keyed, DTensor state as is
        keyed = optimizer_layout.FQN
    else:
        state_dict = _by_name(optimizer.state_dict(), _param_names(model, optimizer))
        keyed = optimizer_layout.FQN

    def stored(name: str, tensor: torch.Tensor) -> Stored:
        if defer:
            # detached, as the model's state_dict gives parameters: a later ``.data = x`` on the live tensor leaves
            # the captured storage to the copy
            captured = tensor.detach()
            snap.deferred.append(("optimizer", name, captured))
            snap.sources.append(_source("optimizer", name, tensor, captured))
            return _NOT_YET
        return _host(f"optimizer/{name}", tensor, buffers)

    tensors, scalars = optimizer_layout.split_state(
        state_dict["state"],
        keyed,
        is_tensor=lambda value: isinstance(value, torch.Tensor),
        tensor=stored,
        value=lambda value, where: _plain(value, f"optimizer state {where}"),
    )
    snap.tensors["optimizer"] = tensors
    snap.contexts["optimizer"] = optimizer_layout.context(
        keys=keyed,
        param_groups=_plain(state_dict["param_groups"], "param_groups"),
        scalars=scalars,
        cls=type(optimizer).__name__,
    )


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer`` in its state_dict's index order (a tied parameter:
    its first name, as ``named_parameters`` gives it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise UsageError("the optimizer holds a parameter that is not the model's: pass the model it trains")
            out.append(name)
    return out


def stored_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names a save records for the optimizer's parameters (in its index order)."""
    names = _param_names(model, optimizer)
    if any(is_dtensor(p) for p in model.parameters()):  # saved through get_optimizer_state_dict
        names = [_dcp_fqn(name) for name in names]
    return names


_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _dcp_fqn(name: str) -> str:
    """A parameter's name as torch's get_optimizer_state_dict keys it (what a DTensor model's save records): without
    the segments that torch.compile, FSDP and activation checkpointing wrap modules in."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _by_name(state_dict: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state_dict keyed by parameter index, re-keyed by parameter name."""
    return {
        "state": {names[int(i)]: entry for i, entry in state_dict["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


def _by_index(state_dict: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_by_name` for the optimizer whose parameters are ``names``."""
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for g in state_dict["param_groups"] for n in g["params"] if n not in index]
    unknown += [n for n in state_dict["state"] if n not in index]
    if unknown:
        raise UsageError(f"the checkpoint has optimizer state for parameters the model lacks: {sorted(unknown)[:5]}")
    return {
        "state": {index[n]: entry for n, entry in state_dict["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state_dict["param_groups"]],
    }


def optimizer_keys(snap: Snapshot) -> str:
    """How the snapshot's optimizer tensors are named: ``fqn`` (``<param>/<key>``) or ``index`` (older saves)."""
    return optimizer_layout.key_scheme(snap.contexts.get("optimizer", {}))


def apply_optimizer(optimizer: torch.optim.Optimizer, snap: Snapshot, model: torch.nn.Module | None = None) -> None:
    context = snap.contexts["optimizer"]
    optimizer_layout.check_class(context, type(optimizer).__name__)
    stored = optimizer_layout.join_state(snap.tensors["optimizer"], context, _to_torch)
    groups = optimizer_layout.param_groups(context["param_groups"])
    if optimizer_keys(snap) == optimizer_layout.FQN:
        if model is None:
            raise UsageError("optimizer state keyed by parameter name needs the model to restore it")
        loaded: dict[str, Any] = {"state": stored, "param_groups": groups}
        # By index, DTensor state included (it is placed like its parameter already): torch's
        # set_optimizer_state_dict first gives an optimizer without state its whole state by a step on zero
        # gradients, memory that the load then throws away.
        optimizer.load_state_dict(_by_index(loaded, stored_param_names(model, optimizer)))
        return
    optimizer.load_state_dict({"state": {int(pid): entries for pid, entries in stored.items()}, "param_groups": groups})


# ------------------------------------------------------------------ anything with state_dict()


def capture_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    """An LR scheduler, grad scaler, or any object with state_dict(), as a context field."""
    snap.contexts[name] = {"state": _plain(obj.state_dict(), name)}


def apply_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    state = snap.contexts[name]["state"]
    obj.load_state_dict(torchify(state))


# ------------------------------------------------------------------ config


def config_field(config: object) -> dict[str, Any]:
    as_dict = config_to_dict(config) if dataclasses.is_dataclass(config) or isinstance(config, Mapping) else None
    if as_dict is None:
        raise UsageError(f"config must be a dict or a dataclass instance, got {type(config).__name__}")
    return {"config": as_dict, "hash": config_hash(as_dict)}


# ------------------------------------------------------------------ I/O


def write_snapshot(writer: CheckpointWriter, snap: Snapshot) -> str:
    """Write every field of ``snap`` and commit; returns the checkpoint id.

    With several ranks (``writer.collective``), each rank writes the shards it is the writer of and the
    replicated tensors assigned to it (:func:`~ckptfmt.torch.sharding.owners`), and the coordinator writes
    the context blobs; the commit is collective.
    """
    stage_snapshot(writer, snap)
    return writer.commit()


def stage_snapshot(writer: CheckpointWriter, snap: Snapshot) -> None:
    """Hand every field of ``snap`` to ``writer`` (not committed; on failure the writer is aborted).

    After ``writer.flush()`` returns, the snapshot's arrays are no longer needed: a snapshot of live
    tensors (views) may let the trainer change them from then on. Such a snapshot is flushed here and checked
    (:meth:`Snapshot.check_sources`): a view changed in place while it was written fails the save.
    """
    if snap.deferred:
        raise UsageError("the snapshot has tensors not copied yet: call materialize() first")
    try:
        collective = writer.collective
        assigned = owners(replicated_sizes(snap.tensors), collective.world_size) if collective is not None else {}
        if collective is not None and "rng" in snap.contexts:
            _gather_rng(snap, collective)
        for name, tensors in snap.tensors.items():
            writer.write_tensors(name, {})  # every rank declares the field, even with nothing to write
            for tname, value in tensors.items():
                if isinstance(value, LocalShard):
                    if value.writer:
                        writer.write_tensor(
                            name, tname, value.array, global_shape=value.global_shape, offsets=value.offsets
                        )
                elif isinstance(value, TargetShard):
                    raise UsageError("a snapshot read for loading cannot be written back", field=name, tensor=tname)
                elif collective is None or assigned[f"{name}/{tname}"] == collective.rank:
                    writer.write_tensor(name, tname, value)
        if writer.is_coordinator:
            for name, context in snap.contexts.items():
                writer.write_context(name, context)
        if snap.sources:  # views of live tensors: their bytes are taken once written
            writer.flush()
            snap.check_sources()
    except BaseException:
        writer.abort()
        raise


def _gather_rng(snap: Snapshot, collective: Collective) -> None:
    """Each rank's own generators into the coordinator's ``rng`` field (:func:`ckptfmt.torch.rng.with_ranks`)."""
    gathered = collective.gather(encode(snap.contexts["rng"], where="field 'rng'"), dst=COORDINATOR)
    if gathered is not None:
        snap.contexts["rng"] = rng.with_ranks([decode(g, field="rng") for g in gathered])
