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

import io
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import rng as base_rng
from ..canonical import config_hash
from ..errors import CheckpointError, ContextError, SourceFormatError, UsageError
from ..fields import check_rng
from ..jsonio import load_json
from . import hf, torch_pt
from .base import (
    ConvertResult,
    Location,
    NoProgress,
    Progress,
    converted_from,
    list_names,
    locate,
    read_file,
    read_range,
    refuse_existing,
)
from .bounded import check_graph, children
from .destination import write_output

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
RNG = "rng_state.pth"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
MAX_JSON_BYTES = 64 << 20  # a trainer_state.json with a long log history stays far below this
_RANK_RNG = re.compile(r"rng_state_(\d+)\.pth")
# TrainingArguments.optim values of torch's own optimizers (the part before "_": adamw_torch_fused -> adamw)
_OPTIM_CLASSES = {"adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
TORCH_CPU = "torch.cpu"
TORCH_CUDA = "torch.cuda"


# ---------------------------------------------------------------- shared with the other trainer formats


def load_torch_file(loc: Location, *, numpy_arrays: bool = False) -> Any:
    """``torch.load(weights_only=True)``; with ``numpy_arrays``, numpy arrays are allowed too (RNG states),
    for this load only (other threads' loads and the user's own allow-list are left as they are)."""
    return torch_pt.load(loc, allow=numpy_globals() if numpy_arrays else ())


def numpy_globals() -> list[Any]:
    """The numpy names an array pickles through: the reconstructor, ndarray, dtype and the uint32 dtype class."""
    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_json(loc: Location, what: str) -> dict[str, Any]:
    # read_file: no symlink followed below the source, regular files only, bounded before reading
    doc = load_json(read_file(loc, MAX_JSON_BYTES), error=SourceFormatError, what=what, path=loc.url, allow_float=True)
    if not isinstance(doc, dict):
        raise SourceFormatError(f"{what} must be a JSON object", path=loc.url)
    return doc


def split_optimizer(state: object, url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict as ckptfmt.torch stores it: tensors ``state.<param>.<key>``, the rest as context."""
    from .torch_bridge import context_value, is_optimizer_state, is_tensor

    if not is_optimizer_state(state):
        raise SourceFormatError("not an optimizer state dict ({'state': ..., 'param_groups': ...})", path=url)
    assert isinstance(state, Mapping)
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, object]] = {}
    for pid, entry in state["state"].items():
        if not isinstance(entry, Mapping):
            raise SourceFormatError(f"state of parameter {pid!r} is a {type(entry).__name__}, not a dict", path=url)
        for key, value in entry.items():
            if is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value
            else:
                scalars.setdefault(str(pid), {})[str(key)] = context_value(value, f"{url}: state.{pid}.{key}")
    groups = context_value(state["param_groups"], f"{url}: param_groups")
    extra = {str(k): context_value(v, f"{url}: {k}") for k, v in state.items() if k not in ("state", "param_groups")}
    return tensors, {"param_groups": groups, "scalars": scalars, **({"extra": extra} if extra else {})}


def join_optimizer(tensors: Mapping[str, Any], context: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_optimizer`: a state dict ``optimizer.load_state_dict`` takes.

    Also takes :mod:`ckptfmt.torch`'s state keyed by parameter name (``keys: fqn``, tensors
    ``<param>/<key>``): parameters are numbered in param-group order, as ``Optimizer.state_dict`` does.
    """
    from .torch_bridge import to_torch

    groups = [
        {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.items()}
        for g in context.get("param_groups") or []
    ]
    by_name = context.get("keys") == "fqn"
    index: dict[str, int] = {}
    if by_name:
        index = {str(p): i for i, p in enumerate(p for g in groups for p in g.get("params", []))}
        groups = [{**g, "params": [index[str(p)] for p in g.get("params", [])]} for g in groups]

    def pid_of(name: str) -> int:
        if not by_name:
            return int(name)
        if name not in index:
            raise UsageError(f"optimizer state for parameter {name!r}, which no param group lists")
        return index[name]

    state: dict[int, dict[str, Any]] = {}
    for name, array in tensors.items():
        if by_name:
            param, _, key = name.rpartition("/")
        else:
            _, param, key = name.split(".", 2)
        state.setdefault(pid_of(param), {})[key] = to_torch(array, _dtype(array)).clone()
    for param, entries in dict(context.get("scalars") or {}).items():
        state.setdefault(pid_of(str(param)), {}).update(torchify(entries))
    extra = {k: v for k, v in dict(context.get("extra") or {}).items() if k not in ("state", "param_groups")}
    return {"state": state, "param_groups": groups, **extra}


def _dtype(array: np.ndarray[Any, Any]) -> str:
    from ..arrays import as_array

    return as_array(array)[1]


def torchify(value: Any) -> Any:
    """Context values back into what torch state dicts hold: numpy arrays become tensors."""
    from .torch_bridge import to_torch

    if isinstance(value, np.ndarray):
        return to_torch(value, _dtype(value)).clone()
    if isinstance(value, dict):
        return {k: torchify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [torchify(v) for v in value]
    return value


def plain(value: Any, where: str) -> Any:
    """A loaded torch value as a context value, tensors as numpy arrays (RNG and loop states hold some)."""
    from .torch_bridge import context_value, is_tensor

    if is_tensor(value):
        return np.array(value.detach().cpu().numpy(), copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}.{i}") for i, v in enumerate(value)]
    return context_value(value, where)


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


def field_source(file: str, key: str | None = None, **extra: object) -> dict[str, object]:
    return {"file": file, **({"key": key} if key is not None else {}), **extra}


def missing_note(fmt: str, missing: Mapping[str, str]) -> str:
    return f"the {fmt} source lacks " + "; ".join(f"{name} ({why})" for name, why in missing.items())


# ---------------------------------------------------------------- training_args.bin, read without unpickling

MAX_ARGS_BYTES = 16 << 20
MAX_PICKLE_OPS = 100_000  # a TrainingArguments pickles in under 2,000 opcodes; each costs ~10 us to decode and walk
MAX_PICKLE_VALUES = MAX_PICKLE_OPS  # once shared references are expanded: walking it costs what decoding did


@dataclass(slots=True)
class _Opaque:
    """An object the pickle would have built by importing ``name`` and calling it: never imported, never called."""

    name: str
    args: object = None
    state: object = None


def scan_pickle(data: bytes, url: str) -> object:
    """Interpret a pickle's opcodes symbolically (``pickletools.genops`` only decodes them): containers and
    plain values are rebuilt, every global reference and call becomes an :class:`_Opaque` record."""
    import pickletools

    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):
            if count > MAX_PICKLE_OPS:
                raise SourceFormatError(f"more than {MAX_PICKLE_OPS} pickle opcodes", path=url)
            name = op.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name == "MARK":
                marks.append(len(stack))
            elif name in _PUSH_ARG:
                stack.append(arg)
            elif name in _PUSH_CONST:
                stack.append(_PUSH_CONST[name])
            elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET"):
                stack.append({"EMPTY_DICT": {}, "EMPTY_LIST": [], "EMPTY_TUPLE": (), "EMPTY_SET": []}[name])
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = stack[-n:]
                del stack[-n:]
                stack.append(tuple(items))
            elif name in ("TUPLE", "LIST", "FROZENSET"):
                items = pop_mark()
                stack.append(tuple(items) if name == "TUPLE" else list(items))
            elif name == "DICT":
                items = pop_mark()
                stack.append(_pairs(items))
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                _setitems(stack[-1], [key, value])
            elif name == "SETITEMS":
                items = pop_mark()
                _setitems(stack[-1], items)
            elif name in ("APPEND", "APPENDS", "ADDITEMS"):
                items = [stack.pop()] if name == "APPEND" else pop_mark()
                if isinstance(stack[-1], list):
                    stack[-1].extend(items)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[int(str(arg))])
            elif name == "GLOBAL":
                stack.append(_Opaque(str(arg).replace(" ", ".")))
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                stack.append(_Opaque(f"{module}.{attr}"))
            elif name in ("REDUCE", "NEWOBJ"):
                args, func = stack.pop(), stack.pop()
                stack.append(_Opaque(func.name if isinstance(func, _Opaque) else "?", args))
            elif name == "NEWOBJ_EX":
                _kwargs, args, func = stack.pop(), stack.pop(), stack.pop()
                stack.append(_Opaque(func.name if isinstance(func, _Opaque) else "?", args))
            elif name == "BUILD":
                state = stack.pop()
                if isinstance(stack[-1], _Opaque):
                    stack[-1].state = state
            elif name in ("BINPERSID", "PERSID"):
                stack[-1 if name == "BINPERSID" else len(stack) :] = [_Opaque("persistent")]
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(stack[-1])
            else:
                raise SourceFormatError(f"pickle opcode {name} is not read", path=url)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise SourceFormatError(f"not a readable pickle: {exc}", path=url) from exc
    if len(stack) != 1:
        raise SourceFormatError("the pickle does not end with one object", path=url)
    # Each opcode above is constant work (a mark pops what was pushed), but a memoised object may be
    # referenced again and again: what the callers walk is the expansion, bounded here on the graph.
    # (Depth is no matter here: the scan recursed nowhere, and fields deeper than _is_plain looks are left out.)
    check_graph(stack[0], url, max_nodes=MAX_PICKLE_VALUES, max_depth=MAX_PICKLE_OPS, inside=_scan_children)
    return stack[0]


def _scan_children(value: object) -> Iterable[object] | None:
    return [value.args, value.state] if isinstance(value, _Opaque) else children(value)


_PUSH_ARG = {
    "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG", "BINFLOAT", "FLOAT", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING", "SHORT_BINBYTES",
    "BINBYTES", "BINBYTES8",
}  # fmt: skip
_PUSH_CONST: dict[str, object] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def _pairs(items: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    _setitems(out, items)
    return out


def _setitems(target: object, items: list[Any]) -> None:
    if isinstance(target, dict):
        for key, value in zip(items[::2], items[1::2], strict=True):
            if isinstance(key, (str, int, float, bool, type(None))):
                target[key] = value


def read_training_args(loc: Location) -> dict[str, object]:
    """The plain fields of a pickled ``TrainingArguments`` (a torch zip file or a bare pickle), found by
    scanning opcodes: nothing is imported or run. Enums give their value; ``*_token`` fields are dropped."""
    import io
    import zipfile
    import zlib

    data = read_file(loc, MAX_ARGS_BYTES)
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                member = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
                if member is None or member.file_size > MAX_ARGS_BYTES:
                    raise SourceFormatError("no data.pkl of a sane size in the torch archive", path=loc.url)
                data = archive.read(member)
        except SourceFormatError:
            raise
        except (
            zipfile.BadZipFile,
            NotImplementedError,
            RuntimeError,
            OSError,
            EOFError,
            ValueError,
            zlib.error,
        ) as exc:
            # zipfile's own failures on a damaged archive: an unsupported compression method raises
            # NotImplementedError, an encrypted entry RuntimeError, a bad deflate stream zlib.error (OSError)
            raise SourceFormatError(f"not a readable torch archive: {type(exc).__name__}: {exc}", path=loc.url) from exc
    root = scan_pickle(data, loc.url)
    if not (isinstance(root, _Opaque) and root.name.endswith("TrainingArguments") and isinstance(root.state, dict)):
        raise SourceFormatError("does not hold a TrainingArguments object", path=loc.url)
    out: dict[str, object] = {}
    for key, value in root.state.items():
        if not isinstance(key, str) or key.endswith("_token") or key.startswith("_"):
            continue
        if isinstance(value, _Opaque) and isinstance(value.args, tuple) and len(value.args) == 1:
            value = value.args[0]  # an Enum member pickles as a call of its class with its value
        if _is_plain(value):
            out[key] = _as_json(value)
    return out


def _is_plain(value: object, depth: int = 0) -> bool:
    """JSON-like and at most 16 levels deep (a crafted pickle may nest far deeper)."""
    if value is None or isinstance(value, (bool, int, str)):
        return not isinstance(value, int) or -(1 << 63) <= value < (1 << 64)
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= 16:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(
            isinstance(k, str) and not k.endswith("_token") and _is_plain(v, depth + 1) for k, v in value.items()
        )
    return False


def _as_json(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- import


class LazySafetensors(Mapping[str, Any]):
    """Safetensors tensors by name, each read (its byte range only) when asked for, so memory stays at one
    tensor; ``loaded`` adds tensors already at hand (memory-mapped torch files)."""

    def __init__(self, items: list[tuple[Location, Any, str]], loaded: Mapping[str, Any] | None = None) -> None:
        self._items = {name: (shard, entry) for shard, entry, name in items}
        self._loaded = dict(loaded or {})
        if set(self._items) & set(self._loaded):
            raise SourceFormatError(f"tensor {sorted(set(self._items) & set(self._loaded))[0]!r} appears twice")

    def __getitem__(self, name: str) -> Any:
        from .. import dtypes

        if name in self._loaded:
            return self._loaded[name]
        shard, entry = self._items[name]
        data = bytearray(read_range(shard, entry.begin, entry.end - entry.begin))
        return np.frombuffer(data, dtype=dtypes.to_numpy(entry.dtype)).reshape(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._items, *self._loaded])

    def __len__(self) -> int:
        return len(self._items) + len(self._loaded)

    @property
    def loaded(self) -> Mapping[str, Any]:
        """The tensors given already loaded (not read lazily)."""
        return self._loaded

    def nbytes(self, name: str) -> int:
        if name in self._loaded:
            return _nbytes(self._loaded[name])
        _, entry = self._items[name]
        return int(entry.end - entry.begin)


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


def _loaded(tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """The tensors of a field already in memory (a lazy mapping's safetensors are read only when written)."""
    return tensors.loaded if isinstance(tensors, LazySafetensors) else tensors


def _size(tensors: Mapping[str, Any], name: str) -> int:
    """A tensor's size in bytes without reading it when the mapping is lazy."""
    return tensors.nbytes(name) if isinstance(tensors, LazySafetensors) else _nbytes(tensors[name])


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return int(value.numel()) * int(value.element_size())


def import_hf_trainer(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    target_file_size: int | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Import a Trainer ``checkpoint-N/`` directory as a training-profile checkpoint."""
    progress = progress or NoProgress()
    loc = locate(src, storage_options)
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
    optim = training_args.get("optim")
    if opt_context and isinstance(optim, str) and _OPTIM_CLASSES.get(optim.split("_")[0]):
        opt_context["class"] = _OPTIM_CLASSES[optim.split("_")[0]]  # as ckptfmt.torch records it, for its load
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
    notes += [f"skipped {s}" for s in skipped]
    if missing:
        notes.insert(0, missing_note("Trainer", missing))

    result = ConvertResult(source=loc.url, source_format="hf-trainer", destination=dst, destination_format="ckptfmt")
    result.notes = notes
    provenance = converted_from("hf-trainer", loc.url, fields=sources, missing=missing, skipped=skipped)
    provenance["step"] = step
    write_training(
        dst,
        weights=weights,
        optimizer=(opt_tensors, opt_context),
        contexts={
            "rng": {"generators": generators},
            "data": data,
            "config": {"config": config, "hash": config_hash(config)},
            "topology": {"world_size": world},
            **extra,
            "provenance": provenance,
        },
        result=result,
        progress=progress,
        storage_options=storage_options,
        overwrite=overwrite,
        target_file_size=target_file_size,
    )
    return result


def write_training(
    dst: str,
    *,
    weights: Mapping[str, Any],
    optimizer: tuple[Mapping[str, Any], Mapping[str, Any]],
    contexts: Mapping[str, Mapping[str, object]],
    result: ConvertResult,
    progress: Progress,
    storage_options: Mapping[str, Any] | None,
    overwrite: bool,
    target_file_size: int | None,
    extra_tensors: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write a training-profile checkpoint: tensor fields one tensor at a time, then the contexts, then commit."""
    import ckptfmt

    from .bounded import check_expansion, dedupe

    # a torch tensor loaded under several names (tied weights, or a hostile file's thousand references to
    # one tensor) is stored once, the other names recorded as aliases the way ckptfmt.torch records them
    _, aliases = dedupe(weights.loaded if isinstance(weights, LazySafetensors) else weights)
    contexts = dict(contexts)
    if aliases:
        contexts["weights"] = {**contexts.get("weights", {}), "aliases": aliases}
    tensor_fields = {"weights": weights, "optimizer": optimizer[0], **dict(extra_tensors or {})}
    names = {
        field: [name for name in tensors if not (field == "weights" and name in aliases)]
        for field, tensors in tensor_fields.items()
    }
    check_expansion(
        (
            _loaded(tensors)[name]
            for field, tensors in tensor_fields.items()
            for name in names[field]
            if name in _loaded(tensors)
        ),
        result.source,
    )
    progress.start(sum(_size(tensors, name) for field, tensors in tensor_fields.items() for name in names[field]))
    options: dict[str, Any] = {"storage_options": storage_options, "overwrite": overwrite}
    if target_file_size is not None:
        options["target_file_size"] = target_file_size
    with ckptfmt.open_writer(dst, profile="training", **options) as writer:
        for field, tensors in tensor_fields.items():
            writer.write_tensors(field, {})
            for name in names[field]:
                tensor = tensors[name]
                writer.write_tensor(field, name, tensor)
                result.tensors += 1
                result.bytes += _nbytes(tensor)
                progress.advance(_nbytes(tensor))
        writer.write_context("optimizer", optimizer[1])
        for field, value in contexts.items():
            writer.write_context(field, value)
    result.checkpoint_id = writer.checkpoint_id


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
    import torch

    import ckptfmt

    progress = progress or NoProgress()
    out = locate(dst, storage_options)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="hf-trainer")
    with ckptfmt.open(src, storage_options) as ckpt:
        if "weights" not in ckpt.fields or ckpt.field("weights").kind != "tensors":
            raise UsageError("the checkpoint has no 'weights' tensor field", path=ckpt.url)
        contexts = {n: ckpt.read_context(n) for n, rec in ckpt.fields.items() if rec.context is not None}
        step = _step(contexts)
        files: dict[str, Any] = {}
        if "optimizer" in ckpt.fields and ckpt.field("optimizer").kind == "tensors":
            opt_tensors, opt_context = ckpt.read_tensors("optimizer"), contexts.get("optimizer", {})
            if "optimizers" in opt_context:
                raise UsageError("the checkpoint holds several optimizers; the Trainer has one", path=ckpt.url)
            if opt_tensors or opt_context.get("param_groups"):  # an empty field: the source had no optimizer
                files[OPTIMIZER] = join_optimizer(opt_tensors, opt_context)
        for fname, name in (("scheduler", SCHEDULER), ("grad_scaler", SCALER)):
            if isinstance(contexts.get(fname), Mapping) and "state" in contexts[fname]:
                files[name] = torchify(contexts[fname]["state"])
        found = contexts.get("rng", {}).get("generators")
        generators: dict[str, Any] = dict(found) if isinstance(found, Mapping) else {}
        ranks = sorted({int(m.group(1)) for n in generators if (m := re.match(r"rank(\d+)/", n))})
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
        for name, obj in files.items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            write_output(out, name, buf.getvalue())
            result.files.append(name)
        for name, doc in json_files.items():
            text = _json_text(doc)
            write_output(out, name, text.encode("utf-8"))
            result.files.append(name)
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
