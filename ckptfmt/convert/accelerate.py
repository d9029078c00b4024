"""Accelerate ``save_state`` directories into the training profile. Import only.

``Accelerator.save_state(dir)`` writes, for the objects passed to ``prepare``:

===========================================  ====================================  ===============
file                                         what                                  field
===========================================  ====================================  ===============
``model.safetensors`` (``model_<i>.…``)      each model's state dict               ``weights``
``pytorch_model.bin`` (``pytorch_model_<i>``) the same, when safe_serialization off ``weights``
``optimizer.bin`` (``optimizer_<i>.bin``)    each optimizer's state dict           ``optimizer``
``scheduler.bin`` (``scheduler_<i>.bin``)    each LR scheduler's state dict        ``scheduler``
``scaler.pt``                                ``GradScaler`` state                  ``grad_scaler``
``random_states_<rank>.pkl``                 Python, numpy, torch (CUDA) RNGs       ``rng``
``sampler.bin``, ``dl_state_dict.bin``…      sampler / stateful loader state       ``accelerate``
``custom_checkpoint_<i>.pkl``                ``register_for_checkpointing`` objects ``accelerate``
===========================================  ====================================  ===============

Every file loads with ``torch.load(weights_only=True)`` (the RNG files under the numpy allow-list
the Trainer uses too); a file that needs more than that (a custom object's pickle) is skipped and
named in the notes. The first model, optimizer and scheduler keep their plain names; the ``i``-th
(``i >= 1``) is prefixed ``model_<i>.`` / ``<i>/``. Accelerate records no step, epoch, sample
position, config or topology, so those come only from the RNG files' count and are reported missing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..arrays import to_torch, torchify
from ..canonical import config_hash
from ..errors import SourceFormatError, UnsafePathError
from .base import ConvertResult, NoProgress, Progress, list_names, locate
from .destination import check_name, prepare_directory
from .lightning import decode, encode
from .optimizer import split_optimizers
from .rng_state import generators_by_rank, rng_generators, trainer_rng_dict
from .torch_files import load_torch_file, plain, save_torch
from .training import (
    LazySafetensors,
    TrainingSource,
    field_source,
    import_training,
    optimizer_states,
    read_contexts,
    write_files,
)

_MODEL = re.compile(r"(model|pytorch_model)(?:_(\d+))?\.(safetensors|bin)")
_OPTIMIZER = re.compile(r"optimizer(?:_(\d+))?\.bin")
_SCHEDULER = re.compile(r"scheduler(?:_(\d+))?\.bin")
_RNG = re.compile(r"random_states_(\d+)\.pkl")
_OTHER = re.compile(r"(sampler(?:_\d+)?|dl_state_dict(?:_\d+)?)\.bin|custom_checkpoint_\d+\.pkl")


def _index(match: re.Match[str], group: int) -> int:
    return int(match.group(group) or 0)


def _model(loc: Any, name: str, prefix: str) -> tuple[list[tuple[Any, Any, str]], dict[str, Any]]:
    """A model file's tensors: safetensors as (file, header entry, name) to read lazily, torch files loaded."""
    from .torch_bridge import is_tensor

    if name.endswith(".safetensors"):
        from .hf import read_header

        entries, _ = read_header(loc)
        return [(loc, e, prefix + t) for t, e in sorted(entries.items(), key=lambda kv: kv[1].begin)], {}
    obj = load_torch_file(loc)
    if not isinstance(obj, Mapping) or not all(is_tensor(v) for v in obj.values()):
        raise SourceFormatError("expected a model state dict (a flat dict of tensors)", path=loc.url)
    return [], {prefix + str(k): v for k, v in obj.items()}


def import_accelerate(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int | None = None,
    progress: Progress | None = None,
    known: Mapping[str, Mapping[str, object]] | None = None,
    step: int | None = None,
) -> ConvertResult:
    """Import an ``Accelerator.save_state`` directory as a training-profile checkpoint.

    ``known`` gives fields Accelerate does not save (``data``, ``config``, ``topology``) from the
    caller, and ``step`` the training step (:mod:`ckptfmt.integrations.accelerate` passes both).
    """
    loc = locate(src, storage_options)
    names = sorted(n for n, kind in list_names(loc).items() if kind == "file")
    rng_files = {_index(m, 1): n for n in names if (m := _RNG.fullmatch(n))}
    models = {_index(m, 2): n for n in names if (m := _MODEL.fullmatch(n))}
    if not rng_files and not models:
        raise SourceFormatError("not an Accelerate save_state directory (no model or RNG files)", path=loc.url)
    sources: dict[str, object] = {}
    missing: dict[str, str] = {}
    skipped: list[str] = []

    lazy: list[tuple[Any, Any, str]] = []
    loaded: dict[str, Any] = {}
    for i, name in sorted(models.items()):
        items, tensors = _model(loc.join(name), name, f"model_{i}." if i else "")
        lazy += items
        loaded |= tensors
    weights = LazySafetensors(lazy, loaded)
    if models:
        sources["weights"] = field_source(", ".join(models[i] for i in sorted(models)))
    else:
        missing["weights"] = "no model files"

    optimizers = {_index(m, 1): n for n in names if (m := _OPTIMIZER.fullmatch(n))}
    files = [loc.join(optimizers[i]) for i in sorted(optimizers)]
    opt_tensors, opt_context = split_optimizers([load_torch_file(f) for f in files], [f.url for f in files])
    if optimizers:
        sources["optimizer"] = field_source(", ".join(optimizers[i] for i in sorted(optimizers)), "state, param_groups")
    else:
        missing["optimizer"] = "no optimizer.bin"

    generators: dict[str, object] = {}
    steps: dict[str, object] = {}
    for r, name in sorted(rng_files.items()):
        raw = load_torch_file(loc.join(name), numpy_arrays=True)
        prefix = f"rank{r}/" if len(rng_files) > 1 else ""
        generators |= rng_generators(raw, loc.join(name).url, prefix=prefix)
        if isinstance(raw, Mapping) and type(raw.get("step")) is int:
            steps[str(r)] = raw["step"]
    if rng_files:
        keys = "random_state, numpy_random_seed, torch_manual_seed"
        sources["rng"] = field_source(", ".join(rng_files[r] for r in sorted(rng_files)), keys)
    else:
        missing["rng"] = "no random_states_<rank>.pkl"

    extra: dict[str, dict[str, object]] = {}
    schedulers = {_index(m, 1): n for n in names if (m := _SCHEDULER.fullmatch(n))}
    states = [plain(load_torch_file(loc.join(schedulers[i])), loc.join(schedulers[i]).url) for i in sorted(schedulers)]
    if states:
        extra["scheduler"] = {"state": states[0]} if len(states) == 1 else {"states": states}
        sources["scheduler"] = field_source(", ".join(schedulers[i] for i in sorted(schedulers)))
    if "scaler.pt" in names:
        extra["grad_scaler"] = {"state": plain(load_torch_file(loc.join("scaler.pt")), loc.join("scaler.pt").url)}
        sources["grad_scaler"] = field_source("scaler.pt")

    other: dict[str, object] = {}
    other_tensors: dict[str, Any] = {}
    for name in names:
        if not _OTHER.fullmatch(name):
            continue
        try:
            other[name] = encode(load_torch_file(loc.join(name)), other_tensors, loc.join(name).url)
        except SourceFormatError as exc:  # a registered object's arbitrary pickle: never built, reported
            skipped.append(f"{name}: {exc.message}")
    extra["accelerate"] = {"files": other, "step": steps, "models": len(models)}
    sources["accelerate"] = field_source(", ".join(sorted(other)) or "random_states_<rank>.pkl", "step")
    for name in names:
        if name != "scaler.pt" and not any(p.fullmatch(name) for p in (_MODEL, _OPTIMIZER, _SCHEDULER, _RNG, _OTHER)):
            skipped.append(f"{name}: not a file Accelerate's save_state writes")

    world = max(1, len(rng_files))
    contexts: dict[str, Mapping[str, object]] = {
        "rng": {"generators": generators},
        "data": {"epoch": 0, "global_sample_offset": 0, "sample_offset_known": False},
        "config": {"config": {}, "hash": config_hash({})},
        "topology": {"world_size": world},
    }
    missing["data"] = "no epoch or sample position (Accelerate leaves them to the training loop)"
    missing["config"] = "no config (Accelerate saves none)"
    missing["topology"] = f"world size {world} inferred from the RNG files; devices and mesh not recorded"
    sources["topology"] = field_source(", ".join(rng_files.values()) or "", "inferred")
    for name, value in (known or {}).items():
        contexts[name] = value
        missing.pop(name, None)
        sources[name] = field_source("", "given by the caller")
    source = TrainingSource(
        weights=weights,
        optimizer=opt_tensors,
        optimizer_context=opt_context,
        contexts={**contexts, **extra},
        extra_tensors={"accelerate_tensors": other_tensors} if other_tensors else None,
        sources=sources,
        missing=missing,
        skipped=skipped,
        step=step,
    )
    return import_training(
        "accelerate",
        "Accelerate",
        loc.url,
        source,
        dst,
        storage_options=storage_options,
        overwrite=overwrite,
        target_file_size=target_file_size,
        progress=progress or NoProgress(),
    )


# ---------------------------------------------------------------- export


def _accelerate_rng(generators: Mapping[str, Any], prefix: str, step: object) -> dict[str, Any]:
    """ckptfmt generator records -> the dict Accelerate saves as random_states_<rank>.pkl."""
    trainer = trainer_rng_dict(generators, prefix)
    names = {"python": "random_state", "numpy": "numpy_random_seed", "cpu": "torch_manual_seed"}
    out: dict[str, Any] = {"step": step if type(step) is int else 0}
    out |= {names[k]: v for k, v in trainer.items() if k in names}
    if "cuda" in trainer:
        out["torch_cuda_manual_seed"] = trainer["cuda"]
    return out


def export_accelerate(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the directory ``Accelerator.load_state`` reads, from a training-profile checkpoint.

    Each model's weights are written whole (as ``save_state`` does), so memory holds the largest model.
    """
    import safetensors.torch

    import ckptfmt

    out = locate(dst, storage_options)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="accelerate")
    files: dict[str, bytes] = {}
    with ckptfmt.open(src, storage_options) as ckpt:
        contexts = read_contexts(ckpt)
        info = contexts.get("accelerate", {})
        models = int(info.get("models", 1) or 1)
        groups: dict[int, dict[str, Any]] = {}
        for name, array in ckpt.read_tensors("weights").items():
            index, key = 0, name
            if models > 1 and (m := re.match(r"model_(\d+)\.(.+)", name)):
                index, key = int(m.group(1)), m.group(2)
            groups.setdefault(index, {})[key] = to_torch(array).contiguous()
            result.tensors += 1
            result.bytes += int(array.nbytes)
        for index, state in sorted(groups.items()):
            files[f"model{f'_{index}' if index else ''}.safetensors"] = safetensors.torch.save(state)
        states = optimizer_states(ckpt, contexts)
        objects: dict[str, Any] = {f"optimizer{f'_{i}' if i else ''}.bin": s for i, s in enumerate(states)}
        scheduler = contexts.get("scheduler", {})
        schedulers = scheduler.get("states", [scheduler["state"]] if "state" in scheduler else [])
        for i, state in enumerate(schedulers):
            objects[f"scheduler{f'_{i}' if i else ''}.bin"] = torchify(state)
        if "state" in contexts.get("grad_scaler", {}):
            objects["scaler.pt"] = torchify(contexts["grad_scaler"]["state"])
        generators, ranks = generators_by_rank(contexts)
        steps: Mapping[str, Any] = info["step"] if isinstance(info.get("step"), Mapping) else {}
        for r in ranks or ([0] if generators else []):
            prefix = f"rank{r}/" if ranks else ""
            objects[f"random_states_{r}.pkl"] = _accelerate_rng(generators, prefix, steps.get(str(r)))
        extra_tensors = {
            k: to_torch(v).clone()
            for k, v in (ckpt.read_tensors("accelerate_tensors") if "accelerate_tensors" in ckpt.fields else {}).items()
        }
        for name, value in dict(info.get("files") or {}).items():
            # a name from the checkpoint: untrusted, so held to the path rule before anything is written
            if check_name(out, name) in objects or name in files:
                raise UnsafePathError(f"the accelerate context names {name!r}, a file written already", path=src)
            objects[name] = decode(value, extra_tensors)
    files |= {name: save_torch(obj) for name, obj in objects.items()}
    prepare_directory(out, list(files), overwrite=overwrite)
    write_files(out, files, result, progress or NoProgress())
    if not generators:
        result.notes.append("the checkpoint holds no RNG state: load_state leaves the generators as they are")
    return result
