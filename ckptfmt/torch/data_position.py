"""The ``data`` field of whatever feeds the trainer: saved from and restored into a :class:`ResumableDataLoader`, a
:class:`ResumableSampler`, a plain ``DataLoader`` or a stateful loader such as torchdata's ``StatefulDataLoader``.

:func:`data_field` takes the position a save writes (refusing, or warning about, one that would repeat data);
:func:`check_restorable` refuses, before anything is applied, a field the source cannot take and warns about a
resume that will not be exact (:func:`inexact_resume_reasons`); :func:`restore_data` puts the position back.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from torch.utils.data import DataLoader

from ..errors import ContextError, UsageError
from .loader import InexactResumeWarning, ResumableDataLoader
from .replica_batches import ReplicaBatches
from .sampler import DatasetIdentity, ResumableSampler

Policy = Literal["strict", "warn", "ignore"]


def _inner_sampler(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, ResumableSampler) and batch_sampler is not None:
        sampler = getattr(batch_sampler, "sampler", sampler)  # DataLoader(batch_sampler=BatchSampler(sampler))
    return sampler


def _is_plain_loader(obj: Any) -> bool:
    return isinstance(obj, DataLoader) and not isinstance(obj, ResumableDataLoader) and not hasattr(obj, "state_dict")


def dataset_identity(source: Any) -> DatasetIdentity | None:
    """The dataset identity a data source declares (compared with the checkpoint's on resume)."""
    if isinstance(source, ResumableDataLoader):
        return source.resumable_sampler.dataset
    if _is_plain_loader(source):
        source = _inner_sampler(source)
    identity = getattr(source, "dataset", None)
    return identity if isinstance(identity, DatasetIdentity) else None


def _warn(message: str) -> None:
    """An :class:`InexactResumeWarning` attributed to the caller's line, not to ckptfmt's internals."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 2  # stacklevel 2 is the frame that called _warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, InexactResumeWarning, stacklevel=level)


def _refuse_or_warn(message: str, policy: Policy) -> None:
    if policy == "strict":
        raise UsageError(message + ' (CheckpointManager(on_mismatch="warn") saves anyway, with a warning)')
    if policy == "warn":
        _warn(message)


def data_field(source: Any, *, policy: Policy = "strict", steps_passed: bool = True) -> dict[str, Any]:
    """The ``data`` field from a data source; a source that would write a wrong position is refused under
    ``policy="strict"`` (warned about under ``"warn"``).

    ``steps_passed``: whether training steps ran since the last restore or save (a sampler that handed
    out samples but never moved matters only then).
    """
    from . import state as torch_state

    if isinstance(source, ResumableDataLoader):
        return source.state_dict()
    if _is_plain_loader(source):
        inner = _inner_sampler(source)
        if not isinstance(inner, ResumableSampler) and not hasattr(inner, "state_dict"):
            _refuse_or_warn(
                f"the DataLoader's sampler ({type(inner).__name__}) cannot report its position, so the resumed run "
                "would restart the epoch and re-read samples already trained on. Use "
                "ckptfmt.torch.ResumableDataLoader(dataset, batch_size=…, seed=…), or a DataLoader with "
                "sampler=ResumableSampler(…) and sampler.advance(len(batch)) after every step",
                policy,
            )
            return {"epoch": 0, "global_sample_offset": 0, "loader": {"kind": "torch.DataLoader", "exact": False}}
        source = inner
    if isinstance(source, ResumableSampler):
        problem = source.position_problem() if steps_passed else None
        if problem:
            _refuse_or_warn(problem, policy)
        return source.state_dict()
    if not hasattr(source, "state_dict"):
        raise UsageError(f"a {type(source).__name__} has no state_dict(): pass a ResumableDataLoader as loader=")
    data = source.state_dict()
    if isinstance(data, Mapping) and "epoch" in data and "global_sample_offset" in data:
        return dict(data)
    # A stateful loader with its own state shape (torchdata's StatefulDataLoader): kept whole under
    # "loader", next to the required keys, filled in as well as the loader lets us.
    yielded = _num_yielded(data)
    size = getattr(source, "batch_size", None) or 1
    offset = int(getattr(source, "consumed", 0)) or (yielded * size if isinstance(yielded, int) else 0)
    epoch = data.get("epoch", 0) if isinstance(data, Mapping) else 0
    kind = f"{type(source).__module__}.{type(source).__qualname__}"
    return {
        "epoch": epoch if isinstance(epoch, int) and epoch >= 0 else 0,
        "global_sample_offset": max(0, offset),
        "loader": {"kind": kind, "state": torch_state._plain(data, "data.loader")},
    }


def _num_yielded(data: object) -> int:
    """Batches a StatefulDataLoader handed out this epoch (kept in its main snapshot with workers)."""
    if not isinstance(data, Mapping):
        return 0
    snapshot = data.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, Mapping) else None
    count = main.get("_sampler_iter_yielded") if isinstance(main, Mapping) else data.get("_num_yielded")
    return count if isinstance(count, int) and count >= 0 else 0


def inexact_resume_reasons(source: Any) -> list[str]:
    """Why resuming into ``source`` would not reproduce the uninterrupted run (empty when it would)."""
    if isinstance(source, (ResumableDataLoader, ResumableSampler, ReplicaBatches)):
        return []
    reasons = []
    if isinstance(source, DataLoader) and source.generator is None:
        reasons.append(
            f"the {type(source).__name__} has generator=None, so every iter(loader) draws its workers' base seed "
            "(and a shuffling sampler's order) from torch's global RNG; the resumed process creates its iterator "
            "at another step than the original did, so dropout masks and every other global draw after the resume "
            "differ. Pass generator=torch.Generator().manual_seed(SEED), or use ckptfmt.torch.ResumableDataLoader"
        )
    shared = getattr(_inner_sampler(source), "generator", None)
    stateful = isinstance(source, DataLoader) and not _is_plain_loader(source)
    if stateful and shared is not None and shared is source.generator:
        reasons.append(
            f"the {type(source).__name__}'s shuffling sampler and its workers' base seed draw from one generator "
            "(shuffle=True with generator=…), so the epoch after a mid-epoch resume gets another order. Pass "
            "sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(SEED)) and a separate "
            "generator=, or use ckptfmt.torch.ResumableDataLoader"
        )
    if _is_plain_loader(source):
        inner = _inner_sampler(source)
        if not isinstance(inner, ResumableSampler) and not hasattr(inner, "load_state_dict"):
            reasons.append(
                f"the DataLoader's sampler ({type(inner).__name__}) cannot report its position, so the run restarts "
                "the epoch and re-reads samples it already trained on. Use ckptfmt.torch.ResumableDataLoader, or "
                "sampler=ResumableSampler(…) with sampler.advance(len(batch)) after every step"
            )
    return reasons


def check_restorable(source: Any, data: Mapping[str, Any]) -> None:
    """Refuse, before anything is applied, a data field that ``source`` cannot take; warn about inexact resumes."""
    for reason in inexact_resume_reasons(source):
        _warn("resume will not be exact: " + reason)
    target = _inner_sampler(source) if _is_plain_loader(source) else source
    if isinstance(target, ReplicaBatches):
        target.check_state_dict(data)  # a peer's or a file's position, refused before anything is applied
        return
    ours = isinstance(target, (ResumableDataLoader, ResumableSampler))
    sampler = data.get("sampler")
    written_by_us = isinstance(sampler, Mapping) and sampler.get("kind") == "ckptfmt.resumable"
    if written_by_us and not ours and hasattr(target, "load_state_dict"):
        raise UsageError(
            f"the data field was written by a ResumableSampler/ResumableDataLoader; a {type(target).__name__} "
            "cannot take it: resume with a ResumableDataLoader (or a ResumableSampler) with the same seed"
        )
    if ours and not written_by_us:
        raise ContextError("data field was not written by a ResumableSampler or ResumableDataLoader", field="data")
    if ours:
        target.check_state_dict(data)  # the whole position, quarantine record included, before anything is applied


def restore_data(source: Any, data: Mapping[str, Any]) -> None:
    """Put the data position back into ``source`` (after :func:`check_restorable`)."""
    from ..arrays import torchify

    if _is_plain_loader(source):
        source = _inner_sampler(source)
        if not hasattr(source, "load_state_dict"):
            return  # warned about in check_restorable: nothing can take the position
    if isinstance(source, (ResumableDataLoader, ResumableSampler, ReplicaBatches)):
        source.load_state_dict(data)
        return
    loader = data.get("loader")
    if isinstance(loader, Mapping) and "state" in loader and "kind" in loader:
        source.load_state_dict(torchify(loader["state"]))
    elif loader is not None:
        source.load_state_dict(torchify(loader))  # written before "loader" had kind and state
    else:
        source.load_state_dict(torchify(dict(data)))
