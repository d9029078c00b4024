#!/usr/bin/env bash
# The whole test suite, plus lint and type checks, on a fresh machine.
#   bash scripts/test.sh              what CI runs (.ci/run)
#   bash scripts/test.sh ARGS...      lint, then one pytest run with ARGS (e.g. tests/test_reader.py -k slice)
# Either fails if a process that the tests started is still running after them (check_no_survivors).
source "$(dirname "$0")/bootstrap.sh" dev
ruff check .
ruff format --check .

# No process that the run starts may outlive it. Each carries this marker in its environment (inherited, and kept
# by a fork or exec that does not replace the environment); once every run has finished, any process still
# carrying it fails the run, is listed and is killed. The scan uses only builtins: it forks nothing that would
# carry the marker itself, and skips this shell.
CKPTFMT_TEST_RUN="$(cat /proc/sys/kernel/random/uuid)"
export CKPTFMT_TEST_RUN
survivors=()
find_survivors() {
  survivors=()
  local dir pid var
  for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    [ "$pid" != "$$" ] || continue
    while IFS= read -r -d '' var; do
      if [ "$var" = "CKPTFMT_TEST_RUN=$CKPTFMT_TEST_RUN" ]; then
        survivors+=("$pid")
        break
      fi
    done 2>/dev/null <"$dir/environ" || true
  done
}
# Fails (status 1) if a process of the run is still alive 5 s after the last one ended (a process that was killed
# or asked to exit may take a moment to go); lists each with its parent and command line, and SIGKILLs it.
check_no_survivors() {
  local tries=50 pid
  find_survivors
  while [ "${#survivors[@]}" -gt 0 ] && [ "$tries" -gt 0 ]; do
    sleep 0.1
    tries=$((tries - 1))
    find_survivors
  done
  [ "${#survivors[@]}" -gt 0 ] || return 0
  echo "FAILED: ${#survivors[@]} process(es) started by the tests outlived them (killed now):" >&2
  for pid in "${survivors[@]}"; do
    echo "  pid $pid, parent $(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null):" \
      "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-300)" >&2
  done
  kill -KILL "${survivors[@]}" 2>/dev/null || true
  return 1
}

# plain pytest (not python -m pytest): the cwd must not shadow the installed package
if [ "$#" -gt 0 ]; then
  mypy
  wait "$PRECOMPILE_PID"
  status=0
  pytest -q -p no:cacheprovider "$@" || status=$?
  check_no_survivors || status=$((status > 0 ? status : 1))
  exit "$status"
fi
# Everything else at once, on CI's 2 cores: mypy (one core, 12 s; beside the precompile), the single-process tests on
# CKPTFMT_TEST_WORKERS pytest-xdist workers (default 2; 3 was slower), and beside them the multi-process end-to-end
# tests (`slow`) one module at a time, then the fuzz targets. Each run alone left part of the machine idle
# (waiting on fsyncs, on subprocesses starting, on the other worker's last test): one after the other they took
# 330 + 349 s, together 601 s.
# The processes use no numpy BLAS: OpenBLAS would start a spinning thread per core in every process that imports
# numpy (0.1 s of CPU each; 23 of the whole conformance run's 99 CPU-seconds).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
logs="$(mktemp -d)"
# torchtitan's own trainer through ckptfmt's DCP layer (tests/test_torchtitan.py): a venv of its pinned packages over
# this one's torch, made once (about 10 s), beside the others; the test itself is in the slow lane (about 45 s)
if [ -z "${CKPTFMT_TORCHTITAN:-}" ]; then
  bash scripts/torchtitan_env.sh "$ROOT/.venv-torchtitan" >"$logs/torchtitan-env" 2>&1 \
    && export CKPTFMT_TORCHTITAN="$ROOT/.venv-torchtitan/bin/python" || cat "$logs/torchtitan-env"
fi
mypy >"$logs/mypy" 2>&1 &
mypy_pid=$!
wait "$PRECOMPILE_PID"  # beside mypy: bytecode for what the tests import, before they start at once
# The fuzz targets (about 130 CPU-seconds of one core, CPU-bound) run after the slow tests, in their run: beside
# the single-process half that run finished minutes sooner and left a core idle (12 min 28 s in all, the halves
# 660 s and 404 s).
fuzz=tests/test_fuzz.py
(
  code=0
  pytest -q -p no:cacheprovider -m slow --durations=15 || code=$?
  pytest -q -p no:cacheprovider -m "not slow" --durations=5 "$fuzz" || code=$((code > 0 ? code : 1))
  exit "$code"
) >"$logs/slow" 2>&1 &
slow_pid=$!
status=0
pytest -q -p no:cacheprovider -m "not slow" -n "${CKPTFMT_TEST_WORKERS:-2}" --ignore="$fuzz" --durations=15 || status=$?
wait "$mypy_pid" || status=$((status > 0 ? status : 1))
cat "$logs/mypy"
wait "$slow_pid" || status=$((status > 0 ? status : 1))
cat "$logs/slow"
rm -rf "$logs"
check_no_survivors || status=$((status > 0 ? status : 1))
exit "$status"
