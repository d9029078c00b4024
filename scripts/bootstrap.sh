# Sourced by the other scripts: a project venv in .venv with the package and its test extras installed.
# Installs non-editable (as users get it); torch is pinned in the extras, served from the machine's wheel.
# pip byte-compiles on one core (40 of a fresh install's 60 s); compileall on every core does the same in 20 s and
# skips what is up to date. (Left to import time instead, each of the suite's first processes compiled torch again.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFMT_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet --no-compile "$ROOT[$1]"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true  # pip too ignores files that do not compile
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
