"""PyTorch state-dict files (``.pt``, ``.bin``, ``.pth``) into ckptfmt. Import only.

Loaded with ``torch.load(weights_only=True)``: torch's restricted unpickler, which builds tensors,
containers and primitives and refuses every other global. Tensors are named by their dotted path
in the nested dicts (the convention of ``state_dict()``); an optimizer state dict found anywhere
(``{"state": ..., "param_groups": ...}``) becomes the ``optimizer`` field, laid out by
:mod:`ckptfmt.optimizer_layout` (tensors ``state.0.exp_avg``; several optimizers ``<i>/state.0.exp_avg``,
in the order provenance's ``optimizer_keys`` names them), so ``ckptfmt.torch`` restores it.
Other non-tensor values (``epoch``, ``step``...) become the ``weights`` field's context.
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, SourceFormatError
from .base import (
    Location,
    exists,
    fs_call,
    list_names,
    open_local,
)
from .bounded import check_expansion, check_graph, dedupe
from .optimizer import split_optimizers
from .torch_bridge import Split, find_optimizers, pop_path, split_tree
from .weights import SourceField, WeightsSource, importer, loaded

SUFFIXES = (".pt", ".bin", ".pth")


def find_file(loc: Location) -> Location:
    """The state-dict file: ``loc`` itself, or the single .pt/.bin/.pth file of a directory."""
    names = list_names(loc)
    if not names:
        if not exists(loc):
            raise CheckpointNotFoundError("no such file or directory", path=loc.url)
        return loc
    # symlinks and special files included: opening one is refused with a message naming it
    found = sorted(n for n, kind in names.items() if kind != "directory" and n.endswith(SUFFIXES))
    if len(found) != 1:
        raise SourceFormatError(
            f"expected one .pt/.bin/.pth file in the directory, found {len(found)}: {', '.join(found)}", path=loc.url
        )
    return loc.join(found[0])


def load(loc: Location, *, allow: Sequence[Any] = ()) -> Any:
    """``torch.load(weights_only=True)`` of a local or remote file; memory-mapped when local. The value is
    bounded (:func:`~ckptfmt.convert.bounded.check_graph`) before any converter walks it.

    ``allow`` adds globals to torch's allow-list for this load, in this thread only (:func:`allowed`).
    """
    with warnings.catch_warnings(), allowed(allow):
        warnings.simplefilter("ignore")  # torch's notes on pickle protocols are not the operator's concern
        value = _load(loc)
    check_graph(value, loc.url)
    return value


_scope = threading.local()  # .names: {"module.qualname": object} this thread's load allows
_install_lock = threading.Lock()
_installed: list[bool] = []


@contextmanager
def allowed(extra: Sequence[Any]) -> Iterator[None]:
    """Allow ``extra`` globals in ``torch.load(weights_only=True)`` calls of this thread, inside the block.

    torch's own ``safe_globals`` context manager edits one process-wide set: while it is open every
    thread's weights_only load accepts those globals, and on exit it removes them even where the user had
    registered them (``add_safe_globals``) before. Instead, torch's reader of that set is wrapped, once,
    to add what the current thread's block allows; the set itself is never touched. A torch without that
    reader falls back to ``safe_globals``, putting back the user's own registrations afterwards.
    """
    if not extra:
        yield
        return
    import torch
    import torch._weights_only_unpickler as unpickler

    names = {f"{g.__module__}.{g.__qualname__}": g for g in extra}
    if _install(unpickler):
        outer = getattr(_scope, "names", None)
        _scope.names = {**(outer or {}), **names}
        try:
            yield
        finally:
            _scope.names = outer
        return
    before = set(torch.serialization.get_safe_globals())
    try:
        with torch.serialization.safe_globals(list(extra)):
            yield
    finally:
        kept = [g for g in extra if g in before]
        if kept:
            torch.serialization.add_safe_globals(kept)


def _install(unpickler: Any) -> bool:
    """Wrap torch's reader of the user allow-list so it also returns this thread's scoped globals."""
    with _install_lock:
        if not _installed:
            original = getattr(unpickler, "_get_user_allowed_globals", None)
            if callable(original):

                def user_allowed_globals() -> dict[str, Any]:
                    names = getattr(_scope, "names", None)
                    found: dict[str, Any] = original()
                    return {**found, **names} if names else found

                unpickler._get_user_allowed_globals = user_allowed_globals
            _installed.append(callable(original))
        return _installed[0]


def _load(loc: Location) -> Any:
    import torch

    try:
        if loc.root is not None:
            return _load_local(loc)
        with fs_call(loc.url, loc.fs.open, loc.path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SourceFormatError(
            f"refused: the file holds objects torch.load(weights_only=True) will not build ({first})", path=loc.url
        ) from exc
    except CheckpointError:
        raise
    except Exception as exc:
        # torch.load parses an untrusted archive and lets the parser's own failures through as they come
        # (IndexError, KeyError, struct.error, AssertionError, OSError(EINVAL)...): all mean a damaged file.
        raise SourceFormatError(f"not a readable PyTorch file: {type(exc).__name__}: {exc}", path=loc.url) from exc


def _load_local(loc: Location) -> Any:
    """Load the regular file opened safely (no symlink below the source root), memory-mapped when torch can:
    torch maps by name, so it is given the opened file's own name in /proc/self/fd, not the path again."""
    import torch

    fd = open_local(loc)
    try:
        by_fd = f"/proc/self/fd/{fd}"
        if os.path.exists(by_fd):
            try:
                return torch.load(by_fd, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
        with os.fdopen(os.dup(fd), "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    finally:
        os.close(fd)


def split_state(obj: object, url: str) -> tuple[Split, tuple[dict[str, Any], dict[str, Any]] | None, list[str]]:
    """(weights, the ``optimizer`` field as (tensors, context) or None, dotted paths of the optimizer state
    dicts found). The field is laid out by :mod:`ckptfmt.optimizer_layout`, as every converter lays it out."""
    if not isinstance(obj, Mapping):
        raise SourceFormatError(f"top level is a {type(obj).__name__}; expected a dict of tensors", path=url)
    tree = dict(obj)
    key_paths = find_optimizers(tree)
    names = [".".join(str(k) for k in p) for p in key_paths]
    if key_paths == [()]:
        return Split(), split_optimizers([tree], [url]), names
    optimizers = [pop_path(tree, p) for p in key_paths]
    weights = split_tree(tree)
    if not optimizers:
        return weights, None, names
    return weights, split_optimizers(optimizers, [f"{url}: {name}" for name in names]), names


def read_pt(src: Location) -> WeightsSource:
    """The ``weights`` field (and ``optimizer``, when the file holds an optimizer state dict) of a state-dict
    file (``src``, or the one in the directory ``src``), every tensor loaded (memory-mapped when local)."""
    loc = find_file(src)
    weights, optimizer, opt_paths = split_state(load(loc), loc.url)
    if "aliases" not in weights.rest:  # a tensor under several names (tied weights) is stored once
        weights.tensors, aliases = dedupe(weights.tensors)
        if aliases:
            weights.rest["aliases"] = aliases
    parts = {"weights": (weights.tensors, weights.rest)} | ({"optimizer": optimizer} if optimizer else {})
    check_expansion((t for tensors, _ in parts.values() for t in tensors.values()), loc.url)
    return WeightsSource(
        url=loc.url,
        fields={
            field: SourceField(tensors=[loaded(name, t) for name, t in tensors.items()], context=context)
            for field, (tensors, context) in parts.items()
        },
        provenance={"optimizer_keys": opt_paths} if opt_paths else {},
    )


import_pt = importer("pt", read_pt)
