"""Byte-compile what the project's processes import, by importing it once (scripts/bootstrap.sh).

A fresh venv has no bytecode. ``compileall`` of all of site-packages compiles 14,700 files (transformers' every
model, sympy, cfn-lint) to use about 3,500: 46 s on CI's 2 cores. Importing the modules the demo, the tests and
their subprocesses use compiles exactly those, in 25-30 s of one core, while the other runs mypy. Left to the
processes themselves, the suite's first few would each compile torch at once (and with PYTHONDONTWRITEBYTECODE
set, every process would, every time). A module missing from the list is compiled by the first process that
imports it.

    python scripts/precompile.py core|test|dev
"""

from __future__ import annotations

import importlib
import sys

CORE = [
    "numpy",
    "ml_dtypes",
    "safetensors",
    "msgpack",
    "zstandard",
    "fsspec",
    "click",
    "xxhash",
    "ckptfmt",
    "ckptfmt.cli",
]
TORCH = [
    "torch",
    "torch._dynamo",  # an optimizer's constructor imports it
    "torch.distributed.run",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
    "ckptfmt.torch",
]
DEV = [
    *TORCH,
    "torchdata.stateful_dataloader",
    "ckptfmt.integrations",
    "transformers",
    "transformers.trainer",
    "pytorch_lightning",
    "accelerate",
    "huggingface_hub",
    "s3fs",
    "boto3",
    "moto.server",
    "moto.s3.responses",
    "jsonschema",
    "hypothesis",
    "pytest",
    "xdist",
    "click.testing",
]


def main(which: str) -> int:
    sys.dont_write_bytecode = False  # the point of this script, whatever PYTHONDONTWRITEBYTECODE says
    for name in CORE + (DEV if which in ("dev", "test") else []):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            pass  # an extra this install does not have (the demo's has no integrations): nothing to compile
        except Exception as exc:  # compiled as far as it got; the process that needs it will say what is wrong
            print(f"precompile: {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "core"))
