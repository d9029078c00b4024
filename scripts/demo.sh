#!/usr/bin/env bash
# The main job: write, inspect, verify and reload a realistic checkpoint on local disk (./demo-out).
source "$(dirname "$0")/bootstrap.sh" test
exec python examples/demo.py "${1:-demo-out}"
