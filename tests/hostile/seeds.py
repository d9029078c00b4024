"""Valid artefacts the mutators start from, built once per process by the library and by torch themselves.

Each seed is a :data:`~.mutators.Tree` (relative path -> bytes): a training checkpoint (a chunked tensor, every
context field), a weights checkpoint (an empty tensor, a 0-d one), Hugging Face single-file and sharded layouts,
a ``torch.save`` archive with an optimizer, a DCP directory written by ``torch.distributed.checkpoint.save``,
a run directory written by ``ckptfmt.torch.save`` (two committed checkpoints, ``latest.json``, ``pins.json``,
a dead writer's remains, and a user's own directory that is not the run's to delete), a checkpoint compressed
with the ``zstd`` codec (several frames per chunk: byte-grouped fp32/bf16/fp64, ungrouped fp8, a chunked
tensor), a memory directory holding a run's slot ring (spec/memory.md; its run key and run directory are
placeholders a target fills in, see :data:`RUN_KEY`), and a Hugging Face Trainer ``checkpoint-N/`` whose
``training_args.bin`` is a torch archive of a ``TrainingArguments`` pickle (written by hand: no transformers).
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ckptfmt

from .mutators import Tree

PROVENANCE = {"writer": {"name": "hostile", "version": "1"}, "created_at": "2026-01-02T03:04:05Z", "step": 100}
# A user's files inside a run directory: gc must leave them alone (the last one looks like a writer's leftover).
USER_FILES = {"notes/README.txt": b"my notes, not a checkpoint\n", "notes/weights/context.msgpack.bak": b"\x80"}
PROTECTED = {"notes/README.txt": USER_FILES["notes/README.txt"]}
DEAD_LOCK = (
    b'{"host": "%s", "nonce": "00ff00ff00ff00ff", "pid": 999999999, "started_at": "2026-01-01T00:00:00.000000Z"}'
)


# The memory seed's placeholders: the run key directory (run_dir_key of the run URL) and the run directory URL
# in the slots' binding metadata; both name the sandbox's destination, known only when a case runs.
RUN_KEY = "run-KEY"
RUN_DIR = "/RUN-DIR-PLACEHOLDER"
ZSTD_FRAME_BYTES = 2048


def read_tree(path: Path) -> Tree:
    out: Tree = {}
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            full = Path(dirpath) / name
            out[full.relative_to(path).as_posix()] = full.read_bytes()
    return out


def _training(url: str) -> None:
    rng = np.random.default_rng(0)
    with ckptfmt.open_writer(url, profile="training") as w:
        w.write_tensor("weights", "layer0.w", rng.standard_normal((4, 3)).astype(np.float32))
        w.write_tensor("weights", "layer0.b", rng.standard_normal(3).astype(ml_dtypes.bfloat16))
        exp_avg = rng.standard_normal((4, 3)).astype(np.float32)
        for start in (0, 2):
            w.write_tensor(
                "optimizer", "layer0.w.exp_avg", exp_avg[start : start + 2], global_shape=(4, 3), offsets=(start, 0)
            )
        w.write_tensor("optimizer", "step", np.array(7, dtype=np.int64))
        w.write_context("optimizer", {"param_groups": [{"lr": 0.001, "params": ["layer0.w", "layer0.b"]}]})
        w.write_context(
            "rng",
            {
                "generators": {
                    "numpy": {"kind": "numpy.bit_generator", "state": np.random.PCG64(0).state},
                    "legacy": {"kind": "numpy.legacy", "state": {"key": np.arange(4, dtype=np.uint32), "pos": 3}},
                }
            },
        )
        w.write_context("data", {"epoch": 1, "global_sample_offset": 4096, "shard_offsets": {"shard-0": 12}})
        w.write_config({"model": {"layers": 1, "hidden": 3}, "lr": 0.001, "seed": 0})
        w.write_context("topology", {"world_size": 1, "rank": 0})
        w.write_context("provenance", PROVENANCE)


def _weights(url: str) -> None:
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "w", np.arange(6, dtype=np.float32).reshape(2, 3))
        w.write_tensor("weights", "empty", np.zeros((0, 4), dtype=np.float16))
        w.write_tensor("weights", "scalar", np.array(3, dtype=np.int32))
        w.write_context("provenance", PROVENANCE)


def _torch_state() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def new_model() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _pt(path: Path) -> None:
    import torch

    model, optimizer = _torch_state()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)


def _dcp(path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    model, _ = _torch_state()
    state: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state["emb"] = torch.randn(3, 2).to(torch.bfloat16)
    state["epoch"] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process, no process group: intended
        dcp.save(state, checkpoint_id=str(path))  # type: ignore[attr-defined]


def _run_dir(path: Path) -> None:
    import socket

    import ckptfmt.torch as ct
    from ckptfmt.run import RunDirectory
    from ckptfmt.torch import ResumableSampler

    model, optimizer = _torch_state()
    run = RunDirectory(str(path))
    for step in (1, 2):
        sampler = ResumableSampler(12, seed=0, rank=0, world_size=1)
        name = f"step-{step:09d}"
        ckpt_id = ct.save(
            str(path / name), step=step, model=model, optimizer=optimizer, sampler=sampler, config={"lr": 1}
        )
        run.set_latest(name, step, ckpt_id)
    run.set_pinned(["step-000000001"])
    dead = path / "step-000000003"
    (dead / "weights").mkdir(parents=True)
    (dead / ".writer-lock").write_bytes(DEAD_LOCK % socket.gethostname().encode())
    (dead / "weights" / "r00000-00000.safetensors").write_bytes(b"\x00" * 16)
    for rel, data in USER_FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)


def _zstd(url: str) -> None:
    from ckptfmt.codecs import WriteCodec
    from ckptfmt.codecs.zstd import ZstdOptions

    rng = np.random.default_rng(1)
    codec = WriteCodec(name="zstd", options=ZstdOptions(frame_bytes=ZSTD_FRAME_BYTES))
    with ckptfmt.open_writer(url, profile="weights", codec=codec) as w:  # type: ignore[arg-type]
        w.write_tensor("weights", "a", rng.standard_normal((32, 48)).astype(np.float32))
        w.write_tensor("weights", "b", rng.standard_normal(3000).astype(ml_dtypes.bfloat16))
        w.write_tensor("weights", "c", rng.standard_normal(5000).astype(ml_dtypes.float8_e4m3fn))
        d = rng.standard_normal((64, 40))
        for start in (0, 32):
            w.write_tensor("weights", "d", d[start : start + 32], global_shape=(64, 40), offsets=(start, 0))
        w.write_tensor("weights", "small", np.arange(6, dtype=np.float32))  # raw: too small to compress
        w.write_context("provenance", PROVENANCE)


def zstd_arrays() -> dict[str, np.ndarray[Any, Any]]:
    """The zstd seed's tensors, as written: what a read that returns must return."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 48)).astype(np.float32)
    b = rng.standard_normal(3000).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal(5000).astype(ml_dtypes.float8_e4m3fn)
    d = rng.standard_normal((64, 40))
    return {"a": a, "b": b, "c": c, "d": d, "small": np.arange(6, dtype=np.float32)}


def _memory(path: Path) -> None:
    """Two committed slots of one run (steps 5 and 6), bound to the placeholder run directory."""
    from ckptfmt.tier import SlotBinding

    rng = np.random.default_rng(2)
    for index, step in ((0, 6), (1, 5)):
        binding = SlotBinding(run_id="run-dir:" + RUN_DIR, run_dir=RUN_DIR, node="node-a", world_size=1, step=step)
        with ckptfmt.open_writer(
            str(path / RUN_KEY / f"slot-{index}"), profile="weights", metadata=binding.to_metadata()
        ) as w:
            w.write_tensor("weights", "w", rng.standard_normal((4, 3)).astype(np.float32))
            w.write_context("provenance", {**PROVENANCE, "step": step})


TRAINING_ARGS_STATE: dict[str, Any] = {
    "output_dir": "out",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "learning_rate": 0.001,
    "optim": "adamw_torch",
    "hub_token": "secret",
    "lr_scheduler_kwargs": {"power": 1.0},
    "report_to": ["none"],
}


def training_args_pickle(state: dict[str, Any] | None = None) -> bytes:
    """A pickled ``TrainingArguments`` as torch.save writes one (NEWOBJ of the class, BUILD of its __dict__, an
    enum as a call of its class with its value), made without transformers: nothing here is ever unpickled."""
    import pickle
    import pickletools

    def plain(value: Any) -> bytes:
        return pickle.dumps(value, protocol=2)[2:-1]  # no PROTO, no STOP

    body = b""
    for key, value in (state or TRAINING_ARGS_STATE).items():
        body += plain(key) + plain(value)
    body += plain("eval_strategy") + b"ctransformers.trainer_utils\nIntervalStrategy\n" + plain("steps") + b"\x85R"
    head = b"\x80\x02ctransformers.training_args\nTrainingArguments\n)\x81}("
    return pickletools.optimize(head + body + b"ub.")


def training_args_zip(pickled: bytes) -> bytes:
    """``training_args.bin`` as torch.save writes it: a zip archive whose ``<name>/data.pkl`` holds the pickle."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("training_args/data.pkl", pickled)
        z.writestr("training_args/byteorder", b"little")
        z.writestr("training_args/version", b"3\n")
    return out.getvalue()


def _hf_trainer(path: Path, weights: Tree) -> None:
    import json
    import random

    import torch

    _, optimizer = _torch_state()
    path.mkdir()
    for name, data in weights.items():
        if isinstance(data, bytes):
            (path / name).write_bytes(data)
    torch.save(optimizer.state_dict(), path / "optimizer.pt")
    rng_state = {"python": random.Random(0).getstate(), "numpy": np.random.RandomState(0).get_state()}
    torch.save({**rng_state, "cpu": torch.random.get_rng_state()}, path / "rng_state.pth")
    state = {"global_step": 3, "epoch": 1.0, "train_batch_size": 2, "max_steps": 6, "log_history": []}
    (path / "trainer_state.json").write_text(json.dumps(state))
    (path / "training_args.bin").write_bytes(training_args_zip(training_args_pickle()))


@functools.lru_cache(maxsize=1)
def seeds() -> dict[str, Tree]:
    """Every seed tree, by name."""
    from ckptfmt.convert import convert

    out: dict[str, Tree] = {}
    with tempfile.TemporaryDirectory(prefix="ckptfmt-seeds-") as tmp:
        base = Path(tmp)
        _training(str(base / "training"))
        _weights(str(base / "weights"))
        convert(str(base / "weights"), str(base / "hf-single"), to="hf")
        convert(str(base / "training"), str(base / "hf-sharded"), to="hf", max_shard_size=40)
        _pt(base / "model.pt")
        _dcp(base / "dcp")
        _run_dir(base / "run")
        _zstd(str(base / "zstd"))
        _memory(base / "memory")
        for name in ("training", "weights", "hf-single", "hf-sharded", "dcp", "run", "zstd", "memory"):
            out[name] = read_tree(base / name)
        out["pt"] = {"model.pt": (base / "model.pt").read_bytes()}
        _hf_trainer(base / "hf-trainer", out["hf-single"])
        out["hf-trainer"] = read_tree(base / "hf-trainer")
    return out


@functools.cache
def seed_bytes(kind: str) -> list[bytes]:
    """Every seed file of one kind (see mutators.kind_of), for the byte-level parser targets."""
    from .mutators import kind_of

    found = []
    for tree in seeds().values():
        for path, data in sorted(tree.items()):
            if isinstance(data, bytes) and kind_of(path) == kind:
                found.append(data)
    return found
