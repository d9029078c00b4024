"""Many ranks over torch.distributed (gloo; processes forked warm, tests/warm_ranks.py): FSDP2 saves on 4 ranks,
loads on 1, 2, 3 and on a 2-D (FSDP x tensor-parallel) mesh, bit for bit; a rank killed mid-save fails the others
cleanly.

The processes are few and share one checkpoint: together they are the costliest tests of the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from concurrent_runs import Jobs
from safetensors.numpy import load_file
from warm_ranks import WarmProcess

import ckptfmt
import ckptfmt.torch as ct

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

WORKER = Path(__file__).with_name("dist_worker.py")


def launch(scenario: str, world: int, out: Path, timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(WarmProcess(WORKER, [scenario, str(out)], env=env))  # forked warm: see warm_ranks.py
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{scenario} on {world} ranks hung")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def ok(results: list[subprocess.CompletedProcess[str]]) -> None:
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-4000:]}"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Every launch of this module, two at a time (concurrent_runs.py): the save on 4 ranks, then the loads from
    it (each writes files of its own), and the killed save, which needs nothing."""
    out, die = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("die")
    jobs = Jobs(workers=2)
    jobs.add("save", lambda: (launch("save", 4, out), out))
    jobs.add("die", lambda: (launch("die", 3, die, timeout=240), die))
    for scenario, world in (("tp", 4), ("load", 3), ("load", 2), ("incremental", 4)):
        jobs.add(f"{scenario}-{world}", lambda _, s=scenario, w=world: launch(s, w, out), "save")
    return jobs.run()


@pytest.fixture(scope="module")
def saved(launches: Jobs) -> Path:
    results, out = launches["save"]
    ok(results)
    return out


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs"


def test_four_ranks_write_their_own_shards_into_one_checkpoint(saved: Path) -> None:
    ckpt = ckptfmt.open(saved / "ckpt")
    assert ckpt.verify().ok
    writers = {f.path.split("/")[-1][:6] for f in ckpt.manifest.files if f.path.endswith(".safetensors")}
    assert writers == {"r00000", "r00001", "r00002", "r00003"}  # the writing is spread, not all on rank 0
    weight = ckpt.tensor("weights", "0.weight")
    assert [c.shape[0] for c in weight.chunks] == [3, 3, 3, 1]  # FSDP2's uneven dim-0 shards of 10 rows
    assert "0.weight/exp_avg" in ckpt.field("optimizer").tensors  # optimizer state keyed by parameter name
    rng = ckpt.read_context("rng")
    assert len(rng["ranks"]) == 4  # type: ignore[arg-type]
    topology = ckpt.read_context("topology")
    assert topology["world_size"] == 4
    placed = topology["tensors"]["weights/0.weight"]  # type: ignore[index]
    assert placed["placements"] == ["Shard(0)"] and placed["mesh"]["shape"] == [4]  # the saving layout
    reference = load_file(str(saved / "reference-weights.safetensors"))
    same({n: ckpt.read_tensor("weights", n) for n in ckpt.tensor_names("weights")}, reference)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_state_saved_on_four_ranks_loads_bit_for_bit_on_fewer(saved: Path, launches: Jobs, world: int) -> None:
    ok(launches[f"load-{world}"])
    for part in ("weights", "optim"):
        same(
            load_file(str(saved / f"loaded-load-{world}-{part}.safetensors")),
            load_file(str(saved / f"reference-{part}.safetensors")),
        )


def test_fsdp_state_loads_onto_a_2d_fsdp_tensor_parallel_mesh(saved: Path, launches: Jobs) -> None:
    ok(launches["tp-4"])
    for part in ("weights", "optim"):
        same(
            load_file(str(saved / f"loaded-tp-4-{part}.safetensors")),
            load_file(str(saved / f"reference-{part}.safetensors")),
        )


def test_four_ranks_load_into_one_process_without_torch_distributed(saved: Path) -> None:
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ct.ResumableSampler(64, seed=7)
    ct.load(
        saved / "ckpt", model=model, optimizer=optimizer, config={"model": "mlp", "layers": [6, 10, 3]}, sampler=sampler
    )
    reference = load_file(str(saved / "reference-weights.safetensors"))
    same({k: v.numpy() for k, v in model.state_dict().items()}, reference)
    optim = load_file(str(saved / "reference-optim.safetensors"))
    for fqn, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert optimizer.state[param][key].numpy().tobytes() == optim[f"{fqn}/{key}"].tobytes()


def test_a_rank_killed_mid_save_fails_the_others_and_commits_nothing(launches: Jobs) -> None:
    results, tmp_path = launches["die"]
    assert results[1].returncode == -9
    for rank in (0, 2):
        assert results[rank].returncode == 0, results[rank].stderr[-3000:]
        text = (tmp_path / f"errors-{rank}.txt").read_text()
        assert text.startswith("CollectiveError"), text
    assert not (tmp_path / "ckpt-die" / "manifest.json").exists()
    with pytest.raises(ckptfmt.IncompleteCheckpointError):
        ckptfmt.open(tmp_path / "ckpt-die")


def test_each_rank_references_its_unchanged_shards_in_the_base(saved: Path, launches: Jobs) -> None:
    ok(launches["incremental-4"])
    with ckptfmt.open(saved / "ckpt-inc") as ckpt:
        assert ckpt.verify().ok
        assert [b.location for b in ckpt.manifest.bases] == ["../ckpt"]
        weights = ckpt.fields["weights"].tensors
        frozen = weights["0.weight"].chunks
        assert len(frozen) == 4 and all(c.base == "../ckpt" for c in frozen)  # every rank's shard, referenced
        written = [c for c in weights["2.weight"].chunks if c.nbytes]  # (3 rows on 4 ranks: one shard is empty)
        assert written and all(c.base is None for c in written)  # trained: written
        moments = ckpt.fields["optimizer"].tensors["0.weight/exp_avg"].chunks
        assert all(c.base == "../ckpt" for c in moments)
        expected = load_file(str(saved / "incremental-weights.safetensors"))
        for name, array in expected.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)
