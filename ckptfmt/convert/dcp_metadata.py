"""Reading a PyTorch Distributed Checkpoint's ``.metadata`` without trusting it.

torch's own reader calls ``pickle.load`` on it: a downloaded checkpoint could run any code, and even a
"restricted" unpickler that hands out the real classes lets the file ``BUILD`` (setattr) onto a class
object and tamper with it for the whole process. So no real class or callable ever reaches the pickle:

1. the opcode stream is walked first (``pickletools.genops``) and any opcode outside an allow-list
   (``INST``, ``OBJ``, ``EXT*``, persistent ids, out-of-band buffers...) is refused;
2. :class:`MetadataUnpickler` resolves only the names DCP metadata is made of, each to an inert stand-in
   created for this one load (:class:`Stub` subclasses that record their constructor arguments and
   state, ``DTypeName`` for a torch dtype, ``dict`` for ``OrderedDict``), and refuses every other name;
3. the stand-in tree is then read field by field into frozen records, checking each field's type: dtype,
   size and chunks of each tensor, and for each stored item a plain file name, an offset and a length.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import SourceFormatError

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 256 << 20

_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[str, frozenset[str]] = {
    _DCP: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties"}),  # torch < 2.1
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
}

# Everything a protocol 2-5 pickle of plain data, objects built by NEWOBJ/REDUCE + BUILD, and memo use
# needs. Not admitted: INST/OBJ (old-style calls), EXT1/2/4 (copyreg registry), PERSID/BINPERSID,
# NEXT_BUFFER/READONLY_BUFFER (out-of-band data).
ALLOWED_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
        "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
        "FLOAT", "BINFLOAT",
        "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
        "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET",
        "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
        "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD",
    }
)  # fmt: skip


class Stub:
    """An inert stand-in for one admitted class: records how the pickle built it, runs nothing.

    ``find_class`` hands out a fresh subclass per name per load, so whatever a file does to one (even a
    ``BUILD`` against the class object itself) stays inside that load.
    """

    qualname = ""

    def __new__(cls, *args: object, **kwargs: object) -> Stub:
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state = None
        return self

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        self.state = state

    args: tuple[object, ...]
    kwargs: dict[str, object]
    state: object


@dataclass(frozen=True, slots=True)
class DTypeName:
    """A torch dtype named by the pickle (``torch.float32``), looked up only after validation."""

    name: str


class MetadataUnpickler(pickle.Unpickler):
    """Resolves the DCP metadata names to inert stand-ins and refuses every other name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._stubs: dict[str, type[Stub]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            qualname = f"{module}.{name}"
            if qualname not in self._stubs:
                self._stubs[qualname] = type(name, (Stub,), {"qualname": qualname, "__module__": __name__})
            return self._stubs[qualname]
        if module == "collections" and name == "OrderedDict":
            return dict  # a builtin type: its attributes cannot be set
        if module == "torch" and name.isidentifier() and not name.startswith("_"):
            return DTypeName(name)  # checked to be a torch.dtype after loading
        raise SourceFormatError(
            f"refused to unpickle {module}.{name}: only DCP metadata classes may appear in .metadata "
            "(this file may be malicious)",
            path=METADATA_NAME,
        )

    def persistent_load(self, pid: object) -> Any:
        raise SourceFormatError("refused: persistent ids do not belong in DCP metadata", path=METADATA_NAME)


def check_opcodes(data: bytes) -> None:
    """Refuse a pickle holding any opcode outside :data:`ALLOWED_OPCODES` (before anything is unpickled)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # genops warns on odd STRING escapes; they are refused or harmless
            for opcode, _arg, position in pickletools.genops(data):
                if opcode.name not in ALLOWED_OPCODES:
                    raise _fail(
                        f"refused: pickle opcode {opcode.name} at byte {position} does not belong in DCP metadata"
                    )
    except SourceFormatError:
        raise
    except Exception as exc:  # genops raises ValueError, EOFError, UnicodeDecodeError, struct.error, ...
        raise _fail(f"not a readable DCP metadata pickle: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredItem:
    """Where one tensor chunk or one byte blob lives: ``relative_path[offset:offset+length]``."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkInfo:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: StoredItem


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    dtype: Any  # torch.dtype
    size: tuple[int, ...]
    chunks: tuple[ChunkInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpMetadata:
    tensors: dict[str, TensorInfo]
    blobs: dict[str, StoredItem]  # non-tensor values (torch.save'd bytes)
    version: str | None


def _fail(message: str) -> SourceFormatError:
    return SourceFormatError(message, path=METADATA_NAME)


def _kind(value: object) -> str:
    # never repr() a value from the file: it may nest thousands deep
    return value.qualname if isinstance(value, Stub) else type(value).__name__


def _is(value: object, *names: str) -> bool:
    return isinstance(value, Stub) and value.qualname.rpartition(".")[2] in names


def _state(value: object, what: str) -> dict[str, object]:
    """The field values of a stand-in dataclass: BUILD state ``{...}`` or ``(None | {...}, {slots})``."""
    state = value.state if isinstance(value, Stub) else None
    if type(state) is tuple and len(state) == 2:
        merged: dict[str, object] = {}
        for part in state:
            if part is not None and type(part) is not dict:
                raise _fail(f"{what} has state of type {type(part).__name__}")
            merged.update(part or {})
        state = merged
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise _fail(f"{what} has state of type {type(state).__name__}, not a field map")
    return state


def _ints(value: object, what: str) -> tuple[int, ...]:
    if _is(value, "Size"):
        assert isinstance(value, Stub)
        if len(value.args) != 1 or value.kwargs:
            raise _fail(f"{what}: torch.Size must be built from one tuple")
        value = value.args[0]
    if not isinstance(value, (tuple, list)) or type(value) not in (tuple, list):
        raise _fail(f"{what} must be non-negative integers, got a {_kind(value)}")
    if not all(type(v) is int and v >= 0 for v in value):
        raise _fail(f"{what} must be non-negative integers")
    return tuple(value)


def _stored(info: object, fqn: str) -> StoredItem:
    if not _is(info, "_StorageInfo"):
        raise _fail(f"{fqn!r} is stored as a {_kind(info)}, not a _StorageInfo")
    state = _state(info, f"{fqn!r} storage info")
    path = state.get("relative_path")
    offset = state.get("offset")
    length = state.get("length")
    if type(path) is not str or not path or "/" in path or "\\" in path or path in (".", "..") or ":" in path:
        shown = repr(path) if type(path) is str else f"a {_kind(path)}"
        raise _fail(f"{fqn!r} is stored in {shown}, which is not a plain file name in the checkpoint directory")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _fail(f"{fqn!r} has an invalid offset/length ({_kind(offset)}/{_kind(length)})")
    if state.get("transform_descriptors"):
        raise _fail(f"{fqn!r} is stored with transforms, which are not supported")
    return StoredItem(relative_path=path, offset=offset, length=length)


def _dtype(properties: object, fqn: str) -> Any:
    import torch

    if not _is(properties, "TensorProperties"):
        raise _fail(f"{fqn!r} has properties of type {_kind(properties)}")
    assert isinstance(properties, Stub)
    state = properties.state
    # TensorProperties pickles as a tuple (dtype, layout, requires_grad, memory_format, pin_memory);
    # older torch as its field map
    name = state[0] if type(state) is tuple and state else _state(properties, f"{fqn!r} properties").get("dtype")
    dtype = getattr(torch, name.name, None) if isinstance(name, DTypeName) else None
    if not isinstance(dtype, torch.dtype):
        raise _fail(f"{fqn!r} has dtype of type {_kind(name)}, not a torch dtype")
    return dtype


def _index(index: object) -> tuple[str, tuple[int, ...] | None]:
    if not _is(index, "MetadataIndex"):
        raise _fail(f"storage_data key of type {_kind(index)} is not a MetadataIndex")
    state = _state(index, "a MetadataIndex")
    fqn = state.get("fqn")
    if type(fqn) is not str:
        raise _fail(f"storage_data key has an fqn of type {_kind(fqn)}")
    offset = state.get("offset")
    return fqn, None if offset is None else _ints(offset, f"{fqn!r} offset")


def parse_metadata(data: bytes) -> DcpMetadata:
    """Validate and unpickle (into inert stand-ins) ``.metadata`` bytes, then read them field by field."""
    if len(data) > MAX_METADATA_BYTES:
        raise _fail(f"{len(data)} bytes exceeds {MAX_METADATA_BYTES}")
    check_opcodes(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (odd STRING escapes warn; the stand-in tree is checked below)
            md = MetadataUnpickler(io.BytesIO(data)).load()
    except SourceFormatError:
        raise
    except Exception as exc:  # a malformed pickle can raise almost anything; none of it may escape raw
        raise _fail(f"not a readable DCP metadata pickle: {type(exc).__name__}: {exc}") from exc
    if not _is(md, "Metadata"):
        raise _fail(f"holds a {_kind(md)}, not DCP Metadata")
    state = _state(md, "Metadata")
    state_dict = state.get("state_dict_metadata")
    storage = state.get("storage_data")
    if type(state_dict) is not dict:
        raise _fail(f"state_dict_metadata is a {_kind(state_dict)}, not a dict")
    if type(storage) is not dict:
        raise _fail("has no storage_data: written by a storage writer other than the file system one")
    where: dict[tuple[str, tuple[int, ...] | None], StoredItem] = {}
    for index, info in storage.items():
        fqn, offset = _index(index)
        where[(fqn, offset)] = _stored(info, fqn)
    tensors: dict[str, TensorInfo] = {}
    blobs: dict[str, StoredItem] = {}
    for fqn, meta in state_dict.items():
        if type(fqn) is not str:
            raise _fail(f"state_dict_metadata key of type {_kind(fqn)} is not a string")
        if _is(meta, "BytesStorageMetadata"):
            if (fqn, None) not in where:
                raise _fail(f"{fqn!r} has no stored bytes")
            blobs[fqn] = where[(fqn, None)]
        elif _is(meta, "TensorStorageMetadata"):
            fields = _state(meta, f"{fqn!r} metadata")
            size = _ints(fields.get("size"), f"{fqn!r} size")
            chunk_list = fields.get("chunks")
            if type(chunk_list) is not list:
                raise _fail(f"{fqn!r} chunks are a {_kind(chunk_list)}, not a list")
            chunks = []
            for chunk in chunk_list:
                if not _is(chunk, "ChunkStorageMetadata"):
                    raise _fail(f"{fqn!r} has a chunk of type {_kind(chunk)}")
                geometry = _state(chunk, f"{fqn!r} chunk")
                offsets = _ints(geometry.get("offsets"), f"{fqn!r} chunk offsets")
                sizes = _ints(geometry.get("sizes"), f"{fqn!r} chunk sizes")
                if (fqn, offsets) not in where:
                    raise _fail(f"{fqn!r} chunk at {list(offsets)} has no stored bytes")
                chunks.append(ChunkInfo(offsets=offsets, sizes=sizes, item=where[(fqn, offsets)]))
            dtype = _dtype(fields.get("properties"), fqn)
            tensors[fqn] = TensorInfo(dtype=dtype, size=size, chunks=tuple(chunks))
        else:
            raise _fail(f"{fqn!r} has metadata of type {_kind(meta)}")
    version = state.get("version")
    return DcpMetadata(tensors=tensors, blobs=blobs, version=version if type(version) is str else None)
