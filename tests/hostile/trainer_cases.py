"""The Trainer's ``training_args.bin`` as a fuzz target (issue 23): the pickle-opcode decoder of
``ckptfmt/convert/training_args.py`` (with ``pickle_scan.py``) and the bounded walk of ``ckptfmt/convert/bounded.py``.

The seed (:func:`.seeds.training_args_pickle`) is a ``TrainingArguments`` pickle as torch.save writes it, in a
torch zip archive or bare. Mutants: the generic pickle mutations (:func:`.mutators.mutate_pickle`: opcodes
truncated, deleted, integers and strings changed, foreign globals, BUILD on a class), and values spliced into
the object's state: shared references expanding past any bound (a "billion laughs" of memo GETs), a list or
dict containing itself, nesting far past any depth, lone surrogates in keys and values, integers at and past
64 bits where a count is read (``gradient_accumulation_steps``), NaN, bytes, persistent ids. Read alone
(``read_training_args``) and through a whole Trainer import (``convert --from hf-trainer``, API and CLI).
"""

from __future__ import annotations

import io
import struct
import zipfile
from random import Random

from .mutators import BOUNDARY_INTS, Symlink, Tree, guarded, mutate_pickle, mutate_pt, mutate_tree
from .seeds import seeds, training_args_pickle, training_args_zip
from .sentinel import Sandbox
from .targets import Case

ARGS = "training_args.bin"


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _laughs(levels: int, width: int) -> bytes:
    """A list of ``width`` references to a list of ``width`` references ... ``levels`` deep (memo GETs)."""
    out = b"]q\x00"
    for k in range(1, levels + 1):
        out += b"(" + (b"h" + bytes([k - 1])) * width + b"lq" + bytes([k])
    return out


def _value(rng: Random) -> bytes:
    """A crafted value: what a TrainingArguments never holds, and a reader must bound or refuse."""
    return rng.choice(
        (
            lambda: _laughs(rng.choice((8, 12, 30, 200)), rng.choice((2, 8))),
            lambda: b"]q\x00h\x00a",  # a list containing itself
            lambda: b"}q\x00X\x01\x00\x00\x00ah\x00s",  # a dict containing itself
            lambda: b"]" * (n := rng.choice((20, 70, 5000, 200_000))) + b"a" * (n - 1),  # nested n deep
            lambda: _text(rng.choice(("\ud800", "a\udfffb", "\x00", "é" * 3))),
            lambda: _int(rng.choice((2**64 - 1, 2**64, 2**63, -(2**63) - 1, 2**70, -1, 0))),
            lambda: b"J" + struct.pack("<i", rng.choice(BOUNDARY_INTS) & 0x7FFFFFFF),
            lambda: b"G" + struct.pack(">d", rng.choice((float("nan"), float("inf"), -0.0, 1e308))),
            lambda: b"C\x04\x00\x01\x02\x03",  # bytes
            lambda: b"N\x94" + b"h\x00" * 3 + b"\x87",  # MEMOIZE, then a tuple of three GETs
            lambda: _text("x") + b"Q",  # BINPERSID
            lambda: b"ctransformers.trainer_utils\nIntervalStrategy\n" + _int(2**64) + b"\x85R",
        )
    )()


def mutate_args_pickle(data: bytes, rng: Random) -> bytes:
    if rng.random() < 0.4 or not data.endswith(b"ub."):
        return guarded(mutate_pickle, data, rng)
    key = rng.choice(
        ("gradient_accumulation_steps", "per_device_train_batch_size", "optim", "laughs", "\ud800", "x_token", "_p")
    )
    return data[:-3] + _text(key) + _value(rng) + data[-3:]


def mutate_training_args(data: bytes, rng: Random) -> bytes:
    """``training_args.bin``: its pickle mutated inside the zip (mostly), the archive itself, or a bare pickle."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pickled = z.read("training_args/data.pkl")
    except Exception:
        return guarded(mutate_args_pickle, data, rng)
    op = rng.random()
    if op < 0.7:
        return training_args_zip(mutate_args_pickle(pickled, rng))
    if op < 0.85:
        return guarded(mutate_pt, data, rng)
    return mutate_args_pickle(pickled, rng)  # a bare pickle, not a zip archive


def make_args_case(rng: Random) -> Case:
    data = training_args_zip(training_args_pickle())
    for _ in range(rng.choice((1, 1, 2))):
        data = mutate_training_args(data, rng)
    return Case(tree={ARGS: data}, args=("hf-trainer",))


def make_trainer_case(rng: Random) -> Case:
    tree = dict(seeds()["hf-trainer"])
    if rng.random() < 0.7:
        data = tree[ARGS]
        assert isinstance(data, bytes)
        tree[ARGS] = mutate_training_args(data, rng)
    else:
        tree = mutate_tree(tree, rng)
    dest: Tree = {"out/weights": Symlink("sentinel-dir")} if rng.random() < 0.05 else {}
    return Case(tree=tree, dest=dest, args=("hf-trainer",))


def read_args(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.convert.base import locate
    from ckptfmt.convert.training_args import read_training_args

    assert box is not None
    read_training_args(locate(str(box.root)).join(ARGS))
