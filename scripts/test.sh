#!/usr/bin/env bash
# The whole test suite, plus lint and type checks, on a fresh machine.
source "$(dirname "$0")/bootstrap.sh" dev
ruff check .
ruff format --check .
mypy
# plain pytest (not python -m pytest): the cwd must not shadow the installed package
exec pytest -q -p no:cacheprovider --durations=25 "$@"
