"""torchtitan 0.3.0's trainer (``torchtitan.train.main``) on a CPU-only torch 2.13, for torchrun.

Run from torchrun with torchtitan's own arguments, e.g.
``torchrun --nproc-per-node 1 launch.py --module cpu_config --config llama3_debugmodel_cpu``.
Each patch below works around one error, named with the torchtitan file:line that raises or reaches it;
none touches the checkpoint path. They are applied before torchtitan's modules are imported.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "stubs"))  # an offline `datasets` (stubs/datasets), not installed
sys.path.insert(0, HERE)  # `--module cpu_config` and ckptfmt_titan

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _stub_tensorboard() -> None:
    """``No module named 'tensorboard'`` at components/metrics.py:15 (``from torch.utils.tensorboard import
    SummaryWriter``): tensorboard is not installed, and the debug config never enables it."""

    class SummaryWriter:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def add_scalar(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module


def _stub_triton_kernels() -> None:
    """``No module named 'triton'`` at distributed/minimal_async_ep/kernels.py:10, imported by every Decoder.
    That module only is stubbed (its kernels are GPU expert-parallel ones, unused here): a fake ``triton``
    package would break torch._inductor (``No module named 'triton.backends'``)."""

    class _Anything:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # used as a decorator (@triton.jit) at import time: hand the function back
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

    module = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    module.__getattr__ = _Anything().__getattr__  # type: ignore[method-assign]
    sys.modules[module.__name__] = module


def _alias_set_timeout() -> None:
    """``AttributeError: module 'torch.distributed' has no attribute 'set_timeout'`` at
    distributed/utils.py:595 after step 1: torchtitan 0.3.0 targets a torch newer than 2.13, which has the
    private form. A version gap, not a CPU one."""
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)  # type: ignore[attr-defined]


def _cpu_device() -> None:
    """``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'`` at trainer.py:301
    (``device_module.set_device``): tools/utils.py:55 falls back to ``device_type = ... or "cuda"`` when no
    accelerator is found. Point it at a CPU module with the calls torchtitan makes of it; the process group
    then uses gloo."""
    import torchtitan.tools.utils as titan_utils

    cpu = types.ModuleType("torchtitan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(cpu, name, getattr(torch.cpu, name))
    none = lambda *args, **kwargs: None  # noqa: E731
    cpu.get_device_name = lambda *args: "cpu"  # type: ignore[attr-defined]
    cpu.get_device_properties = lambda *args: types.SimpleNamespace(total_memory=64 << 30, name="cpu")  # type: ignore[attr-defined]
    cpu.memory_stats = lambda *args: {}  # type: ignore[attr-defined]
    cpu.reset_peak_memory_stats = none  # type: ignore[attr-defined]
    cpu.empty_cache = none  # type: ignore[attr-defined]
    # distributed/utils.py:586 barrier(device_ids=[device_module.current_device()]) needs an int
    cpu.current_device = lambda: 0  # type: ignore[attr-defined]
    memory = types.ModuleType("torchtitan_cpu_device.memory")
    memory.__getattr__ = lambda name: none  # type: ignore[method-assign]
    cpu.memory = memory  # type: ignore[attr-defined]
    titan_utils.device_type, titan_utils.device_module = "cpu", cpu


def _dense_flex_attention() -> None:
    """``NotImplementedError: FlexAttention does not support backward on CPU`` (torch's flex_attention.py:2083,
    from models/common/attention.py:331 FlexAttention.forward); ``attn_backend="sdpa"`` is refused
    (models/common/config_utils.py:99). Compute the same block-causal mask densely and run SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def forward(
        self: FlexAttention,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        score_mod: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the dense CPU attention takes neither score_mod nor out_transform")
        batch, length = q_BLNH.shape[0], q_BLNH.shape[1]
        mask = create_mask(attention_masks.mask_mod, batch, None, length, k_BLNH.shape[1], device=q_BLNH.device)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    FlexAttention.forward = forward  # type: ignore[method-assign]


def _gloo_gradient_sum() -> None:
    """2+ ranks only: ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``, after distributed/fsdp.py:41
    sets ``set_gradient_divide_factor(1.0)``. Force a plain SUM (then x1.0): the same arithmetic."""
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_gloo(self: FSDPModule, factor: float) -> None:
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_gloo  # type: ignore[method-assign]


def main() -> None:
    _stub_tensorboard()
    _stub_triton_kernels()
    _alias_set_timeout()
    if not torch.cuda.is_available():  # the rest are for a CPU-only machine
        _cpu_device()  # before anything imports device_type/device_module from tools.utils
        _dense_flex_attention()
        _gloo_gradient_sum()
    from torchtitan.train import main as train

    train()


if __name__ == "__main__":
    main()
