#!/usr/bin/env bash
# The whole test suite, plus lint and type checks, on a fresh machine.
#   bash scripts/test.sh              what CI runs (.ci/run)
#   bash scripts/test.sh ARGS...      lint, then one pytest run with ARGS (e.g. tests/test_reader.py -k slice)
source "$(dirname "$0")/bootstrap.sh" dev
ruff check .
ruff format --check .
# plain pytest (not python -m pytest): the cwd must not shadow the installed package
if [ "$#" -gt 0 ]; then
  mypy
  exec pytest -q -p no:cacheprovider "$@"
fi
# mypy (one core, 12 s) runs beside the first pytest run, which leaves part of a core idle; its verdict counts
mypy_log="$(mktemp)"
mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Two runs, together the whole suite: the single-process tests on CKPTFMT_TEST_WORKERS pytest-xdist workers
# (default 2, CI's cores: they leave a core idle on their own, 427 s -> 284 s here), then the multi-process
# end-to-end tests (`slow`) one at a time, as each already keeps both cores busy with its ranks.
status=0
pytest -q -p no:cacheprovider -m "not slow" -n "${CKPTFMT_TEST_WORKERS:-2}" --durations=15 || status=$?
wait "$mypy_pid" || status=$((status > 0 ? status : 1))
cat "$mypy_log"
rm -f "$mypy_log"
pytest -q -p no:cacheprovider -m slow --durations=15 || status=$((status > 0 ? status : $?))
exit "$status"
