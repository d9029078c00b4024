"""Incremental checkpoints in a run directory (spec/references.md REF-13, REF-14): retention and gc keep every
base that a kept checkpoint or a live writer references, deletion and replacement of a referenced checkpoint are
refused, ``ckpt ls`` shows own and referenced bytes, and ``materialize`` (and ``convert --to ckptfmt``) make a
self-contained copy that outlives its base. Ends with a state machine: random saves (full and incremental) and
random retention, after which every checkpoint left opens, verifies and reads back what was saved."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, run_cli
from run_helpers import lock_of

import ckptfmt
from ckptfmt.errors import CheckpointError, DigestMismatchError, UsageError
from ckptfmt.materialize import materialize, materialize_checkpoint
from ckptfmt.run import Entry, RunDirectory, checkpoint_name
from ckptfmt.storage import open_store
from ckptfmt.writer import CheckpointWriter

Tensors = dict[str, np.ndarray]


def tensors(seed: int, names: tuple[str, ...] = ("a", "b", "c")) -> Tensors:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((8, 4)).astype(np.float32) for n in names}


def save(run: str, step: int, values: Tensors, base: str | None = None, frozen: tuple[str, ...] = ()) -> str:
    """A committed weights checkpoint ``step-<step>`` of ``run``, referencing ``base`` (a name) when given."""
    name = checkpoint_name(step)
    base_url = None if base is None else f"{run}/{base}"
    with CheckpointWriter(open_store(f"{run}/{name}"), profile="weights", base=base_url, frozen=frozen) as w:
        w.write_tensors("weights", values)
        w.write_context("provenance", {"step": step})
    return name


def assert_reads(url: str, values: Tensors) -> None:
    with ckptfmt.open(url) as ckpt:
        report = ckpt.verify()
        assert report.ok, report.problems
        assert sorted(ckpt.tensor_names("weights")) == sorted(values)
        for n, array in values.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", n), array)


def write_lock(run: Path, name: str, lock: dict[str, object] | str) -> None:
    """The remains of a save at work: a data file and its writer lock (a dict, or raw text)."""
    (run / name / "weights").mkdir(parents=True)
    (run / name / "weights" / "r00000-00000.safetensors").write_bytes(b"x" * 10)
    (run / name / ".writer-lock").write_text(lock if isinstance(lock, str) else json.dumps(lock))


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, dict[str, Tensors]]:
    """step-1 full; step-2 on step-1 (b changed); step-3 on step-2 (c changed): both reference step-1's a."""
    run = tmp_path / "run"
    v1 = tensors(1)
    v2 = {**v1, "b": tensors(2)["b"]}
    v3 = {**v2, "c": tensors(3)["c"]}
    save(str(run), 1, v1)
    save(str(run), 2, v2, base="step-000000001")
    save(str(run), 3, v3, base="step-000000002", frozen=("a",))
    return run, {"step-000000001": v1, "step-000000002": v2, "step-000000003": v3}


# ---------------------------------------------------------------- retention and gc


def test_entries_bases_and_bytes(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, _ = chain
    entries = {e.name: e for e in RunDirectory(run).entries()}
    assert entries["step-000000001"].bases == () and entries["step-000000001"].referenced_bytes == 0
    # references name the checkpoint storing the bytes (REF-8): step-3 references b in step-2, a in step-1
    assert entries["step-000000002"].bases == ("step-000000001",)
    assert entries["step-000000003"].bases == ("step-000000001", "step-000000002")
    assert entries["step-000000003"].referenced_bytes == 2 * 8 * 4 * 4
    assert entries["step-000000003"].to_dict()["bases"] == ["step-000000001", "step-000000002"]


def test_gc_keeps_the_bases_of_what_it_keeps(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, _ = chain
    rd = RunDirectory(run)
    plan = rd.plan_retention(keep_last=1)
    assert plan.doomed == ()
    # step-2 is kept for step-3, and then step-1 for both
    assert plan.referenced == {
        "step-000000001": ("step-000000002", "step-000000003"),
        "step-000000002": ("step-000000003",),
    }
    save(str(run), 4, tensors(4))  # a full one: nothing needs the chain any more
    assert [e.name for e in rd.gc(keep_last=1)] == ["step-000000003", "step-000000002", "step-000000001"]
    assert [e.name for e in rd.entries()] == ["step-000000004"]


def test_gc_keeps_a_base_whose_referrer_is_pinned(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, saved = chain
    save(str(run), 4, tensors(4))
    rd = RunDirectory(run)
    rd.set_pinned(["step-000000002"])
    deleted = rd.gc(keep_last=1)
    assert [e.name for e in deleted] == ["step-000000003"]
    assert_reads(rd.child_url("step-000000002"), saved["step-000000002"])


def test_closure_over_a_chain() -> None:
    """References are one level deep (REF-8), but a hand-made chain is kept whole all the same."""

    def entry(name: str, step: int, *bases: str) -> Entry:
        return Entry(name=name, step=step, status="committed", size=1, files=1, bases=bases)

    entries = [entry("d", 4), entry("c", 3, "b"), entry("b", 2, "a"), entry("a", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDirectory(tmp)
        plan = rd.plan_retention(keep_last=2, entries=entries)  # keeps d and c; c needs b, b needs a
        assert plan.doomed == ()
        assert plan.referenced == {"b": ("c",), "a": ("b",)}
        assert [e.name for e in rd.plan_gc(keep_last=1, entries=entries)] == ["c", "b", "a"]


def test_a_live_writers_bases_are_kept(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, _ = chain
    save(str(run), 4, tensors(4))
    # a save at work (this process: alive) that references step-2 (REF-13: named in its lock)
    write_lock(run, "step-000000005", {**lock_of(os.getpid()), "bases": ["step-000000002"]})
    rd = RunDirectory(run)
    writing = {e.name: e for e in rd.entries()}["step-000000005"]
    assert writing.status == "writing" and writing.bases == ("step-000000002",)
    plan = rd.plan_retention(keep_last=1)
    assert [e.name for e in plan.doomed] == ["step-000000003"]
    assert plan.referenced == {"step-000000002": ("step-000000005",), "step-000000001": ("step-000000002",)}
    with pytest.raises(UsageError, match="live writer"):
        rd.delete("step-000000002")


def test_an_unreadable_live_lock_suspends_retention(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, _ = chain
    save(str(run), 4, tensors(4))
    write_lock(run, "step-000000005", "{not a lock")  # counts as live; what it references is unknown
    rd = RunDirectory(run)
    plan = rd.plan_retention(keep_last=1)
    assert plan.doomed == () and plan.hold is not None and "step-000000005" in plan.hold


def test_gc_rechecks_references_before_deleting(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(str(run), 1, tensors(1))
    save(str(run), 2, tensors(2))
    rd = RunDirectory(run)
    plan = rd.plan_retention(keep_last=1)
    assert [e.name for e in plan.doomed] == ["step-000000001"]
    save(str(run), 3, tensors(1), base="step-000000001")  # committed after the plan, referencing its doomed
    assert rd.collect(plan) == []
    assert_reads(rd.child_url("step-000000003"), tensors(1))


# ---------------------------------------------------------------- delete, referrers, replace


def test_referrers_delete_and_replace(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, _ = chain
    rd = RunDirectory(run)
    assert rd.referrers("step-000000001") == ["step-000000002", "step-000000003"]
    assert rd.referrers("step-000000002") == ["step-000000003"]
    assert rd.referrers("step-000000003") == []
    with pytest.raises(UsageError, match="step-000000002 \\(committed\\), step-000000003") as refused:
        rd.delete("step-000000001")
    assert refused.value.requirement == "REF-13"
    with pytest.raises(UsageError, match="cannot replace") as refused:
        rd.check_replaceable("step-000000002")
    assert refused.value.requirement == "REF-14"
    rd.check_replaceable("step-000000003")  # nothing references it
    rd.check_replaceable("step-000000009")  # nothing there
    rd.delete("step-000000003")  # referencing, not referenced: fine
    rd.delete("step-000000002")
    assert rd.referrers("step-000000001") == []
    rd.delete("step-000000001")
    assert rd.entries() == []


def test_forced_delete_breaks_the_referrer_detectably(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, saved = chain
    rd = RunDirectory(run)
    rd.delete("step-000000001", force=True)
    with ckptfmt.open(rd.child_url("step-000000002")) as ckpt:
        assert not ckpt.verify().ok
        np.testing.assert_array_equal(ckpt.read_tensor("weights", "b"), saved["step-000000002"]["b"])  # its own


# ---------------------------------------------------------------- the CLI


def test_ls_and_gc_cli(chain: tuple[Path, dict[str, Tensors]]) -> None:
    run, saved = chain
    listed = run_cli("ls", str(run), "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = {e["name"]: e for e in listed.json()["checkpoints"]}
    assert rows["step-000000003"]["bases"] == ["step-000000001", "step-000000002"]
    assert rows["step-000000003"]["referenced_bytes"] == 256
    assert rows["step-000000001"]["referenced_bytes"] == 0 and rows["step-000000001"]["size"] > 256
    table = run_cli("ls", str(run)).stdout.splitlines()
    assert table[0].split() == ["NAME", "STEP", "CREATED", "SIZE", "REFERENCED", "STATUS", "BASES"]
    assert table[1].split()[-1] == "step-000000001,step-000000002"

    v4 = {**saved["step-000000003"], "c": tensors(4)["c"]}
    save(str(run), 4, v4, base="step-000000003")  # references b of step-2 and a of step-1
    gc = run_cli("gc", str(run), "--keep-last", "1", "--json")
    assert gc.exit_code == 0, gc.stderr
    doc = gc.json()
    assert [d["name"] for d in doc["deleted"]] == ["step-000000003"]
    assert doc["kept_referenced"] == [
        {"name": "step-000000001", "referenced_by": ["step-000000002", "step-000000004"]},
        {"name": "step-000000002", "referenced_by": ["step-000000004"]},
    ]
    dry = run_cli("gc", str(run), "--keep-last", "1", "--dry-run")
    assert "kept step-000000002 (referenced by step-000000004)" in dry.stdout


# ---------------------------------------------------------------- materialize


def test_materialize_round_trip(store_url: str) -> None:
    run = store_url.rstrip("/")
    v1 = tensors(1)
    v2 = {**v1, "b": tensors(2)["b"]}
    save(run, 1, v1)
    save(run, 2, v2, base="step-000000001")
    copy = f"{run}/step-000000002-full"
    done = materialize_checkpoint(f"{run}/step-000000002", copy)
    assert done.copied_from_bases == {
        "../step-000000001/weights/r00000-00000.safetensors": "weights/r00000-00001.safetensors"
    }
    with ckptfmt.open(copy) as ckpt:
        assert ckpt.id == done.checkpoint_id and ckpt.manifest.bases == ()
        assert not any(c.base for t in ckpt.manifest.fields["weights"].tensors.values() for c in t.chunks)
    assert b"ckptfmt.references" not in open_store(copy).read("manifest.json")
    rd = RunDirectory(run)
    rd.delete("step-000000002")
    rd.delete("step-000000001")
    assert_reads(copy, v2)  # outlives its base


def test_materialize_refusals_and_corruption(chain: tuple[Path, dict[str, Tensors]], tmp_path: Path) -> None:
    run, saved = chain
    src = str(run / "step-000000003")
    with pytest.raises(UsageError):
        materialize(src, src)
    with pytest.raises(UsageError, match="cannot replace"):  # step-2 is step-3's base (REF-14)
        materialize(src, str(run / "step-000000002"), overwrite=True)
    with pytest.raises(CheckpointError):
        materialize(src, str(run / "step-000000002"))  # exists
    assert_reads(str(run / "step-000000002"), saved["step-000000002"])
    base_file = run / "step-000000001" / "weights" / "r00000-00000.safetensors"
    data = bytearray(base_file.read_bytes())
    data[-1] ^= 1  # inside step-3's referenced tensor a
    base_file.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError):
        materialize(src, str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists() or not any((tmp_path / "copy").rglob("*.safetensors"))


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_materialize_and_convert_cli(chain: tuple[Path, dict[str, Tensors]], tmp_path: Path, runner: str) -> None:
    run, saved = chain
    result = RUNNERS[runner]("materialize", str(run / "step-000000003"), str(tmp_path / "m"), "--json")
    assert result.exit_code == 0, result.stderr
    assert len(result.json()["copied_from_bases"]) == 2
    again = RUNNERS[runner]("materialize", str(run / "step-000000003"), str(tmp_path / "m"))
    assert again.exit_code == 2 and "[exists]" in again.stderr
    # convert to ckptfmt re-encodes through the reader, which follows references: self-contained too
    converted = run_cli("convert", str(run / "step-000000003"), str(tmp_path / "c"), "--to", "ckptfmt")
    assert converted.exit_code == 0, converted.stderr
    shutil.rmtree(run)
    assert_reads(str(tmp_path / "m"), saved["step-000000003"])
    assert_reads(str(tmp_path / "c"), saved["step-000000003"])


# ---------------------------------------------------------------- state machine


class RetentionMachine(RuleBasedStateMachine):
    """Saves (full, or incremental on the newest kept) and retention in random order; whatever retention
    leaves opens, verifies, and reads back what was saved under its name."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="ckptfmt-refs-")
        self.run = f"{self.root}/run"
        self.step = 0
        self.saved: dict[str, Tensors] = {}

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def newest(self) -> str:
        return max(self.saved)

    def save(self, changed: set[str] | None, seed: int, declare_frozen: bool = False) -> None:
        """A full save (``changed`` None, or nothing left to base one on), else one on the newest checkpoint
        with the tensors in ``changed`` given new values (the others referenced in its base)."""
        fresh = tensors(seed)
        base = self.newest() if self.saved and changed is not None else None
        if base is None:
            values, frozen = fresh, ()
        else:
            assert changed is not None
            values = {n: fresh[n] if n in changed else a for n, a in self.saved[base].items()}
            frozen = tuple(sorted(set(values) - changed)) if declare_frozen else ()
        self.step += 1
        self.saved[save(self.run, self.step, values, base=base, frozen=frozen)] = values

    @initialize(seed=st.integers(0, 2**16))
    def first(self, seed: int) -> None:
        self.save(None, seed)

    # two incremental saves for one full one: chains of references long enough for retention to cut them
    @rule(
        changed=st.none() | st.sets(st.sampled_from("abc"), max_size=2) | st.sets(st.sampled_from("abc"), max_size=2),
        seed=st.integers(0, 2**16),
        declare_frozen=st.booleans(),
    )
    def save_one(self, changed: set[str] | None, seed: int, declare_frozen: bool) -> None:
        self.save(changed, seed, declare_frozen)

    @precondition(lambda self: self.saved)
    @rule(
        keep_last=st.integers(1, 4),
        keep_every=st.none() | st.integers(2, 5),
        pins=st.sets(st.integers(1, 12), max_size=2),
    )
    def gc(self, keep_last: int, keep_every: int | None, pins: set[int]) -> None:
        rd = RunDirectory(self.run)
        rd.set_pinned(checkpoint_name(p) for p in pins)
        for entry in rd.gc(keep_last=keep_last, keep_every=keep_every):
            del self.saved[entry.name]

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def delete_one(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.saved)))
        rd = RunDirectory(self.run)
        if rd.referrers(name):
            with pytest.raises(UsageError):
                rd.delete(name)
        else:
            rd.delete(name)
            del self.saved[name]

    @invariant()
    def every_checkpoint_left_reads_back(self) -> None:
        if not self.saved:
            return
        committed = [e.name for e in RunDirectory(self.run).entries() if e.status == "committed"]
        assert sorted(committed) == sorted(self.saved)
        for name, values in self.saved.items():
            assert_reads(f"{self.run}/{name}", values)


RetentionMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRetention = RetentionMachine.TestCase
