"""Every parser and every CLI command, as a fuzz target.

A :class:`Target` makes a :class:`Case` from a seeded ``random.Random`` (a mutated artefact) and runs it. Four
kinds: ``parser`` (bytes in, no file system: cheap, most of the examples), ``api`` (a tree of files in the
sandbox's root through the public API), ``cli`` (``ckpt`` through click's CliRunner, in process) and
``subprocess`` (the installed ``ckpt`` console script: what a user's shell sees, a handful per run).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Literal

from .mutators import (
    Symlink,
    Tree,
    guarded,
    mutate_bytes,
    mutate_json,
    mutate_manifest,
    mutate_msgpack,
    mutate_pickle,
    mutate_safetensors,
    mutate_tree,
)
from .oracle import CliResult
from .seeds import PROTECTED, new_model, seed_bytes, seeds
from .sentinel import Sandbox

Kind = Literal["parser", "api", "cli", "subprocess"]
CKPT = Path(sys.executable).parent / "ckpt"
MAX_INPUT_BYTES = 1 << 20


@dataclass
class Case:
    """One input: bytes for a parser, or a tree for the sandbox's root (and dest), plus arguments."""

    data: bytes = b""
    tree: Tree = field(default_factory=dict)
    dest: Tree = field(default_factory=dict)
    protected: dict[str, bytes] = field(default_factory=dict)
    args: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Bytes of input in all: the memory bound grows with it."""
        trees = (self.tree, self.dest)
        return len(self.data) + sum(len(v) for tree in trees for v in tree.values() if isinstance(v, bytes))

    def summary(self) -> str:
        """What the input was, for a violation's report."""
        if self.tree:
            return f"tree of {len(self.tree)} entries, args {list(self.args)}"
        return f"{len(self.data)} bytes, args {list(self.args)}"


@dataclass(frozen=True)
class Target:
    name: str
    kind: Kind
    count: int  # examples in the default (CI) run
    make: Callable[[Random], Case]
    run: Callable[[Case, Sandbox | None], CliResult | None]
    check_tamper: bool = False

    @property
    def uses_sandbox(self) -> bool:
        return self.kind != "parser"


# ---------------------------------------------------------------- case makers


def _bytes_case(
    kind: str, mutate: Callable[[bytes, Random], bytes], rounds: tuple[int, ...] = (1, 1, 2)
) -> Callable[[Random], Case]:
    def make(rng: Random) -> Case:
        data = rng.choice(seed_bytes(kind))
        for _ in range(rng.choice(rounds)):
            if len(data) > MAX_INPUT_BYTES:  # copies of copies: big enough, and the memory bound is for small inputs
                break
            data = guarded(mutate, data, rng)
        return Case(data=data)

    return make


def _any_json(rng: Random) -> Case:
    data = rng.choice(seed_bytes("json") + seed_bytes("manifest"))
    return Case(data=mutate_json(data, rng))


def _tree_case(
    *names: str, rounds: tuple[int, ...] = (1, 1, 1, 2), hostile_dest: bool = False
) -> Callable[[Random], Case]:
    def make(rng: Random) -> Case:
        name = rng.choice(names)
        tree = dict(seeds()[name])
        for _ in range(rng.choice(rounds)):
            tree = mutate_tree(tree, rng)
        dest: Tree = {}
        if hostile_dest and rng.random() < 0.1:  # a destination whose field directory is a symlink outside
            dest = {"out/weights": Symlink("sentinel-dir")}
        # protected: the user's files the mutation left as they were (a mutated one is no longer the user's)
        protected = {p: d for p, d in PROTECTED.items() if name == "run" and tree.get(p) == d}
        return Case(tree=tree, dest=dest, protected=protected, args=(name,))

    return make


def _hf_case(rng: Random) -> Case:
    """Hugging Face sources; one in six has its index point into a subdirectory that is a symlink outside."""
    case = _tree_case("hf-single", "hf-sharded", hostile_dest=True)(rng)
    if rng.random() < 1 / 6:
        tree = dict(seeds()["hf-sharded"])
        index = json.loads(tree["model.safetensors.index.json"])  # type: ignore[arg-type]
        index["weight_map"] = {"w": "shards/model.safetensors"}
        tree = {"model.safetensors.index.json": json.dumps(index).encode(), "shards": Symlink("sentinel-dir")}
        case = Case(tree=tree, args=("hf-sharded",))
    return case


def _diff_case(rng: Random) -> Case:
    name = rng.choice(("training", "weights"))
    base = seeds()[name]
    mutated = dict(base)
    for _ in range(rng.choice((1, 1, 2))):
        mutated = mutate_tree(mutated, rng)
    a, b = (base, mutated) if rng.random() < 0.5 else (mutated, base)
    tree: Tree = {f"a/{k}": v for k, v in a.items()} | {f"b/{k}": v for k, v in b.items()}
    return Case(tree=tree, args=(name,))


# ---------------------------------------------------------------- parser runs


def _parse_manifest(case: Case, box: Sandbox | None) -> None:
    import ckptfmt

    ckptfmt.parse_manifest(case.data)


def _safetensors_header(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.safetensors_io import header_length, parse_header

    n = header_length(case.data[:8], len(case.data), "x.safetensors")
    parse_header(case.data[8 : 8 + n], len(case.data), "x.safetensors")


def _context_decode(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.context import decode
    from ckptfmt.fields import CHECKS, check_standard_field

    value = decode(case.data, path="f/context.msgpack", field="f")
    for name in CHECKS:  # the schema checks run on whatever decodes
        try:
            check_standard_field(name, value)
        except Exception as exc:
            import ckptfmt

            if not isinstance(exc, ckptfmt.CheckpointError):
                raise


def _dcp_metadata(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.convert.dcp_metadata import parse_metadata

    parse_metadata(case.data)


def _load_json(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.errors import ManifestError
    from ckptfmt.jsonio import load_json

    load_json(case.data, error=ManifestError, what="document", path="x.json", allow_float=True)


def _lock_case(rng: Random) -> Case:
    tree = seeds()["run"]
    data = tree["step-000000003/.writer-lock"]
    assert isinstance(data, bytes)
    return Case(data=mutate_json(data, rng))


def _writer_lock(case: Case, box: Sandbox | None) -> None:
    # the lock as gc and the writer's takeover read it: parse, then ask whether its holder is gone
    from ckptfmt.lock import read_lock
    from ckptfmt.storage import open_store

    assert box is not None
    (box.root / ".writer-lock").write_bytes(case.data)
    lock = read_lock(open_store(str(box.root)))
    if lock is not None:
        lock.holder_is_dead()
        lock.age_seconds()
        lock.holder()


# ---------------------------------------------------------------- API runs over trees


def _open_read(case: Case, box: Sandbox | None) -> None:
    import ckptfmt

    assert box is not None
    with ckptfmt.open(str(box.root)) as ckpt:
        for name in ckpt.fields:
            for tensor in ckpt.tensor_names(name):
                ckpt.read_tensor(name, tensor)
            if ckpt.has_context(name):
                ckpt.read_context(name)


def _verify(case: Case, box: Sandbox | None) -> None:
    import ckptfmt

    assert box is not None
    ckptfmt.verify(str(box.root))


def _convert(to: str, source_format: str | None, src: str = "") -> Callable[[Case, Sandbox | None], None]:
    def run(case: Case, box: Sandbox | None) -> None:
        from ckptfmt.convert import convert

        assert box is not None
        source = str(box.root / src) if src else str(box.root)
        extra = {"max_shard_size": 64} if to == "hf" else {}
        convert(source, str(box.dest / "out"), to=to, source_format=source_format, **extra)  # type: ignore[arg-type]

    return run


def _run_directory(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.run import RunDirectory

    assert box is not None
    run = RunDirectory(str(box.root))
    run.entries()
    run.latest()
    run.pinned()
    run.plan_gc(keep_last=1, keep_every=2)


def _gc(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.run import RunDirectory

    assert box is not None
    RunDirectory(str(box.root)).gc(keep_last=1)


def _restore_latest(case: Case, box: Sandbox | None) -> None:
    from ckptfmt.torch import CheckpointManager

    assert box is not None
    logging.getLogger("ckptfmt").setLevel(logging.ERROR)  # its WARNINGs about skipped checkpoints are expected
    with CheckpointManager(str(box.root), keep_last=None, preemption_signals=(), verify_on_restore=True) as mgr:
        mgr.restore_latest(model=new_model())


# ---------------------------------------------------------------- CLI


def _cli_args(case: Case, box: Sandbox) -> list[str]:
    return [a.replace("{root}", str(box.root)).replace("{dest}", str(box.dest)) for a in case.args[1:]]


def _clirunner(case: Case, box: Sandbox | None) -> CliResult:
    from ckptfmt.cli import cli  # type: ignore[import-not-found,unused-ignore]
    from click.testing import CliRunner

    assert box is not None
    result = CliRunner().invoke(cli, _cli_args(case, box), catch_exceptions=True)
    return CliResult(result.exit_code, result.stdout, result.stderr, result.exception)


def _subprocess(case: Case, box: Sandbox | None) -> CliResult:
    assert box is not None
    proc = subprocess.run([str(CKPT), *_cli_args(case, box)], capture_output=True, text=True, timeout=60, check=False)
    return CliResult(proc.returncode, proc.stdout, proc.stderr, None)


def _with_args(make: Callable[[Random], Case], *variants: tuple[str, ...]) -> Callable[[Random], Case]:
    def wrapped(rng: Random) -> Case:
        case = make(rng)
        case.args = (case.args[0] if case.args else "", *rng.choice(variants))
        return case

    return wrapped


R, D = "{root}", "{dest}"
CHECKPOINTS = ("training", "weights")


def all_targets() -> list[Target]:
    """Every target with its example count in the default run (about 10^5 in all, parsers the most)."""
    api_ckpt = _tree_case(*CHECKPOINTS)
    return _targets(api_ckpt) + _later_surfaces()


def _later_surfaces() -> list[Target]:
    """The surfaces added after the harness (issue 23): the zstd codec, the run directory's pointer files, the
    memory tier's slots and rescue, the Trainer's training_args.bin. Their own oracles live beside their cases."""
    from . import codec_cases, memory_cases, rundir_cases, trainer_cases
    from .rundir_cases import cli_checked, keep_last_of

    memory = memory_cases.make_memory_case
    pointers = rundir_cases.make_pointer_case
    trainer = trainer_cases.make_trainer_case
    return [
        Target("zstd_read", "api", 45, codec_cases.make_zstd_case, codec_cases.read_zstd),
        Target("zstd_verify", "api", 20, codec_cases.make_zstd_case, codec_cases.verify_zstd),
        Target(
            "cli_zstd",
            "cli",
            15,
            _with_args(codec_cases.make_zstd_case, ("verify", R, "--json"), ("inspect", R, "--tensors")),
            _clirunner,
        ),
        Target("run_pointers", "api", 8, pointers, rundir_cases.run_directory),
        Target("cli_ls_pointers", "cli", 10, _with_args(pointers, ("ls", R), ("ls", R, "--json")), _clirunner),
        Target(
            "cli_gc_pointers",
            "cli",
            10,
            _with_args(pointers, ("gc", R, "--keep-last", "1"), ("gc", R), ("gc", R, "--dry-run", "--keep-last", "1")),
            cli_checked(keep_last_of),
        ),
        Target("memory_slots", "api", 40, memory, memory_cases.slots_api),
        Target("memory_rescue", "api", 25, memory, memory_cases.rescue_api),
        Target(
            "cli_rescue",
            "cli",
            12,
            _with_args(memory, ("rescue", R, D + "/run", "--json"), ("rescue", R, D + "/run")),
            memory_cases.rescue_cli,
        ),
        Target("training_args", "api", 80, trainer_cases.make_args_case, trainer_cases.read_args),
        Target("import_hf_trainer", "api", 15, trainer, _convert("ckptfmt", "hf-trainer")),
        Target(
            "cli_convert_from_hf_trainer",
            "cli",
            6,
            _with_args(trainer, ("convert", R, D + "/out", "--to", "ckptfmt", "--from", "hf-trainer")),
            _clirunner,
        ),
    ]


def _targets(api_ckpt: Callable[[Random], Case]) -> list[Target]:
    return [
        # parsers: bytes in
        Target("parse_manifest", "parser", 4_000, _bytes_case("manifest", mutate_manifest), _parse_manifest),
        Target(
            "safetensors_header", "parser", 40_000, _bytes_case("safetensors", mutate_safetensors), _safetensors_header
        ),
        Target("context_decode", "parser", 55_000, _bytes_case("msgpack", mutate_msgpack), _context_decode),
        Target("load_json", "parser", 6_000, _any_json, _load_json),
        Target("dcp_metadata", "parser", 1_500, _bytes_case("pickle", mutate_pickle), _dcp_metadata, check_tamper=True),
        Target("writer_lock", "api", 400, _lock_case, _writer_lock),
        # the public API over trees of files
        Target("open_read", "api", 300, api_ckpt, _open_read),
        Target("verify", "api", 120, api_ckpt, _verify),
        Target("run_directory", "api", 25, _tree_case("run"), _run_directory),
        Target("gc", "api", 20, _tree_case("run"), _gc),
        Target("restore_latest", "api", 10, _tree_case("run"), _restore_latest),
        Target("import_hf", "api", 150, _hf_case, _convert("ckptfmt", "hf")),
        Target("import_pt", "api", 80, _tree_case("pt", hostile_dest=True), _convert("ckptfmt", "pt")),
        Target(
            "import_dcp",
            "api",
            80,
            _tree_case("dcp", hostile_dest=True),
            _convert("ckptfmt", "dcp"),
            check_tamper=True,
        ),
        Target("export_hf", "api", 60, _tree_case(*CHECKPOINTS, hostile_dest=True), _convert("hf", "ckptfmt")),
        Target("export_dcp", "api", 30, _tree_case(*CHECKPOINTS), _convert("dcp", "ckptfmt")),
        Target("reencode", "api", 60, _tree_case(*CHECKPOINTS, hostile_dest=True), _convert("ckptfmt", "ckptfmt")),
        # every CLI command, in process
        Target(
            "cli_inspect",
            "cli",
            100,
            _with_args(api_ckpt, ("inspect", R), ("inspect", R, "--tensors", "--json")),
            _clirunner,
        ),
        Target(
            "cli_verify",
            "cli",
            80,
            _with_args(api_ckpt, ("verify", R), ("verify", R, "--json"), ("verify", R, "--quick")),
            _clirunner,
        ),
        Target("cli_dump", "cli", 60, _with_args(api_ckpt, ("dump", "--canonical", R)), _clirunner),
        Target(
            "cli_diff",
            "cli",
            40,
            _with_args(_diff_case, ("diff", R + "/a", R + "/b"), ("diff", R + "/a", R + "/b", "--json")),
            _clirunner,
        ),
        Target("cli_ls", "cli", 20, _with_args(_tree_case("run"), ("ls", R), ("ls", R, "--json")), _clirunner),
        Target(
            "cli_gc_dry_run",
            "cli",
            10,
            _with_args(_tree_case("run"), ("gc", R, "--dry-run", "--keep-last", "1")),
            _clirunner,
        ),
        Target(
            "cli_gc", "cli", 10, _with_args(_tree_case("run"), ("gc", R, "--keep-last", "1"), ("gc", R)), _clirunner
        ),
        Target(
            "cli_convert_from_hf",
            "cli",
            60,
            _with_args(_hf_case, ("convert", R, D + "/out", "--to", "ckptfmt")),
            _clirunner,
        ),
        Target(
            "cli_convert_from_pt",
            "cli",
            40,
            _with_args(_tree_case("pt"), ("convert", R, D + "/out", "--to", "ckptfmt", "--from", "pt")),
            _clirunner,
        ),
        Target(
            "cli_convert_from_dcp",
            "cli",
            40,
            _with_args(_tree_case("dcp"), ("convert", R, D + "/out", "--to", "ckptfmt", "--from", "dcp")),
            _clirunner,
            check_tamper=True,
        ),
        Target(
            "cli_convert_to_hf",
            "cli",
            30,
            _with_args(api_ckpt, ("convert", R, D + "/out", "--to", "hf", "--max-shard-size", "64")),
            _clirunner,
        ),
        Target(
            "cli_convert_to_dcp", "cli", 15, _with_args(api_ckpt, ("convert", R, D + "/out", "--to", "dcp")), _clirunner
        ),
        Target(
            "cli_convert_reencode",
            "cli",
            30,
            _with_args(api_ckpt, ("convert", R, D + "/out", "--to", "ckptfmt", "--target-file-size", "64")),
            _clirunner,
        ),
        # the installed console script, a handful
        Target("subprocess_inspect", "subprocess", 1, _with_args(api_ckpt, ("inspect", R)), _subprocess),
        Target("subprocess_verify", "subprocess", 1, _with_args(api_ckpt, ("verify", R)), _subprocess),
        Target(
            "subprocess_gc", "subprocess", 1, _with_args(_tree_case("run"), ("gc", R, "--keep-last", "1")), _subprocess
        ),
        Target(
            "subprocess_convert",
            "subprocess",
            1,
            _with_args(_tree_case("hf-single"), ("convert", R, D + "/out", "--to", "ckptfmt")),
            _subprocess,
        ),
    ]


def by_name() -> dict[str, Target]:
    return {t.name: t for t in all_targets()}


__all__ = ["Case", "Target", "all_targets", "by_name", "mutate_bytes"]
