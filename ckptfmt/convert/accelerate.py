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

from ..errors import SourceFormatError
from .base import ConvertResult, NoProgress, Progress, converted_from, list_names, locate
from .hf_trainer import (
    field_source,
    load_torch_file,
    missing_note,
    plain,
    rng_generators,
    split_optimizer,
    write_training,
)
from .lightning import encode

_MODEL = re.compile(r"(model|pytorch_model)(?:_(\d+))?\.(safetensors|bin)")
_OPTIMIZER = re.compile(r"optimizer(?:_(\d+))?\.bin")
_SCHEDULER = re.compile(r"scheduler(?:_(\d+))?\.bin")
_RNG = re.compile(r"random_states_(\d+)\.pkl")
_OTHER = re.compile(r"(sampler(?:_\d+)?|dl_state_dict(?:_\d+)?)\.bin|custom_checkpoint_\d+\.pkl")


def _index(match: re.Match[str], group: int) -> int:
    return int(match.group(group) or 0)


def _model(loc: Any, name: str) -> dict[str, Any]:
    from .torch_bridge import is_tensor

    if name.endswith(".safetensors"):
        import numpy as np

        from .. import dtypes
        from .base import read_range
        from .hf import read_header

        entries, _ = read_header(loc)
        return {
            tensor: np.frombuffer(
                bytearray(read_range(loc, e.begin, e.end - e.begin)), dtype=dtypes.to_numpy(e.dtype)
            ).reshape(e.shape)
            for tensor, e in sorted(entries.items(), key=lambda kv: kv[1].begin)
        }
    obj = load_torch_file(loc)
    if not isinstance(obj, Mapping) or not all(is_tensor(v) for v in obj.values()):
        raise SourceFormatError("expected a model state dict (a flat dict of tensors)", path=loc.url)
    return {str(k): v for k, v in obj.items()}


def import_accelerate(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Import an ``Accelerator.save_state`` directory as a training-profile checkpoint."""
    loc = locate(src, storage_options)
    names = sorted(n for n, kind in list_names(loc).items() if kind == "file")
    rng_files = {_index(m, 1): n for n in names if (m := _RNG.fullmatch(n))}
    models = {_index(m, 2): n for n in names if (m := _MODEL.fullmatch(n))}
    if not rng_files and not models:
        raise SourceFormatError("not an Accelerate save_state directory (no model or RNG files)", path=loc.url)
    sources: dict[str, object] = {}
    missing: dict[str, str] = {}
    skipped: list[str] = []

    weights: dict[str, Any] = {}
    for i, name in sorted(models.items()):
        weights |= {(f"model_{i}." if i else "") + k: v for k, v in _model(loc.join(name), name).items()}
    if models:
        sources["weights"] = field_source(", ".join(models[i] for i in sorted(models)))
    else:
        missing["weights"] = "no model files"

    optimizers = {_index(m, 1): n for n in names if (m := _OPTIMIZER.fullmatch(n))}
    opt_tensors: dict[str, Any] = {}
    opt_context: dict[str, Any] = {}
    for i, name in sorted(optimizers.items()):
        tensors, context = split_optimizer(load_torch_file(loc.join(name)), loc.join(name).url)
        if len(optimizers) == 1:
            opt_tensors, opt_context = tensors, context
        else:
            opt_tensors |= {f"{i}/{k}": v for k, v in tensors.items()}
            opt_context.setdefault("optimizers", []).append(context)
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
    extra["accelerate"] = {"files": other, "step": steps}
    sources["accelerate"] = field_source(", ".join(sorted(other)) or "random_states_<rank>.pkl", "step")
    for name in names:
        known = _MODEL, _OPTIMIZER, _SCHEDULER, _RNG, _OTHER
        if name != "scaler.pt" and not any(p.fullmatch(name) for p in known):
            skipped.append(f"{name}: not a file Accelerate's save_state writes")

    world = max(1, len(rng_files))
    missing["data"] = "no epoch or sample position (Accelerate leaves them to the training loop)"
    missing["config"] = "no config (Accelerate saves none)"
    missing["topology"] = f"world size {world} inferred from the RNG files; devices and mesh not recorded"
    sources["topology"] = field_source(", ".join(rng_files.values()) or "", "inferred")

    result = ConvertResult(source=loc.url, source_format="accelerate", destination=dst, destination_format="ckptfmt")
    result.notes.append(missing_note("Accelerate", missing))
    result.notes += [f"skipped {s}" for s in skipped]
    write_training(
        dst,
        weights=weights,
        optimizer=(opt_tensors, opt_context),
        contexts={
            "rng": {"generators": generators},
            "data": {"epoch": 0, "global_sample_offset": 0, "sample_offset_known": False},
            "config": {"config": {}, "hash": _empty_hash()},
            "topology": {"world_size": world},
            **extra,
            "provenance": converted_from("accelerate", loc.url, fields=sources, missing=missing, skipped=skipped),
        },
        extra_tensors={"accelerate_tensors": other_tensors} if other_tensors else None,
        result=result,
        progress=progress or NoProgress(),
        storage_options=storage_options,
        overwrite=overwrite,
        target_file_size=target_file_size,
    )
    return result


def _empty_hash() -> str:
    from ..canonical import config_hash

    return config_hash({})
