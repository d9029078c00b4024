# Sourced by the other scripts: a project venv in .venv with the package and its test extras installed.
# Installs non-editable (as users get it); torch is pinned in the extras, served from the machine's wheel.
# pip would byte-compile all 14,700 files on one core (40 s); scripts/precompile.py compiles the 3,500 that the
# processes import, by importing them, in the background: `wait "$PRECOMPILE_PID"` before starting processes
# that import torch (left to them, the suite's first few compiled torch at once, each).
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
python scripts/precompile.py "$1" &
PRECOMPILE_PID=$!
