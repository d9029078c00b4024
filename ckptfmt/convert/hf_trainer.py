"""Hugging Face ``Trainer`` checkpoint directories (``checkpoint-N/``) into the training profile, and back.

What a Trainer checkpoint holds, and where each ckptfmt field comes from:

=====================  ==================================================  ==================
source file            what                                                field
=====================  ==================================================  ==================
``model.safetensors``  weights, single or sharded (``pytorch_model.bin``   ``weights``
                       and its shards too, loaded weights_only)
``optimizer.pt``       ``optimizer.state_dict()``                          ``optimizer``
``rng_state.pth``      Python, numpy, torch CPU and CUDA generators        ``rng``
(``rng_state_<r>.pth``  one per process when distributed)
``trainer_state.json`` global step, epoch, log history, batch size         ``data``, ``trainer_state``
``config.json``        the model's config                                  ``config``
``scheduler.pt``       ``lr_scheduler.state_dict()``                       ``scheduler``
``scaler.pt``          ``GradScaler.state_dict()`` (mixed precision)       ``grad_scaler``
``training_args.bin``  ``TrainingArguments``, pickled: opcodes scanned,    ``config``, ``data``
                       never unpickled (see :func:`read_training_args`)
=====================  ==================================================  ==================

Torch files load with ``torch.load(weights_only=True)``; the RNG files hold numpy's legacy state,
so they load under the allow-list the Trainer itself uses (numpy's array reconstructor, ndarray
and dtypes, which build arrays and nothing else). ``training_args.bin`` is never unpickled: its
opcodes are decoded (``pickletools``) and interpreted symbolically, every import and call kept as
an opaque record, so its plain fields (gradient accumulation for the data position, the learning
rate, the optimizer's name...) are read without running anything; ``*_token`` fields are dropped.
When that fails the file is skipped, said in the notes, and one micro-batch per step is assumed.

Export writes the files the Trainer's ``resume_from_checkpoint`` reads, from any training-profile
checkpoint (an imported one round-trips them; one written by :mod:`ckptfmt.torch` gets a minimal
``trainer_state.json`` from its step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..arrays import torchify
from ..canonical import config_hash
from ..errors import CheckpointError, SourceFormatError, UsageError
from . import hf
from .base import ConvertResult, Location, NoProgress, Progress, list_names, locate, refuse_existing
from .optimizer import split_optimizer
from .rng_state import generators_by_rank, rng_generators, trainer_rng_dict
from .torch_files import load_torch_file, plain, read_json, save_torch
from .training import (
    LazySafetensors,
    TrainingSource,
    field_source,
    optimizer_states,
    read_contexts,
    training_importer,
    write_files,
)
from .training_args import TRAINING_ARGS, optimizer_class, read_training_args

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
RNG = "rng_state.pth"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
_RANK_RNG = re.compile(r"rng_state_(\d+)\.pth")


# ---------------------------------------------------------------- import


def _weights(loc: Location, names: Mapping[str, str]) -> tuple[Mapping[str, Any], str]:
    """(tensors by name, the source file(s)): safetensors by byte range, else pytorch_model.bin weights_only."""
    if any(n.endswith(".safetensors") for n in names):
        items, info = hf.plan_read(loc)
        files = sorted({shard.url.rpartition("/")[2] for shard, _, _ in items})
        return LazySafetensors(items), ", ".join(files) if info["layout"] == "sharded" else files[
            0
        ] if files else hf.SINGLE
    if PT_INDEX in names:
        index_url = loc.join(PT_INDEX).url
        index = read_json(loc.join(PT_INDEX), "weights index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise SourceFormatError("index has no 'weight_map' object", path=loc.join(PT_INDEX).url)
        shards = sorted({str(v) for v in weight_map.values()})
        out = {}
        for shard_name in shards:
            if "/" in shard_name or "\\" in shard_name or shard_name.startswith(".") or not shard_name.endswith(".bin"):
                raise SourceFormatError(f"weight_map names {shard_name!r}, not a .bin file here", path=index_url)
            out.update(_state_dict(loc.join(shard_name)))
        return out, PT_INDEX
    if PT_WEIGHTS in names:
        return _state_dict(loc.join(PT_WEIGHTS)), PT_WEIGHTS
    return {}, ""


def _state_dict(loc: Location) -> dict[str, Any]:
    from .torch_bridge import is_tensor

    obj = load_torch_file(loc)
    if not isinstance(obj, Mapping) or not all(is_tensor(v) for v in obj.values()):
        raise SourceFormatError("expected a flat dict of tensors (a model state dict)", path=loc.url)
    return {str(k): v for k, v in obj.items()}


def read_hf_trainer(loc: Location) -> TrainingSource:
    """What a Trainer ``checkpoint-N/`` directory holds for each field, and where each came from."""
    names = list_names(loc)
    if TRAINER_STATE not in names:
        raise SourceFormatError(f"not a Trainer checkpoint directory: no {TRAINER_STATE}", path=loc.url)
    trainer_state = read_json(loc.join(TRAINER_STATE), TRAINER_STATE)
    sources: dict[str, object] = {}
    missing: dict[str, str] = {}
    notes: list[str] = []

    weights, weights_file = _weights(loc, names)
    if weights_file:
        sources["weights"] = field_source(weights_file)
    else:
        missing["weights"] = "no model.safetensors or pytorch_model.bin"

    opt_tensors: dict[str, Any] = {}
    opt_context: dict[str, Any] = {}
    if OPTIMIZER in names:
        opt_tensors, opt_context = split_optimizer(load_torch_file(loc.join(OPTIMIZER)), loc.join(OPTIMIZER).url)
        sources["optimizer"] = field_source(OPTIMIZER, "state, param_groups")
    else:
        missing["optimizer"] = f"no {OPTIMIZER}"

    ranks = sorted(int(m.group(1)) for n in names if (m := _RANK_RNG.fullmatch(n)))
    generators: dict[str, object] = {}
    if RNG in names:
        raw = load_torch_file(loc.join(RNG), numpy_arrays=True)
        generators = rng_generators(raw, loc.join(RNG).url)
        sources["rng"] = field_source(RNG, ", ".join(str(k) for k in raw))
    elif ranks:
        keys: set[str] = set()
        for r in ranks:
            f = loc.join(f"rng_state_{r}.pth")
            raw = load_torch_file(f, numpy_arrays=True)
            generators.update(rng_generators(raw, f.url, prefix=f"rank{r}/"))
            keys.update(str(k) for k in raw)
        sources["rng"] = field_source(", ".join(f"rng_state_{r}.pth" for r in ranks), ", ".join(sorted(keys)))
    else:
        missing["rng"] = f"no {RNG}"

    step = trainer_state.get("global_step")
    epoch = trainer_state.get("epoch")
    batch = trainer_state.get("train_batch_size")
    if type(step) is not int or step < 0:
        raise SourceFormatError("'global_step' must be a non-negative integer", path=loc.join(TRAINER_STATE).url)
    world = max(1, len(ranks))
    skipped: list[str] = []
    training_args: dict[str, object] = {}
    if TRAINING_ARGS in names:
        try:
            training_args = read_training_args(loc.join(TRAINING_ARGS))
        except SourceFormatError as exc:  # unreadable without running it: left alone, and said so
            skipped.append(f"{TRAINING_ARGS}: {exc.message}; never unpickled")
    if opt_context and optimizer_class(training_args):
        opt_context["class"] = optimizer_class(training_args)  # as ckptfmt.torch records it, for its load
    accumulation = training_args.get("gradient_accumulation_steps")
    micro = accumulation if type(accumulation) is int and accumulation > 0 else 1
    data: dict[str, object] = {
        "epoch": math.floor(epoch) if isinstance(epoch, (int, float)) and math.isfinite(epoch) else 0,
        "global_sample_offset": step * batch * micro * world if type(batch) is int and batch > 0 else 0,
        "hf_trainer": {"global_step": step, "epoch": epoch},
    }
    if training_args:
        sources["data"] = field_source(
            f"{TRAINER_STATE}, {TRAINING_ARGS}", "global_step, epoch, train_batch_size, gradient_accumulation_steps"
        )
        notes.append(
            f"{TRAINING_ARGS} read by scanning its pickle opcodes (nothing imported or run): "
            f"{len(training_args)} plain fields into config.training_args, *_token fields dropped"
        )
    else:
        sources["data"] = field_source(TRAINER_STATE, "global_step, epoch, train_batch_size")
        notes.append(
            "data: global_sample_offset = global_step x train_batch_size x processes, assuming one micro-batch "
            f"per step (gradient_accumulation_steps is in {TRAINING_ARGS}, which could not be read)"
        )

    config: dict[str, object] = {
        "trainer": {
            k: trainer_state[k]
            for k in ("train_batch_size", "max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps")
            if k in trainer_state
        }
    }
    for name, key in ((CONFIG, "model"), (GENERATION_CONFIG, "generation")):
        if name in names:
            config[key] = read_json(loc.join(name), name)
    if training_args:
        config["training_args"] = training_args
    read = [n for n in (CONFIG, GENERATION_CONFIG, TRAINER_STATE) if n in names] + (
        [TRAINING_ARGS] * bool(training_args)
    )
    sources["config"] = field_source(", ".join(read), ", ".join(k for k in config))
    if CONFIG not in names:
        missing["config"] = f"no {CONFIG}: only the trainer's settings from {TRAINER_STATE}"
    missing["topology"] = (
        f"world size {world} inferred from the RNG files; devices, mesh and ranks are not recorded"
        if ranks
        else "no per-process RNG files, so one process is assumed; devices and mesh are not recorded"
    )
    sources["topology"] = field_source(", ".join(f"rng_state_{r}.pth" for r in ranks) or RNG, "inferred")

    extra: dict[str, dict[str, object]] = {"trainer_state": {"state": trainer_state}}
    sources["trainer_state"] = field_source(TRAINER_STATE)
    for name, fname in ((SCHEDULER, "scheduler"), (SCALER, "grad_scaler")):
        if name in names:
            extra[fname] = {"state": plain(load_torch_file(loc.join(name)), loc.join(name).url)}
            sources[fname] = field_source(name)
    return TrainingSource(
        weights=weights,
        optimizer=opt_tensors,
        optimizer_context=opt_context,
        contexts={
            "rng": {"generators": generators},
            "data": data,
            "config": {"config": config, "hash": config_hash(config)},
            "topology": {"world_size": world},
            **extra,
        },
        sources=sources,
        missing=missing,
        skipped=skipped,
        notes=notes,
        step=step,
    )


import_hf_trainer = training_importer("hf-trainer", "Trainer", read_hf_trainer)
import_hf_trainer.__doc__ = "Import a Trainer ``checkpoint-N/`` directory as a training-profile checkpoint."


# ---------------------------------------------------------------- export


def export_hf_trainer(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write a directory the Trainer resumes from (``trainer.train(resume_from_checkpoint=dst)``)."""
    import ckptfmt

    progress = progress or NoProgress()
    out = locate(dst, storage_options)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="hf-trainer")
    with ckptfmt.open(src, storage_options) as ckpt:
        if "weights" not in ckpt.fields or ckpt.field("weights").kind != "tensors":
            raise UsageError("the checkpoint has no 'weights' tensor field", path=ckpt.url)
        contexts = read_contexts(ckpt)
        step = _step(contexts)
        files: dict[str, Any] = {}
        if "optimizers" in contexts.get("optimizer", {}):
            raise UsageError("the checkpoint holds several optimizers; the Trainer has one", path=ckpt.url)
        states = optimizer_states(ckpt, contexts)  # none for an empty field: the source had no optimizer
        if states:
            files[OPTIMIZER] = states[0]
        for fname, name in (("scheduler", SCHEDULER), ("grad_scaler", SCALER)):
            if isinstance(contexts.get(fname), Mapping) and "state" in contexts[fname]:
                files[name] = torchify(contexts[fname]["state"])
        generators, ranks = generators_by_rank(contexts)
        for r in ranks:
            files[f"rng_state_{r}.pth"] = trainer_rng_dict(generators, prefix=f"rank{r}/")
        if not ranks and generators:
            files[RNG] = trainer_rng_dict(generators)
        json_files = {TRAINER_STATE: _trainer_state(contexts, step)}
        config = contexts.get("config", {}).get("config")
        if isinstance(config, Mapping):
            for key, name in (("model", CONFIG), ("generation", GENERATION_CONFIG)):
                if isinstance(config.get(key), Mapping):
                    json_files[name] = dict(config[key])
        targets = [hf.SINGLE, hf.INDEX, *files, *json_files]
        refuse_existing(out, targets, overwrite)
        weights = hf.export_hf(
            src, dst, storage_options=storage_options, overwrite=overwrite, field="weights", progress=progress
        )
        result.tensors, result.bytes, result.files = weights.tensors, weights.bytes, list(weights.files)
        write_files(out, {name: save_torch(obj) for name, obj in files.items()}, result, None)
        write_files(out, {name: _json_text(doc).encode("utf-8") for name, doc in json_files.items()}, result, None)
    lacking = [f for f in (OPTIMIZER, SCHEDULER) if f not in files] + ([] if generators else [RNG])
    if lacking:
        result.notes.append(f"the checkpoint holds nothing for {', '.join(lacking)}: the Trainer starts those afresh")
    if "trainer_state" not in contexts:
        result.notes.append(f"{TRAINER_STATE} made from the checkpoint's step {step} (no log history)")
    return result


def _step(contexts: Mapping[str, Mapping[str, Any]]) -> int:
    state = contexts.get("trainer_state", {}).get("state")
    if isinstance(state, Mapping) and type(state.get("global_step")) is int:
        return int(state["global_step"])
    step = contexts.get("provenance", {}).get("step")
    if type(step) is not int:
        raise UsageError("the checkpoint records no step (provenance 'step'); the Trainer needs one to resume")
    return int(step)


def _trainer_state(contexts: Mapping[str, Mapping[str, Any]], step: int) -> dict[str, Any]:
    state = contexts.get("trainer_state", {}).get("state")
    if isinstance(state, Mapping):
        return dict(state)
    data = contexts.get("data", {})
    epoch = data.get("hf_trainer", {}).get("epoch") if isinstance(data.get("hf_trainer"), Mapping) else None
    epoch = float(epoch if epoch is not None else data.get("epoch", 0))
    return {"global_step": step, "epoch": epoch, "log_history": []}


def _json_text(doc: Mapping[str, Any]) -> str:
    import json

    try:
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as exc:  # an array or bytes in a context this exporter did not write
        raise CheckpointError(f"cannot write as JSON: {exc}") from exc
