"""Canonical JSON of configs (JCS with exact integers and code point key order) and the config hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt.canonical import canonical_json, config_hash, config_to_dict, format_number, manifest_bytes
from ckptfmt.errors import ContextError

# ---------------------------------------------------------------- numbers (ECMAScript Number::toString)

NUMBERS = [
    (1.0, "1"),
    (0.0, "0"),
    (-0.0, "0"),
    (-1.0, "-1"),
    (1.5, "1.5"),
    (0.1, "0.1"),
    (100.0, "100"),
    (1e20, "100000000000000000000"),
    (1e21, "1e+21"),
    (1.5e21, "1.5e+21"),
    (123456789012345680000.0, "123456789012345680000"),
    (1e-6, "0.000001"),
    (1e-7, "1e-7"),
    (1.25e-7, "1.25e-7"),
    (0.000123, "0.000123"),
    (333333333.3333333, "333333333.3333333"),
    (1e30, "1e+30"),
    (4.5, "4.5"),
    (2e-3, "0.002"),
    (1e-27, "1e-27"),
    (5e-324, "5e-324"),
    (1.7976931348623157e308, "1.7976931348623157e+308"),
    (-1.7976931348623157e308, "-1.7976931348623157e+308"),
    (9007199254740992.0, "9007199254740992"),
    (9007199254740994.0, "9007199254740994"),
    (0.30000000000000004, "0.30000000000000004"),
    (295147905179352830000.0, "295147905179352830000"),
]


@pytest.mark.parametrize(("value", "text"), NUMBERS, ids=[t for _, t in NUMBERS])
def test_number_formatting(value: float, text: str) -> None:
    assert format_number(value) == text
    assert canonical_json(value) == text.encode()


def _stable_id(value: object) -> str:
    """repr, but the same in every process (pytest-xdist compares the workers' collections): no addresses."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_have_no_canonical_form(value: float) -> None:
    with pytest.raises(ContextError):
        canonical_json({"x": value})


NUMBER_GRAMMAR = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?(e[+-][1-9][0-9]*)?")


@settings(max_examples=2000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_number_formatting_round_trips_and_follows_the_grammar(value: float) -> None:
    text = format_number(value)
    assert float(text) == value  # exact: shortest round-trip digits
    assert NUMBER_GRAMMAR.fullmatch(text), text
    magnitude = abs(value)
    uses_exponent = "e" in text
    assert uses_exponent == (magnitude != 0 and (magnitude >= 1e21 or magnitude < 1e-6))
    digits = text.lstrip("-").split("e")[0].replace(".", "").strip("0")
    assert len(digits) <= len(repr(magnitude).split("e")[0].replace(".", "").strip("0")) or magnitude == 0


# ---------------------------------------------------------------- structure, key order, escapes


def test_key_order_is_code_point_order() -> None:
    value = {"b": 1, "a": 2, "aa": 3, "B": 4, "é": 5, "\uffff": 6, "😀": 7, "": 8, "a\x00": 9}
    text = canonical_json(value).decode()
    keys = [k for k in json.loads(text, object_pairs_hook=lambda pairs: [p[0] for p in pairs])]
    assert keys == ["", "B", "a", "a\x00", "aa", "b", "é", "\uffff", "😀"]
    # U+FFFF before U+1F600: code point order, where JCS's UTF-16 order would put the emoji first


def test_nested_keys_are_sorted_and_there_is_no_whitespace() -> None:
    value = {"z": {"y": [1, {"b": None, "a": True}], "x": False}, "a": []}
    assert canonical_json(value) == b'{"a":[],"z":{"x":false,"y":[1,{"a":true,"b":null}]}}'


def test_string_escapes() -> None:
    value = '"\\\b\f\n\r\t\x01\x1f\x7f é\u2028😀/'
    expected = '"\\"\\\\\\b\\f\\n\\r\\t\\u0001\\u001f\x7f é\u2028😀/"'
    assert canonical_json(value) == expected.encode("utf-8")


def test_rfc8785_example() -> None:
    source = (
        '{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],'
        '"string":"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        '"literals":[null,true,false]}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical_json(json.loads(source)) == expected.encode("utf-8")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (2**64 + 1, "18446744073709551617"),
        (-(2**70), "-1180591620717411303424"),
        (2**53 + 1, "9007199254740993"),  # a double would round this
        (True, "true"),
        (None, "null"),
        ((1, (2,)), "[1,[2]]"),
        (np.int64(-3), "-3"),
        (np.float32(0.5), "0.5"),
        (np.bool_(False), "false"),
    ],
    ids=repr,
)
def test_exact_integers_and_other_values(value: object, text: str) -> None:
    assert canonical_json(value) == text.encode()


@pytest.mark.parametrize("value", [{1: "a"}, {"s": {1, 2}}, {"b": b"bytes"}, {"o": object()}, "\ud800"], ids=_stable_id)
def test_values_without_a_json_form_are_refused(value: object) -> None:
    with pytest.raises(ContextError):
        canonical_json(value)


def test_manifest_bytes_are_the_documented_python_form() -> None:
    doc = {"b": [1, {"z": "é\n"}], "a": "x"}
    assert manifest_bytes(doc) == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert manifest_bytes(doc) == canonical_json(doc)  # they agree where the manifest's values live


# ---------------------------------------------------------------- the config hash


@dataclasses.dataclass
class Optim:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)


@dataclasses.dataclass
class Config:
    name: str = "gpt"
    layers: int = 12
    seed: int = 2**63 + 5
    optim: Optim = dataclasses.field(default_factory=Optim)
    tags: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])


CONFIG_DICT = {
    "tags": ["a", "b"],
    "optim": {"betas": [0.9, 0.95], "lr": 3e-4},
    "seed": 2**63 + 5,
    "layers": 12,
    "name": "gpt",
}


def test_config_hash_of_a_dataclass_equals_that_of_the_dict() -> None:
    assert config_hash(Config()) == config_hash(CONFIG_DICT)
    assert config_to_dict(Config()) == {**CONFIG_DICT, "optim": {"lr": 3e-4, "betas": (0.9, 0.95)}}


def test_config_hash_is_sha256_of_canonical_json() -> None:
    expected = hashlib.sha256(canonical_json(CONFIG_DICT)).hexdigest()
    assert config_hash(CONFIG_DICT) == f"sha256:{expected}"
    canonical = canonical_json(CONFIG_DICT)
    assert canonical == (
        b'{"layers":12,"name":"gpt","optim":{"betas":[0.9,0.95],"lr":0.0003},'
        b'"seed":9223372036854775813,"tags":["a","b"]}'
    )


def test_config_hash_worked_example() -> None:
    # A fixed vector other implementations can check against.
    config = {"lr": 1.0, "big": 1e21, "small": 1e-7, "name": "x"}
    assert canonical_json(config) == b'{"big":1e+21,"lr":1,"name":"x","small":1e-7}'
    digest = hashlib.sha256(b'{"big":1e+21,"lr":1,"name":"x","small":1e-7}').hexdigest()
    assert config_hash(config) == f"sha256:{digest}"


def test_config_hash_ignores_key_order_and_int_valued_float_spelling() -> None:
    assert config_hash({"a": 1, "b": 2}) == config_hash({"b": 2, "a": 1})
    assert config_hash({"lr": 1.0}) == config_hash({"lr": 1})  # both are the JSON number 1


def test_config_hash_changes_with_content() -> None:
    assert config_hash({"lr": 0.1}) != config_hash({"lr": 0.2})
    assert config_hash(Config()) != config_hash(Config(layers=13))


@pytest.mark.parametrize("config", [[1, 2], "text", 3, Config], ids=repr)
def test_config_must_be_a_mapping_or_dataclass_instance(config: object) -> None:
    with pytest.raises(ContextError):
        config_hash(config)
