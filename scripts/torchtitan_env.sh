#!/usr/bin/env bash
# A scratch venv for examples/torchtitan and tests/test_torchtitan.py: torchtitan 0.3.0 over the project's own
# torch and ckptfmt. Usage: scripts/torchtitan_env.sh [VENV] (default /tmp/ckptfmt-torchtitan-venv). Idempotent.
#
# - The project venv's site-packages come in through a .pth file (site.addsitedir):
#   `venv --system-site-packages` would show pyenv's site-packages instead, without torch (.venv/bin/python is
#   a symlink to the base interpreter).
# - --no-deps: torchtitan 0.3.0 requires torch_checkpointing>=0.1, which requires torch>=2.11 and would replace
#   the project's torch; datasets, tensorboard and wandb are not needed (examples/torchtitan/stubs, launch.py).
# - The wheel has none of the assets its debug config reads (tests/assets/ in its repository):
#   make_assets.py builds offline stand-ins in VENV/titan-assets, where cpu_config.py looks by default.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-/tmp/ckptfmt-torchtitan-venv}"
PROJECT_PY="${CKPTFMT_VENV:-$ROOT/.venv}/bin/python"
PINNED=(
  torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 einops==0.8.2
  docstring-parser==0.17.0 typeguard==4.4.4
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PROJECT_PY" -m venv "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir, not a bare path line: the project's own .pth files (an editable ckptfmt's) must run too
"$PROJECT_PY" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
  > "$SITE/_ckptfmt_project.pth"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${PINNED[@]}"
if [ ! -f "$VENV/titan-assets/tokenizer/tokenizer.json" ]; then
  "$VENV/bin/python" "$ROOT/examples/torchtitan/make_assets.py" "$VENV/titan-assets"
fi
"$VENV/bin/python" -c 'import torch, torchtitan, ckptfmt.dcp; print("torch", torch.__version__, "torchtitan", torchtitan.__version__)'
echo "ready: CKPTFMT_TORCHTITAN=$VENV/bin/python"
