"""The ``optimizer`` field's layout: how an optimizer's state dict is stored, and how it comes back.

This module is the one owner of that layout. :mod:`ckptfmt.torch` (saving and restoring a live
optimizer) and the converters (:mod:`ckptfmt.convert`, reading and writing other formats' optimizer
files) both build and take the field through it, so the two cannot drift apart. torch is imported
only when tensors are made.

An optimizer state dict (``{"state": {param: {key: value}}, "param_groups": [...]}``) is stored as:

- tensors, one per (parameter, key) holding a tensor, named by the key scheme ``keys``:
  ``"index"``: ``state.<index>.<key>`` (the parameter's number in the state dict);
  ``"fqn"``: ``<parameter name>/<key>`` (survives a change of parallelism);
- the field's context: ``keys`` (the scheme; absent means ``"index"``: what converters wrote before
  this module owned the layout, and what ckptfmt.torch wrote before it keyed by name; both still read),
  ``param_groups`` (as saved, tuples as lists), ``scalars`` (per parameter, the non-tensor state:
  ``{"0": {"step": 3}}``), and optionally ``class`` (the optimizer's class name, which a restore checks)
  and ``extra`` (other top-level keys of a foreign state dict, given back on export).

Several optimizers in one field (a Lightning or Accelerate source) are stored with their tensors
prefixed ``<i>/`` and the context ``{"optimizers": [context, ...]}``, one per optimizer.

Read, not written: the layout ckptfmt's ``.pt`` import wrote before it went through this module, where
the context was the state dict less its tensors (``{"param_groups": [...], "state": {"0": {"step": 3}}, ...}``: no
``keys``, no ``scalars``) and several optimizers were keyed by their dotted path in the file
(tensors ``<path>.state.0.exp_avg``, context ``{<path>: {...}}``). :func:`parts` reads it as the
layout above (:func:`upgrade`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .arrays import torchify
from .errors import ContextError, UsageError

INDEX = "index"
FQN = "fqn"
SCHEMES = (INDEX, FQN)


def tensor_name(param: object, key: object, keys: str) -> str:
    """The stored name of parameter ``param``'s state tensor ``key`` under the key scheme ``keys``."""
    return f"{param}/{key}" if keys == FQN else f"state.{param}.{key}"


def parse_tensor_name(name: str, keys: str) -> tuple[str, str]:
    """(parameter, key) of a stored tensor name: the inverse of :func:`tensor_name`."""
    if keys == FQN:
        param, _, key = name.rpartition("/")
        return param, key
    _, param, key = name.split(".", 2)
    return param, key


def key_scheme(context: Mapping[str, Any]) -> str:
    """The key scheme a stored context names; absent: ``"index"`` (older writers recorded none)."""
    keyed = context.get("keys", INDEX)
    if keyed not in SCHEMES:
        raise ContextError(f"unknown optimizer key scheme {keyed!r}", field="optimizer")
    return str(keyed)


def split_state(
    state: Mapping[Any, Mapping[Any, Any]],
    keys: str,
    *,
    is_tensor: Callable[[object], bool],
    tensor: Callable[[str, Any], Any],
    value: Callable[[object, str], object],
) -> tuple[dict[str, Any], dict[str, dict[str, object]]]:
    """A state dict's ``state`` as (stored tensors by name, ``scalars``).

    ``tensor(name, t)`` gives what to store for a tensor (a host copy, or the tensor itself) and
    ``value(v, where)`` a non-tensor value as a context value (``where``: ``<param>.<key>``), raising
    the caller's error.
    """
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, object]] = {}
    for param, entry in state.items():
        for key, item in entry.items():
            name = tensor_name(param, key, keys)
            if is_tensor(item):
                tensors[name] = tensor(name, item)
            else:
                scalars.setdefault(str(param), {})[str(key)] = value(item, f"{param}.{key}")
    return tensors, scalars


def context(
    *, keys: str, param_groups: object, scalars: Mapping[str, object], cls: str | None = None, extra: object = None
) -> dict[str, Any]:
    """The field's context, its keys in one order whoever writes it."""
    out: dict[str, Any] = {} if cls is None else {"class": cls}
    out |= {"keys": keys, "param_groups": param_groups, "scalars": dict(scalars)}
    return out | ({"extra": extra} if extra else {})


def join_state(
    tensors: Mapping[str, Any], context: Mapping[str, Any], to_tensor: Callable[[Any], Any]
) -> dict[str, dict[str, Any]]:
    """The stored tensors and ``scalars`` back into ``{param: {key: value}}``, params as stored (strings).

    Non-tensor state may hold arrays inside lists (LBFGS's history): they come back as tensors too.
    """
    keys = key_scheme(context)
    state: dict[str, dict[str, Any]] = {}
    for name, array in tensors.items():
        param, key = parse_tensor_name(name, keys)
        state.setdefault(param, {})[key] = to_tensor(array)
    for param, entries in dict(context.get("scalars") or {}).items():
        state.setdefault(str(param), {}).update(torchify(entries))
    return state


def check_class(context: Mapping[str, Any], name: str) -> None:
    """Refuse restoring state saved from another optimizer class into an optimizer of class ``name``.

    A context that names no class was converted from a file that does not say (a ``.pt`` or Lightning
    state dict): it is taken as the caller's, the param groups still checked by the caller.
    """
    saved = context.get("class")
    if saved is not None and saved != name:
        raise UsageError(f"checkpoint holds {saved} state, the optimizer is {name}")


def param_groups(groups: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Stored param groups as torch's optimizers take them."""
    # msgpack turns tuples (betas) into lists; torch's optimizers accept either, but keep them tuples
    return [{k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.items()} for g in groups or []]


def merge(parts: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Several optimizers' (tensors, context) as one field: one optimizer is stored as it is."""
    if len(parts) == 1:
        return dict(parts[0][0]), dict(parts[0][1])
    tensors: dict[str, Any] = {}
    contexts: list[Mapping[str, Any]] = []
    for i, (mine, ctx) in enumerate(parts):
        tensors |= {f"{i}/{k}": v for k, v in mine.items()}
        contexts.append(ctx)
    return tensors, ({"optimizers": contexts} if contexts else {})


def parts(
    tensors: Mapping[str, Any], context: Mapping[str, Any], order: Sequence[str] = ()
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The inverse of :func:`merge`: each optimizer's (tensors, context); none for an empty field.

    A field in the ``.pt`` import's former layout comes back in this one (:func:`upgrade`, ``order``).
    """
    legacy = upgrade(tensors, context, order)
    if legacy is not None:
        return legacy
    if "optimizers" in context:
        out = []
        for i, ctx in enumerate(context["optimizers"]):
            mine = {k.partition("/")[2]: v for k, v in tensors.items() if k.partition("/")[0] == str(i)}
            out.append((mine, dict(ctx)))
        return out
    if tensors or context.get("param_groups"):  # an empty field: the source had no optimizer
        return [(dict(tensors), dict(context))]
    return []


_CURRENT = ("keys", "scalars", "optimizers")


def upgrade(
    tensors: Mapping[str, Any], context: Mapping[str, Any], order: Sequence[str] = ()
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """Each optimizer's (tensors, context) of a field in the ``.pt`` import's former layout; None for any other.

    That layout is the one whose context holds none of ``keys``, ``scalars`` and ``optimizers``: either one
    state dict less its tensors (``param_groups``, non-tensor ``state``, other keys), or several keyed by
    their dotted path in the file, each such (their tensors prefixed ``<path>.``). A context's keys come
    back sorted: ``order`` (the provenance's ``optimizer_keys``) gives the paths' order in the file.
    """
    if any(k in context for k in _CURRENT):
        return None
    if "param_groups" in context:
        return [_upgraded(dict(tensors), context)]
    if not context or not all(isinstance(v, Mapping) and "param_groups" in v for v in context.values()):
        return None
    paths = [p for p in order if p in context] + [p for p in context if p not in order]
    return [
        _upgraded({k.removeprefix(f"{p}."): v for k, v in tensors.items() if k.startswith(f"{p}.")}, context[p])
        for p in paths
    ]


def _upgraded(tensors: dict[str, Any], old: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    extra = {k: v for k, v in old.items() if k not in ("state", "param_groups")}
    scalars = {str(p): dict(v) for p, v in dict(old.get("state") or {}).items() if isinstance(v, Mapping) and v}
    return tensors, context(keys=INDEX, param_groups=old["param_groups"], scalars=scalars, extra=extra)
