"""``training_args.bin``: the plain fields of a pickled ``TrainingArguments``, read without unpickling.

The file (a torch zip archive or a bare pickle) is never unpickled: its opcodes are interpreted by
:func:`~.pickle_scan.scan_pickle`, so its plain fields (gradient accumulation for the data position,
the learning rate, the optimizer's name...) are read without running anything; ``*_token`` fields
are dropped. A caller whose file cannot be read so skips it and says so.
"""

from __future__ import annotations

import math

from ..errors import SourceFormatError
from .base import Location, read_file
from .pickle_scan import Opaque, scan_pickle

TRAINING_ARGS = "training_args.bin"
MAX_ARGS_BYTES = 16 << 20
# TrainingArguments.optim values of torch's own optimizers (the part before "_": adamw_torch_fused -> adamw)
OPTIM_CLASSES = {"adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}


def optimizer_class(training_args: dict[str, object]) -> str | None:
    """The class name of the optimizer ``TrainingArguments.optim`` names, when it is one of torch's own."""
    optim = training_args.get("optim")
    return OPTIM_CLASSES.get(optim.split("_")[0]) if isinstance(optim, str) else None


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
    if not (isinstance(root, Opaque) and root.name.endswith("TrainingArguments") and isinstance(root.state, dict)):
        raise SourceFormatError("does not hold a TrainingArguments object", path=loc.url)
    out: dict[str, object] = {}
    for key, value in root.state.items():
        if not isinstance(key, str) or key.endswith("_token") or key.startswith("_"):
            continue
        if isinstance(value, Opaque) and isinstance(value.args, tuple) and len(value.args) == 1:
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
