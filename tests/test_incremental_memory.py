"""Incremental durable saves from memory (``memory_every=`` with ``incremental=True``): a persist re-writes the
snapshot and references the chunks of the previous durable save that are unchanged, as a direct incremental save
does (spec/memory.md MEM-7, spec/references.md); every ``full_every``-th durable save is self-contained."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rank_threads import run_ranks
from torch import nn

import ckptfmt
import ckptfmt.torch.memory as memory_module
from ckptfmt.chain import SINCE_FULL
from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import UsageError
from ckptfmt.run import RunDirectory, checkpoint_name
from ckptfmt.torch import CheckpointManager, ResumableSampler
from ckptfmt.torch.memory_engine import MemoryEngine
from ckptfmt.torch.options import DurableOptions, MemoryOptions, RetentionOptions
from ckptfmt.torch.training_state import Lineage, TrainingState

ROWS, COLS = 512, 256  # the frozen table: 512 KiB of float32, the bulk of every checkpoint


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(ROWS, COLS), requires_grad=False)  # never changes
        self.head = nn.Linear(COLS, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x @ self.table)
        return out


def build() -> TrainingState:
    torch.manual_seed(5)
    model = Model()
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.01)
    return TrainingState(model=model, optimizer=optimizer, config={"lr": 0.01}, sampler=ResumableSampler(64, seed=1))


def step_once(state: TrainingState, step: int) -> None:
    model, optimizer = state.model, state.optimizer
    assert isinstance(model, Model) and optimizer is not None and isinstance(state.sampler, ResumableSampler)
    state.sampler.advance(4)
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, ROWS, generator=g), torch.randn(4, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(run_dir: Path, shm: Path, steps: int, **options: Any) -> dict[int, dict[str, torch.Tensor]]:
    """``steps`` steps, a snapshot and a durable save after each (waited for, so none is coalesced away); the
    model's weights at each step."""
    state = build()
    seen: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(
        run_dir, memory_every=1, memory_dir=shm, keep_last=None, preemption_signals=(), **options
    ) as mgr:
        for step in range(1, steps + 1):
            step_once(state, step)
            mgr.checkpoint_if_due(step, state, every=1)
            mgr.wait()
            seen[step] = weights(state.model)
    return seen


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def stored_bytes(path: Path) -> int:
    """The bytes a checkpoint stores itself (not what it references)."""
    with ckptfmt.open(path) as ckpt:
        return sum(f.size for f in ckpt.manifest.files)


def check_checkpoint(path: Path, expected: dict[str, torch.Tensor]) -> ckptfmt.Checkpoint:
    ckpt = ckptfmt.open(path)
    assert ckpt.verify().ok
    for name, value in expected.items():
        assert np.array_equal(ckpt.read_tensor("weights", name), value.numpy()), (path, name)
    return ckpt


@pytest.mark.parametrize("frozen", [(), ("table",)], ids=["hashed", "frozen"])
def test_persists_from_memory_reference_the_previous_durable_save(tmp_path: Path, frozen: tuple[str, ...]) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    seen = train(run_dir, shm, 6, incremental=True, full_every=3, frozen=frozen)
    table_bytes = ROWS * COLS * 4
    for step in range(1, 7):
        with check_checkpoint(run_dir / checkpoint_name(step), seen[step]) as ckpt:
            bases = {b.name for b in ckpt.manifest.bases}
            table = ckpt.manifest.fields["weights"].tensors["table"].chunks
            if step in (1, 4):  # full_every=3: every third durable save is self-contained
                assert not bases and all(c.base is None for c in table), step
                assert stored_bytes(run_dir / checkpoint_name(step)) > table_bytes
                continue
            # the unchanged table is referenced where it is stored (never through a reference, REF-9)
            stored_in = checkpoint_name(1 if step < 4 else 4)
            assert bases == {stored_in} and all(c.base is not None for c in table), (step, bases)
            assert stored_bytes(run_dir / checkpoint_name(step)) < table_bytes / 4
            assert ckpt.manifest.metadata[SINCE_FULL] == str(step - (1 if step < 4 else 4))
            origin = ckpt.read_context("provenance")["converted_from"]
            assert isinstance(origin, dict) and str(origin["checkpoint_id"]).startswith("sha256:")
            assert ckpt.id != origin["checkpoint_id"]  # a re-written checkpoint has an id of its own (MEM-7)

    # the run directory grows by far less than with copies of every snapshot
    full_dir = tmp_path / "full"
    assert train(full_dir, tmp_path / "shm-full", 6)[6].keys() == seen[6].keys()
    assert disk_bytes(run_dir) < disk_bytes(full_dir) - 3 * table_bytes

    # a restore from the run directory (the latest, step 6, references step 4) is bit-identical
    state = build()
    with CheckpointManager(run_dir, incremental=True, full_every=3, preemption_signals=()) as mgr:
        assert mgr.restore_latest(state) == 6
        assert mgr.last_restore is not None and mgr.last_restore.tier == "durable"
    for name, value in weights(state.model).items():
        assert torch.equal(value, seen[6][name]), name


def test_a_restore_from_memory_then_a_persist_references_the_durable_save(tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    options: dict[str, Any] = {"memory_every": 1, "memory_dir": shm, "keep_last": None, "incremental": True}
    state = build()
    seen: dict[int, dict[str, torch.Tensor]] = {}
    mgr = CheckpointManager(run_dir, preemption_signals=(), **options)
    for step in range(1, 6):  # durable saves at 2 and 4; step 5 in memory only, then the process "dies"
        step_once(state, step)
        mgr.checkpoint_if_due(step, state, every=2)
        mgr.wait()
        seen[step] = weights(state.model)
    mgr.close(persist=False)
    assert sorted(e.step or 0 for e in RunDirectory(run_dir).entries()) == [2, 4]

    state = build()
    with CheckpointManager(run_dir, preemption_signals=(), **options) as mgr:
        assert mgr.restore_latest(state) == 5
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        mgr.wait()  # the restored snapshot, which the run directory lacks, is persisted
        step_once(state, 6)
        mgr.checkpoint_if_due(6, state, every=2)
        mgr.wait()
        seen[6] = weights(state.model)
    for step, base in ((4, "step-000000002"), (5, "step-000000002"), (6, "step-000000002")):
        with check_checkpoint(run_dir / checkpoint_name(step), seen[step]) as ckpt:
            assert {b.name for b in ckpt.manifest.bases} == {base}, step


def test_an_incremental_persist_with_a_codec_references_unchanged_encoded_chunks(tmp_path: Path) -> None:
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    seen = train(run_dir, shm, 3, incremental=True, codec="zstd")
    for step in (1, 2, 3):
        with check_checkpoint(run_dir / checkpoint_name(step), seen[step]) as ckpt:
            table = ckpt.manifest.fields["weights"].tensors["table"].chunks
            assert all(c.codec.name == "zstd" for c in table)
            # step 1 is re-encoded in full; then the encoded table is referenced after one hash of its raw bytes
            assert all((c.base is None) == (step == 1) for c in table), step


def test_async_save_with_the_memory_tier_is_still_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="async_save=True"):
        CheckpointManager(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", async_save=True)


def test_incremental_on_several_nodes_is_refused_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a snapshot spread over several nodes is persisted by every rank at once, as a copy: refused, by name
    rank_of = threading.local()
    monkeypatch.setattr(memory_module, "node_key", lambda: f"node-{rank_of.rank}")
    run = RunDirectory(tmp_path / "run")

    def engine(rank: int, collective: ThreadCollective) -> MemoryEngine:
        rank_of.rank = rank
        return MemoryEngine(
            run,
            options=MemoryOptions(every=1, memory_dir=tmp_path / f"shm-{rank}"),
            durable=DurableOptions(incremental=True),
            lineage=Lineage.start(data_policy="strict", loader=None),
            retention=RetentionOptions(),
            collective=collective,
            process_group=None,
        )

    results = run_ranks(2, engine, 20.0, join_timeout=120.0)
    for result in results:
        assert isinstance(result, UsageError) and "several nodes" in str(result), results
        assert "incremental=True" in str(result) and "memory_every=" in str(result)
