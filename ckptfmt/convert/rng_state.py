"""RNG states as the Trainer and Accelerate save them (``rng_state.pth``, ``random_states_<rank>.pkl``),
to ckptfmt generator records and back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import rng as base_rng
from ..errors import ContextError, SourceFormatError
from ..fields import check_rng

TORCH_CPU = "torch.cpu"
TORCH_CUDA = "torch.cuda"


def rng_generators(state: object, url: str, prefix: str = "") -> dict[str, object]:
    """The Trainer's (and Accelerate's) RNG dict -> ckptfmt generator records, state types checked."""
    from .torch_bridge import is_tensor

    if not isinstance(state, Mapping):
        raise SourceFormatError(f"RNG state is a {type(state).__name__}, not a dict", path=url)
    out: dict[str, object] = {}
    record: dict[str, object]
    for key, value in state.items():
        where = f"{url}: {key}"
        if key in ("python", "random_state"):
            try:
                version, internal, gauss = value
                record = {"kind": base_rng.PYTHON, "state": [int(version), [int(v) for v in internal], gauss]}
            except (TypeError, ValueError) as exc:
                raise SourceFormatError(f"python RNG state is malformed: {exc}", path=where) from exc
            out[prefix + "python"] = record
        elif key in ("numpy", "numpy_random_seed"):
            try:
                algorithm, keys, pos, has_gauss, cached = value
                record = {
                    "kind": base_rng.NUMPY_LEGACY,
                    "state": {
                        "algorithm": str(algorithm),
                        "key": np.asarray(keys, dtype=np.uint32).copy(),
                        "pos": int(pos),
                        "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached),
                    },
                }
            except (TypeError, ValueError) as exc:
                raise SourceFormatError(f"numpy RNG state is malformed: {exc}", path=where) from exc
            out[prefix + "numpy"] = record
        elif key in ("cpu", "torch_manual_seed"):
            out[prefix + "torch"] = {"kind": TORCH_CPU, "state": _bytes_state(value, where)}
        elif key in ("cuda", "torch_cuda_manual_seed"):
            states = value if isinstance(value, (list, tuple)) else [value]
            for device, s in enumerate(states):
                out[f"{prefix}cuda:{device}"] = {"kind": TORCH_CUDA, "state": _bytes_state(s, where), "device": device}
        elif is_tensor(value):
            out[prefix + str(key)] = {"kind": f"torch.{key}", "state": _bytes_state(value, where)}
        # other keys (Accelerate's "step", sampler seeds) are not generators: the caller keeps them
    try:
        check_rng({"generators": out})  # the rules a reader applies (RNG-1..5), failing here naming the file
    except ContextError as exc:
        raise SourceFormatError(exc.message, path=url) from exc
    return out


def _bytes_state(value: object, where: str) -> np.ndarray[Any, Any]:
    from .torch_bridge import is_tensor

    if not is_tensor(value) or str(getattr(value, "dtype", "")) != "torch.uint8":
        raise SourceFormatError("a torch generator state must be a uint8 tensor", path=where)
    return np.array(value.numpy(), dtype=np.uint8, copy=True)  # type: ignore[attr-defined]


def trainer_rng_dict(generators: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """ckptfmt generator records (Python, numpy, torch CPU/CUDA) -> the dict the Trainer saves as rng_state.pth."""
    import torch

    out: dict[str, Any] = {}
    cuda: dict[int, Any] = {}
    for name, gen in generators.items():
        if not name.startswith(prefix) or not isinstance(gen, Mapping):
            continue
        local, kind, state = name[len(prefix) :], gen.get("kind"), gen.get("state")
        if kind == base_rng.PYTHON and isinstance(state, list):
            out["python"] = (state[0], tuple(state[1]), state[2])
        elif kind == base_rng.NUMPY_LEGACY and isinstance(state, Mapping):
            key = np.asarray(state["key"], dtype=np.uint32)
            out["numpy"] = (state["algorithm"], key, state["pos"], state["has_gauss"], state["cached_gaussian"])
        elif kind == TORCH_CPU:
            out["cpu"] = torch.from_numpy(np.asarray(state, dtype=np.uint8).copy())
        elif kind == TORCH_CUDA:
            cuda[int(gen.get("device", 0))] = torch.from_numpy(np.asarray(state, dtype=np.uint8).copy())
        elif "/" not in local and ":" not in local and isinstance(kind, str) and kind.startswith("torch."):
            out[local] = torch.from_numpy(np.asarray(state, dtype=np.uint8).copy())
    if cuda:
        out["cuda"] = [cuda[d] for d in sorted(cuda)]
    return out


def generators_by_rank(contexts: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], list[int]]:
    """A checkpoint's generator records, and the ranks they are prefixed with (``rank<r>/``; none: one process)."""
    found = contexts.get("rng", {}).get("generators")
    generators: dict[str, Any] = dict(found) if isinstance(found, Mapping) else {}
    ranks = sorted({int(m.group(1)) for n in generators if (m := re.match(r"rank(\d+)/", n))})
    return generators, ranks
