"""The registry of formats: what each is called, how it is recognized, which functions read and write it.

Call sequence, as :func:`ckptfmt.convert.convert` runs it: the source's :class:`Format` is the one
named (:func:`find`) or the first whose :meth:`Format.detect` claims the source (:func:`detect`);
then either the source format's :meth:`Format.read` imports it into ckptfmt, or the target format's
:meth:`Format.write` exports a ckptfmt checkpoint. Every conversion goes to or from ckptfmt.

A format's functions live in its own module and are imported when first called, so importing this
registry loads no converter (and neither torch nor click).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .base import ConvertResult, Progress


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What a conversion is asked for beyond its source and destination; each format takes what applies."""

    storage_options: Mapping[str, Any] | None = None
    overwrite: bool = False
    target_file_size: int | None = None
    max_shard_size: int | None = None
    field: str = "weights"
    progress: Progress | None = None


def _names(*names: str) -> Callable[[Mapping[str, str]], bool]:
    return lambda listing: any(n in listing for n in names)


def _endings(*endings: str, prefix: str = "") -> Callable[[Mapping[str, str]], bool]:
    return lambda listing: any(n.startswith(prefix) and n.endswith(endings) for n in listing)


@dataclass(frozen=True, slots=True, kw_only=True)
class Format:
    """One format: its names, how a source is recognized (from names alone: nothing is opened), and
    ``module:function`` of its reader (import into ckptfmt) and writer (export from ckptfmt)."""

    name: str
    aliases: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ()  # a source URL ending so is this format...
    suffix_needs_file: bool = False  # ...but only when it is not a directory
    marks: Callable[[Mapping[str, str]], bool] | None = None  # a directory listing that is this format
    reader: str | None = None
    writer: str | None = None
    write_options: tuple[str, ...] = ()  # the Options fields its writer takes, beyond the common ones

    def claims_name(self, url: str, is_directory: Callable[[], bool]) -> bool:
        """Whether the source's URL alone says it is this format."""
        return (
            url.endswith(self.suffixes) if self.suffixes and not (self.suffix_needs_file and is_directory()) else False
        )

    def detect(self, listing: Mapping[str, str]) -> bool:
        """Whether a directory holding ``listing`` (name -> kind) is this format."""
        return self.marks is not None and self.marks(listing)

    def read(self, src: str, dst: str, options: Options) -> ConvertResult:
        if self.reader is None:
            raise UsageError(f"format {self.name!r} cannot be read")
        return _load(self.reader)(
            src,
            dst,
            storage_options=options.storage_options,
            overwrite=options.overwrite,
            target_file_size=options.target_file_size,
            progress=options.progress,
        )

    def write(self, src: str, dst: str, options: Options) -> ConvertResult:
        if self.writer is None:
            raise UsageError(f"format {self.name!r} is import only")
        extra = {k: getattr(options, k) for k in self.write_options if getattr(options, k) is not None}
        return _load(self.writer)(
            src,
            dst,
            storage_options=options.storage_options,
            overwrite=options.overwrite,
            progress=options.progress,
            **extra,
        )


def _load(target: str) -> Callable[..., ConvertResult]:
    module, _, function = target.partition(":")
    found: Callable[..., ConvertResult] = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    return found


REGISTRY: tuple[Format, ...] = (
    Format(
        name="ckptfmt",
        marks=_names("manifest.json", ".writer-lock"),
        reader="native:reencode",
        writer="native:reencode",
        write_options=("target_file_size",),
    ),
    Format(
        name="hf",
        aliases=("safetensors",),
        suffixes=(".safetensors", ".safetensors.index.json"),
        marks=_endings(".safetensors.index.json", ".safetensors"),
        reader="hf:import_hf",
        writer="hf:export_hf",
        write_options=("max_shard_size", "field"),
    ),
    Format(
        name="pt",
        aliases=("torch", "pth", "bin"),
        suffixes=(".pt", ".bin", ".pth"),
        marks=_endings(".pt", ".bin", ".pth"),
        reader="torch_pt:import_pt",
    ),
    Format(
        name="dcp",
        marks=_names(".metadata"),
        reader="dcp:import_dcp",
        writer="dcp:export_dcp",
        write_options=("field",),
    ),
    Format(
        name="hf-trainer",
        marks=_names("trainer_state.json"),
        reader="hf_trainer:import_hf_trainer",
        writer="hf_trainer:export_hf_trainer",
    ),
    Format(
        name="lightning",
        aliases=("ckpt",),
        # a file; a directory named *.ckpt is what ckptfmt's Lightning plugin writes
        suffixes=(".ckpt",),
        suffix_needs_file=True,
        reader="lightning:import_lightning",
        writer="lightning:export_lightning",
    ),
    Format(
        name="accelerate",
        marks=_endings(".pkl", prefix="random_states_"),
        reader="accelerate:import_accelerate",
        writer="accelerate:export_accelerate",
    ),
)
_BY_NAME = {f.name: f for f in REGISTRY}
FORMATS: tuple[str, ...] = tuple(_BY_NAME)
ALIASES: dict[str, str] = {alias: f.name for f in REGISTRY for alias in f.aliases}
WRITABLE: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.writer is not None)
# the order sources are recognized in: by URL first (a file's suffix), then by what a directory holds
BY_URL: tuple[Format, ...] = tuple(_BY_NAME[n] for n in ("lightning", "pt", "hf"))
BY_LISTING: tuple[Format, ...] = tuple(_BY_NAME[n] for n in ("ckptfmt", "dcp", "hf-trainer", "accelerate", "hf", "pt"))


def find(name: str) -> Format:
    """The format called ``name`` or one of its aliases (any case)."""
    fmt = ALIASES.get(name.lower(), name.lower())
    if fmt not in _BY_NAME:
        raise UsageError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return _BY_NAME[fmt]
