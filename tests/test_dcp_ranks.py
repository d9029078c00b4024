"""DCP through ckptfmt's storage layer on gloo ranks (tests/dcp_worker.py): an FSDP2 model and AdamW saved on 2
ranks load on 1 and 3 ranks to the state they had, the same as DCP's own FileSystemWriter and FileSystemReader give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from process_ranks import launch

from ckptfmt import open_checkpoint

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("dcp_worker.py")


def test_fsdp2_state_saved_on_two_ranks_loads_on_one_and_three_as_through_the_file_system_writer(
    tmp_path: Path,
) -> None:
    launch(WORKER, ["save", str(tmp_path)], 2, timeout=240)
    saved = json.loads((tmp_path / "saved.json").read_text())["saved"]
    for world in (1, 3):
        launch(WORKER, ["load", str(tmp_path)], world, timeout=240)
        loaded = json.loads((tmp_path / f"loaded-{world}.json").read_text())
        assert loaded == {"ours": saved, "theirs": saved}, world


@pytest.mark.parametrize("mode", ["async", "async-process"])
def test_an_async_save_through_ckptfmt_loads_to_the_state_it_had(tmp_path: Path, mode: str) -> None:
    launch(WORKER, [mode, str(tmp_path)], 2, timeout=240)
    saved = json.loads((tmp_path / "saved.json").read_text())["saved"]
    launch(WORKER, ["load", str(tmp_path)], 2, timeout=240)
    assert json.loads((tmp_path / "loaded-2.json").read_text()) == {"ours": saved}


def test_a_rank_killed_mid_save_fails_the_others_and_commits_nothing(tmp_path: Path) -> None:
    done = launch(WORKER, ["die", str(tmp_path)], 2, timeout=240, check=False)
    assert [r.returncode for r in done] == [0, -9], [r.stdout[-2000:] for r in done]
    error = json.loads((tmp_path / "die.json").read_text())["error"]
    # it learned that rank 1 is gone, and did not hang: our commit's CollectiveError, or gloo's error from DCP's own
    # gather ("Connection closed by peer" or "Read error ...: Connection reset by peer", as the timing falls)
    assert error and ("CollectiveError" in error[0] or "by peer" in error[0])
    assert not (tmp_path / "dying" / "manifest.json").exists()  # nothing committed, nothing that looks usable


def test_a_rank_failing_mid_save_deletes_every_file_names_the_error_and_gives_the_lock_back(tmp_path: Path) -> None:
    launch(WORKER, ["fail", str(tmp_path)], 2, timeout=240)
    outcomes = [json.loads((tmp_path / f"fail-{rank}.json").read_text()) for rank in (0, 1)]
    # rank 1's own error, on rank 1; on the coordinator, whose finish refused the commit, the same error
    assert any("No space left on device" in e for e in outcomes[1]["errors"]), outcomes
    assert any("No space left on device" in e for e in outcomes[0]["errors"]), outcomes
    assert outcomes[0]["left"] == [] and outcomes[1]["left"] == []  # no manifest, no data file, no lock
    with open_checkpoint(str(tmp_path / "failing")) as ckpt:  # the next save, into the same place, committed
        ckpt.verify()
