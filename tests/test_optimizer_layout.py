"""The optimizer field's layout (:mod:`ckptfmt.optimizer_layout`), shared by ckptfmt.torch and the converters."""

from __future__ import annotations

import numpy as np
import pytest

from ckptfmt import optimizer_layout as layout
from ckptfmt.errors import ContextError, UsageError


@pytest.mark.parametrize("keys", layout.SCHEMES)
def test_tensor_names_round_trip(keys: str) -> None:
    for param in ("0", "12", "layer.0.weight"):
        if keys == layout.INDEX and not param.isdigit():
            continue
        for key in ("exp_avg", "momentum_buffer", "a.b"):
            assert layout.parse_tensor_name(layout.tensor_name(param, key, keys), keys) == (param, key)


def test_key_scheme_defaults_to_index_and_refuses_unknown() -> None:
    assert layout.key_scheme({}) == layout.INDEX  # what converters before the key schemes wrote
    assert layout.key_scheme({"keys": "fqn"}) == layout.FQN
    with pytest.raises(ContextError):
        layout.key_scheme({"keys": "bogus"})


def test_split_then_join_state() -> None:
    state = {0: {"step": 3, "exp_avg": np.ones(2, np.float32)}, 1: {"exp_avg": np.zeros(1, np.float32)}}
    tensors, scalars = layout.split_state(
        state,
        layout.INDEX,
        is_tensor=lambda v: isinstance(v, np.ndarray),
        tensor=lambda _, t: t,
        value=lambda v, where: v,
    )
    assert sorted(tensors) == ["state.0.exp_avg", "state.1.exp_avg"]
    assert scalars == {"0": {"step": 3}}
    context = layout.context(keys=layout.INDEX, param_groups=[{"params": [0, 1]}], scalars=scalars)
    assert list(context) == ["keys", "param_groups", "scalars"]
    joined = layout.join_state(tensors, context, lambda a: a)
    assert joined["0"]["step"] == 3 and joined["0"]["exp_avg"] is tensors["state.0.exp_avg"]


def test_merge_and_parts_are_inverse() -> None:
    one = ({"state.0.a": 1}, {"keys": "index", "param_groups": [{}]})
    two = ({"state.0.b": 2}, {"keys": "index", "param_groups": [{}]})
    assert layout.parts(*layout.merge([one])) == [one]
    tensors, context = layout.merge([one, two])
    assert tensors == {"0/state.0.a": 1, "1/state.0.b": 2}
    assert layout.parts(tensors, context) == [one, two]
    assert layout.merge([]) == ({}, {})
    assert layout.parts({}, {}) == []


def test_param_groups_keep_betas_a_tuple() -> None:
    assert layout.param_groups([{"betas": [0.9, 0.99], "lr": 1.0}]) == [{"betas": (0.9, 0.99), "lr": 1.0}]


def test_the_class_is_checked_when_the_checkpoint_names_one() -> None:
    layout.check_class({"class": "AdamW"}, "AdamW")
    layout.check_class({}, "SGD")  # converted from a file that names none (.pt, Lightning)
    with pytest.raises(UsageError, match="holds AdamW state, the optimizer is SGD"):
        layout.check_class({"class": "AdamW"}, "SGD")


def test_the_former_pt_import_layout_reads_as_this_one() -> None:
    groups = [{"params": [0], "lr": 1.0}]
    one = {"param_groups": groups, "state": {"0": {"note": 5}}, "defaults": 1}
    [(tensors, context)] = layout.parts({"state.0.m": "M"}, one)
    assert tensors == {"state.0.m": "M"}
    assert context == layout.context(
        keys="index", param_groups=groups, scalars={"0": {"note": 5}}, extra={"defaults": 1}
    )
    several = {"a.b": {"param_groups": groups}, "c": {"param_groups": groups}}
    found = layout.parts({"a.b.state.0.m": 1, "c.state.0.m": 2}, several, order=["c", "a.b"])
    assert [t for t, _ in found] == [{"state.0.m": 2}, {"state.0.m": 1}]
    current = layout.context(keys="index", param_groups=groups, scalars={})
    assert layout.upgrade({}, current) is None and layout.upgrade({}, {}) is None
