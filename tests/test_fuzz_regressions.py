"""Every violation the hostile-input harness found, and every hole issue 9 names, as a fixed input and the oracle.

Each test runs one input through the oracle of tests/hostile/oracle.py (only ckptfmt's own errors escape, the CLI
exits 0/1/2 with a message and no traceback, bounded time and memory, nothing outside the root touched) and, where
the oracle cannot know it (a corrupt checkpoint diffed as identical, a NaN accepted), asserts the refusal itself.
Inputs are bytes in the test or files under tests/hostile/corpus/.

A ``xfail(strict=True)`` mark means the defect is being fixed by its file's owner as this lands: the test turns
into a failure (XPASS) once the fix is in, which is the signal to remove the mark (and the matching KNOWN entry of
tests/test_fuzz.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile.campaign import fast_tmp, run_case
from hostile.mutators import _BUILD_ON_CLASS, _SETITEM_ON_ENUM, Fifo, Symlink, Tree
from hostile.oracle import CliResult, Outcome, fuzzing, run_one
from hostile.seeds import PROTECTED, seeds
from hostile.sentinel import Sandbox
from hostile.targets import Case, by_name

import ckptfmt
from ckptfmt.errors import CheckpointError, SafetensorsHeaderError, SourceFormatError

CORPUS = Path(__file__).parent / "hostile" / "corpus"
TARGETS = by_name()


@pytest.fixture
def box() -> Iterator[Sandbox]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptfmt-regress-", dir=fast_tmp()) as tmp:
        yield Sandbox(Path(tmp))


def oracle(call: Callable[[], CliResult | None], **kwargs: object) -> Outcome:
    with fuzzing():
        return run_one(call, **kwargs)  # type: ignore[arg-type]


def run_target(name: str, box: Sandbox, tree: Tree, dest: Tree | None = None, **case: object) -> Outcome:
    with fuzzing():
        return run_case(TARGETS[name], Case(tree=tree, dest=dest or {}, **case), box)  # type: ignore[arg-type]


def assert_clean(outcome: Outcome) -> None:
    assert outcome.status != "violation", f"{outcome.reason}: {outcome.detail}"


def corpus_tree(name: str) -> Tree:
    root = CORPUS / name
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def safetensors_file(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def parse_safetensors(data: bytes) -> None:
    from ckptfmt.safetensors_io import header_length, parse_header

    n = header_length(data[:8], len(data), "x.safetensors")
    parse_header(data[8 : 8 + n], len(data), "x.safetensors")


# ---------------------------------------------------------------- found by the harness


# Found as UnicodeEncodeError escaping ckptfmt/paths.py check_path (a JSON "\ud800" escape in a path); fixed by the
# parser engineer while this harness landed.
def test_manifest_path_with_lone_surrogate() -> None:
    data = (CORPUS / "manifest-surrogate.json").read_bytes()
    assert b"\\ud800" in data
    assert_clean(oracle(lambda: ckptfmt.parse_manifest(data)))


def test_cli_verify_manifest_path_with_lone_surrogate(box: Sandbox) -> None:
    tree = dict(seeds()["weights"])
    tree["manifest.json"] = (CORPUS / "manifest-surrogate.json").read_bytes()
    assert_clean(run_target("cli_verify", box, tree, args=("weights", "verify", "{root}")))


def _weights_manifest_with(edit: Callable[[dict[str, object]], object]) -> bytes:
    doc = json.loads(seeds()["weights"]["manifest.json"])  # type: ignore[arg-type]
    edit(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _set_context(value: object) -> Callable[[dict[str, object]], object]:
    return lambda doc: doc["fields"]["provenance"].__setitem__("context", value)  # type: ignore[index]


def _set_dtype(value: object) -> Callable[[dict[str, object]], object]:
    return lambda doc: doc["fields"]["weights"]["tensors"]["w"].__setitem__("dtype", value)  # type: ignore[index]


# Found as RecursionError and ValueError (json.loads) and TypeError (a list where a hashable path or dtype goes)
# escaping ckptfmt/manifest_parse.py parse_manifest and _parse_field; fixed by the parser engineer while this landed.
@pytest.mark.parametrize(
    "make",
    [
        lambda: _weights_manifest_with(_set_context([])),
        lambda: _weights_manifest_with(_set_context({"path": []})),
        lambda: _weights_manifest_with(_set_dtype([])),
        lambda: _weights_manifest_with(_set_dtype({"name": "F32"})),
        lambda: _weights_manifest_with(_set_context("X")).replace(b'"X"', b"[" * 5000 + b"]" * 5000),
        lambda: _weights_manifest_with(_set_context("X")).replace(b'"X"', b"9" * 5000),
    ],
    ids=["context-list", "context-path-list", "dtype-list", "dtype-object", "deep-nesting", "5000-digit-integer"],
)
def test_manifest_values_of_the_wrong_kind(make: Callable[[], bytes]) -> None:
    data = make()
    assert_clean(oracle(lambda: ckptfmt.parse_manifest(data)))


# Found as RecursionError, ValueError (integer digits) and TypeError (unhashable dtype) escaping
# ckptfmt/safetensors_io.py parse_header; fixed by the parser engineer while this harness landed.
@pytest.mark.parametrize(
    "header",
    [
        b"[" * 5000 + b"]" * 5000,
        b'{"w":{"dtype":"F32","shape":[' + b"1" * 5000 + b'],"data_offsets":[0,4]}}',
        b'{"w":{"dtype":[],"shape":[1],"data_offsets":[0,4]}}',
        b'{"w":{"dtype":{},"shape":[1],"data_offsets":[0,4]}}',
    ],
    ids=["deep-nesting", "5000-digit-integer", "list-dtype", "object-dtype"],
)
def test_safetensors_header_hostile_json(header: bytes) -> None:
    data = safetensors_file(header, b"\x00" * 4)
    assert_clean(oracle(lambda: parse_safetensors(data)))


def test_hf_import_of_deeply_nested_header(box: Sandbox) -> None:
    tree: Tree = {"model.safetensors": safetensors_file(b"[" * 5000 + b"]" * 5000)}
    assert_clean(run_target("import_hf", box, tree))


# Found by the fuzz harness: torch.load of a damaged archive raised IndexError, AttributeError, struct.error,
# OSError (EINVAL), KeyError, TypeError, AssertionError through ckptfmt/convert/torch_pt.py (now SourceFormatError).
@pytest.mark.parametrize(
    "name",
    [
        "pt-indexerror",
        "pt-attributeerror",
        "pt-structerror",
        "pt-oserror",
        "pt-keyerror",
        "pt-typeerror",
        "pt-assertionerror",
        "pt-stride-overflow",
    ],
)
def test_damaged_pt_archive(name: str, box: Sandbox) -> None:
    assert_clean(run_target("import_pt", box, corpus_tree(name)))


def test_cli_convert_damaged_pt_archive(box: Sandbox) -> None:
    case = ("pt", "convert", "{root}", "{dest}/out", "--to", "ckptfmt", "--from", "pt")
    assert_clean(run_target("cli_convert_from_pt", box, corpus_tree("pt-structerror"), args=case))


# Found by the fuzz harness: a damaged stored DCP item raised IndexError through ckptfmt/convert/dcp.py load_item.
def test_damaged_dcp_item(box: Sandbox) -> None:
    assert_clean(run_target("import_dcp", box, corpus_tree("dcp-indexerror")))


# ---------------------------------------------------------------- the holes issue 9 names


def test_writer_does_not_write_through_a_symlinked_destination_directory(box: Sandbox) -> None:
    outcome = run_target("reencode", box, seeds()["weights"], {"out/weights": Symlink("sentinel-dir")})
    assert_clean(outcome)
    assert outcome.status == "error"


def test_gc_leaves_a_users_directory_that_holds_a_writer_like_file(box: Sandbox) -> None:
    tree = seeds()["run"]
    assert "notes/weights/context.msgpack.bak" in tree
    assert_clean(run_target("gc", box, tree, protected=dict(PROTECTED)))
    assert_clean(run_target("cli_gc", box, tree, protected=dict(PROTECTED), args=("run", "gc", "{root}")))


def test_hf_import_does_not_follow_a_directory_symlink_named_by_weight_map(box: Sandbox) -> None:
    index = {"metadata": {}, "weight_map": {"w": "shards/model.safetensors"}}
    tree: Tree = {"model.safetensors.index.json": json.dumps(index).encode(), "shards": Symlink("sentinel-dir")}
    outcome = run_target("import_hf", box, tree)
    assert_clean(outcome)
    assert outcome.status == "error"


def _flip_last_data_byte(tree: Tree) -> Tree:
    out = dict(tree)
    path = "weights/r00000-00000.safetensors"
    data = out[path]
    assert isinstance(data, bytes)
    out[path] = data[:-1] + bytes([data[-1] ^ 0x01])
    return out


def test_diff_does_not_call_a_corrupt_checkpoint_identical(box: Sandbox) -> None:
    good = seeds()["weights"]
    bad = _flip_last_data_byte(good)
    tree: Tree = {f"a/{k}": v for k, v in good.items()} | {f"b/{k}": v for k, v in bad.items()}
    results: list[CliResult] = []

    def run() -> CliResult:
        result = TARGETS["cli_diff"].run(Case(tree=tree, args=("weights", "diff", "{root}/a", "{root}/b")), box)
        assert result is not None
        results.append(result)
        return result

    box.load(tree)
    outcome = oracle(run, sandbox=box)
    assert_clean(outcome)
    assert results[0].exit_code != 0, results[0].stdout


def test_dcp_metadata_cannot_set_attributes_on_an_admitted_class() -> None:
    from ckptfmt.convert.dcp_metadata import parse_metadata

    for payload in (_BUILD_ON_CLASS, _SETITEM_ON_ENUM):
        outcome = oracle(lambda p=payload: parse_metadata(p), check_tamper=True)  # type: ignore[misc]
        assert_clean(outcome)
        with pytest.raises(SourceFormatError):
            parse_metadata(payload)


def test_fifo_in_place_of_a_data_file_does_not_hang(box: Sandbox) -> None:
    for target in ("open_read", "verify"):
        tree = dict(seeds()["training"])
        tree["weights/r00000-00000.safetensors"] = Fifo()
        assert_clean(run_target(target, box, tree))
        tree = dict(seeds()["training"])
        tree["manifest.json"] = Fifo()
        assert_clean(run_target(target, box, tree))


# Found read whole before any size check (time and memory bounds exceeded); fixed while this harness landed.
def test_sparse_manifest_is_not_read_whole(box: Sandbox) -> None:
    box.load(seeds()["weights"])
    os.truncate(box.root / "manifest.json", 512 << 20)  # 512 MiB on paper (over MAX_MANIFEST_BYTES), nothing on disk

    def call() -> None:
        ckptfmt.open(str(box.root))

    outcome = oracle(call, sandbox=box)
    assert_clean(outcome)
    assert outcome.status == "error"


def _huge_empty_tensor(tmp: Path) -> Tree:
    """A weights checkpoint whose tensor "e" has shape [0, 9000000000000000000]: valid as written (no bytes), but
    numpy cannot even describe it. Written with [0, 1000000000000000000], then the digits swapped in place (same
    length, so every offset holds) and the data file's digest recomputed."""
    import numpy as np

    from ckptfmt.digests import digest_of

    url = str(tmp / "huge")
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "e", np.zeros((0, 10**18), dtype=np.float16))
        w.write_context("provenance", {"writer": {"name": "t", "version": "1"}, "created_at": "2026-01-01T00:00:00Z"})
    tree: Tree = {}
    for path in sorted(Path(url).rglob("*")):
        if path.is_file():
            tree[path.relative_to(url).as_posix()] = path.read_bytes()
    old, new = str(10**18).encode(), str(9 * 10**18).encode()
    data_path = next(p for p in tree if p.endswith(".safetensors"))
    data = tree[data_path]
    assert isinstance(data, bytes) and old in data
    new_data = data.replace(old, new)
    manifest = tree["manifest.json"]
    assert isinstance(manifest, bytes)
    algorithm = json.loads(manifest)["files"][0]["digest"].partition(":")[0]
    digests = {f["path"]: f["digest"] for f in json.loads(manifest)["files"]}
    manifest = manifest.replace(old, new).replace(digests[data_path].encode(), digest_of(algorithm, new_data).encode())
    tree[data_path] = new_data
    tree["manifest.json"] = manifest
    shutil.rmtree(url)
    return tree


@pytest.mark.parametrize("target", ["open_read", "verify", "cli_dump", "cli_diff", "cli_inspect"])
def test_empty_tensor_with_astronomical_dimension(target: str, box: Sandbox, tmp_path: Path) -> None:
    try:
        tree = _huge_empty_tensor(tmp_path)
    except CheckpointError as exc:  # the writer may refuse such a shape; then no reader ever meets one from us
        pytest.skip(f"writer refuses the shape: {exc}")
    args: tuple[str, ...] = ("weights",)
    if target == "cli_dump":
        args += ("dump", "--canonical", "{root}")
    elif target == "cli_inspect":
        args += ("inspect", "{root}", "--tensors", "--json")
    elif target == "cli_diff":
        tree = {f"a/{k}": v for k, v in tree.items()} | {f"b/{k}": v for k, v in tree.items()}
        args += ("diff", "{root}/a", "{root}/b")
    assert_clean(run_target(target, box, tree, args=args))


def test_restore_latest_over_a_weights_profile_checkpoint(box: Sandbox) -> None:
    tree = dict(seeds()["run"])
    tree |= {f"step-000000009/{k}": v for k, v in seeds()["weights"].items()}
    assert_clean(run_target("restore_latest", box, tree))


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_safetensors_header_with_nan_is_refused(constant: bytes) -> None:
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + constant + b"}}"
    with pytest.raises(SafetensorsHeaderError):
        parse_safetensors(safetensors_file(header, b"\x00" * 4))


@pytest.mark.parametrize(
    "name, document",
    [
        ("latest.json", b'{"name": ["step-000000001"], "step": 1}'),
        ("latest.json", b"[" * 5000 + b"]" * 5000),
        ("latest.json", b'{"name": "step-000000001", "step": ' + b"9" * 5000 + b"}"),
        ("pins.json", b'{"pinned": [["step-000000001"]]}'),
        ("pins.json", b'{"pinned": "step-000000001"}'),
        ("step-000000003/.writer-lock", b'{"host": "h", "pid": 99999999999999999999, "nonce": "n", "started_at": "x"}'),
        ("step-000000003/.writer-lock", b'{"host": [], "pid": -1, "nonce": 1, "started_at": null}'),
        ("step-000000003/.writer-lock", b"[" * 5000 + b"]" * 5000),
    ],
)
@pytest.mark.parametrize("target", ["run_directory", "cli_ls", "cli_gc_dry_run"])
def test_run_directory_files_of_the_wrong_json_type(target: str, name: str, document: bytes, box: Sandbox) -> None:
    tree = dict(seeds()["run"])
    tree[name] = document
    args = {"cli_ls": ("run", "ls", "{root}"), "cli_gc_dry_run": ("run", "gc", "{root}", "--dry-run")}.get(target, ())
    assert_clean(run_target(target, box, tree, args=args, protected=dict(PROTECTED)))


# ---------------------------------------------------------------- issue 23: the surfaces added since the harness


def _memory_tree(**replace: object) -> Tree:
    tree = dict(seeds()["memory"])
    tree.update(replace)  # type: ignore[arg-type]
    return {k: v for k, v in tree.items() if v is not None}


def test_find_slots_lists_no_run_directory_that_is_a_symlink(box: Sandbox) -> None:
    """The run's directory in the memory directory, a symlink to a directory elsewhere: find_slots (and so
    ``ckpt rescue``) listed it and read the slots there (os.listdir outside the root); refused now, as a writer
    refuses it (UnsafePathError)."""
    tree: Tree = {"run-KEY": Symlink("sentinel-dir")}
    assert_clean(run_target("memory_slots", box, tree, args=("memory",)))
    assert_clean(run_target("cli_rescue", box, tree, args=("memory", "rescue", "{root}", "{dest}/run", "--json")))


def test_rescue_never_persists_through_a_symlinked_checkpoint_directory(box: Sandbox) -> None:
    """``run/step-000000006`` planted as a symlink to a directory elsewhere: persist opened it and wrote there
    (the lock, the files); the slot is now reported and nothing is written outside."""
    dest: Tree = {"run/step-000000006": Symlink("sentinel-dir")}
    assert_clean(run_target("memory_rescue", box, _memory_tree(), dest, args=("memory",)))
    assert not (box.work / "sentinel" / "dir" / "manifest.json").read_bytes().startswith(b'{"fields"')


def test_a_training_args_pickle_of_a_million_opcodes_is_refused_quickly(box: Sandbox) -> None:
    """400,000 opcodes nesting lists: decoded and walked (about 10 us an opcode) for over 5 s under the
    oracle before a refusal, up to 1,000,000 allowed; now at most 100,000 (a TrainingArguments has under 2,000)."""
    from hostile.seeds import training_args_pickle, training_args_zip

    pickled = training_args_pickle()
    n = 200_000
    pickled = pickled[:-3] + b"X\x01\x00\x00\x00a" + b"]" * n + b"a" * (n - 1) + pickled[-3:]
    outcome = run_target("training_args", box, {"training_args.bin": training_args_zip(pickled)}, args=("x",))
    assert_clean(outcome)
    assert outcome.status == "error"


def test_a_zstd_tensor_claiming_far_more_raw_bytes_than_stored_is_refused_unallocated(box: Sandbox) -> None:
    """A zstd tensor whose shape and frame_bytes are scaled by 2**36 (the frame count still agrees): read_slice
    allocates the 384 TiB region (MemoryError under the harness's address-space cap) before the frame index is
    checked. A zstd block decodes to at most 128 KiB from 4 stored bytes, so no chunk can hold more than
    32768 times its stored bytes; a reader can refuse that, and check data files, before allocating."""
    tree = dict(seeds()["zstd"])
    doc = json.loads(tree["manifest.json"])  # type: ignore[arg-type]
    record = doc["fields"]["weights"]["tensors"]["a"]
    record["shape"][0] <<= 36
    record["chunks"][0]["shape"][0] <<= 36
    record["chunks"][0]["codec"]["configuration"]["frame_bytes"] <<= 36
    tree["manifest.json"] = json.dumps(doc).encode()
    assert_clean(run_target("zstd_read", box, tree, args=("zstd", "1")))
    assert_clean(run_target("zstd_verify", box, tree, args=("zstd", "1")))  # verify's one-frame scratch, likewise
