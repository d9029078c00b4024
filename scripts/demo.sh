#!/usr/bin/env bash
# The main demo, on local disk (./story-out): train, get SIGKILLed, resume, `ckpt verify`, and `ckpt diff`
# against an uninterrupted run. The format demo (write, inspect, verify, reload) is examples/demo.py.
source "$(dirname "$0")/bootstrap.sh" test
wait "$PRECOMPILE_PID"
exec python examples/story.py "${1:-story-out}"
