"""torchtitan's llama3 debug model, small enough for a CPU, checkpointing every 2 steps through ckptfmt.

``--module cpu_config --config llama3_debugmodel_cpu``. Assets (tokenizer, dataset) come from
``CKPTFMT_TITAN_ASSETS`` (default ``<venv>/titan-assets``, where scripts/torchtitan_env.sh builds them); the rest
is overridden on the command line as with any torchtitan config (``--dump-folder``, ``--training.steps``).
"""

from __future__ import annotations

import os
import sys

from ckptfmt_titan import CkptfmtCheckpointManager
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer


def llama3_debugmodel_cpu() -> Trainer.Config:
    config = llama3_debugmodel()
    assets = os.environ.get("CKPTFMT_TITAN_ASSETS", os.path.join(sys.prefix, "titan-assets"))
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "c4_test")
    # "flex", made dense on CPU by launch.py: "sdpa" is refused for language models
    config.model_spec = model_registry("debugmodel", attn_backend="flex")
    config.validator.enable = False
    config.training.seq_len = 128
    config.training.local_batch_size = 2
    config.training.steps = 4
    config.checkpoint = CkptfmtCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, last_save_model_only=False
    )
    # bit-identical resumes need the same seed and deterministic kernels
    config.debug.seed = 0
    config.debug.deterministic = True
    return config
