# Sourced by the other scripts: a project venv in .venv with the package and its test extras installed.
# Installs non-editable (as users get it); torch is pinned in the extras, served from the machine's wheel.
# --no-compile: byte-compiling every installed module (torch, transformers, ...) took 40 of a fresh install's 60 s;
# Python compiles the few modules a run imports on first use and caches them in the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFMT_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet --no-compile "$ROOT[$1]"
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
