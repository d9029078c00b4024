"""CkptfmtCallback end to end on CPU: train a tiny Trainer, SIGKILL it in a process of its own, resume from the
ckptfmt copy alone, and end bit-identical to the uninterrupted run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfmt

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may reach the Hub
import transformers  # the integrations extra, which .[dev] installs

from ckptfmt.integrations.hf import CkptfmtCallback, prepare_resume

STEPS = 6


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Killed(Exception):
    pass


class KillAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Dies at the start of a step (after the last save, before the next): SIGKILL, or an exception."""

    def __init__(self, step: int, *, hard: bool = False) -> None:
        self.step = step
        self.hard = hard

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            if self.hard:
                os.kill(os.getpid(), signal.SIGKILL)
            raise Killed(f"killed at step {self.step}")


# the killed run, in a process of its own: this module loaded by path, a Trainer SIGKILLed at step 4
KILLED_RUN = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("hf_case", sys.argv[1])
case = importlib.util.module_from_spec(spec)
spec.loader.exec_module(case)
case.trainer(Path(sys.argv[2]), [case.CkptfmtCallback(sys.argv[3]), case.KillAt(4, hard=True)]).train()
"""


def trainer(out: Path, callbacks: list[Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    model = transformers.GPT2LMHeadModel(config)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


@pytest.mark.slow
def test_kill_and_resume_from_ckptfmt_is_bit_identical(tmp_path: Path) -> None:
    ckpt_root = tmp_path / "ckpt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # the killed run is independent of the uninterrupted one: it starts (mostly importing transformers) meanwhile
    with subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, __file__, str(tmp_path / "run"), str(ckpt_root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as killed:
        full = trainer(tmp_path / "full", [CkptfmtCallback(tmp_path / "full-ckpt", keep_hf_checkpoint=False)])
        full.train()
        _, killed_stderr = killed.communicate(timeout=600)
    assert sorted(os.listdir(tmp_path / "full-ckpt")) == ["checkpoint-3", "checkpoint-6"]
    assert not (tmp_path / "full" / "checkpoint-3").exists()  # keep_hf_checkpoint=False

    assert killed.returncode == -signal.SIGKILL, killed_stderr[-2000:]
    assert sorted(os.listdir(ckpt_root)) == ["checkpoint-3"]
    shutil.rmtree(tmp_path / "run")  # the Trainer's own checkpoints are gone: only ckptfmt is left
    report = ckptfmt.verify(ckpt_root / "checkpoint-3")
    assert report.ok, report

    resumed = trainer(tmp_path / "resumed", [], seed=1)
    resumed.train(resume_from_checkpoint=prepare_resume(ckpt_root / "checkpoint-3", tmp_path / "resume-dir"))
    assert resumed.state.global_step == STEPS
    expected = full.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with ckptfmt.open(tmp_path / "full-ckpt" / "checkpoint-6") as ckpt:
        for name, array in ckpt.read_tensors("optimizer").items():
            _, pid, key = name.split(".", 2)
            assert torch.equal(resumed.optimizer.state_dict()["state"][int(pid)][key], torch.from_numpy(array))
