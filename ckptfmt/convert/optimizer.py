"""Foreign optimizer state dicts (``optimizer.pt``, ``optimizer_states``, ``optimizer.bin``) into the
``optimizer`` field and back.

The layout itself belongs to :mod:`ckptfmt.optimizer_layout`, which :mod:`ckptfmt.torch` uses too: a
converted checkpoint resumes through ``ckptfmt.torch.load`` and a saved one exports to any trainer.
Here a foreign file is checked (it must be a state dict; a value with no context equivalent names
the file) and written in the ``index`` key scheme, the one whose names a state dict already has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .. import optimizer_layout as layout
from ..arrays import as_array, to_torch
from ..errors import SourceFormatError, UsageError
from .bounded import check_expansion


def split_optimizer(state: object, url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict as the field stores it: (tensors ``state.<param>.<key>``, context)."""
    from .torch_bridge import context_value, is_optimizer_state, is_tensor

    if not is_optimizer_state(state):
        raise SourceFormatError("not an optimizer state dict ({'state': ..., 'param_groups': ...})", path=url)
    assert isinstance(state, Mapping)
    for pid, entry in state["state"].items():
        if not isinstance(entry, Mapping):
            raise SourceFormatError(f"state of parameter {pid!r} is a {type(entry).__name__}, not a dict", path=url)
    # tensors inside a parameter's other state (LBFGS keeps its history in lists of them) are stored as arrays
    # in ``scalars``, as ckptfmt.torch stores them: bounded like the field's own tensors before any is copied
    check_expansion((t for e in state["state"].values() for v in e.values() for t in _inside(v)), url)
    tensors, scalars = layout.split_state(
        state["state"],
        layout.INDEX,
        is_tensor=is_tensor,
        tensor=lambda _, tensor: tensor,
        value=lambda value, where: _state_value(value, f"{url}: state.{where}"),
    )
    groups = context_value(state["param_groups"], f"{url}: param_groups")
    extra = {str(k): context_value(v, f"{url}: {k}") for k, v in state.items() if k not in ("state", "param_groups")}
    return tensors, layout.context(keys=layout.INDEX, param_groups=groups, scalars=scalars, extra=extra)


def _inside(value: object) -> Iterator[Any]:
    """The torch tensors inside the lists of a non-tensor state value (its depth is bounded by check_graph)."""
    from .torch_bridge import is_tensor

    if isinstance(value, (list, tuple)):
        for item in value:
            yield from [item] if is_tensor(item) else _inside(item)


def _state_value(value: object, where: str) -> object:
    """A parameter's non-tensor state as a context value, tensors in its lists as arrays."""
    from .torch_bridge import context_value, is_tensor

    if isinstance(value, (list, tuple)) and any(True for _ in _inside(value)):
        return [as_array(v)[0] if is_tensor(v) else _state_value(v, f"{where}.{i}") for i, v in enumerate(value)]
    return context_value(value, where)


def split_optimizers(states: Sequence[object], urls: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Several optimizers' state dicts (a Lightning or Accelerate source) as one field."""
    return layout.merge([split_optimizer(state, url) for state, url in zip(states, urls, strict=True)])


def join_optimizer(tensors: Mapping[str, Any], context: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_optimizer`: a state dict ``optimizer.load_state_dict`` takes.

    Also takes :mod:`ckptfmt.torch`'s state keyed by parameter name (``keys: fqn``): with no model at
    hand, parameters are numbered in param-group order, as ``Optimizer.state_dict`` does.
    """
    groups = layout.param_groups(context.get("param_groups"))
    index: dict[str, int] = {}
    by_name = layout.key_scheme(context) == layout.FQN
    if by_name:
        index = {str(p): i for i, p in enumerate(p for g in groups for p in g.get("params", []))}
        groups = [{**g, "params": [index[str(p)] for p in g.get("params", [])]} for g in groups]

    def pid_of(name: str) -> int:
        if not by_name:
            return int(name)
        if name not in index:
            raise UsageError(f"optimizer state for parameter {name!r}, which no param group lists")
        return index[name]

    stored = layout.join_state(tensors, context, lambda array: to_torch(array).clone())
    state: dict[int, dict[str, Any]] = {}
    for param, entries in stored.items():
        state.setdefault(pid_of(param), {}).update(entries)
    extra = {k: v for k, v in dict(context.get("extra") or {}).items() if k not in ("state", "param_groups")}
    return {"state": state, "param_groups": groups, **extra}


def join_optimizers(
    tensors: Mapping[str, Any], context: Mapping[str, Any], order: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each optimizer's state dict from the field (none when it is empty); ``order``: see :func:`layout.parts`."""
    return [join_optimizer(mine, ctx) for mine, ctx in layout.parts(tensors, context, order)]
